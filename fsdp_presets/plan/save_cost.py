"""What a checkpoint save costs per strategy, and how often to save (Young/Daly).

A save writes each rank's parameters (fp32, its shards) and optimizer state: the
:class:`ModelStateBytes` a real run holds between steps, less the gradients. Under FSDP the
checkpoint is DCP's, and DCP's save planner spreads replicated pieces over the ranks by size
(``dedup_save_plans``), so every GPU writes about ``one copy / GPUs``; under DDP accelerate writes
``model.safetensors`` and ``optimizer.bin`` from the main process alone.

- **save time** (a synchronous save's blocked time): the bytes of the busiest node over the node's
  storage bandwidth (``--storage-bandwidth``).
- **blocked time with --async-save**: the copy of each rank's shards into host memory (in parallel
  on every GPU) at :data:`STAGING_BYTES_PER_S`; the write then overlaps training.
- **staging host memory**: the copy, per process (its shard of parameters and optimizer state)
  and per node (times the processes of a node), which ``--async-save`` holds while writing. It is
  counted against a node's host memory beside what training keeps there already
  (:func:`staging_fit`): the offloaded model states of the node's processes (``offload``; DCP
  stages a copy of them too), or on a CPU-only host every process's whole step.

How often: with a save cost ``C`` (seconds of training lost per save) and a mean time between
failures of the whole job ``M``, the interval that minimizes the expected lost time is Young's
``sqrt(2 C M)`` (J. W. Young, "A first order approximation to the optimum checkpoint interval",
CACM 17(9), 1974; Daly's higher-order refinement, FGCS 22(3), 2006, agrees to first order when
``C << M``). A failure then loses on average half an interval of training plus the time the save
in progress needed to become durable (``write``): ``interval / 2 + write``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fsdp_presets.fileio import GiB

DEFAULT_STORAGE_GB_PER_S = 2.0
"""Write bandwidth per node in GB/s (``--storage-bandwidth``): an assumed, conservative figure for
one node's client of a parallel file system or local NVMe RAID; measure yours (``fio``, or
``dd if=/dev/zero of=FILE bs=1G count=8 oflag=direct``) and give it."""

STAGING_BYTES_PER_S = 25e9
"""Device-to-host copy into pinned memory, per GPU: about 80% of PCIe Gen4 x16's 32 GB/s
(PCI-SIG, PCIe 4.0 specification: 16 GT/s x 16 lanes, 128b/130b encoding)."""


@dataclass(frozen=True, kw_only=True)
class SaveCost:
    """One strategy's checkpoint save on one hardware."""

    label: str
    """The strategy, as the plan's table names it."""
    checkpoint_bytes: int
    """One checkpoint: one copy of the parameters and optimizer state."""
    per_gpu_bytes: int
    """Bytes the busiest GPU writes."""
    staging_per_process_bytes: int
    """Host memory of ``--async-save``'s copy, per process: its shard of parameters and optimizer state."""
    staging_per_node_bytes: int
    """The same for the processes of one node together."""
    save_s: float
    """Time of the write at the stated storage bandwidth: the blocked time of a synchronous save."""
    async_blocked_s: float
    """Training time an ``--async-save`` save blocks (the staging copy)."""
    async_supported: bool
    """Whether ``--async-save`` applies (FSDP2; the recipes refuse it elsewhere)."""


def save_cost(strategy, hardware, *, storage_bytes_per_s: float = DEFAULT_STORAGE_GB_PER_S * 1e9) -> SaveCost:
    """The save cost of one :class:`StrategyPlan` on ``hardware`` (a :class:`Hardware`)."""
    if storage_bytes_per_s <= 0:
        raise ValueError("the storage bandwidth must be > 0")
    state = strategy.model_state
    per_rank = state.params + state.optimizer
    replicated = strategy.fsdp_version is None
    one_copy = per_rank if replicated else per_rank * strategy.shard_world_size
    gpus_per_node = hardware.gpus // hardware.nodes
    per_gpu = one_copy if replicated else math.ceil(one_copy / hardware.gpus)
    busiest_node = one_copy if replicated else per_gpu * gpus_per_node
    return SaveCost(label=strategy.label, checkpoint_bytes=one_copy, per_gpu_bytes=per_gpu,
                    staging_per_process_bytes=per_rank, staging_per_node_bytes=per_rank * gpus_per_node,
                    save_s=busiest_node / storage_bytes_per_s, async_blocked_s=per_rank / STAGING_BYTES_PER_S,
                    async_supported=strategy.fsdp_version == 2)


@dataclass(frozen=True, kw_only=True)
class StagingFit:
    """``--async-save``'s staging copy against one node's host memory."""

    per_process_bytes: int
    """The copy one process holds: its shard of parameters and optimizer state."""
    per_node_bytes: int
    """The copies of a node's processes together."""
    in_use_bytes: int
    """What training keeps in the node's host memory already: its processes' offloaded model
    states, or on a CPU-only host every process's whole step."""
    host_bytes: int
    """The node's host memory (``--host-memory``), or on a CPU-only host what its processes may use."""

    @property
    def need_bytes(self) -> int:
        return self.per_node_bytes + self.in_use_bytes

    @property
    def fits(self) -> bool:
        return self.need_bytes <= self.host_bytes

    def describe(self) -> str:
        """``1.1 GiB per process, 8.9 GiB per node (with the 20 GiB of offloaded states there: ...)``"""
        from fsdp_presets.fileio import format_bytes

        text = f"{format_bytes(self.per_process_bytes)} per process, {format_bytes(self.per_node_bytes)} per node"
        if self.in_use_bytes:
            text += f" beside the {format_bytes(self.in_use_bytes)} training keeps in host memory"
        return text + f": {format_bytes(self.need_bytes)} of {format_bytes(self.host_bytes)} per node"

    def to_json(self) -> dict:
        return {"per_process_bytes": self.per_process_bytes, "per_node_bytes": self.per_node_bytes,
                "in_use_bytes": self.in_use_bytes, "host_bytes": self.host_bytes, "fits": self.fits}


def staging_fit(strategy, hardware, shape, *, host_bytes: float) -> StagingFit:
    """``--async-save``'s staging copy of ``strategy`` (a :class:`StrategyPlan` planned with
    ``shape``) on a GPU node of ``host_bytes`` of host memory, beside the states training offloads
    there. (CPU presets save synchronously: the background write would share the cores that train.)"""
    from fsdp_presets.plan.planner import offloads

    cost = save_cost(strategy, hardware)
    per_node = hardware.gpus // hardware.nodes
    in_use = strategy.model_state.total * per_node if offloads(shape, strategy.name) else 0
    return StagingFit(per_process_bytes=cost.staging_per_process_bytes, per_node_bytes=cost.staging_per_node_bytes,
                      in_use_bytes=in_use, host_bytes=int(host_bytes))


def save_costs_json(memory_plan, *, storage_bytes_per_s: float, host_bytes: float) -> dict:
    """``plan --json``'s ``saves``: every strategy's :class:`SaveCost` and, where ``--async-save``
    applies, its staging copy against ``host_bytes`` of host memory per node."""
    strategies = []
    for strategy in memory_plan.strategies:
        cost = save_cost(strategy, memory_plan.hardware, storage_bytes_per_s=storage_bytes_per_s)
        staging = staging_fit(strategy, memory_plan.hardware, memory_plan.shape, host_bytes=host_bytes)
        strategies.append({**vars(cost), "async_staging": staging.to_json() if cost.async_supported else None})
    return {"storage_bytes_per_s": storage_bytes_per_s, "host_bytes": int(host_bytes), "strategies": strategies}


@dataclass(frozen=True, kw_only=True)
class SaveInterval:
    """Young/Daly's save interval for one save cost."""

    interval_s: float
    """``sqrt(2 x cost x MTBF)``."""
    interval_steps: int | None
    """The interval in optimizer steps (at least 1), None without a step time."""
    loss_per_failure_s: float
    """Expected training time one failure loses: half an interval plus the time to durable."""
    overhead: float
    """Share of training time spent blocked by saves at that interval."""


def young_daly_interval(*, cost_s: float, mtbf_s: float, durable_s: float,
                        step_time_s: float | None = None) -> SaveInterval:
    """The interval between saves that minimizes the expected lost time, for a save that blocks
    training ``cost_s`` and is durable ``durable_s`` after it starts, under failures every
    ``mtbf_s`` on average (see the module notes)."""
    if cost_s < 0 or durable_s < 0 or mtbf_s <= 0 or (step_time_s is not None and step_time_s <= 0):
        raise ValueError("save cost and write time must be >= 0, the MTBF and the step time > 0")
    interval = math.sqrt(2.0 * cost_s * mtbf_s)
    steps = None if step_time_s is None else max(1, round(interval / step_time_s))
    effective = interval if steps is None else steps * step_time_s
    return SaveInterval(interval_s=interval, interval_steps=steps, loss_per_failure_s=effective / 2.0 + durable_s,
                        overhead=cost_s / effective if effective > 0 else 0.0)


def describe_duration(seconds: float) -> str:
    """``0.42 s``, ``12.3 min``, ``2.5 h``."""
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"


def save_input_problems(*, storage_gb_per_s: float | None, mtbf_hours: float | None,
                        step_time_s: float | None) -> list[str]:
    """What is wrong with the inputs of a save's cost (``--storage-bandwidth``, ``--mtbf``,
    ``--seconds-per-step``), one line each: every one given must be a positive, finite number."""
    return [f"{flag} {value}: give a positive number"
            for flag, value in (("--storage-bandwidth", storage_gb_per_s), ("--mtbf", mtbf_hours),
                                ("--seconds-per-step", step_time_s))
            if value is not None and not (value > 0 and value < float("inf"))]


def format_save_costs(memory_plan, *, storage_bytes_per_s: float, mtbf_hours: float | None,
                      step_time_s: float | None, host_bytes: float) -> list[str]:
    """The plan's lines about checkpoint saves: a table per strategy (with ``--async-save``'s
    staging copy per process and per node, and whether it fits ``host_bytes`` of host memory per
    node beside what training keeps there), and with ``mtbf_hours`` the save interval of the
    recommended strategy (or the first), synchronous and ``--async-save``."""
    from fsdp_presets.fileio import format_bytes, text_table

    hardware = memory_plan.hardware
    costs = [save_cost(strategy, hardware, storage_bytes_per_s=storage_bytes_per_s)
             for strategy in memory_plan.strategies]
    stagings = [staging_fit(strategy, hardware, memory_plan.shape, host_bytes=host_bytes)
                for strategy in memory_plan.strategies]
    lines = [f"checkpoint saves (parameters and optimizer state; storage {storage_bytes_per_s / 1e9:g} GB/s per "
             f"node, --storage-bandwidth; staging copy {STAGING_BYTES_PER_S / 1e9:g} GB/s per GPU; host memory "
             f"{host_bytes / GiB:g} GiB per node, --host-memory)"]
    rows = [[cost.label, format_bytes(cost.checkpoint_bytes), format_bytes(cost.per_gpu_bytes),
             describe_duration(cost.save_s)]
            + ([describe_duration(cost.async_blocked_s), format_bytes(staging.per_process_bytes),
                format_bytes(staging.per_node_bytes), "yes" if staging.fits else "no"] if cost.async_supported
               else ["-"] * 4)
            for cost, staging in zip(costs, stagings)]
    lines += text_table(["strategy", "checkpoint", "per GPU", "blocked sync", "blocked async", "staging/proc",
                         "staging/node", "fits host"], rows, right={1, 2, 3, 4, 5, 6, 7})
    chosen = memory_plan.recommended
    if chosen is not None:
        index = memory_plan.strategies.index(chosen)
        cost, staging = costs[index], stagings[index]
        if cost.async_supported:
            verdict = "fits" if staging.fits else "does not fit"
            lines.append(f"--async-save with {cost.label} {verdict} host memory: {staging.describe()}")
    if mtbf_hours is None:
        return lines
    chosen = memory_plan.recommended or memory_plan.strategies[-1]
    cost = costs[memory_plan.strategies.index(chosen)]
    mtbf_s = mtbf_hours * 3600.0
    lines.append(f"save interval (Young/Daly, sqrt(2 x save cost x MTBF), MTBF {mtbf_hours:g} h, {cost.label}):")
    variants = [("sync", cost.save_s, cost.save_s)]
    if cost.async_supported:
        variants.append(("--async-save", cost.async_blocked_s, cost.async_blocked_s + cost.save_s))
    for name, blocked, durable in variants:
        interval = young_daly_interval(cost_s=blocked, mtbf_s=mtbf_s, durable_s=durable, step_time_s=step_time_s)
        every = (f"every {interval.interval_steps} steps ({describe_duration(interval.interval_s)} at "
                 f"{step_time_s:g} s per step)" if interval.interval_steps is not None else
                 f"every {describe_duration(interval.interval_s)} (give --seconds-per-step SECONDS for steps)")
        lines.append(f"  {name}: save {every}; a failure loses {describe_duration(interval.loss_per_failure_s)} of "
                     f"training on average; saves take {100 * interval.overhead:.2g}% of training time")
    return lines
