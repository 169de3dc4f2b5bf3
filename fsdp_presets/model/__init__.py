"""What a model is: the family registry, the config, the model built on the meta device, its profile.

``model_loading`` reads a config (a family name, a folder or a ``config.json``) and builds the model
on the meta device; ``profile`` reads off it the blocks, units, embeddings, norms, head and tied
weights (``model_profile`` holds the types); ``family``, ``families_decoders`` and ``families`` are the
registry, one entry per family. No weights are loaded and no memory is planned here.
"""
