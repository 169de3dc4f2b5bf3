"""``fsdp-presets plan MODEL --gpus N --gpu-memory GiB``: what fits, per strategy, and what to use.

    fsdp-presets plan tests/data/llama-3-70b --gpus 16 --nodes 2 --gpu-memory 80 --seq-len 4096
    fsdp-presets plan llama --gpus 2 --gpu-memory 24 --json
    fsdp-presets plan path/to/model --gpus 8 --gpu-memory 80 --diagram plan.png
    fsdp-presets plan model_configs/llama-3.1-8b --gpus 8 --gpu-memory 80 --seq-len 4096 --grad-accum 4

Per GPU at the step's peak (the start of backward, as a rehearsal measures it: ``fsdp-presets
rehearse``): parameters, gradients, optimizer state, activations and transient buffers for DDP,
NO_SHARD, SHARD_GRAD_OP, FULL_SHARD and (with --nodes > 1) HYBRID_SHARD, FSDP1 and FSDP2;
whether each fits, the largest micro-batch that does, and the bytes each GPU sends per step.
Formulas and their sources: :mod:`fsdp_presets.plan.planner`.
"""

from __future__ import annotations

import argparse

HELP = "plan per-GPU memory and communication of every FSDP/DDP strategy, and recommend one"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from fsdp_presets import arguments
    from fsdp_presets.plan.methods import add_method_arguments

    arguments.add_model(parser)
    arguments.add_gpus(parser, required=True)
    arguments.add_nodes(parser)
    arguments.add_gpu_memory(parser)
    arguments.add_seq_len(parser, default_help="; a longer one given here is refused")
    arguments.add_micro_batch(parser)
    arguments.add_grad_accum(parser, extra_help="; under no_sync FSDP keeps unsharded gradients of the whole "
                             "model between them")
    parser.add_argument("--reduce-every-micro-batch", action="store_true",
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
    parser.add_argument("--seconds-per-step", type=float, metavar="SECONDS",
                        help="seconds per optimizer step, to give the save interval in steps")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--diagram", metavar="FILE.png", help="draw per-GPU memory and the unit split to this file")
    arguments.add_trust_remote_code(parser)


def run(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from fsdp_presets import arguments
    from fsdp_presets.errors import UsageError
    from fsdp_presets.plan.methods import lora_from_args
    from fsdp_presets.fileio import GiB
    from fsdp_presets.plan.shapes import Hardware, TrainingShape
    from fsdp_presets.plan.planner import fit_seq_len, plan_with_auto_savers

    # Validate every flag before touching the model, and report all problems at once.
    problems = []
    if args.diagram and Path(args.diagram).suffix.lower() not in (".png", ".svg", ".pdf"):
        problems.append(f"--diagram {args.diagram}: give a .png (or .svg/.pdf) file name")
    hardware = shape = None
    lora_default = "auto" if args.method in ("lora", "qlora") else "off"
    checkpointing = args.activation_checkpointing or lora_default
    offload = args.offload or lora_default
    try:
        lora_from_args(args)  # the flags alone; target names are checked against the model below
    except UsageError as error:
        problems.append(str(error))
    try:
        hardware = Hardware(gpus=args.gpus, nodes=args.nodes or 1,
                            gpu_memory_bytes=int((args.gpu_memory or arguments.DEFAULT_GPU_MEMORY_GIB) * GiB))
    except UsageError as error:
        problems.append(str(error))
    try:
        shape = TrainingShape(
            seq_len=args.seq_len or arguments.DEFAULT_SEQ_LEN,
            micro_batch=args.micro_batch or 1,
            grad_accum=args.grad_accum or 1,
            reduce_every_micro_batch=args.reduce_every_micro_batch,
            precision="bf16" if args.precision in (None, "auto") else args.precision,  # plan is for GPUs
            optimizer=args.optimizer,
            activation_checkpointing=checkpointing == "on",
            offload=offload == "on",
            attention=args.attention,
        )
    except UsageError as error:
        problems.append(str(error))
    for flag, value in (("--storage-bandwidth", args.storage_bandwidth), ("--mtbf", args.mtbf),
                        ("--seconds-per-step", args.seconds_per_step)):
        if value is not None and not (value > 0 and value < float("inf")):
            problems.append(f"{flag} {value}: give a positive number")
    if problems:
        raise UsageError("; ".join(problems))
    from fsdp_presets.plan.save_cost import DEFAULT_STORAGE_GB_PER_S, format_save_costs, save_cost

    storage = (args.storage_bandwidth or DEFAULT_STORAGE_GB_PER_S) * 1e9

    from fsdp_presets.preset.generate import load_profile

    profile = load_profile(args.model, trust_remote_code=args.trust_remote_code)
    shape, seq_note = fit_seq_len(shape, profile, given=args.seq_len)
    shape = shape.replace(lora=lora_from_args(args, profile))
    from fsdp_presets.preset.measured_activations import with_rehearsed_terms

    shape, terms_note = with_rehearsed_terms(args.model, shape, trust_remote_code=args.trust_remote_code)
    memory_plan, chosen = plan_with_auto_savers(profile, hardware, shape, checkpointing=checkpointing,
                                                offload=offload)

    if args.diagram:
        from fsdp_presets.plan.diagram import draw_plan

        Path(args.diagram).parent.mkdir(parents=True, exist_ok=True)
        draw_plan(memory_plan, profile, args.diagram)
    if args.json:
        document = memory_plan.to_json()
        document["model"] = {"source": args.model, "architecture": profile.architecture,
                             "total_params": profile.total_params}
        document["settings_chosen"] = chosen
        document["saves"] = {"storage_bytes_per_s": storage, "strategies": [
            vars(save_cost(strategy, hardware, storage_bytes_per_s=storage)) for strategy in memory_plan.strategies]}
        document["activation_terms"] = terms_note
        if shape.lora is not None:
            from fsdp_presets.plan.lora_memory import adapter_params, base_storage_bytes, default_target_modules

            document["lora"] = {**shape.lora.to_json(), "trainable_params": adapter_params(profile, memory_plan.shape),
                                "base_storage_bytes": base_storage_bytes(profile, memory_plan.shape),
                                "targets_resolved": shape.lora.target_modules and list(shape.lora.target_modules)
                                if shape.lora.target_modules and "all-linear" not in shape.lora.target_modules
                                else default_target_modules(profile)}
        print(json.dumps(document, indent=2))
    else:
        print(format_plan(memory_plan, profile, source=args.model))
        if args.mtbf is not None or args.storage_bandwidth is not None:  # the save cost and interval
            print("\n".join(["", *format_save_costs(memory_plan, storage_bytes_per_s=storage, mtbf_hours=args.mtbf,
                                                     step_time_s=args.seconds_per_step)]))
        if chosen:
            print(f"note: {' and '.join(chosen)} turned on (auto): nothing fits without")
        if seq_note:
            print(f"note: {seq_note}")
        print(f"activations: {terms_note['source']}: {terms_note['how']}")
        if args.diagram:
            print(f"diagram: {args.diagram}")
    return 0


# --------------------------------------------------------------------------- human output


def format_plan(memory_plan, profile, *, source: str) -> str:
    """The table, the recommendation and its reason (or the suggestions when nothing fits)."""
    from fsdp_presets.fileio import byte_unit, format_count
    from fsdp_presets.fileio import GiB
    from fsdp_presets.plan.tables import text_table

    hardware, shape = memory_plan.hardware, memory_plan.shape
    nodes = f" on {hardware.nodes} nodes" if hardware.nodes > 1 else ""
    lines = [
        f"{source}: {profile.architecture}, {format_count(profile.total_params)} parameters",
        f"{hardware.gpus} GPUs{nodes} x {hardware.gpu_memory_bytes / GiB:g} GiB "
        f"({hardware.usable_bytes / GiB:.1f} usable), seq {shape.seq_len}, micro-batch {shape.micro_batch}"
        f"{_accumulation_text(shape)}, "
        f"{shape.precision}, {shape.optimizer}, {_method_text(shape)}activation checkpointing "
        f"{'on' if shape.activation_checkpointing else 'off'}, offload {'on' if shape.offload else 'off'}",
        "",
    ]
    # One unit per column family, picked from the largest value so small models stay readable.
    memory_name, memory_unit = byte_unit(max(s.per_gpu.total for s in memory_plan.strategies), binary=True)
    comm_name, comm_unit = byte_unit(max(s.comm.total for s in memory_plan.strategies), binary=False)
    lines.append(f"per GPU in {memory_name}; comm = {comm_name} each GPU sends per step")
    headers = ["strategy", "params", "grads", "optim", "activ", "buffers", "total", "fits", "max mb",
               "comm", "inter-node", "how"]
    rows = []
    for strategy in memory_plan.strategies:
        per_gpu = strategy.per_gpu
        marker = " *" if strategy is memory_plan.recommended else ""
        rows.append([
            strategy.label + marker,
            *(f"{value / memory_unit:.2f}" for value in (per_gpu.params, per_gpu.grads, per_gpu.optimizer,
                                                  per_gpu.activations, per_gpu.buffers, per_gpu.total)),
            "yes" if strategy.fits else "no",
            str(strategy.max_micro_batch),
            f"{strategy.comm.total / comm_unit:.2f}",
            f"{strategy.comm.inter_node / comm_unit:.2f}",
            "composed" if strategy.source == "composed from a rehearsal" else "estimated",
        ])
    lines += text_table(headers, rows, right=set(range(1, len(headers) - 1)))
    notes = sorted({note for strategy in memory_plan.strategies for note in strategy.notes})
    lines += [f"note: {note}" for note in notes]
    lines.append("")
    if memory_plan.recommended is not None:
        lines.append(f"recommended: {memory_plan.recommended.label} (marked *)")
        lines.append(f"reason: {memory_plan.reason}")
    else:
        lines.append("recommended: none")
        lines.append(f"reason: {memory_plan.reason}")
        lines += [f"try: {suggestion}" for suggestion in memory_plan.suggestions]
    return "\n".join(lines)


def _method_text(shape) -> str:
    lora = shape.lora
    if lora is None:
        return ""
    base = "4-bit NF4 base (bf16 storage)" if lora.method == "qlora" else "frozen base"
    targets = "default targets" if lora.target_modules is None else ",".join(lora.target_modules)
    return f"{lora.method} r {lora.r} ({targets}, {base}), "


def _accumulation_text(shape) -> str:
    if shape.grad_accum == 1:
        return ""
    how = "reduced every micro-batch" if shape.reduce_every_micro_batch else "no_sync"
    return f" x {shape.grad_accum} accumulation ({how})"
