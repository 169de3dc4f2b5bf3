"""Deterministic fault injection, for tests and fault drills.

A process dies exactly where a real crash would hurt most, so the recovery path is exercised on
purpose instead of by luck::

    FSDP_PRESETS_FAULT=kill-during-save:step=6            # rank 0 is SIGKILLed during the save of step 6
    FSDP_PRESETS_FAULT=kill-during-save:step=6:rank=1     # the same, on rank 1

Points (where the code calls :func:`fault_point`):

``during-save``
    :class:`fsdp_presets.checkpoint.manager.CheckpointManager`, after every rank wrote its shards into the
    temporary folder and before the manifest is written and the folder committed.
    ``FSDPPresetsCallback``: after Trainer wrote ``checkpoint-N`` and before its manifest (with
    ``async_save=True``: its shards still being written in the background).
``save``
    The same, before anything of the save is written (the folder of the files is the temporary one).
``async-save``
    :class:`fsdp_presets.checkpoint.async_save.CheckpointSaver` (``--async-save``), after the small
    files of the save were written and before the model and optimizer shards are written in the
    background (the folder is the temporary one: ``full`` makes the background write fail).
``save-in-flight``
    The same, at the end of a later step while that save is in flight and not yet committed.
``export``
    :func:`fsdp_presets.train.final_model.export_model`, before the main process writes the Hugging Face folder.
``evaluation``
    :meth:`fsdp_presets.train.recipe.RecipeRun.end_step`, before an evaluation after step N.

The action is ``kill`` (SIGKILL: no handler, no cleanup, like the out-of-memory killer),
``raise`` (a ``RuntimeError``) or ``full`` (a full disk: from that point on, every file this
process opens for writing under the point's folder is ``/dev/full``, whose writes the kernel fails
with ENOSPC, so the real error travels the real writers: DCP, ``torch.save``, transformers)::

    FSDP_PRESETS_FAULT=full-save:step=4:rank=1            # rank 1's part of the step-4 save hits a full disk
    FSDP_PRESETS_FAULT=full-export                        # the final export hits a full disk

``stall`` holds the process :data:`STALL_S` seconds at the point (a slow save, so that a drill can
send a signal while it is in progress)::

    FSDP_PRESETS_FAULT=stall-during-save:step=4          # rank 0 holds 8 s inside the save of step 4

Without the variable nothing happens.
"""

from __future__ import annotations

import builtins
import io
import os
import signal
from pathlib import Path

from fsdp_presets import environment

FAULT_ENV = environment.FAULT.name
ACTIONS = ("kill", "raise", "full", "stall")
STALL_S = 8.0
"""How long ``stall`` holds the process at its point: a slow save, long enough to signal it there."""
FULL_DEVICE = "/dev/full"  # every write fails with ENOSPC (Linux, macOS has none)


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


def fault_spec_problem() -> str | None:
    """What is wrong with ``FSDP_PRESETS_FAULT`` (None when unset or well-formed): checked at start,
    so a typo is not found only when the fault point is reached."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    try:
        _parse(spec)
    except ValueError as error:
        text = str(error)
        return text if text.startswith(FAULT_ENV) else (f"{FAULT_ENV}={spec!r}: expected ACTION-POINT[:step=N]"
                                                         f"[:rank=R], ACTION one of {ACTIONS}")
    return None


def fault_point(point: str, *, step: int | None, rank: int, folder: str | os.PathLike | None = None) -> None:
    """Act here if ``FSDP_PRESETS_FAULT`` names this point, step and rank (rank 0 by default)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    action, wanted_point, values = _parse(spec)
    if wanted_point != point or values.get("step", step) != step or values.get("rank", 0) != rank:
        return
    print(f"[fault] {action} at {point}, step {step}, rank {rank} ({FAULT_ENV})", flush=True)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "stall":
        import time

        time.sleep(STALL_S)
        return
    if action == "full" and folder is not None:
        _fill_disk(Path(folder))
        return
    raise RuntimeError(f"injected fault at {point}, step {step}, rank {rank}")


def _fill_disk(folder: Path) -> None:
    """From now on, files opened for writing under ``folder`` in this process are ``/dev/full``
    (the open succeeds, the first write that reaches the kernel fails with ENOSPC)."""
    inside = os.path.abspath(folder)
    original = io.open

    def open_on_a_full_disk(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and any(flag in mode for flag in "wax+"):
            path = os.path.abspath(os.fspath(file))
            if path == inside or path.startswith(inside + os.sep):
                return original(FULL_DEVICE, mode.replace("x", "w"), *args, **kwargs)
        return original(file, mode, *args, **kwargs)

    io.open = builtins.open = open_on_a_full_disk
