"""Launching a run: the launch scripts ``generate --launcher`` and ``fsdp-presets launcher`` write
(``launchers``: slurm, torchrun, accelerate; ``options``: their flags), local multi-process launches
(``local``: a free port, an ``accelerate launch`` command), and shell/comment quoting (``quoting``)."""
