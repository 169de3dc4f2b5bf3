"""One real training step at full size on fake tensors and a fake process group, through
accelerate's own preparation, measured by torch's FSDP memory tracker (``rehearsal``), and what
``fsdp-presets rehearse`` runs for a model or a config (``request``)."""
