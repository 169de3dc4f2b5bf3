"""Hand the trained model back as a normal Hugging Face folder (config, generation config,
tokenizer, safetensors) that plain ``from_pretrained`` loads, whatever the sharding was.

``accelerator.get_state_dict`` gathers the full state dict (FSDP2: DCP's
``get_model_state_dict(full_state_dict=True)``; FSDP1: a FULL_STATE_DICT context; DDP: the
module's own), and ``save_pretrained`` writes it on the main process: it writes a tied weight
once and records the tie in the config. The folder is written next to its destination and
renamed into place, so ``final/`` is either the old export or the complete new one.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path


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
