"""How long one optimizer step takes per GPU, for one strategy row: a :class:`StepTime`.

Pure arithmetic on a profile, the hardware (with its :class:`~fsdp_presets.plan.gpus.GpuType`), the
training shape and the row's communication; no torch. The terms, per micro-batch and per GPU:

- **compute**: matmul FLOPs of the blocks and the head at the achievable matmul rate
  (:data:`MATMUL_EFFICIENCY`): forward ``2 N``, backward ``4 N`` (``2 N`` for a frozen LoRA/QLoRA
  base, which computes input gradients only), attention ``4 L s_eff d`` forward with ``s_eff = s/2``
  for causal models (FlashAttention skips masked tiles) and 2.5 times that backward ([FA2]: five
  matmuls against two), and the blocks' forward again under activation checkpointing;
- **memory-bound kernels**: the elementwise work of an eager (not compiled) block, norms, residuals,
  rotary embeddings, activations, counted in bytes per token (:data:`ELEMENTWISE_BYTES_PER_HIDDEN`,
  :data:`ELEMENTWISE_BYTES_PER_INTERMEDIATE`), the loss over the vocabulary
  (:data:`LOSS_BYTES_PER_LOGIT`) and QLoRA's dequantization, at the achievable HBM bandwidth;
- **communication**: each unit's all-gather, reduce-scatter (and HSDP's all-reduce) at the link it
  crosses (:class:`Links`), overlapped as FSDP does: the next unit's all-gather during this unit's
  compute, a unit's reduce-scatter during the next unit's backward (FSDP1 with another backward
  prefetch exposes more: :func:`_fsdp_micro_batch`); what compute does not hide is
  *exposed* (the first all-gather and the last reduce-scatter always are). Under gradient
  accumulation with ``no_sync`` only the last micro-batch reduces. DDP all-reduces in buckets
  during backward. Each collective also pays a latency per ring step ([NCCL]);
- **the optimizer step**: memory-bound, :data:`OPTIMIZER_BYTES_PER_PARAM` per trainable parameter shard
  (torch's foreach passes, as the recipes run it; LoRA/QLoRA: the adapters);
- **CPU offload**: the shards cross PCIe every gather and every reduction, and the optimizer steps on
  the host (:data:`HOST_OPTIMIZER_PARAMS_PER_S`), none of it hidden.

MFU is model FLOPs over peak: ``6 N + 12 L H Q T`` per token (PaLM, Chowdhery et al. 2022, App. B;
torchtitan counts the same way), ``N`` the parameters a token uses (MoE: the active ones) without the
input embedding, ``H Q`` the attention width, ``T`` the sequence length: recomputation does not count.

Sources: [FA2] Dao 2023, "FlashAttention-2", arXiv:2307.08691, Sec. 3.1-3.2. [NCCL] nccl-tests
``doc/PERFORMANCE.md`` (bus bandwidth; a ring takes n-1 steps). Calibration: docs/sharding.md and
``tests/data/published_throughput.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from fsdp_presets.plan.mesh_plan import collectives_per_step
from fsdp_presets.rehearse.mesh import Mesh
from fsdp_presets.model.model_profile import ModelProfile
from fsdp_presets.plan.gpus import GpuType
from fsdp_presets.plan.model_state import fsdp_units
from fsdp_presets.plan.shapes import OPTIMIZER_STATE_BYTES

MATMUL_EFFICIENCY = MappingProxyType({
    # Fitted once on the calibration sources (docs/sharding.md, "Calibration"): the share of the
    # datasheet's dense bf16 rate that a training step's matmuls and attention reach, with
    # ATTENTION_EFFICIENCY and OVERLAP_SLOWDOWN below (the median calibration row of each type then
    # predicted within 1%: the shares are rounded to two places). fms-fsdp's and torchtitan's
    # A100-80GB rows (20); the A100-40GB is the same GA100 chip at the same clocks.
    "a100-40gb": 0.82,
    "a100-80gb": 0.82,
    # torchtitan's and fms-fsdp's H100 rows (16).
    "h100-sxm": 0.61,
})
"""Achievable share of the peak matmul rate, per GPU type, where a calibration source measured it."""
DEFAULT_MATMUL_EFFICIENCY = 0.61
"""For GPU types no calibration source measured: the H100's share, the lower of the two (an assumption:
check yours against a short run)."""
ATTENTION_EFFICIENCY = 0.3
"""Attention kernels' rate against the matmuls', fitted with :data:`MATMUL_EFFICIENCY` on the same two
calibration sources: their rows' spread after one factor per source and GPU type is least from 0.27
to 0.33 (the A100's matmul share then 0.81 to 0.84 of peak). Lower than the kernels alone
([FA2] Sec. 4.1: 50-70% of the A100's peak forward, less backward): it carries what a real step adds
around them (masks, layout copies, the backward's recomputation of the scores)."""
HBM_EFFICIENCY = 0.7
"""Share of the datasheet memory bandwidth that torch's elementwise kernels reach (STREAM-like
kernels reach about 90% on A100/H100; eager torch ops with their casts less)."""
LINK_EFFICIENCY = 0.8
"""Bus bandwidth a ring collective reaches on NVLink/PCIe against the link's one-direction figure
(nccl-tests on DGX H100: all-gather about 360 of 450 GB/s)."""
NETWORK_EFFICIENCY = 0.85
"""The same across nodes: InfiniBand/RoCE bus bandwidth against the adapter's line rate."""
OVERLAP_SLOWDOWN = 0.25
"""Seconds a step loses per second of communication hidden behind compute. A collective that overlaps
compute is not free: NCCL's kernels hold SMs (one per channel, up to 32 on NVLink) and read and write
HBM at the link's rate beside the matmuls, so a large model at a small micro-batch (the most bytes
gathered per token computed) is slower than its arithmetic. Fitted with :data:`MATMUL_EFFICIENCY` on
the calibration sources (docs/sharding.md, "Calibration"): their rows' spread after one factor per
source and GPU type falls as it rises from 0 to 0.25 and stays flat above, where the A100's fitted
matmul share heads past 0.9 of peak; the low end of the flat range is kept."""
RING_STEP_LATENCY_S = MappingProxyType({"intra": 1e-6, "inter": 2e-6})
"""Latency of one step of a ring collective inside a node and across nodes ([NCCL]: n-1 steps)."""
ELEMENTWISE_BYTES_PER_HIDDEN = 400
"""HBM bytes per token per block per hidden unit, forward and backward, of an eager block's
elementwise kernels: two RMSNorms upcast to fp32 (about 36 B a norm forward), two residual adds,
rotary embeddings on queries and keys, the transposes around attention: about 130 B forward, twice
that backward."""
ELEMENTWISE_BYTES_PER_INTERMEDIATE = MappingProxyType({"gated": 30, "plain": 10})
"""The same per MLP intermediate unit (per active expert). A gated MLP (SwiGLU, GeGLU): the activation
and the gate product, about 10 B forward and 20 B backward. A plain one (GELU between two linears,
GPT-2, MPT): the activation alone, read and written forward (4 B), its backward reads the gradient and
the input and writes one (6 B). Which one a block has is read off its linears (:func:`mlp_is_gated`)."""
LOSS_BYTES_PER_LOGIT = 30
"""HBM bytes per logit per token: the logits written in bf16 and upcast to fp32, log-softmax and its
backward, the gradient cast back (transformers' loss)."""
OPTIMIZER_BYTES_PER_PARAM = MappingProxyType({
    # torch's foreach implementations (the default for CUDA tensors, torch 2.13 torch/optim/adamw.py,
    # sgd.py), one pass over memory per op, without weight decay (the recipes' and Trainer's default):
    # Adam/AdamW: lerp_ of the first moment (12 B), mul_ and addcmul_ of the second (8 + 16), its sqrt,
    # div_ and add_ of epsilon (8 + 8 + 8), addcdiv_ into the parameter (16): 76 B.
    "adamw": 76 + 12,
    "adam": 76 + 12,
    # SGD with momentum: mul_ and add_ of the buffer (8 + 12), add_ into the parameter (12).
    "sgd": 32 + 12,
    # Lion (lion-pytorch, per tensor): the interpolation, its sign, the update and the moment's lerp_.
    "lion": 44 + 12,
})
"""HBM bytes per trainable fp32 parameter shard of one optimizer step, with the recipes' clipping (+12 B:
the gradient read for the float64 norm, :func:`fsdp_presets.numerics.clip_grad_norm`, and its scaling).
Trainer's default ``adamw_torch_fused`` and torchtitan's fused AdamW read and write each tensor once
(28 B), so their steps are shorter than planned by the difference (under 1% of a step at the
published rows' batches)."""
BUCKET_BYTES = 25 * 2**20
"""DDP's default bucket (``bucket_cap_mb=25``): the last one's all-reduce starts after backward."""
HOST_LINK_EFFICIENCY = 0.8
"""Share of PCIe's one-direction rate that pinned host<->GPU copies reach."""
HOST_OPTIMIZER_PARAMS_PER_S = 2e8
"""Parameters per second torch's AdamW steps on the host CPU for one GPU's process under offload (an
assumed figure: a node's cores shared by 8 processes, unfused AdamW; measure yours)."""


MODEL_ERROR = 0.01
"""Steps predicted less than 1% apart are a tie: the model is not more exact than that, so a change of
settings for less is no reason (:func:`clearly_faster`)."""


def clearly_faster(step_s: float, than_s: float) -> bool:
    """Whether a step of ``step_s`` beats one of ``than_s`` by more than :data:`MODEL_ERROR`."""
    return step_s < (1 - MODEL_ERROR) * than_s


@dataclass(frozen=True, kw_only=True)
class Links:
    """Bandwidths (bytes/s, already at their achievable share) a step's traffic crosses."""

    intra: float
    """GPU to GPU inside a node."""
    inter: float
    """One GPU's network to other nodes."""
    host: float
    """GPU to its host (PCIe), for offload."""
    spanning: float = 0.0
    """A ring over every GPU of several nodes: NCCL builds one ring per network adapter, so what enters
    and leaves a node is spread over all of its adapters and each GPU's ring runs at the node's whole
    network (``gpus_per_node x inter``) or at its NVLink share, whichever is less ([NCCL]: the bus
    bandwidth of an all-reduce across DGX nodes approaches the node's adapters together). A group of
    one GPU per node (HSDP's replicas) has only its own adapter: ``inter``."""

    @classmethod
    def of(cls, gpu: GpuType, inter_node_gbps: float | None, gpus_per_node: int = 1) -> "Links":
        gbps = gpu.inter_node_gbps if inter_node_gbps is None else inter_node_gbps
        intra = gpu.intra_node_bytes_per_s * LINK_EFFICIENCY
        inter = gbps / 8 * 1e9 * NETWORK_EFFICIENCY
        return cls(intra=intra, inter=inter, host=gpu.host_link_bytes_per_s * HOST_LINK_EFFICIENCY,
                   spanning=min(intra, inter * max(1, gpus_per_node)))


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """One optimizer step of one strategy row on one GPU type."""

    step_s: float
    """Seconds per optimizer step (every micro-batch, the reductions, the optimizer)."""
    compute_s: float
    """Matmuls and attention (recomputation included) at the achievable rate."""
    memory_bound_s: float
    """Elementwise kernels, the loss, QLoRA's dequantization."""
    comm_s: float
    """Every collective's time, as if nothing overlapped."""
    exposed_comm_s: float
    """The part of ``comm_s`` that compute does not hide."""
    optimizer_s: float
    """The optimizer step."""
    offload_s: float
    """CPU offload's PCIe traffic and host optimizer step (0 without offload)."""
    contention_s: float = 0.0
    """Compute slowed by the collectives that run beside it (:data:`OVERLAP_SLOWDOWN`)."""
    tokens_per_s_per_gpu: float
    """Training tokens per second per GPU."""
    mfu: float
    """Model FLOPs utilization: ``6 N + 12 L H Q T`` per token over the GPU's dense bf16 peak."""

    @property
    def exposed_comm_fraction(self) -> float:
        """Share of the step spent waiting for communication."""
        return self.exposed_comm_s / self.step_s if self.step_s else 0.0

    def to_json(self) -> dict:
        return {"step_time_s": self.step_s, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "mfu": self.mfu,
                "exposed_comm_fraction": self.exposed_comm_fraction,
                "terms_s": {"compute": self.compute_s, "memory_bound": self.memory_bound_s, "comm": self.comm_s,
                            "exposed_comm": self.exposed_comm_s, "optimizer": self.optimizer_s,
                            "offload": self.offload_s, "contention": self.contention_s}}


# --------------------------------------------------------------------------- FLOPs and bytes


def embedding_params(profile: ModelProfile) -> int:
    """Parameters of the lookup tables (input, position, token-type embeddings): no matmul."""
    return sum(int(entry.get("params", 0)) for entry in profile.embeddings
               if entry.get("role") in ("input", "position", "token_type"))


def head_params(profile: ModelProfile) -> int:
    """Parameters of the output head's matmul (vocab x hidden; the tied embedding's too)."""
    if not profile.output_head or not profile.dims.vocab_size:
        return 0
    return profile.dims.vocab_size * profile.dims.hidden_size


def active_block_params(profile: ModelProfile) -> int:
    """Block parameters one token uses: all of them, or for a mixture of experts the routed
    experts it is sent to (``moe.active_params`` of the profile, less what lies outside the blocks)."""
    moe = profile.structure.get("moe")
    if not moe:
        return profile.unit_params
    return max(0, profile.unit_params - moe["routed_expert_params"]
               + moe["routed_expert_params"] * moe["experts_per_token"] // max(moe["num_experts"], 1))


def model_flops_per_token(profile: ModelProfile, seq_len: int) -> float:
    """``6 N + 12 L H Q T``: the FLOPs MFU counts (see the module notes)."""
    dims = profile.dims
    return 6 * (active_block_params(profile) + head_params(profile)) + 12 * dims.num_layers * dims.hidden_size * seq_len


def mlp_is_gated(profile: ModelProfile) -> bool:
    """Whether the blocks' MLP multiplies two projections of the input (SwiGLU and the like): its
    linears from the hidden size to the intermediate size give twice the intermediate width (a fused
    ``gate_up_proj`` or two projections). A block whose linears the profile does not list (GPT-2's
    Conv1D) counts as gated, the costlier."""
    dims = profile.dims
    widths = [sum(out for _, inputs, out, _ in linears if inputs == dims.hidden_size and out in
                  (dims.intermediate_size, 2 * dims.intermediate_size))
              for linears in (profile.structure.get("block_linears") or {}).values()]
    widths = [width for width in widths if width]
    return not widths or max(widths) >= 2 * dims.intermediate_size


def _causal(profile: ModelProfile) -> bool:
    return bool(profile.dims.vocab_size) and not profile.is_encoder_decoder


@dataclass(frozen=True, kw_only=True)
class _Work:
    """FLOPs and HBM bytes of one micro-batch, split where FSDP's units need them."""

    block_forward_flops: float
    block_backward_flops: float
    head_flops: float
    """Head forward and backward (the head is never recomputed)."""
    memory_bytes: float


def _work(profile: ModelProfile, shape, micro_batch: int, tp: int = 1) -> _Work:
    """``tp``: the heads are split over that many ranks (``profile`` is one rank's slice then)."""
    dims = profile.dims
    tokens = shape.seq_len * micro_batch
    frozen = shape.lora is not None
    block = active_block_params(profile)
    attention_forward = 4 * dims.num_layers * dims.hidden_size * shape.seq_len * (0.5 if _causal(profile) else 1.0) / tp
    attention_forward /= ATTENTION_EFFICIENCY  # in matmul-rate FLOPs
    forward = 2 * block + attention_forward
    backward = (2 if frozen else 4) * block + 2.5 * attention_forward
    if shape.activation_checkpointing:
        backward += forward  # the block's forward again before its backward
    head = head_params(profile) * (4 if frozen else 6)
    bytes_per_element = 2 if shape.compute_bytes == 4 else 1  # fp32 compute moves twice the bytes
    moe = profile.structure.get("moe")
    experts = max(1, moe["experts_per_token"]) if moe else 1
    elementwise = dims.num_layers * (ELEMENTWISE_BYTES_PER_HIDDEN * dims.hidden_size
                                     + ELEMENTWISE_BYTES_PER_INTERMEDIATE["gated" if mlp_is_gated(profile) else "plain"]
                                     * dims.intermediate_size * experts)
    if shape.activation_checkpointing:
        elementwise *= 4 / 3  # the forward (a third of it) again
    memory = tokens * (elementwise * bytes_per_element + LOSS_BYTES_PER_LOGIT * dims.vocab_size)
    if shape.lora is not None and shape.lora.method == "qlora":
        # bitsandbytes dequantizes each 4-bit weight to bf16 in every forward and backward (and recompute):
        # read 0.5 B and write 2 B, then the matmul reads the 2 B again.
        passes = 3 if shape.activation_checkpointing else 2
        memory += passes * profile.unit_params * 4.5
    return _Work(block_forward_flops=tokens * forward, block_backward_flops=tokens * backward,
                 head_flops=tokens * head, memory_bytes=memory)


# --------------------------------------------------------------------------- communication


def _ring_latency(group_size: int, spans_nodes: bool) -> float:
    return max(group_size - 1, 0) * RING_STEP_LATENCY_S["inter" if spans_nodes else "intra"]


@dataclass(frozen=True, kw_only=True)
class _UnitTimes:
    """One FSDP unit in forward order: its compute and its collectives' seconds."""

    forward_s: float
    backward_s: float
    gather_s: float
    """One all-gather of the unit (0 for a unit never gathered)."""
    regathered: bool
    """Gathered again for backward."""
    reduce_s: float
    """Its gradient reduction on the shard group's link (reduce-scatter, or NO_SHARD's all-reduce)."""
    replicate_s: float
    """HSDP: its gradient shards' all-reduce across nodes (on the network, beside ``reduce_s``)."""


def _units(profile, hardware, row, links: Links, compute_rate: float, work: _Work) -> list[_UnitTimes]:
    """The row's FSDP units in forward order with their seconds (blocks share compute by parameters)."""
    units = fsdp_units(profile, row.fsdp_version)
    total = sum(unit.count * unit.params for unit in units) or 1
    name = row.name
    passes = sum(unit.count * unit.params * (2 if unit.reshards_after_forward and name != "SHARD_GRAD_OP" else 1)
                 for unit in units) or 1
    spans = hardware.nodes > 1 and name != "HYBRID_SHARD"  # the shard group crosses the network
    shard_link = links.spanning if spans else links.intra
    shard_latency = _ring_latency(row.shard_world_size, spans)
    reduction = row.comm.all_reduce if name == "NO_SHARD" else row.comm.reduce_scatter
    block_params = profile.unit_params or 1
    timed = []
    ordered = sorted(units, key=lambda unit: {"embedding": 0, "root": 0, "tail": 2}.get(unit.name, 1))
    for unit in ordered:
        share = unit.params / block_params if unit.name not in ("embedding", "root", "tail") else 0.0
        head = work.head_flops if unit.name in ("tail", "root") else 0.0
        forward = (work.block_forward_flops * share + head / 3) / compute_rate
        backward = (work.block_backward_flops * share + 2 * head / 3) / compute_rate
        regathered = unit.reshards_after_forward and name != "SHARD_GRAD_OP"
        gather = row.comm.all_gather * unit.params / passes / shard_link + shard_latency if name != "NO_SHARD" else 0.0
        reduce = reduction * unit.params / total / shard_link + shard_latency
        replicate = (row.comm.all_reduce * unit.params / total / links.inter
                     + _ring_latency(row.replicate_world_size, True)) if name == "HYBRID_SHARD" else 0.0
        timed += [_UnitTimes(forward_s=forward, backward_s=backward, gather_s=gather, regathered=regathered,
                             reduce_s=reduce, replicate_s=replicate)] * unit.count
    # NOTE: FSDP1's root (embeddings and head) is gathered first and computes last; it is timed
    # first with the head's compute, which moves a little of the overlap between neighbours.
    return timed


def _fsdp_micro_batch(units: list[_UnitTimes], *, reduces: bool,
                      prefetch: str = "BACKWARD_PRE") -> tuple[float, float, float]:
    """``(compute, comm, exposed)`` seconds of one micro-batch's forward and backward: a unit's
    gather is prefetched during the previous unit's compute. In backward, ``prefetch`` (FSDP1's
    backward prefetch, :data:`~fsdp_presets.plan.shapes.BACKWARD_PREFETCH`) decides when the next
    unit's gather is issued, and a gather and a reduction of one process group run one after the other
    (NCCL runs a communicator's collectives in the order they were issued, whatever their streams):

    - ``BACKWARD_PRE`` (FSDP2 always): before this unit's gradient computation, so the next unit's
      gather and the previous unit's reduction run during this unit's backward;
    - ``BACKWARD_POST``: after it, ahead of this unit's reduction: the gather has nothing to hide
      behind, the reduction runs during the next unit's backward;
    - ``NO_PREFETCH``: when the next unit's backward starts, behind this unit's reduction: both wait.

    HSDP's all-reduce runs on the network beside them, on its own process group."""
    compute = sum(unit.forward_s + unit.backward_s for unit in units)
    comm = sum(unit.gather_s * (2 if unit.regathered else 1) + (unit.reduce_s + unit.replicate_s) * reduces
               for unit in units)
    exposed = units[0].gather_s if units else 0.0
    for previous, unit in zip(units, units[1:]):
        exposed += max(0.0, unit.gather_s - previous.forward_s)
    backward = list(reversed(units))
    if prefetch == "BACKWARD_PRE" and backward and backward[0].regathered:
        exposed += backward[0].gather_s
    for index, unit in enumerate(backward):
        following = backward[index + 1] if index + 1 < len(backward) else None
        preceding = backward[index - 1] if index else None
        reduction = preceding.reduce_s if reduces and preceding is not None else 0.0
        on_network = preceding.replicate_s if reduces and preceding is not None else 0.0
        gather = unit.gather_s if unit.regathered else 0.0
        if prefetch == "BACKWARD_PRE":
            on_link = (following.gather_s if following is not None and following.regathered else 0.0) + reduction
            exposed += max(0.0, max(on_link, on_network) - unit.backward_s)
        elif prefetch == "BACKWARD_POST" or not gather:
            exposed += gather + max(0.0, max(reduction, on_network) - unit.backward_s)
        else:  # NO_PREFETCH: this unit's gather waits behind the previous unit's reduction
            exposed += gather + reduction + max(0.0, on_network - unit.backward_s)
    if reduces and backward:
        exposed += backward[-1].reduce_s + backward[-1].replicate_s
    return compute, comm, exposed


# --------------------------------------------------------------------------- the step


def stepped_params(row, shape) -> float:
    """The parameters the optimizer steps on this rank: its optimizer state holds one state per
    trainable parameter shard (LoRA/QLoRA: the adapters, not the frozen base)."""
    return row.model_state.optimizer / OPTIMIZER_STATE_BYTES[shape.optimizer]


def matmul_rate(gpu: GpuType, shape) -> float:
    """Achievable matmul FLOP/s: the calibrated share of the dense bf16 peak, or of the fp32 one for an
    fp32 run (torch leaves TF32 off for matmuls)."""
    efficiency = MATMUL_EFFICIENCY.get(gpu.name.lower(), DEFAULT_MATMUL_EFFICIENCY)
    return (gpu.peak_fp32_flops if shape.compute_bytes == 4 else gpu.peak_bf16_flops) * efficiency


def predicted_on(gpu_name: str, profile: ModelProfile, memory_plan, row, *, network_share: float = 1.0) -> StepTime:
    """``row``'s step time on GPUs of type ``gpu_name``, whatever GPU ``memory_plan`` was made for
    (a preset's header: its plan knows memory only); ``network_share``: of the network between nodes
    (the plan's ``--inter-node-gbps``, else the GPU type's), below 1 to check a choice holds on a
    slower one."""
    import dataclasses

    from fsdp_presets.plan.gpus import gpu_type

    gpu = gpu_type(gpu_name)
    hardware = dataclasses.replace(memory_plan.hardware, gpu=gpu, host=None)
    if network_share != 1.0:
        network = gpu.inter_node_gbps if hardware.inter_node_gbps is None else hardware.inter_node_gbps
        hardware = dataclasses.replace(hardware, inter_node_gbps=network * network_share)
    return step_time(profile, hardware, memory_plan.shape, row)


def step_time(profile: ModelProfile, hardware, shape, row, *, full_profile: ModelProfile | None = None) -> StepTime:
    """The :class:`StepTime` of strategy ``row`` (a :class:`~fsdp_presets.plan.results.StrategyPlan`)
    on ``hardware.gpu`` (a :class:`~fsdp_presets.plan.gpus.GpuType`) at ``shape``, or on the measured
    CPU host ``hardware.host`` (:func:`cpu_step_time`). A row with TP/EP (``row.tp_size``,
    ``row.ep_size``): ``profile`` and ``hardware`` are one rank's slice and the FSDP ranks
    (:mod:`fsdp_presets.plan.mesh_plan`), ``full_profile`` the whole model; the TP/EP collectives
    (``row.mesh_comm``) wait on the node's link, not hidden, and a TP group's ranks share its tokens."""
    if hardware.host is not None:
        return cpu_step_time(profile, hardware, shape, row)
    tp = getattr(row, "tp_size", 1)
    gpu = hardware.gpu
    links = Links.of(gpu, hardware.inter_node_gbps, hardware.gpus_per_node)
    rate = matmul_rate(gpu, shape)
    work = _work(profile, shape, shape.micro_batch, tp)
    memory_s = work.memory_bytes / (gpu.hbm_bytes_per_s * HBM_EFFICIENCY)
    accumulation = shape.grad_accum
    reduces_every = shape.reduce_every_micro_batch or accumulation == 1
    if row.name == "DDP":
        compute = (work.block_forward_flops + work.block_backward_flops + work.head_flops) / rate
        spans = hardware.nodes > 1
        link = links.spanning if spans else links.intra
        all_reduce = row.comm.all_reduce / link + _ring_latency(hardware.gpus, spans) * 2
        backward = (work.block_backward_flops + 2 * work.head_flops / 3) / rate
        exposed_last = max(0.0, all_reduce - backward) + min(all_reduce, BUCKET_BYTES * 2 / link)
        reductions = accumulation if shape.reduce_every_micro_batch else 1
        comm = all_reduce * reductions
        exposed = exposed_last * reductions
        compute_total = compute * accumulation
    else:
        units = _units(profile, hardware, row, links, rate, work)
        prefetch = shape.backward_prefetch if row.fsdp_version == 1 else "BACKWARD_PRE"
        compute_one, comm_silent, exposed_silent = _fsdp_micro_batch(units, reduces=False, prefetch=prefetch)
        _, comm_reducing, exposed_reducing = _fsdp_micro_batch(units, reduces=True, prefetch=prefetch)
        if reduces_every:
            comm, exposed = comm_reducing * accumulation, exposed_reducing * accumulation
        else:
            comm = comm_silent * (accumulation - 1) + comm_reducing
            exposed = exposed_silent * (accumulation - 1) + exposed_reducing
        compute_total = compute_one * accumulation
    shard_params = stepped_params(row, shape)
    offloaded = shape.offload and row.name not in ("DDP", "NO_SHARD")
    optimizer = 0.0 if offloaded else (shard_params * OPTIMIZER_BYTES_PER_PARAM[shape.optimizer]
                                       / (gpu.hbm_bytes_per_s * HBM_EFFICIENCY))
    offload = 0.0
    if offloaded:
        gathers = sum(2 if unit.reshards_after_forward and row.name != "SHARD_GRAD_OP" else 1
                      for unit in fsdp_units(profile, row.fsdp_version) for _ in range(unit.count))
        per_unit_shard = row.model_state.params / max(1, sum(u.count for u in fsdp_units(profile, row.fsdp_version)))
        copies = per_unit_shard * gathers * accumulation + row.model_state.grads
        offload = copies / links.host + shard_params / HOST_OPTIMIZER_PARAMS_PER_S
    memory_total = memory_s * accumulation
    contention = OVERLAP_SLOWDOWN * max(0.0, comm - exposed)  # before the TP/EP waits, which nothing hides
    mesh_comm = getattr(row, "mesh_comm", None)
    if mesh_comm is not None and mesh_comm.total:
        mesh = Mesh(tp=tp, ep=getattr(row, "ep_size", 1))
        waits = (mesh_comm.total / links.intra
                 + collectives_per_step(full_profile or profile, shape, mesh, accumulation)
                 * _ring_latency(max(mesh.tp, mesh.ep), False))
        comm, exposed = comm + waits, exposed + waits
    step = compute_total + memory_total + exposed + contention + optimizer + offload
    tokens = shape.seq_len * shape.micro_batch * accumulation / tp  # a TP group's ranks share its tokens
    tokens_per_s = tokens / step
    mfu = model_flops_per_token(full_profile or profile, shape.seq_len) * tokens_per_s / gpu.peak_bf16_flops
    return StepTime(step_s=step, compute_s=compute_total, memory_bound_s=memory_total, comm_s=comm,
                    exposed_comm_s=exposed, optimizer_s=optimizer, offload_s=offload, contention_s=contention,
                    tokens_per_s_per_gpu=tokens_per_s, mfu=mfu)


# --------------------------------------------------------------------------- a CPU host

def cpu_step_time(profile: ModelProfile, hardware, shape, row) -> StepTime:
    """One optimizer step on a CPU host, every process with one thread, from the host's measured rates
    (:class:`~fsdp_presets.plan.gpus.HostRates`): matmuls at the measured rate for this width and
    micro-batch, elementwise bytes at the measured memory bandwidth, the strategy's measured cost of a
    step and of each block beyond arithmetic and bytes (the collectives' latency included), the
    optimizer step at its measured rate per parameter, and every collective's bytes at gloo's
    measured bandwidth: DDP's all-reduce and FSDP's backward gathers and reductions in full, FSDP's
    forward gathers behind the previous unit's compute where the host has a core to spare for
    gloo's threads (else in full too)."""
    host = hardware.host
    dims = profile.dims
    work = _work(profile, shape, shape.micro_batch)
    tokens = shape.seq_len * shape.micro_batch
    rate = host.matmul_flops(tokens, dims.hidden_size)
    compute = (work.block_forward_flops + work.block_backward_flops + work.head_flops) / rate
    step_overhead, block_overhead = host.overhead(row.name)
    overhead = block_overhead * (4 / 3 if shape.activation_checkpointing else 1) * profile.num_blocks
    memory = work.memory_bytes / host.memory_bytes_per_s
    accumulation = shape.grad_accum
    reducing = accumulation if shape.reduce_every_micro_batch else 1
    if row.name in ("DDP", "NO_SHARD"):
        latency, bandwidth = host.collectives["all_reduce"]
        buckets = max(1, -(-row.comm.all_reduce // (2 * BUCKET_BYTES)))
        comm = reducing * ((buckets - 1) * latency + row.comm.all_reduce / bandwidth)
        exposed = comm
    else:
        # FSDP2 prefetches the next unit's forward all-gather while this unit computes: gloo's
        # threads send while the main thread multiplies, on a core of their own where one is spare
        # (with one rank per core the copies take their time from the compute); the backward's
        # gathers and the reductions wait.
        gather_bw = host.collectives["all_gather"][1]
        units = _units(profile, hardware, row, Links(intra=gather_bw, inter=gather_bw, host=gather_bw, spanning=gather_bw), rate, work)
        forward_gathers = sum(unit.gather_s for unit in units)
        exposed_forward = (units[0].gather_s if units else 0.0) + sum(
            max(0.0, unit.gather_s - previous.forward_s) for previous, unit in zip(units, units[1:]))
        if host.cores <= host.processes:
            exposed_forward = forward_gathers  # every core computes: gloo's copies take their time
        gathers = row.comm.all_gather / gather_bw
        reductions = (row.comm.reduce_scatter / host.collectives["reduce_scatter"][1]
                      + row.comm.all_reduce / host.collectives["all_reduce"][1])
        comm = accumulation * gathers + reducing * reductions
        exposed = accumulation * (gathers - forward_gathers + exposed_forward) + reducing * reductions
    optimizer = host.optimizer_s(stepped_params(row, shape))
    compute_total = compute * accumulation
    memory_total = (memory + overhead) * accumulation
    step = compute_total + memory_total + exposed + optimizer + step_overhead
    tokens_per_s = tokens * accumulation / step
    mfu = model_flops_per_token(profile, shape.seq_len) * tokens_per_s / max(point[2] for point in host.matmul)
    return StepTime(step_s=step, compute_s=compute_total, memory_bound_s=memory_total, comm_s=comm,
                    exposed_comm_s=exposed, optimizer_s=optimizer, offload_s=0.0, tokens_per_s_per_gpu=tokens_per_s,
                    mfu=mfu)
