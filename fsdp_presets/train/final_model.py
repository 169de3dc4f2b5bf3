"""Hand the trained model back as a normal Hugging Face folder (config, generation config,
tokenizer, safetensors) that plain ``from_pretrained`` loads, whatever the sharding was.

``accelerator.get_state_dict`` gathers the full state dict (FSDP2: DCP's
``get_model_state_dict(full_state_dict=True)``; FSDP1: a FULL_STATE_DICT context; DDP: the
module's own), and ``save_pretrained`` writes it on the main process, a tied weight once (the
config records the tie). The folder is written next to its destination and
renamed into place, so ``final/`` is either the old export or the complete new one.
"""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path
from typing import Callable

from fsdp_presets.checkpoint.layout import retired_sibling, staging_sibling
from fsdp_presets.errors import disk_full_cause, disk_full_message, refused_write_class
from fsdp_presets.faults import fault_point
from fsdp_presets.fileio import staged_folder


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


def write_model_folder(output_dir: Path, write: Callable[[Path], None], *, tokenizer=None, merge: bool = False) -> None:
    """Write a model folder (Hugging Face or PEFT; main process) completely or not at all:
    ``write(staging)`` fills a hidden sibling of ``output_dir``, the tokenizer is added, and the
    folder replaces ``output_dir`` in one rename (``merge``: its files are renamed into
    ``output_dir``, beside what it holds; :func:`fsdp_presets.fileio.staged_folder`). A failure
    removes the sibling and raises; a kill leaves it, and the next export removes it."""
    output_dir = Path(output_dir)
    with staged_folder(output_dir, staging=staging_sibling(output_dir, unique=False),
                       retired=lambda: retired_sibling(output_dir), merge=merge) as staging:
        write(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(staging))


def export_model(accelerator, model, tokenizer, output_dir: str | os.PathLike, *,
                 max_shard_size: str = "5GB") -> Path:
    """Write ``output_dir`` from a prepared (possibly sharded) model. Collective: every rank
    must call it."""
    output_dir = Path(output_dir)
    state_dict = accelerator.get_state_dict(model)
    problem = None
    if accelerator.is_main_process:
        try:
            fault_point("export", step=None, rank=accelerator.process_index,
                        folder=staging_sibling(output_dir, unique=False))
            write_model_folder(output_dir, functools.partial(_write, accelerator, model, state_dict,
                                                             max_shard_size=max_shard_size), tokenizer=tokenizer)
        except Exception as error:
            cause = disk_full_cause(error)
            if cause is None:
                raise
            kept = (f"{output_dir} keeps the model it held." if output_dir.exists() else "") + \
                " The checkpoints are intact: the same command exports again from the last one."
            problem = disk_full_message(cause, "exporting the trained model", output_dir.parent, kept=kept.strip())
    del state_dict
    if accelerator.num_processes > 1:  # every rank learns the outcome (no rank waits for a dead one)
        from accelerate.utils import broadcast_object_list

        problem = broadcast_object_list([problem], from_process=0)[0]
    if problem:
        raise refused_write_class(problem)(problem)
    accelerator.wait_for_everyone()
    return output_dir


def _write(accelerator, model, state_dict, staging: Path, max_shard_size: str) -> None:
    """The main process's part: the gathered weights written into ``staging``."""
    unwrapped = accelerator.unwrap_model(model)
    # Tensors gathered by FSDP2 may share storage with views; save contiguous copies.
    state_dict = {name: tensor.detach().contiguous() for name, tensor in state_dict.items()}
    for name in tied_duplicates(unwrapped):
        state_dict.pop(name, None)
    with _written_by_one_process(unwrapped):
        unwrapped.save_pretrained(staging, state_dict=state_dict, safe_serialization=True,
                                  max_shard_size=max_shard_size)


@contextlib.contextmanager
def _written_by_one_process(model):
    """``save_pretrained`` of a model transformers sharded at load time (``config.distributed_config``,
    ``--distributed-config``) gathers the weights and waits at a barrier itself, as if every rank
    called it: called by the main process alone with weights already gathered
    (``accelerator.get_state_dict``), it would wait for the others forever. Its config leaves the
    mesh out for the write (config.json never holds it)."""
    config = model.config
    mesh = getattr(config, "distributed_config", None)
    if mesh is None:
        yield
        return
    config.distributed_config = None
    try:
        yield
    finally:
        config.distributed_config = mesh
