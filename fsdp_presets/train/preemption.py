"""Preemption: a run told to stop (SIGTERM, SIGUSR1) saves the step it reached and exits with a
status a requeue script can test.

Schedulers stop jobs politely before they kill them: SLURM sends SIGTERM on ``scancel`` and at the
time limit (``--signal=USR1@N`` gives N seconds of warning), Kubernetes sends SIGTERM and waits its
grace period. The pieces, usable by any training loop (the recipes, a Trainer callback)::

    preemption.install(preemption.parse_signals("TERM,USR1"))   # once, main thread
    ...
    if preemption.should_stop(accelerator):    # collective, at a point every rank reaches
        save(...); raise preemption.Preempted(...)

- :func:`install` makes the signals set a flag instead of killing the process; a handler the
  script had before is called too (chained), so users' own handlers keep working.
- :func:`should_stop` is the agreement: one all-reduce of the flag (max over ranks), so a signal
  that reached one rank stops all of them at the same step, and no rank ever saves alone. A signal
  that arrives during an evaluation, a save or data loading only sets the flag; it is answered at
  the next agreement.
- A second signal, more than :data:`REPEAT_GRACE_S` after the first, means "now": the process
  exits at once with ``128 + signal`` (``os._exit``: no save, nothing more written). Checkpoints
  are committed by a rename, so the newest committed one is intact; one cut short is ignored by
  ``--resume auto``.

:data:`PREEMPTED_EXIT` is the status of a rank that stopped this way (the launcher's own status
depends on who got the signal: docs/runbook.md).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from fsdp_presets.errors import UsageError

DEFAULT_SIGNALS = "TERM,USR1"
"""``--preempt-signals`` default: what SLURM, Kubernetes and spot notices send."""
PREEMPTED_EXIT = 75
"""Exit status of a rank that saved and stopped on a preemption signal (EX_TEMPFAIL of sysexits.h:
"try again later"); 128 + signal after a second signal."""
REPEAT_GRACE_S = 3.0
"""A signal this soon after the first is the same one delivered twice (to the whole process group
and forwarded again by the launcher), not a second request."""

_state: dict = {"signals": (), "first": None, "first_at": None, "previous": {}}


class Preempted(Exception):
    """The run saved the step it reached and stopped on a preemption signal (exit :data:`PREEMPTED_EXIT`)."""


def parse_signals(text: str) -> tuple[signal.Signals, ...]:
    """``"TERM,USR1"`` (with or without ``SIG``) as signals; ``"none"``: no signal at all."""
    text = (text or "").strip()
    if text.lower() == "none":
        return ()
    found, bad = [], []
    for name in (part.strip().upper() for part in text.split(",")):
        name = name if name.startswith("SIG") else f"SIG{name}"
        member = getattr(signal.Signals, name, None) if name.isidentifier() else None
        if member is None or member in (signal.SIGKILL, signal.SIGSTOP, signal.SIGINT):
            bad.append(name)
        elif member not in found:
            found.append(member)
    if bad or not found:
        raise UsageError(f"--preempt-signals {text!r}: {', '.join(bad) or 'nothing'} cannot be used (SIGKILL and "
                         "SIGSTOP cannot be caught, Ctrl-C has its own handling); give signal names such as "
                         f"{DEFAULT_SIGNALS}, or none to turn preemption saves off")
    return tuple(found)


def install(signals: tuple[signal.Signals, ...]) -> None:
    """Catch ``signals`` in this process (main thread only; elsewhere nothing changes). Called
    again, it replaces the set (``()``: the handlers it installed are put back)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum, previous in _state["previous"].items():
        signal.signal(signum, previous)
    _state.update(signals=tuple(signals), first=None, first_at=None, previous={})
    for signum in signals:
        _state["previous"][signum] = signal.signal(signum, _on_signal)


def _on_signal(signum, frame) -> None:
    now = time.monotonic()
    if _state["first_at"] is None:
        _state.update(first=signal.Signals(signum).name, first_at=now)
    elif now - _state["first_at"] >= REPEAT_GRACE_S:  # a second request: stop now, save nothing
        print(f"{os.path.basename(sys.argv[0])}: error: second {signal.Signals(signum).name}: stopping at once "
              "without a save; the newest committed checkpoint is intact (--resume auto continues from it)",
              file=sys.stderr, flush=True)
        os._exit(128 + signum)
    previous = _state["previous"].get(signum)
    if callable(previous) and previous is not _on_signal:  # the script's own handler keeps working
        previous(signum, frame)


def received() -> str | None:
    """The name of the first preemption signal this process got (``SIGTERM``), or None."""
    return _state["first"]


def should_stop(accelerator) -> bool:
    """Whether any rank got a preemption signal. Collective: every rank calls it at the same point
    and gets the same answer (one all-reduce of one number)."""
    return agree(accelerator, received() is not None)[0]


def agree(accelerator, *flags: bool) -> tuple[bool, ...]:
    """Each flag OR-ed over the ranks, in one all-reduce (the recipes agree on Ctrl-C and on
    preemption together)."""
    if accelerator.num_processes == 1:
        return tuple(bool(flag) for flag in flags)
    import torch

    local = torch.tensor([1.0 if flag else 0.0 for flag in flags], device=accelerator.device)
    return tuple(value > 0 for value in accelerator.reduce(local, reduction="sum").tolist())


def stop(accelerator, *, step: int, checkpoint,
         again: str = "run the same command again to continue from it (--resume auto)") -> None:
    """Raise :class:`Preempted` once the checkpoint of ``step`` is committed (the main process
    prints the line; the others leave a moment later)."""
    from fsdp_presets.errors import COLLECTIVE_EXIT_DELAY_S

    if not accelerator.is_main_process:
        time.sleep(COLLECTIVE_EXIT_DELAY_S)
    where = f"saved {checkpoint}" if checkpoint else "nothing to save (no step trained yet)"
    raise Preempted(f"preempted ({received() or 'signal on another rank'}) at step {step}: {where}; {again}; "
                    f"exit status {PREEMPTED_EXIT}")
