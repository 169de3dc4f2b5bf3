"""The planner's results: bytes per GPU by category, bytes sent per step, one row per strategy
(:class:`StrategyPlan`) and the whole :class:`MemoryPlan`. What each category holds:
:mod:`fsdp_presets.plan.planner`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from fsdp_presets.plan.shapes import Hardware, TrainingShape

Strategy = Literal["DDP", "NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD"]
"""``DDP`` or an FSDP sharding strategy (FSDP1 names; FSDP2 expresses them with reshard_after_forward and the HSDP mesh)."""


@dataclass(frozen=True, kw_only=True)
class ModelStateBytes:
    """Parameters, gradients and optimizer state one rank keeps between steps."""

    params: int
    """Stored (fp32) parameters, this rank's shards."""
    grads: int
    """Gradients in the parameter dtype, this rank's shards."""
    optimizer: int
    """Optimizer state (e.g. Adam's two moments), this rank's shards."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


@dataclass(frozen=True, kw_only=True)
class PerGpuBytes:
    """Peak bytes on one GPU, by category (see the module notes for what each holds)."""

    params: int
    """Stored parameters on the GPU (0 when offloaded)."""
    grads: int
    """Gradients kept between backward and the optimizer step (0 when offloaded)."""
    optimizer: int
    """Optimizer state (0 when offloaded)."""
    activations: int
    """Activations saved for backward, plus the logits and the loss's fp32 copies."""
    buffers: int
    """Transient: all-gathered parameters, unsharded gradients, buckets, compute copies."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    def to_json(self) -> dict:
        return {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "buffers": self.buffers,
            "total": self.total,
        }


@dataclass(frozen=True, kw_only=True)
class CommBytes:
    """Bytes one GPU sends per optimizer step, by collective and by link."""

    all_gather: int = 0
    """Parameter all-gathers (forward, and backward for units resharded after forward)."""
    reduce_scatter: int = 0
    """Gradient reduce-scatters."""
    all_reduce: int = 0
    """Gradient all-reduces (DDP, NO_SHARD, and the replicate dimension of HYBRID_SHARD)."""
    intra_node: int = 0
    """Of the above, collectives whose group stays inside one node."""
    inter_node: int = 0
    """Of the above, collectives whose group spans nodes (a ring then crosses the network)."""

    def __post_init__(self) -> None:
        if self.intra_node + self.inter_node != self.all_gather + self.reduce_scatter + self.all_reduce:
            raise ValueError("intra_node + inter_node must equal the sum of the collectives")

    @property
    def total(self) -> int:
        return self.all_gather + self.reduce_scatter + self.all_reduce

    def to_json(self) -> dict:
        return {
            "all_gather": self.all_gather,
            "reduce_scatter": self.reduce_scatter,
            "all_reduce": self.all_reduce,
            "intra_node": self.intra_node,
            "inter_node": self.inter_node,
            "total": self.total,
        }


@dataclass(frozen=True, kw_only=True)
class StrategyPlan:
    """One strategy on one hardware and training shape."""

    name: Strategy
    """``DDP`` or the FSDP sharding strategy name (FSDP2: ``FULL_SHARD`` is
    ``reshard_after_forward: true``, ``SHARD_GRAD_OP`` is ``false``, ``HYBRID_SHARD`` is HSDP)."""
    fsdp_version: int | None
    """1 or 2; None for DDP."""
    shard_world_size: int
    """GPUs one copy of the model states is sharded over (1: replicated)."""
    replicate_world_size: int
    """Copies of the sharded model states (all-reduced across them)."""
    model_state: ModelStateBytes
    """Per-rank parameters, gradients and optimizer state between steps (on the GPU or, with
    offload, on the host): what a real run holds after an optimizer step."""
    per_gpu: PerGpuBytes
    """Peak bytes on one GPU at the requested micro-batch."""
    fits: bool
    """Whether ``per_gpu.total`` fits the GPU's usable memory."""
    max_micro_batch: int
    """Largest micro-batch that fits (0: not even one sequence)."""
    comm: CommBytes
    """Communication per GPU per optimizer step."""
    notes: tuple[str, ...] = ()
    """Caveats that apply to this row (e.g. offload not available)."""
    allocator_reserve: int = 0
    """What torch's caching allocator holds beyond ``per_gpu`` at the peak
    (:mod:`fsdp_presets.plan.allocator`)."""
    nvidia_smi: int = 0
    """What ``nvidia-smi`` shows at the peak: ``per_gpu``, ``allocator_reserve`` and the CUDA context."""
    time: object = None
    """Seconds per step, tokens/s and MFU on the hardware's GPU type (a
    :class:`~fsdp_presets.plan.step_time.StepTime`); None when the GPU type is not known."""
    tp_size: int = 1
    """Tensor-parallel ranks (1: none); the row is then FSDP2 x TP through ``DistributedConfig``."""
    ep_size: int = 1
    """Expert-parallel ranks (1: none)."""
    mesh_comm: CommBytes = CommBytes()
    """The TP/EP collectives per GPU per step (inside a node), besides :attr:`comm` (FSDP's)."""
    source: str = "estimated"
    """How the figures were obtained: ``composed from a rehearsal`` (this model's own activation
    terms, :mod:`fsdp_presets.preset.measured_activations`, composed for a strategy a rehearsal can
    follow) or ``estimated`` (family constants, or a strategy no rehearsal follows)."""

    @property
    def is_nd(self) -> bool:
        """A second dimension (TP or EP) beside data-parallel sharding."""
        return self.tp_size > 1 or self.ep_size > 1

    @property
    def label(self) -> str:
        """``FULL_SHARD (FSDP2)``, ``DDP``, ``FSDP 8 x TP 8``, ``HSDP 2 x FSDP 4 x TP 2``."""
        if self.is_nd:
            fsdp = self.shard_world_size // self.tp_size
            parts = [f"HSDP {self.replicate_world_size}"] if self.replicate_world_size > 1 else []
            parts += [f"FSDP {fsdp}"] + ([f"TP {self.tp_size}"] if self.tp_size > 1 else []) + (
                [f"EP {self.ep_size}"] if self.ep_size > 1 else [])
            return " x ".join(parts)
        return self.name if self.fsdp_version is None else f"{self.name} (FSDP{self.fsdp_version})"

    @property
    def comm_total(self) -> int:
        """Bytes sent per GPU per step, every dimension's collectives together."""
        return self.comm.total + self.mesh_comm.total

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "label": self.label,
            "fsdp_version": self.fsdp_version,
            "tp_size": self.tp_size,
            "ep_size": self.ep_size,
            "shard_world_size": self.shard_world_size,
            "replicate_world_size": self.replicate_world_size,
            "per_gpu_bytes": self.per_gpu.to_json(),
            "fits": self.fits,
            "max_micro_batch": self.max_micro_batch,
            "allocator_reserve_bytes": self.allocator_reserve,
            "nvidia_smi_bytes": self.nvidia_smi,
            "source": self.source,
            "comm_bytes_per_step": self.comm.to_json(),
            "mesh_comm_bytes_per_step": self.mesh_comm.to_json(),
            **_time_json(self.time),
            "notes": list(self.notes),
        }


def _time_json(time) -> dict:
    """The row's time fields (None each when the GPU type is not known)."""
    if time is None:
        return {"step_time_s": None, "tokens_per_s_per_gpu": None, "mfu": None, "exposed_comm_fraction": None}
    return time.to_json()


@dataclass(kw_only=True)
class MemoryPlan:
    """Every applicable strategy for one model, hardware and training shape, and a choice."""

    hardware: Hardware
    """The hardware planned for."""
    shape: TrainingShape
    """The training shape planned for."""
    strategies: list[StrategyPlan]
    """One row per strategy (and FSDP version where they differ)."""
    recommended: StrategyPlan | None
    """The row to use, or None when nothing fits (see ``suggestions``)."""
    reason: str
    """Why ``recommended`` was chosen, or why nothing fits."""
    suggestions: list[str] = field(default_factory=list)
    """When nothing fits: changes that would make something fit, each checked by re-planning."""

    def get(self, name: str, fsdp_version: int | None = 2) -> StrategyPlan:
        """The row for ``name`` (``fsdp_version`` is ignored for DDP)."""
        for strategy in self.strategies:
            if strategy.name == name and (name == "DDP" or strategy.fsdp_version == fsdp_version) and not strategy.is_nd:
                return strategy
        known = [s.label for s in self.strategies]
        raise KeyError(f"no strategy {name!r} for FSDP{fsdp_version} in this plan; known: {', '.join(known)}")

    def to_json(self) -> dict:
        """The ``plan --json`` contract."""
        recommended = self.recommended
        return {
            "strategies": [strategy.to_json() for strategy in self.strategies],
            "recommended": None
            if recommended is None
            else {"name": recommended.name, "fsdp_version": recommended.fsdp_version, "label": recommended.label,
                  "tp_size": recommended.tp_size, "ep_size": recommended.ep_size},
            "reason": self.reason,
            "suggestions": list(self.suggestions),
            "hardware": self.hardware.to_json(),
            "shape": dataclasses.asdict(self.shape),
            "method": self.shape.method,
        }

