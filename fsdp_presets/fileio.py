"""SHA-256 digests of files and model configs: what run.json and checkpoint manifests record so that
a checkpoint of another model, other data or a tampered file is recognised."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable

_CHUNK_BYTES = 1 << 20  # 1 MiB reads: large enough for disk throughput, small enough for RAM

# Keys of a transformers config that change with the library or the folder, not with the model.
_VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path", "torch_dtype", "dtype", "_commit_hash",
                         "architectures", "use_cache")


def sha256_file(path: str | os.PathLike) -> str:
    """Hex SHA-256 of one file's bytes."""
    hasher = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(_CHUNK_BYTES), b""):
            hasher.update(chunk)
    return hasher.hexdigest()


def sha256_files(paths: Iterable[str | os.PathLike]) -> str:
    """Hex SHA-256 over several files in the given order (name-independent: only the contents
    count, so moving a data file does not make it "other data")."""
    hasher = hashlib.sha256()
    for path in paths:
        hasher.update(bytes.fromhex(sha256_file(path)))
    return hasher.hexdigest()


def config_digest(config: Any) -> str:
    """Hex SHA-256 of a model config (a ``PretrainedConfig`` or its dict) that ignores the keys
    that vary with the transformers version or the folder it was loaded from."""
    values = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    for key in _VOLATILE_CONFIG_KEYS:
        values.pop(key, None)
    canonical = json.dumps(values, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def write_json_atomic(path: str | os.PathLike, payload: Any) -> None:
    """Write JSON to ``path`` so that a reader sees the old file or the new one, never half of one:
    write a sibling, flush it to disk, then ``os.replace`` (atomic on POSIX file systems)."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "w") as handle:
        json.dump(payload, handle, indent=2, sort_keys=False)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
