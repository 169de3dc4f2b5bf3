"""Whether a checkpoint folder may be used: the read-only verdict the recipes, ``inspect-checkpoint``
and ``export`` all give (:func:`checkpoint_verdict`), before anything reads the folder.

A checkpoint may come from elsewhere, and whoever made it controls every byte, manifest included.
The verdict checks a well-formed manifest, a closed folder (no symbolic link, no path out of it, no
file it does not list), sizes and SHA-256, every saving rank's random state, and every pickle
readable as data only (:mod:`fsdp_presets.checkpoint.safe_unpickle`). Nothing here writes, and
nothing needs a process group: the collective save, rotation and load are
:mod:`fsdp_presets.checkpoint.manager`'s.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from fsdp_presets.checkpoint.layout import MANIFEST, rng_state_file, step_of, trainer_rng_state_file
from fsdp_presets.checkpoint.manifest import IMPORTED_KIND, TRAINER_KIND, Manifest, inside_path_problem
from fsdp_presets.errors import UsageError
from fsdp_presets.fileio import sha256_file


def _walk_problem(folder: Path, listed: set[str] | None) -> str | None:
    """A symbolic link anywhere in the folder, or (with ``listed``) a file the manifest does not list."""
    for directory, subdirectories, files in os.walk(folder, followlinks=False):
        for name in sorted(subdirectories + files):
            path = Path(directory) / name
            relative = str(path.relative_to(folder))
            if path.is_symlink():
                return (f"{relative} is a symbolic link (to {os.readlink(path)}); a checkpoint holds only its own "
                        "files and links in it are never followed: replace the link with the file")
            if listed is not None and name in files and relative != MANIFEST and relative not in listed:
                return f"file {relative} is not listed in {MANIFEST} (a checkpoint holds only what it lists)"
    return None


@dataclass(kw_only=True)
class Verdict:
    """Whether a checkpoint folder may be used: the one answer the recipes, ``inspect-checkpoint``
    and ``export`` all give."""

    manifest: Manifest | None
    """The parsed manifest (also when a later check failed), or None."""
    problem: str | None
    """What is wrong, or None when the checkpoint is complete, untampered and holds only data."""
    unsafe: bool = False
    """True when a file of it was refused as a pickle that could run code."""

    @property
    def ok(self) -> bool:
        return self.problem is None


def checkpoint_verdict(folder: str | os.PathLike, *, check_pickles: bool = True) -> Verdict:
    """Check a checkpoint folder: a manifest whose every field is well-formed, a closed folder (no
    symbolic links, no path outside it, no file it does not list), every file with its recorded
    size and SHA-256, every rank's random state present, and every pickle readable as data only
    (:func:`fsdp_presets.checkpoint.safe_unpickle.vet_checkpoint_pickles`)."""
    from fsdp_presets.checkpoint.safe_unpickle import UnsafeCheckpointError, vet_checkpoint_pickles

    folder = Path(folder)
    manifest_path = folder / MANIFEST
    if manifest_path.is_symlink():
        return Verdict(manifest=None, problem=f"{MANIFEST} is a symbolic link; a checkpoint holds only its own files")
    if not manifest_path.is_file():
        return Verdict(manifest=None, problem=f"no {MANIFEST} (the save did not finish)")
    try:
        manifest = Manifest.read(folder)
    except (ValueError, TypeError, OSError) as error:
        return Verdict(manifest=None, problem=f"unreadable {MANIFEST} ({str(error)[:300]})")
    if manifest.kind != IMPORTED_KIND and step_of(folder.name) not in (None, manifest.step):  # named by its step
        return Verdict(manifest=manifest, problem=f"{MANIFEST} says step {manifest.step}, the folder is {folder.name}")
    for relative in sorted(manifest.files):
        problem = inside_path_problem(relative)
        if problem:
            return Verdict(manifest=manifest, problem=problem)
    problem = _walk_problem(folder, set(manifest.files))
    if problem:
        return Verdict(manifest=manifest, problem=problem)
    for relative, expected in sorted(manifest.files.items()):
        path = folder / relative
        if not path.is_file():
            return Verdict(manifest=manifest, problem=f"missing file {relative}")
        if path.stat().st_size != expected["bytes"]:
            return Verdict(manifest=manifest, problem=f"file {relative} has {path.stat().st_size} bytes, manifest says "
                                                      f"{expected['bytes']}")
        if sha256_file(path) != expected["sha256"]:
            return Verdict(manifest=manifest, problem=f"file {relative} does not match its SHA-256 in the manifest")
    if manifest.kind != IMPORTED_KIND:
        rng_name = ((lambda rank: trainer_rng_state_file(rank, manifest.world_size)) if manifest.kind == TRAINER_KIND
                    else rng_state_file)
        missing = [rng_name(rank) for rank in range(manifest.world_size) if rng_name(rank) not in manifest.files]
        if missing:
            return Verdict(manifest=manifest, problem=f"{', '.join(missing[:4])} missing: the random state of "
                                                      f"{len(missing)} of the {manifest.world_size} ranks that saved it")
    if check_pickles:
        try:
            vet_checkpoint_pickles(folder)
        except UnsafeCheckpointError as error:
            return Verdict(manifest=manifest, problem=str(error), unsafe=True)
        except UsageError as error:
            return Verdict(manifest=manifest, problem=str(error))
    return Verdict(manifest=manifest, problem=None)


def folder_verdict(folder: str | os.PathLike) -> Verdict:
    """The checks of :func:`checkpoint_verdict` that need no manifest, for a folder without one:
    no symbolic link in it, every pickle data only (``manifest`` is None either way)."""
    from fsdp_presets.checkpoint.safe_unpickle import UnsafeCheckpointError, vet_checkpoint_pickles

    problem = _walk_problem(Path(folder), None)
    if problem:
        return Verdict(manifest=None, problem=problem)
    try:
        vet_checkpoint_pickles(Path(folder))
    except UnsafeCheckpointError as error:
        return Verdict(manifest=None, problem=str(error), unsafe=True)
    except UsageError as error:
        return Verdict(manifest=None, problem=str(error))
    return Verdict(manifest=None, problem=None)


def verify_checkpoint(folder: str | os.PathLike) -> tuple[Manifest | None, str | None]:
    """``(manifest, None)`` when the folder is a complete, untampered checkpoint that holds only
    data, else ``(None, what is wrong)`` (see :func:`checkpoint_verdict`)."""
    verdict = checkpoint_verdict(folder)
    return (verdict.manifest, None) if verdict.ok else (None, verdict.problem)
