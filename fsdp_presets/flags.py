"""The flags of one training request, each spelled once: the ``fsdp-presets`` commands
(:mod:`fsdp_presets.arguments`, :mod:`fsdp_presets.plan.methods`), the recipes' parser
(:mod:`fsdp_presets.train.loop`, :mod:`fsdp_presets.train.lora`), the launch lines generated presets
print (:mod:`fsdp_presets.preset.emit_commands`) and the convergence check's launches
(:mod:`fsdp_presets.compare.converge`) take the names from here.

    flags.add(parser, flags.MICRO_BATCH, type=limits.micro_batch, default=2)   # --micro-batch
    [flags.MICRO_BATCH.name, "2"]                                               # a launch line's words

A spelling users typed before a setting had one name (the recipes' ``--micro-batch-size``,
``--gradient-accumulation-steps``, ``--load-in-4bit``) is still accepted, with a one-line note on
stderr that names the new one. The checks of the numbers are the domain's
(:mod:`fsdp_presets.plan.limits`, which words its refusals with these names); the defaults that
every front end shares are here. tests/test_flags.py parses every shipped preset's launch line with
the recipes' parser and fails when a spelling drifts. Standard library only (``fsdp-presets
--help`` stays instant).
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass

from fsdp_presets.errors import UsageError, note


@dataclass(frozen=True, kw_only=True)
class Flag:
    """One setting of a training request on the command line."""

    name: str
    """Its one spelling, ``--micro-batch``."""
    help: str
    """What it sets; a front end may add what its default is."""
    old_names: tuple[str, ...] = ()
    """Spellings accepted from before, each with a note on stderr that names :attr:`name`."""

    @property
    def dest(self) -> str:
        """The attribute argparse stores it in, ``micro_batch``."""
        return self.name.removeprefix("--").replace("-", "_")


# ---- the settings ----
METHODS: tuple[str, ...] = ("full", "lora", "qlora")
"""``--method``: full fine-tuning, LoRA, or QLoRA (LoRA over a 4-bit base)."""
DEFAULT_LORA_R = 16
"""peft's and trl's usual rank for (Q)LoRA recipes: ``--lora-r`` when ``--method lora|qlora`` gives none."""
DEFAULT_LORA_DROPOUT = 0.0
"""``--lora-dropout`` when not given (peft's default is 0.0 too)."""
DEFAULT_GRAD_ACCUM = 1
"""``--grad-accum`` when not given: one micro-batch per optimizer step."""

MODEL = Flag(name="--model", help="local model folder (config.json, weights, tokenizer)")
DATA = Flag(name="--data", help="training data: JSONL/JSON, CSV, Parquet or plain text")
OUTPUT_DIR = Flag(name="--output-dir", help="run folder: metrics.jsonl, checkpoints/, final/, plots/")
MAX_STEPS = Flag(name="--max-steps", help="optimizer steps to train in total")
SEED = Flag(name="--seed", help="seed of initialisation, data order and dropout")
LEARNING_RATE = Flag(name="--learning-rate", help="peak learning rate (AdamW)")
RESUME = Flag(name="--resume", help="auto (latest valid checkpoint in --output-dir, if any), PATH (a "
              "checkpoints/step-NNNNNNNN folder) or none")
SAVE_EVERY = Flag(name="--save-every", help="checkpoint every N steps (0: only at the end)")
ASYNC_SAVE = Flag(name="--async-save", help="write checkpoints in the background (FSDP2, sharded): training "
                  "waits only while this rank's shards are copied to host memory")
SEQ_LEN = Flag(name="--seq-len", help="tokens per sequence")
MICRO_BATCH = Flag(name="--micro-batch", help="sequences per GPU per step", old_names=("--micro-batch-size",))
GRAD_ACCUM = Flag(name="--grad-accum", help="micro-batches accumulated per optimizer step",
                  old_names=("--gradient-accumulation-steps",))
REDUCE_EVERY_MICRO_BATCH = Flag(
    name="--reduce-every-micro-batch", help="reduce gradients after every micro-batch instead of accumulating them "
    "unsharded under no_sync (FSDP then never holds a whole model's unsharded gradients; more communication)")
METHOD = Flag(name="--method", help="full fine-tuning (default), lora (an adapter over a frozen bf16 base) or qlora "
              "(an adapter over a 4-bit NF4 base stored as bfloat16 so FSDP shards it)")
LOAD_IN_4BIT = "--load-in-4bit"
"""The recipes' spelling of ``--method qlora`` before the recipes had ``--method``: still accepted."""
LORA_R = Flag(name="--lora-r", help=f"LoRA rank (peft's r; default {DEFAULT_LORA_R})")
LORA_ALPHA = Flag(name="--lora-alpha", help="LoRA scaling numerator (peft's lora_alpha; default 2 x --lora-r)")
LORA_DROPOUT = Flag(name="--lora-dropout", help="dropout on the LoRA path (default 0)")
LORA_TARGET_MODULES = Flag(name="--lora-target-modules", help="comma-separated Linear names to adapt, or all-linear "
                           "(default: the attention and MLP projections of the model's block)")

TP = Flag(name="--tp", help="tensor-parallel ranks inside a node (FSDP2 x TP through transformers' DistributedConfig)")
EP = Flag(name="--ep", help="expert-parallel ranks for a mixture-of-experts model")
DISTRIBUTED_CONFIG = Flag(name="--distributed-config",
                          help="NAME.distributed.json (from fsdp-presets generate --tp N / --ep N): transformers shards "
                          "the model over that FSDP2 x TP or x EP mesh at load time")

TRAINING = (MODEL, DATA, OUTPUT_DIR, MAX_STEPS, SEED, LEARNING_RATE, RESUME, SAVE_EVERY, ASYNC_SAVE, SEQ_LEN,
            MICRO_BATCH, GRAD_ACCUM, REDUCE_EVERY_MICRO_BATCH, METHOD, LORA_R, LORA_ALPHA, LORA_DROPOUT,
            LORA_TARGET_MODULES, DISTRIBUTED_CONFIG)
"""Every setting above: the recipes' parser has each of them."""
SHARED = (SEQ_LEN, MICRO_BATCH, GRAD_ACCUM, METHOD, LORA_R, LORA_ALPHA, LORA_DROPOUT, LORA_TARGET_MODULES)
"""The settings both ``fsdp-presets plan|generate`` and the recipes take (tests/test_flags.py)."""

_TARGET_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,200}")


def target_modules(text: str) -> tuple[str, ...]:
    """``--lora-target-modules``: the comma-separated module names (or ``all-linear``), each of
    letters, digits, ``_``, ``.`` and ``-`` (at most 200); :class:`UsageError` for anything else."""
    names = tuple(name.strip() for name in str(text).split(",") if name.strip())
    if not names or any(not _TARGET_NAME.fullmatch(name) for name in names):
        raise UsageError(f"{LORA_TARGET_MODULES.name} {text!r}: give Linear names separated by commas, such as "
                         "q_proj,v_proj, or all-linear")
    return names


# ---- adding them to a parser ----
def note_old_spelling(old: str, new: str) -> None:
    """One line on stderr (from the first process of a launch only) that ``old`` is now ``new``."""
    note(f"{old} is now spelled {new}; the old spelling still works", stream=sys.stderr)


class _Store(argparse._StoreAction):
    """argparse's ``store``, with a note when an old spelling was typed. NOTE: argparse tells only
    an action which of its option strings was typed, hence a subclass of its own action."""

    new_name = ""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string is not None and option_string != self.new_name:
            note_old_spelling(option_string, self.new_name)
        super().__call__(parser, namespace, values, option_string)


class _MethodQlora(argparse.Action):
    """``--load-in-4bit``: ``--method qlora``, with its note."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        given = getattr(namespace, self.dest, None)
        if given not in (None, "qlora"):
            parser.error(f"{option_string} ({METHOD.name} qlora) given with {METHOD.name} {given}")
        note_old_spelling(option_string, f"{METHOD.name} qlora")
        setattr(namespace, self.dest, "qlora")


def add(parser: argparse.ArgumentParser, flag: Flag, *, help_suffix: str = "", **kwargs) -> argparse.Action:
    """Add ``flag`` to ``parser`` under its one spelling and its old ones (``kwargs`` as
    ``add_argument``'s: ``type``, ``default``, ``choices``, ``action="store_true"``...); its help
    is :attr:`Flag.help` plus ``help_suffix`` unless ``kwargs`` gives one."""
    kwargs.setdefault("help", flag.help + help_suffix)
    if flag.old_names:  # a flag that takes a value (the only kind renamed so far)
        kwargs["action"] = type("_Store", (_Store,), {"new_name": flag.name})
    return parser.add_argument(flag.name, *flag.old_names, dest=flag.dest, **kwargs)


def add_load_in_4bit(parser: argparse.ArgumentParser) -> None:
    """The recipes' ``--load-in-4bit``, now ``--method qlora``."""
    parser.add_argument(LOAD_IN_4BIT, dest=METHOD.dest, action=_MethodQlora,
                        help=f"the earlier spelling of {METHOD.name} qlora")
