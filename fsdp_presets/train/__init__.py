"""What a recipe launched by ``accelerate launch`` uses: one object from launch to export that
holds everything a recipe does besides its model, data and loss (``recipe``), the loop pieces
it is made of (``loop``), data, metrics and plots, start-up agreement of the ranks
(``startup``), Ctrl-C and preemption with the exit statuses (``signals``), the model every run
loads and prepares (``model_setup``), LoRA/QLoRA (``lora``), the final Hugging Face folder
(``final_model``) and a LoRA run's adapter folders (``final_adapter``); and what a user's own
Trainer script gets from ``FSDPPresetsCallback`` (``trainer_callback``, ``trainer_saves``).

Checkpoints are :mod:`fsdp_presets.checkpoint`'s; this package uses it, never the reverse.
"""
