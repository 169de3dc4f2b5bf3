"""What training a model costs per GPU, for every data-parallel strategy: a ``MemoryPlan``.

Pure arithmetic on a :class:`~fsdp_presets.model.profile.ModelProfile`; no torch, no files::

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

from fsdp_presets.plan.limits import MAX_GPUS
from fsdp_presets.errors import UsageError
from fsdp_presets.plan.activations import (activation_bytes, activation_bytes_per_layer, activation_source,
                                           block_activations, end_bytes, in_block_activation_bytes,
                                           last_block_activation_bytes, logits_bytes, mlp_width, saved_per_block,
                                           tail_activation_bytes)
from fsdp_presets.plan.allocator import allocator_reserve, nvidia_smi_bytes, unit_bytes
from fsdp_presets.plan.communication import collectives, fsdp_comm
from fsdp_presets.fileio import GiB, format_bytes
from fsdp_presets.plan.lora_memory import lora_comm, lora_model_state_bytes, lora_peak
from fsdp_presets.plan.model_state import (ACCUMULATED_GRAD_BYTES, fsdp_units, gathered_params, input_embedding_params,
                                          model_state_bytes)
from fsdp_presets.model.model_profile import ModelProfile
from fsdp_presets.plan.mesh_plan import estimated_mesh_terms, sliced_profile, tensor_parallel_comm
from fsdp_presets.plan.results import CommBytes, MemoryPlan, ModelStateBytes, PerGpuBytes, StrategyPlan
from fsdp_presets.rehearse.mesh import Mesh
from fsdp_presets.plan.step_time import step_time
from fsdp_presets.plan.shapes import (OPTIMIZER_STATE_BYTES, OPTIMIZER_STEP_TEMPORARY_BYTES, STORED_PARAM_BYTES,
                                      Hardware, TrainingShape)

__all__ = ["fit_seq_len", "human_bytes", "offloads", "plan", "plan_with_auto_savers", "strategies_for"]

human_bytes = format_bytes  # the old name, still imported by the benchmark harness

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





def _accumulated_grads(profile: ModelProfile, shape: TrainingShape, fsdp_version: int | None) -> int:
    """Unsharded gradients of the whole model held across micro-batches under ``no_sync``."""
    if shape.grad_accum == 1 or shape.reduce_every_micro_batch or fsdp_version is None:
        return 0
    per_param = STORED_PARAM_BYTES if shape.compute_bytes == 4 else ACCUMULATED_GRAD_BYTES[fsdp_version]
    return profile.total_params * per_param


def _peak(profile: ModelProfile, shape: TrainingShape, name: str, fsdp_version: int | None,
          state: ModelStateBytes, micro_batch: int, expert_shard: int = 1,
          expert_parallel: bool = False) -> PerGpuBytes:
    """Bytes on one GPU at the peak of a step at ``micro_batch``; ``state`` is what the GPU keeps
    between steps (zero when offloaded); ``expert_shard``: the ranks FSDP2 shards fused experts
    over (a gathered block and its unsharded gradient are padded to a multiple of them:
    :func:`~fsdp_presets.plan.model_state.gathered_params`). ``expert_parallel``: the experts are
    transformers' own FSDP units on ``efsdp`` (expert parallelism), which gather a rank's experts
    unpadded and reduce their gradient padded in fp32 (rehearsed: a 4-block Mixtral-8x7B as FSDP 64
    x EP 4 holds 11.2 GiB of such a gradient in one block's backward).

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
    - under accumulation (``no_sync``), the forward of a later micro-batch: the accumulated
      unsharded gradients of the whole model beside the blocks' activations and gathered units.
    - the optimizer step: the model states, every gradient shard and the step's own temporaries
      (:data:`~fsdp_presets.plan.shapes.OPTIMIZER_STEP_TEMPORARY_BYTES`); the peak where the states
      are large beside the activations (few GPUs, activation checkpointing).

    DDP and NO_SHARD are not rehearsed: model states, full gradients and the buffers below."""
    if shape.lora is not None:
        return lora_peak(profile, shape, name, fsdp_version, state, micro_batch)
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
    # A fused expert tensor gathers (and reduces its gradient) padded to the ranks sharding it.
    pad = max((gathered_params(profile, unit, fsdp_version, expert_shard) - unit.params for unit in units), default=0)
    padded_blocks = sum(unit.count for unit in units if gathered_params(profile, unit, fsdp_version, expert_shard)
                        > unit.params)
    # the unsharded gradient of the block in backward, with its padding, in bytes
    # (expert parallelism: a rehearsal on the mesh saw the unpadded gradient among its temporaries)
    grad_in_block = pad * STORED_PARAM_BYTES if expert_parallel else (largest + pad) * c
    if expert_parallel:
        pad = 0  # gathered unpadded
    if name == "SHARD_GRAD_OP":
        # every unit gathered from forward to backward
        gathered_at_loss = gathered_in_block = total + pad * padded_blocks
    else:
        gathered_at_loss, gathered_in_block = kept, kept + sum(resharded[:2]) + pad * min(padded_blocks, 2)
    grads = state.grads if shape.grad_accum > 1 and shape.reduce_every_micro_batch else 0
    # In a block's backward the units reduced before it (the tail, the block after it) already
    # hold their fp32 gradient shards (measured: 0.74 GiB for Mixtral-8x7B at 8 GPUs).
    reduced_shards = grads or (state.grads * (largest + kept) // total if total else 0)
    # Under no_sync the last micro-batch reduces each unit's accumulated gradients after its
    # backward and frees them: in a block's backward those of the units reduced before it are gone,
    # at the end of backward all but the unit in backward (rehearsed: Qwen3 at 8 GPUs, micro-batch 1
    # x 4 under checkpointing peaks at the loss, not later in backward with every gradient held).
    accumulated_in_block = accumulated - (accumulated * (largest + kept) // total if total else 0)
    accumulated_at_end = accumulated * largest // total if total else 0
    at_loss = PerGpuBytes(params=state.params, grads=grads, optimizer=state.optimizer, activations=activations,
                          buffers=gathered_at_loss * c + accumulated)
    # Under activation checkpointing the block in backward first recomputes its full activations.
    recomputed = activation_bytes_per_layer(profile, shape, micro_batch) if shape.activation_checkpointing else 0
    block_temporaries = 2 * shape.seq_len * micro_batch * mlp_width(profile) * c
    # FSDP2 reshards the tail kept gathered through forward after its own backward, before any
    # block's (rehearsed: StarCoder2 peaks in a block's backward with two blocks gathered, no tail).
    tail_resharded = kept if fsdp_version == 2 and name != "SHARD_GRAD_OP" else 0
    own = in_block_activation_bytes(profile, shape, micro_batch)  # rehearsed for this model, where it peaks there
    in_block = PerGpuBytes(params=state.params, grads=reduced_shards, optimizer=state.optimizer,
                           activations=own if own is not None else activations - logits_bytes(profile, shape, micro_batch)
                           + recomputed + block_temporaries,
                           buffers=(gathered_in_block - tail_resharded) * c + grad_in_block + accumulated_in_block)
    # The end of backward: every gradient shard exists (the backward of the embedding, with the
    # last blocks gathered). Sharded states dominate here when they are large beside the
    # activations: fused experts over more ranks than experts (rehearsed: Mixtral-8x7B at 32
    # GPUs, rank 0 peaks late in backward with most of its 21 GiB of gradient shards).
    # (The tail kept gathered through backward is resharded after its own backward, early on.)
    # Where a block's backward was rehearsed for this model, the last block holds what it held there,
    # beside the gradient shards of every unit but itself and the input embedding, reduced after it
    # (rehearsed: DeepSeek-V2-Lite at 8 GPUs, micro-batch 2 under checkpointing, peaks there).
    last_block = last_block_activation_bytes(profile, shape, micro_batch)
    embedding = input_embedding_params(profile) or (
        min(profile.dims.vocab_size * profile.dims.hidden_size, profile.root_params) if profile.tied_embeddings else 0)
    unreduced = state.grads * (largest + embedding) // total if total and last_block is not None else 0
    at_end = PerGpuBytes(params=state.params, grads=max(state.grads - unreduced, grads), optimizer=state.optimizer,
                         activations=recomputed + block_temporaries if last_block is None else last_block,
                         buffers=(gathered_in_block - (kept if name != "SHARD_GRAD_OP" else 0)) * c + grad_in_block
                         + accumulated_at_end)
    step_temporaries = (state.optimizer * OPTIMIZER_STEP_TEMPORARY_BYTES.get(shape.optimizer, 0)
                        // OPTIMIZER_STATE_BYTES[shape.optimizer])
    at_step = PerGpuBytes(params=state.params, grads=state.grads, optimizer=state.optimizer, activations=0,
                          buffers=step_temporaries)
    moments = [at_loss, in_block, at_end, at_step]
    if accumulated and fsdp_version == 2:
        # A later micro-batch's forward under no_sync, in its last block: the unsharded gradients
        # of the whole model accumulated by the earlier ones, the saved activations of the blocks
        # before it and its input, the tail kept gathered and three blocks' worth of gathered
        # parameters (rehearsed: Granite-3.1-8B and StarCoder2-15B at 64 GPUs, micro-batch 1 x 4,
        # peak there, Granite with 1.49 GiB of unsharded parameters: its 201M-parameter tail and
        # 3 x 199M, and 3 blocks' activations).
        block = max((unit.params_each for unit in profile.units), default=0)
        before = max(0, profile.dims.num_layers - 1) * saved_per_block(profile, shape, micro_batch)
        block_input = saved_per_block(profile, shape.replace(activation_checkpointing=True), micro_batch)
        moments.append(PerGpuBytes(params=state.params, grads=grads, optimizer=state.optimizer,
                                   activations=before + block_input, buffers=(kept + 3 * block) * c + accumulated))
    tail = tail_activation_bytes(profile, shape, micro_batch) if fsdp_version == 2 else None
    if tail is not None:
        # The tail's backward, where rehearsed for this model (block_activations): the logits' loss
        # tensors are freed, the blocks' activations not yet, and the tail is gathered twice over
        # with its unsharded gradients (accumulated ones already counted under no_sync).
        # The tail's own gradient shards exist by then (its reduce-scatter is done).
        family = block_activations(profile, shape)
        moments.append(PerGpuBytes(
            params=state.params, grads=grads or (state.grads * kept // total if total else 0),
            optimizer=state.optimizer, activations=tail,
            buffers=(gathered_at_loss - kept) * c + family.tail_unsharded_params
            + (0 if accumulated else family.tail_unsharded_grads) + accumulated))
    end = end_bytes(profile, shape, micro_batch) if fsdp_version == 2 and name != "SHARD_GRAD_OP" else None
    if end is not None:
        # The end of backward as rehearsed for this model: a head tied to the embedding sums its
        # gradient with the embedding's there (rehearsed: Command-R, 256k vocabulary).
        moments.append(PerGpuBytes(params=state.params, grads=max(state.grads, grads), optimizer=state.optimizer,
                                   activations=end, buffers=accumulated_at_end))
    return max(moments, key=lambda peak: peak.total)


def offloads(shape: TrainingShape, name: str) -> bool:
    """Whether strategy ``name`` keeps its model states in host memory under ``shape``: CPU offload
    is planned for the sharded strategies only (DDP has none, and FSDP1 NO_SHARD would move whole
    replicas through PCIe every step)."""
    return shape.offload and name not in ("DDP", "NO_SHARD")


def _strategy_plan(
    profile: ModelProfile, hardware: Hardware, shape: TrainingShape, name: str, fsdp_version: int | None,
    mesh: Mesh = Mesh(), *, largest_micro_batch: bool = True,
) -> StrategyPlan:
    """One row; with a ``mesh`` of TP/EP (FSDP2 ``FULL_SHARD`` or ``HYBRID_SHARD`` only), the same
    model state over the same ranks, and what one rank of the mesh gathers, computes and saves
    (:mod:`fsdp_presets.plan.mesh_plan`). ``largest_micro_batch=False``: the row only says whether
    it fits (and how fast), its ``max_micro_batch`` left at 0 (the suggestions' search plans
    thousands of rows and reads nothing else)."""
    notes: list[str] = []
    if name in ("DDP", "NO_SHARD"):
        shard_size, replicate_size = 1, hardware.gpus
    elif name == "HYBRID_SHARD":
        shard_size, replicate_size = hardware.gpus_per_node, hardware.nodes
    else:
        shard_size, replicate_size = hardware.gpus, 1
    state = (model_state_bytes if shape.lora is None else lora_model_state_bytes)(profile, shape, shard_size, fsdp_version)
    full_profile, mesh_comm, source, expert_shard = profile, CommBytes(), None, shard_size
    if mesh.is_nd:
        # What FSDP gathers and a rank computes and saves: one TP rank's slice over the FSDP ranks.
        terms = dict(shape.measured_on_mesh).get((mesh.tp, mesh.ep))
        source = "composed from a rehearsal on this mesh" if terms is not None else "estimated"
        shape = shape.replace(measured=terms if terms is not None else estimated_mesh_terms(profile, shape, mesh))
        mesh_comm = tensor_parallel_comm(profile, shape, mesh, shape.grad_accum)
        profile = sliced_profile(profile, mesh)
        hardware = dataclasses.replace(hardware, gpus=hardware.gpus // mesh.tp)
        # Dense parameters over fsdp (x tp), a rank's experts over efsdp = fsdp x tp / ep.
        expert_shard = shard_size // (mesh.ep if mesh.ep > 1 else mesh.tp)
        state = model_state_bytes(profile, shape, shard_size // mesh.tp, fsdp_version, expert_shard)
    offloaded = offloads(shape, name)
    if shape.offload and not offloaded:
        notes.append(f"offload is not planned for {name}; shown without it")
    if offloaded:
        notes.append(f"{format_bytes(state.total)} of model states per rank in host memory")
    on_gpu = ModelStateBytes(params=0, grads=0, optimizer=0) if offloaded else state

    if shape.lora is not None:
        comm = lora_comm(profile, hardware, shape, name, fsdp_version)
    elif name == "DDP":
        # Gradients all-reduced in the parameter dtype (fp32 under autocast) [ZeRO] Sec. 7.1.
        comm = collectives([("all_reduce", profile.total_params * STORED_PARAM_BYTES, hardware.gpus, hardware.nodes > 1)])
    elif name == "NO_SHARD":
        comm = collectives([("all_reduce", profile.total_params * shape.compute_bytes, hardware.gpus, hardware.nodes > 1)])
    else:
        comm = fsdp_comm(profile, hardware, shape, name, fsdp_version)

    def total_at(micro_batch: int) -> int:
        return _peak(profile, shape, name, fsdp_version, on_gpu, micro_batch, expert_shard, mesh.ep > 1).total

    per_gpu = _peak(profile, shape, name, fsdp_version, on_gpu, shape.micro_batch, expert_shard, mesh.ep > 1)
    reserve = allocator_reserve(unit_bytes(profile, shape, fsdp_version, shard_size // mesh.tp), fsdp_version=fsdp_version,
                                name=name, offloaded=offloaded, state_grads_on_gpu=on_gpu.grads,
                                peak_grads=per_gpu.grads, peak_total=per_gpu.total)
    row = StrategyPlan(
        name=name,
        fsdp_version=fsdp_version,
        shard_world_size=shard_size,
        replicate_world_size=replicate_size,
        model_state=state,
        per_gpu=per_gpu,
        fits=per_gpu.total <= hardware.usable_bytes,
        max_micro_batch=_max_micro_batch(total_at, hardware.usable_bytes) if largest_micro_batch else 0,
        comm=comm,
        allocator_reserve=reserve.total,
        nvidia_smi=nvidia_smi_bytes(per_gpu.total, reserve, hardware.gpu_memory_bytes),
        notes=tuple(notes),
        source=source or _source(profile, shape, fsdp_version),
        tp_size=mesh.tp,
        ep_size=mesh.ep,
        mesh_comm=mesh_comm,
    )
    if hardware.gpu is None and hardware.host is None:
        return row
    return dataclasses.replace(row, time=step_time(profile, hardware, shape, row, full_profile=full_profile))


def _source(profile: ModelProfile, shape: TrainingShape, fsdp_version: int | None) -> str:
    """``composed from a rehearsal`` for FSDP2 rows with this model's rehearsed activation terms;
    ``estimated`` otherwise (family constants, or FSDP1/DDP, which torch's tracker cannot follow)."""
    if fsdp_version == 2 and activation_source(profile, shape) == "composed from a rehearsal":
        return "composed from a rehearsal"
    return "estimated"


def _max_micro_batch(total_at, usable: int) -> int:
    """Largest b with total_at(b) <= usable. total_at grows with b (activations), about linearly
    past the moments that do not grow with it (the optimizer step): the estimate from b = 1 and 2
    is exact for linear terms and is taken when b + 1 is over; below, doubling finds a b that is
    over (a peak that does not grow with b hid the growth at b = 1 and 2), and where rounding or
    terms that grow otherwise push the estimate over, bisection finds the largest b that fits
    below it (a few evaluations, not one per micro-batch: a small model on a large GPU fits tens
    of thousands)."""
    if total_at(1) > usable:
        return 0
    per_sample = total_at(2) - total_at(1)
    guess = 1 + (usable - total_at(1)) // per_sample if per_sample > 0 else 2
    fits, over = 1, guess
    for _ in range(64):
        if total_at(over) > usable:
            break
        if total_at(over + 1) > usable:
            return over
        fits, over = over, over * 2
    else:
        return fits  # nothing grows with b: any micro-batch fits
    while over - fits > 1:  # total_at(fits) <= usable < total_at(over)
        middle = (fits + over) // 2
        if total_at(middle) <= usable:
            fits = middle
        else:
            over = middle
    return fits


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
    # NOTE: times equal to two significant digits are a tie (the model is not more exact than that);
    # a tie goes to less traffic.
    # A TP group's ranks share one micro-batch: per token, its step counts tp_size times.
    step = float(f"{strategy.time.step_s * strategy.tp_size:.2g}") if strategy.time is not None else 0.0
    return (
        step,
        strategy.comm.inter_node,
        strategy.comm_total,
        strategy.tp_size * strategy.ep_size,
        _PREFERENCE.index((strategy.name, strategy.fsdp_version)),
    )


def _best(strategies: list[StrategyPlan]) -> StrategyPlan | None:
    """The strategy that fits with the shortest step (when the GPU type is known), then the least
    communication (across nodes first); then its FSDP2 form when that fits too. FSDP1 and FSDP2
    of one strategy differ in communication only by which small units are re-gathered, which is no
    reason to leave the default version."""
    fitting = sorted((s for s in strategies if s.fits), key=_rank_key)
    if not fitting:
        return None
    same_name = [s for s in fitting if (s.name, s.tp_size, s.ep_size) ==
                 (fitting[0].name, fitting[0].tp_size, fitting[0].ep_size)]
    return min(same_name, key=lambda s: _PREFERENCE.index((s.name, s.fsdp_version)))


def plan(profile: ModelProfile, hardware: Hardware, shape: TrainingShape,
         meshes: tuple[Mesh, ...] = ()) -> MemoryPlan:
    """Cost every applicable strategy and recommend one.

    The recommendation is, among the strategies that fit at the requested micro-batch, the one
    that sends the fewest bytes across nodes, then the fewest in total; ties go to the simpler
    strategy and to FSDP2 over FSDP1. When nothing fits, ``recommended`` is None and
    ``suggestions`` lists re-planned changes that would fit. ``meshes``: TP/EP meshes to plan
    beside (FSDP2 x TP/EP, and HSDP x TP/EP across nodes), the ones the model and GPUs allow."""
    strategies = [_strategy_plan(profile, hardware, shape, name, version) for name, version in strategies_for(hardware)]
    for mesh in meshes:
        for name in ("FULL_SHARD",) + (("HYBRID_SHARD",) if hardware.nodes > 1 else ()):
            if not mesh.problems(profile.structure.get("parallel") or {}, gpus=hardware.gpus,
                                 gpus_per_node=hardware.gpus_per_node, hybrid=name == "HYBRID_SHARD",
                                 nodes=hardware.nodes):
                strategies.append(_strategy_plan(profile, hardware, shape, name, 2, mesh))
    best = _best(strategies)
    if best is not None:
        others = [s for s in strategies if not s.fits]
        reason = (
            f"{best.label} fits with the least communication: {format_bytes(best.per_gpu.total)} of tensors "
            f"(~{format_bytes(best.nvidia_smi)} as nvidia-smi shows it) of {format_bytes(hardware.usable_bytes)} "
            f"usable per GPU at micro-batch {shape.micro_batch} (up to "
            f"{best.max_micro_batch}), {format_bytes(best.comm_total, binary=False)} sent per GPU per step"
        )
        if best.comm.inter_node:
            reason += f" ({format_bytes(best.comm.inter_node, binary=False)} across nodes)"
        if others:
            smallest_missing = min(others, key=lambda s: s.per_gpu.total)
            reason += f"; {len(others)} other(s) do not fit (e.g. {smallest_missing.label} needs {format_bytes(smallest_missing.per_gpu.total)})"
        if best.time is not None:
            reason = time_reason(best, strategies) + "; " + reason.replace(" fits with the least communication", " fits")
        return MemoryPlan(hardware=hardware, shape=shape, strategies=strategies, recommended=best, reason=reason)
    smallest = min(strategies, key=lambda s: s.per_gpu.total)
    reason = (
        f"nothing fits at micro-batch {shape.micro_batch}: the smallest is {smallest.label} with "
        f"{format_bytes(smallest.per_gpu.total)} per GPU against {format_bytes(hardware.usable_bytes)} usable"
    )
    return MemoryPlan(
        hardware=hardware,
        shape=shape,
        strategies=strategies,
        recommended=None,
        reason=reason,
        suggestions=_suggestions(profile, hardware, shape),
    )


def time_reason(best: StrategyPlan, strategies: list[StrategyPlan]) -> str:
    """Why ``best`` is the fastest that fits: its step, and what makes the runner-up slower."""
    time = best.time
    text = (f"{best.label} is the fastest that fits: {time.step_s:.3g} s per step, "
            f"{time.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, MFU {time.mfu:.0%}, "
            f"{time.exposed_comm_fraction:.0%} of the step waiting on communication")
    def per_token(row: StrategyPlan) -> float:  # a TP group's GPUs share one micro-batch
        return row.time.step_s * row.tp_size

    others = sorted((s for s in strategies if s.fits and s.time is not None
                     and (s.name, s.tp_size, s.ep_size) != (best.name, best.tp_size, best.ep_size)), key=per_token)
    if others:
        runner = others[0]
        slower = per_token(runner) / per_token(best)
        if runner.time.exposed_comm_s > time.exposed_comm_s:
            why = (f"{format_bytes(runner.comm.inter_node, binary=False)} across nodes" if runner.comm.inter_node
                   > best.comm.inter_node else f"{format_bytes(runner.comm_total, binary=False)} sent")
            text += f" ({runner.label} {slower:.2f}x slower: {why}, {runner.time.exposed_comm_fraction:.0%} exposed)"
        elif slower < 1.01:
            text += f" ({runner.label} as fast: the tie goes to less traffic)"
        else:
            text += f" ({runner.label} {slower:.2f}x slower)"
    if best.name == "HYBRID_SHARD":
        text += (": HYBRID_SHARD sends only the gradient shards' all-reduce across nodes "
                 f"({best.comm.inter_node / max(best.comm.total, 1):.0%} of its traffic)")
    return text


def plan_with_auto_savers(profile, hardware, shape, *, checkpointing: str, offload: str, meshes: tuple = ()):
    """``(plan, chosen)``: the plan as asked, or, where a saver is ``auto`` and nothing fits, with the
    cheapest savers that make something fit (activation checkpointing first, then offload too).
    ``chosen`` names the savers turned on; when none makes anything fit, the plan as asked.
    ``meshes``: TP/EP meshes planned beside (:func:`plan`)."""
    first = plan(profile, hardware, shape, meshes)
    if first.recommended is not None:
        return first, []
    steps = []
    if checkpointing == "auto":
        steps.append((["activation checkpointing"], {"activation_checkpointing": True}))
    if offload == "auto":
        previous = steps[-1][1] if steps else {}
        names = (steps[-1][0] if steps else []) + ["offload"]
        steps.append((names, {**previous, "offload": True}))
    for names, change in steps:
        candidate = plan(profile, hardware, shape.replace(**change), meshes)
        if candidate.recommended is not None:
            return candidate, names
    return first, []


def fit_seq_len(shape, profile, *, given: int | None):
    """``(shape, note)``: the sequence length checked against the model's positions.

    A ``--seq-len`` longer than ``max_position_embeddings`` is refused, not planned: the model as
    its config stands cannot take it (a learned position table has no row for it; a rotary model
    runs past its trained context and the recipes' positions would not match the config), so a
    plan for it would describe a run that cannot happen as configured. The default is capped with
    a note instead, as ``generate`` does (:func:`fsdp_presets.preset.presets.decide`)."""
    limit = profile.dims.max_position_embeddings
    if not limit or shape.seq_len <= limit:
        return shape, None
    if given is not None:
        raise UsageError(f"--seq-len {given} is longer than the model's {limit} positions "
                         f"(max_position_embeddings in its config): use --seq-len {limit} or less, or plan a "
                         "longer context on a config that allows it (raise max_position_embeddings, with "
                         "rope_scaling for a rotary model)")
    return (dataclasses.replace(shape, seq_len=limit),
            f"sequence length {shape.seq_len} capped to {limit}, the model's maximum positions "
            "(max_position_embeddings)")


def _fits_anywhere(profile: ModelProfile, hardware: Hardware, shape: TrainingShape) -> StrategyPlan | None:
    """The strategy :func:`plan` would recommend on ``hardware`` for ``shape``, or None when none fits."""
    return _best([_strategy_plan(profile, hardware, shape, name, version, largest_micro_batch=False)
                  for name, version in strategies_for(hardware)])


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
        more_gpus_fit = False
        count, limit = start, MAX_GPUS // (hardware.gpus_per_node if hardware.nodes > 1 else 1)
        for _ in range(24):  # doubling: up to 2**24 times as many, within what one job can hold
            if count >= limit:
                break
            count = min(count * 2, limit)
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
                more_gpus_fit = True
                break
        if more_gpus_fit:
            break  # the first candidate that more GPUs make fit
    if not suggestions:
        suggestions.append("no change tried fits: use GPUs with more memory or shorter sequences (--seq-len)")
    return suggestions

