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
:mod:`fsdp_presets.rehearse.rehearsal`. FSDP1 and DDP are not rehearsed (torch's memory tracker follows
FSDP2 only); CPU offload is rehearsed without it and the offloaded states subtracted.

Exit status: 0 when the rehearsed peak fits the GPU memory, 1 when it does not, 2 on bad input.
"""

from __future__ import annotations

import argparse

HELP = "rehearse one FSDP2 training step at full size on the CPU (fake tensors) and compare with the planner"


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
    arguments.add_strategy(parser, default_text="auto: full on one node, hybrid across nodes; only FSDP2 is rehearsed, so not no-shard")
    arguments.add_gpu_memory(parser, default_help=", or the preset's; for the fit verdict and the planner")
    arguments.add_mesh(parser, default_text="1: FSDP alone, through accelerate")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    add_method_arguments(parser, method_help="the training method: only full is rehearsed (a LoRA/QLoRA plan is "
                         "checked against a hand calculation, docs/sharding.md)")
    arguments.add_trust_remote_code(parser)


def run(args: argparse.Namespace) -> int:
    import dataclasses
    import json
    from pathlib import Path

    from fsdp_presets.errors import UsageError
    from fsdp_presets.plan.methods import lora_from_args
    from fsdp_presets.preset.measured_activations import rehearsed_mesh_terms, with_rehearsed_terms
    from fsdp_presets.rehearse.mesh import Mesh
    from fsdp_presets.preset.rehearse_request import (METHOD_NOT_REHEARSED, format_rehearsal, rehearse_request,
                                                      request_from_flags, request_from_preset)

    if (args.method or "full") != "full":
        raise UsageError(METHOD_NOT_REHEARSED.format(method=args.method, where="the command line"))
    lora_from_args(args)  # LoRA flags without --method lora|qlora are refused
    from_preset = args.model.endswith((".yaml", ".yml")) and Path(args.model).is_file()
    if args.model.endswith((".yaml", ".yml")) and not from_preset:
        raise UsageError(f"{args.model}: no such preset file")
    summary = env = None
    if from_preset:
        overriding = [flag for flag, value in (("--gpus", args.gpus), ("--nodes", args.nodes),
                                               ("--micro-batch", args.micro_batch), ("--grad-accum", args.grad_accum),
                                               ("--seq-len", args.seq_len), ("--precision", args.precision),
                                               ("--activation-checkpointing", args.activation_checkpointing),
                                               ("--strategy", args.strategy)) if value is not None]
        request, summary, env = request_from_preset(args.model, overriding=overriding)
        if args.gpu_memory is not None:
            request = dataclasses.replace(request, gpu_memory_gib=args.gpu_memory)
    else:
        request = request_from_flags(args.model, gpus=args.gpus, nodes=args.nodes, micro_batch=args.micro_batch,
                                     grad_accum=args.grad_accum, seq_len=args.seq_len, precision=args.precision,
                                     activation_checkpointing=args.activation_checkpointing, strategy=args.strategy,
                                     gpu_memory_gib=args.gpu_memory)
    mesh = Mesh(tp=args.tp or 1, ep=args.ep or 1)
    if mesh.is_nd and from_preset:
        raise UsageError("--tp/--ep: a preset file fixes its mesh; rehearse the model with the flags instead "
                         "(fsdp-presets rehearse MODEL --gpus N --tp N)")
    if from_preset:
        mesh = request.mesh  # a preset of `generate --tp/--ep` is rehearsed on its mesh
    if mesh.is_nd and request.strategy not in ("full", "hybrid", "auto"):
        raise UsageError(f"--strategy {request.strategy}: a TP/EP mesh is rehearsed with full or hybrid sharding")
    def mesh_terms(shape):
        """The planner's activation terms for the mesh: rehearsed on it (cached), else estimated."""
        shape, _ = with_rehearsed_terms(args.model, shape, trust_remote_code=args.trust_remote_code)
        measured, _ = rehearsed_mesh_terms(args.model, shape, (mesh,), trust_remote_code=args.trust_remote_code)
        return shape.replace(measured_on_mesh=measured)

    document, result, row = rehearse_request(request, source=args.model, preset_file=from_preset, summary=summary,
                                             env=env, grad_accum=args.grad_accum,
                                             trust_remote_code=args.trust_remote_code, mesh=mesh,
                                             mesh_terms=mesh_terms if mesh.is_nd else None)
    if args.json:
        print(json.dumps(document, indent=2))
    else:
        print(format_rehearsal(document, result, row))
    return 0 if document["fits"] else 1
