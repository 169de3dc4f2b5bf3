"""The flags the commands share, each defined in one place: one spelling, one default, one
validation, so that ``--gpus``, ``--gpu-memory`` or ``--precision`` mean and refuse the same thing
in ``plan``, ``generate``, ``rehearse``, ``check`` and ``launcher``.

    arguments.add_gpus(parser, required=True)          # in a command's add_arguments
    arguments.add_gpu_memory(parser)

The ``add_*`` functions add a shared flag with its type, choices and default; a command may only
add to the help what the default means for it (``default_help``, ``default_text``). The types,
defaults, bounds and choices are the domain's (:mod:`fsdp_presets.plan.limits`), where the
requests and shapes the flags become check the same values. Where a default depends on something
a command reads later (a preset's header, the device), the flag's default is None and the command
fills in the value (``DEFAULT_SEQ_LEN``, ``DEFAULT_GPU_MEMORY_GIB``). The training-method flags
(``--method``, ``--lora-*``) are defined the same way in :mod:`fsdp_presets.plan.methods`, the
launch-script flags in :mod:`fsdp_presets.launching.options`. The settings a training run shares
with the recipes are spelled by :mod:`fsdp_presets.flags`. tests/test_arguments.py parses
every command's parser and fails when a shared flag drifts.

A bad value raises :class:`~fsdp_presets.errors.UsageError`, which argparse does not catch:
``fsdp_presets.cli.main`` prints it as the command's one-line error and exits with status 2,
before any model is read. Standard library and the limits only (``fsdp-presets --help`` stays
instant).
"""

from __future__ import annotations

import argparse

from fsdp_presets import flags
from fsdp_presets.plan.limits import (DEFAULT_GPU_MEMORY_GIB, DEFAULT_SEQ_LEN, DEVICES, PRECISION_CHOICES,
                                      STRATEGY_CHOICES, SWITCH_CHOICES, activation_checkpointing, device,
                                      gpu_count, gpu_memory_gib, grad_accum, host_memory_gib, micro_batch, node_count,
                                      offload, precision, seq_len, strategy, tp_size, ep_size)


# --------------------------------------------------------------------------- the shared flags


def add_model(parser: argparse.ArgumentParser, *, optional: bool = False, metavar: str = "MODEL",
              extra_help: str = "") -> None:
    """The positional MODEL: a registry family, a local model folder or a config.json path."""
    parser.add_argument("model", metavar=metavar, nargs="?" if optional else None,
                        help="a family name (see `fsdp-presets inspect --list`), a local model folder, or a "
                        "config.json path" + extra_help)


def add_gpus(parser: argparse.ArgumentParser, *, required: bool = False, help_text: str = "GPUs in the whole job",
             metavar: str | None = None) -> None:
    """``--gpus``: GPUs (processes) of the whole job."""
    parser.add_argument("--gpus", type=gpu_count, required=required, metavar=metavar, help=help_text)


def add_nodes(parser: argparse.ArgumentParser) -> None:
    """``--nodes``: machines the GPUs are spread over (None: 1, or what a preset says)."""
    parser.add_argument("--nodes", type=node_count, help="machines the GPUs are spread over, the same number "
                        "on each (default 1)")


def add_gpu_memory(parser: argparse.ArgumentParser, *, default_help: str = "") -> None:
    """``--gpu-memory``: GiB of one GPU (None: :data:`DEFAULT_GPU_MEMORY_GIB`, or a preset's)."""
    parser.add_argument("--gpu-memory", type=gpu_memory_gib, metavar="GiB", help="memory of one GPU in GiB "
                        f"(default {DEFAULT_GPU_MEMORY_GIB:g}{default_help})")


def add_gpu(parser: argparse.ArgumentParser, *, default_help: str) -> None:
    """``--gpu NAME``: the GPU type (:data:`~fsdp_presets.plan.gpus.GPU_NAMES`) step times are
    predicted on and, without ``--gpu-memory``, its memory (None: ``default_help``)."""
    from fsdp_presets.plan.gpus import GPU_NAMES

    parser.add_argument("--gpu", metavar="NAME", help=f"GPU type for step times and memory: {', '.join(GPU_NAMES)} "
                        f"(case-insensitive; {default_help})")


def add_inter_node_gbps(parser: argparse.ArgumentParser, *, extra_help: str = "") -> None:
    """``--inter-node-gbps``: one GPU's network to other nodes (None: the GPU type's usual cluster)."""
    from fsdp_presets.plan.limits import inter_node_gbps

    parser.add_argument("--inter-node-gbps", type=inter_node_gbps, metavar="Gb/s",
                        help="one GPU's network to other nodes in Gb/s (default: the GPU type's usual cluster, "
                        f"e.g. 400 for H100-SXM: one 400 Gb/s adapter per GPU{extra_help})")


def add_host_memory(parser: argparse.ArgumentParser, *, default_help: str = "") -> None:
    """``--host-memory``: GiB of host RAM of one node (None: the command's default)."""
    parser.add_argument("--host-memory", type=host_memory_gib, metavar="GiB",
                        help="host RAM of one node in GiB (default 1024: 8-GPU nodes carry 1-2 TiB" + default_help + ")")


def add_precision(parser: argparse.ArgumentParser, *, default_help: str = "") -> None:
    """``--precision``: one of :data:`PRECISION_CHOICES` (None: auto)."""
    parser.add_argument("--precision", type=precision, metavar="|".join(PRECISION_CHOICES), help="mixed precision, accelerate's "
                        "mixed_precision (default auto: bf16 on GPUs" + default_help + ")")


def add_seq_len(parser: argparse.ArgumentParser, *, default_help: str = "") -> None:
    """``--seq-len``: tokens per sequence (None: :data:`DEFAULT_SEQ_LEN`, or a preset's)."""
    flags.add(parser, flags.SEQ_LEN, type=seq_len, help_suffix=f" (default {DEFAULT_SEQ_LEN}, capped by the model's "
              "positions" + default_help + ")")


def add_micro_batch(parser: argparse.ArgumentParser, *, default_help: str = "1") -> None:
    """``--micro-batch``: sequences per GPU per forward/backward (None: the command's default); the
    recipes' ``--micro-batch-size`` still parses, with a note."""
    flags.add(parser, flags.MICRO_BATCH, type=micro_batch, help_suffix=f" (default {default_help})")


def add_grad_accum(parser: argparse.ArgumentParser, *, extra_help: str = "") -> None:
    """``--grad-accum``: micro-batches per optimizer step (None: 1)."""
    flags.add(parser, flags.GRAD_ACCUM, type=grad_accum,
              help_suffix=f" (default {flags.DEFAULT_GRAD_ACCUM})" + extra_help)


def add_savers(parser: argparse.ArgumentParser, *, with_offload: bool = True,
               default_text: str = "auto: only when needed to fit, activation checkpointing first") -> None:
    """``--activation-checkpointing`` and ``--offload``: one of :data:`SWITCH_CHOICES` (None: the
    command's default, which ``default_text`` says)."""
    parser.add_argument("--activation-checkpointing", type=activation_checkpointing, metavar="|".join(SWITCH_CHOICES), help="recompute block "
                        f"activations in backward (default {default_text})")
    if with_offload:
        parser.add_argument("--offload", type=offload, metavar="|".join(SWITCH_CHOICES), help="FSDP CPU offload of parameters, "
                            f"gradients and optimizer state (default {default_text})")


def add_strategy(parser: argparse.ArgumentParser, *,
                 default_text: str = "auto: on GPUs the fastest that fits by predicted step time; with --device cpu "
                                     "FULL_SHARD (SHARD_GRAD_OP on 2 processes), HYBRID_SHARD across nodes, when it "
                                     "fits") -> None:
    """``--strategy``: one of :data:`STRATEGY_CHOICES` (None: auto, which ``default_text`` says)."""
    parser.add_argument("--strategy", type=strategy, metavar="|".join(STRATEGY_CHOICES), help="sharding: full "
                        "(FULL_SHARD), grad-op (SHARD_GRAD_OP), hybrid (HSDP) or no-shard (FSDP1 only) "
                        f"(default {default_text})")


def add_device(parser: argparse.ArgumentParser, *, default_help: str = "") -> None:
    """``--device``: gpu or cpu (None: gpu, or a preset's)."""
    parser.add_argument("--device", type=device, metavar="|".join(DEVICES), help="gpu (default" + default_help + ") or cpu: a CPU-only "
                        "host (demos, CI; fp32, no offload)")


def add_tolerance(parser: argparse.ArgumentParser) -> None:
    """``--tolerance``: how far two runs may drift apart ('auto' or a relative tolerance, checked by
    :func:`fsdp_presets.compare.tolerance.parse_tolerance`)."""
    parser.add_argument("--tolerance", default="auto", metavar="auto|REL",
                        help="largest relative deviation |a-b|/max(|a|,|b|) accepted for loss and "
                        "grad_norm; 'auto' (default) follows the runs' precision: fp32 1e-6, bf16 "
                        "calibrated (docs/convergence.md)")


def add_mesh(parser: argparse.ArgumentParser, *, default_text: str) -> None:
    """``--tp`` and ``--ep``: a second dimension beside FSDP (None: ``default_text``)."""
    flags.add(parser, flags.TP, type=tp_size, metavar="N", help_suffix=f" (default {default_text})")
    flags.add(parser, flags.EP, type=ep_size, metavar="N", help_suffix=f" (default {default_text})")


def add_trust_remote_code(parser: argparse.ArgumentParser) -> None:
    """``--trust-remote-code``: off unless given."""
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow a config that names its own Python code (auto_map) to run that code")
