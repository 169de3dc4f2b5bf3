"""Measuring a model: one real training step at full size on fake tensors and a fake process
group, through accelerate's own preparation, measured by torch's FSDP memory tracker
(``rehearsal``). The planner composes its figures from these measurements; what
``fsdp-presets rehearse`` runs for a preset or a model is :mod:`fsdp_presets.preset.rehearse_request`."""
