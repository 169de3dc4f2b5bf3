"""What to tell accelerate for one model and one cluster: a :class:`Preset`, each decision with
its reason. Pure: a :class:`~fsdp_presets.model.profile.ModelProfile` and a :class:`PresetRequest` in,
a ``Preset`` out (``emit.py`` turns it into YAML; only the CLI touches files)::

    profile = profile_model("model_configs/llama-3.1-8b")
    preset = decide(profile, PresetRequest(model="model_configs/llama-3.1-8b", gpus=16, nodes=2))
    preset.parallelism.label            # "HSDP 2x8"
    preset.batch.micro_batch, preset.batch.accumulation

How ``auto`` decides (the planner, :mod:`fsdp_presets.plan.planner`, costs every option):

* GPUs: the fastest configuration that fits by the step predicted on ``--gpu`` (H100-SXM unless given;
  :mod:`fsdp_presets.preset.fastest_fit`, the figure the header prints) among the strategies (one
  node: FULL_SHARD and SHARD_GRAD_OP; several: HYBRID_SHARD and FULL_SHARD across every GPU, judged
  at half the network too), activation checkpointing off and on, and gradients accumulated under
  no_sync or reduced every micro-batch, each at the largest micro-batch it fits. Steps within 1% are
  a tie, which the default order decides (the order above, no_sync, no checkpointing). CPU offload
  only when nothing fits otherwise (always slower: every step waits on PCIe) and the node's host
  memory holds the offloaded states.
* CPU hosts (``--device cpu``) and TP/EP meshes: the first that fits in the default order. Strategy
  FULL_SHARD; with 2 processes SHARD_GRAD_OP when it fits (measured faster there, see
  ``CPU_GRAD_OP_MEASURED``); several nodes: HYBRID_SHARD when it fits, else FULL_SHARD. Activation
  checkpointing only when the strategy does not fit without it, reducing every micro-batch only when
  no_sync does not fit with it either.
* what is asked for (``--strategy``, ``--activation-checkpointing``, ``--offload``, ``--micro-batch``)
  is kept; the rest is decided around it.
* micro-batch: the largest that fits and divides each rank's share of the global batch; gradient
  accumulation makes up the rest, so micro x accumulation x data-parallel size = global batch.
"""

from __future__ import annotations

from itertools import islice

from fsdp_presets.errors import UsageError
from fsdp_presets.fileio import GiB, format_bytes, format_count
from fsdp_presets.preset.choices import BatchPlan, MemorySavers, Parallelism, PrecisionChoice, Preset, WrapChoice
from fsdp_presets.model.model_profile import ModelProfile
from fsdp_presets.numerics import param_groups
from fsdp_presets.plan.results import MemoryPlan, StrategyPlan
from fsdp_presets.plan.step_time import predicted_on
from fsdp_presets.preset.checkpoint_choice import state_dict_choice, with_async_save
from fsdp_presets.preset.fastest_fit import (SLOW_NETWORK_SHARE, Candidate, checkpointing_comparison,
                                             fastest_candidate, reduction_comparison, strategy_comparison)
from fsdp_presets.plan.shapes import TrainingShape
from fsdp_presets.plan.planner import plan
from fsdp_presets.preset.request import (CPU_DEFAULT_SEQUENCES_PER_PROCESS, DEFAULT_GLOBAL_BATCH_TOKENS, STRATEGY_NAMES,
                                         PresetRequest, parse_global_batch)
from fsdp_presets.plan.limits import DEFAULT_SEQ_LEN, one_machine_note
from fsdp_presets.schema import K

__all__ = ["decide"]


# --------------------------------------------------------------------------- deciding


def decide(profile: ModelProfile, request: PresetRequest, *, measured=None, measured_on_mesh: tuple = ()) -> Preset:
    """The preset for ``profile`` on the layout of ``request``; UsageError when it cannot be made.
    ``measured``: the model's own activation terms
    (:func:`fsdp_presets.preset.measured_activations.with_rehearsed_terms`), else the family's;
    ``measured_on_mesh``: on the request's TP/EP mesh
    (:func:`~fsdp_presets.preset.measured_activations.rehearsed_mesh_terms`), else estimated."""
    notes: list[str] = []
    seq_len = _seq_len(profile, request, notes)
    hardware = request.hardware
    one_machine = one_machine_note(request.gpus, request.nodes) if request.device == "gpu" else None
    if one_machine:
        notes.append(one_machine)
    precision = _precision(profile, request, notes)
    mesh = request.mesh
    candidates = _strategy_candidates(request)
    if mesh.is_nd:  # first: a mesh the GPUs cannot hold is refused before its batch is split
        candidates = _mesh_candidates(profile, request, candidates)
    data_parallel = request.gpus // mesh.tp  # a TP group's ranks share one batch
    global_samples = _global_samples(request, seq_len, data_parallel, notes)
    per_rank = global_samples // data_parallel
    checkpointing = {"on": [True], "off": [False], "auto": [False, True]}[request.activation_checkpointing]
    offloading = [False] if request.device == "cpu" else {"on": [True], "off": [False], "auto": [False, True]}[
        request.offload]
    needed_micro = request.micro_batch or 1
    lora = request.lora_shape
    if lora is not None:
        from fsdp_presets.plan.lora_memory import default_target_modules, unknown_target_modules

        unknown = unknown_target_modules(profile, lora)
        if unknown or not default_target_modules(profile):
            raise UsageError(f"--lora-target-modules: {', '.join(unknown) or 'no Linear layer'} not in "
                             f"{profile.architecture}'s block; its Linear layers are "
                             f"{','.join(default_target_modules(profile)) or 'none'} (or give all-linear)")
    if request.micro_batch and per_rank % request.micro_batch:
        raise UsageError(
            f"--micro-batch {request.micro_batch} does not divide each rank's share of the global batch "
            f"({global_samples} sequences / {data_parallel} ranks = {per_rank}); use one of "
            f"{', '.join(str(d) for d in _divisors(per_rank))}"
        )

    # Accumulating (more than one micro-batch per rank): under no_sync FSDP holds a whole model's
    # unsharded gradients between micro-batches; reducing every micro-batch avoids that for more
    # traffic.
    accumulating = per_rank > needed_micro
    base = TrainingShape(lora=request.lora_shape, measured=measured, seq_len=seq_len, micro_batch=needed_micro,
                         precision=precision.planner_precision, grad_accum=2 if accumulating else 1,
                         measured_on_mesh=measured_on_mesh)
    by_speed = _chosen_by_speed(request)
    host_short: list[str] = []
    fitting: list[Candidate] = []
    for offload in offloading:  # offload only when nothing fits without it: every step waits on PCIe
        fits = _fitting(profile, request, base.replace(offload=offload), candidates, checkpointing,
                        [False, True] if accumulating else [False], host_short)
        fitting = [_completed(profile, request, shape, name, row, per_rank, by_speed=by_speed)
                   for name, shape, row in (fits if by_speed else islice(fits, 1))]
        if fitting:
            break
    if not fitting:
        raise UsageError(_nothing_fits(profile, request, hardware, seq_len, precision, candidates, checkpointing,
                                       offloading, needed_micro, host_short, measured=measured))
    chosen = fastest_candidate(fitting) if by_speed else fitting[0]
    name, final_shape, memory_plan, row = chosen.name, chosen.shape, chosen.memory_plan, chosen.row
    micro, accumulation = final_shape.micro_batch, final_shape.grad_accum
    ac, offload, reduce_every = (final_shape.activation_checkpointing, final_shape.offload,
                                 final_shape.reduce_every_micro_batch)
    speed = (strategy_comparison(chosen, fitting, candidates) if by_speed and request.strategy == "auto"
             else None)

    parallelism = _parallelism(request, name, row, memory_plan, speed=speed)
    savers = MemorySavers(activation_checkpointing=ac, offload=offload,
                          reason=_savers_reason(request, profile, hardware, row, ac, offload, seq_len, precision,
                                                 shape=final_shape,
                                                 speed=checkpointing_comparison(chosen, fitting) if by_speed else None))
    state_dict = with_async_save(state_dict_choice(profile, request, notes), request, memory_plan, row, notes)
    wrap = _wrap(profile, request)
    batch = BatchPlan(
        seq_len=seq_len, micro_batch=micro, accumulation=accumulation, data_parallel_size=data_parallel,
        reason=_batch_reason(request, row, micro, accumulation, data_parallel, global_samples, seq_len)
        + _accumulation_reason(profile, hardware, final_shape, name, request,
                               speed=reduction_comparison(chosen, fitting) if by_speed else None),
        reduce_every_micro_batch=reduce_every,
    )
    if precision.mixed_precision == "fp16" and profile.structure.get("config_dtype") == "bfloat16":
        notes.append("fp16 on a model trained in bf16: bf16 weights can exceed fp16's range (max 65504); "
                     "prefer --precision bf16")
    return Preset(request=request, profile=profile, parallelism=parallelism, precision=precision, savers=savers,
                  state_dict=state_dict, wrap=wrap, batch=batch, memory_plan=memory_plan, row=row, notes=tuple(notes))


def _chosen_by_speed(request: PresetRequest) -> bool:
    """Whether ``auto`` picks the fastest configuration that fits by predicted step time
    (:mod:`fsdp_presets.preset.fastest_fit`) rather than the first in the default order: on GPUs
    without a TP/EP mesh. A CPU host's speed is measured, not predicted (its rules quote the
    measurements); a mesh's layout is the one asked for."""
    return request.device == "gpu" and not request.mesh.is_nd


def _fitting(profile: ModelProfile, request: PresetRequest, base: TrainingShape, candidates: list[str],
             checkpointing: list[bool], reductions: list[bool], host_short: list[str]):
    """``(strategy, shape, row)`` for each configuration that fits ``base``'s micro-batch, lazily and in
    the default order: strategies as listed, accumulation under no_sync before reducing every
    micro-batch (less traffic), no activation checkpointing before it (no recomputation). An
    offloading one whose states the node's host memory cannot hold adds why to ``host_short``."""
    for name in candidates:
        for reduce_every in reductions:
            for ac in checkpointing:
                shape = base.replace(activation_checkpointing=ac, reduce_every_micro_batch=reduce_every)
                row = _row(plan(profile, request.hardware, shape, _meshes(request)), name, request)
                if row.max_micro_batch < base.micro_batch:
                    continue
                if shape.offload and not _host_holds_offload(row, request):
                    host_short.append(_host_message(row, request))
                    continue
                yield name, shape, row


def _completed(profile: ModelProfile, request: PresetRequest, shape: TrainingShape, name: str, row: StrategyPlan,
               per_rank: int, *, by_speed: bool) -> Candidate:
    """The configuration at the micro-batch it would run (as asked, else the largest that fits and
    divides the rank's ``per_rank`` sequences), planned there, with its predicted step when
    ``by_speed``."""
    micro = request.micro_batch or max(d for d in _divisors(per_rank) if d <= row.max_micro_batch)
    accumulation = per_rank // micro
    final = shape.replace(micro_batch=micro, grad_accum=accumulation,
                          reduce_every_micro_batch=shape.reduce_every_micro_batch and accumulation > 1)
    memory_plan = plan(profile, request.hardware, final, _meshes(request))
    final_row = _row(memory_plan, name, request)
    if not by_speed:
        return Candidate(name=name, shape=final, memory_plan=memory_plan, row=final_row)
    gpu = request.gpu_type.name
    step_s = predicted_on(gpu, profile, memory_plan, final_row).step_s
    slow_network_s = (predicted_on(gpu, profile, memory_plan, final_row, network_share=SLOW_NETWORK_SHARE).step_s
                      if request.nodes > 1 and request.inter_node_gbps is None else None)  # a network given is known
    return Candidate(name=name, shape=final, memory_plan=memory_plan, row=final_row, gpu=gpu, step_s=step_s,
                     slow_network_s=slow_network_s)


def _seq_len(profile: ModelProfile, request: PresetRequest, notes: list[str]) -> int:
    limit = profile.dims.max_position_embeddings
    wanted = request.seq_len or DEFAULT_SEQ_LEN
    if limit and wanted > limit:
        notes.append(f"sequence length {wanted} capped to {limit}, the model's maximum positions "
                     "(max_position_embeddings)")
        return limit
    return wanted


def _precision(profile: ModelProfile, request: PresetRequest, notes: list[str]) -> PrecisionChoice:
    trained = profile.structure.get("config_dtype")
    trained_text = f" (its config says {trained})" if trained else ""
    if request.precision == "auto":
        if request.device == "cpu":
            return PrecisionChoice(mixed_precision="no", reason=(
                "fp32 (auto on CPU): exact and simple for demos and CI; CPU bf16 autocast is slower than fp32 "
                "on most CPUs"))
        return PrecisionChoice(mixed_precision="bf16", reason=(
            f"bf16 mixed precision (auto on GPUs): compute and communication in bf16, fp32 master weights and "
            f"optimizer state; bf16 keeps fp32's exponent range, so no loss scaling is needed{trained_text}"))
    if request.precision == "fp32":
        return PrecisionChoice(mixed_precision="no", reason=(
            "fp32 as asked: twice the activation and communication bytes of bf16 (the planner counts them)"))
    if request.precision == "fp16":
        return PrecisionChoice(mixed_precision="fp16", reason=(
            f"fp16 mixed precision as asked: needs loss scaling (accelerate adds a gradient scaler){trained_text}"))
    return PrecisionChoice(mixed_precision="bf16", reason=(
        f"bf16 mixed precision as asked: fp32 master weights and optimizer state{trained_text}"))


def _global_samples(request: PresetRequest, seq_len: int, data_parallel: int, notes: list[str]) -> int:
    if request.global_batch is None and request.device == "cpu":
        value, unit = CPU_DEFAULT_SEQUENCES_PER_PROCESS * data_parallel, "samples"
    elif request.global_batch is None:
        value, unit = DEFAULT_GLOBAL_BATCH_TOKENS, "tokens"
    else:
        value, unit = parse_global_batch(request.global_batch)
    if unit == "samples":
        if value % data_parallel:
            lower, upper = (value // data_parallel) * data_parallel, -(-value // data_parallel) * data_parallel
            options = " or ".join(str(v) for v in (lower, upper) if v > 0)
            per = "one per GPU" if data_parallel == request.gpus else f"one per TP group of {request.mesh.tp} GPUs"
            raise UsageError(f"--global-batch {value} sequences does not divide over {data_parallel} data-parallel "
                             f"ranks ({per}): use {options}")
        return value
    sequences = value // seq_len
    samples = (sequences // data_parallel) * data_parallel
    if samples < 1:
        raise UsageError(f"--global-batch {value} tokens is less than one sequence of {seq_len} tokens per "
                         f"data-parallel rank ({data_parallel} ranks): give at least {seq_len * data_parallel} tokens")
    if samples * seq_len != value:
        source = "the default 0.5M" if request.global_batch is None else str(request.global_batch)
        notes.append(f"global batch {source} tokens = {value / seq_len:g} sequences of {seq_len}: rounded down to "
                     f"{samples}, a multiple of the {data_parallel} data-parallel ranks")
    return samples


def _divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]


def _meshes(request: PresetRequest) -> tuple:
    """The TP/EP meshes the planner costs beside FSDP alone: the request's, when it has one."""
    return (request.mesh,) if request.mesh.is_nd else ()


def _row(memory_plan: MemoryPlan, name: str, request: PresetRequest) -> StrategyPlan:
    """The plan's row of strategy ``name`` on the request's mesh (FSDP alone without one)."""
    mesh = request.mesh
    if not mesh.is_nd:
        return memory_plan.get(name, request.fsdp_version)
    return next(row for row in memory_plan.strategies
                if row.name == name and (row.tp_size, row.ep_size) == (mesh.tp, mesh.ep))


def _mesh_candidates(profile: ModelProfile, request: PresetRequest, candidates: list[str]) -> list[str]:
    """The strategies of ``candidates`` the request's TP/EP mesh can run with (UsageError, with why,
    when none can)."""
    mesh = request.mesh
    parallel = profile.structure.get("parallel") or {}
    problems: dict[str, list[str]] = {
        name: mesh.problems(parallel, gpus=request.gpus, gpus_per_node=request.gpus_per_node,
                            hybrid=name == "HYBRID_SHARD", nodes=request.nodes)
        for name in candidates}
    # transformers' FSDP plan shards fully (per copy under HSDP): SHARD_GRAD_OP has no mesh row
    usable = [name for name in candidates if not problems[name] and name in MESH_STRATEGIES]
    if not usable and not any(problems.values()) and candidates:
        raise UsageError(f"--strategy {request.strategy} with --tp/--ep: transformers' DistributedConfig shards "
                         "fully (FULL_SHARD, HYBRID_SHARD across nodes); leave --strategy auto or give full")
    if not usable:
        found = sorted({problem for listed in problems.values() for problem in listed})
        raise UsageError(f"--tp {mesh.tp} --ep {mesh.ep}: {'; '.join(found)} (`fsdp-presets inspect MODEL` lists the "
                         "sizes the model allows)")
    return usable


MESH_STRATEGIES = ("FULL_SHARD", "HYBRID_SHARD")
"""The strategies a TP/EP mesh is planned with (transformers' FSDP plan: each copy fully sharded)."""


def _strategy_candidates(request: PresetRequest) -> list[str]:
    """The strategies ``decide`` considers, in the default order (which breaks ties, and is the whole
    choice where no step is predicted)."""
    if request.strategy != "auto":
        return [STRATEGY_NAMES[request.strategy]]
    # NOTE: with one GPU per node an HSDP mesh would be N x 1, which accelerate refuses ("no
    # dimension for FSDP to shard across"): sharding across all nodes is the only FSDP choice.
    if request.nodes > 1 and request.gpus_per_node > 1:
        return ["HYBRID_SHARD", "FULL_SHARD"]
    if request.device == "cpu" and request.gpus == CPU_GRAD_OP_PROCESSES:
        return ["SHARD_GRAD_OP", "FULL_SHARD"]  # measured faster here; FULL_SHARD when it does not fit
    # NOTE: on one node GPU presets weigh SHARD_GRAD_OP's saved all-gather against the memory it holds
    # by predicted step time. Not across nodes: there it would send every gather over the network
    # (HSDP keeps them in the node) for a predicted gain within 2% on the shipped models, and only
    # under the best-case network the prediction assumes (one 400 Gb/s adapter per GPU).
    return ["FULL_SHARD"] + (["SHARD_GRAD_OP"] if _chosen_by_speed(request) and request.nodes == 1 else [])


CPU_GRAD_OP_PROCESSES = 2
"""On a CPU host with this many processes ``auto`` picks SHARD_GRAD_OP when it fits (see
:data:`CPU_GRAD_OP_MEASURED`); other counts were not measured and keep FULL_SHARD."""
CPU_GRAD_OP_MEASURED = ("measured on SmolLM2-135M, 2 CPU processes, 2 x 64 tokens per rank, fp32 "
                        "(python scripts/bench.py --side-by-side, docs/benchmarks.md): 13% less CPU time and 6% less "
                        "wall time per step than FULL_SHARD (0.97x vs 1.10x DDP's CPU time), peak RSS per process "
                        "2.9 vs 2.4 GiB")
"""The figures behind the CPU SHARD_GRAD_OP rule, quoted in the preset's header."""


def _host_holds_offload(row: StrategyPlan, request: PresetRequest) -> bool:
    """Offloaded model states of every rank of a node must fit the node's host RAM."""
    return row.model_state.total * request.gpus_per_node <= request.host_bytes


def _host_message(row: StrategyPlan, request: PresetRequest) -> str:
    need = row.model_state.total * request.gpus_per_node / GiB
    return (f"{row.label} with offload needs {need:.0f} GiB of host RAM per node for the offloaded states, more than "
            f"--host-memory {request.host_bytes / GiB:g}")


def _layout(request: PresetRequest) -> str:
    unit = "processes" if request.device == "cpu" else "GPUs"
    if request.nodes > 1:
        return f"{request.nodes} nodes x {request.gpus_per_node} {unit}"
    return f"{request.gpus} {unit}"


def _nothing_fits(profile, request, hardware, seq_len, precision, candidates, checkpointing, offloading,
                  needed_micro, host_short, *, measured=None) -> str:
    widest = TrainingShape(lora=request.lora_shape, measured=measured, seq_len=seq_len, micro_batch=needed_micro, precision=precision.planner_precision,
                           activation_checkpointing=checkpointing[-1], offload=offloading[-1])
    memory_plan = plan(profile, hardware, widest)
    tried = " or ".join(f"{name} (FSDP{request.fsdp_version})" for name in candidates)
    savers = [text for flag, text in ((checkpointing[-1], "activation checkpointing"), (offloading[-1], "offload"))
              if flag]
    with_savers = f" even with {' and '.join(savers)}" if savers else ""
    memory = (f"{hardware.gpu_memory_bytes / GiB:g} GiB each" if request.device == "cpu"
              else f"{hardware.gpu_memory_bytes / GiB:g} GiB")
    message = (f"{profile.architecture} ({format_count(profile.total_params, compact=True)} parameters) does not fit {_layout(request)} "
               f"of {memory} with {tried}{with_savers} at micro-batch {needed_micro}, sequence {seq_len}")
    rows = [memory_plan.get(name, request.fsdp_version) for name in candidates]
    smallest = min(rows, key=lambda r: r.per_gpu.total)
    if host_short:
        message += f": {host_short[0]} (give your nodes' RAM with --host-memory GiB if they have more)"
    else:
        message += (f": {smallest.label} needs {smallest.per_gpu.total / GiB:.1f} GiB per GPU of "
                    f"{hardware.usable_bytes / GiB:.1f} usable")
    fitting_other = memory_plan.recommended
    if request.strategy != "auto" and fitting_other is not None and fitting_other.name != "DDP":
        message += f"; {fitting_other.label} would fit (--strategy {_flag_for(fitting_other.name)})"
    suggestions = memory_plan.suggestions or plan(
        profile, hardware, TrainingShape(lora=request.lora_shape, measured=measured, seq_len=seq_len, micro_batch=needed_micro,
                                         precision=precision.planner_precision,
                                         activation_checkpointing=True, offload=request.device != "cpu")).suggestions
    if suggestions:
        message += "; the planner suggests: " + "; ".join(suggestions)
    return message


def _flag_for(strategy: str) -> str:
    return {value: key for key, value in STRATEGY_NAMES.items()}[strategy]


def _parallelism(request: PresetRequest, name: str, row: StrategyPlan, memory_plan: MemoryPlan, *,
                 speed: str | None = None) -> Parallelism:
    """The layout of strategy ``name`` and why: ``speed`` (the predicted steps of the strategies that
    fit, :func:`~fsdp_presets.preset.fastest_fit.strategy_comparison`) where it was chosen by speed,
    else the default order's rule."""
    if name == "HYBRID_SHARD":
        replicate, shard = request.nodes, request.gpus_per_node
    elif name == "NO_SHARD":
        replicate, shard = request.gpus, 1
    else:
        replicate, shard = 1, request.gpus
    comm = f"{format_bytes(row.comm.total)} sent per GPU per step"
    if row.comm.inter_node:
        comm += f", {format_bytes(row.comm.inter_node)} of it across nodes"
    if request.strategy != "auto":
        reason = f"{row.label} as asked (--strategy {request.strategy}): {comm}"
    elif speed is not None:
        reason = f"{speed}. {_what_it_does(name, request, comm)}"
    elif name == "HYBRID_SHARD":
        full = memory_plan.get("FULL_SHARD", request.fsdp_version)
        reason = (f"HYBRID_SHARD (HSDP {replicate}x{shard}): each node holds one sharded copy of the model states "
                  f"and parameter all-gathers stay inside the node; only gradient shards are all-reduced across "
                  f"nodes ({comm}; FULL_SHARD over all {request.gpus} GPUs would send "
                  f"{format_bytes(full.comm.inter_node)} across nodes)")
    elif name == "SHARD_GRAD_OP":
        full = memory_plan.get("FULL_SHARD", request.fsdp_version)
        reason = (f"SHARD_GRAD_OP over {request.gpus} processes (ZeRO-2, auto on a CPU host with "
                  f"{CPU_GRAD_OP_PROCESSES} processes when it fits): gradients and optimizer state sharded, each block "
                  f"gathered once for forward and backward instead of twice ({comm}; FULL_SHARD "
                  f"{format_bytes(full.comm.total)}), for {format_bytes(row.per_gpu.total)} instead of "
                  f"{format_bytes(full.per_gpu.total)} per process: {CPU_GRAD_OP_MEASURED}; --strategy full to shard "
                  "parameters too")
    elif request.nodes > 1:
        hybrid = memory_plan.get("HYBRID_SHARD", request.fsdp_version)
        reason = (f"FULL_SHARD across all {request.gpus} GPUs: HYBRID_SHARD does not fit, even with the memory savers "
                  f"allowed (it shards over one node's {request.gpus_per_node} GPUs only: "
                  f"{format_bytes(hybrid.model_state.total)} of model states per GPU against "
                  f"{format_bytes(row.model_state.total)} here); {comm}")
    else:
        grad_op = memory_plan.get("SHARD_GRAD_OP", request.fsdp_version)
        reason = (f"FULL_SHARD over {request.gpus} {'processes' if request.device == 'cpu' else 'GPUs'} (ZeRO-3): "
                  f"parameters, gradients and optimizer state sharded, each block gathered only while it computes, "
                  f"which leaves the most memory for activations ({comm}). SHARD_GRAD_OP would send "
                  f"{format_bytes(grad_op.comm.total)} but keep every block gathered from forward to backward "
                  f"({format_bytes(grad_op.per_gpu.total)} vs {format_bytes(row.per_gpu.total)} per GPU here; "
                  "--strategy grad-op)")
    if request.fsdp_version == 1:
        reason += ". FSDP1 as asked (--fsdp-version 1)"
    if row.is_nd:
        reason = (f"{row.label} as asked (--tp {request.tp} --ep {request.ep}), through transformers' "
                  f"DistributedConfig: every rank holds {format_bytes(row.model_state.total)} of model states as "
                  f"with FSDP alone; {comm}, and {format_bytes(row.mesh_comm.total)} of TP/EP collectives inside "
                  f"the node. " + reason)
    return Parallelism(num_processes=request.gpus, num_machines=request.nodes, strategy=name,
                       fsdp_version=request.fsdp_version, replicate_size=replicate, shard_size=shard, reason=reason,
                       tp_size=request.tp, ep_size=request.ep)


def _what_it_does(name: str, request: PresetRequest, comm: str) -> str:
    """What strategy ``name`` shards and gathers on GPUs, and the flag that asks for another."""
    return {
        "HYBRID_SHARD": (f"HSDP {request.nodes}x{request.gpus_per_node}: each node holds one sharded copy of the "
                         "model states and parameter all-gathers stay inside the node; only gradient shards are "
                         f"all-reduced across nodes ({comm})"),
        "FULL_SHARD": (f"FULL_SHARD (ZeRO-3) over {request.gpus} GPUs: parameters, gradients and optimizer state "
                       f"sharded, each block gathered only while it computes, which leaves the most memory for "
                       f"activations ({comm})"),
        "SHARD_GRAD_OP": (f"SHARD_GRAD_OP (ZeRO-2) over {request.gpus} GPUs: gradients and optimizer state sharded, "
                          "each block gathered once for forward and backward instead of twice and held from one "
                          f"to the other ({comm})"),
    }[name] + "; --strategy full|grad-op" + ("|hybrid" if request.nodes > 1 else "") + " to choose another"


def _savers_reason(request, profile, hardware, row, ac, offload, seq_len, precision, shape=None,
                   speed: str | None = None) -> str:
    """Why activation checkpointing and offload are on or off; ``speed``: the predicted steps with and
    without checkpointing where both fit (:func:`~fsdp_presets.preset.fastest_fit.checkpointing_comparison`)."""
    parts = []
    if request.activation_checkpointing == "auto" and speed is not None:
        parts.append(speed)
    elif request.activation_checkpointing == "auto":
        if ac:
            plain = TrainingShape(lora=request.lora_shape, seq_len=seq_len, micro_batch=1, precision=precision.planner_precision, offload=offload)
            if shape is not None:  # the same accumulation, without checkpointing
                plain = shape.replace(micro_batch=1, activation_checkpointing=False)
            without = plan(profile, hardware, plain).get(row.name, row.fsdp_version)
            parts.append(f"activation checkpointing on (auto): without it {row.label} needs "
                         f"{format_bytes(without.per_gpu.total)} per GPU at micro-batch 1 of "
                         f"{format_bytes(hardware.usable_bytes)} usable; recomputing each block in backward costs about "
                         "a third more compute")
        else:
            parts.append("activation checkpointing off (auto): not needed to fit, so no recomputation")
    else:
        parts.append(f"activation checkpointing {'on' if ac else 'off'} as asked")
    if ac:
        parts.append("the training forward must pass use_cache=False: accelerate re-runs each block in backward "
                     "(checkpoint_wrapper) and a KV cache would be appended to twice")
    if request.device == "cpu":
        parts.append("offload off: on a CPU-only host parameters already live in host memory")
    elif request.offload == "auto":
        if offload:
            need = row.model_state.total * request.gpus_per_node / GiB
            parts.append(f"CPU offload on (auto): nothing fits on the GPUs otherwise; parameters, gradients and "
                         f"optimizer state live in host RAM ({format_bytes(row.model_state.total)} per rank, "
                         f"{need:.0f} GiB per node) and every step moves them over PCIe (slow)")
        else:
            parts.append("CPU offload off (auto): the model states fit on the GPUs")
    else:
        parts.append(f"CPU offload {'on' if offload else 'off'} as asked")
    return "; ".join(parts)


def _wrap(profile: ModelProfile, request: PresetRequest) -> WrapChoice:
    if not profile.wrap_classes:
        raise UsageError(f"{profile.architecture} has no repeated blocks to wrap: FSDP would shard the whole model as "
                         "one unit (gathered whole every step), which saves nothing over DDP; "
                         "`fsdp-presets inspect` shows its structure")
    blocks = ", ".join(f"{unit.count} x {unit.cls} ({format_count(unit.params_each, compact=True)} each)" for unit in profile.units)
    no_split = profile.structure.get("no_split_modules") or []
    reason = (f"TRANSFORMER_BASED_WRAP with the model's blocks, read off the built model: {blocks}; each block is "
              "one FSDP unit, gathered just before it computes")
    missing = profile.missing_no_split
    if missing:
        reason += (f". Named explicitly because _no_split_modules lists {', '.join(missing)}, which this model does "
                   "not contain (left to _no_split_modules, some accelerate versions raise 'Could not find the "
                   "transformer layer class')")
    elif no_split and sorted(no_split) != sorted(profile.wrap_classes):
        reason += f" (the model's _no_split_modules: {', '.join(no_split)})"
    return WrapChoice(classes=tuple(profile.wrap_classes), reason=reason, model_parts=tuple(_model_parts(profile, request)))


def _model_parts(profile: ModelProfile, request: PresetRequest) -> list[str]:
    """How the parameters outside the blocks are handled, and why (the header explains these)."""
    parts = []
    embeddings = ", ".join(f"{entry['name']} ({format_count(entry['params'], compact=True)})" for entry in profile.embeddings) or "none"
    head = profile.output_head or "none"
    root = format_count(profile.root_params, compact=True)
    if request.fsdp_version == 2:
        if profile.tied_embeddings:
            parts.append(f"embeddings {embeddings} and the output head {head} share one weight (tied): accelerate "
                         "puts the input embedding, the final norm and the head into one tail unit, so the shared "
                         "parameter lives in exactly one FSDP unit and stays tied after sharding")
        else:
            parts.append(f"input embedding {embeddings}: its own FSDP unit (accelerate shards it apart from the "
                         f"blocks); the final norm and the output head {head} form a tail unit that stays gathered "
                         "from forward to backward (reshard_after_forward false for it: re-gathering it at the "
                         "start of backward could not be hidden)")
        parts.append(f"{root} parameters live outside the blocks in all; what the units above do not take stays in "
                     "the root unit, which FSDP2 keeps gathered after forward")
    else:
        tie = " (the tied embedding/head weight is one parameter of it)" if profile.tied_embeddings else ""
        parts.append(f"embeddings {embeddings}, the final norm and the output head {head}: FSDP1's root unit "
                     f"({root} parameters){tie}, kept gathered after forward because backward needs it first")
    norms = ", ".join(profile.norm_classes) or "none"
    rms = [name for name in profile.norm_classes if "rms" in name.lower() or name == "T5LayerNorm"]
    if request.device == "cpu" and request.precision in ("auto", "fp32"):
        parts.append(f"norms ({norms}) stay inside their blocks' units and compute in fp32 like everything else")
    else:
        upcast = (f"; {', '.join(rms)} upcast{'s' if len(rms) == 1 else ''} to fp32 internally (Hugging Face RMSNorm implementations compute the "
                  "variance in fp32)" if rms else "")
        parts.append(f"norms ({norms}) stay inside their blocks' units (the final norm in the tail/root unit); under "
                     "FSDP mixed precision their weights are gathered in the compute dtype like every parameter and "
                     f"the fp32 master copy is what the optimizer updates{upcast}")
    fsdp1 = f"; FSDP1 needs {K.use_orig_params}: true for such per-parameter groups (set)"
    parts.append("weight decay: recipes/causal_lm.py excludes norms, biases and embeddings "
                 f"({param_groups.__module__}.{param_groups.__name__})" + (fsdp1 if request.fsdp_version == 1 else ""))
    parts.append(f"no ignored modules ({K.ignored_modules} unset): FSDP leaves ignored parameters out of gradient "
                 "synchronisation, so they would drift apart between ranks")
    return parts


def _accumulation_reason(profile, hardware, shape, name, request, speed: str | None = None) -> str:
    """Why gradients are accumulated under no_sync or reduced every micro-batch, with the
    planner's (rehearsal-checked) numbers; ``speed``: the predicted steps of both where both fit
    (:func:`~fsdp_presets.preset.fastest_fit.reduction_comparison`)."""
    if shape.grad_accum == 1:
        return ""
    def row_of(changed) -> StrategyPlan:
        return _row(plan(profile, hardware, changed, _meshes(request)), name, request)

    no_sync = row_of(shape.replace(reduce_every_micro_batch=False))
    held = no_sync.per_gpu.buffers - row_of(shape.replace(grad_accum=1)).per_gpu.buffers
    if not shape.reduce_every_micro_batch:
        return (f"; accumulated under no_sync: reduced once per optimizer step, while each GPU holds "
                f"{format_bytes(held)} of unsharded gradients between micro-batches"
                + (f" ({speed})" if speed else ""))
    if speed:
        return (f"; gradients reduced after every micro-batch (recipe --reduce-every-micro-batch): {speed}; "
                f"no_sync would hold {format_bytes(held)} of unsharded gradients per GPU between micro-batches")
    return (f"; gradients reduced after every micro-batch (recipe --reduce-every-micro-batch): accumulating "
            f"them under no_sync would hold {format_bytes(held)} of unsharded gradients per GPU "
            f"({format_bytes(no_sync.per_gpu.total)} in all, over {format_bytes(hardware.usable_bytes)} usable)")


def _batch_reason(request, row, micro, accumulation, data_parallel, global_samples, seq_len) -> str:
    tokens = global_samples * seq_len
    if request.micro_batch:
        how = f"micro-batch {micro} as asked (up to {row.max_micro_batch} fits)"
    else:
        how = (f"micro-batch {micro}: the largest that fits ({row.max_micro_batch} fits) and divides each rank's "
               f"{global_samples // data_parallel} sequences")
    batch_source = f"--global-batch {request.global_batch}" if request.global_batch is not None else \
        f"default {CPU_DEFAULT_SEQUENCES_PER_PROCESS} sequences per process on a CPU" if request.device == "cpu" else \
        "default 0.5M tokens"
    return (f"{micro} x {accumulation} accumulation x {data_parallel} data-parallel ranks = {global_samples} sequences "
            f"= {tokens:,} tokens per optimizer step ({batch_source}); {how}")
