"""A LoRA (trainable-only) checkpoint as a PEFT adapter folder, for ``fsdp-presets export``.

A LoRA recipe run (:mod:`fsdp_presets.train.lora`) saves its trainable weights as DCP in
``adapter_model_0/`` and writes ``model_config/adapter_config.json`` and
``model_config/adapter_keys.json`` (checkpoint tensor name -> key in a PEFT
``adapter_model.safetensors``), so the checkpoint alone is enough to write the adapter folder.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Callable

from fsdp_presets.checkpoint.layout import ADAPTER_CONFIG, ADAPTER_KEYS, ADAPTER_MODEL, ADAPTER_WEIGHTS, MODEL_CONFIG
from fsdp_presets.errors import UsageError

_KEY = re.compile(r"^[A-Za-z0-9_.]{1,500}$")
"""A tensor name or PEFT key read from adapter_keys.json: dotted identifiers, nothing else."""


def is_adapter_checkpoint(folder: str | os.PathLike) -> bool:
    """True for a checkpoint of a LoRA run (trainable weights only)."""
    return (Path(folder) / ADAPTER_MODEL).is_dir()


def export_checkpoint_adapter(checkpoint: Path, staging: Path, *, dtype: str,
                              log: Callable[[str], None] = print) -> tuple[int, int]:
    """Write a PEFT folder from a LoRA checkpoint (already verified) into ``staging``: returns
    (tensors, bytes). Key names come from the checkpoint's model_config/adapter_keys.json. Nothing
    is copied: the adapter config is written from its parsed dict, the tokenizer by transformers
    from the tokenizer it loads (without remote code) out of model_config/."""
    import torch
    from safetensors.torch import save_file

    from fsdp_presets.checkpoint.files import DcpReader

    config_dir = checkpoint / MODEL_CONFIG
    try:
        record = json.loads((config_dir / ADAPTER_KEYS).read_text())
        keys = record["keys"]
        adapter_config = json.loads((config_dir / ADAPTER_CONFIG).read_text())
        if not isinstance(keys, dict) or not isinstance(adapter_config, dict):
            raise ValueError("not an object")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UsageError(f"{checkpoint}: {MODEL_CONFIG}/{ADAPTER_KEYS} or {ADAPTER_CONFIG} missing or unreadable "
                         f"({error}); the checkpoint was not written by a LoRA run of the recipes") from None
    for name, key in keys.items():
        if not (isinstance(name, str) and isinstance(key, str) and _KEY.match(name) and _KEY.match(key)):
            raise UsageError(f"{checkpoint}: {MODEL_CONFIG}/{ADAPTER_KEYS} holds a key that is not a tensor name")
    reader = DcpReader(checkpoint / ADAPTER_MODEL)
    entries = reader.entries()
    unknown = sorted(set(entries) - set(keys))
    if unknown:
        raise UsageError(f"{checkpoint}: tensors {unknown[:3]} have no PEFT name in {MODEL_CONFIG}/{ADAPTER_KEYS}")
    target = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    tensors = {keys[name]: tensor.to(target).contiguous() for name, tensor in reader.read(sorted(entries)).items()}
    staging.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(staging / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (staging / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2, sort_keys=True))
    _write_tokenizer(config_dir, staging, log)
    return len(tensors), sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())


def _write_tokenizer(config_dir: Path, staging: Path, log: Callable[[str], None]) -> None:
    """The tokenizer of ``config_dir`` saved by transformers into ``staging`` (no remote code)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(config_dir, trust_remote_code=False)
    except Exception as error:
        log(f"export: no tokenizer written: none loads from {config_dir} without running its code "
            f"({type(error).__name__})")
        return
    tokenizer.save_pretrained(staging)
