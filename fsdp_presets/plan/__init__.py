"""What a training step costs per GPU: memory and communication for each strategy.

The planner's inputs are ``shapes`` (Hardware, TrainingShape, LoraShape); its terms are
``model_state`` (parameters, gradients, optimizer state), ``activations``, ``communication`` and
``lora_memory``; ``results`` holds what it returns and ``planner`` ranks the strategies. ``methods``
are the training-method flags (full, LoRA, QLoRA), ``diagram`` and ``tables`` format plans as text.
The model comes from :mod:`fsdp_presets.model`; nothing here decides a preset or writes a file.
"""
