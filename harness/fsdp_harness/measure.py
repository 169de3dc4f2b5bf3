"""Measure what a rank holds and sends in a real training step, and hold it against the planner.

Used by the benchmark (``scripts/bench.py``) inside launched workers, and by anyone who wants
the same numbers from their own script::

    with CollectiveRecorder() as comm:          # every collective of the step, with its payload
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
    held = held_state_bytes(model, optimizer)    # this rank's shards after the step
    deviations = state_deviations(held, plan_row.model_state)   # [] when within 1%

Conventions are the planner's (:mod:`fsdp_presets.plan.planner`): payloads are full, unsharded
buffers; what a rank *sends* is ``(n-1)/n`` of them for an all-gather or a reduce-scatter and
``2(n-1)/n`` for an all-reduce (ring algorithms, nccl-tests ``doc/PERFORMANCE.md``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

COLLECTIVE_OPS = ("all_gather", "reduce_scatter", "all_reduce")


class CollectiveRecorder(TorchDispatchMode):
    """A dispatch mode that sees the collectives a rank runs: ``records`` holds an ``{"op",
    "payload_bytes", "group_size"}`` dict for each all-gather, reduce-scatter and all-reduce, and
    :meth:`get_comm_counts` counts every collective by op, named as torch's ``CommDebugMode``
    names them (``c10d._allgather_base_``, ...).

    It sees collectives at the dispatcher only, like ``CommDebugMode``, but keeps no module
    tracker: that tracker's forward hooks lose their place on models whose forward does not
    nest module calls the way it expects (transformers 5.25's Llama), and the step then fails.

    The CPU mode runs FSDP2's all-gather and reduce-scatter on a 2-rank gloo group as one
    send/receive pair (:func:`fsdp_presets.cpu_fsdp.pair_all_gather`, ``pair_reduce_scatter``).
    Those are recorded, and counted, as the collective they stand for (what the planner models;
    a rank sends the same bytes as a ring over 2 ranks would), not as the sends and receives
    that carry them."""

    KINDS = {
        torch.ops.c10d._allgather_base_: "all_gather",
        torch.ops.c10d.allgather_: "all_gather",  # FSDP1 over gloo gathers into a list
        torch.ops.c10d._reduce_scatter_base_: "reduce_scatter",
        torch.ops.c10d.allreduce_: "all_reduce",
    }
    COUNTED = frozenset({*KINDS, torch.ops.c10d.allgather_into_tensor_coalesced_, torch.ops.c10d.allreduce_coalesced_,
               torch.ops.c10d.reduce_scatter_, torch.ops.c10d.reduce_scatter_tensor_coalesced_,
               torch.ops.c10d.broadcast_, torch.ops.c10d.alltoall_base_, torch.ops.c10d.alltoall_,
               torch.ops._c10d_functional.all_gather_into_tensor, torch.ops._c10d_functional.all_reduce,
               torch.ops._c10d_functional.reduce_scatter_tensor})
    """Collectives :meth:`get_comm_counts` counts: c10d's, and the functional ones DTensor runs
    (a gradient-norm all-reduce). Only ``KINDS`` are also recorded with their payloads."""
    PAIR_OPS = {"pair_all_gather": ("all_gather", torch.ops.c10d._allgather_base_),
                "pair_reduce_scatter": ("reduce_scatter", torch.ops.c10d._reduce_scatter_base_)}
    """``fsdp_presets.cpu_fsdp`` function: (recorded op, the c10d collective it replaces)."""

    def __init__(self):
        super().__init__()
        self.records: list[dict[str, Any]] = []
        self._counts: dict[Any, int] = {}
        self._unpatched: dict[str, Any] = {}

    def __enter__(self):
        from fsdp_presets import cpu_fsdp

        for name, (kind, collective) in self.PAIR_OPS.items():
            original = self._unpatched[name] = getattr(cpu_fsdp, name)
            setattr(cpu_fsdp, name, self._recording_pair(original, kind, collective))
        return super().__enter__()

    def __exit__(self, *exc):
        from fsdp_presets import cpu_fsdp

        for name, original in self._unpatched.items():
            setattr(cpu_fsdp, name, original)
        self._unpatched.clear()
        return super().__exit__(*exc)

    def _count(self, collective) -> None:
        self._counts[collective] = self._counts.get(collective, 0) + 1

    def _recording_pair(self, function, kind: str, collective):
        def record(output, source, *args, **kwargs):
            full = output if kind == "all_gather" else source  # the full, unsharded buffer
            self.records.append({"op": kind, "payload_bytes": _nbytes(full), "group_size": 2})
            self._count(collective)
            return function(output, source, *args, **kwargs)

        return record

    def get_comm_counts(self) -> dict[Any, int]:
        """``{c10d op packet: count}``; ``str(packet)`` reads ``c10d._allgather_base_``."""
        return dict(self._counts)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(issubclass(kind, DTensor) for kind in types):
            return NotImplemented  # let DTensor lower itself to plain tensors and collectives first
        packet = func._overloadpacket
        kind = self.KINDS.get(packet)
        if kind is not None:
            payload_bytes, group_size = _payload(packet, args)
            self.records.append({"op": kind, "payload_bytes": payload_bytes, "group_size": group_size})
        if packet in self.COUNTED:
            self._count(packet)
        return func(*args, **(kwargs or {}))


def _nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _payload(op, args) -> tuple[int, int]:
    """``(full buffer bytes, group size)`` of a c10d collective from its dispatcher arguments."""
    output, inputs = args[0], args[1]
    if op is torch.ops.c10d._allgather_base_:  # (output, input, group, ...): output is the full buffer
        return _nbytes(output), output.numel() // inputs.numel()
    if op is torch.ops.c10d.allgather_:  # ([[pieces]], [input], group, ...)
        return sum(_nbytes(piece) for piece in output[0]), len(output[0])
    if op is torch.ops.c10d._reduce_scatter_base_:  # (output, input, group, ...): input is the full buffer
        return _nbytes(inputs), inputs.numel() // output.numel()
    # allreduce_(tensors, process_group, ...): the group arrives boxed for the dispatcher
    return _nbytes(output[0]), dist.ProcessGroup.unbox(inputs).size()


def record_ddp_allreduce(ddp_model, records: list[dict[str, Any]]) -> None:
    """Record DDP's gradient all-reduces into ``records`` (same format as the recorder).

    DDP's reducer starts its all-reduces from C++ on autograd's thread, where no Python dispatch
    mode sees them; a communication hook does, on every bucket. It runs torch's default
    ``allreduce_hook`` (what DDP does without a hook: divide by the world size, all-reduce)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def counting_hook(state, bucket):
        records.append({"op": "all_reduce", "payload_bytes": _nbytes(bucket.buffer()),
                        "group_size": dist.get_world_size(state)})
        return allreduce_hook(state, bucket)

    ddp_model.register_comm_hook(None, counting_hook)


def ring_bytes(record: dict[str, Any]) -> float:
    """What one rank sends for a recorded collective with a ring algorithm (planner convention)."""
    group_size = record["group_size"]
    if group_size <= 1:
        return 0.0
    factor = 2 if record["op"] == "all_reduce" else 1
    return factor * record["payload_bytes"] * (group_size - 1) / group_size


def sent_bytes(records: list[dict[str, Any]]) -> dict[str, float]:
    """``{"all_gather", "reduce_scatter", "all_reduce", "total"}`` bytes one rank sent."""
    sent = {op: 0.0 for op in COLLECTIVE_OPS}
    for record in records:
        sent[record["op"]] += ring_bytes(record)
    sent["total"] = sum(sent[op] for op in COLLECTIVE_OPS)
    return sent


def _local_bytes(tensor) -> int:
    return _nbytes(tensor.to_local() if hasattr(tensor, "to_local") else tensor)


def held_state_bytes(model, optimizer) -> dict[str, int]:
    """Bytes of this rank's parameters, gradients and optimizer state (local shards).

    FSDP2 parameters are DTensors (their local shard counts); FSDP1 with ``use_orig_params``
    (accelerate's default) exposes each parameter as a view of this rank's piece of the flat
    parameter (empty when the piece lies elsewhere), so the same sum counts its shard without the
    padding of the flat parameter. ``step_counters`` are the optimizer's per-parameter ``step``
    scalars (AdamW keeps a 4-byte tensor per parameter), counted inside ``optimizer`` too; the
    planner leaves them out (a few hundred bytes)."""
    held = {"params": 0, "grads": 0, "optimizer": 0, "step_counters": 0}
    for param in model.parameters():
        held["params"] += _local_bytes(param)
        if param.grad is not None:
            held["grads"] += _local_bytes(param.grad)
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
    for state in inner.state.values():
        for key, value in state.items():
            if torch.is_tensor(value):
                size = _local_bytes(value)
                held["optimizer"] += size
                if key == "step":
                    held["step_counters"] += size
    return held


def sharded_element_counts(model) -> dict[str, int]:
    """``{"local", "total"}``: elements of the sharded parameters this rank holds, and their
    unsharded total. FSDP1: one flat parameter per unit, cut into equal (padded) pieces; FSDP2:
    every parameter a DTensor sharded on dim 0. Neither (DDP): both 0."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    local = total = 0
    if isinstance(model, FSDP1):
        for unit in FSDP1.fsdp_modules(model):
            if unit._handle is not None:
                flat_param = unit._handle.flat_param
                local += flat_param.numel()
                total += flat_param._unpadded_unsharded_size.numel()
        return {"local": local, "total": total}
    for param in model.parameters():
        if hasattr(param, "to_local"):
            local += param.to_local().numel()
            total += param.numel()
    return {"local": local, "total": total}


# ---- host memory (the CPU stand-in for torch.cuda.max_memory_allocated) ----
def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def current_rss_bytes() -> int | None:
    """Resident set size of this process now (Linux ``VmRSS``), or None where unreadable."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def peak_rss_bytes() -> int | None:
    """Peak resident set size since the last :func:`reset_peak_rss` (Linux ``VmHWM``)."""
    kib = _status_kib("VmHWM")
    return None if kib is None else kib * 1024


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (glibc malloc.h)
_LIVE_MMAP_THRESHOLD = 64 * 1024
_DEFAULT_MMAP_THRESHOLD_MAX = 32 * 1024**2  # glibc's ceiling for its dynamic threshold (64-bit)


def _mallopt(*settings: tuple[int, int]) -> bool:
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        applied = all(libc.mallopt(parameter, value) == 1 for parameter, value in settings)
        libc.malloc_trim(0)
        return applied
    except (OSError, AttributeError):
        return False


def follow_live_memory() -> bool:
    """Make the resident set follow live allocations (glibc): every allocation of 64 KiB or more
    gets its own mapping, returned to the system when freed (``mallopt(M_MMAP_THRESHOLD)``), and
    what the heap holds free now is given back (``malloc_trim``). torch's CPU tensors come from
    ``posix_memalign``, so peak RSS then measures tensor memory, not allocator cache. Call it
    before building the model: chunks already in the heap would be reused without being counted
    out when freed. Returns False where this is not glibc (RSS then includes cached memory)."""
    return _mallopt((_M_MMAP_THRESHOLD, _LIVE_MMAP_THRESHOLD))


def cache_freed_memory() -> bool:
    """Undo :func:`follow_live_memory` for timing: large blocks are kept and reused as glibc does
    once its dynamic threshold has grown (up to 32 MiB, with trimming at twice that), instead of
    being mapped and zero-filled again at every allocation."""
    return _mallopt((_M_MMAP_THRESHOLD, _DEFAULT_MMAP_THRESHOLD_MAX), (_M_TRIM_THRESHOLD, 2 * _DEFAULT_MMAP_THRESHOLD_MAX))


def reset_peak_rss() -> bool:
    """Reset the peak to the current RSS (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0, see
    ``man 5 proc``). Returns False where that is not allowed: the peak is then the lifetime one."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


# ---- against the planner ----
STATE_PARTS = ("params", "grads", "optimizer")

DEFAULT_TOLERANCE = 0.01
"""Largest relative deviation of measured per-rank state from the plan before the benchmark fails."""


@dataclass(frozen=True, kw_only=True)
class StateDeviation:
    """One part of a rank's model state that the planner got wrong by more than the tolerance."""

    label: str
    """Which run and rank (``FULL_SHARD (FSDP2) x2, rank 1``)."""
    part: str
    """``params``, ``grads``, ``optimizer`` or ``total``."""
    measured: int
    """Bytes the rank held."""
    planned: int
    """Bytes the planner predicted."""

    @property
    def relative(self) -> float:
        return (self.measured - self.planned) / self.planned if self.planned else float("inf")

    def __str__(self) -> str:
        return (f"{self.label}: {self.part} measured {self.measured} B, planned {self.planned} B "
                f"({self.relative:+.2%})")


def relative_error(measured: float, planned: float) -> float:
    """``(measured - planned) / planned`` (inf when nothing was planned but something measured)."""
    if planned == 0:
        return 0.0 if measured == 0 else float("inf")
    return (measured - planned) / planned


def state_deviations(held: dict[str, int], planned, *, label: str = "",
                     tolerance: float = DEFAULT_TOLERANCE) -> list[StateDeviation]:
    """Parts of ``held`` (:func:`held_state_bytes`) off the planner's ``ModelStateBytes`` by more
    than ``tolerance`` (relative). The optimizer's ``step`` counters are left out, as the planner
    leaves them out."""
    measured = {"params": held["params"], "grads": held["grads"],
                "optimizer": held["optimizer"] - held.get("step_counters", 0)}
    measured["total"] = sum(measured.values())
    expected = {"params": planned.params, "grads": planned.grads, "optimizer": planned.optimizer,
                "total": planned.total}
    return [StateDeviation(label=label, part=part, measured=measured[part], planned=expected[part])
            for part in (*STATE_PARTS, "total")
            if abs(relative_error(measured[part], expected[part])) > tolerance]


def host_description() -> dict[str, Any]:
    """CPU model, core count and memory of this host (for benchmark reports)."""
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    memory = None
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemTotal:"):
                    memory = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": memory,
            "load_average": list(load) if load else None}
