"""Deterministic fault injection, for tests and fault drills.

A process dies exactly where a real crash would hurt most, so the recovery path is exercised on
purpose instead of by luck::

    FSDP_PRESETS_FAULT=kill-during-save:step=6            # rank 0 is SIGKILLed during the save of step 6
    FSDP_PRESETS_FAULT=kill-during-save:step=6:rank=1     # the same, on rank 1

Points (where the code calls :func:`fault_point`):

``during-save``
    :class:`fsdp_presets.checkpoint.CheckpointManager`, after every rank wrote its shards into the
    temporary folder and before the manifest is written and the folder committed.

The action is ``kill`` (SIGKILL: no handler, no cleanup, like the out-of-memory killer) or
``raise`` (a ``RuntimeError``). Without the variable nothing happens.
"""

from __future__ import annotations

import os
import signal

FAULT_ENV = "FSDP_PRESETS_FAULT"
ACTIONS = ("kill", "raise")


def _parse(spec: str) -> tuple[str, str, dict[str, int]] | None:
    head, *fields = [part.strip() for part in spec.split(":") if part.strip()]
    action, _, point = head.partition("-")
    if action not in ACTIONS or not point:
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected ACTION-POINT[:step=N][:rank=R], ACTION one of {ACTIONS}")
    values = {}
    for field in fields:
        key, _, value = field.partition("=")
        if key not in ("step", "rank") or not value.isdigit():
            raise ValueError(f"{FAULT_ENV}={spec!r}: unknown field {field!r} (known: step=N, rank=R)")
        values[key] = int(value)
    return action, point, values


def fault_point(point: str, *, step: int, rank: int) -> None:
    """Die here if ``FSDP_PRESETS_FAULT`` names this point, step and rank (rank 0 by default)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    action, wanted_point, values = _parse(spec)
    if wanted_point != point or values.get("step", step) != step or values.get("rank", 0) != rank:
        return
    print(f"[fault] {action} at {point}, step {step}, rank {rank} ({FAULT_ENV})", flush=True)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"injected fault at {point}, step {step}, rank {rank}")
