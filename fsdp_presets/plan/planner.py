"""What training a model costs per GPU, for every data-parallel strategy: a ``MemoryPlan``.

Pure arithmetic on a :class:`~fsdp_presets.plan.profile.ModelProfile`; no torch, no files::

    memory_plan = plan(profile, Hardware(gpus=8, gpu_memory_bytes=80 * GiB),
                       TrainingShape(seq_len=4096, micro_batch=2))
    memory_plan.recommended          # the StrategyPlan to use, or None when nothing fits
    memory_plan.get("FULL_SHARD", 2).max_micro_batch

Sources, cited again where each number is used:

- [ZeRO] Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
  Parameter Models", arXiv:1910.02054: model states (Sec. 3.1, Fig. 1) and communication
  volume (Sec. 7).
- [Korthikanti] Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models", arXiv:2205.05198: activations per layer (Sec. 4, Eq. 1) and with full
  recomputation (Sec. 5).
- [FSDP] Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel",
  arXiv:2304.11277: flat parameters padded to a multiple of the world size (Sec. 3.2.1), one
  unit prefetched (Sec. 3.3), the root kept unsharded after forward.
- [FSDP2] PyTorch ``fully_shard`` documentation and source (torch 2.13,
  ``torch/distributed/fsdp/_fully_shard``): per-parameter dim-0 sharding, dim 0 padded to a
  multiple of the shard world size, the root not resharded after forward.
- [accelerate] ``accelerate/utils/fsdp_utils.py::fsdp2_prepare_model`` (1.16): how accelerate
  wraps a model for FSDP2 (blocks, the input embedding, and a ``[final_norm, lm_head]`` tail that
  is never resharded after forward).
- [NCCL] nccl-tests ``doc/PERFORMANCE.md``: a ring all-gather / reduce-scatter sends
  ``(n-1)/n`` of the full buffer per rank, an all-reduce twice that.
- [DDP] ``torch.nn.parallel.DistributedDataParallel`` documentation, ``gradient_as_bucket_view``:
  gradient buckets as large as all gradients unless that flag is set (accelerate's default is
  unset).

Accounting conventions (read these before comparing with other estimators):

- *Stored parameters are fp32* under every precision here. PyTorch AMP and FSDP mixed precision
  (``MixedPrecision``/``MixedPrecisionPolicy``, which accelerate sets from ``mixed_precision``)
  keep the fp32 parameters and cast a low-precision copy for compute. Those stored fp32
  parameters *are* the mixed-precision master weights: counted once, under ``params``. ZeRO
  counts the same 16 bytes per parameter for Adam as 2 (fp16 params) + 2 (fp16 grads) + 12
  (fp32 master, momentum, variance); here they are 4 (fp32 params = master) + 4 (fp32 grads:
  FSDP casts reduced gradients back to the parameter dtype) + 8 (Adam moments). Totals agree.
- ``params``, ``grads``, ``optimizer``: the state a rank keeps between steps (its shards).
  ``buffers``: what exists only while a step runs (all-gathered parameters, unsharded gradients,
  DDP's gradient buckets, low-precision compute copies). ``activations``: saved activations and
  logits. The peak is taken as their sum.
- Communication bytes are what each GPU sends per optimizer step (one micro-batch, no gradient
  accumulation), with ring algorithms [NCCL].
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from fsdp_presets.errors import UsageError, unknown_name_message
from fsdp_presets.plan.profile import ModelProfile

GiB = 1024**3
"""Bytes in a gibibyte: GPU memory is sold and reported (``nvidia-smi``) in these."""

Precision = Literal["bf16", "fp16", "fp32"]
PRECISIONS: tuple[str, ...] = ("bf16", "fp16", "fp32")
"""Accelerate's ``mixed_precision`` values: bf16/fp16 compute with fp32 master weights, or fp32."""

OPTIMIZER_STATE_BYTES = MappingProxyType(
    {
        # Adam/AdamW: momentum + variance, fp32 each (ZeRO Sec. 3.1: K = 12 counts these 8 bytes
        # plus the 4-byte fp32 master copy, which is the stored parameter here).
        "adamw": 8,
        "adam": 8,
        # One fp32 momentum buffer (torch.optim.SGD with momentum > 0; plain SGD keeps none).
        "sgd": 4,
        # Lion (Chen et al. 2023, arXiv:2302.06675): a single fp32 momentum.
        "lion": 4,
    }
)
"""Optimizer state bytes per parameter (fp32 state, as torch.optim keeps for fp32 parameters)."""

Strategy = Literal["DDP", "NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD"]

STORED_PARAM_BYTES = 4
"""fp32 parameters (and the gradients FSDP/DDP keep in the parameter dtype): see module notes."""

DEFAULT_RESERVED_BYTES = 1 * GiB
"""Memory a CUDA training process cannot use for tensors: CUDA context, cuBLAS workspaces and
NCCL buffers. The context alone is typically 0.3-1 GiB depending on the CUDA version and which
kernels are loaded; 1 GiB is a round, deliberately cautious figure (override per hardware)."""

ALLOCATOR_RESERVE_FRACTION = 0.05
"""Share of a GPU's memory kept back for what a rehearsal on CPU cannot see
(:mod:`fsdp_presets.plan.rehearsal`): the CUDA caching allocator rounds every block up (to 512 B, and
large ones to 2 MiB segments) and fragments, and CUDA-only kernels take workspaces. PyTorch's
own guidance on fragmentation (``PYTORCH_CUDA_ALLOC_CONF``, CUDA semantics notes) gives no single
figure; 5% is a cautious round one. Added to :data:`DEFAULT_RESERVED_BYTES` by default."""

def default_reserved_bytes(gpu_memory_bytes: int) -> int:
    """:data:`DEFAULT_RESERVED_BYTES` + :data:`ALLOCATOR_RESERVE_FRACTION` of the GPU."""
    return DEFAULT_RESERVED_BYTES + int(ALLOCATOR_RESERVE_FRACTION * max(gpu_memory_bytes, 0))


# Order used to break ties between strategies that cost the same communication: the simplest
# first, and the project's default FSDP2 before FSDP1.
_PREFERENCE: tuple[tuple[str, int | None], ...] = (
    ("DDP", None),
    ("SHARD_GRAD_OP", 2),
    ("HYBRID_SHARD", 2),
    ("FULL_SHARD", 2),
    ("SHARD_GRAD_OP", 1),
    ("HYBRID_SHARD", 1),
    ("FULL_SHARD", 1),
    ("NO_SHARD", 1),
)


def human_bytes(count: float, *, binary: bool = True) -> str:
    """``80.0 GiB``, ``864.4 KiB`` (memory, binary) or ``41.24 GB`` (traffic, decimal)."""
    units = (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)) if binary else (("GB", 1e9), ("MB", 1e6), ("kB", 1e3))
    for name, size in units:
        if abs(count) >= size:
            return f"{count / size:.{1 if binary else 2}f} {name}"
    return f"{count:.0f} B"


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """The GPUs a job runs on."""

    gpus: int
    """GPUs in the whole job (all nodes together)."""
    gpu_memory_bytes: int
    """Memory of one GPU in bytes (80 GiB for an H100 SXM: ``80 * GiB``)."""
    nodes: int = 1
    """Machines the GPUs are spread over, the same number on each."""
    reserved_bytes: int | None = None
    """Memory of each GPU that tensors cannot use (CUDA context, library workspaces, allocator
    rounding and fragmentation). Default: :data:`DEFAULT_RESERVED_BYTES` plus
    :data:`ALLOCATOR_RESERVE_FRACTION` of the GPU's memory (5 GiB of an 80 GiB GPU)."""

    def __post_init__(self) -> None:
        if self.reserved_bytes is None:
            object.__setattr__(self, "reserved_bytes", default_reserved_bytes(self.gpu_memory_bytes))
        problems = []
        if self.gpus < 1:
            problems.append(f"--gpus must be at least 1, got {self.gpus}")
        if self.nodes < 1:
            problems.append(f"--nodes must be at least 1, got {self.nodes}")
        if self.gpus >= 1 and self.nodes >= 1 and self.gpus % self.nodes:
            problems.append(
                f"--nodes {self.nodes} does not divide --gpus {self.gpus}: every node must hold "
                f"the same number of GPUs (e.g. --gpus {self.nodes * max(1, self.gpus // self.nodes)})"
            )
        if self.reserved_bytes < 0:
            problems.append(f"reserved bytes must not be negative, got {self.reserved_bytes}")
        if self.gpu_memory_bytes <= self.reserved_bytes:
            problems.append(
                f"--gpu-memory {self.gpu_memory_bytes / GiB:g} GiB is too small for anything: a CUDA "
                f"process reserves about {self.reserved_bytes / GiB:g} GiB for its context and "
                "libraries; give one GPU's memory in GiB (e.g. --gpu-memory 80)"
            )
        if problems:
            raise UsageError("; ".join(problems))

    @property
    def gpus_per_node(self) -> int:
        return self.gpus // self.nodes

    @property
    def usable_bytes(self) -> int:
        """What tensors can use on one GPU."""
        return self.gpu_memory_bytes - self.reserved_bytes


@dataclass(frozen=True, kw_only=True)
class TrainingShape:
    """How the model is trained: sequence, micro-batch, precision, optimizer, memory savers."""

    seq_len: int = 2048
    """Tokens per sequence."""
    micro_batch: int = 1
    """Sequences per GPU per forward/backward."""
    precision: Precision = "bf16"
    """Accelerate ``mixed_precision``: bf16/fp16 compute with fp32 master weights, or fp32."""
    optimizer: str = "adamw"
    """Optimizer name, a key of :data:`OPTIMIZER_STATE_BYTES`."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward (keep only its input)."""
    offload: bool = False
    """FSDP CPU offload: sharded parameters, gradients and optimizer state live in host memory."""
    attention: Literal["fused", "eager"] = "fused"
    """``fused`` (SDPA/FlashAttention: the s x s attention matrices are never stored) or ``eager``
    (they are, the ``5as/h`` term of [Korthikanti] Eq. 1)."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step."""
    reduce_every_micro_batch: bool = False
    """Reduce (FSDP: reduce-scatter) gradients after every micro-batch instead of accumulating
    them unsharded under ``no_sync`` until the last one: less memory (no unsharded gradient of the
    whole model), ``grad_accum`` times the gradient communication."""
    lora: "LoraShape | None" = None
    """LoRA or QLoRA (:class:`LoraShape`); None for full fine-tuning."""

    @property
    def method(self) -> str:
        """``full``, ``lora`` or ``qlora``."""
        return "full" if self.lora is None else self.lora.method

    def __post_init__(self) -> None:
        problems = []
        if self.seq_len < 1:
            problems.append(f"--seq-len must be at least 1, got {self.seq_len}")
        if self.micro_batch < 1:
            problems.append(f"--micro-batch must be at least 1, got {self.micro_batch}")
        if self.precision not in PRECISIONS:
            problems.append(unknown_name_message("precision", str(self.precision), PRECISIONS))
        if self.optimizer not in OPTIMIZER_STATE_BYTES:
            problems.append(unknown_name_message("optimizer", str(self.optimizer), tuple(OPTIMIZER_STATE_BYTES)))
        if self.grad_accum < 1:
            problems.append(f"--grad-accum must be at least 1, got {self.grad_accum}")
        if self.attention not in ("fused", "eager"):
            problems.append(unknown_name_message("attention", str(self.attention), ("fused", "eager")))
        if problems:
            raise UsageError("; ".join(problems))

    @property
    def compute_bytes(self) -> int:
        """Bytes of one element of compute (all-gathered parameters, activations, reductions).

        Accelerate sets FSDP ``param_dtype`` and ``reduce_dtype`` both to the mixed-precision
        dtype (``FullyShardedDataParallelPlugin.set_mixed_precision``)."""
        return 4 if self.precision == "fp32" else 2

    @property
    def mixed(self) -> bool:
        """Whether a low-precision compute copy of the parameters exists beside the fp32 ones."""
        return self.precision != "fp32"

    def replace(self, **changes) -> "TrainingShape":
        return dataclasses.replace(self, **changes)


# --------------------------------------------------------------------------- results


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

    @property
    def label(self) -> str:
        """``FULL_SHARD (FSDP2)``, ``DDP``."""
        return self.name if self.fsdp_version is None else f"{self.name} (FSDP{self.fsdp_version})"

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "fsdp_version": self.fsdp_version,
            "shard_world_size": self.shard_world_size,
            "replicate_world_size": self.replicate_world_size,
            "per_gpu_bytes": self.per_gpu.to_json(),
            "fits": self.fits,
            "max_micro_batch": self.max_micro_batch,
            "comm_bytes_per_step": self.comm.to_json(),
            "notes": list(self.notes),
        }


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
            if strategy.name == name and (name == "DDP" or strategy.fsdp_version == fsdp_version):
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
            else {"name": recommended.name, "fsdp_version": recommended.fsdp_version},
            "reason": self.reason,
            "suggestions": list(self.suggestions),
            "hardware": dataclasses.asdict(self.hardware),
            "shape": dataclasses.asdict(self.shape),
            "method": self.shape.method,
        }


# --------------------------------------------------------------------------- FSDP units


@dataclass(frozen=True, kw_only=True)
class ShardUnit:
    """One FSDP unit: a group of parameters all-gathered and reduce-scattered together."""

    name: str
    """Block class name, ``embedding``, ``root`` (FSDP1) or ``tail`` (FSDP2)."""
    params: int
    """Parameters in one such unit."""
    count: int = 1
    """How many identical units."""
    reshards_after_forward: bool = True
    """False for units FSDP keeps unsharded from forward through backward whatever the strategy
    (the root: [FSDP] and [FSDP2]; accelerate's FSDP2 tail: [accelerate])."""


def input_embedding_params(profile: ModelProfile) -> int:
    """Parameters of the input token embedding when it is not tied to the head (else 0).

    Read from the profile's ``role: input`` embedding; a profile without roles falls back to
    vocab x hidden, bounded by the root."""
    if profile.tied_embeddings:
        return 0
    inputs = [entry.get("params", 0) for entry in profile.embeddings if entry.get("role") == "input"]
    if inputs:
        return min(sum(inputs), profile.root_params)
    return min(profile.dims.vocab_size * profile.dims.hidden_size, profile.root_params)


def fsdp_units(profile: ModelProfile, fsdp_version: int) -> list[ShardUnit]:
    """How accelerate wraps ``profile`` into FSDP units.

    FSDP1 (``transformer_based_wrap``): one flat parameter per block, and the root unit with
    everything else, which FSDP1 does not free after forward ([FSDP]: "the root's parameters
    are not freed after forward since they are needed immediately in backward").
    FSDP2 [accelerate]: each block; the untied input embedding as its own unit; a
    ``[final_norm, lm_head]`` tail (with the embedding when tied) and the root's leftovers, both
    kept unsharded after forward (``reshard_after_forward=False`` for the tail; torch's default
    for the root)."""
    if fsdp_version not in (1, 2):
        raise ValueError(f"fsdp_version must be 1 or 2, got {fsdp_version}")
    units = [ShardUnit(name=unit.cls, params=unit.params_each, count=unit.count) for unit in profile.units]
    if fsdp_version == 1:
        if profile.root_params:
            units.append(ShardUnit(name="root", params=profile.root_params, reshards_after_forward=False))
        return units
    embedding = input_embedding_params(profile)
    if embedding:
        units.append(ShardUnit(name="embedding", params=embedding))
    if profile.root_params - embedding:
        units.append(ShardUnit(name="tail", params=profile.root_params - embedding, reshards_after_forward=False))
    return units


def shard_numel(params: int, shard_world_size: int) -> int:
    """Elements of one unit a rank holds: ``ceil(params / N)``.

    FSDP1 pads each flat parameter to a multiple of N, so every rank holds exactly this [FSDP].
    FSDP2 pads each *parameter*'s dim 0 to a multiple of N ([FSDP2]: rank 0 holds
    ``ceil(dim0 / N)`` rows of each), which :func:`fsdp2_shard_numel` computes from shapes;
    from a unit's total alone this is exact when every dim 0 divides by N (the usual case:
    widths are multiples of 64) and otherwise short by under one row per parameter."""
    return -(-params // shard_world_size)


def fsdp2_shard_numel(shapes: list[tuple[int, ...]], shard_world_size: int) -> int:
    """Elements the largest rank (rank 0) holds of FSDP2-sharded parameters of these shapes:
    ``ceil(dim0 / N)`` rows of each [FSDP2]. Later ranks hold fewer rows when dim 0 is uneven
    (``torch.chunk`` semantics; their shards are padded in storage up to the same size)."""
    total = 0
    for shape in shapes:
        if not shape:  # a 0-d parameter counts as one row
            shape = (1,)
        rows = -(-shape[0] // shard_world_size)
        total += rows * math.prod(shape[1:])
    return total


def fused_expert_params(profile: ModelProfile) -> int:
    """Parameters of one block's experts when transformers stores them fused, one 3-D tensor per
    projection with the experts on dim 0 (Mixtral in transformers 5: gate, up and down, each
    experts x hidden x intermediate); 0 for a dense model."""
    dims = profile.dims
    return dims.num_experts * 3 * dims.hidden_size * dims.intermediate_size if dims.num_experts else 0


def _unit_shard_numel(profile: ModelProfile, unit: "ShardUnit", shard_world_size: int, fsdp_version: int) -> int:
    """Elements of ``unit`` the largest rank (rank 0) holds. FSDP2 shards every parameter on
    dim 0 [FSDP2]: a fused expert tensor has only ``experts`` rows, so over more ranks than
    experts rank 0 holds a whole expert of each (1/8 of Mixtral's experts at 16 or 32 GPUs, not
    1/16 or 1/32; rehearsed: 21.2 GiB of fp32 parameters on rank 0 at 32 GPUs)."""
    experts = fused_expert_params(profile)
    if fsdp_version != 2 or not experts or unit.name in ("embedding", "tail", "root") or experts > unit.params:
        return shard_numel(unit.params, shard_world_size)
    count = profile.dims.num_experts
    rows = -(-count // shard_world_size)
    return rows * (experts // count) + shard_numel(unit.params - experts, shard_world_size)


def model_state_bytes(
    profile: ModelProfile, shape: TrainingShape, shard_world_size: int, fsdp_version: int | None = 2
) -> ModelStateBytes:
    """Per-rank parameters, gradients and optimizer state with model states sharded over
    ``shard_world_size`` ranks (1: replicated, as DDP and NO_SHARD).

    The [ZeRO] Sec. 3.1 accounting with the stored-fp32 convention of this module: 4 + 4 + K'
    bytes per parameter (K' = optimizer state, 8 for Adam), divided by the shard world size
    (ZeRO stage 3 = FSDP FULL_SHARD, Sec. 5.3)."""
    if shard_world_size < 1:
        raise ValueError(f"shard_world_size must be at least 1, got {shard_world_size}")
    if shape.lora is not None:
        return lora_model_state_bytes(profile, shape, shard_world_size, fsdp_version)
    if shard_world_size == 1 or fsdp_version is None:
        numel = profile.total_params if shard_world_size == 1 else shard_numel(profile.total_params, shard_world_size)
    else:
        numel = sum(unit.count * _unit_shard_numel(profile, unit, shard_world_size, fsdp_version)
                    for unit in fsdp_units(profile, fsdp_version))
    return ModelStateBytes(
        params=numel * STORED_PARAM_BYTES,
        grads=numel * STORED_PARAM_BYTES,
        optimizer=numel * OPTIMIZER_STATE_BYTES[shape.optimizer],
    )


def zero_model_state_bytes(total_params: int, stage: int, world_size: int, k: int = 12) -> float:
    """[ZeRO] Sec. 5 / Fig. 1 model-state bytes per GPU, fp16 mixed precision with a K-byte
    optimizer (K = 12 for mixed-precision Adam): stage 0 (DDP) (2+2+K)P, stage 1 (P_os)
    (2+2)P + KP/N, stage 2 (P_os+g) 2P + (2+K)P/N, stage 3 (P_os+g+p) (2+2+K)P/N.

    Kept for comparison with the paper: FSDP stores fp32 parameters and gradients (see module
    notes), which gives the same totals for stages 0 and 3 and 2P/N more than stage 2 for
    SHARD_GRAD_OP (its sharded gradients are fp32, not fp16)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    n = world_size
    psi = total_params
    return {
        0: (2 + 2 + k) * psi,
        1: (2 + 2) * psi + k * psi / n,
        2: 2 * psi + (2 + k) * psi / n,
        3: (2 + 2 + k) * psi / n,
    }[stage]


# --------------------------------------------------------------------------- activations


@dataclass(frozen=True, kw_only=True)
class BlockActivations:
    """What one family's blocks keep for backward, in bytes per token and per hidden unit with
    16-bit compute, measured by rehearsing a real training step (:mod:`fsdp_presets.plan.rehearsal`).
    Bytes of one block = coefficient x sequence x micro-batch x hidden size."""

    saved: float
    """One block without activation checkpointing."""
    checkpointed: float
    """One block under activation checkpointing (its input, and what the checkpoint keeps)."""
    outside: float
    """Outside the blocks (embedding output, final norm), once per model."""
    logits: float = 12
    """Bytes per logit element (sequence x micro-batch x vocabulary) at the loss's backward: see
    :data:`LOGITS_BYTES_AT_PEAK`; more where the model transforms its logits (Gemma 2's final
    soft-capping keeps its own copies)."""
    attention_scores: float = 0
    """Bytes per attention score (heads x sequence^2 x micro-batch) one block stores: non-zero for
    families whose attention is eager in transformers (Gemma 2's soft-capping), 0 for SDPA."""
    measured: str
    """The rehearsals that produced the numbers, and what they measured."""


_REHEARSED = "fsdp-presets rehearse model_configs/{model} --gpus 8 --seq-len {seq} (FULL_SHARD, bf16, micro-batch 1) "

BLOCK_ACTIVATIONS = MappingProxyType({
    # SwiGLU MLP (gate, up, their product and the SiLU: 8 bytes per intermediate unit), fp32
    # RMSNorm upcasts, rotary q/k copies: about 25.5 x h + 8 x intermediate per token and layer.
    "llama": BlockActivations(
        saved=54.03, checkpointed=2.0, outside=8.13,
        measured=_REHEARSED.format(model="llama-3.1-8b", seq=4096) + "with 32 and 2 layers: activations 29.10 and "
        "3.77 GiB at the loss's backward (25.33 GiB / 30 layers = 54.03 x s x h); under activation checkpointing "
        "3.10 and 2.16 GiB (2.0: each block keeps its bf16 input)"),
    "mistral": BlockActivations(
        saved=54.03, checkpointed=2.0, outside=8.13,
        measured=_REHEARSED.format(model="mistral-7b-v0.3", seq=4096) + "with 4 and 2 layers: activations 4.00 and "
        "2.32 GiB (Llama's block); checkpointed as Llama's (its own peak then moves into a block's backward)"),
    "qwen2": BlockActivations(
        saved=68.6, checkpointed=2.0, outside=8.14,
        measured=_REHEARSED.format(model="qwen2.5-7b", seq=4096) + "with 4 and 2 layers: activations 6.18 and "
        "4.31 GiB (a 5.3 x h MLP); under activation checkpointing 2.56 and 2.50 GiB"),
    "phi3": BlockActivations(
        saved=54.04, checkpointed=2.0, outside=8.13,
        measured=_REHEARSED.format(model="phi-3-mini-4k", seq=4096) + "with 4 and 2 layers: activations 3.12 and "
        "1.85 GiB; under activation checkpointing 0.69 and 0.65 GiB"),
    "gemma2": BlockActivations(
        saved=77.16, checkpointed=2.0, outside=8.13, logits=14.03, attention_scores=8.0,
        measured=_REHEARSED.format(model="gemma-2-9b", seq="4096 and 2048") + "with 4 and 2 layers: activations "
        "18.22 and 12.11 GiB at 4096, 7.11 and 5.05 GiB at 2048; per layer 77.16 x s x h plus 8 bytes per "
        "attention score (eager attention: soft-capping), the final logit soft-capping 2.03 bytes per logit "
        "more; under activation checkpointing 6.17 and 6.12 GiB at 4096"),
    "mixtral": BlockActivations(
        saved=90.0, checkpointed=2.0, outside=8.13,
        measured=_REHEARSED.format(model="mixtral-8x7b", seq=4096) + "with all 32 layers: peak 119.93 GiB in the "
        "last block's backward, activations and temporaries 45.84 GiB (the expert MLPs' routed copies); fitted to "
        "that run. Truncated models (2 and 4 layers) measure less per layer: expert routing under fake tensors is "
        "not data-dependent, so this is an estimate for other sizes"),
})
"""Per Hugging Face ``model_type``: measured by ``fsdp-presets rehearse`` (FSDP2 FULL_SHARD,
bf16, seq 4096, micro-batch 1) at two layer counts of the family's shipped config
(``model_configs/``): the difference per layer is ``saved``/``checkpointed``, the rest after the
logits is ``outside``. A family not listed uses the largest measured figures (cautious)."""

LOGITS_BYTES_AT_PEAK = 12
"""Bytes per logit element (sequence x micro-batch x vocabulary) at the peak, the backward of the
loss: the fp32 log-softmax that ``cross_entropy`` saved (4) and the two fp32 gradients its
backward computes from it (8). Measured: 8B at 8 GPUs, seq 4096: 1.96 GiB saved + 3.91 GiB of
temporaries for 525M logits. (The bf16 logits and their fp32 copy are freed by then.)"""


def block_activations(profile: ModelProfile) -> BlockActivations:
    """The family's measured :class:`BlockActivations`, or the largest measured ones."""
    known = BLOCK_ACTIVATIONS.get(profile.model_type)
    if known is not None:
        return known
    return BlockActivations(
        saved=max(entry.saved for entry in BLOCK_ACTIVATIONS.values()),
        checkpointed=max(entry.checkpointed for entry in BLOCK_ACTIVATIONS.values()),
        outside=max(entry.outside for entry in BLOCK_ACTIVATIONS.values()),
        logits=LOGITS_BYTES_AT_PEAK,
        measured=f"no measurement for model_type {profile.model_type!r}: the largest of "
        f"{', '.join(sorted(BLOCK_ACTIVATIONS))}",
    )


def _tokens_hidden(profile: ModelProfile, shape: TrainingShape, micro_batch: int) -> float:
    """``s x b x h``, scaled by the compute width (fp32 activations are twice 16-bit ones)."""
    return shape.seq_len * micro_batch * profile.dims.hidden_size * shape.compute_bytes / 2


def activation_bytes_per_layer(profile: ModelProfile, shape: TrainingShape, micro_batch: int) -> int:
    """One block's saved activations, without checkpointing: the family's measured coefficient
    (:data:`BLOCK_ACTIVATIONS`) x ``sbh``. With eager attention add the ``5as/h`` of
    [Korthikanti] Eq. 1 (the s x s scores, softmax and dropout mask), which fused attention
    (FlashAttention, Dao et al. 2022; PyTorch SDPA, as rehearsed) never stores.

    [Korthikanti] Eq. 1 gives 34 for a GPT layer (4h GELU MLP); a Llama block measures ~54
    (SwiGLU's three 3.5h-wide tensors, the fp32 upcast inside RMSNorm, rotary embeddings)."""
    s, a, h = shape.seq_len, profile.dims.num_attention_heads, profile.dims.hidden_size
    family = block_activations(profile)
    coefficient = family.saved + (5 * a * s / h if shape.attention == "eager" and not family.attention_scores else 0)
    scores = family.attention_scores * a * s * s * micro_batch * shape.compute_bytes / 2
    return math.ceil(_tokens_hidden(profile, shape, micro_batch) * coefficient + scores)


def logits_bytes(profile: ModelProfile, shape: TrainingShape, micro_batch: int) -> int:
    """Logits and the loss's fp32 tensors at the peak (:data:`LOGITS_BYTES_AT_PEAK` per element)."""
    per_element = block_activations(profile).logits
    return math.ceil(shape.seq_len * micro_batch * profile.dims.vocab_size * per_element)


def activation_bytes(profile: ModelProfile, shape: TrainingShape, micro_batch: int | None = None) -> int:
    """Activations at the peak, the start of backward (the loss's backward): every block's saved
    activations (checkpointed blocks keep less, :class:`BlockActivations`), what is saved outside
    the blocks, and the logits with the loss's fp32 tensors.

    Under activation checkpointing the peak is still there: recomputing one block later in
    backward needs less than the logits' loss tensors free by then (measured for 8B and 70B)."""
    b = shape.micro_batch if micro_batch is None else micro_batch
    family = block_activations(profile)
    per_block = family.checkpointed if shape.activation_checkpointing else family.saved
    tokens_hidden = _tokens_hidden(profile, shape, b)
    blocks = profile.dims.num_layers * (
        math.ceil(tokens_hidden * per_block) if shape.activation_checkpointing
        else activation_bytes_per_layer(profile, shape, b))
    return blocks + math.ceil(tokens_hidden * family.outside) + logits_bytes(profile, shape, b)


# --------------------------------------------------------------------------- communication


def _ring(op: str, payload_bytes: int, group_size: int) -> int:
    """Bytes one rank sends for a collective over ``group_size`` ranks whose full (unsharded)
    buffer is ``payload_bytes`` [NCCL]: all-gather and reduce-scatter (n-1)/n, all-reduce 2(n-1)/n."""
    if group_size <= 1:
        return 0
    factor = 2 if op == "all_reduce" else 1
    return factor * payload_bytes * (group_size - 1) // group_size


def _comm(parts: list[tuple[str, int, int, bool]]) -> CommBytes:
    """Sum ``(op, payload_bytes, group_size, spans_nodes)`` collectives, split by link. A ring
    over a group that spans nodes crosses the network, and every rank's traffic then moves at
    the slowest link's speed, so all of it is counted as inter-node."""
    totals = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    intra = inter = 0
    for op, payload, group_size, spans_nodes in parts:
        sent = _ring(op, payload, group_size)
        totals[op] += sent
        if spans_nodes:
            inter += sent
        else:
            intra += sent
    return CommBytes(**totals, intra_node=intra, inter_node=inter)


def fsdp_comm(
    profile: ModelProfile, hardware: Hardware, shape: TrainingShape, name: str, fsdp_version: int
) -> CommBytes:
    """Per-step communication of an FSDP strategy.

    [ZeRO] Sec. 7.2.2: stage 3 all-gathers the parameters in forward and again in backward and
    reduce-scatters the gradients (3 x the parameters, 1.5 x DDP's 2 x). Units FSDP keeps
    unsharded after forward (root/tail) are not re-gathered in backward; SHARD_GRAD_OP keeps
    every unit, so it gathers once. Payloads include the padding of each unit to N shards.
    HYBRID_SHARD does this inside a node and all-reduces the gradient shards across nodes."""
    if name == "HYBRID_SHARD":
        shard_size, replicate_size = hardware.gpus_per_node, hardware.nodes
    else:
        shard_size, replicate_size = hardware.gpus, 1
    c = shape.compute_bytes  # all-gather in param_dtype, reduce in reduce_dtype (= param_dtype)
    gathered = reduced = sharded = 0
    for unit in fsdp_units(profile, fsdp_version):
        padded = unit.count * shard_numel(unit.params, shard_size) * shard_size
        regathered = unit.reshards_after_forward and name != "SHARD_GRAD_OP"
        gathered += padded * (2 if regathered else 1)
        reduced += padded
        sharded += unit.count * shard_numel(unit.params, shard_size)
    # The shard group spans nodes unless it is HYBRID_SHARD's node-local one; the replicate
    # group always does (one rank per node).
    shard_spans = hardware.nodes > 1 and name != "HYBRID_SHARD"
    parts = [
        ("all_gather", gathered * c, shard_size, shard_spans),
        ("reduce_scatter", reduced * c, shard_size, shard_spans),
    ]
    if replicate_size > 1:
        parts.append(("all_reduce", sharded * c, replicate_size, True))
    return _comm(parts)


# --------------------------------------------------------------------------- one strategy


ACCUMULATED_GRAD_BYTES = {1: STORED_PARAM_BYTES, 2: 2}
"""Bytes per parameter of the unsharded gradients FSDP accumulates under ``no_sync``, by FSDP
version, with 16-bit compute. FSDP2 keeps every parameter's unsharded gradient in the compute
dtype until the micro-batch that reduces (measured: +14.96 GiB per GPU for 8B at 8 GPUs, with
or without activation checkpointing); FSDP1 accumulates them in the parameter dtype (fp32; not
rehearsed). In fp32 both are 4."""


def _accumulated_grads(profile: ModelProfile, shape: TrainingShape, fsdp_version: int | None) -> int:
    """Unsharded gradients of the whole model held across micro-batches under ``no_sync``."""
    if shape.grad_accum == 1 or shape.reduce_every_micro_batch or fsdp_version is None:
        return 0
    per_param = STORED_PARAM_BYTES if shape.compute_bytes == 4 else ACCUMULATED_GRAD_BYTES[fsdp_version]
    return profile.total_params * per_param


def _mlp_width(profile: ModelProfile) -> int:
    """Widest MLP tensor per token: the intermediate size, times the experts each token visits."""
    return profile.dims.intermediate_size * max(1, profile.dims.num_experts_per_token)


def _peak(profile: ModelProfile, shape: TrainingShape, name: str, fsdp_version: int | None,
          state: ModelStateBytes, micro_batch: int) -> PerGpuBytes:
    """Bytes on one GPU at the peak of a step at ``micro_batch``; ``state`` is what the GPU keeps
    between steps (zero when offloaded).

    FSDP: the larger of two moments of the last micro-batch's backward, as rehearsed:

    - the loss's backward (the peak in every rehearsal here): parameters and optimizer state,
      every saved activation, the logits' fp32 loss tensors, the units FSDP keeps gathered (the
      tail/root), and the unsharded gradients accumulated under ``no_sync``. Gradient shards do
      not exist yet (``zero_grad(set_to_none=True)`` freed them), unless gradients are reduced
      every micro-batch, which keeps their fp32 shards between micro-batches.
    - a block's backward: the logits' tensors are gone; that block and the next (prefetched,
      [FSDP] Sec. 3.3) are gathered, with the unsharded gradients of one and the gradient shards
      of the units reduced before it; its activations are recomputed first under activation
      checkpointing, and the gradients of its MLP's two widest tensors are live (measured:
      Mixtral-8x7B peaks here, and Mistral-7B under activation checkpointing, with
      2 x s x b x intermediate x 2 bytes of temporaries).

    DDP and NO_SHARD are not rehearsed: model states, full gradients and the buffers below."""
    if shape.lora is not None:
        return _lora_peak(profile, shape, name, fsdp_version, state, micro_batch)
    c = shape.compute_bytes
    total = profile.total_params
    activations = activation_bytes(profile, shape, micro_batch)
    accumulated = _accumulated_grads(profile, shape, fsdp_version)
    if name == "DDP":
        # [DDP]: buckets as large as all gradients (fp32, the parameter dtype) unless
        # gradient_as_bucket_view=True; under autocast the low-precision copies of the weights
        # are saved for backward.
        buffers = total * STORED_PARAM_BYTES + (total * c if shape.mixed else 0)
        return PerGpuBytes(params=state.params, grads=state.grads, optimizer=state.optimizer,
                           activations=activations, buffers=buffers)
    if name == "NO_SHARD":
        units = fsdp_units(profile, fsdp_version)
        largest = max((unit.params for unit in units), default=0)
        # FSDP1 NO_SHARD under mixed precision keeps a full low-precision copy for compute.
        buffers = (total * c + largest * c) if shape.mixed else 0
        return PerGpuBytes(params=state.params, grads=state.grads, optimizer=state.optimizer,
                           activations=activations, buffers=buffers + accumulated)
    units = fsdp_units(profile, fsdp_version)
    resharded = sorted(
        (unit.params for unit in units if unit.reshards_after_forward for _ in range(min(unit.count, 2))),
        reverse=True,
    )
    largest = resharded[0] if resharded else 0
    kept = sum(unit.count * unit.params for unit in units if not unit.reshards_after_forward)
    if name == "SHARD_GRAD_OP":
        gathered_at_loss = gathered_in_block = total  # every unit gathered from forward to backward
    else:
        gathered_at_loss, gathered_in_block = kept, kept + sum(resharded[:2])
    grads = state.grads if shape.grad_accum > 1 and shape.reduce_every_micro_batch else 0
    # In a block's backward the units reduced before it (the tail, the block after it) already
    # hold their fp32 gradient shards (measured: 0.74 GiB for Mixtral-8x7B at 8 GPUs).
    reduced_shards = grads or (state.grads * (largest + kept) // total if total else 0)
    at_loss = PerGpuBytes(params=state.params, grads=grads, optimizer=state.optimizer, activations=activations,
                          buffers=gathered_at_loss * c + accumulated)
    # Under activation checkpointing the block in backward first recomputes its full activations.
    recomputed = activation_bytes_per_layer(profile, shape, micro_batch) if shape.activation_checkpointing else 0
    block_temporaries = 2 * shape.seq_len * micro_batch * _mlp_width(profile) * c
    in_block = PerGpuBytes(params=state.params, grads=reduced_shards, optimizer=state.optimizer,
                           activations=activations - logits_bytes(profile, shape, micro_batch) + recomputed
                           + block_temporaries,
                           buffers=gathered_in_block * c + largest * c + accumulated)
    # The end of backward: every gradient shard exists (the backward of the embedding, with the
    # last blocks gathered). Sharded states dominate here when they are large beside the
    # activations: fused experts over more ranks than experts (rehearsed: Mixtral-8x7B at 32
    # GPUs, rank 0 peaks late in backward with most of its 21 GiB of gradient shards).
    # (The tail kept gathered through backward is resharded after its own backward, early on.)
    at_end = PerGpuBytes(params=state.params, grads=max(state.grads, grads), optimizer=state.optimizer,
                         activations=recomputed + block_temporaries,
                         buffers=(gathered_in_block - (kept if name != "SHARD_GRAD_OP" else 0)) * c + largest * c
                         + accumulated)
    return max(at_loss, in_block, at_end, key=lambda peak: peak.total)


def _strategy_plan(
    profile: ModelProfile, hardware: Hardware, shape: TrainingShape, name: str, fsdp_version: int | None
) -> StrategyPlan:
    notes: list[str] = []
    if name in ("DDP", "NO_SHARD"):
        shard_size, replicate_size = 1, hardware.gpus
    elif name == "HYBRID_SHARD":
        shard_size, replicate_size = hardware.gpus_per_node, hardware.nodes
    else:
        shard_size, replicate_size = hardware.gpus, 1
    state = model_state_bytes(profile, shape, shard_size, fsdp_version)
    # CPU offload is planned for the sharded strategies only: DDP has none, and FSDP1 NO_SHARD
    # would move whole replicas through PCIe every step.
    offloaded = shape.offload and name not in ("DDP", "NO_SHARD")
    if shape.offload and not offloaded:
        notes.append(f"offload is not planned for {name}; shown without it")
    if offloaded:
        notes.append(f"{state.total / GiB:.1f} GiB of model states per rank in host memory")
    on_gpu = ModelStateBytes(params=0, grads=0, optimizer=0) if offloaded else state

    if shape.lora is not None:
        comm = lora_comm(profile, hardware, shape, name, fsdp_version)
    elif name == "DDP":
        # Gradients all-reduced in the parameter dtype (fp32 under autocast) [ZeRO] Sec. 7.1.
        comm = _comm([("all_reduce", profile.total_params * STORED_PARAM_BYTES, hardware.gpus, hardware.nodes > 1)])
    elif name == "NO_SHARD":
        comm = _comm([("all_reduce", profile.total_params * shape.compute_bytes, hardware.gpus, hardware.nodes > 1)])
    else:
        comm = fsdp_comm(profile, hardware, shape, name, fsdp_version)

    def total_at(micro_batch: int) -> int:
        return _peak(profile, shape, name, fsdp_version, on_gpu, micro_batch).total

    per_gpu = _peak(profile, shape, name, fsdp_version, on_gpu, shape.micro_batch)
    return StrategyPlan(
        name=name,
        fsdp_version=fsdp_version,
        shard_world_size=shard_size,
        replicate_world_size=replicate_size,
        model_state=state,
        per_gpu=per_gpu,
        fits=per_gpu.total <= hardware.usable_bytes,
        max_micro_batch=_max_micro_batch(total_at, hardware.usable_bytes),
        comm=comm,
        notes=tuple(notes),
    )


def _max_micro_batch(total_at, usable: int) -> int:
    """Largest b with total_at(b) <= usable; total_at grows linearly in b (activations)."""
    if total_at(1) > usable:
        return 0
    per_sample = total_at(2) - total_at(1)
    if per_sample <= 0:
        return 1
    guess = 1 + (usable - total_at(1)) // per_sample
    while guess > 1 and total_at(guess) > usable:  # ceil() rounding can push the guess over
        guess -= 1
    return guess


# --------------------------------------------------------------------------- the plan


def strategies_for(hardware: Hardware) -> list[tuple[str, int | None]]:
    """The (strategy, fsdp_version) rows that apply to this hardware, in table order.

    NO_SHARD is FSDP1 only (accelerate's FSDP2 takes a boolean reshard_after_forward);
    HYBRID_SHARD needs more than one node."""
    rows: list[tuple[str, int | None]] = [("DDP", None), ("NO_SHARD", 1)]
    for name in ("SHARD_GRAD_OP", "FULL_SHARD") + (("HYBRID_SHARD",) if hardware.nodes > 1 else ()):
        rows += [(name, 1), (name, 2)]
    return rows


def _rank_key(strategy: StrategyPlan) -> tuple:
    return (
        strategy.comm.inter_node,
        strategy.comm.total,
        _PREFERENCE.index((strategy.name, strategy.fsdp_version)),
    )


def _best(strategies: list[StrategyPlan]) -> StrategyPlan | None:
    """The strategy that fits with the least communication (across nodes first); then its FSDP2
    form when that fits too. FSDP1 and FSDP2 of one strategy differ in communication only by
    which small units are re-gathered, which is no reason to leave the default version."""
    fitting = sorted((s for s in strategies if s.fits), key=_rank_key)
    if not fitting:
        return None
    same_name = [s for s in fitting if s.name == fitting[0].name]
    return min(same_name, key=lambda s: _PREFERENCE.index((s.name, s.fsdp_version)))


def plan(profile: ModelProfile, hardware: Hardware, shape: TrainingShape) -> MemoryPlan:
    """Cost every applicable strategy and recommend one.

    The recommendation is, among the strategies that fit at the requested micro-batch, the one
    that sends the fewest bytes across nodes, then the fewest in total; ties go to the simpler
    strategy and to FSDP2 over FSDP1. When nothing fits, ``recommended`` is None and
    ``suggestions`` lists re-planned changes that would fit."""
    strategies = [_strategy_plan(profile, hardware, shape, name, version) for name, version in strategies_for(hardware)]
    best = _best(strategies)
    if best is not None:
        others = [s for s in strategies if not s.fits]
        reason = (
            f"{best.label} fits with the least communication: {human_bytes(best.per_gpu.total)} of "
            f"{human_bytes(hardware.usable_bytes)} usable per GPU at micro-batch {shape.micro_batch} (up to "
            f"{best.max_micro_batch}), {human_bytes(best.comm.total, binary=False)} sent per GPU per step"
        )
        if best.comm.inter_node:
            reason += f" ({human_bytes(best.comm.inter_node, binary=False)} across nodes)"
        if others:
            smallest_missing = min(others, key=lambda s: s.per_gpu.total)
            reason += f"; {len(others)} other(s) do not fit (e.g. {smallest_missing.label} needs {human_bytes(smallest_missing.per_gpu.total)})"
        return MemoryPlan(hardware=hardware, shape=shape, strategies=strategies, recommended=best, reason=reason)
    smallest = min(strategies, key=lambda s: s.per_gpu.total)
    reason = (
        f"nothing fits at micro-batch {shape.micro_batch}: the smallest is {smallest.label} with "
        f"{human_bytes(smallest.per_gpu.total)} per GPU against {human_bytes(hardware.usable_bytes)} usable"
    )
    return MemoryPlan(
        hardware=hardware,
        shape=shape,
        strategies=strategies,
        recommended=None,
        reason=reason,
        suggestions=_suggestions(profile, hardware, shape),
    )


def _fits_anywhere(profile: ModelProfile, hardware: Hardware, shape: TrainingShape) -> StrategyPlan | None:
    return _best([_strategy_plan(profile, hardware, shape, name, version) for name, version in strategies_for(hardware)])


def _suggestions(profile: ModelProfile, hardware: Hardware, shape: TrainingShape) -> list[str]:
    """Changes that make something fit, each verified by planning again: memory savers first
    (cheapest to adopt), then more GPUs."""
    savers: list[tuple[str, dict]] = []
    if shape.micro_batch > 1:
        savers.append(("--micro-batch 1 (gradient accumulation keeps the batch)", {"micro_batch": 1}))
    if not shape.activation_checkpointing:
        savers.append(("--activation-checkpointing on", {"activation_checkpointing": True}))
    if not shape.offload:
        savers.append(("--offload on (slower: bound by host memory and PCIe)", {"offload": True}))
    all_savers = {key: value for _, change in savers for key, value in change.items()}
    if len(savers) > 1:
        savers.append((" + ".join(text.split(" (")[0] for text, _ in savers), all_savers))
    suggestions = []
    for text, change in savers:
        if hit := _fits_anywhere(profile, hardware, shape.replace(**change)):
            suggestions.append(f"{text}: {hit.label} fits")
            break  # the first (cheapest) saver that works; the rest would fit too or cost more

    # Fewest GPUs at which something fits, as asked, or else with every saver: more GPUs in the
    # one node asked for, or more nodes of the same size.
    def resized(count: int) -> Hardware:
        if hardware.nodes == 1:
            return dataclasses.replace(hardware, gpus=count)
        return dataclasses.replace(hardware, gpus=count * hardware.gpus_per_node, nodes=count)

    def describe(count: int) -> str:
        if hardware.nodes == 1:
            return f"{count} GPUs"
        return f"{count * hardware.gpus_per_node} GPUs ({count} nodes of {hardware.gpus_per_node})"

    start = hardware.nodes if hardware.nodes > 1 else hardware.gpus
    candidates = [("", shape)] + [(f" with {text.split(' (')[0]}", shape.replace(**change)) for text, change in savers]
    for label, candidate in candidates:
        if _fits_anywhere(profile, resized(start), candidate):
            continue  # fits without more GPUs: said above
        count = start
        for _ in range(24):  # doubling: up to 2**24 times as many
            count *= 2
            if _fits_anywhere(profile, resized(count), candidate):
                low, high = max(start, count // 2), count  # low does not fit, high does
                while high - low > 1:
                    middle = (low + high) // 2
                    if _fits_anywhere(profile, resized(middle), candidate):
                        high = middle
                    else:
                        low = middle
                hit = _fits_anywhere(profile, resized(high), candidate)
                suggestions.append(f"{describe(high)} of {hardware.gpu_memory_bytes / GiB:g} GiB{label}: {hit.label} fits")
                break
        else:
            continue
        break  # the first candidate that more GPUs make fit
    if not suggestions:
        suggestions.append("no change tried fits: use GPUs with more memory or shorter sequences (--seq-len)")
    return suggestions


# --------------------------------------------------------------------------- LoRA and QLoRA
#
# Sources:
# - [LoRA] Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685:
#   a frozen W plus B @ A with A (r x in) and B (out x r): r x (in + out) trainable parameters per
#   adapted Linear (Sec. 4.1).
# - [QLoRA] Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs",
#   arXiv:2305.14314, Sec. 2-3: NF4 weights (4 bits), one fp32 absmax per 64-weight block
#   (32/64 = 0.5 bits per parameter); double quantization stores those constants in 8 bits with
#   one fp32 constant per 256 of them: 8/64 + 32/(64 x 256) = 0.127 bits per parameter.
# - [bitsandbytes] ``bitsandbytes.nn.Linear4bit`` / ``Params4bit`` (0.50) and transformers'
#   ``BitsAndBytesConfig``: every ``nn.Linear`` but the output head is quantized, its packed
#   weight (two 4-bit values per byte) held in ``bnb_4bit_quant_storage`` (bfloat16 here, so FSDP
#   shards it like any bf16 tensor; uint8 storage is left replicated by accelerate), dequantized
#   one Linear at a time for compute.
# - [accelerate] ``fsdp2_prepare_model`` (1.16) upcasts to fp32 only parameters that require
#   gradients: the frozen base keeps its storage dtype, the adapters become fp32 masters.

METHODS: tuple[str, ...] = ("full", "lora", "qlora")
"""Training methods: every weight, a LoRA adapter over a frozen base, or LoRA over a 4-bit base."""

NF4_BYTES_PER_PARAM = 0.5
"""4-bit NF4 weights, two per byte [QLoRA]."""

QUANT_CONSTANT_BITS = {False: 32 / 64, True: 8 / 64 + 32 / (64 * 256)}
"""Bits per quantized parameter of quantization constants, without / with double quantization
[QLoRA] Sec. 3: an fp32 absmax per 64 weights (0.5), or 8-bit absmax plus an fp32 constant per 256
of them (0.127). The recipes' ``BitsAndBytesConfig`` keeps double quantization off."""

DEFAULT_LORA_R = 16
"""peft's and trl's usual rank for QLoRA recipes (the recipes' default with --load-in-4bit)."""


@dataclass(frozen=True, kw_only=True)
class LoraShape:
    """A LoRA adapter: which Linear layers, which rank, and (QLoRA) how the base is stored."""

    method: Literal["lora", "qlora"] = "lora"
    r: int = DEFAULT_LORA_R
    alpha: float | None = None
    """peft's ``lora_alpha`` (default 2 x r); recorded, it does not change memory."""
    dropout: float = 0.0
    """Dropout on the adapter's input: above 0 it keeps a copy of each adapted Linear's input."""
    target_modules: tuple[str, ...] | None = None
    """Module names (``q_proj``) or ``("all-linear",)``; None: every Linear of the block (the
    attention and MLP projections)."""
    double_quant: bool = False
    """QLoRA: bitsandbytes ``bnb_4bit_use_double_quant`` (off in the recipes)."""

    def __post_init__(self) -> None:
        problems = []
        if self.method not in ("lora", "qlora"):
            problems.append(unknown_name_message("method", str(self.method), METHODS))
        if not isinstance(self.r, int) or self.r < 1 or self.r > 65536:
            problems.append(f"--lora-r must be a whole number from 1 to 65536, got {self.r}")
        if self.alpha is not None and not (math.isfinite(self.alpha) and self.alpha > 0):
            problems.append(f"--lora-alpha must be a positive number, got {self.alpha}")
        if not (math.isfinite(self.dropout) and 0 <= self.dropout < 1):
            problems.append(f"--lora-dropout must be in [0, 1), got {self.dropout}")
        if self.target_modules is not None and not self.target_modules:
            problems.append("--lora-target-modules is empty: give names such as q_proj,v_proj or all-linear")
        if problems:
            raise UsageError("; ".join(problems))

    @property
    def lora_alpha(self) -> float:
        return float(2 * self.r if self.alpha is None else self.alpha)

    def to_json(self) -> dict:
        return {"method": self.method, "r": self.r, "alpha": self.lora_alpha, "dropout": self.dropout,
                "target_modules": None if self.target_modules is None else list(self.target_modules),
                "double_quant": self.double_quant}


@dataclass(frozen=True, kw_only=True)
class BlockLinear:
    name: str
    in_features: int
    out_features: int
    bias: bool = False


def block_linears(profile: ModelProfile, cls: str) -> list[BlockLinear]:
    """The Linear layers of one block of class ``cls``, read off the profile; for a profile
    without them (older JSON), the Llama-style projections from the dims."""
    known = (profile.structure.get("block_linears") or {}).get(cls)
    if known is not None:
        return [BlockLinear(name=n, in_features=i, out_features=o, bias=bool(b)) for n, i, o, b in known]
    d = profile.dims
    if not (d.hidden_size and d.num_attention_heads):
        return []
    head = d.hidden_size // d.num_attention_heads
    q, kv = d.num_attention_heads * head, d.num_key_value_heads * head
    return [BlockLinear(name="q_proj", in_features=d.hidden_size, out_features=q),
            BlockLinear(name="k_proj", in_features=d.hidden_size, out_features=kv),
            BlockLinear(name="v_proj", in_features=d.hidden_size, out_features=kv),
            BlockLinear(name="o_proj", in_features=q, out_features=d.hidden_size),
            BlockLinear(name="gate_proj", in_features=d.hidden_size, out_features=d.intermediate_size),
            BlockLinear(name="up_proj", in_features=d.hidden_size, out_features=d.intermediate_size),
            BlockLinear(name="down_proj", in_features=d.intermediate_size, out_features=d.hidden_size)]


def default_target_modules(profile: ModelProfile) -> list[str]:
    """The attention and MLP projections of the family's block: every Linear name in it."""
    names: list[str] = []
    for unit in profile.units:
        for linear in block_linears(profile, unit.cls):
            if linear.name not in names:
                names.append(linear.name)
    return names


def targeted_linears(profile: ModelProfile, lora: LoraShape, cls: str) -> list[BlockLinear]:
    """The Linear layers of one block that get an adapter (peft matches the last name component)."""
    linears = block_linears(profile, cls)
    targets = lora.target_modules
    if targets is None or "all-linear" in targets:
        return linears
    return [linear for linear in linears if linear.name in targets]


def unknown_target_modules(profile: ModelProfile, lora: LoraShape) -> list[str]:
    """Requested target names that no block of the model has (peft would raise)."""
    if lora.target_modules is None or "all-linear" in lora.target_modules:
        return []
    present = set(default_target_modules(profile))
    return [name for name in lora.target_modules if name not in present]


@dataclass(frozen=True, kw_only=True)
class LoraUnit:
    """One FSDP unit under LoRA: its frozen base bytes as stored and its adapter parameters."""

    name: str
    count: int
    base_bytes: int
    """Frozen weights of one unit in storage (bf16, or packed 4-bit plus constants)."""
    adapter_params: int
    """Trainable LoRA parameters in one unit: r x (in + out) per adapted Linear [LoRA]."""
    reshards_after_forward: bool = True
    largest_dequantized: int = 0
    """QLoRA: elements of the widest Linear weight, dequantized for compute one at a time."""


def _base_bytes_per_param(shape: TrainingShape) -> int:
    """The frozen base's storage: the compute dtype (bf16 under bf16; fp32 under fp32)."""
    return shape.compute_bytes


def _quantized_bytes(params: int, lora: LoraShape) -> int:
    return math.ceil(params * (NF4_BYTES_PER_PARAM + QUANT_CONSTANT_BITS[lora.double_quant] / 8))


def lora_units(profile: ModelProfile, shape: TrainingShape, fsdp_version: int | None) -> list[LoraUnit]:
    """The FSDP units (as :func:`fsdp_units`) with LoRA's bytes; for DDP (``None``) the FSDP2 split."""
    lora = shape.lora
    base = _base_bytes_per_param(shape)
    units = []
    for unit in fsdp_units(profile, fsdp_version or 2):
        block = next((u for u in profile.units if u.cls == unit.name and u.params_each == unit.params), None)
        if block is None:  # root, tail, embedding: never adapted, never quantized (the head is skipped)
            units.append(LoraUnit(name=unit.name, count=unit.count, base_bytes=unit.params * base, adapter_params=0,
                                  reshards_after_forward=unit.reshards_after_forward))
            continue
        linears = block_linears(profile, unit.name)
        adapters = sum(lora.r * (linear.in_features + linear.out_features)
                       for linear in targeted_linears(profile, lora, unit.name))
        if lora.method == "qlora":
            quantized = min(sum(linear.in_features * linear.out_features for linear in linears), unit.params)
            base_bytes = _quantized_bytes(quantized, lora) + (unit.params - quantized) * base
            widest = max((linear.in_features * linear.out_features for linear in linears), default=0)
        else:
            base_bytes, widest = unit.params * base, 0
        units.append(LoraUnit(name=unit.name, count=unit.count, base_bytes=base_bytes, adapter_params=adapters,
                              reshards_after_forward=unit.reshards_after_forward, largest_dequantized=widest))
    return units


def adapter_params(profile: ModelProfile, shape: TrainingShape) -> int:
    """Trainable parameters of the whole adapter."""
    return sum(unit.count * unit.adapter_params for unit in lora_units(profile, shape, 2))


def base_storage_bytes(profile: ModelProfile, shape: TrainingShape) -> int:
    """The whole frozen base as stored (bf16, or 4-bit packed plus constants)."""
    return sum(unit.count * unit.base_bytes for unit in lora_units(profile, shape, 2))


def lora_model_state_bytes(profile: ModelProfile, shape: TrainingShape, shard_world_size: int,
                           fsdp_version: int | None) -> ModelStateBytes:
    """Per rank: the frozen base in storage plus fp32 adapter masters (``params``), fp32 adapter
    gradients and optimizer state. Frozen weights have neither gradients nor optimizer state."""
    units = lora_units(profile, shape, fsdp_version)
    n = shard_world_size if fsdp_version is not None else 1
    base = sum(unit.count * shard_numel(unit.base_bytes, n) for unit in units)
    adapters = sum(unit.count * shard_numel(unit.adapter_params, n) for unit in units)
    return ModelStateBytes(params=base + adapters * STORED_PARAM_BYTES, grads=adapters * STORED_PARAM_BYTES,
                           optimizer=adapters * OPTIMIZER_STATE_BYTES[shape.optimizer])


def adapter_activation_bytes_per_layer(profile: ModelProfile, shape: TrainingShape, micro_batch: int) -> int:
    """What the adapter path adds to one block's saved activations: per adapted Linear and token,
    A's r-wide output and the scaled B output's input (2 x r values); with dropout, the dropped
    copy of the input and its mask (in x (c + 1) bytes). The base Linear's input is the same tensor
    the adapter reads, saved once. Without dropout this is under 1% of the block."""
    lora, c = shape.lora, shape.compute_bytes
    tokens = shape.seq_len * micro_batch
    per_token = 0
    for unit in profile.units[:1]:
        for linear in targeted_linears(profile, lora, unit.cls):
            per_token += 2 * lora.r * c + (linear.in_features * (c + 1) if lora.dropout > 0 else 0)
    return tokens * per_token


def lora_activation_bytes(profile: ModelProfile, shape: TrainingShape, micro_batch: int) -> int:
    """Activations under LoRA: the full fine-tune's (backward through frozen layers still needs
    every block's saved tensors to reach the adapters below) plus the adapter path in every block
    when blocks are not checkpointed (under checkpointing each block keeps only its input)."""
    extra = 0 if shape.activation_checkpointing else \
        profile.dims.num_layers * adapter_activation_bytes_per_layer(profile, shape, micro_batch)
    return activation_bytes(profile, shape, micro_batch) + extra


def _lora_peak(profile: ModelProfile, shape: TrainingShape, name: str, fsdp_version: int | None,
               state: ModelStateBytes, micro_batch: int) -> PerGpuBytes:
    """:func:`_peak` for LoRA/QLoRA: the same two moments, with units gathered in their storage
    bytes (frozen base as stored, adapters cast to the compute dtype), unsharded gradients of the
    adapters only, and (QLoRA) one Linear's dequantized weight in compute."""
    c = shape.compute_bytes
    units = lora_units(profile, shape, fsdp_version)
    activations = lora_activation_bytes(profile, shape, micro_batch)
    adapters = sum(unit.count * unit.adapter_params for unit in units)
    dequantized = max((unit.largest_dequantized for unit in units), default=0) * c
    accumulated = 0
    if shape.grad_accum > 1 and not shape.reduce_every_micro_batch and fsdp_version is not None:
        accumulated = adapters * (STORED_PARAM_BYTES if c == 4 else ACCUMULATED_GRAD_BYTES[fsdp_version])
    if name == "DDP":
        # Buckets for the trainable gradients only; the adapters' compute copies under autocast.
        buffers = adapters * STORED_PARAM_BYTES + (adapters * c if shape.mixed else 0) + dequantized
        return PerGpuBytes(params=state.params, grads=state.grads, optimizer=state.optimizer,
                           activations=activations, buffers=buffers)
    if name == "NO_SHARD":
        buffers = (adapters * c if shape.mixed else 0) + dequantized + accumulated
        return PerGpuBytes(params=state.params, grads=state.grads, optimizer=state.optimizer,
                           activations=activations, buffers=buffers)

    def gathered(unit: LoraUnit) -> int:
        return unit.base_bytes + unit.adapter_params * c

    resharded = sorted((unit for unit in units if unit.reshards_after_forward for _ in range(min(unit.count, 2))),
                       key=gathered, reverse=True)
    kept = sum(unit.count * gathered(unit) for unit in units if not unit.reshards_after_forward)
    if name == "SHARD_GRAD_OP":
        at_loss = in_block = sum(unit.count * gathered(unit) for unit in units)
    else:
        at_loss, in_block = kept, kept + sum(gathered(unit) for unit in resharded[:2])
    largest_adapter = resharded[0].adapter_params if resharded else 0
    grads = state.grads if shape.grad_accum > 1 and shape.reduce_every_micro_batch else 0
    peak_at_loss = PerGpuBytes(params=state.params, grads=grads, optimizer=state.optimizer, activations=activations,
                               buffers=at_loss + accumulated)
    recomputed = 0
    if shape.activation_checkpointing:
        recomputed = activation_bytes_per_layer(profile, shape, micro_batch) + \
            adapter_activation_bytes_per_layer(profile, shape, micro_batch)
    block_temporaries = 2 * shape.seq_len * micro_batch * _mlp_width(profile) * c
    peak_in_block = PerGpuBytes(
        params=state.params, grads=grads or state.grads, optimizer=state.optimizer,
        activations=activations - logits_bytes(profile, shape, micro_batch) + recomputed + block_temporaries,
        buffers=in_block + largest_adapter * c + dequantized + accumulated)
    return max(peak_at_loss, peak_in_block, key=lambda peak: peak.total)


def lora_comm(profile: ModelProfile, hardware: Hardware, shape: TrainingShape, name: str,
              fsdp_version: int | None) -> CommBytes:
    """Per-step communication under LoRA: FSDP all-gathers every unit as stored (the frozen base
    too) and reduces only the adapters' gradients; DDP all-reduces the adapters' fp32 gradients."""
    c = shape.compute_bytes
    if name in ("DDP", "NO_SHARD"):
        per = STORED_PARAM_BYTES if name == "DDP" else c
        return _comm([("all_reduce", adapter_params(profile, shape) * per, hardware.gpus, hardware.nodes > 1)])
    if name == "HYBRID_SHARD":
        shard_size, replicate_size = hardware.gpus_per_node, hardware.nodes
    else:
        shard_size, replicate_size = hardware.gpus, 1
    gathered = reduced = sharded = 0
    for unit in lora_units(profile, shape, fsdp_version):
        payload = unit.count * shard_numel(unit.base_bytes + unit.adapter_params * c, shard_size) * shard_size
        regathered = unit.reshards_after_forward and name != "SHARD_GRAD_OP"
        gathered += payload * (2 if regathered else 1)
        reduced += unit.count * shard_numel(unit.adapter_params, shard_size) * shard_size * c
        sharded += unit.count * shard_numel(unit.adapter_params, shard_size) * c
    shard_spans = hardware.nodes > 1 and name != "HYBRID_SHARD"
    parts = [("all_gather", gathered, shard_size, shard_spans), ("reduce_scatter", reduced, shard_size, shard_spans)]
    if replicate_size > 1:
        parts.append(("all_reduce", sharded, replicate_size, True))
    return _comm(parts)
