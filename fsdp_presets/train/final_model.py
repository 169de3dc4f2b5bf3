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

from fsdp_presets.errors import Finding, disk_full_cause, disk_full_message
from fsdp_presets.faults import fault_point


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
    problem = None
    if accelerator.is_main_process:
        staging = output_dir.with_name(f".tmp-{output_dir.name}")
        try:
            _write(accelerator, model, tokenizer, state_dict, output_dir, staging, max_shard_size)
        except Exception as error:
            cause = disk_full_cause(error)
            if cause is None:
                raise
            shutil.rmtree(staging, ignore_errors=True)
            kept = (f"{output_dir} keeps the model it held." if output_dir.exists() else "") + \
                " The checkpoints are intact: the same command exports again from the last one."
            problem = disk_full_message(cause, "exporting the trained model", output_dir.parent, kept=kept.strip())
    del state_dict
    if accelerator.num_processes > 1:  # every rank learns the outcome (no rank waits for a dead one)
        from accelerate.utils import broadcast_object_list

        problem = broadcast_object_list([problem], from_process=0)[0]
    if problem:
        raise Finding(problem)
    accelerator.wait_for_everyone()
    return output_dir


def _write(accelerator, model, tokenizer, state_dict, output_dir: Path, staging: Path, max_shard_size: str) -> None:
    """The main process's part: the folder written as ``staging``, then renamed into place."""
    if staging.exists():
        shutil.rmtree(staging)
    fault_point("export", step=None, rank=accelerator.process_index, folder=staging)
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
