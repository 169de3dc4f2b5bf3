"""Trainer's ``checkpoint-N`` saves in the background: ``FSDPPresetsCallback(async_save=True)``
(``recipes/sft_trainer.py --async-save``), through the recipes' writer
(:class:`fsdp_presets.checkpoint.async_save.CheckpointSaver`).

How it fits Trainer's save flow (``Trainer._save_checkpoint``: ``save_model`` (no weights under
``SHARDED_STATE_DICT``), then accelerate's ``save_fsdp_model`` and ``save_fsdp_optimizer`` (DCP,
every rank), the scheduler, the scaler, every rank's RNG state, ``trainer_state.json``, then the
rotation of old checkpoints):

1. the save in flight, if any, is committed first (at most one in flight);
2. Trainer's own ``_save_checkpoint`` runs with its model and optimizer writes left out (the
   callback's ``_save_optimizer_and_scheduler`` writes only the scheduler, as Trainer does) and its
   rotation deferred: every other file is Trainer's, written by Trainer, at once;
3. the writer stages this rank's model and optimizer shards in host memory and hands them to DCP's
   ``async_save`` into ``pytorch_model_fsdp_0/`` and ``optimizer_0/`` (the folders and keys
   ``save_fsdp_model``/``save_fsdp_optimizer`` write, so Trainer's resume reads them unchanged), on
   gloo process groups of their own; training goes on;
4. once every rank's background write has finished (asked at each optimizer step's end, one small
   all-reduce; the next save, a preemption, ``train()``'s end and ``save_model`` wait for it), the
   manifest is written (:class:`TrainerCheckpoints` ``commit``: the folder is committed) and then
   Trainer's rotation runs, so it never removes the last committed checkpoint for one still in
   flight.

Trainer writes ``checkpoint-N`` in place (no temporary name): until its manifest is written the
folder is not committed, and ``trainer.train(resume_from_checkpoint=True)`` with the callback skips
it for the newest committed one.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from fsdp_presets.checkpoint.layout import (MANIFEST, RUN_JSON, TRAINER_CHECKPOINT_PATTERN, deleting_name,
                                            trainer_checkpoint_name)
from fsdp_presets.checkpoint.manager import hash_share
from fsdp_presets.checkpoint.resume import TRAINER_RESUME, resume_note


@dataclass(kw_only=True)
class TrainerCheckpoints:
    """What :class:`~fsdp_presets.checkpoint.async_save.CheckpointSaver` asks of its checkpoint
    manager, for Trainer's own ``checkpoint-N`` folders (one instance per process)."""

    accelerator: Any
    """The Trainer's ``accelerate.Accelerator``."""
    directory: Path
    """Trainer's run folder (``args.output_dir``), which holds the ``checkpoint-N`` folders."""
    commit_folder: Callable[[Path, int, dict[str, dict[str, Any]]], None]
    """Main process: write the manifest of ``(folder, step, files)``, then rotate old checkpoints."""

    def begin_save(self, step: int) -> Path:
        """``checkpoint-N`` of ``step``, which Trainer's own save is about to write, emptied
        (:func:`clear_folder`). Collective."""
        folder = self.directory / trainer_checkpoint_name(step)
        clear_folder(self.accelerator, folder)
        return folder

    def commit(self, temporary: Path, *, step: int, samples_consumed: int,
               hashed: list[tuple[str, str, int]] | None = None) -> tuple[Path, int]:
        """Every rank's files are written: gather the ranks' shares of the hashing and commit the
        folder (its manifest, then Trainer's rotation) on the main process. Returns the folder and
        its bytes (0 on the other ranks). Collective. ``samples_consumed``: the manifest derives it
        from the step, as the synchronous save does."""
        from accelerate.utils import gather_object

        accelerator = self.accelerator
        accelerator.wait_for_everyone()
        if hashed is None:
            hashed = hash_share(temporary, rank=accelerator.process_index, world_size=accelerator.num_processes)
        hashed = gather_object(hashed) if accelerator.num_processes > 1 else hashed
        total_bytes = 0
        if accelerator.is_main_process:
            self.commit_folder(temporary, step, {relative: {"sha256": digest, "bytes": size}
                                                 for relative, digest, size in sorted(hashed)})
            total_bytes = sum(size for _, _, size in hashed)
        accelerator.wait_for_everyone()
        return temporary, total_bytes

    def kept_note(self) -> str:
        """What a failed background write leaves to resume from: the newest ``checkpoint-N`` with a
        manifest (committed), which Trainer's own resume continues from."""
        committed = [folder for _, folder in trainer_checkpoints(self.directory) if (folder / MANIFEST).is_file()]
        return resume_note(committed[-1] if committed else None, how=TRAINER_RESUME)

    def abandon(self, temporary: Path) -> None:
        """A background write failed: remove its folder (main process)."""
        if self.accelerator.is_main_process and temporary.exists():
            _remove_tree(temporary)

    def stop_if_disk_full(self, error: BaseException, *, step: int, temporary: Path) -> None:
        """Staging failed: the error goes on as it is (the folder has no manifest: never resumed from)."""


def trainer_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """``[(step, folder)]`` of the ``checkpoint-N`` folders Trainer wrote under ``directory``, oldest
    first (committed or not: a committed one holds its manifest)."""
    return sorted((int(match.group(1)), entry) for entry in (directory.iterdir() if directory.is_dir() else ())
                  if (match := TRAINER_CHECKPOINT_PATTERN.match(entry.name)) and entry.is_dir())


def resume_choice(directory: Path) -> tuple[Path | None, str | None]:
    """The ``checkpoint-N`` under ``directory`` that ``trainer.train(resume_from_checkpoint=True)``
    continues from, and a line saying why when it is not the newest folder: the newest committed
    one (with its manifest); None when none is (training starts from step 0), never a folder a
    killed or interrupted run left without its manifest, even the only one. A run folder written
    without the callback (no ``run.json``, no manifest anywhere): the newest folder, as Trainer
    picks it."""
    found = trainer_checkpoints(directory)
    committed = [folder for _, folder in found if (folder / MANIFEST).is_file()]
    if not committed and not (directory / RUN_JSON).is_file():
        return (found[-1][1] if found else None), None
    if not found or committed[-1:] == [found[-1][1]]:
        return (committed[-1] if committed else None), None
    instead = (f"resuming from {committed[-1]}, the newest committed checkpoint" if committed else
               "no checkpoint of this run was committed: training starts from step 0")
    return (committed[-1] if committed else None), (f"{found[-1][1]} has no {MANIFEST}: it was cut short before it "
                                                     f"was committed; {instead}")


def clear_folder(accelerator, folder: Path) -> None:
    """Remove ``folder`` before Trainer saves that step into it (main process; every rank waits):
    a killed run's unfinished ``checkpoint-N`` (no manifest), or a committed one of the same step
    saved again after a resume from an older one. Trainer writes into an existing folder and keeps
    what it does not overwrite, so the new checkpoint would hold stale files (a one-process run's
    ``rng_state.pth`` beside a two-process run's ``rng_state_N.pth``) and its manifest would vouch
    for them. Collective."""
    if accelerator.is_main_process and folder.exists():
        _remove_tree(folder)
    accelerator.wait_for_everyone()


def _remove_tree(path: Path) -> None:
    """Renamed first, then deleted: a kill mid-delete leaves a dot-folder, never a checkpoint-looking one."""
    doomed = deleting_name(path)
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def save_scheduler(trainer, output_dir: str) -> None:
    """The scheduler file Trainer's ``_save_optimizer_and_scheduler`` writes (main process), without
    its synchronous FSDP model and optimizer save (written in the background instead)."""
    import warnings

    import torch
    from transformers.trainer import SCHEDULER_NAME
    from transformers.trainer_pt_utils import reissue_pt_warnings

    if trainer.args.should_save:
        with warnings.catch_warnings(record=True) as caught_warnings:
            torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
        reissue_pt_warnings(caught_warnings)


def rotate(trainer, *, save_total_limit: int | None) -> None:
    """Trainer's own rotation of old ``checkpoint-N`` folders (the user's ``save_total_limit``, which
    the callback sets aside while Trainer saves; main process), run after a commit rather than before
    it: a save in flight, committed when the next save begins, is rotated with the user's limit too."""
    from transformers.trainer_utils import rotate_checkpoints

    rotate_checkpoints(output_dir=trainer._get_output_dir(trial=None), save_total_limit=save_total_limit,
                       best_model_checkpoint=trainer.state.best_model_checkpoint, use_mtime=True)
