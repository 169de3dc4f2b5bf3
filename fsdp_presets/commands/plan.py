"""``fsdp-presets plan MODEL --gpus N --gpu-memory GiB``: what fits, per strategy, and what to use.

    fsdp-presets plan tests/data/llama-3-70b --gpus 16 --nodes 2 --gpu-memory 80 --seq-len 4096
    fsdp-presets plan llama --gpus 2 --gpu-memory 24 --json
    fsdp-presets plan path/to/model --gpus 8 --gpu-memory 80 --diagram plan.png
    fsdp-presets plan model_configs/llama-3.1-8b --gpus 8 --gpu-memory 80 --seq-len 4096 --grad-accum 4
    fsdp-presets plan model_configs/llama-3.1-70b --gpus 8,16,32,64,128 --gpu H100-SXM --tokens 10e9

Per GPU at the step's peak (the start of backward, as a rehearsal measures it: ``fsdp-presets
rehearse``): parameters, gradients, optimizer state, activations and transient buffers for DDP,
NO_SHARD, SHARD_GRAD_OP, FULL_SHARD and (with --nodes > 1) HYBRID_SHARD, FSDP1 and FSDP2;
whether each fits, the largest micro-batch that does, and the bytes each GPU sends per step; the
step time, tokens/s per GPU, MFU and the share of the step waiting on communication on the GPU
type (``--gpu``, H100-SXM unless given), and the fastest configuration that fits. Several
``--gpus`` counts print a scaling table. Formulas and their sources: :mod:`fsdp_presets.plan.planner`
(memory) and :mod:`fsdp_presets.plan.step_time` (time).
"""

from __future__ import annotations

import argparse

HELP = "plan per-GPU memory and communication of every FSDP/DDP strategy, and recommend one"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from fsdp_presets import arguments, flags
    from fsdp_presets.plan.methods import add_method_arguments
    from fsdp_presets.plan.limits import gpu_counts, token_count

    arguments.add_model(parser)
    parser.add_argument("--gpus", type=gpu_counts, required=True, metavar="N[,N...]",
                        help="GPUs in the whole job; several counts (8,16,32,64) print a scaling table with "
                        "8 GPUs a node above 8")
    arguments.add_nodes(parser)
    arguments.add_gpu(parser, default_help="default H100-SXM for the times, --gpu-memory for the memory")
    arguments.add_inter_node_gbps(parser)
    parser.add_argument("--tokens", type=token_count, metavar="N",
                        help="tokens to train on (10e9): adds training time and GPU-hours")
    arguments.add_gpu_memory(parser, default_help=", or the --gpu type's")
    arguments.add_device(parser, default_help="; cpu: processes on this host, timed by measuring the host "
                         "once (about 15 s, cached)")
    arguments.add_seq_len(parser, default_help="; a longer one given here is refused")
    arguments.add_micro_batch(parser)
    arguments.add_grad_accum(parser, extra_help="; under no_sync FSDP keeps unsharded gradients of the whole "
                             "model between them")
    flags.add(parser, flags.REDUCE_EVERY_MICRO_BATCH, action="store_true",
              help="plan gradients reduced after every micro-batch instead of accumulated under no_sync")
    arguments.add_precision(parser)
    parser.add_argument("--optimizer", default="adamw", help="adamw (default), adam, sgd (with momentum) or lion")
    arguments.add_savers(parser, default_text="off; with --method lora|qlora auto: on only when nothing fits "
                         "without it, activation checkpointing first, and the plan says so")
    add_method_arguments(parser)
    parser.add_argument("--attention", choices=("fused", "eager"), default="fused",
                        help="fused (SDPA/FlashAttention, default) or eager attention (stores s x s scores)")
    parser.add_argument("--storage-bandwidth", type=float, metavar="GB/s", default=None,
                        help="checkpoint write bandwidth per node in GB/s (default 2, an assumed figure: measure yours); "
                        "prints what a save costs per strategy")
    parser.add_argument("--mtbf", type=float, metavar="HOURS",
                        help="mean time between failures of the whole job: print what a save costs per strategy and the save "
                        "interval (Young/Daly)")
    arguments.add_host_memory(parser, default_help="; prints what a save costs, and whether --async-save's staging "
                              "copy fits beside the offloaded states")
    parser.add_argument("--seconds-per-step", type=float, metavar="SECONDS",
                        help="seconds per optimizer step, to give the save interval in steps (default: the "
                        "predicted step time of the recommended strategy)")
    arguments.add_mesh(parser, default_text="the sizes the model allows, each planned beside FSDP alone")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--diagram", metavar="FILE.png", help="draw per-GPU memory and the unit split to this file")
    arguments.add_trust_remote_code(parser)


def run(args: argparse.Namespace) -> int:
    import json

    from fsdp_presets.fileio import GiB
    from fsdp_presets.plan.fastest import fastest
    from fsdp_presets.plan.inputs import plan_inputs
    from fsdp_presets.plan.methods import lora_from_args
    from fsdp_presets.plan.mesh_plan import meshes_for
    from fsdp_presets.plan.planner import fit_seq_len, plan_with_auto_savers
    from fsdp_presets.plan.report import plan_json, plan_text, scaling_json, scaling_text
    from fsdp_presets.preset.generate import load_profile
    from fsdp_presets.preset.measured_activations import rehearsed_mesh_terms, with_rehearsed_terms
    from fsdp_presets.preset.request import DEFAULT_HOST_MEMORY_GIB

    inputs = plan_inputs(args)  # every flag checked before the model is read
    if args.device == "cpu" and (args.tp or args.ep):
        from fsdp_presets.errors import UsageError

        raise UsageError("--tp/--ep with --device cpu: a CPU host's step is timed for FSDP alone; plan the mesh "
                         "for GPUs (--gpu NAME)")
    storage, shape = inputs.storage_bytes_per_s, inputs.shape
    host = (args.host_memory or DEFAULT_HOST_MEMORY_GIB["gpu"]) * GiB
    profile = load_profile(args.model, trust_remote_code=args.trust_remote_code)
    shape, seq_note = fit_seq_len(shape, profile, given=args.seq_len)
    shape = shape.replace(lora=lora_from_args(args, profile))
    shape, terms_note = with_rehearsed_terms(args.model, shape, trust_remote_code=args.trust_remote_code)
    hardwares = inputs.hardwares
    if args.device == "cpu":
        import dataclasses

        from fsdp_presets.preset.host_rates import host_rates
        from fsdp_presets.preset.request import PresetRequest

        rates, host_note = host_rates(processes=args.gpus[0])
        hardware = PresetRequest(model=args.model, gpus=args.gpus[0], device="cpu",
                                 host_memory_gib=args.host_memory).hardware
        hardwares = (dataclasses.replace(hardware, host=rates),)
    plans = []
    for hardware in hardwares:
        meshes = () if args.device == "cpu" else meshes_for(
            profile, hardware, shape, tp=args.tp, ep=args.ep)
        measured, _ = rehearsed_mesh_terms(args.model, shape, meshes, trust_remote_code=args.trust_remote_code,
                                           rehearse_missing=bool(args.tp or args.ep))
        memory_plan, chosen = plan_with_auto_savers(profile, hardware, shape.replace(measured_on_mesh=measured),
                                                    checkpointing=inputs.checkpointing, offload=inputs.offload,
                                                    meshes=meshes)
        plans.append((memory_plan, chosen, fastest(profile, hardware, memory_plan.shape, meshes)))
    gpu_note = (host_note if args.device == "cpu" else None if inputs.gpu_named
                else f"step times for {inputs.hardware.gpu.name} GPUs: give --gpu for yours")

    if len(plans) > 1:
        if args.json:
            print(json.dumps(scaling_json(plans, profile, source=args.model, tokens=args.tokens), indent=2))
        else:
            print(scaling_text(plans, profile, source=args.model, tokens=args.tokens, gpu_note=gpu_note))
        return 0
    memory_plan, chosen, found = plans[0]
    if args.diagram:
        from fsdp_presets.plan.diagram import draw_plan

        draw_plan(memory_plan, profile, args.diagram)
    if args.json:
        print(json.dumps(plan_json(memory_plan, profile, source=args.model, chosen=chosen, storage_bytes_per_s=storage,
                                   host_bytes=host, terms_note=terms_note, fastest=found, tokens=args.tokens),
                         indent=2))
    else:
        predicted = memory_plan.recommended.time.step_s if memory_plan.recommended is not None else None
        print(plan_text(memory_plan, profile, source=args.model, chosen=chosen, seq_note=seq_note,
                        terms_note=terms_note, storage_bytes_per_s=storage, host_bytes=host,
                        saves=any(value is not None for value in (args.mtbf, args.storage_bandwidth, args.host_memory)),
                        mtbf_hours=args.mtbf,
                        step_time_s=args.seconds_per_step or predicted, diagram=args.diagram, fastest=found,
                        tokens=args.tokens, gpu_note=gpu_note))
    return 0
