"""The planner's inputs: the GPUs (:class:`Hardware`) and how the model is trained
(:class:`TrainingShape`, with :class:`LoraShape` for LoRA and QLoRA), each checked on construction.

Standard library only: :mod:`fsdp_presets.plan.methods` imports it while the command line parses.
Sources and accounting conventions: :mod:`fsdp_presets.plan.planner`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from fsdp_presets.plan.limits import DEFAULT_SEQ_LEN, PRECISIONS, gpu_count, node_count
from fsdp_presets.errors import UsageError, unknown_name_message
from fsdp_presets.fileio import GiB
from fsdp_presets.flags import DEFAULT_LORA_R, METHODS  # the methods and the rank without --lora-r
from fsdp_presets.plan.gpus import GpuType, HostRates

Precision = Literal["bf16", "fp16", "fp32"]
"""Accelerate's ``mixed_precision`` values (:data:`fsdp_presets.plan.limits.PRECISIONS`)."""

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

OPTIMIZER_STEP_TEMPORARY_BYTES = MappingProxyType({"adamw": 4, "adam": 4})
"""Bytes per parameter the optimizer step allocates besides its state: torch's foreach Adam/AdamW
(the default for CUDA tensors) computes the square root of the whole group's variance at once, one
fp32 tensor per parameter (rehearsed: DeepSeek-V2-Lite at 8 GPUs under activation checkpointing
peaks there, ``_foreach_sqrt``, with 5 x 4 bytes per parameter shard). Not rehearsed for the others."""

STORED_PARAM_BYTES = 4
"""fp32 parameters (and the gradients FSDP/DDP keep in the parameter dtype): see module notes."""

DEFAULT_RESERVED_BYTES = 1 * GiB
"""Memory a CUDA training process cannot use for tensors: CUDA context, cuBLAS workspaces and
NCCL buffers. The context alone is typically 0.3-1 GiB depending on the CUDA version and which
kernels are loaded; 1 GiB is a round, deliberately cautious figure (override per hardware)."""

ALLOCATOR_RESERVE_FRACTION = 0.05
"""Share of a GPU's memory kept back for what a rehearsal on CPU cannot see
(:mod:`fsdp_presets.rehearse.rehearsal`): the CUDA caching allocator rounds every block up (to 512 B, and
large ones to 2 MiB segments) and fragments, and CUDA-only kernels take workspaces. PyTorch's
own guidance on fragmentation (``PYTORCH_CUDA_ALLOC_CONF``, CUDA semantics notes) gives no single
figure; 5% is a cautious round one. Added to :data:`DEFAULT_RESERVED_BYTES` by default."""


def default_reserved_bytes(gpu_memory_bytes: int) -> int:
    """:data:`DEFAULT_RESERVED_BYTES` + :data:`ALLOCATOR_RESERVE_FRACTION` of the GPU."""
    return DEFAULT_RESERVED_BYTES + int(ALLOCATOR_RESERVE_FRACTION * max(gpu_memory_bytes, 0))


# --------------------------------------------------------------------------- inputs


def mesh_problems(gpus, nodes) -> list[str]:
    """What is wrong with ``gpus`` and ``nodes`` as counts, in the command line's own words
    (:func:`fsdp_presets.plan.limits.gpu_count` and :func:`~fsdp_presets.plan.limits.node_count` check
    them); [] when both are fine."""
    problems = []
    for flag, check, value in (("--gpus", gpu_count, gpus), ("--nodes", node_count, nodes)):
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{flag} must be a whole number, got {value!r}")
            continue
        try:
            check(str(value))
        except UsageError as error:
            problems.append(str(error))
    return problems


class OnNodes:
    """``gpus`` spread evenly over ``nodes``: the planner's :class:`Hardware` and the user's
    :class:`~fsdp_presets.preset.request.PresetRequest` (both check that ``nodes`` divides ``gpus``)."""

    @property
    def gpus_per_node(self) -> int:
        return self.gpus // self.nodes


@dataclass(frozen=True, kw_only=True)
class Hardware(OnNodes):
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
    gpu: GpuType | None = None
    """The GPU type (:mod:`fsdp_presets.plan.gpus`): with it every row gets a step time; None: memory only."""
    inter_node_gbps: float | None = None
    """One GPU's network to other nodes in Gb/s; None: the GPU type's reference cluster."""
    host: HostRates | None = None
    """A measured CPU host (``plan --device cpu``): the processes' step times come from it instead
    of a GPU type."""

    def __post_init__(self) -> None:
        if self.reserved_bytes is None:
            object.__setattr__(self, "reserved_bytes", default_reserved_bytes(self.gpu_memory_bytes))
        problems = mesh_problems(self.gpus, self.nodes)
        if not problems and self.gpus % self.nodes:
            problems.append(
                f"--nodes {self.nodes} does not divide --gpus {self.gpus}: every node must hold "
                f"the same number of GPUs (e.g. --gpus {self.nodes * max(1, self.gpus // self.nodes)})"
            )
        if self.inter_node_gbps is not None and not (0 < self.inter_node_gbps <= 1e6):
            problems.append(f"--inter-node-gbps must be more than 0 and at most 1e6, got {self.inter_node_gbps!r} "
                            "(e.g. --inter-node-gbps 400)")
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
    def usable_bytes(self) -> int:
        """What tensors can use on one GPU."""
        return self.gpu_memory_bytes - self.reserved_bytes

    def to_json(self) -> dict:
        return {"gpus": self.gpus, "nodes": self.nodes, "gpu_memory_bytes": self.gpu_memory_bytes,
                "reserved_bytes": self.reserved_bytes,
                "gpu": "CPU (measured)" if self.host is not None else None if self.gpu is None else self.gpu.name,
                "inter_node_gbps": None if self.gpu is None else (
                    self.gpu.inter_node_gbps if self.inter_node_gbps is None else self.inter_node_gbps)}


BACKWARD_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")
"""FSDP1's backward prefetch settings, as accelerate names them (``NO_PREFETCH``: torch's ``None``)."""


@dataclass(frozen=True, kw_only=True)
class TrainingShape:
    """How the model is trained: sequence, micro-batch, precision, optimizer, memory savers."""

    seq_len: int = DEFAULT_SEQ_LEN
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
    backward_prefetch: str = "BACKWARD_PRE"
    """FSDP1's backward prefetch (accelerate's ``fsdp_backward_prefetch``, one of
    :data:`BACKWARD_PREFETCH`): when the next unit's all-gather is issued in backward, which decides what
    it overlaps (the step time only). FSDP2 always prefetches as ``BACKWARD_PRE`` does."""
    measured: object = None
    """The model's own activation terms (a :class:`fsdp_presets.plan.activations.BlockActivations`
    read off a short rehearsal, :mod:`fsdp_presets.preset.measured_activations`), used where its
    ``seq_len`` and ``precision`` are this shape's; None: the family constants."""
    measured_on_mesh: tuple = ()
    """``((tp, ep), terms)`` pairs: the model's activation terms rehearsed on a TP/EP mesh
    (:func:`fsdp_presets.preset.measured_activations.rehearsed_mesh_terms`), for the plan's rows on
    that mesh; a mesh not listed is estimated (:func:`fsdp_presets.plan.mesh_plan.estimated_mesh_terms`)."""

    @property
    def method(self) -> str:
        """``full``, ``lora`` or ``qlora``."""
        return "full" if self.lora is None else self.lora.method

    def __post_init__(self) -> None:
        # Only what makes the arithmetic meaningless: the command line's upper bounds were checked
        # on the flags (fsdp_presets.plan.limits), and the preset search plans micro-batches and
        # accumulation counts of its own beyond them.
        problems = []
        if self.seq_len < 1:
            problems.append(f"--seq-len must be at least 1, got {self.seq_len}")
        if self.micro_batch < 1:
            problems.append(f"--micro-batch must be at least 1, got {self.micro_batch}")
        if self.grad_accum < 1:
            problems.append(f"--grad-accum must be at least 1, got {self.grad_accum}")
        if self.precision not in PRECISIONS:
            problems.append(unknown_name_message("precision", str(self.precision), PRECISIONS))
        if self.optimizer not in OPTIMIZER_STATE_BYTES:
            problems.append(unknown_name_message("optimizer", str(self.optimizer), tuple(OPTIMIZER_STATE_BYTES)))
        if self.backward_prefetch not in BACKWARD_PREFETCH:
            problems.append(unknown_name_message("backward prefetch", str(self.backward_prefetch), BACKWARD_PREFETCH))
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



# --------------------------------------------------------------------------- LoRA and QLoRA
# (sources: fsdp_presets.plan.lora_memory)



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
    base_dtype: Literal["bf16", "fp16", "fp32"] | None = None
    """The frozen base's dtype as loaded (``from_pretrained(dtype=...)``; QLoRA: its non-quantized
    weights, the ``bnb_4bit_quant_storage`` dtype). None: LoRA in the compute dtype, QLoRA in bf16."""

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
        if self.base_dtype not in (None, "bf16", "fp16", "fp32"):
            problems.append(f"--lora-base-dtype must be bf16, fp16 or fp32, got {self.base_dtype}")
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
                "double_quant": self.double_quant, "base_dtype": self.base_dtype}


