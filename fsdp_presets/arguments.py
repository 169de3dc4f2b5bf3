"""The numbers of the command line, each checked in one place: argparse ``type=`` functions that
every command uses for the same flag, so that ``--gpus`` or ``--gpu-memory`` mean and refuse the
same thing in ``plan``, ``generate`` and ``launcher``.

    parser.add_argument("--gpus", type=arguments.gpu_count, ...)

A bad value raises :class:`~fsdp_presets.errors.UsageError`, which argparse does not catch:
``fsdp_presets.cli.main`` prints it as the command's one-line error and exits with status 2,
before any model is read. The bounds are far above anything real and far below what breaks the
arithmetic (``--gpu-memory 1e308`` is infinite bytes): a value past one is a typo, and the
message says what a real value looks like. Standard library only (``fsdp-presets --help`` stays
instant).
"""

from __future__ import annotations

import math

from fsdp_presets.errors import UsageError

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
MAX_GLOBAL_BATCH = {"samples": 2**24, "tokens": 2**36}
"""Per optimizer step (``--global-batch``): 16M sequences or 64G tokens; the largest published runs
use about 60M tokens (Llama 3 405B: 16M tokens)."""
MAX_JOIN_TIMEOUT_S = 7 * 24 * 3600
"""Seconds the first node waits for the others: a week."""
MAX_CPUS_PER_TASK = 2**16
"""SLURM CPUs for one node's task."""


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


def gpu_count(text: str) -> int:
    """``--gpus``: GPUs (processes) in the whole job, 1 .. :data:`MAX_GPUS`."""
    return _whole(text, flag="--gpus", low=1, high=MAX_GPUS, example="8")


def gpus_per_node(text: str) -> int:
    """``launcher --gpus``: GPUs (processes) per machine."""
    return _whole(text, flag="--gpus", low=1, high=MAX_GPUS, example="8")


def node_count(text: str) -> int:
    """``--nodes``: machines in the job, 1 .. :data:`MAX_NODES`."""
    return _whole(text, flag="--nodes", low=1, high=MAX_NODES, example="2")


def gpu_memory_gib(text: str) -> float:
    """``--gpu-memory``: GiB of one GPU, (0, :data:`MAX_GPU_MEMORY_GIB`]."""
    return _amount(text, flag="--gpu-memory", high=MAX_GPU_MEMORY_GIB, what="GiB", example="80")


def host_memory_gib(text: str) -> float:
    """``--host-memory``: GiB of host RAM of one node, (0, :data:`MAX_HOST_MEMORY_GIB`]."""
    return _amount(text, flag="--host-memory", high=MAX_HOST_MEMORY_GIB, what="GiB", example="1024")


def seq_len(text: str) -> int:
    """``--seq-len``: tokens per sequence, 1 .. :data:`MAX_SEQ_LEN`."""
    return _whole(text, flag="--seq-len", low=1, high=MAX_SEQ_LEN, example="4096")


def micro_batch(text: str) -> int:
    """``--micro-batch``: sequences per GPU per step, 1 .. :data:`MAX_MICRO_BATCH`."""
    return _whole(text, flag="--micro-batch", low=1, high=MAX_MICRO_BATCH, example="2")


def tcp_port(text: str) -> int:
    """``--port``: a TCP port."""
    return _whole(text, flag="--port", low=1, high=65535, example="29500")


def join_timeout_s(text: str) -> int:
    """``--join-timeout``: seconds, 1 .. :data:`MAX_JOIN_TIMEOUT_S`."""
    return _whole(text, flag="--join-timeout", low=1, high=MAX_JOIN_TIMEOUT_S, example="600")


def cpus_per_task(text: str) -> int:
    """``--cpus-per-task``: SLURM CPUs for one node's task."""
    return _whole(text, flag="--cpus-per-task", low=1, high=MAX_CPUS_PER_TASK, example="32")
