"""What a training step costs per GPU: memory and communication for each strategy.

The planner's inputs are ``shapes`` (Hardware, TrainingShape, LoraShape); its terms are
``model_state`` (parameters, gradients, optimizer state), ``activations``, ``communication`` and
``lora_memory``, and ``step_time`` on a GPU type of ``gpus``; ``results`` holds what it returns,
``planner`` ranks the strategies and ``fastest`` searches micro-batch and checkpointing too. ``methods``
are the training-method flags (full, LoRA, QLoRA), ``diagram`` and ``tables`` format plans as text.
The model comes from :mod:`fsdp_presets.model`; nothing here decides a preset or writes a file.
"""
