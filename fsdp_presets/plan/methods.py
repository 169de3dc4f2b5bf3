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
import re

from fsdp_presets.plan import limits
from fsdp_presets.errors import UsageError
from fsdp_presets.plan.shapes import DEFAULT_LORA_R, METHODS, LoraShape

__all__ = ["add_method_arguments", "lora_from_args"]
_TARGET = re.compile(r"[A-Za-z0-9_.\-]{1,200}")


def add_method_arguments(parser: argparse.ArgumentParser, *, method_help: str | None = None) -> None:
    """``--method`` and the LoRA shape flags. ``--method`` defaults to None, which every command
    reads as ``full`` unless a preset's header says otherwise; ``method_help`` replaces its help."""
    add = parser.add_argument
    add("--method", choices=METHODS, help=method_help or (
        "full fine-tuning (default), lora (an adapter over a frozen bf16 base) or qlora (an adapter over a "
        "4-bit NF4 base stored as bfloat16 so FSDP shards it)"))
    add("--lora-r", type=limits.lora_rank, metavar="R", help=f"LoRA rank (peft's r; default {DEFAULT_LORA_R})")
    add("--lora-alpha", type=limits.lora_alpha, help="LoRA scaling numerator (peft's lora_alpha; default 2 x --lora-r)")
    add("--lora-dropout", type=limits.lora_dropout, help="dropout on the LoRA path (default 0)")
    add("--lora-target-modules", metavar="NAMES", help="comma-separated Linear names to adapt, or all-linear "
        "(default: the attention and MLP projections of the model's block)")
    add("--lora-base-dtype", choices=("bf16", "fp16", "fp32"), help="the frozen base's dtype as loaded "
        "(from_pretrained(dtype=...)); default: the compute dtype for lora, bf16 storage for qlora")


def lora_from_args(args: argparse.Namespace, profile=None):
    """The :class:`~fsdp_presets.plan.planner.LoraShape` the flags ask for, None for ``--method full``.
    LoRA flags without ``--method lora|qlora``, bad values, or target names the model's block does
    not have (``profile`` given) are one :class:`UsageError`."""
    method = getattr(args, "method", None) or "full"
    given = [flag for flag, value in (("--lora-r", args.lora_r), ("--lora-alpha", args.lora_alpha),
                                      ("--lora-dropout", args.lora_dropout),
                                      ("--lora-target-modules", args.lora_target_modules),
                                      ("--lora-base-dtype", getattr(args, "lora_base_dtype", None)))
             if value is not None]
    if method == "full":
        if given:
            raise UsageError(f"{', '.join(given)} given with --method full; add --method lora or --method qlora")
        return None
    from fsdp_presets.plan.lora_memory import default_target_modules, unknown_target_modules

    targets = None
    if args.lora_target_modules is not None:
        targets = tuple(name.strip() for name in args.lora_target_modules.split(",") if name.strip())
        if not targets or any(not _TARGET.fullmatch(name) for name in targets):
            raise UsageError(f"--lora-target-modules {args.lora_target_modules!r}: give Linear names separated by "
                             "commas, such as q_proj,v_proj, or all-linear")
    lora = LoraShape(method=method, r=DEFAULT_LORA_R if args.lora_r is None else args.lora_r, alpha=args.lora_alpha,
                     dropout=0.0 if args.lora_dropout is None else args.lora_dropout, target_modules=targets,
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
