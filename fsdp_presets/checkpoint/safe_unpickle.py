"""Reading the pickles inside a checkpoint without running code from them.

A checkpoint comes from elsewhere (another cluster, a colleague, the internet) and its author
controls every byte of it, ``manifest.json`` included, so checksums cannot make it safe. Three of
its formats are pickles:

- DCP's ``.metadata`` (the index of a DCP folder). torch's ``FileSystemReader.read_metadata``
  reads it with plain ``pickle.load``: a ``__reduce__`` in it runs any command.
- The non-tensor items of a DCP folder (an optimizer's ``param_groups``: lr, betas, ...), stored
  as ``torch.save`` bytes inside the ``.distcp`` files. torch's ``DefaultLoadPlanner.load_bytes``
  reads them with ``torch.load(weights_only=False)``: the same hole.
- accelerate's ``random_states_<rank>.pkl``, ``scheduler.bin``, ``optimizer.bin`` and
  ``pytorch_model_fsdp.bin``. accelerate 1.16 loads these with ``torch.load(weights_only=True)``
  (``accelerate.utils.other.load`` defaults it, ``load_fsdp_model``/``load_fsdp_optimizer`` pass
  it): safe, but a refused random-state file is skipped with a log line nobody sees, and a refused
  scheduler file is a traceback. ``custom_checkpoint_<n>.pkl`` (the state of objects registered
  with ``register_for_checkpointing``) it loads with ``weights_only=False``: the recipes register
  none, so such a file is refused outright.

What this module does about each:

- :class:`MetadataUnpickler` admits only the types a DCP index is made of (the
  ``torch.distributed.checkpoint.metadata`` dataclasses, ``_StorageInfo``, ``torch.Size``, dtypes,
  layouts, paths); anything else is refused before it is looked up, so nothing of the file runs.
  :func:`read_dcp_metadata` then checks the structure (every shard file a plain name inside the
  folder, offsets and lengths non-negative integers). Before unpickling, the file must be a regular
  file of at most :data:`~fsdp_presets.checkpoint.pickle_bounds.METADATA_MAX_BYTES` (256 MiB) and
  its opcode stream nest at most :data:`~fsdp_presets.checkpoint.pickle_bounds.METADATA_MAX_DEPTH`
  (64) levels (:func:`~fsdp_presets.checkpoint.pickle_bounds.check_pickle_bounds`), and
  ``bytearray`` is admitted only from bytes: what it builds is in proportion to the file.
- :class:`SafeFileSystemReader` and :class:`SafeLoadPlanner` are torch's reader and planner with
  those two reads replaced (metadata through the allow-list, bytes items with
  ``weights_only=True``); the project's own DCP reads use them.
- :func:`vet_checkpoint_pickles` reads every pickle of a checkpoint folder the safe way and names
  the first one refused; the recipes, ``inspect-checkpoint`` and ``export`` call it (through
  :func:`fsdp_presets.checkpoint.verify.verify_checkpoint`) before anything else reads the folder.
- :func:`safe_dcp_loading` hands the safe reader and planner to accelerate's ``load_state``, which
  builds its own ``FileSystemReader`` and ``DefaultLoadPlanner`` inside ``load_fsdp_model`` and
  ``load_fsdp_optimizer`` (no argument reaches them): the two names are swapped in torch's modules
  for the duration of the load, so even a file changed after vetting is read safely.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import re
from pathlib import Path
from typing import Any, Iterator

from fsdp_presets.checkpoint.layout import DCP_METADATA
from fsdp_presets.checkpoint.pickle_bounds import (METADATA_MAX_BYTES, PickleOutOfBounds, bytearray_of_data,
                                                   check_pickle_bounds)
from fsdp_presets.errors import UsageError
from fsdp_presets.fileio import read_regular_bytes

# A DCP shard file name as torch writes it (``__<rank>_<n>.distcp``); the index may name no other.
DCP_SHARD_FILE = re.compile(r"^__\d+_\d+\.distcp$")
# accelerate's other pickles in a checkpoint folder (accelerate.utils.constants names), read with
# torch.load(weights_only=True) by accelerate itself.
TORCH_PICKLE_SUFFIXES = (".pkl", ".bin", ".pt", ".pth")


class UnsafeCheckpointError(UsageError):
    """A file of a checkpoint holds something other than data: it was refused, nothing of it ran."""


def _allowed_globals() -> dict[tuple[str, str], Any]:
    import pathlib

    import torch
    from torch.distributed.checkpoint import filesystem, metadata

    allowed: dict[tuple[str, str], Any] = {}
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                 "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"):
        allowed[("torch.distributed.checkpoint.metadata", name)] = getattr(metadata, name)
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    # dtypes (torch.float32 pickles as the global torch.float32), layouts and memory formats:
    # values, not callables.
    for name, value in vars(torch).items():
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[("torch", name)] = value
    allowed[("torch.serialization", "_get_layout")] = _layout_by_name
    # StorageMeta.checkpoint_id is the path the checkpoint was saved to: a pure path object.
    for module in ("pathlib", "pathlib._local"):  # pathlib._local: Python >= 3.13
        for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"):
            allowed[(module, name)] = pathlib.PurePosixPath if "Posix" in name or name == "Path" else \
                pathlib.PureWindowsPath
    allowed[("collections", "OrderedDict")] = __import__("collections").OrderedDict
    for name in ("set", "frozenset", "complex"):
        allowed[("builtins", name)] = getattr(__import__("builtins"), name)
    allowed[("builtins", "bytearray")] = bytearray_of_data
    return allowed


def _layout_by_name(name: Any):
    """torch.serialization._get_layout, limited to a string naming one of torch's layouts."""
    import torch

    layouts = {str(value): value for value in vars(torch).values() if isinstance(value, torch.layout)}
    if not isinstance(name, str) or name not in layouts:
        raise pickle.UnpicklingError(f"unknown tensor layout {name!r}")
    return layouts[name]


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the checkpoint-metadata types (see the module docstring)."""

    _allowed: dict[tuple[str, str], Any] | None = None

    def find_class(self, module: str, name: str) -> Any:
        if MetadataUnpickler._allowed is None:
            MetadataUnpickler._allowed = _allowed_globals()
        try:
            return MetadataUnpickler._allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"it calls {module}.{name}, which is not a checkpoint-metadata type") from None

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds a persistent reference, which DCP metadata never does")


def _refusal(path: Path, why: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{path}: refused: {why}. The file was not loaded and nothing in it ran; a checkpoint may hold only "
        "data. Use a checkpoint from a source you trust, or ask its author for a clean copy")


def loads_metadata(data: bytes, path: Path):
    """Unpickle the bytes of a DCP ``.metadata`` through the allow-list and check its structure;
    a pickle out of bounds (:func:`check_pickle_bounds`) is refused before any of it is unpickled."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        check_pickle_bounds(data)
    except PickleOutOfBounds as error:
        raise _refusal(path, str(error)) from None
    try:
        metadata = MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as error:
        raise _refusal(path, str(error)) from None
    except Exception as error:  # a damaged file: truncated, wrong types for the allowed classes
        raise UsageError(f"{path}: cannot be read ({type(error).__name__}: {str(error)[:200]}); the file is "
                         "damaged") from None
    if not isinstance(metadata, Metadata):
        raise _refusal(path, f"it holds a {type(metadata).__name__}, not DCP Metadata")
    _check_metadata_structure(metadata, path)
    return metadata


def _check_metadata_structure(metadata, path: Path) -> None:
    """Every field DCP reads later must be of the type torch writes: a shard file is a plain name
    in the same folder (so no read leaves it), offsets and lengths are non-negative integers."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, MetadataIndex,
                                                       TensorStorageMetadata)

    def bad(what: str) -> UnsafeCheckpointError:
        return _refusal(path, f"its index is malformed ({what})")

    if not isinstance(metadata.state_dict_metadata, dict):
        raise bad("state_dict_metadata is not a dict")
    for key, item in metadata.state_dict_metadata.items():
        if not isinstance(key, str) or not isinstance(item, (TensorStorageMetadata, BytesStorageMetadata)):
            raise bad(f"entry {key!r}")
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise bad("storage_data is not a dict")
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise bad(f"storage entry {index!r}")
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not DCP_SHARD_FILE.match(name):
            raise bad(f"{index.fqn!r} is stored in {name!r}, not a shard file of this folder (__<rank>_<n>.distcp)")
        for field_name in ("offset", "length"):
            value = getattr(info, field_name, None)
            if type(value) is not int or value < 0:
                raise bad(f"{index.fqn!r} has {field_name} {value!r}")
        if getattr(info, "transform_descriptors", None):
            raise bad(f"{index.fqn!r} names storage transforms {info.transform_descriptors!r}, which this "
                      "project never writes")
    if metadata.planner_data is not None and not isinstance(metadata.planner_data, dict):
        raise bad("planner_data is not a dict")


def read_dcp_metadata(folder: Path):
    """The ``Metadata`` of a DCP folder, read through the allow-list (see :func:`loads_metadata`)."""
    return loads_metadata(read_metadata_bytes(Path(folder) / DCP_METADATA), Path(folder) / DCP_METADATA)


def read_metadata_bytes(path: Path) -> bytes:
    """The bytes of a ``.metadata`` file: a regular file of at most ``METADATA_MAX_BYTES``."""
    if not path.exists():
        raise UsageError(f"{path}: missing; the DCP folder has no index of its shards")
    try:
        return read_regular_bytes(path, limit=METADATA_MAX_BYTES)
    except OSError as error:
        raise UsageError(f"{error}; the DCP folder's index cannot be read") from None


def load_torch_bytes(data: bytes | io.BytesIO, where: str) -> Any:
    """A ``torch.save`` payload loaded with ``weights_only=True``; refused naming ``where``."""
    import torch

    stream = data if isinstance(data, io.BytesIO) else io.BytesIO(data)
    try:
        return torch.load(stream, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise _refusal(Path(where), "torch.load(weights_only=True) rejects it: it holds Python objects other "
                       f"than tensors and plain values ({_first_line(error)})") from None


def vet_dcp_folder(folder: Path):
    """Read a DCP folder's index safely and load each of its non-tensor items with
    ``weights_only=True`` (as :class:`SafeLoadPlanner` will); returns the metadata."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    folder = Path(folder)
    metadata = read_dcp_metadata(folder)
    byte_items = {fqn for fqn, item in metadata.state_dict_metadata.items() if isinstance(item, BytesStorageMetadata)}
    sizes: dict[str, int] = {}
    for index, info in sorted(metadata.storage_data.items(), key=lambda pair: (pair[1].relative_path, pair[1].offset)):
        path = folder / info.relative_path
        if info.relative_path not in sizes:
            sizes[info.relative_path] = path.stat().st_size if path.is_file() else -1
        if info.offset + info.length > sizes[info.relative_path]:  # refused before any read allocates it
            raise UsageError(f"{path}: truncated or missing ({folder / DCP_METADATA} lists {index.fqn} at bytes "
                             f"{info.offset}..{info.offset + info.length}, past the end of the file)")
        if index.fqn not in byte_items:
            continue
        try:
            with open(path, "rb") as handle:
                handle.seek(info.offset)
                data = handle.read(info.length)
        except OSError as error:
            raise UsageError(f"{path}: cannot be read ({error})") from None
        if len(data) != info.length:
            raise UsageError(f"{path}: truncated ({folder / DCP_METADATA} lists bytes beyond its end)")
        try:
            load_torch_bytes(data, f"{path}: item {index.fqn}")
        except UnsafeCheckpointError:
            raise
        except Exception as error:
            raise UsageError(f"{path}: item {index.fqn} cannot be read ({type(error).__name__}); the file is "
                             "damaged") from None
    return metadata


def vet_torch_file(path: Path) -> None:
    """Load a ``torch.save`` file of accelerate's (random states, scheduler, optimizer, model) the
    way accelerate does, ``weights_only=True`` with accelerate's numpy allowances, memory-mapped so
    that a large file costs no memory; refused naming the file."""
    import torch
    from accelerate.utils.other import TORCH_SAFE_GLOBALS

    try:
        with torch.serialization.safe_globals(TORCH_SAFE_GLOBALS):
            try:
                torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as error:
                if "mmap" not in str(error):
                    raise
                torch.load(path, map_location="cpu", weights_only=True)  # legacy (non-zip) format
    except pickle.UnpicklingError as error:
        raise _refusal(path, "torch.load(weights_only=True) rejects it: it holds Python objects other than "
                       f"tensors and plain values ({_first_line(error)})") from None
    except Exception as error:
        raise UsageError(f"{path}: cannot be read ({type(error).__name__}: {_first_line(error)}); the file is "
                         "truncated or damaged") from None


def vet_checkpoint_pickles(folder: Path) -> None:
    """Every pickle of a checkpoint folder read the safe way (see the module docstring); raises
    :class:`UnsafeCheckpointError` naming the first refused file, :class:`UsageError` for a
    damaged one. DCP folders are the folders that hold a ``.metadata``."""
    folder = Path(folder)
    for custom in sorted(folder.rglob("custom_checkpoint_*.pkl")):
        raise _refusal(custom, "accelerate loads a registered object's custom state with "
                       "torch.load(weights_only=False), and the recipes register none")
    for metadata in sorted(folder.rglob(DCP_METADATA)):
        vet_dcp_folder(metadata.parent)
    for path in sorted(folder.rglob("*")):
        if path.suffix in TORCH_PICKLE_SUFFIXES and path.is_file() and not path.is_symlink():
            vet_torch_file(path)


# ---- torch's reader and planner, with the two unsafe reads replaced ----
def _safe_classes():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafeFileSystemReader(dcp.FileSystemReader):
        """torch's ``FileSystemReader`` whose ``.metadata`` goes through the allow-list."""

        def read_metadata(self, *args: Any, **kwargs: Any):
            from torch.distributed.checkpoint.metadata import StorageMeta

            path = Path(self._get_metadata_path(kwargs.get("rank")))
            metadata = loads_metadata(read_metadata_bytes(path), path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafeLoadPlanner(DefaultLoadPlanner):
        """torch's ``DefaultLoadPlanner`` that loads non-tensor items with ``weights_only=True``."""

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            from torch.distributed.checkpoint._traverse import set_element as set_nested

            loaded = load_torch_bytes(value, f"DCP item {read_item.dest_index.fqn}")
            if self.flatten_state_dict:
                set_nested(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafeFileSystemReader, SafeLoadPlanner


_SAFE: tuple[type, type] | None = None


def safe_reader_and_planner() -> tuple[type, type]:
    """``(SafeFileSystemReader, SafeLoadPlanner)`` classes (built once, torch imported lazily)."""
    global _SAFE
    if _SAFE is None:
        _SAFE = _safe_classes()
    return _SAFE


def safe_dcp_load(state: dict, folder: str | Path, *, no_dist: bool) -> None:
    """``torch.distributed.checkpoint.load`` with the safe reader and planner."""
    import torch.distributed.checkpoint as dcp

    reader, planner = safe_reader_and_planner()
    dcp.load(state, storage_reader=reader(str(folder)), planner=planner(), no_dist=no_dist)


@contextlib.contextmanager
def safe_dcp_loading() -> Iterator[None]:
    """While inside, ``torch.distributed.checkpoint.FileSystemReader`` and ``DefaultLoadPlanner``
    are the safe ones, for code that builds its own (accelerate's ``load_state``)."""
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.default_planner as default_planner
    import torch.distributed.checkpoint.filesystem as filesystem

    reader, planner = safe_reader_and_planner()
    saved = (dcp.FileSystemReader, filesystem.FileSystemReader, default_planner.DefaultLoadPlanner)
    dcp.FileSystemReader = filesystem.FileSystemReader = reader
    default_planner.DefaultLoadPlanner = planner
    try:
        yield
    finally:
        dcp.FileSystemReader, filesystem.FileSystemReader, default_planner.DefaultLoadPlanner = saved


def _first_line(error: BaseException) -> str:
    """The telling line of an error: for torch's weights_only refusal, the global it refused
    (its first line is advice about torch versions)."""
    text = str(error).strip()
    for line in text.splitlines():
        if "Unsupported global" in line or "unsupported GLOBAL" in line or "Unsupported operand" in line:
            return line.strip().rstrip(".")[:200]
    return text.splitlines()[0][:200] if text else type(error).__name__
