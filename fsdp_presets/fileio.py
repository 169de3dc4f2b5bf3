"""Files written so that a crash never leaves half of one, byte counts as people read them, and the
SHA-256 digests that run.json and checkpoint manifests record.

- **Atomic writes** (:func:`write_text_atomic`, :func:`write_bytes_atomic`, :func:`write_json_atomic`,
  :func:`atomic_path`): the content goes to a temporary sibling (``tempfile.mkstemp`` in the same
  folder, so two writers never share one), is flushed to disk, and ``os.replace`` puts it in place
  (atomic on POSIX file systems): a reader sees the old file or the new one.
- **Staged folders** (:func:`staged_folder`, the one way a folder is written in this package): a
  folder is written under a hidden sibling name and renamed into place when complete; a folder it
  replaces is renamed away first and deleted after (never deleted before the new one is complete).
  The sibling names are the caller's (a run folder's and a checkpoint's come from
  :mod:`fsdp_presets.checkpoint.layout`).
- **Units for people** (:func:`format_bytes`, :func:`byte_unit`, :func:`format_count`, :data:`GiB`,
  :data:`MiB`): bytes in binary units as the planner counts (decimal for traffic), parameter counts.
  Every command, message and preset header formats bytes and counts with these.
- **Printing names** (:func:`printable`): control characters of a name shown escaped.
- **Text tables** (:func:`text_table`): the commands' fixed-width columns, numbers right-aligned.
- **Digests** (:func:`sha256_file`, :func:`sha256_files`, :func:`config_digest`).
- **Bounded reads** (:func:`read_regular_bytes`, :func:`read_regular_text`, :func:`load_yaml_data`): a file a user or a
  checkpoint names is read only when it is a regular file (a FIFO would block forever,
  ``/dev/zero`` never ends) and no larger than the reader's limit, checked before reading.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

GiB = 1024**3
"""Bytes in a gibibyte: GPU memory is sold and reported (``nvidia-smi``) in these."""
MiB = 1024**2
KiB = 1024

_CHUNK_BYTES = 1 << 20  # 1 MiB reads: large enough for disk throughput, small enough for RAM

# Keys of a transformers config that change with the library or the folder, not with the model.
_VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path", "torch_dtype", "dtype", "_commit_hash",
                         "architectures", "use_cache")


class UnreadableFile(OSError):
    """A file refused before reading: not a regular file, or larger than its reader's limit."""


def read_regular_bytes(path: str | os.PathLike, *, limit: int) -> bytes:
    """The bytes of ``path`` when it is a regular file (after links) of at most ``limit`` bytes;
    otherwise :class:`UnreadableFile` (an ``OSError``) naming what it is. At most ``limit + 1``
    bytes are ever read, so a file that grows while read is refused too."""
    import stat

    path = Path(path)
    with open(path, "rb", opener=lambda name, flags: os.open(name, flags | os.O_NONBLOCK)) as handle:
        status = os.fstat(handle.fileno())
        if not stat.S_ISREG(status.st_mode):
            raise UnreadableFile(_not_regular(path, status.st_mode))
        if status.st_size > limit:
            raise UnreadableFile(f"{path} holds {format_bytes(status.st_size)}, more than the "
                                 f"{format_bytes(limit)} this reader accepts")
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise UnreadableFile(f"{path} grew past the {format_bytes(limit)} this reader accepts while read")
    return data


def _not_regular(path: Path, mode: int) -> str:
    import stat

    kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
    return f"{path} is {kind}, not a regular file; pass a file"


def not_regular_problem(path: str | os.PathLike) -> str | None:
    """What an existing ``path`` is when it is not a regular file (after links), as
    :func:`read_regular_bytes` says it; None for a regular file or a path that does not exist.
    Nothing is opened, so a FIFO never blocks."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    return None if stat.S_ISREG(mode) else _not_regular(Path(path), mode)


def read_regular_text(path: str | os.PathLike, *, limit: int) -> str:
    """:func:`read_regular_bytes` decoded as UTF-8 (``UnicodeDecodeError`` when it is not)."""
    return read_regular_bytes(path, limit=limit).decode("utf-8")


CONFIG_MAX_BYTES = 16 * 1024**2
"""Largest JSON config read (a model's ``config.json``, a checkpoint's JSON files): 16 MiB. The
largest published ``config.json`` files (with id-to-label tables) are a few hundred KiB."""
MODEL_FILE_MAX_BYTES = 256 * 1024**2
"""Largest tokenizer, chat template or other text file of a model folder (``*.json``, ``*.jinja``,
``*.txt``, ``*.model``, ``*.tiktoken``) that ``import`` and ``export`` let transformers read whole:
256 MiB. The largest published ``tokenizer.json`` files are a few tens of MiB."""
YAML_MAX_BYTES = 1024**2
"""Largest accelerate config (or preset) read: 1 MiB. A generated preset is about 3 KiB."""
YAML_MAX_DEPTH = 32
"""Deepest nesting of mappings and lists admitted in a YAML config (accelerate's nest 3 deep)."""


def load_yaml_data(text: str) -> Any:
    """``yaml.safe_load`` of ``text`` (at most :data:`YAML_MAX_BYTES`) with no anchors or aliases
    (a few of them make a "billion laughs": gigabytes from a few lines) and at most
    :data:`YAML_MAX_DEPTH` levels of nesting; a refused text raises ``yaml.YAMLError`` saying why,
    checked on the parser's events before any value is built."""
    import yaml

    if len(text) > YAML_MAX_BYTES:
        raise yaml.YAMLError(f"it holds {format_bytes(len(text))}, more than the {format_bytes(YAML_MAX_BYTES)} a "
                             "config may hold")
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise yaml.YAMLError("it uses YAML anchors or aliases (&name, *name), which a config never needs; "
                                 "write each value out")
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > YAML_MAX_DEPTH:
                raise yaml.YAMLError(f"it nests deeper than {YAML_MAX_DEPTH} levels, which a config never does")
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
    return yaml.safe_load(text)


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


def file_mode(path: str | os.PathLike) -> int:
    """The mode a rewritten file keeps: the existing file's, else what the umask gives a new file
    (``mkstemp`` alone would make it 0600)."""
    path = Path(path)
    if path.exists():
        return path.stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def temporary_sibling(path: str | os.PathLike, *, suffix: str = ".tmp") -> Path:
    """A new, empty, hidden file next to ``path`` (``.NAME.XXXXXXXX.tmp``) with the mode ``path``
    will have: write it, then ``os.replace`` it onto ``path`` (the caller removes it on failure)."""
    path = Path(path)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.close(handle)
    os.chmod(temporary, file_mode(path))
    return Path(temporary)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, mode: int | None = None, suffix: str = ".tmp") -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` to write (by any means: ``savefig``, a writer that takes a
    path); when the block ends without an error it is flushed to disk and renamed onto ``path``,
    otherwise removed. ``mode``: the file's permissions (default: those of the file it replaces, or
    the umask's); ``suffix``: the temporary name's (a writer that infers the format from it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_sibling(path, suffix=suffix)
    try:
        yield temporary
        if mode is not None:
            os.chmod(temporary, mode)
        with open(temporary, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_bytes_atomic(path: str | os.PathLike, data: bytes, *, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the new one, never half of one."""
    with atomic_path(path, mode=mode) as temporary:
        temporary.write_bytes(data)


def write_text_atomic(path: str | os.PathLike, text: str, *, mode: int | None = None) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (see :func:`write_bytes_atomic`)."""
    write_bytes_atomic(path, text.encode("utf-8"), mode=mode)


def write_json_atomic(path: str | os.PathLike, payload: Any) -> None:
    """Write JSON (indented, a final newline) to ``path`` atomically."""
    write_text_atomic(path, json.dumps(payload, indent=2, sort_keys=False) + "\n")


def replace_folder(staging: Path, output: Path, *, retired: Path) -> None:
    """Put the complete folder ``staging`` in place of ``output``: an existing non-empty ``output`` is
    renamed to ``retired`` first and deleted after (an empty one is removed), so ``output`` is at
    every moment the old folder, absent, or the new one."""
    staging, output = Path(staging), Path(output)
    old = None
    if output.exists():
        if output.is_dir() and not output.is_symlink() and not any(output.iterdir()):
            output.rmdir()
        else:
            os.rename(output, retired)
            old = retired
    os.rename(staging, output)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged_folder(output: str | os.PathLike, *, staging: Path, retired: Callable[[], Path],
                  merge: bool = False) -> Iterator[Path]:
    """Yield the empty folder ``staging`` (a leftover of it is removed first) to write into; when
    the block ends without an error it replaces ``output`` (:func:`replace_folder`, with the name
    ``retired()`` gives for the old folder), otherwise it is deleted and the error goes on. With
    ``merge`` the complete folder's files are renamed one by one into ``output`` instead (each
    rename atomic), and what else ``output`` holds stays (Trainer's ``save_model()`` writes into its
    output folder, beside the checkpoints)."""
    output, staging = Path(output), Path(staging)
    output.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
        if merge:
            output.mkdir(exist_ok=True)
            for entry in sorted(staging.iterdir()):
                os.replace(entry, output / entry.name)
            staging.rmdir()
        else:
            replace_folder(staging, output, retired=retired())
    except BaseException:  # DCP's CheckpointException is a BaseException
        shutil.rmtree(staging, ignore_errors=True)
        raise


def byte_unit(largest: float, *, binary: bool = True) -> tuple[str, int]:
    """``(name, bytes)`` of the largest unit that ``largest`` fills at least once (KiB or kB at the
    least): the unit of a table or a plot whose largest value is ``largest``."""
    units = (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)) if binary else (("GB", 10**9), ("MB", 10**6), ("kB", 10**3))
    for name, size in units:
        if largest >= size:
            return name, size
    return units[-1]


def format_bytes(count: float, *, binary: bool = True, digits: int | None = None) -> str:
    """``count`` bytes in the largest unit that keeps it at least 1: ``80.0 GiB``, ``864.4 KiB``
    (memory: binary units, 1 decimal), ``41.24 GB`` (``binary=False``, traffic: decimal units, 2
    decimals), ``512 B``."""
    digits = (1 if binary else 2) if digits is None else digits
    if abs(count) < (KiB if binary else 10**3):
        return f"{count:.0f} B"
    name, size = byte_unit(abs(count), binary=binary)
    return f"{count / size:.{digits}f} {name}"


def printable(text: str) -> str:
    """``text`` safe to print on one terminal line: control and format characters (escape sequences,
    carriage returns, newlines, right-to-left overrides) written as ``\\x1b``, ``\\r``, ``\\u202e``. File
    names from a checkpoint go through it, so no name can redraw what a command prints."""
    import unicodedata

    return "".join(character.encode("unicode_escape").decode("ascii") if unicodedata.category(character)[0] == "C"
                   else character for character in text)


def format_count(count: float, *, compact: bool = False) -> str:
    """A parameter count at a glance: ``70.55 B``, ``26.80 K`` (the commands' tables), or with
    ``compact`` ``8.03B``, ``218.1M``, ``26.80K`` (preset headers and messages: no space, millions
    with 1 decimal, no T). Below a thousand the whole number: ``512``."""
    units = ((10**9, "B"), (10**6, "M"), (10**3, "K")) if compact else ((10**12, "T"), (10**9, "B"), (10**6, "M"),
                                                                        (10**3, "K"))
    for size, suffix in units:
        if abs(count) >= size:
            digits = 1 if compact and size == 10**6 else 2
            return f"{count / size:.{digits}f}{'' if compact else ' '}{suffix}"
    return f"{count:.0f}"


def text_table(headers: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    """The lines of a plain-text table (the commands' human output): each column as wide as its
    widest cell, the columns whose index is in ``right`` right-aligned, two spaces between columns,
    no trailing spaces."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            str(cell).rjust(width) if index in right else str(cell).ljust(width)
            for index, (cell, width) in enumerate(zip(cells, widths))
        ).rstrip()

    return [line(headers)] + [line(row) for row in rows]
