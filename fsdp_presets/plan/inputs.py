"""The planner's inputs from ``fsdp-presets plan``'s flags: every flag checked before the model is
read, every problem reported at once (one :class:`UsageError`), and the defaults a plan takes
when a flag is not given::

    inputs = plan_inputs(args)        # Hardware, TrainingShape, the saver choices, save-cost figures

Standard library and the plan stage only (``limits``, ``shapes``, ``methods``, ``save_cost``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from fsdp_presets.errors import UsageError
from fsdp_presets.fileio import GiB
from fsdp_presets.plan import limits
from fsdp_presets.plan.methods import lora_from_args
from fsdp_presets.plan.gpus import DEFAULT_GPU, GpuType, gpu_type, memory_of
from fsdp_presets.plan.save_cost import DEFAULT_STORAGE_GB_PER_S, save_input_problems
from fsdp_presets.plan.shapes import Hardware, TrainingShape
from fsdp_presets.rehearse.mesh import Mesh

__all__ = ["DIAGRAM_SUFFIXES", "PlanInputs", "plan_inputs"]

DIAGRAM_SUFFIXES = (".png", ".svg", ".pdf")


@dataclass(frozen=True, kw_only=True)
class PlanInputs:
    hardware: Hardware
    """The GPUs, nodes and memory per GPU the plan is for."""
    shape: TrainingShape
    """The step as asked for: sequence length, batch, precision, optimizer, savers (the sequence
    length is fitted to the model and the LoRA shape added once the model is read)."""
    checkpointing: str
    """``on``, ``off`` or ``auto`` (with --method lora|qlora: on only when nothing fits without it)."""
    offload: str
    """``on``, ``off`` or ``auto``, as ``checkpointing``."""
    storage_bytes_per_s: float
    """Checkpoint write bandwidth per node (--storage-bandwidth, else the assumed default)."""
    hardwares: tuple[Hardware, ...] = ()
    """One per ``--gpus`` count (a scaling table when several); ``hardware`` is the first."""
    gpu_named: bool = False
    """Whether ``--gpu`` named the GPU type (else the step times are for :data:`DEFAULT_GPU`)."""


def plan_inputs(args: argparse.Namespace) -> PlanInputs:
    """The checked inputs of ``plan``'s parsed flags; raises one :class:`UsageError` naming every
    problem. Nothing is read from disk."""
    problems = []
    if args.diagram and Path(args.diagram).suffix.lower() not in DIAGRAM_SUFFIXES:
        problems.append(f"--diagram {args.diagram}: give a .png (or .svg/.pdf) file name")
    hardware = shape = None
    saver_default = "auto" if args.method in ("lora", "qlora") else "off"
    checkpointing = args.activation_checkpointing or saver_default
    offload = args.offload or saver_default
    try:
        lora_from_args(args)  # the flags alone; target names are checked against the model later
    except UsageError as error:
        problems.append(str(error))
    if getattr(args, "tp", None) or getattr(args, "ep", None):
        problems += Mesh.setting_problems(method=args.method or "full", precision=args.precision)
    gpu: GpuType | None = None
    cpu = getattr(args, "device", None) == "cpu"
    counts = args.gpus if isinstance(args.gpus, tuple) else (args.gpus,)
    if cpu:
        given = [flag for flag, value in (("--gpu", args.gpu), ("--inter-node-gbps", args.inter_node_gbps),
                                          ("--gpu-memory", args.gpu_memory)) if value]
        if given or (args.nodes or 1) > 1 or len(counts) > 1:
            problems.append(f"--device cpu plans processes on this host, timed by measuring it: drop "
                            f"{', '.join(given + (['--nodes'] if (args.nodes or 1) > 1 else []) + (['the extra --gpus counts'] if len(counts) > 1 else []))}"
                            " (--host-memory gives the RAM they share)")
    try:
        gpu = gpu_type(args.gpu or DEFAULT_GPU)
    except UsageError as error:
        problems.append(str(error))
    if len(counts) > 1 and args.nodes:
        problems.append(f"--nodes {args.nodes} with several --gpus counts: the scaling table puts "
                        f"{limits.GPUS_PER_SERVER} GPUs on a node; give --nodes with one count")
    if len(counts) > 1:
        uneven = [count for count in counts if count > limits.GPUS_PER_SERVER and count % limits.GPUS_PER_SERVER]
        if uneven:
            problems.append(f"--gpus {','.join(map(str, uneven))}: above {limits.GPUS_PER_SERVER} a scaling "
                            f"table counts whole nodes of {limits.GPUS_PER_SERVER} (e.g. --gpus 8,16,32,64)")
    memory_gib = memory_of(args.gpu_memory, args.gpu if gpu is not None else None)
    hardwares = []
    if gpu is not None and not problems:
        try:
            for count in counts:
                nodes = args.nodes or (count // limits.GPUS_PER_SERVER
                                       if len(counts) > 1 and count > limits.GPUS_PER_SERVER else 1)
                hardwares.append(Hardware(gpus=count, nodes=nodes, gpu_memory_bytes=int(memory_gib * GiB), gpu=gpu,
                                          inter_node_gbps=args.inter_node_gbps))
        except UsageError as error:
            problems.append(str(error))
    hardware = hardwares[0] if hardwares else None
    try:
        shape = TrainingShape(
            seq_len=args.seq_len or limits.DEFAULT_SEQ_LEN,
            micro_batch=args.micro_batch or 1,
            grad_accum=args.grad_accum or 1,
            reduce_every_micro_batch=args.reduce_every_micro_batch,
            # auto: bf16 on GPUs, fp32 on a CPU host (what generate --device cpu writes)
            precision=("fp32" if cpu else "bf16") if args.precision in (None, "auto") else args.precision,
            optimizer=args.optimizer,
            activation_checkpointing=checkpointing == "on",
            offload=offload == "on",
            attention=args.attention,
        )
    except UsageError as error:
        problems.append(str(error))
    problems += save_input_problems(storage_gb_per_s=args.storage_bandwidth, mtbf_hours=args.mtbf,
                                    step_time_s=args.seconds_per_step)
    if problems:
        raise UsageError("; ".join(problems))
    return PlanInputs(hardware=hardware, shape=shape, checkpointing=checkpointing, offload=offload,
                      storage_bytes_per_s=(args.storage_bandwidth or DEFAULT_STORAGE_GB_PER_S) * 1e9,
                      hardwares=tuple(hardwares), gpu_named=bool(args.gpu))
