"""Hand the trained model back as a normal Hugging Face folder (config, generation config,
tokenizer, safetensors) that plain ``from_pretrained`` loads, whatever the sharding was.

``accelerator.get_state_dict`` gathers the full state dict (FSDP2: DCP's
``get_model_state_dict(full_state_dict=True)``; FSDP1: a FULL_STATE_DICT context; DDP: the
module's own), and ``save_pretrained`` writes it on the main process, a tied weight once (the
config records the tie). The folder is written next to its destination and
renamed into place, so ``final/`` is either the old export or the complete new one.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path


def tied_duplicates(module) -> list[str]:
    """Names under which an already-named parameter appears again (``lm_head.weight`` of a model
    with tied embeddings). A gathered state dict holds separate copies under every name, so
    ``save_pretrained`` would write the tied weight twice; the config's tie restores it on load."""
    first_name: dict[int, str] = {}
    duplicates = []
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first_name:
            duplicates.append(name)
        else:
            first_name[id(param)] = name
    return duplicates


def export_model(accelerator, model, tokenizer, output_dir: str | os.PathLike, *,
                 max_shard_size: str = "5GB") -> Path:
    """Write ``output_dir`` from a prepared (possibly sharded) model. Collective: every rank
    must call it."""
    output_dir = Path(output_dir)
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        staging = output_dir.with_name(f".tmp-{output_dir.name}")
        if staging.exists():
            shutil.rmtree(staging)
        unwrapped = accelerator.unwrap_model(model)
        # Tensors gathered by FSDP2 may share storage with views; save contiguous copies.
        state_dict = {name: tensor.detach().contiguous() for name, tensor in state_dict.items()}
        for name in tied_duplicates(unwrapped):
            state_dict.pop(name, None)
        unwrapped.save_pretrained(staging, state_dict=state_dict, safe_serialization=True,
                                  max_shard_size=max_shard_size)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        if output_dir.exists():
            retired = output_dir.with_name(f".old-{output_dir.name}-{time.time_ns()}")
            os.rename(output_dir, retired)
            os.rename(staging, output_dir)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.rename(staging, output_dir)
    del state_dict
    accelerator.wait_for_everyone()
    return output_dir
