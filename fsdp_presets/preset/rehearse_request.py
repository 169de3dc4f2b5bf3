"""What ``fsdp-presets rehearse`` rehearses and how its result reads beside the planner: the request
of a generated preset or of the command's flags (:func:`request_from_preset`,
:func:`request_from_flags`), its accelerate environment, and :func:`rehearse_request`, which runs
one FSDP2 step at full size (:func:`fsdp_presets.rehearse.rehearsal.rehearse`) and returns the
document the command prints.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

from fsdp_presets.plan.limits import DEFAULT_GPU_MEMORY_GIB, DEFAULT_SEQ_LEN
from fsdp_presets.errors import UsageError
from fsdp_presets.fileio import YAML_MAX_BYTES, GiB, format_count, read_regular_text, text_table

NOT_REHEARSED = ("FSDP1 and DDP are not rehearsed (torch's FSDP memory tracker follows FSDP2 only); the "
                 "planner's figures for them are estimates")
"""Said by every rehearsal, text and JSON."""
CPU_BLIND_SPOTS = ("not seen on a CPU: the CUDA allocator's rounding and fragmentation, the CUDA context, "
                   "NCCL/cuBLAS workspaces and CUDA-only kernels; the planner reserves memory for them")
"""What a rehearsal on CPU kernels leaves out (see fsdp_presets.rehearse.rehearsal)."""


def request_from_preset(path, *, overriding: list[str]) -> tuple:
    """``(PresetRequest, batch summary, env)`` of a generated preset file; ``overriding`` names the
    flags given besides it, which a preset fixes (refused)."""
    from fsdp_presets.preset.accelerate_view import AccelerateRejected, accelerate_view
    from fsdp_presets.preset.emit import read_metadata
    from fsdp_presets.preset.request import PresetRequest

    path = Path(path)
    if overriding:
        raise UsageError(f"{', '.join(overriding)}: a preset file fixes these; rehearse the model with the flags "
                         f"instead (fsdp-presets rehearse MODEL --gpus N ...)")
    try:
        text = read_regular_text(path, limit=YAML_MAX_BYTES)
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"cannot read {path}: {error}") from None
    metadata = read_metadata(text)
    if not metadata or metadata.get("kind") != "fsdp":
        raise UsageError(f"{path}: not an FSDP preset written by `fsdp-presets generate` (no `# fsdp-presets:` "
                         "metadata line); rehearse the model instead: fsdp-presets rehearse MODEL --gpus N")
    method = (metadata.get("request") or {}).get("method", "full")
    if method != "full":
        raise UsageError(METHOD_NOT_REHEARSED.format(method=method, where=f"{path} (its header)"))
    try:
        request = PresetRequest(**metadata["request"])
        view = accelerate_view(path)
    except (TypeError, KeyError) as error:
        raise UsageError(f"{path}: its metadata line is not one this version reads ({error}); regenerate it") from None
    except AccelerateRejected as error:
        raise UsageError(f"{path}: accelerate rejects it: {error}") from None
    return request, metadata["summary"], view.env


METHOD_NOT_REHEARSED = ("--method {method} from {where}: only full fine-tuning is rehearsed (a fake-tensor FSDP2 "
                        "step of the whole model); a LoRA/QLoRA plan is checked against the hand calculation in "
                        "docs/sharding.md instead: fsdp-presets plan MODEL --method {method} --gpus N --gpu-memory GiB")


def request_from_flags(model: str, *, gpus: int | None, nodes: int | None = None, micro_batch: int | None = None,
                       grad_accum: int | None = None, seq_len: int | None = None, precision: str | None = None,
                       activation_checkpointing: str | None = None, strategy: str | None = None,
                       gpu_memory_gib: float | None = None):
    """The :class:`~fsdp_presets.preset.presets.PresetRequest` of a model rehearsed with these
    settings (None: the command's default), its global batch one optimizer step of them."""
    from fsdp_presets.preset.request import PresetRequest

    if gpus is None:
        raise UsageError("--gpus is required with a MODEL (e.g. --gpus 8)")
    if strategy == "no-shard":
        raise UsageError(f"--strategy no-shard: {NOT_REHEARSED}")
    nodes = nodes or 1
    micro = micro_batch or 1
    accumulation = grad_accum or 1
    return PresetRequest(
        model=model, gpus=gpus, nodes=nodes,
        precision=precision if precision not in (None, "auto") else "bf16",
        strategy=strategy if strategy not in (None, "auto") else ("hybrid" if nodes > 1 else "full"),
        activation_checkpointing=activation_checkpointing or "off", offload="off",
        seq_len=seq_len or DEFAULT_SEQ_LEN, micro_batch=micro,
        global_batch=str(micro * accumulation * gpus), gpu_memory_gib=gpu_memory_gib,
    )


def config_env(preset) -> dict[str, str]:
    """The environment `accelerate launch` gives the processes for ``preset``'s accelerate config:
    the config written by the emitter, read back through accelerate's own launcher code."""
    from fsdp_presets.preset.accelerate_view import accelerate_view
    from fsdp_presets.preset.emit import accelerate_config, config_yaml

    handle, path = tempfile.mkstemp(suffix=".yaml", prefix="rehearse-")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(config_yaml(accelerate_config(preset)))
        return accelerate_view(path).env
    finally:
        os.unlink(path)


def decide_unchecked(profile, request):
    """The preset of ``request`` with its settings as given, whether or not the planner says it
    fits: decided on GPUs large enough for anything, then re-planned on the asked memory."""
    from fsdp_presets.plan.limits import MAX_GPU_MEMORY_GIB, MAX_HOST_MEMORY_GIB
    from fsdp_presets.plan.shapes import Hardware
    from fsdp_presets.plan.planner import plan
    from fsdp_presets.preset.presets import decide

    roomy = dataclasses.replace(request, gpu_memory_gib=MAX_GPU_MEMORY_GIB, host_memory_gib=MAX_HOST_MEMORY_GIB)
    preset = decide(profile, roomy)
    gpu_gib = request.gpu_memory_gib or DEFAULT_GPU_MEMORY_GIB
    hardware = Hardware(gpus=request.gpus, nodes=request.nodes, gpu_memory_bytes=int(gpu_gib * GiB))
    memory_plan = plan(profile, hardware, preset.memory_plan.shape)
    return preset, memory_plan


def rehearse_request(request, *, source: str, preset_file: bool, summary: dict | None = None,
                     env: dict | None = None, grad_accum: int | None = None, trust_remote_code: bool = False,
                     mesh=None, mesh_terms=None):
    """``(document, result, row)``: one rehearsed FSDP2 step of ``request`` (a preset file's, with its
    ``summary`` and ``env``, when ``preset_file``) beside the planner's row of the same strategy.
    ``mesh``: a :class:`~fsdp_presets.rehearse.mesh.Mesh` of TP/EP, sharded by transformers'
    ``DistributedConfig`` on it, beside the planner's row for that mesh, whose activation terms
    ``mesh_terms(shape)`` gives (the shape with them: :func:`fsdp_presets.preset.measured_activations.
    rehearsed_mesh_terms`; None: estimated).
    ``document`` is the ``rehearse --json`` contract; ``document["fits"]`` the verdict."""
    from fsdp_presets.rehearse.mesh import Mesh

    mesh = mesh or Mesh()
    from transformers.utils import logging as hf_logging

    from fsdp_presets.plan.planner import plan
    from fsdp_presets.preset.presets import decide
    from fsdp_presets.model.model_loading import build_meta_model, load_config
    from fsdp_presets.model.profile import profile_module

    from_preset = preset_file
    if from_preset:
        micro, accumulation = summary["micro_batch"], summary["gradient_accumulation"]
    else:
        micro, accumulation = request.micro_batch, grad_accum or 1
    hf_logging.set_verbosity_error()
    config = load_config(request.model, trust_remote_code=trust_remote_code)
    profile = profile_module(build_meta_model(config, trust_remote_code=trust_remote_code))
    if request.fsdp_version != 2:
        raise UsageError(f"{source}: FSDP{request.fsdp_version}: {NOT_REHEARSED}")
    if from_preset:
        preset = decide(profile, request)
        memory_plan, row = preset.memory_plan, preset.row
    else:
        preset, memory_plan = decide_unchecked(profile, request)
        env = config_env(preset)
        shape = dataclasses.replace(memory_plan.shape, grad_accum=accumulation)
        if mesh.is_nd:
            problems = mesh.problems(profile.structure.get("parallel") or {}, gpus=request.gpus,
                                     gpus_per_node=memory_plan.hardware.gpus_per_node,
                                     hybrid=preset.row.name == "HYBRID_SHARD", nodes=request.nodes)
            if problems:
                raise UsageError(f"{source}: {'; '.join(problems)} (`fsdp-presets inspect MODEL` lists the sizes "
                                 "the model allows)")
            if mesh_terms is not None:
                shape = mesh_terms(shape)
        memory_plan = plan(profile, memory_plan.hardware, shape, (mesh,) if mesh.is_nd else ())
        row = memory_plan.get(preset.row.name, 2) if not mesh.is_nd else next(
            s for s in memory_plan.strategies if s.name == preset.row.name and (s.tp_size, s.ep_size) == (mesh.tp, mesh.ep))
    if preset.row.name == "NO_SHARD" or preset.row.fsdp_version != 2:
        raise UsageError(f"{source}: {preset.row.label}: {NOT_REHEARSED}")
    shape, hardware = memory_plan.shape, memory_plan.hardware

    from fsdp_presets.rehearse.rehearsal import rehearse

    result = rehearse(config, env, world_size=hardware.gpus, seq_len=shape.seq_len, micro_batch=micro,
                      grad_accum=accumulation, reduce_every_micro_batch=shape.reduce_every_micro_batch,
                      trust_remote_code=trust_remote_code,
                      mesh_sizes=mesh.sizes(gpus=hardware.gpus, nodes=hardware.nodes,
                                            hybrid=row.name == "HYBRID_SHARD") if mesh.is_nd else None)
    gpu_bytes = hardware.gpu_memory_bytes
    peak = result.peak_bytes
    offloaded = 0
    if shape.offload:
        # FSDP CPU offload keeps the shards of parameters, gradients and optimizer state in host
        # memory; rehearsed without it (one CPU is host and device at once), they come off here.
        offloaded = sum(result.peak_by_category.get(name, 0) for name in ("params", "grads", "optimizer"))
        peak -= offloaded
    fits = peak <= gpu_bytes
    planned = row.per_gpu.total
    difference = (planned - peak) / peak if peak else 0.0
    document = {
        "model": {"source": request.model, "architecture": profile.architecture, "total_params": profile.total_params},
        "config": source if from_preset else None,
        "strategy": row.label, "tp_size": mesh.tp, "ep_size": mesh.ep, "gpus": hardware.gpus, "nodes": hardware.nodes,
        "seq_len": shape.seq_len, "micro_batch": micro, "grad_accum": accumulation,
        "reduce_every_micro_batch": shape.reduce_every_micro_batch,
        "precision": shape.precision, "activation_checkpointing": shape.activation_checkpointing,
        "offload": shape.offload,
        "rehearsal": {**result.to_json(), "per_gpu_peak_bytes": peak, "offloaded_bytes": offloaded},
        "planner": row.per_gpu.to_json(),
        "planner_difference": round(difference, 4),
        "gpu_memory_bytes": gpu_bytes,
        "fits": fits,
        "not_rehearsed": NOT_REHEARSED,
        "not_seen": CPU_BLIND_SPOTS,
    }
    return document, result, row


def format_rehearsal(document: dict, result, row) -> str:
    """What ``fsdp-presets rehearse`` prints for :func:`rehearse_request`'s ``(document, result,
    row)``: the per-category table, rehearsal beside planner, and the verdict."""
    rehearsed = result.peak_by_category
    model = document["model"]
    preparation = ("transformers' DistributedConfig sharding" if document.get("tp_size", 1) * document.get("ep_size", 1) > 1
                   else "accelerate's FSDP2 preparation")
    lines = [
        f"{model['source']}: {model['architecture']}, {format_count(model['total_params'])} parameters",
        f"{document['strategy']} over {document['gpus']} GPUs"
        + (f" on {document['nodes']} nodes" if document["nodes"] > 1 else "")
        + f", seq {document['seq_len']}, micro-batch {document['micro_batch']} x {document['grad_accum']} "
        f"accumulation{' (reduced every micro-batch)' if document['reduce_every_micro_batch'] else ''}, "
        f"{document['precision']}, activation checkpointing {'on' if document['activation_checkpointing'] else 'off'}"
        + (", offload on" if document["offload"] else ""),
        f"rehearsed: {result.iterations} optimizer steps through {preparation} ({result.units} "
        f"units), fake tensors, a fake process group of {document['gpus']} ranks; {result.seconds:.0f} s",
        "",
        "per GPU (rank 0) at the peak, GiB:",
    ]
    planner = row.per_gpu

    def cell(value) -> str:
        return "" if value is None else f"{value / GiB:.2f}"

    rows = [
        ["parameters (sharded)", cell(rehearsed.get("params", 0)), cell(planner.params)],
        ["gradients (sharded)", cell(rehearsed.get("grads", 0)), cell(planner.grads)],
        ["optimizer state", cell(rehearsed.get("optimizer", 0)), cell(planner.optimizer)],
        ["activations", cell(rehearsed.get("activations", 0)), None],
        ["temporaries (loss backward)", cell(rehearsed.get("temporaries", 0)), None],
        ["  activations + temporaries", cell(rehearsed.get("activations", 0) + rehearsed.get("temporaries", 0)),
         cell(planner.activations)],
        ["unsharded parameters", cell(rehearsed.get("unsharded params", 0)), None],
        ["unsharded gradients", cell(rehearsed.get("unsharded grads", 0)), None],
        ["  unsharded (buffers)", cell(rehearsed.get("unsharded params", 0) + rehearsed.get("unsharded grads", 0)),
         cell(planner.buffers)],
    ]
    if document["offload"]:
        rows.append(["offloaded to host (not on GPU)", f"-{cell(document['rehearsal']['offloaded_bytes'])}", None])
    rows.append(["total", cell(document["rehearsal"]["per_gpu_peak_bytes"]), cell(planner.total)])
    lines += text_table(["category", "rehearsal", "planner"], [[r[0], r[1], r[2] or ""] for r in rows], right={1, 2})
    lines += [
        "",
        f"peak: {result.peak_where}",
        f"planner vs rehearsal: {document['planner_difference'] * 100:+.1f}%",
        f"{'fits' if document['fits'] else 'does NOT fit'} a {document['gpu_memory_bytes'] / GiB:g} GiB GPU "
        f"(rehearsed peak {document['rehearsal']['per_gpu_peak_bytes'] / GiB:.1f} GiB; the planner also reserves "
        f"memory for what a CPU rehearsal cannot see)",
        f"note: {document['not_seen']}",
        f"note: {document['not_rehearsed']}",
    ]
    return "\n".join(lines)
