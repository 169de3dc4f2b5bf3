"""Sharded checkpoints that are committed atomically, verified before use, and pruned.

A save is ``accelerator.save_state`` (DCP shards under FSDP, so every rank writes its own part)
into ``checkpoints/.tmp-step-NNNNNNNN``, then ``manifest.json`` (step, samples consumed, world
size, how the model was sharded, model-config digest, SHA-256 and size of every file), then one
``os.rename`` to ``checkpoints/step-NNNNNNNN``. A folder without a manifest is therefore a save
that did not finish, and a committed folder whose files do not match their checksums is damaged:
:meth:`CheckpointManager.latest_valid` skips both, saying so, and never resumes from them.

A checkpoint may come from elsewhere, and whoever made it controls every byte, manifest included:
a folder is used only after :func:`fsdp_presets.checkpoint.verify.checkpoint_verdict` (the one
read-only answer the recipes, ``inspect-checkpoint`` and ``export`` give) has passed it, and
:meth:`CheckpointManager.load` then reads through the safe DCP reader and planner.

Only the main process writes shared files (manifest, renames, pruning); every rank hashes a share
of the files (so a large checkpoint is not hashed by one process alone) and all ranks wait at the
same points. Kill-during-save drills: see :mod:`fsdp_presets.faults` (point ``during-save``).

A ``transformers.Trainer`` run with ``fsdp_presets.FSDPPresetsCallback`` goes through the same
manager under another :class:`CheckpointNaming` (:data:`TRAINER_NAMING`): Trainer writes
``checkpoint-N`` in place (there is no temporary name), so the manifest written into it is the
commit, and Trainer's own rotation replaces the pruning.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from fsdp_presets.checkpoint.layout import (DCP_RANK_FILE, FINAL, MANIFEST, RUN_JSON, TEMPORARY_STEP_PREFIX,
                                            TRAINER_CHECKPOINT_PATTERN, deleting_name, step_folder_name, step_of,
                                            temporary_step_folder, trainer_checkpoint_name)
from fsdp_presets.checkpoint.manifest import ADAPTER_KIND, TRAINER_KIND, TRAINING_KIND, Manifest
from fsdp_presets.checkpoint.resume import RECIPE_RESUME, TRAINER_RESUME, resume_note
from fsdp_presets.checkpoint.verify import checkpoint_verdict
from fsdp_presets.errors import (UsageError, disk_full_cause, disk_full_message, rank_local,
                                 raise_on_every_rank, refused_write_class)
from fsdp_presets.faults import fault_point
from fsdp_presets.fileio import sha256_file, write_json_atomic

def _short(problem: str) -> str:
    """The first sentence of a problem, without the folder it is about (for a list of them)."""
    text = problem.split(". ")[0]
    return text if len(text) <= 200 else text[:197] + "..."


def committed_checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """``[(step, folder)]`` of the committed-looking ``step-*`` folders, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(step, entry) for entry in directory.iterdir()
             if entry.is_dir() and (step := step_of(entry.name)) is not None]
    return sorted(found)


def trainer_checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """``[(step, folder)]`` of the ``checkpoint-N`` folders Trainer wrote under ``directory``, oldest
    first (committed or not: a committed one holds its manifest)."""
    directory = Path(directory)
    return sorted((int(match.group(1)), entry) for entry in (directory.iterdir() if directory.is_dir() else ())
                  if (match := TRAINER_CHECKPOINT_PATTERN.match(entry.name)) and entry.is_dir())


def committed_trainer_checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """The :func:`trainer_checkpoints` with their manifest (committed), oldest first."""
    return [(step, folder) for step, folder in trainer_checkpoints(directory) if (folder / MANIFEST).is_file()]


def trainer_resume_choice(directory: Path) -> tuple[Path | None, str | None]:
    """The ``checkpoint-N`` under ``directory`` that ``trainer.train(resume_from_checkpoint=True)``
    continues from, and a line saying why when it is not the newest folder: the newest committed
    one (with its manifest); None when none is (training starts from step 0), never a folder a
    killed or interrupted run left without its manifest, even the only one. A run folder written
    without the callback (no ``run.json``, no manifest anywhere): the newest folder, as Trainer
    picks it."""
    found = trainer_checkpoints(directory)
    committed = [folder for _, folder in committed_trainer_checkpoints(directory)]
    if not committed and not (directory / RUN_JSON).is_file():
        return (found[-1][1] if found else None), None
    if not found or committed[-1:] == [found[-1][1]]:
        return (committed[-1] if committed else None), None
    instead = (f"resuming from {committed[-1]}, the newest committed checkpoint" if committed else
               "no checkpoint of this run was committed: training starts from step 0")
    return (committed[-1] if committed else None), (f"{found[-1][1]} has no {MANIFEST}: it was cut short before it "
                                                     f"was committed; {instead}")


@dataclass(frozen=True, kw_only=True)
class CheckpointNaming:
    """How a run names, writes and finds its checkpoints."""

    folder_name: Callable[[int], str]
    """The committed folder of a step."""
    in_place: bool
    """The writer writes the committed folder's own name (Trainer's ``checkpoint-N``): no temporary
    folder, no rename; the manifest written into it is the commit."""
    kind: str | None
    """The manifest kind (None: ``training``, or ``adapter`` for a LoRA run)."""
    resume: str
    """How a stopped run continues from its newest committed checkpoint (the messages say it)."""
    committed: Callable[[Path], list[tuple[int, Path]]]
    """``[(step, folder)]`` of the committed checkpoints under the manager's directory, oldest first."""


RECIPE_NAMING = CheckpointNaming(folder_name=step_folder_name, in_place=False, kind=None, resume=RECIPE_RESUME,
                                 committed=committed_checkpoints)
"""The recipes: ``OUTPUT_DIR/checkpoints/step-NNNNNNNN``, written as ``.tmp-step-NNNNNNNN`` and renamed."""
TRAINER_NAMING = CheckpointNaming(folder_name=trainer_checkpoint_name, in_place=True, kind=TRAINER_KIND,
                                  resume=TRAINER_RESUME, committed=committed_trainer_checkpoints)
"""``transformers.Trainer``: ``OUTPUT_DIR/checkpoint-N``, written in place by Trainer."""


def hash_share(folder: Path, *, rank: int, world_size: int,
               written: dict[str, tuple[str, int]] | None = None) -> list[tuple[str, str, int]]:
    """``(relative path, SHA-256, bytes)`` of this rank's share of a complete save folder's files:
    the DCP data files it wrote (``__RANK_N.distcp``: each rank's own), and every ``world_size``-th
    of the other files, starting at ``rank``. ``written``: ``relative path: (SHA-256, bytes)`` of
    files hashed as they were written (not read again)."""
    written = written or {}
    relative_paths = sorted(str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file())
    others = []
    mine = []
    for relative in relative_paths:
        writer = DCP_RANK_FILE.match(Path(relative).name)
        if writer is None:
            others.append(relative)
        elif int(writer.group(1)) % world_size == rank:
            mine.append(relative)
    return [(relative, *written[relative]) if relative in written else
            (relative, sha256_file(folder / relative), (folder / relative).stat().st_size)
            for relative in sorted(mine + others[rank::world_size])]


def _library_versions() -> dict[str, str]:
    import accelerate
    import torch
    import transformers

    return {"torch": torch.__version__, "accelerate": accelerate.__version__,
            "transformers": transformers.__version__}


def _remove_tree(path: Path, delete: Callable[[Path], None] | None = None) -> None:
    """Rename first (atomic), then delete (``delete(renamed)``; at once when None): a kill mid-delete
    leaves a dot-folder that is ignored, never a committed-looking folder with files missing."""
    doomed = deleting_name(path)
    os.rename(path, doomed)
    if delete is None:
        shutil.rmtree(doomed, ignore_errors=True)
    else:
        delete(doomed)


@dataclass(kw_only=True)
class CheckpointManager:
    """Saves, finds and loads the checkpoints of one run folder (one instance per process)."""

    accelerator: Any
    """The run's ``accelerate.Accelerator``."""
    directory: Path
    """OUTPUT_DIR/checkpoints."""
    keep_last: int
    """How many committed checkpoints to keep (older ones are deleted after each commit)."""
    config_digest: str
    """Digest of the model config, recorded in each manifest."""
    distributed: dict[str, Any]
    """:func:`fsdp_presets.checkpoint.run_folder.distributed_settings` of this run."""
    log: Callable[[str], None] = print
    """Where messages go (the main process prints them)."""
    state: Any = None
    """What to save and load instead of ``accelerator.save_state``/``load_state`` (an object with
    ``save(folder)`` and ``load(folder)``: :class:`fsdp_presets.checkpoint.adapter.TrainableState`), or None."""
    training: dict[str, Any] | None = None
    """Recorded in each manifest (:attr:`Manifest.training`)."""
    delete_pruned: Callable[[Path], None] | None = None
    """How a pruned checkpoint, once renamed out of the way, is deleted (None: at once, before the
    commit returns; background saves hand it to their writer thread, so that deleting the files of
    an old checkpoint does not block training)."""
    naming: CheckpointNaming = RECIPE_NAMING
    """How the checkpoints are named, written and found (:data:`TRAINER_NAMING`: Trainer's)."""
    rotate: Callable[[], None] | None = None
    """What removes older checkpoints after a commit (main process; None: all but :attr:`keep_last`;
    a Trainer run: Trainer's own rotation)."""

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise UsageError(f"--keep-last {self.keep_last}: keep at least 1 checkpoint")
        self.directory = Path(self.directory)

    # ---- save ----
    def save(self, *, step: int, samples_consumed: int,
             write_extra: Callable[[Path], None] | None = None) -> Path:
        """Save the accelerate state of every prepared object, commit it as ``step-NNNNNNNN``
        and prune. ``write_extra(folder)`` runs on the main process before hashing (e.g. to add
        the model config and tokenizer, so a checkpoint is self-describing). Collective."""
        return self.commit(self.write(step, write_extra), step=step, samples_consumed=samples_consumed)[0]

    def write(self, step: int, write_extra: Callable[[Path], None] | None = None) -> Path:
        """Write the save of ``step`` into its temporary folder (every prepared object's accelerate
        state, then ``write_extra`` on the main process) and return that folder, not yet committed.
        A refused write removes the folder and stops the run in one line. Collective."""
        temporary = self.begin_save(step)
        try:
            if self.state is not None:
                self.state.save(temporary)
            else:
                self.accelerator.save_state(str(temporary))
            if self.accelerator.is_main_process and write_extra is not None:
                write_extra(temporary)
        except BaseException as error:  # DCP reports every rank's write failure as a CheckpointException
            self.stop_if_disk_full(error, step=step, temporary=temporary)
            raise
        return temporary

    def begin_save(self, step: int) -> Path:
        """The empty temporary folder of the save of ``step`` (an older one of that step removed),
        on every rank once the main process made it. Collective. In place (Trainer), the folder of
        the step itself: a killed run's unfinished ``checkpoint-N``, or a committed one of the same
        step saved again after a resume from an older one, is removed first (Trainer writes into an
        existing folder and keeps what it does not overwrite, such as a one-process run's
        ``rng_state.pth`` beside a two-process run's ``rng_state_N.pth``, and the manifest would
        vouch for them)."""
        accelerator = self.accelerator
        temporary = (self.directory / self.naming.folder_name(step) if self.naming.in_place
                     else temporary_step_folder(self.directory, step))
        if accelerator.is_main_process:
            self.directory.mkdir(parents=True, exist_ok=True)
            if temporary.exists():
                _remove_tree(temporary)
        accelerator.wait_for_everyone()
        fault_point("save", step=step, rank=accelerator.process_index, folder=temporary)
        return temporary

    def commit(self, temporary: Path, *, step: int, samples_consumed: int,
               hashed: list[tuple[str, str, int]] | None = None) -> tuple[Path, int]:
        """Once every rank's files of the save are in ``temporary``: hash them (every rank a share;
        ``hashed``: this rank's share already hashed, by :func:`hash_share`), write the manifest,
        rename the folder to ``step-NNNNNNNN`` (the commit) and prune. Returns the committed folder
        and its bytes (on the main process; 0 elsewhere). Collective."""
        accelerator = self.accelerator
        committed = self.directory / self.naming.folder_name(step)
        accelerator.wait_for_everyone()
        if not self.naming.in_place:  # an in-place writer (Trainer's callback) marks the point where its files are
            fault_point("during-save", step=step, rank=accelerator.process_index)

        # Every rank hashes its share (hash_share); the main process gathers the results.
        from accelerate.utils import gather_object

        if hashed is None:
            hashed = hash_share(temporary, rank=accelerator.process_index, world_size=accelerator.num_processes)
        hashed = gather_object(hashed) if accelerator.num_processes > 1 else hashed
        total_bytes = 0
        if accelerator.is_main_process:
            manifest = Manifest(
                step=step, samples_consumed=samples_consumed,
                world_size=self.distributed["world_size"],
                distributed_type=self.distributed["distributed_type"], fsdp=self.distributed["fsdp"],
                config_digest=self.config_digest,
                files={relative: {"sha256": digest, "bytes": size} for relative, digest, size in sorted(hashed)},
                versions=_library_versions(), created_unix=time.time(), training=self.training,
                model_mesh=self.distributed.get("model_mesh"),
                kind=self.naming.kind or (ADAPTER_KIND if self.training else TRAINING_KIND),
            )
            total_bytes = sum(size for _, _, size in hashed)
            try:
                write_json_atomic(temporary / MANIFEST, asdict(manifest))  # in place: the commit
            except OSError as error:
                self.stop_if_disk_full(error, step=step, temporary=temporary)
                raise
            if not self.naming.in_place:
                if committed.exists():  # the same step saved again after resuming from an older one
                    _remove_tree(committed)
                os.rename(temporary, committed)  # the commit: atomic on one file system
            self._fsync_directory()
            if self.rotate is not None:
                self.rotate()
            else:
                self._prune()
        accelerator.wait_for_everyone()
        return committed, total_bytes

    def kept_note(self) -> str:
        """What a failed save leaves to resume from, as the run's stop message says it."""
        previous = self.naming.committed(self.directory)
        return resume_note(previous[-1][1] if previous else None, how=self.naming.resume)

    def abandon(self, temporary: Path) -> None:
        """Remove the unfinished folder of a save that failed (main process); the committed
        checkpoints are untouched."""
        if self.accelerator.is_main_process and temporary.exists():
            _remove_tree(temporary)

    def stop_if_disk_full(self, error: BaseException, *, step: int, temporary: Path) -> None:
        """A full disk during a save: remove the unfinished folder (the space it took is freed, and
        the last committed checkpoint is untouched) and raise one error naming both (a read-only or
        size-limited folder: exit 2, :func:`~fsdp_presets.errors.refused_write_class`). DCP
        raises on every rank (the main process prints it); another write fails on its rank alone."""
        cause = None if isinstance(error, (KeyboardInterrupt, SystemExit)) else disk_full_cause(error, temporary)
        if cause is None:
            return
        shutil.rmtree(temporary, ignore_errors=True)
        message = disk_full_message(cause, f"saving the checkpoint of step {step}", self.directory,
                                    kept=self.kept_note())
        refused = refused_write_class(message)
        if type(error).__name__ == "CheckpointException":
            raise refused(message) from None
        rank = self.accelerator.process_index
        raise rank_local(refused(f"rank {rank}: {message}" if rank else message), print_here=True) from None

    def _fsync_directory(self) -> None:
        descriptor = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)

    def _prune(self) -> None:
        for _, folder in committed_checkpoints(self.directory)[:-self.keep_last]:
            _remove_tree(folder, self.delete_pruned)

    # ---- find ----
    def latest_valid(self) -> Path | None:
        """The newest committed checkpoint that verifies, or None when the run has none yet.
        Interrupted saves are removed; damaged or refused checkpoints are reported and skipped.
        When there are checkpoints but none is usable, or a finished model but no checkpoint, it
        stops (:class:`UsageError` with the list) rather than train over the run from step 0.
        Collective: the main process decides and every rank gets the same answer."""
        accelerator = self.accelerator
        choice = error = None
        if accelerator.is_main_process and self.directory.is_dir():
            for leftover in sorted(self.directory.glob(f"{TEMPORARY_STEP_PREFIX}*")):
                self.log(f"checkpoint: ignoring {leftover}: a save that did not finish (no manifest); "
                         "removing it")
                _remove_tree(leftover)
            skipped = []
            for step, folder in reversed(committed_checkpoints(self.directory)):
                problem = ("a symbolic link, not a checkpoint this run wrote" if folder.is_symlink()
                           else checkpoint_verdict(folder).problem)
                if problem is None:
                    choice = str(folder)
                    break
                self.log(f"checkpoint: skipping {folder}: {problem}")
                skipped.append(f"{folder.name}: {_short(problem)}")
            if choice is None and skipped:
                error = (f"--resume auto: no checkpoint in {self.directory} can be used ({' | '.join(skipped)}); "
                         "nothing was trained or overwritten. Restore a checkpoint (e.g. from a copy), give one "
                         "with --resume PATH, or start over in a new --output-dir")
        final = self.directory.parent / FINAL
        if accelerator.is_main_process and choice is None and error is None and final.exists():
            error = (f"--resume auto: {self.directory.parent} holds a finished model ({final}) but no checkpoint "
                     "to continue from; nothing was trained or overwritten. Choose a new --output-dir to train "
                     "again, or give a checkpoint with --resume PATH")
        choice, error = self._broadcast((choice, error))
        raise_on_every_rank(accelerator, error)
        return Path(choice) if choice else None

    def resolve(self, resume: str, *, max_steps: int | None = None) -> Path | None:
        """The checkpoint that ``--resume auto|PATH|none`` names (collective). With ``max_steps``,
        a checkpoint already past it is refused: the run would end at once with the later model
        while run.json recorded the smaller number."""
        if resume == "none":
            return None
        if resume == "auto":
            folder = self.latest_valid()
        else:
            problem = None
            if self.accelerator.is_main_process:
                problem = checkpoint_verdict(resume).problem if Path(resume).is_dir() else "no such folder"
            problem = self._broadcast(problem)
            raise_on_every_rank(self.accelerator, problem and (
                f"--resume {resume}: {problem}; give a committed checkpoint folder (checkpoints/step-NNNNNNNN) "
                "or --resume auto"))
            folder = Path(resume)
        if folder is not None and max_steps is not None:
            step = Manifest.read(folder).step
            raise_on_every_rank(self.accelerator, step > max_steps and (
                f"--max-steps {max_steps}: the checkpoint to resume ({folder}) is already at step {step}; give "
                f"--max-steps {step} or more to continue that run, or choose a new --output-dir (nothing was "
                "trained or overwritten)"))
        return folder

    # ---- load ----
    def load(self, folder: str | os.PathLike) -> Manifest:
        """Restore model, optimizer, scheduler and RNG state from ``folder`` (checked by
        :meth:`resolve`); returns its manifest. DCP is read through the safe reader and planner
        (:func:`fsdp_presets.checkpoint.safe_unpickle.safe_dcp_loading`); every other file accelerate reads
        it loads with ``weights_only=True``."""
        from fsdp_presets.checkpoint.safe_unpickle import safe_dcp_loading

        manifest = Manifest.read(folder)
        if manifest.config_digest != self.config_digest:
            raise UsageError(f"--resume {folder}: the checkpoint is of another model (config digest "
                             "differs); give a checkpoint of this --model")
        if self.state is not None:
            self.state.load(folder)  # a LoRA checkpoint: DCP of the trainable weights, any strategy reads it
        else:
            check_layout_fits(folder, manifest, self.distributed)
            with safe_dcp_loading():
                self.accelerator.load_state(str(folder))
        if self.accelerator.num_processes > manifest.world_size and self.accelerator.is_main_process:
            # accelerate skips a rank without its random_states_<rank>.pkl without a word.
            self.log(f"checkpoint: ranks {manifest.world_size}-{self.accelerator.num_processes - 1} have no saved "
                     f"random state ({folder} was saved by {manifest.world_size} processes): they keep their "
                     "seeded one (only dropout, if any, draws differently)")
        return manifest

    def _broadcast(self, value):
        if self.accelerator.num_processes == 1:
            return value
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([value], from_process=0)[0]


def check_layout_fits(folder: str | os.PathLike, manifest: Manifest, distributed: dict[str, Any]) -> None:
    """:class:`UsageError` when this run cannot read the checkpoint's layout: accelerate's
    ``load_state`` reads DCP only under FSDP with ``SHARDED_STATE_DICT``, a full
    ``pytorch_model_fsdp.bin`` only under FSDP with ``FULL_STATE_DICT``, and ``model.safetensors``
    only without FSDP; anything else ends in a traceback deep inside it."""
    from fsdp_presets.checkpoint.files import find_checkpoint_files

    layout = find_checkpoint_files(folder).layout
    if layout == "adapter":
        raise UsageError(f"--resume {folder}: it is a LoRA checkpoint (trainable weights only) and this run trains "
                         "every weight; resume it with the LoRA flags it was saved with (its manifest's training "
                         "entry names them), or export the adapter: fsdp-presets export CHECKPOINT --output DIR")
    fsdp = distributed.get("fsdp") or None
    now_type = (fsdp or {}).get("state_dict_type")
    needs = {"dcp": "FSDP with SHARDED_STATE_DICT", "full": "FSDP with FULL_STATE_DICT", "ddp": "DDP or one process"}
    fits = {"dcp": fsdp is not None and now_type == "SHARDED_STATE_DICT",
            "full": fsdp is not None and now_type == "FULL_STATE_DICT",
            "ddp": fsdp is None}[layout]
    if fits:
        return
    now = (f"FSDP{fsdp.get('version')} with {now_type}" if fsdp else
           {"NO": "one process without FSDP"}.get(distributed.get("distributed_type"),
                                                  f"DDP ({distributed.get('distributed_type')})"))
    saved = (f"FSDP{manifest.fsdp.get('version')} with {manifest.fsdp.get('state_dict_type')}"
             if manifest.fsdp else manifest.distributed_type)
    raise UsageError(f"--resume {folder}: it was saved by {saved} ({layout} layout) and this run is {now}, which "
                     f"cannot read it; launch with an accelerate config of {needs[layout]} (the run's run.json names "
                     "the config that wrote it), or turn it into weights any run loads: fsdp-presets export "
                     "CHECKPOINT --output HF_DIR, then fsdp-presets import HF_DIR --output START and --resume START")
