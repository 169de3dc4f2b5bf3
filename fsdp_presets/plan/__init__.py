"""From a model to an accelerate config: profile, plan, preset, emit, check and rehearse.

Flow: ``profile`` (the model on the meta device) -> ``planner`` (memory and communication per
strategy) -> ``presets`` (decisions with reasons) -> ``emit`` (accelerate's YAML, built from the
key table in ``schema``) and ``check`` (rules for a config someone already has). ``rehearsal``
runs one real step at full size on fake tensors to check the planner.

This package never imports :mod:`fsdp_presets.train` or :mod:`fsdp_presets.checkpoint`.
"""
