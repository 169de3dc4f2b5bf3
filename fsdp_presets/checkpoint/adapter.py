"""A LoRA (trainable-only) checkpoint: what it saves and loads, and the PEFT adapter folder
``fsdp-presets export`` writes from it.

A LoRA run saves only the trainable weights and their optimizer state (DCP, every rank its shard:
``adapter_model_0/`` and ``adapter_optimizer_0/``; :class:`TrainableState`), with accelerate's
scheduler and random states; the frozen base is reloaded from ``--model`` (``accelerate
load_state`` cannot read 4-bit quantization-state keys anyway). DCP reshards on load, so a run
resumes at another process count, and even under another strategy; it is read back through the
safe DCP reader. Beside it the checkpoint's ``model_config/`` holds ``adapter_config.json`` and
``adapter_keys.json`` (checkpoint tensor name -> key in a PEFT ``adapter_model.safetensors``:
:func:`write_adapter_files`, :func:`read_adapter_keys`, the one writer and reader of that file),
so the checkpoint alone is enough to write the adapter folder.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Callable

from fsdp_presets.checkpoint.layout import (ADAPTER_CONFIG, ADAPTER_KEYS, ADAPTER_MODEL, ADAPTER_OPTIMIZER,
                                            ADAPTER_WEIGHTS, DCP_METADATA, MODEL_CONFIG)
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
    keys, adapter_config = read_adapter_keys(checkpoint)
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


def write_adapter_files(folder: Path, lora: dict[str, Any], key_map: dict[str, str], adapter_config) -> None:
    """Into a checkpoint's model_config/ (main process): adapter_config.json (peft's config object)
    and adapter_keys.json (the method and shape, and the key map), so ``fsdp-presets export`` writes
    a PEFT folder from the checkpoint alone."""
    target = Path(folder) / MODEL_CONFIG
    target.mkdir(parents=True, exist_ok=True)
    adapter_config.save_pretrained(str(target))
    (target / ADAPTER_KEYS).write_text(json.dumps({"lora": lora, "keys": key_map}, indent=1, sort_keys=True))


def read_adapter_keys(checkpoint: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """``(keys, adapter_config)`` of a LoRA checkpoint: its adapter_keys.json key map (every name
    and key a dotted identifier of at most 500 characters) and its parsed adapter_config.json;
    :class:`UsageError` when either is missing or malformed."""
    config_dir = Path(checkpoint) / MODEL_CONFIG
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
    return keys, adapter_config


# ---- save and load ----
def trainable_names(model) -> set[str]:
    """The state-dict names of the trainable parameters of ``model`` (FSDP-wrapped or not)."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    names: set[str] = set()
    for name, param in model.named_parameters():
        if param.requires_grad:
            names.update(_get_fqns(model, name))
    return names


def trainable_options(**kwargs):
    """torch state-dict options that leave the frozen parameters out."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, **kwargs)


def _inner(optimizer):
    return getattr(optimizer, "optimizer", optimizer)


def _trainable_state(model, optimizer):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, _inner(optimizer), options=trainable_options())
    keep = trainable_names(model)
    return {name: value for name, value in model_state.items() if name in keep}, optimizer_state


class TrainableState:
    """What a LoRA checkpoint saves and loads in place of ``accelerator.save_state``: trainable
    weights and their optimizer state as DCP, plus accelerate's scheduler and random states."""

    def __init__(self, accelerator, model, optimizer) -> None:
        self.accelerator, self.model, self.optimizer = accelerator, model, optimizer

    def _without_model_and_optimizer(self, action: Callable[[], Any]) -> None:
        accelerator = self.accelerator
        models, optimizers = accelerator._models, accelerator._optimizers
        accelerator._models, accelerator._optimizers = [], []
        try:
            action()
        finally:
            accelerator._models, accelerator._optimizers = models, optimizers

    def save(self, folder: Path) -> None:
        import torch.distributed.checkpoint as dcp

        model_state, optimizer_state = _trainable_state(self.model, self.optimizer)
        for name, state in ((ADAPTER_MODEL, {"model": model_state}), (ADAPTER_OPTIMIZER, {"optimizer": optimizer_state})):
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(Path(folder) / name)),
                     no_dist=self.accelerator.num_processes == 1)
        self._without_model_and_optimizer(lambda: self.accelerator.save_state(str(folder)))

    def load(self, folder: Path) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        from fsdp_presets.checkpoint.safe_unpickle import safe_dcp_load, safe_dcp_loading

        folder = Path(folder)
        for name in (ADAPTER_MODEL, ADAPTER_OPTIMIZER):
            if not (folder / name / DCP_METADATA).is_file():
                raise UsageError(f"--resume {folder}: no {name}/ in it, so it is not a LoRA checkpoint; give a "
                                 "checkpoint of a LoRA run with the same --lora-* flags, or train without them")
        model_state, optimizer_state = _trainable_state(self.model, self.optimizer)
        saved = _saved_shapes(folder / ADAPTER_MODEL)
        if set(saved) != set(model_state):
            missing, extra = sorted(set(model_state) - set(saved)), sorted(set(saved) - set(model_state))
            raise UsageError(f"--resume {folder}: its adapter does not match this run's (missing {missing[:3]}, "
                             f"extra {extra[:3]}); resume with the --lora-* flags of the run that saved it")
        other = sorted(name for name, value in model_state.items() if tuple(value.shape) != saved[name])
        if other:
            raise UsageError(f"--resume {folder}: its adapter has other shapes ({other[0]}: {saved[other[0]]} there, "
                             f"{tuple(model_state[other[0]].shape)} now); resume with the --lora-r of the run that "
                             "saved it")
        single = self.accelerator.num_processes == 1
        safe_dcp_load({"model": model_state}, folder / ADAPTER_MODEL, no_dist=single)
        safe_dcp_load({"optimizer": optimizer_state}, folder / ADAPTER_OPTIMIZER, no_dist=single)
        set_state_dict(self.model, _inner(self.optimizer), model_state_dict=model_state,
                       optim_state_dict=optimizer_state, options=trainable_options(strict=False))
        with safe_dcp_loading():
            self._without_model_and_optimizer(lambda: self.accelerator.load_state(str(folder)))


def _saved_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    from fsdp_presets.checkpoint.files import DcpReader

    return {name: tuple(info.shape) for name, info in DcpReader(folder).entries().items()}
