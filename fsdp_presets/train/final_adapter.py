"""A LoRA run's trained model handed back: the PEFT adapter folder (``final/``), and with
``--export-merged`` the base with the adapter merged in (``merged/``), a plain Hugging Face folder.

The trainable weights are gathered with torch's ``get_model_state_dict(full_state_dict=True,
ignore_frozen_params=True)`` (``cpu_offload`` off under FSDP1, where it fails on rank 1) and written
under the key names peft gave them before FSDP wrapped the model
(:func:`fsdp_presets.train.lora.adapter_key_map`): peft would otherwise build key names from the
FSDP1-wrapped module tree and write zeros. The merged folder merges into the base reloaded in fp32
(QLoRA: into the dequantized 4-bit base; merging into the 4-bit weights re-quantizes them). Both
are written like the full model's folder (:func:`fsdp_presets.train.final_model.write_model_folder`).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from fsdp_presets.checkpoint.adapter import trainable_names, trainable_options
from fsdp_presets.checkpoint.layout import ADAPTER_WEIGHTS
from fsdp_presets.errors import Finding
from fsdp_presets.train.final_model import write_model_folder
from fsdp_presets.train.lora import keep_4bit_layout, quantization_config


def gather_trainable(accelerator, model) -> dict[str, Any]:
    """Full (unsharded) trainable weights on every rank, on the CPU (collective)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    fsdp1 = accelerator.distributed_type.value == "FSDP" and accelerator.state.fsdp_plugin.fsdp_version == 1
    state = get_model_state_dict(model, options=trainable_options(full_state_dict=True, cpu_offload=not fsdp1))
    keep = trainable_names(model)
    return {name: value.detach().cpu().contiguous() for name, value in state.items() if name in keep}


def write_adapter_folder(folder: Path, state: dict[str, Any], key_map: dict[str, str], adapter_config) -> None:
    """adapter_model.safetensors under peft's key names (:func:`fsdp_presets.train.lora.adapter_key_map`,
    taken on the unwrapped model: peft's own ``save_pretrained`` on an FSDP1-wrapped model writes
    nothing or zeros) and adapter_config.json."""
    import copy

    from safetensors.torch import save_file

    missing = sorted(set(state) - set(key_map))
    if missing:
        raise RuntimeError(f"trainable weights without a PEFT name: {missing[:3]}")
    folder.mkdir(parents=True, exist_ok=True)
    save_file({key_map[name]: tensor for name, tensor in state.items()}, str(folder / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    config = copy.deepcopy(adapter_config)
    config.inference_mode = True
    config.save_pretrained(str(folder))


def export_adapter(accelerator, model, tokenizer, output_dir: Path, *, key_map: dict[str, str],
                   merged_dir: Path | None = None, merge: bool = False,
                   model_class=None, base_path: str | None = None, lora: dict[str, Any] | None = None) -> None:
    """Write ``output_dir`` as a PEFT folder (adapter_config.json + adapter_model.safetensors +
    tokenizer; ``merge``: its files beside what ``output_dir`` holds) and, with ``merged_dir``, the
    merged model as a Hugging Face folder. Collective."""
    state = gather_trainable(accelerator, model)
    problem = None
    if accelerator.is_main_process:
        output_dir = Path(output_dir)
        adapter_config = accelerator.unwrap_model(model).peft_config["default"]
        write_model_folder(output_dir, functools.partial(write_adapter_folder, state=state, key_map=key_map,
                                                         adapter_config=adapter_config), tokenizer=tokenizer,
                           merge=merge)
        if merged_dir is not None:
            try:
                export_merged(output_dir, Path(merged_dir), model_class=model_class, base_path=base_path,
                              quantized=lora is not None and lora["method"] == "qlora", tokenizer=tokenizer)
            except (OSError, ValueError, RuntimeError) as error:
                problem = f"writing the merged model to {merged_dir} failed ({type(error).__name__}: {error}); " \
                          f"the adapter in {output_dir} is complete"
    del state
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        problem = broadcast_object_list([problem], from_process=0)[0]
    if problem:
        raise Finding(problem)
    accelerator.wait_for_everyone()


def export_merged(adapter_dir: Path, merged_dir: Path, *, model_class, base_path: str, quantized: bool,
                  tokenizer=None) -> None:
    """The base reloaded (QLoRA: 4-bit, then dequantized) with the adapter merged in, written as a
    plain Hugging Face folder (one process)."""
    import torch
    from peft import PeftModel

    kwargs = {"quantization_config": quantization_config()} if quantized else {}
    base = model_class.from_pretrained(base_path, dtype=torch.float32, trust_remote_code=False, use_kernels=False,
                                       **kwargs)
    if quantized:
        keep_4bit_layout(base)
        base = base.dequantize()  # merging into 4-bit weights would re-quantize them
        base = base.to(torch.float32)
        for attribute in ("quantization_config", "_pre_quantization_dtype"):
            if hasattr(base.config, attribute):
                delattr(base.config, attribute)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    write_model_folder(merged_dir, lambda staging: merged.save_pretrained(str(staging), safe_serialization=True),
                       tokenizer=tokenizer)
