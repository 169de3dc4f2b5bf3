"""Sharded checkpoints that are committed atomically, verified before use, and pruned.

A save is ``accelerator.save_state`` (DCP shards under FSDP, so every rank writes its own part)
into ``checkpoints/.tmp-step-NNNNNNNN``, then ``manifest.json`` (step, samples consumed, world
size, how the model was sharded, model-config digest, SHA-256 and size of every file), then one
``os.rename`` to ``checkpoints/step-NNNNNNNN``. A folder without a manifest is therefore a save
that did not finish, and a committed folder whose files do not match their checksums is damaged:
:meth:`CheckpointManager.latest_valid` skips both, saying so, and never resumes from them.

Only the main process writes shared files (manifest, renames, pruning); every rank hashes a share
of the files (so a large checkpoint is not hashed by one process alone) and all ranks wait at the
same points. Kill-during-save drills: see :mod:`fsdp_presets.faults` (point ``during-save``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from fsdp_presets.digest import sha256_file, write_json_atomic
from fsdp_presets.errors import UsageError
from fsdp_presets.faults import fault_point

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
STEP_PATTERN = re.compile(r"^step-(\d{8})$")
TEMPORARY_PREFIX = ".tmp-step-"
DELETING_PREFIX = ".deleting-"


def step_folder_name(step: int) -> str:
    """``step-00000012``: eight digits so that names sort like steps."""
    return f"step-{step:08d}"


@dataclass(kw_only=True)
class Manifest:
    """What a committed checkpoint holds and how to check it."""

    step: int
    """Optimizer steps completed when the state was saved."""
    samples_consumed: int
    """Training samples consumed by all ranks together: the data position to resume from."""
    world_size: int
    """Processes that wrote the checkpoint."""
    distributed_type: str
    """accelerate's distributed type (FSDP, MULTI_CPU, MULTI_GPU, NO)."""
    fsdp: dict[str, Any] | None
    """FSDP version, resharding, state-dict type, activation checkpointing, HSDP mesh (or None)."""
    config_digest: str
    """SHA-256 of the model config (see :func:`fsdp_presets.digest.config_digest`)."""
    files: dict[str, dict[str, Any]]
    """Relative path -> {"sha256", "bytes"} of every file in the checkpoint except the manifest."""
    versions: dict[str, str] = field(default_factory=dict)
    """torch / accelerate / transformers versions that wrote it."""
    created_unix: float = 0.0
    """When it was committed (seconds since the epoch)."""
    format: int = MANIFEST_FORMAT
    """Manifest format version."""

    def __post_init__(self) -> None:
        problems = []
        if self.step < 0:
            problems.append(f"step {self.step} < 0")
        if self.samples_consumed < 0:
            problems.append(f"samples_consumed {self.samples_consumed} < 0")
        if self.world_size < 1:
            problems.append(f"world_size {self.world_size} < 1")
        if problems:
            raise ValueError("invalid manifest: " + "; ".join(problems))

    @classmethod
    def read(cls, folder: str | os.PathLike) -> "Manifest":
        """Load ``folder/manifest.json`` (raises ``ValueError``/``OSError`` when missing or bad)."""
        payload = json.loads((Path(folder) / MANIFEST).read_text())
        known = {name for name in cls.__dataclass_fields__}
        return cls(**{key: value for key, value in payload.items() if key in known})


def verify_checkpoint(folder: str | os.PathLike) -> tuple[Manifest | None, str | None]:
    """``(manifest, None)`` when the folder is a complete, untampered checkpoint, else
    ``(None, what is wrong)``. Checks that the manifest parses and that every listed file exists
    with its recorded size and SHA-256."""
    folder = Path(folder)
    if not (folder / MANIFEST).is_file():
        return None, "no manifest.json (the save did not finish)"
    try:
        manifest = Manifest.read(folder)
    except (ValueError, TypeError, OSError) as error:
        return None, f"unreadable manifest.json ({error})"
    for relative, expected in sorted(manifest.files.items()):
        path = folder / relative
        if not path.is_file():
            return None, f"missing file {relative}"
        if path.stat().st_size != expected["bytes"]:
            return None, f"file {relative} has {path.stat().st_size} bytes, manifest says {expected['bytes']}"
        if sha256_file(path) != expected["sha256"]:
            return None, f"file {relative} does not match its SHA-256 in the manifest"
    return manifest, None


def committed_checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """``[(step, folder)]`` of the committed-looking ``step-*`` folders, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(match.group(1)), entry) for entry in directory.iterdir()
             if entry.is_dir() and (match := STEP_PATTERN.match(entry.name))]
    return sorted(found)


def _library_versions() -> dict[str, str]:
    import accelerate
    import torch
    import transformers

    return {"torch": torch.__version__, "accelerate": accelerate.__version__,
            "transformers": transformers.__version__}


def _remove_tree(path: Path) -> None:
    """Rename first (atomic), then delete: a kill mid-delete leaves a dot-folder that is ignored,
    never a committed-looking folder with files missing."""
    doomed = path.with_name(f"{DELETING_PREFIX}{path.name}-{time.time_ns()}")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


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
    """:func:`fsdp_presets.run_folder.distributed_settings` of this run."""
    log: Callable[[str], None] = print
    """Where messages go (the main process prints them)."""

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
        accelerator = self.accelerator
        temporary = self.directory / f"{TEMPORARY_PREFIX}{step:08d}"
        committed = self.directory / step_folder_name(step)
        if accelerator.is_main_process:
            self.directory.mkdir(parents=True, exist_ok=True)
            if temporary.exists():
                _remove_tree(temporary)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(temporary))
        if accelerator.is_main_process and write_extra is not None:
            write_extra(temporary)
        accelerator.wait_for_everyone()
        fault_point("during-save", step=step, rank=accelerator.process_index)

        # Every rank hashes every world_size-th file; the main process gathers the results.
        from accelerate.utils import gather_object

        relative_paths = sorted(str(path.relative_to(temporary)) for path in temporary.rglob("*")
                                if path.is_file())
        mine = relative_paths[accelerator.process_index::accelerator.num_processes]
        hashed = [(relative, sha256_file(temporary / relative), (temporary / relative).stat().st_size)
                  for relative in mine]
        hashed = gather_object(hashed) if accelerator.num_processes > 1 else hashed
        if accelerator.is_main_process:
            manifest = Manifest(
                step=step, samples_consumed=samples_consumed,
                world_size=self.distributed["world_size"],
                distributed_type=self.distributed["distributed_type"], fsdp=self.distributed["fsdp"],
                config_digest=self.config_digest,
                files={relative: {"sha256": digest, "bytes": size} for relative, digest, size in sorted(hashed)},
                versions=_library_versions(), created_unix=time.time(),
            )
            write_json_atomic(temporary / MANIFEST, asdict(manifest))
            if committed.exists():  # the same step saved again after resuming from an older one
                _remove_tree(committed)
            os.rename(temporary, committed)  # the commit: atomic on one file system
            self._fsync_directory()
            self._prune()
        accelerator.wait_for_everyone()
        return committed

    def _fsync_directory(self) -> None:
        descriptor = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)

    def _prune(self) -> None:
        for _, folder in committed_checkpoints(self.directory)[:-self.keep_last]:
            _remove_tree(folder)

    # ---- find ----
    def latest_valid(self) -> Path | None:
        """The newest committed checkpoint that verifies, or None. Interrupted saves and damaged
        checkpoints are reported and skipped (interrupted ones are removed). Collective: the main
        process decides and every rank gets the same answer."""
        accelerator = self.accelerator
        choice = None
        if accelerator.is_main_process and self.directory.is_dir():
            for leftover in sorted(self.directory.glob(f"{TEMPORARY_PREFIX}*")):
                self.log(f"checkpoint: ignoring {leftover}: a save that did not finish (no manifest); "
                         "removing it")
                _remove_tree(leftover)
            for step, folder in reversed(committed_checkpoints(self.directory)):
                manifest, problem = verify_checkpoint(folder)
                if problem is None:
                    choice = str(folder)
                    break
                self.log(f"checkpoint: skipping {folder}: {problem}")
        return Path(choice) if (choice := self._broadcast(choice)) else None

    def resolve(self, resume: str) -> Path | None:
        """The checkpoint that ``--resume auto|PATH|none`` names (collective)."""
        if resume == "none":
            return None
        if resume == "auto":
            return self.latest_valid()
        problem = None
        if self.accelerator.is_main_process:
            _, problem = verify_checkpoint(resume) if Path(resume).is_dir() else (None, "no such folder")
        problem = self._broadcast(problem)
        if problem:
            raise UsageError(f"--resume {resume}: {problem}; give a committed checkpoint folder "
                             "(checkpoints/step-NNNNNNNN) or --resume auto")
        return Path(resume)

    # ---- load ----
    def load(self, folder: str | os.PathLike) -> Manifest:
        """Restore model, optimizer, scheduler and RNG state from ``folder``; returns its manifest."""
        manifest = Manifest.read(folder)
        if manifest.config_digest != self.config_digest:
            raise UsageError(f"--resume {folder}: the checkpoint is of another model (config digest "
                             "differs); give a checkpoint of this --model")
        self.accelerator.load_state(str(folder))
        return manifest

    def _broadcast(self, value):
        if self.accelerator.num_processes == 1:
            return value
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([value], from_process=0)[0]
