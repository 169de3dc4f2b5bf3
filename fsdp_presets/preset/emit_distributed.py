"""``NAME.distributed.json``: a preset's TP/EP mesh as transformers' ``DistributedConfig`` arguments,
written by ``generate --tp N`` / ``--ep N`` beside the accelerate config::

    {
      "fsdp_presets": {"about": ["FSDP 8 x TP 8 of ...", ...], "metadata": {...}},
      "dp_replicate_size": 1, "fsdp_size": 8, "tp_size": 8, "ep_size": 1,
      "fsdp_mixed_precision": true, "fsdp_cpu_offload": false
    }

Every key but ``fsdp_presets`` is an argument of ``DistributedConfig``, whose own loader reads the
file as it is (``DistributedConfig.from_dict`` keeps the keys it knows)::

    config = DistributedConfig.from_dict(json.load(open("NAME.distributed.json")))
    model = AutoModelForCausalLM.from_pretrained(MODEL, distributed_config=config)

``fsdp_presets`` holds what a YAML preset's header says (JSON has no comments) and the same
metadata document, so ``generate`` knows the file as its own and regenerates it.
"""

from __future__ import annotations

import json
from pathlib import Path

HEADER_KEY = "fsdp_presets"
"""The key of the header and metadata (not a ``DistributedConfig`` argument)."""
SUFFIX = ".distributed.json"
TRAINER_SUFFIX = ".trainer.yaml"
"""The accelerate config a Trainer script launches with on the mesh (:func:`trainer_config_path`)."""


def distributed_config_path(output: str) -> str:
    """``runs/llama.yaml`` -> ``runs/llama.distributed.json``."""
    path = Path(output)
    return str(path.with_name(path.stem + SUFFIX))


def trainer_config_path(output: str) -> str:
    """``runs/llama.yaml`` -> ``runs/llama.trainer.yaml``: the DDP-type config with every rank of the
    mesh that a ``transformers.Trainer`` script launches with (the Trainer takes a model sharded at
    load time as it is and prepares its optimizer alone, which accelerate refuses under FSDP)."""
    path = Path(output)
    return str(path.with_name(path.stem + TRAINER_SUFFIX))


def distributed_arguments(preset) -> dict:
    """``DistributedConfig``'s arguments of ``preset``: the mesh's sizes, mixed precision (transformers'
    policy: bf16 parameters, fp32 reduction) and CPU offload."""
    return {**preset.parallelism.distributed_config(),
            "fsdp_mixed_precision": preset.precision.mixed_precision != "no",
            "fsdp_cpu_offload": preset.savers.offload}


def render_distributed_config(preset, *, config_file: str, about: list[str], metadata: dict) -> str:
    """The JSON text: ``about`` (the header's lines, without ``#``) and ``metadata`` under
    :data:`HEADER_KEY`, then the arguments."""
    document = {HEADER_KEY: {"about": about, "config": config_file, "metadata": metadata},
                **distributed_arguments(preset)}
    return json.dumps(document, indent=2) + "\n"


def read_distributed_metadata(text: str) -> dict | None:
    """The metadata document of a file :func:`render_distributed_config` wrote, None for any other text."""
    try:
        document = json.loads(text)
    except ValueError:
        return None
    header = document.get(HEADER_KEY) if isinstance(document, dict) else None
    metadata = header.get("metadata") if isinstance(header, dict) else None
    return metadata if isinstance(metadata, dict) else None


def load_distributed_config(path):
    """``path`` through transformers' own loader (``DistributedConfig.from_dict``), the sizes it
    resolved checked against the file's: ValueError when they differ (a key it did not take)."""
    from transformers.distributed.configuration_utils import DistributedConfig

    from fsdp_presets.fileio import CONFIG_MAX_BYTES, read_regular_text

    document = json.loads(read_regular_text(path, limit=CONFIG_MAX_BYTES))  # not a FIFO, not 1 GB
    config = DistributedConfig.from_dict(document)
    resolved = config.to_dict()
    differing = {key: (value, resolved.get(key)) for key, value in document.items()
                 if key != HEADER_KEY and resolved.get(key) != value}
    if differing:
        raise ValueError(f"DistributedConfig does not take {path} as written: {differing}")
    return config


def recipes_refuse(config) -> str | None:
    """Why the recipes do not train the mesh of ``config`` (a :func:`load_distributed_config`), or None:
    pipeline stages, or no data-parallel ranks (transformers applies FSDP2 only when the mesh has
    them; a model it leaves unsharded would be wrapped by accelerate's FSDP2 over the TP ranks, and
    ``fully_shard`` of TP DTensors on the whole world fails: "Invariant encountered")."""
    if int(config.pp_size) != 1:
        return f"pp_size {config.pp_size}: the recipes do not run pipeline stages; set it to 1"
    if int(config.dp_size) == 1:
        return (f"fsdp_size 1 x tp_size {config.tp_size} has no data-parallel ranks, and the recipes train FSDP2 "
                "meshes (at least 2 FSDP ranks)")
    return None


__all__ = ["HEADER_KEY", "SUFFIX", "TRAINER_SUFFIX", "distributed_arguments", "distributed_config_path",
           "load_distributed_config", "recipes_refuse", "trainer_config_path",
           "read_distributed_metadata", "render_distributed_config"]
