"""``fsdp-presets rehearse MODEL --gpus N``: one real FSDP2 training step at full size on this CPU,
per-GPU peak memory by category, with the planner's numbers beside it.

    fsdp-presets rehearse model_configs/llama-3.1-70b --gpus 64 --seq-len 4096
    fsdp-presets rehearse model_configs/llama-3.1-8b --gpus 8 --seq-len 4096 --micro-batch 2 --grad-accum 4
    fsdp-presets rehearse accelerate_configs/llama-3.1-8b_1x8.yaml          # a generated preset, as its header says
    fsdp-presets rehearse model_configs/llama-3.1-8b --gpus 8 --seq-len 4096 --json

The step is the causal-LM recipe's (forward, ``logits[:, :-1].float()`` summed cross entropy,
backward under ``no_sync`` accumulation, clipping, AdamW), on the model's real architecture,
prepared by accelerate's own FSDP2 code, as rank 0 of a fake process group of N ranks with fake
tensors: no weights, no GPUs, a few hundred MiB of host RAM. How, and what it cannot see:
:mod:`fsdp_presets.plan.rehearsal`. FSDP1 and DDP are not rehearsed (torch's memory tracker follows
FSDP2 only); CPU offload is rehearsed without it and the offloaded states subtracted.

Exit status: 0 when the rehearsed peak fits the GPU memory, 1 when it does not, 2 on bad input.
"""

from __future__ import annotations

import argparse

HELP = "rehearse one FSDP2 training step at full size on the CPU (fake tensors) and compare with the planner"

NOT_REHEARSED = ("FSDP1 and DDP are not rehearsed (torch's FSDP memory tracker follows FSDP2 only); the "
                 "planner's figures for them are estimates")
"""Said by every rehearsal, text and JSON."""
CPU_BLIND_SPOTS = ("not seen on a CPU: the CUDA allocator's rounding and fragmentation, the CUDA context, "
                   "NCCL/cuBLAS workspaces and CUDA-only kernels; the planner reserves memory for them")
"""What a rehearsal on CPU kernels leaves out (see fsdp_presets.plan.rehearsal)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from fsdp_presets import arguments
    from fsdp_presets.plan.methods import add_method_arguments

    arguments.add_model(parser, metavar="MODEL|CONFIG.yaml",
                        extra_help=", or a preset written by `fsdp-presets generate`")
    arguments.add_gpus(parser, help_text="GPUs in the whole job (required with a MODEL)")
    arguments.add_nodes(parser)
    arguments.add_micro_batch(parser)
    arguments.add_grad_accum(parser)
    arguments.add_seq_len(parser)
    arguments.add_precision(parser)
    arguments.add_savers(parser, with_offload=False, default_text="off; auto: off, a rehearsal is on roomy GPUs")
    arguments.add_strategy(parser, default_help="; FSDP2 only: no-shard is FSDP1")
    arguments.add_gpu_memory(parser, default_help=", or the preset's; for the fit verdict and the planner")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    add_method_arguments(parser, method_help="the training method: only full is rehearsed (a LoRA/QLoRA plan is "
                         "checked against a hand calculation, docs/sharding.md)")
    arguments.add_trust_remote_code(parser)


# --------------------------------------------------------------------------- what to rehearse


def _from_preset(args) -> tuple:
    """(PresetRequest, batch settings, env) of a generated preset file; flags may not change it."""
    from pathlib import Path

    from fsdp_presets.plan.emit import read_metadata
    from fsdp_presets.errors import UsageError
    from fsdp_presets.plan.check import AccelerateRejected, accelerate_view
    from fsdp_presets.plan.presets import PresetRequest

    path = Path(args.model)
    overriding = [flag for flag, value in (("--gpus", args.gpus), ("--nodes", args.nodes),
                                           ("--micro-batch", args.micro_batch), ("--grad-accum", args.grad_accum),
                                           ("--seq-len", args.seq_len), ("--precision", args.precision),
                                           ("--activation-checkpointing", args.activation_checkpointing),
                                           ("--strategy", args.strategy)) if value is not None]
    if overriding:
        raise UsageError(f"{', '.join(overriding)}: a preset file fixes these; rehearse the model with the flags "
                         f"instead (fsdp-presets rehearse MODEL --gpus N ...)")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"cannot read {path}: {error}") from None
    metadata = read_metadata(text)
    if not metadata or metadata.get("kind") != "fsdp":
        raise UsageError(f"{path}: not an FSDP preset written by `fsdp-presets generate` (no `# fsdp-presets:` "
                         "metadata line); rehearse the model instead: fsdp-presets rehearse MODEL --gpus N")
    method = (metadata.get("request") or {}).get("method", "full")
    if method != "full":
        raise UsageError(_NOT_REHEARSED.format(method=method, where=f"{path} (its header)"))
    try:
        request = PresetRequest(**metadata["request"])
        view = accelerate_view(path)
    except (TypeError, KeyError) as error:
        raise UsageError(f"{path}: its metadata line is not one this version reads ({error}); regenerate it") from None
    except AccelerateRejected as error:
        raise UsageError(f"{path}: accelerate rejects it: {error}") from None
    return request, metadata["summary"], view.env


_NOT_REHEARSED = ("--method {method} from {where}: only full fine-tuning is rehearsed (a fake-tensor FSDP2 step of "
                  "the whole model); a LoRA/QLoRA plan is checked against the hand calculation in docs/sharding.md "
                  "instead: fsdp-presets plan MODEL --method {method} --gpus N --gpu-memory GiB")


def _request_from_flags(args):
    from fsdp_presets import arguments
    from fsdp_presets.errors import UsageError
    from fsdp_presets.plan.presets import PresetRequest

    if args.gpus is None:
        raise UsageError("--gpus is required with a MODEL (e.g. --gpus 8)")
    if args.strategy == "no-shard":
        raise UsageError(f"--strategy no-shard: {NOT_REHEARSED}")
    nodes = args.nodes or 1
    micro = args.micro_batch or 1
    accumulation = args.grad_accum or 1
    strategy = args.strategy if args.strategy not in (None, "auto") else ("hybrid" if nodes > 1 else "full")
    return PresetRequest(
        model=args.model, gpus=args.gpus, nodes=nodes,
        precision=args.precision if args.precision not in (None, "auto") else "bf16", strategy=strategy,
        activation_checkpointing=args.activation_checkpointing or "off", offload="off",
        seq_len=args.seq_len or arguments.DEFAULT_SEQ_LEN, micro_batch=micro,
        global_batch=str(micro * accumulation * args.gpus), gpu_memory_gib=args.gpu_memory,
    )


def _config_env(preset) -> dict[str, str]:
    """The environment `accelerate launch` gives the processes for ``preset``'s accelerate config:
    the config written by the emitter, read back through accelerate's own launcher code."""
    import os
    import tempfile

    from fsdp_presets.plan.emit import accelerate_config, config_yaml
    from fsdp_presets.plan.check import accelerate_view

    handle, path = tempfile.mkstemp(suffix=".yaml", prefix="rehearse-")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(config_yaml(accelerate_config(preset)))
        return accelerate_view(path).env
    finally:
        os.unlink(path)


def _decide_unchecked(profile, request):
    """The preset of ``request`` with its settings as given, whether or not the planner says it
    fits: decided on GPUs large enough for anything, then re-planned on the asked memory."""
    import dataclasses

    from fsdp_presets.plan.planner import GiB, Hardware, plan
    from fsdp_presets.arguments import DEFAULT_GPU_MEMORY_GIB
    from fsdp_presets.plan.presets import decide

    roomy = dataclasses.replace(request, gpu_memory_gib=4096.0, host_memory_gib=65536.0)  # the largest accepted
    preset = decide(profile, roomy)
    gpu_gib = request.gpu_memory_gib or DEFAULT_GPU_MEMORY_GIB
    hardware = Hardware(gpus=request.gpus, nodes=request.nodes, gpu_memory_bytes=int(gpu_gib * GiB))
    memory_plan = plan(profile, hardware, preset.memory_plan.shape)
    return preset, memory_plan


# --------------------------------------------------------------------------- run


def run(args: argparse.Namespace) -> int:
    import dataclasses
    import json
    from pathlib import Path

    from fsdp_presets.errors import UsageError

    if (args.method or "full") != "full":
        raise UsageError(_NOT_REHEARSED.format(method=args.method, where="the command line"))
    from fsdp_presets.plan.methods import lora_from_args

    lora_from_args(args)  # LoRA flags without --method lora|qlora are refused
    from_preset = args.model.endswith((".yaml", ".yml")) and Path(args.model).is_file()
    if args.model.endswith((".yaml", ".yml")) and not from_preset:
        raise UsageError(f"{args.model}: no such preset file")

    from transformers.utils import logging as hf_logging

    from fsdp_presets.plan.planner import plan
    from fsdp_presets.plan.presets import decide
    from fsdp_presets.plan.profile import build_meta_model, load_config, profile_module

    hf_logging.set_verbosity_error()
    if from_preset:
        request, summary, env = _from_preset(args)
        if args.gpu_memory is not None:
            request = dataclasses.replace(request, gpu_memory_gib=args.gpu_memory)
        micro, accumulation = summary["micro_batch"], summary["gradient_accumulation"]
    else:
        request = _request_from_flags(args)
        micro, accumulation = request.micro_batch, 1 if args.grad_accum is None else args.grad_accum
    config = load_config(request.model, trust_remote_code=args.trust_remote_code)
    profile = profile_module(build_meta_model(config, trust_remote_code=args.trust_remote_code))
    if request.fsdp_version != 2:
        raise UsageError(f"{args.model}: FSDP{request.fsdp_version}: {NOT_REHEARSED}")
    if from_preset:
        preset = decide(profile, request)
        memory_plan, row = preset.memory_plan, preset.row
    else:
        preset, memory_plan = _decide_unchecked(profile, request)
        env = _config_env(preset)
        shape = dataclasses.replace(memory_plan.shape, grad_accum=accumulation)
        memory_plan = plan(profile, memory_plan.hardware, shape)
        row = memory_plan.get(preset.row.name, 2)
    if preset.row.name == "NO_SHARD" or preset.row.fsdp_version != 2:
        raise UsageError(f"{args.model}: {preset.row.label}: {NOT_REHEARSED}")
    shape, hardware = memory_plan.shape, memory_plan.hardware

    from fsdp_presets.plan.rehearsal import rehearse

    result = rehearse(config, env, world_size=hardware.gpus, seq_len=shape.seq_len, micro_batch=micro,
                      grad_accum=accumulation, reduce_every_micro_batch=shape.reduce_every_micro_batch,
                      trust_remote_code=args.trust_remote_code)
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
        "config": args.model if from_preset else None,
        "strategy": row.label, "gpus": hardware.gpus, "nodes": hardware.nodes,
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
    if args.json:
        print(json.dumps(document, indent=2))
    else:
        print(format_rehearsal(document, result, row))
    return 0 if fits else 1


def format_rehearsal(document: dict, result, row) -> str:
    """The per-category table, rehearsal beside planner, and the verdict."""
    from fsdp_presets.fileio import GiB as gib
    from fsdp_presets.plan.tables import human_count, text_table

    rehearsed = result.peak_by_category
    model = document["model"]
    lines = [
        f"{model['source']}: {model['architecture']}, {human_count(model['total_params'])} parameters",
        f"{document['strategy']} over {document['gpus']} GPUs"
        + (f" on {document['nodes']} nodes" if document["nodes"] > 1 else "")
        + f", seq {document['seq_len']}, micro-batch {document['micro_batch']} x {document['grad_accum']} "
        f"accumulation{' (reduced every micro-batch)' if document['reduce_every_micro_batch'] else ''}, "
        f"{document['precision']}, activation checkpointing {'on' if document['activation_checkpointing'] else 'off'}"
        + (", offload on" if document["offload"] else ""),
        f"rehearsed: {result.iterations} optimizer steps through accelerate's FSDP2 preparation ({result.units} "
        f"units), fake tensors, a fake process group of {document['gpus']} ranks; {result.seconds:.0f} s",
        "",
        "per GPU (rank 0) at the peak, GiB:",
    ]
    planner = row.per_gpu

    def cell(value) -> str:
        return "" if value is None else f"{value / gib:.2f}"

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
        f"{'fits' if document['fits'] else 'does NOT fit'} a {document['gpu_memory_bytes'] / gib:g} GiB GPU "
        f"(rehearsed peak {document['rehearsal']['per_gpu_peak_bytes'] / gib:.1f} GiB; the planner also reserves "
        f"memory for what a CPU rehearsal cannot see)",
        f"note: {CPU_BLIND_SPOTS}",
        f"note: {NOT_REHEARSED}",
    ]
    return "\n".join(lines)
