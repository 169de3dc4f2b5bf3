"""Resuming a recipe checkpoint on another number of processes, and starting from an imported one.

**Another GPU count.** A recipe checkpoint keeps the data position as one number (samples
consumed by all ranks together, see :mod:`fsdp_presets.train.loop`), and under FSDP with
``SHARDED_STATE_DICT`` its model and optimizer are DCP checkpoints: ``accelerator.load_state``
hands each rank a template of *its* shards and DCP reads the matching pieces from whichever files
hold them, so 2 -> 1, 1 -> 2, 2 -> 4 and 4 -> 2 processes all load the same tensors. What does not
follow by itself is the global batch, ``micro_batch_size x gradient_accumulation_steps x data
parallel size``: :func:`keep_global_batch` recomputes the accumulation for the new process count
so that every optimizer step takes the same samples as before (the set of samples of a step does
not depend on how it is split over ranks and micro-steps).

**An imported checkpoint** (written by ``fsdp-presets import``) holds model weights only, as the
same DCP folder accelerate writes (``pytorch_model_fsdp_0``), and a manifest with ``"kind":
"imported"``, step 0 and 0 samples: :func:`load_imported` loads the weights into the prepared
model (FSDP2, FSDP1, DDP or one process; DCP reshards them) and the run starts at step 0 with a
fresh optimizer and schedule.

RNG state: accelerate restores ``random_states_<rank>.pkl`` per rank and silently skips ranks that
have no file (more processes than were saved); :meth:`~fsdp_presets.checkpoint.manager.CheckpointManager.load`
says which ranks those are, and a checkpoint missing the file of a rank that saved it is damaged. The recipes' models train without dropout by
default, so this does not change the training; with dropout, the new ranks draw other masks.
"""

from __future__ import annotations

import os
from pathlib import Path

from fsdp_presets.checkpoint.layout import DCP_MODEL
from fsdp_presets.checkpoint.manifest import recorded_global_batch
from fsdp_presets.errors import UsageError

RECIPE_RESUME = "--resume auto"
"""How a recipe run continues from its newest committed checkpoint (the same command again)."""
TRAINER_RESUME = "trainer.train(resume_from_checkpoint=True)"
"""How a Trainer run with :class:`fsdp_presets.FSDPPresetsCallback` continues from its newest committed one."""


def resume_note(checkpoint: str | os.PathLike | None, *, how: str = RECIPE_RESUME, saved: bool = False) -> str:
    """The one message that names the checkpoint a stopped run continues from. ``how``: the resume
    that takes it (:data:`RECIPE_RESUME`, :data:`TRAINER_RESUME`); ``saved``: the run has just
    committed it (a Ctrl-C or a preemption), else it is what a failed save left (a sentence)."""
    if saved:
        if checkpoint is None:
            return f"nothing to save (no step trained yet); {how} starts from step 0"
        return f"saved {checkpoint}; {how} continues from it"
    if checkpoint is None:
        return f"No earlier committed checkpoint exists in this run ({how} starts from step 0)."
    return f"The last committed checkpoint, {checkpoint}, is intact and {how} continues from it."


def accumulation_for(global_batch: int, *, micro_batch_size: int, data_parallel_size: int) -> int | None:
    """Gradient accumulation steps that make ``micro x accumulation x dp == global_batch``, or
    None when the global batch does not split that way."""
    per_micro_step = micro_batch_size * data_parallel_size
    if global_batch % per_micro_step:
        return None
    return global_batch // per_micro_step


def keep_global_batch(folder: str | os.PathLike, *, step: int, samples_consumed: int, micro_batch_size: int,
                      gradient_accumulation_steps: int, data_parallel_size: int,
                      names: tuple[str, str, str] = ("--resume", "micro-batch", "gradient accumulation"),
                      ) -> tuple[int, str | None]:
    """``(gradient_accumulation_steps, note)`` for resuming the checkpoint in ``folder`` with
    ``data_parallel_size`` ranks so that the global batch stays what it was. ``note`` says what
    changed (None when nothing did). Raises :class:`UsageError` when the global batch cannot be
    kept with this micro-batch size and process count. ``names``: how the messages call the
    resume, the micro-batch size and the accumulation (the recipes' flags; Trainer's arguments)."""
    resume, micro_name, accumulation_name = names
    recorded = recorded_global_batch(folder, step=step, samples_consumed=samples_consumed)
    requested = micro_batch_size * gradient_accumulation_steps * data_parallel_size
    if recorded is None or recorded == requested:
        return gradient_accumulation_steps, None
    accumulation = accumulation_for(recorded, micro_batch_size=micro_batch_size,
                                    data_parallel_size=data_parallel_size)
    if accumulation is None:
        raise UsageError(
            f"{resume} {folder}: the run trained with a global batch of {recorded} samples, which {micro_name} "
            f"{micro_batch_size} x {data_parallel_size} data-parallel ranks cannot split; choose a {micro_name} "
            f"and process count whose product divides {recorded}")
    note = (f"global batch kept at {recorded} samples: {accumulation_name} {gradient_accumulation_steps} -> "
            f"{accumulation} for {data_parallel_size} data-parallel ranks x {micro_name} {micro_batch_size}")
    return accumulation, note


TRAINER_BATCH_NAMES = ("resume from", "per_device_train_batch_size", "gradient_accumulation_steps")
""":func:`keep_global_batch`'s ``names`` for ``transformers.Trainer``'s arguments."""


def load_imported(model, folder: str | os.PathLike, *, config_digest: str):
    """Load the weights of an imported checkpoint into a prepared model (collective under FSDP/DDP:
    every rank calls it). Returns the checkpoint's :class:`~fsdp_presets.checkpoint.manager.Manifest`.

    ``get_model_state_dict`` gives the template of this rank's shards (FSDP2 DTensors, FSDP1
    sharded tensors, or full tensors for DDP and one process); DCP fills it from the checkpoint
    whatever process count wrote it, and ``set_model_state_dict`` puts it back.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from fsdp_presets.checkpoint.manifest import Manifest
    from fsdp_presets.checkpoint.safe_unpickle import safe_dcp_load

    manifest = Manifest.read(folder)
    if manifest.config_digest != config_digest:
        raise UsageError(f"--resume {folder}: the imported checkpoint is of another model (config digest "
                         "differs); give a checkpoint of this --model or import this model")
    state = get_model_state_dict(model)
    distributed = dist.is_available() and dist.is_initialized()
    safe_dcp_load({"model": state}, Path(folder) / DCP_MODEL, no_dist=not distributed)
    set_model_state_dict(model, state)
    return manifest
