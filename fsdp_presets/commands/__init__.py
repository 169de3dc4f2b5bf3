"""One module per ``fsdp-presets`` subcommand.

Each module defines ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``.
Module top levels import only the standard library so that ``fsdp-presets --help`` is instant;
heavy imports (torch, transformers) happen inside ``run``.
"""

# Order here is the order in `fsdp-presets --help`. Adding a command is adding its module name.
COMMANDS: tuple[str, ...] = ("inspect", "plan", "generate", "check", "rehearse", "compare", "launcher", "export", "import_", "inspect_checkpoint")
