"""The training-method flags ``plan``, ``generate``, ``check`` and ``rehearse`` share, defined once:
``--method full|lora|qlora`` and the LoRA shape with the names peft and trl use.

    add_method_arguments(parser)                      # in a command's add_arguments
    lora = lora_from_args(args, profile)              # LoraShape, or None for full fine-tuning

Standard library at import (``fsdp-presets --help`` stays instant). The names and defaults agree
with the recipes' flags (:mod:`fsdp_presets.train.lora`): rank 16, alpha 2 x r, dropout 0, every Linear
of the decoder block, and for QLoRA bitsandbytes nf4 stored as bfloat16.
"""

from __future__ import annotations

import argparse

from fsdp_presets import flags
from fsdp_presets.plan import limits
from fsdp_presets.errors import UsageError
from fsdp_presets.flags import DEFAULT_LORA_DROPOUT, DEFAULT_LORA_R, METHODS
from fsdp_presets.plan.shapes import LoraShape

__all__ = ["add_method_arguments", "lora_from_args"]


def add_method_arguments(parser: argparse.ArgumentParser, *, method_help: str | None = None) -> None:
    """``--method`` and the LoRA shape flags. ``--method`` defaults to None, which every command
    reads as ``full`` unless a preset's header says otherwise; ``method_help`` replaces its help."""
    flags.add(parser, flags.METHOD, choices=METHODS, **({"help": method_help} if method_help else {}))
    flags.add(parser, flags.LORA_R, type=limits.lora_rank, metavar="R")
    flags.add(parser, flags.LORA_ALPHA, type=limits.lora_alpha)
    flags.add(parser, flags.LORA_DROPOUT, type=limits.lora_dropout)
    flags.add(parser, flags.LORA_TARGET_MODULES, metavar="NAMES")
    parser.add_argument("--lora-base-dtype", choices=("bf16", "fp16", "fp32"), help="the frozen base's dtype as loaded "
        "(from_pretrained(dtype=...)); default: the compute dtype for lora, bf16 storage for qlora")


def lora_from_args(args: argparse.Namespace, profile=None):
    """The :class:`~fsdp_presets.plan.shapes.LoraShape` the flags ask for, None for ``--method full``.
    LoRA flags without ``--method lora|qlora``, bad values, or target names the model's block does
    not have (``profile`` given) are one :class:`UsageError`."""
    method = getattr(args, "method", None) or "full"
    lora_flags = (flags.LORA_R, flags.LORA_ALPHA, flags.LORA_DROPOUT, flags.LORA_TARGET_MODULES)
    given = [flag.name for flag in lora_flags if getattr(args, flag.dest) is not None]
    given += ["--lora-base-dtype"] if getattr(args, "lora_base_dtype", None) is not None else []
    if method == "full":
        if given:
            raise UsageError(f"{', '.join(given)} given with --method full; add --method lora or --method qlora")
        return None
    from fsdp_presets.plan.lora_memory import default_target_modules, unknown_target_modules

    targets = None
    if args.lora_target_modules is not None:
        targets = flags.target_modules(args.lora_target_modules)
    lora = LoraShape(method=method, r=DEFAULT_LORA_R if args.lora_r is None else args.lora_r, alpha=args.lora_alpha,
                     dropout=DEFAULT_LORA_DROPOUT if args.lora_dropout is None else args.lora_dropout, target_modules=targets,
                     base_dtype=getattr(args, "lora_base_dtype", None))
    if profile is not None:
        unknown = unknown_target_modules(profile, lora)
        if unknown:
            known = default_target_modules(profile)
            raise UsageError(f"--lora-target-modules: {', '.join(unknown)} not in {profile.architecture}'s block; "
                             f"its Linear layers are {','.join(known) or 'none'} (or give all-linear)")
        if not default_target_modules(profile):
            raise UsageError(f"{profile.architecture}'s blocks hold no nn.Linear layer for LoRA to adapt")
    return lora
