"""``manifest.json``: what a committed checkpoint holds and how to check it.

Format 2 (written now) records the checkpoint's ``kind`` and ``format``:

- ``training``: a recipe's full state (model, optimizer, scheduler, every rank's random state);
- ``adapter``: a LoRA/QLoRA recipe's state, trainable weights only (the base reloads from ``--model``);
- ``imported``: model weights only, written by ``fsdp-presets import`` (step 0, no optimizer);
- ``trainer``: a ``transformers.Trainer`` checkpoint (``checkpoint-N``) committed by
  ``fsdp_presets.FSDPPresetsCallback`` (Trainer's file names; model files as accelerate writes them).

Format 1 (before the kind was recorded) is still read: its kind is inferred as it always was, from
the ``"kind": "imported"`` key an import wrote and from the ``training`` entry of a LoRA run
(tests/data/checkpoint_format1 keeps checkpoints written in that format).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import MISSING, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from fsdp_presets.checkpoint.layout import MANIFEST
from fsdp_presets.checkpoint.run_folder import run_info_of
from fsdp_presets.schema import MESH_SIZE_KEYS

MANIFEST_FORMAT = 2
"""The format written now; 1 is the format without ``kind`` (read, never written)."""
Kind = Literal["training", "adapter", "imported", "trainer"]
TRAINING_KIND, ADAPTER_KIND, IMPORTED_KIND, TRAINER_KIND = "training", "adapter", "imported", "trainer"
KINDS: tuple[str, ...] = (TRAINING_KIND, ADAPTER_KIND, IMPORTED_KIND, TRAINER_KIND)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def inferred_kind(payload: dict[str, Any]) -> str:
    """The kind of a parsed manifest: its ``kind`` when recorded, else (format 1) ``imported`` for
    what an import wrote, ``adapter`` for a LoRA run (a ``training`` entry), else ``training``."""
    kind = payload.get("kind")
    if kind is not None:
        return kind
    return ADAPTER_KIND if payload.get("training") else TRAINING_KIND


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
    """SHA-256 of the model config (see :func:`fsdp_presets.fileio.config_digest`)."""
    files: dict[str, dict[str, Any]]
    """Relative path -> {"sha256", "bytes"} of every file in the checkpoint except the manifest."""
    kind: Kind = TRAINING_KIND
    """What the checkpoint holds (see the module docstring); inferred for format 1."""
    versions: dict[str, str] = field(default_factory=dict)
    """torch / accelerate / transformers versions that wrote it."""
    created_unix: float = 0.0
    """When it was committed (seconds since the epoch)."""
    format: int = MANIFEST_FORMAT
    """Manifest format version (:data:`MANIFEST_FORMAT` when written now)."""
    training: dict[str, Any] | None = None
    """LoRA/QLoRA runs: the method and LoRA shape (:func:`fsdp_presets.train.lora.settings`); None: full."""
    source: str | None = None
    """``imported``: the Hugging Face folder it was made from."""
    contents: str | None = None
    """``imported``: what it holds, in words, for a reader of the file."""
    model_mesh: dict[str, Any] | None = None
    """A model transformers sharded at load time over a TP/EP mesh: its sizes
    (:meth:`fsdp_presets.train.model_mesh.ModelMesh.settings`); None for FSDP or DDP alone."""

    def __post_init__(self) -> None:
        problems = []
        for name, least in (("step", 0), ("samples_consumed", 0), ("world_size", 1), ("format", 1)):
            value = getattr(self, name)
            if type(value) is not int:
                problems.append(f"{name} {value!r} is not an integer")
            elif value < least:
                problems.append(f"{name} {value} < {least}")
        if type(self.format) is int and self.format > MANIFEST_FORMAT:
            problems.append(f"format {self.format} is newer than this version of fsdp-presets reads "
                            f"({MANIFEST_FORMAT}); upgrade fsdp-presets to read it")
        if self.kind not in KINDS:
            problems.append(f"kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if not isinstance(self.distributed_type, str):
            problems.append(f"distributed_type {self.distributed_type!r} is not a string")
        if self.fsdp is not None and not isinstance(self.fsdp, dict):
            problems.append(f"fsdp {self.fsdp!r} is not an object")
        if self.training is not None and not isinstance(self.training, dict):
            problems.append(f"training {self.training!r} is not an object")
        if self.model_mesh is not None and not isinstance(self.model_mesh, dict):
            problems.append(f"model_mesh {self.model_mesh!r} is not an object")
        elif self.model_mesh is not None:
            sizes = {key: self.model_mesh[key] for key in MESH_SIZE_KEYS if key in self.model_mesh}
            problems += [f"model_mesh {key} {size!r} is not a positive integer" for key, size in sizes.items()
                         if not (type(size) is int and size >= 1)]
        if not isinstance(self.config_digest, str):
            problems.append(f"config_digest {self.config_digest!r} is not a string")
        if not isinstance(self.files, dict):
            problems.append("files is not an object of path -> {sha256, bytes}")
        else:
            for relative, entry in self.files.items():
                problem = _file_entry_problem(relative, entry)
                if problem:
                    problems.append(problem)
                    break
        if problems:
            raise ValueError("invalid manifest: " + "; ".join(problems))

    @classmethod
    def from_json(cls, payload: Any) -> "Manifest":
        """A manifest from the parsed ``manifest.json`` (``ValueError`` naming every missing or
        malformed field); a format-1 manifest gets its kind inferred (:func:`inferred_kind`)."""
        if not isinstance(payload, dict):
            raise ValueError("invalid manifest: not a JSON object")
        known = {name for name in cls.__dataclass_fields__}
        required = [name for name, spec in cls.__dataclass_fields__.items()
                    if spec.default is MISSING and spec.default_factory is MISSING]
        missing = [name for name in required if name not in payload]
        if payload.get("format", 1) != 1 and "kind" not in payload:
            missing.append("kind")
        if missing:
            raise ValueError(f"invalid manifest: no {', '.join(missing)}")
        values = {key: value for key, value in payload.items() if key in known}
        values.setdefault("format", 1)  # NOTE: the first manifests always wrote it; a hand-made one may not
        values["kind"] = inferred_kind(payload)
        return cls(**values)

    @classmethod
    def read(cls, folder: str | os.PathLike) -> "Manifest":
        """Load ``folder/manifest.json`` (raises ``ValueError``/``OSError`` when missing or bad; see
        :func:`read_manifest_text` for its bounds)."""
        return cls.from_json(_parse(read_manifest_text(folder)))


def read_manifest_text(folder: str | os.PathLike) -> str:
    """The text of ``folder/manifest.json``: a regular file of at most ``CONFIG_MAX_BYTES`` (16 MiB;
    a manifest lists a few files per rank, about 150 bytes each)."""
    from fsdp_presets.fileio import CONFIG_MAX_BYTES, read_regular_text

    return read_regular_text(Path(folder) / MANIFEST, limit=CONFIG_MAX_BYTES)


def _parse(text: str) -> Any:
    """JSON, with a nesting too deep for the parser (``RecursionError``) read as bad JSON."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("invalid manifest: nested too deep") from None


def read_manifest_json(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The raw ``manifest.json`` of a checkpoint folder (every key, also those :class:`Manifest`
    does not know), or None when there is none or it is not a JSON object."""
    try:
        payload = _parse(read_manifest_text(folder))
    except (OSError, ValueError):
        return None
    return payload if isinstance(payload, dict) else None


def manifest_kind(folder: str | os.PathLike) -> str | None:
    """The kind of the checkpoint in ``folder`` as its manifest says or implies (unverified), or
    None without a readable manifest."""
    payload = read_manifest_json(folder)
    return None if payload is None else inferred_kind(payload)


def is_imported(folder: str | os.PathLike) -> bool:
    """True for a checkpoint written by ``fsdp-presets import`` (model weights only)."""
    return manifest_kind(folder) == IMPORTED_KIND


def _file_entry_problem(relative: Any, entry: Any) -> str | None:
    """What is wrong with one ``files`` entry of a manifest, or None."""
    if not isinstance(relative, str) or not relative:
        return f"file name {relative!r} is not a path"
    if not isinstance(entry, dict):
        return f"file {relative!r}: entry is not an object with sha256 and bytes"
    digest, size = entry.get("sha256"), entry.get("bytes")
    if not isinstance(digest, str) or not _SHA256.match(digest):
        return f"file {relative!r}: sha256 {digest!r} is not 64 hex digits"
    if type(size) is not int or size < 0:
        return f"file {relative!r}: bytes {size!r} is not a size"
    return None


def inside_path_problem(relative: str) -> str | None:
    """Why a manifest path would leave the checkpoint folder (absolute, ``..``, a drive or a
    backslash), or None: a checkpoint is a closed folder."""
    pure = PurePosixPath(relative)
    if pure.is_absolute() or "\\" in relative or ":" in relative or any(part in ("..", ".", "") for part in
                                                                     relative.split("/")):
        return f"{MANIFEST} lists {relative!r}, a path outside the checkpoint folder (paths must be plain " \
               "relative names inside it)"
    return None


def recorded_global_batch(folder: str | os.PathLike, *, step: int, samples_consumed: int) -> int | None:
    """Samples per optimizer step of the run that wrote the checkpoint in ``folder``.

    The run folder's ``run.json`` (``OUTPUT_DIR/run.json`` for ``OUTPUT_DIR/checkpoints/step-N``)
    is used when it agrees with the checkpoint (``step x global batch == samples consumed``);
    otherwise ``samples_consumed / step`` when that divides exactly; None at step 0 (nothing to
    keep) or when neither is known.
    """
    if step <= 0:
        return None
    run = run_info_of(folder)
    recorded = run.global_batch_samples if run and type(run.global_batch_samples) is int else 0
    if recorded > 0 and recorded * step == samples_consumed:
        return recorded
    if samples_consumed % step == 0 and samples_consumed > 0:
        return samples_consumed // step
    return None
