"""What a recipe launched by ``accelerate launch`` uses: one object from launch to export that
holds everything a recipe does besides its model, data and loss (``recipe``), the loop pieces
it is made of (``loop``), data, metrics and plots, start-up agreement of the ranks
(``startup``), Ctrl-C and preemption with the exit statuses (``signals``), LoRA/QLoRA (``lora``) and the final Hugging Face folder
(``final_model``).

Checkpoints are :mod:`fsdp_presets.checkpoint`'s; this package uses it, never the reverse.
"""
