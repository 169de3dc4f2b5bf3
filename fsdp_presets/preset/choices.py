"""The decisions of a :class:`Preset`, each with its reason: parallelism, precision, memory savers,
checkpoint format, wrapping and the batch split. Made by :func:`fsdp_presets.preset.presets.decide`;
turned into YAML by :mod:`fsdp_presets.preset.emit`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fsdp_presets.plan.results import MemoryPlan, StrategyPlan
from fsdp_presets.model.model_profile import ModelProfile
from fsdp_presets.preset.request import PresetRequest


# --------------------------------------------------------------------------- the preset


@dataclass(frozen=True, kw_only=True)
class Parallelism:
    """Processes and how the model states are split over them."""

    num_processes: int
    """Processes in the whole job, one per GPU (accelerate ``num_processes``)."""
    num_machines: int
    """Nodes (accelerate ``num_machines``)."""
    strategy: str
    """FSDP sharding strategy: FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD or NO_SHARD."""
    fsdp_version: int
    """1 or 2."""
    replicate_size: int
    """Copies of the sharded model states (HSDP: nodes; 1 otherwise; NO_SHARD: every process)."""
    shard_size: int
    """Processes one copy is sharded over (HSDP: the GPUs of a node)."""
    reason: str
    """Why this strategy."""
    tp_size: int = 1
    """Tensor-parallel ranks inside ``shard_size`` (1: none); FSDP then shards over ``shard_size / tp_size``."""
    ep_size: int = 1
    """Expert-parallel ranks (1: none)."""

    def __post_init__(self) -> None:
        if self.replicate_size * self.shard_size != self.num_processes:
            raise ValueError(f"replicate {self.replicate_size} x shard {self.shard_size} != processes "
                             f"{self.num_processes}")

    @property
    def reshard_after_forward(self) -> bool:
        """FSDP2: free each block's gathered parameters after its forward (FULL_SHARD, HSDP) or keep
        them until its backward (SHARD_GRAD_OP)."""
        return self.strategy != "SHARD_GRAD_OP"

    @property
    def hsdp(self) -> bool:
        return self.strategy == "HYBRID_SHARD"

    @property
    def is_nd(self) -> bool:
        return self.tp_size > 1 or self.ep_size > 1

    @property
    def label(self) -> str:
        """``HSDP 2x8``, ``FULL_SHARD 8``, ``FSDP 4 x TP 2``: what changes when a preset is rescaled."""
        if self.is_nd:
            parts = [f"HSDP {self.replicate_size}"] if self.hsdp else []
            parts.append(f"FSDP {self.shard_size // self.tp_size}")
            parts += [f"TP {self.tp_size}"] if self.tp_size > 1 else []
            parts += [f"EP {self.ep_size}"] if self.ep_size > 1 else []
            return " x ".join(parts)
        if self.hsdp:
            return f"HSDP {self.replicate_size}x{self.shard_size}"
        return f"{self.strategy} {self.num_processes}"

    def distributed_config(self) -> dict:
        """transformers ``DistributedConfig`` sizes of this layout."""
        return {"dp_replicate_size": self.replicate_size, "fsdp_size": self.shard_size // self.tp_size,
                "tp_size": self.tp_size, "ep_size": self.ep_size}


@dataclass(frozen=True, kw_only=True)
class PrecisionChoice:
    """Accelerate ``mixed_precision``."""

    mixed_precision: Literal["bf16", "fp16", "no"]
    """``bf16``/``fp16``: compute in that dtype, fp32 master weights; ``no``: fp32."""
    reason: str
    """Why."""

    @property
    def planner_precision(self) -> str:
        return "fp32" if self.mixed_precision == "no" else self.mixed_precision


@dataclass(frozen=True, kw_only=True)
class MemorySavers:
    """Activation checkpointing and CPU offload."""

    activation_checkpointing: bool
    """Recompute each block's activations in backward."""
    offload: bool
    """FSDP CPU offload of parameters, gradients and optimizer state."""
    reason: str
    """Why each is on or off."""


@dataclass(frozen=True, kw_only=True)
class StateDictChoice:
    """How checkpoints are written and how the model is first loaded."""

    state_dict_type: Literal["SHARDED_STATE_DICT", "FULL_STATE_DICT"]
    """Accelerate ``fsdp_state_dict_type``."""
    cpu_ram_efficient_loading: bool
    """Only rank 0 reads the pretrained weights; the others receive their shards."""
    reason: str
    """Why."""
    async_save: bool = False
    """The launch line passes ``--async-save`` (saves written in the background): the recipe takes
    it (FSDP2, sharded, every weight trained) and its staging copy fits the node's host memory."""


@dataclass(frozen=True, kw_only=True)
class WrapChoice:
    """Which modules become FSDP units, and how the rest of the model is handled."""

    classes: tuple[str, ...]
    """``fsdp_transformer_layer_cls_to_wrap``: the model's block classes."""
    reason: str
    """Why these classes."""
    model_parts: tuple[str, ...]
    """How embeddings, norms, the output head and tied weights are handled, and why."""


@dataclass(frozen=True, kw_only=True)
class BatchPlan:
    """How the global batch is split: micro x accumulation x data-parallel size."""

    seq_len: int
    """Tokens per sequence."""
    micro_batch: int
    """Sequences per GPU per forward/backward (recipe ``--micro-batch``)."""
    accumulation: int
    """Micro-batches per optimizer step (recipe ``--grad-accum``)."""
    data_parallel_size: int
    """Ranks that each see different data (every process: FSDP and HSDP are data parallel)."""
    reason: str
    """Why this split."""
    reduce_every_micro_batch: bool = False
    """Gradients reduced after every micro-batch (recipe ``--reduce-every-micro-batch``) instead of
    accumulated unsharded under ``no_sync``, which would hold a whole model's gradients per GPU."""

    def __post_init__(self) -> None:
        if min(self.seq_len, self.micro_batch, self.accumulation, self.data_parallel_size) < 1:
            raise ValueError(f"invalid batch split {self}")

    @property
    def global_samples(self) -> int:
        return self.micro_batch * self.accumulation * self.data_parallel_size

    @property
    def global_tokens(self) -> int:
        return self.global_samples * self.seq_len


@dataclass(frozen=True, kw_only=True)
class Preset:
    """Every decision for one model on one cluster, with the planner's numbers behind it."""

    request: PresetRequest
    """What was asked."""
    profile: ModelProfile
    """The model, as FSDP sees it."""
    parallelism: Parallelism
    """Processes, nodes, sharding."""
    precision: PrecisionChoice
    """Mixed precision."""
    savers: MemorySavers
    """Activation checkpointing and offload."""
    state_dict: StateDictChoice
    """Checkpoint format and loading."""
    wrap: WrapChoice
    """FSDP units."""
    batch: BatchPlan
    """Global batch split."""
    memory_plan: MemoryPlan
    """The planner's table at the chosen micro-batch, precision and savers."""
    row: StrategyPlan
    """The planner's row of the chosen strategy."""
    notes: tuple[str, ...] = ()
    """Adjustments made to the request (capped sequence length, rounded batch) and warnings."""
    memory_figures: str = ""
    """How the planner's figures were obtained (composed from a rehearsal of this model, or
    estimated) and from what: :func:`fsdp_presets.preset.generate.decide_with_rehearsed_terms`."""

    @property
    def device(self) -> str:
        return self.request.device

    def decisions(self) -> list[tuple[str, str]]:
        """``(topic, reason)`` in the order the header lists them."""
        return [
            ("strategy", self.parallelism.reason),
            ("precision", self.precision.reason),
            ("memory savers", self.savers.reason),
            ("checkpoints", self.state_dict.reason),
            ("wrapping", self.wrap.reason),
            ("batch", self.batch.reason),
        ]

    def summary(self) -> dict:
        """The settings a rescale compares (kept in the file's metadata line)."""
        return {
            "processes": self.parallelism.num_processes,
            "machines": self.parallelism.num_machines,
            "sharding": self.parallelism.label,
            "fsdp_version": self.parallelism.fsdp_version,
            "precision": self.precision.mixed_precision,
            "activation_checkpointing": self.savers.activation_checkpointing,
            "offload": self.savers.offload,
            "state_dict": self.state_dict.state_dict_type,
            "async_save": self.state_dict.async_save,
            "seq_len": self.batch.seq_len,
            "micro_batch": self.batch.micro_batch,
            "gradient_accumulation": self.batch.accumulation,
            "reduce_every_micro_batch": self.batch.reduce_every_micro_batch,
            "data_parallel_size": self.batch.data_parallel_size,
            "global_batch": self.batch.global_samples,
        }


