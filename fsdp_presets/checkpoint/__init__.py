"""Checkpoints and run folders on disk: ``layout`` names every file and folder and the path rules,
``manifest`` says what a checkpoint holds (kind, format, digests), ``verify`` says whether a
checkpoint may be used (read-only), ``manager`` saves, rotates, finds and loads checkpoints, ``resume`` continues one at another process count or from an import,
``inspect`` reports, ``export``, ``import_hf``, ``hf_model``, ``outputs`` and ``adapter`` move
between DCP and a Hugging Face or PEFT folder, ``safe_unpickle`` reads what a checkpoint from
elsewhere holds without running its code.

This package imports none of the config stages (model, rehearse, plan, preset, check).

Recipe checkpoint <-> Hugging Face folder, offline, in one process, without a GPU.

**Export** (:func:`export_checkpoint`): the model weights of a checkpoint (DCP shards, a full
``pytorch_model_fsdp.bin`` or a DDP ``model.safetensors``) become a folder that plain
``from_pretrained`` loads: ``config.json`` (with the written dtype), ``generation_config.json``,
the tokenizer files, and safetensors shards with ``model.safetensors.index.json`` when there is
more than one. The config and tokenizer come from the checkpoint's ``model_config/`` (the recipes
save them into every checkpoint), else from the ``model`` recorded in the run's ``run.json``, else
from ``--model``.

How it is written, and what it holds in memory: the output shards are planned from the tensor
shapes alone (``huggingface_hub.split_torch_state_dict_into_shards`` on meta tensors, the helper
``save_pretrained`` uses), tied weights are dropped by transformers' own
``remove_tied_weights_from_state_dict`` (the embedding is written once and the config says it is
tied), then each output shard is read (:mod:`fsdp_presets.checkpoint.files`: DCP reads only the
byte ranges of that shard's tensors), cast, written with ``safetensors`` and freed. Peak memory
is therefore about one output shard (``--max-shard-size``) plus the largest tensor, whatever the
model size. Models whose transformers class renames or fuses weights on load (a "weight
conversion", e.g. some mixture-of-experts models) are instead loaded whole and written by
``save_pretrained``, which reverts the conversion; the report says which path was taken.

**Import** (:func:`import_hf`): a Hugging Face folder (safetensors, or legacy
``pytorch_model.bin`` loaded with ``weights_only=True``) becomes a checkpoint folder of the
``dcp`` layout with model weights only (fp32, as the recipes train), a ``model_config/`` and a
manifest with ``"kind": "imported"``, step 0 and 0 samples: a recipe given ``--resume`` of it
loads the weights at any process count and starts with a fresh optimizer (see
:mod:`fsdp_presets.checkpoint.resume`). The import holds the model once in memory (DCP writes one state
dict in one pass).

**Verify** (:func:`verify_export`, :func:`verify_import`): both sides are loaded into the model
class and run on one fixed batch in fp32; the largest logit difference, relative to the largest
logit, must stay under :data:`VERIFY_TOLERANCE` of the written dtype.

Where each part lives: :mod:`~fsdp_presets.checkpoint.export` and
:mod:`~fsdp_presets.checkpoint.import_hf` (the two directions), :mod:`~fsdp_presets.checkpoint.hf_model`
(the model's config, tokenizer, expected tensors and the ``--verify`` comparison),
:mod:`~fsdp_presets.checkpoint.outputs` (output folders).

Every input is checked before anything is written (manifest checksums, DCP shard sizes, config
digest, tensor names and shapes), and output goes to a hidden sibling folder that is renamed into
place only when complete, so a failure leaves no output.
"""

