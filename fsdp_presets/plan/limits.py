"""The bounds, defaults and checks of what a plan and a preset are asked for: GPUs, nodes, memory,
sequence length, batch, precision, the savers, the strategy, the device and the LoRA adapter.

Each check takes the text of a flag and returns its value, or raises
:class:`~fsdp_presets.errors.UsageError` in one line that names the flag and gives an example
(``--gpus must be at least 1, got 0 (e.g. --gpus 8)``); :func:`value_problem` applies the same check to
a value given in code (a request field, a training shape), so a request is refused in the words of
the command line. The command-line flags (:mod:`fsdp_presets.arguments`) take their types,
defaults and choices from here. The bounds are far above anything real and far below what breaks
the arithmetic (``--gpu-memory 1e308`` is infinite bytes): a value past one is a typo. Standard
library only (``fsdp-presets --help`` stays instant).
"""

from __future__ import annotations

import math

from fsdp_presets import flags
from fsdp_presets.errors import UsageError, unknown_name_message

DEFAULT_SEQ_LEN = 2048
"""Tokens per sequence that ``plan``, ``generate``, ``rehearse`` and ``check`` plan for when
``--seq-len`` is not given (capped by the model's positions)."""
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

GPUS_PER_SERVER = 8
"""GPUs one training server holds: the HGX/DGX (A100, H100, H200, B200) and MI300X platforms hold 8.
A scaling table (``plan --gpus 8,16,32``) puts this many on a node; more on one machine is said
(:func:`one_machine_note`)."""


def one_machine_note(gpus: int, nodes: int) -> str | None:
    """What a GPU job of more GPUs than a server holds assumes on one machine (``--nodes`` 1, its
    default): a link as fast as NVLink between all of them and no network; None otherwise."""
    if nodes != 1 or gpus <= GPUS_PER_SERVER:
        return None
    servers = (f"--nodes {gpus // GPUS_PER_SERVER} for {gpus // GPUS_PER_SERVER} such servers"
               if gpus % GPUS_PER_SERVER == 0 else "--nodes with the number of machines")
    return (f"{gpus} GPUs on one machine (--nodes 1): planned as one NVLink domain, no network between them; most "
            f"training servers hold {GPUS_PER_SERVER} (HGX/DGX, MI300X): give {servers}")


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


def count_check(flag: str, *, high: float, example: str, doc: str, gib: bool = False):
    """An argparse ``type=`` for a whole number from 1 to ``high`` (``gib``: GiB more than 0 and at
    most ``high``), refused in one line that names the flag and gives an example."""

    def check(text: str):
        if gib:
            return _amount(text, flag=flag, high=high, what="GiB", example=example)
        return _whole(text, flag=flag, low=1, high=int(high), example=example)

    check.__name__, check.__doc__ = flag.lstrip("-").replace("-", "_"), doc
    return check


gpu_count = count_check("--gpus", high=MAX_GPUS, example="8",
                   doc="``--gpus``: GPUs (processes) in the whole job, 1 .. :data:`MAX_GPUS`.")
node_count = count_check("--nodes", high=MAX_NODES, example="2",
                    doc="``--nodes``: machines in the job, 1 .. :data:`MAX_NODES`.")
gpu_memory_gib = count_check("--gpu-memory", high=MAX_GPU_MEMORY_GIB, example="80", gib=True,
                      doc="``--gpu-memory``: GiB of one GPU, (0, :data:`MAX_GPU_MEMORY_GIB`].")
host_memory_gib = count_check("--host-memory", high=MAX_HOST_MEMORY_GIB, example="1024", gib=True,
                       doc="``--host-memory``: GiB of host RAM of one node, (0, :data:`MAX_HOST_MEMORY_GIB`].")
seq_len = count_check(flags.SEQ_LEN.name, high=MAX_SEQ_LEN, example="4096",
                 doc="``--seq-len``: tokens per sequence, 1 .. :data:`MAX_SEQ_LEN`.")
micro_batch = count_check(flags.MICRO_BATCH.name, high=MAX_MICRO_BATCH, example="2",
                     doc="``--micro-batch``: sequences per GPU per step, 1 .. :data:`MAX_MICRO_BATCH`.")
grad_accum = count_check(flags.GRAD_ACCUM.name, high=MAX_GRAD_ACCUM, example="4",
                    doc="``--grad-accum``: micro-batches per optimizer step, 1 .. :data:`MAX_GRAD_ACCUM`.")
MAX_MESH_SIZE = 128
"""Largest ``--tp``/``--ep`` accepted (a TP group lives inside a node)."""
tp_size = count_check("--tp", high=MAX_MESH_SIZE, example="8",
                 doc="``--tp``: tensor-parallel ranks, 1 .. :data:`MAX_MESH_SIZE`.")
ep_size = count_check("--ep", high=MAX_MESH_SIZE, example="8",
                 doc="``--ep``: expert-parallel ranks, 1 .. :data:`MAX_MESH_SIZE`.")
lora_rank = count_check(flags.LORA_R.name, high=MAX_LORA_R, example="16",
                   doc="``--lora-r``: the adapter's rank, 1 .. :data:`MAX_LORA_R`.")


def gpu_counts(text: str) -> tuple[int, ...]:
    """``plan --gpus``: one GPU count, or several separated by commas (``8,16,32,64``) for a scaling
    table; each checked as :func:`gpu_count`, no count twice."""
    counts = tuple(gpu_count(part) for part in str(text).split(","))
    if len(set(counts)) != len(counts):
        raise UsageError(f"--gpus {text}: a count is given twice (e.g. --gpus 8,16,32)")
    return counts


def _real(text: str, *, flag: str, accepts, rule: str, example: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and accepts(value)):
        raise UsageError(f"{flag} must be {rule}, got {text!r} (e.g. {flag} {example})")
    return value


def inter_node_gbps(text: str) -> float:
    """``--inter-node-gbps``: one GPU's network to other nodes in Gb/s, more than 0 and at most 1e6."""
    return _real(text, flag="--inter-node-gbps", accepts=lambda value: 0 < value <= 1e6,
                 rule="a number of Gb/s more than 0 and at most 1e6", example="400")


def token_count(text: str) -> float:
    """``--tokens``: tokens to train on (``10e9``), more than 0 and at most 1e15."""
    return _real(text, flag="--tokens", accepts=lambda value: 0 < value <= 1e15,
                 rule="a number of tokens more than 0 and at most 1e15", example="10e9")


def lora_alpha(text: str) -> float:
    """``--lora-alpha``: peft's ``lora_alpha``, a number above 0."""
    return _real(text, flag=flags.LORA_ALPHA.name, accepts=lambda value: value > 0, rule="a number more than 0",
                 example="32")


def lora_dropout(text: str) -> float:
    """``--lora-dropout``: a probability in [0, 1)."""
    return _real(text, flag=flags.LORA_DROPOUT.name, accepts=lambda value: 0 <= value < 1,
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
