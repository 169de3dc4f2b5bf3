"""What a recipe checkpoint folder holds, and reading its model tensors a few at a time.

``accelerator.save_state`` writes one of three layouts (accelerate 1.x names):

=========  ==============================  ===================================  ====================
layout     written by                      model                                optimizer
=========  ==============================  ===================================  ====================
``dcp``    FSDP, ``SHARDED_STATE_DICT``    ``pytorch_model_fsdp_0/`` (DCP)      ``optimizer_0/`` (DCP)
``full``   FSDP, ``FULL_STATE_DICT``       ``pytorch_model_fsdp.bin``           ``optimizer.bin``
``ddp``    DDP or one process              ``model.safetensors``                ``optimizer.bin``
``adapter``  a LoRA run (any strategy)     ``adapter_model_0/`` (DCP, trainable  ``adapter_optimizer_0/``
                                           weights only)                        (DCP)
=========  ==============================  ===================================  ====================

A DCP folder is ``.metadata`` (every tensor's global shape, dtype, and which byte range of which
file holds each of its chunks) plus one ``__<rank>_<n>.distcp`` file per writing rank.

Reading (:class:`WeightReader`): ``entries()`` lists every tensor's name, shape and dtype without
reading tensor data; ``read(names)`` returns only those tensors, so a caller that reads one output
shard at a time holds about one shard in memory:

- ``dcp``: DCP's own loader without a process group (``torch.distributed.checkpoint.load(...,
  no_dist=True)``) into empty tensors of the requested names; its ``FileSystemReader`` reads only
  the byte ranges that ``.metadata`` lists for them, and reassembles the ranks' chunks. The index
  and any non-tensor item are read without running code (:mod:`fsdp_presets.checkpoint.safe_unpickle`).
- ``full``: ``torch.load(mmap=True, weights_only=True)``: tensors are views of the memory-mapped
  file, read from disk when touched (the file is one pickle, so this is as lazy as it gets).
- ``ddp`` (and Hugging Face folders): ``safetensors.safe_open`` reads one tensor at a time.
"""

from __future__ import annotations

import json
import pickle
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fsdp_presets.checkpoint.layout import (ADAPTER_MODEL, ADAPTER_OPTIMIZER, DCP_METADATA, DCP_MODEL,
                                            DCP_OPTIMIZER, DCP_RANK_FILE, DDP_MODEL, FULL_MODEL, OPTIMIZER_BIN,
                                            HF_WEIGHT_FILES, RNG_STATE_GLOB, WEIGHTS_SUFFIX, rng_state_rank)
from fsdp_presets.errors import UsageError

Layout = Literal["dcp", "full", "ddp", "adapter"]
_RANK_FILE = DCP_RANK_FILE
# safetensors dtype names (https://github.com/huggingface/safetensors, format spec) -> torch names
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                       "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
                       "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


@dataclass(frozen=True, kw_only=True)
class TensorInfo:
    """Shape and dtype of one stored tensor."""

    shape: tuple[int, ...]
    """Global shape (the whole tensor, not one rank's shard)."""
    dtype: Any
    """``torch.dtype``."""

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count


@dataclass(kw_only=True)
class CheckpointFiles:
    """Where a checkpoint keeps its model and optimizer."""

    folder: Path
    """The checkpoint folder (``checkpoints/step-NNNNNNNN``)."""
    layout: Layout
    """How the model was saved (see the module docstring)."""
    model: Path
    """The model's DCP folder or file."""
    optimizer: Path | None
    """The optimizer's DCP folder or file (None for an imported checkpoint: weights only)."""


def find_checkpoint_files(folder: str | Path, *, require_metadata: bool = True) -> CheckpointFiles:
    """Recognise the layout of a checkpoint folder; :class:`UsageError` naming what is missing
    (a DCP folder without ``.metadata`` too, unless ``require_metadata`` is False)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UsageError(f"{folder}: no such checkpoint folder (give OUTPUT_DIR/checkpoints/step-NNNNNNNN)")
    candidates: list[tuple[Layout, Path, Path]] = [
        ("dcp", folder / DCP_MODEL, folder / DCP_OPTIMIZER),
        ("adapter", folder / ADAPTER_MODEL, folder / ADAPTER_OPTIMIZER),
        ("full", folder / FULL_MODEL, folder / OPTIMIZER_BIN),
        ("ddp", folder / DDP_MODEL, folder / OPTIMIZER_BIN),
    ]
    for layout, model, optimizer in candidates:
        if model.exists():
            if layout in ("dcp", "adapter") and require_metadata and not (model / DCP_METADATA).is_file():
                raise UsageError(f"{model / DCP_METADATA}: missing; the DCP folder {model.name} has no index "
                                 "of its shards, so the checkpoint cannot be read (restore the file, or use "
                                 "another checkpoint)")
            return CheckpointFiles(folder=folder, layout=layout, model=model,
                                   optimizer=optimizer if optimizer.exists() else None)
    raise UsageError(f"{folder} holds no model weights ({DCP_MODEL}/, {FULL_MODEL} or {DDP_MODEL}); "
                     "is it a checkpoint folder of a recipe run (OUTPUT_DIR/checkpoints/step-NNNNNNNN)?")


# ---- DCP ----
def check_dcp_file_sizes(folder: Path, metadata) -> None:
    """Every byte range ``.metadata`` lists must lie inside its file: catches a truncated or
    missing shard before anything is read (and without a manifest to compare against)."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for relative, size in sorted(needed.items()):
        path = folder / relative
        if not path.is_file():
            raise UsageError(f"{path}: missing; {folder / DCP_METADATA} lists data in it")
        actual = path.stat().st_size
        if actual < size:
            raise UsageError(f"{path}: truncated ({actual} bytes; {folder / DCP_METADATA} needs at least {size})")


@dataclass(kw_only=True)
class RankFile:
    """One data file of a checkpoint and what it holds."""

    path: str
    """Path relative to the checkpoint folder."""
    rank: int | None
    """The rank that wrote it (None for files every rank shares or only the main process writes)."""
    tensors: int
    """Tensors (or tensor chunks, for DCP) stored in it."""
    bytes: int
    """Size on disk."""


def dcp_rank_files(folder: Path, relative_to: Path) -> list[RankFile]:
    """Per-file tensor counts of a DCP folder, from its ``.metadata`` (no tensor data is read)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from fsdp_presets.checkpoint.safe_unpickle import read_dcp_metadata  # the allow-list reader

    metadata = read_dcp_metadata(folder)
    tensor_keys = {fqn for fqn, item in metadata.state_dict_metadata.items()
                   if isinstance(item, TensorStorageMetadata)}
    counts: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        counts.setdefault(info.relative_path, 0)
        if index.fqn in tensor_keys:
            counts[info.relative_path] += 1
    files = []
    for relative in sorted(counts, key=_rank_sort_key):
        path = folder / relative
        match = _RANK_FILE.match(relative)
        files.append(RankFile(path=str(path.relative_to(relative_to)), rank=int(match.group(1)) if match else None,
                              tensors=counts[relative], bytes=path.stat().st_size if path.is_file() else 0))
    return files


def _rank_sort_key(name: str):
    match = _RANK_FILE.match(name)
    return (int(match.group(1)), int(match.group(2))) if match else (1 << 30, 0)


# ---- readers ----
class WeightReader:
    """Tensors of one stored state dict, listed without reading and read a few at a time."""

    path: Path
    """The file or DCP folder read (named in error messages)."""

    def entries(self) -> dict[str, TensorInfo]:
        raise NotImplementedError

    def read(self, names: list[str]) -> dict[str, Any]:
        raise NotImplementedError


class DcpReader(WeightReader):
    """A DCP folder saved as ``{"model": state_dict}`` (accelerate) or as a flat state dict."""

    def __init__(self, folder: Path) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from fsdp_presets.checkpoint.safe_unpickle import read_dcp_metadata  # the allow-list reader

        self.path = Path(folder)
        self._metadata = read_dcp_metadata(self.path)
        check_dcp_file_sizes(self.path, self._metadata)
        planner_data = self._metadata.planner_data or {}
        self._paths: dict[str, tuple] = {}
        self._entries: dict[str, TensorInfo] = {}
        for fqn, item in self._metadata.state_dict_metadata.items():
            if not isinstance(item, TensorStorageMetadata):
                continue
            path = tuple(planner_data.get(fqn, (fqn,)))
            # accelerate nests the model under "model"; the tensor's name is what follows it.
            name = path[1] if len(path) == 2 and path[0] == "model" else ".".join(map(str, path))
            self._paths[name] = path
            self._entries[name] = TensorInfo(shape=tuple(item.size), dtype=item.properties.dtype)

    def entries(self) -> dict[str, TensorInfo]:
        return dict(self._entries)

    def read(self, names: list[str]) -> dict[str, Any]:
        import torch

        from fsdp_presets.checkpoint.safe_unpickle import safe_dcp_load

        state: dict[Any, Any] = {}
        targets = {}
        for name in names:
            info = self._entries[name]
            tensor = torch.empty(info.shape, dtype=info.dtype)
            targets[name] = tensor
            node = state
            for part in self._paths[name][:-1]:
                node = node.setdefault(part, {})
            node[self._paths[name][-1]] = tensor
        try:
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.simplefilter("ignore")
                safe_dcp_load(state, self.path, no_dist=True)
        except UsageError:
            raise
        except Exception as error:
            raise UsageError(f"{self.path}: reading its shards failed ({type(error).__name__}: "
                             f"{_first_line(error)}); a shard file is damaged") from None
        return targets


class TorchFileReader(WeightReader):
    """A ``torch.save`` state dict, memory-mapped and loaded with ``weights_only=True`` (no code in
    the file can run)."""

    def __init__(self, path: Path) -> None:
        import torch

        self.path = Path(path)
        try:
            state = torch.load(self.path, map_location="cpu", mmap=True, weights_only=True)
        except pickle.UnpicklingError as error:
            raise UsageError(f"{self.path}: refused by torch.load(weights_only=True): it holds Python objects "
                             f"other than tensors, which could run code ({_first_line(error)[:120]})") from None
        except Exception as error:
            raise UsageError(f"{self.path}: cannot be read ({type(error).__name__}: {_first_line(error)}); "
                             "the file is truncated or damaged") from None
        if not isinstance(state, dict) or not all(isinstance(value, torch.Tensor) for value in state.values()):
            raise UsageError(f"{self.path}: not a state dict of tensors")
        self._state = state

    def entries(self) -> dict[str, TensorInfo]:
        return {name: TensorInfo(shape=tuple(tensor.shape), dtype=tensor.dtype) for name, tensor in self._state.items()}

    def read(self, names: list[str]) -> dict[str, Any]:
        return {name: self._state[name] for name in names}


class SafetensorsReader(WeightReader):
    """One or more safetensors files (a DDP checkpoint's ``model.safetensors``, or the shards of a
    Hugging Face folder), one tensor at a time."""

    def __init__(self, files: list[Path]) -> None:
        import torch
        from safetensors import safe_open

        self.path = Path(files[0]) if len(files) == 1 else Path(files[0]).parent
        self._where: dict[str, Path] = {}
        self._entries: dict[str, TensorInfo] = {}
        for file in files:
            try:
                with safe_open(str(file), framework="pt") as handle:
                    for name in handle.keys():
                        view = handle.get_slice(name)
                        dtype = getattr(torch, _SAFETENSORS_DTYPES.get(view.get_dtype(), "float32"))
                        self._entries[name] = TensorInfo(shape=tuple(view.get_shape()), dtype=dtype)
                        self._where[name] = Path(file)
            except Exception as error:
                raise UsageError(f"{file}: cannot be read as safetensors ({type(error).__name__}: "
                                 f"{_first_line(error)}); the file is truncated or damaged") from None

    def entries(self) -> dict[str, TensorInfo]:
        return dict(self._entries)

    def read(self, names: list[str]) -> dict[str, Any]:
        from safetensors import safe_open

        tensors = {}
        for file in sorted({self._where[name] for name in names}):
            try:
                with safe_open(str(file), framework="pt") as handle:
                    for name in names:
                        if self._where[name] == file:
                            tensors[name] = handle.get_tensor(name)
            except Exception as error:
                raise UsageError(f"{file}: reading tensors failed ({type(error).__name__}: {_first_line(error)})") from None
        return tensors


def model_reader(files: CheckpointFiles) -> WeightReader:
    """The reader of a checkpoint's model weights."""
    if files.layout in ("dcp", "adapter"):
        return DcpReader(files.model)
    if files.layout == "full":
        return TorchFileReader(files.model)
    return SafetensorsReader([files.model])


def rank_files(files: CheckpointFiles) -> list[RankFile]:
    """Every data file of the checkpoint's model and optimizer with its tensor count and size."""
    found: list[RankFile] = []
    for part in (files.model, files.optimizer):
        if part is None:
            continue
        if part.is_dir():
            found.extend(dcp_rank_files(part, files.folder))
        else:
            found.append(RankFile(path=str(part.relative_to(files.folder)), rank=None,
                                  tensors=_tensor_count(part), bytes=part.stat().st_size))
    for path in sorted(files.folder.glob(RNG_STATE_GLOB)):
        found.append(RankFile(path=path.name, rank=rng_state_rank(path.name), tensors=0, bytes=path.stat().st_size))
    return found


def _tensor_count(path: Path) -> int:
    """Tensors in a safetensors or ``torch.save`` file (0 when it cannot be read)."""
    import torch

    try:
        if path.suffix == WEIGHTS_SUFFIX:
            return len(SafetensorsReader([path]).entries())
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception:
        return 0
    count, pending = 0, [state]
    while pending:
        item = pending.pop()
        if isinstance(item, torch.Tensor):
            count += 1
        elif isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
    return count


def hf_weight_files(folder: Path) -> list[Path]:
    """The weight files of a Hugging Face folder, by transformers' names: sharded or single
    safetensors first, then legacy ``pytorch_model.bin`` (sharded or single)."""
    for index_name, single in HF_WEIGHT_FILES:
        index = folder / index_name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as error:
                raise UsageError(f"{index}: not a valid shard index ({error})") from None
            files = [folder / name for name in sorted(set(weight_map.values()))]
            missing = [path.name for path in files if not path.is_file()]
            if missing:
                raise UsageError(f"{index} lists shard files that are missing: {', '.join(missing)}")
            return files
        if (folder / single).is_file():
            return [folder / single]
    raise UsageError(f"{folder} holds no model weights (model.safetensors[.index.json] or "
                     "pytorch_model.bin[.index.json]); is it a Hugging Face model folder?")


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _first_line(error: BaseException) -> str:
    text = _ANSI.sub("", str(error)).strip()
    return text.splitlines()[0][:300] if text else ""
