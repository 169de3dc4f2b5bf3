"""From a model to an accelerate config: profile, plan, preset, emit, check and rehearse.

Flow: ``profile`` (the model on the meta device) -> ``planner`` (memory and communication per
strategy) -> ``presets`` (decisions with reasons) -> ``emit`` (accelerate's YAML, built from the
key table in ``schema``) and ``check`` (rules for a config someone already has). ``rehearsal``
runs one real step at full size on fake tensors to check the planner.

Where each stage's pieces are: the model, ``model_loading`` (config, meta-device build),
``model_profile`` (the types) and ``profile`` (reading the built model); the registry, ``family``,
``families_decoders`` and ``families``; the planner's inputs ``shapes`` (Hardware, TrainingShape,
LoraShape), its terms ``model_state``, ``activations``, ``communication`` and ``lora_memory``, its
``results``, with ``planner`` ranking the strategies (and re-exporting the rest); the request
(``request``), the decisions (``choices``) and ``presets`` deciding them; ``generate`` renders,
rescales and writes files; ``rehearse_request`` is what ``fsdp-presets rehearse`` runs; ``tables``
formats the commands' text tables.

This package never imports :mod:`fsdp_presets.train` or :mod:`fsdp_presets.checkpoint`.
"""
