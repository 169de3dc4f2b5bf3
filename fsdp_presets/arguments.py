"""The flags the commands share, each defined in one place: one spelling, one default, one
validation, so that ``--gpus``, ``--gpu-memory`` or ``--precision`` mean and refuse the same thing
in ``plan``, ``generate``, ``rehearse``, ``check`` and ``launcher``.

    arguments.add_gpus(parser, required=True)          # in a command's add_arguments
    arguments.add_gpu_memory(parser)
    parser.add_argument("--port", type=arguments.tcp_port, ...)   # a number one command has

The ``add_*`` functions add a shared flag with its type, choices and default; a command may only
add to the help what the default means for it (``default_help``, ``default_text``). Where a default depends on
something a command reads later (a preset's header, the device), the flag's default is None and
the command fills in the value below (:data:`DEFAULT_SEQ_LEN`, :data:`DEFAULT_GPU_MEMORY_GIB`).
The training-method flags (``--method``, ``--lora-*``) are defined the same way in
:mod:`fsdp_presets.plan.methods`. tests/test_arguments.py parses every command's parser and fails
when a shared flag drifts.

A bad value raises :class:`~fsdp_presets.errors.UsageError`, which argparse does not catch:
``fsdp_presets.cli.main`` prints it as the command's one-line error and exits with status 2,
before any model is read. The bounds are far above anything real and far below what breaks the
arithmetic (``--gpu-memory 1e308`` is infinite bytes): a value past one is a typo, and the
message says what a real value looks like. Standard library only (``fsdp-presets --help`` stays
instant).
"""

from __future__ import annotations

import argparse
import math

from fsdp_presets.errors import UsageError, unknown_name_message

DEFAULT_SEQ_LEN = 2048
"""Tokens per sequence that ``plan``, ``generate``, ``rehearse`` and ``check`` plan for when
``--seq-len`` is not given (capped by the model's positions)."""
RECIPE_SEQ_LEN = 128
"""Tokens per sample the recipes train on when ``--seq-len`` is not given: the CPU demo's length
(accelerate_configs/cpu_fsdp2_demo.yaml is planned for it)."""
DEFAULT_GPU_MEMORY_GIB = 80.0
"""Memory of one GPU when ``--gpu-memory`` is not given: A100 80GB / H100 SXM, the common training GPU."""
PRECISIONS: tuple[str, ...] = ("bf16", "fp16", "fp32")
"""Accelerate's ``mixed_precision`` values: bf16/fp16 compute with fp32 master weights, or fp32."""
PRECISION_CHOICES: tuple[str, ...] = ("auto",) + PRECISIONS
"""``--precision``: ``auto`` is bf16 on GPUs (fp32 on a CPU host for ``generate --device cpu``)."""
SWITCH_CHOICES: tuple[str, ...] = ("auto", "on", "off")
"""``--activation-checkpointing`` and ``--offload``: ``auto`` turns a saver on only when needed to fit."""
STRATEGY_CHOICES: tuple[str, ...] = ("auto", "full", "grad-op", "hybrid", "no-shard")
"""``--strategy``: FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD (HSDP, several nodes), NO_SHARD (FSDP1)."""
DEVICES: tuple[str, ...] = ("gpu", "cpu")
"""``--device``: GPUs, or a CPU-only host (demos, CI) where FSDP runs over gloo."""

MAX_GPUS = 2**20
"""GPUs (processes) in one job: the largest training clusters hold about 10^5 GPUs."""
MAX_NODES = MAX_GPUS
"""Machines in one job (at least one GPU each)."""
MAX_GPU_MEMORY_GIB = 4096.0
"""Memory of one GPU: the largest today hold 288 GB (NVIDIA B300); 4 TiB leaves room."""
MAX_HOST_MEMORY_GIB = 65536.0
"""Host RAM of one node: the largest single servers hold 32 TiB; 64 TiB leaves room."""
MAX_SEQ_LEN = 2**24
"""Tokens per sequence: 16M, beyond the longest contexts models are trained on (about 10M)."""
MAX_MICRO_BATCH = 2**16
"""Sequences per GPU per forward pass."""
MAX_GRAD_ACCUM = 2**16
"""Micro-batches per optimizer step."""
MAX_GLOBAL_BATCH = {"samples": 2**24, "tokens": 2**36}
"""Per optimizer step (``--global-batch``): 16M sequences or 64G tokens; the largest published runs
use about 60M tokens (Llama 3 405B: 16M tokens)."""
MAX_JOIN_TIMEOUT_S = 7 * 24 * 3600
"""Seconds the first node waits for the others: a week."""
MAX_CPUS_PER_TASK = 2**16
"""SLURM CPUs for one node's task."""
MAX_LORA_R = 2**16
"""LoRA rank: far above any adapter (peft's default is 8)."""


def _whole(text: str, *, flag: str, low: int, high: int, example: str) -> int:
    try:
        value = int(str(text).strip(), 10)
    except ValueError:
        raise UsageError(f"{flag} must be a whole number, got {text!r} (e.g. {flag} {example})") from None
    if value < low:
        raise UsageError(f"{flag} must be at least {low}, got {value} (e.g. {flag} {example})")
    if value > high:
        raise UsageError(f"{flag} must be at most {high}, got {value}: more than any real job (e.g. {flag} {example})")
    return value


def _amount(text: str, *, flag: str, high: float, what: str, example: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= high):
        raise UsageError(f"{flag} must be a number of {what} more than 0 and at most {high:g}, got {text!r} "
                         f"(e.g. {flag} {example})")
    return value


def _count(flag: str, *, high: float, example: str, doc: str, gib: bool = False):
    """An argparse ``type=`` for a whole number from 1 to ``high`` (``gib``: GiB more than 0 and at
    most ``high``), refused in one line that names the flag and gives an example."""

    def check(text: str):
        if gib:
            return _amount(text, flag=flag, high=high, what="GiB", example=example)
        return _whole(text, flag=flag, low=1, high=int(high), example=example)

    check.__name__, check.__doc__ = flag.lstrip("-").replace("-", "_"), doc
    return check


gpu_count = _count("--gpus", high=MAX_GPUS, example="8",
                   doc="``--gpus``: GPUs (processes) in the whole job, 1 .. :data:`MAX_GPUS`.")
gpus_per_node = _count("--gpus", high=MAX_GPUS, example="8", doc="``launcher --gpus``: GPUs (processes) per machine.")
node_count = _count("--nodes", high=MAX_NODES, example="2",
                    doc="``--nodes``: machines in the job, 1 .. :data:`MAX_NODES`.")
gpu_memory_gib = _count("--gpu-memory", high=MAX_GPU_MEMORY_GIB, example="80", gib=True,
                      doc="``--gpu-memory``: GiB of one GPU, (0, :data:`MAX_GPU_MEMORY_GIB`].")
host_memory_gib = _count("--host-memory", high=MAX_HOST_MEMORY_GIB, example="1024", gib=True,
                       doc="``--host-memory``: GiB of host RAM of one node, (0, :data:`MAX_HOST_MEMORY_GIB`].")
seq_len = _count("--seq-len", high=MAX_SEQ_LEN, example="4096",
                 doc="``--seq-len``: tokens per sequence, 1 .. :data:`MAX_SEQ_LEN`.")
micro_batch = _count("--micro-batch", high=MAX_MICRO_BATCH, example="2",
                     doc="``--micro-batch``: sequences per GPU per step, 1 .. :data:`MAX_MICRO_BATCH`.")
grad_accum = _count("--grad-accum", high=MAX_GRAD_ACCUM, example="4",
                    doc="``--grad-accum``: micro-batches per optimizer step, 1 .. :data:`MAX_GRAD_ACCUM`.")
lora_rank = _count("--lora-r", high=MAX_LORA_R, example="16",
                   doc="``--lora-r``: the adapter's rank, 1 .. :data:`MAX_LORA_R`.")
tcp_port = _count("--port", high=65535, example="29500", doc="``--port``: a TCP port.")
join_timeout_s = _count("--join-timeout", high=MAX_JOIN_TIMEOUT_S, example="600",
                        doc="``--join-timeout``: seconds, 1 .. :data:`MAX_JOIN_TIMEOUT_S`.")
cpus_per_task = _count("--cpus-per-task", high=MAX_CPUS_PER_TASK, example="32",
                       doc="``--cpus-per-task``: SLURM CPUs for one node's task.")


def _real(text: str, *, flag: str, accepts, rule: str, example: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and accepts(value)):
        raise UsageError(f"{flag} must be {rule}, got {text!r} (e.g. {flag} {example})")
    return value


def lora_alpha(text: str) -> float:
    """``--lora-alpha``: peft's ``lora_alpha``, a number above 0."""
    return _real(text, flag="--lora-alpha", accepts=lambda value: value > 0, rule="a number more than 0",
                 example="32")


def lora_dropout(text: str) -> float:
    """``--lora-dropout``: a probability in [0, 1)."""
    return _real(text, flag="--lora-dropout", accepts=lambda value: 0 <= value < 1,
                 rule="a number from 0 up to (not including) 1", example="0.05")


def _one_of(flag: str, known: tuple[str, ...]):
    """An argparse ``type=`` that accepts one of ``known`` and refuses anything else in one line
    (``unknown --precision value 'bf61'; did you mean 'bf16'? known: ...``), as the numbers do."""

    def check(text: str) -> str:
        if text not in known:
            raise UsageError(unknown_name_message(f"{flag} value", text, known))
        return text

    check.__name__ = flag.lstrip("-").replace("-", "_")
    return check


precision = _one_of("--precision", PRECISION_CHOICES)
"""``--precision``: one of :data:`PRECISION_CHOICES`."""
activation_checkpointing = _one_of("--activation-checkpointing", SWITCH_CHOICES)
"""``--activation-checkpointing``: one of :data:`SWITCH_CHOICES`."""
offload = _one_of("--offload", SWITCH_CHOICES)
"""``--offload``: one of :data:`SWITCH_CHOICES`."""
strategy = _one_of("--strategy", STRATEGY_CHOICES)
"""``--strategy``: one of :data:`STRATEGY_CHOICES`."""
device = _one_of("--device", DEVICES)
"""``--device``: one of :data:`DEVICES`."""


def value_problem(value, check, *, flag: str) -> str | None:
    """What is wrong with ``value`` given in code rather than typed (a request field, a training
    shape), in the words of the flag's own ``check``; None when it is unset or fine. The one way
    the library checks a number the command line also takes."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{flag} must be a number, got {value!r}"
    try:
        check(str(value))
    except UsageError as error:
        return str(error)
    return None


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
    parser.add_argument("--seq-len", type=seq_len, help=f"tokens per sequence (default {DEFAULT_SEQ_LEN}, capped "
                        "by the model's positions" + default_help + ")")


def add_micro_batch(parser: argparse.ArgumentParser, *, default_help: str = "1") -> None:
    """``--micro-batch``: sequences per GPU per forward/backward (None: the command's default)."""
    parser.add_argument("--micro-batch", type=micro_batch, help=f"sequences per GPU per step (default {default_help})")


def add_grad_accum(parser: argparse.ArgumentParser, *, extra_help: str = "") -> None:
    """``--grad-accum``: micro-batches per optimizer step (None: 1)."""
    parser.add_argument("--grad-accum", type=grad_accum, help="micro-batches accumulated per optimizer step "
                        "(default 1)" + extra_help)


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
                 default_text: str = "auto: FULL_SHARD on one node, HYBRID_SHARD across nodes when it fits") -> None:
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


def add_trust_remote_code(parser: argparse.ArgumentParser) -> None:
    """``--trust-remote-code``: off unless given."""
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow a config that names its own Python code (auto_map) to run that code")
