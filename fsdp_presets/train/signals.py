"""Signals that stop a training run (Ctrl-C, preemption) and the exit status of every way a run
stops, for the recipes and the Trainer callback alike.

    signals.install(signals.parse_signals("TERM,USR1"))   # once, main thread
    ...                                                   # loading, first evaluation: Ctrl-C stops at once
    signals.defer()                                       # the training loop: Ctrl-C is answered at a step's end
    interrupted, preempted = signals.agree(accelerator)   # collective, at every optimizer step's end
    if interrupted or preempted:
        checkpoint = save(...)
        signals.stop(accelerator, step=step, checkpoint=checkpoint, interrupted=interrupted)

**Ctrl-C (SIGINT).** A Ctrl-C at a terminal reaches every process of the launch at once (the
launcher and every rank), and the launcher (torchrun's agent) forwards it to the ranks again a
moment later; it kills ranks still running 30 s after that. Python's default turns each SIGINT
into a ``KeyboardInterrupt`` wherever each rank happens to be (a traceback on every rank, a save
cut in half, peers left in a collective). Before :func:`defer` (loading, the first evaluation)
that is still what happens, and :func:`exit_status` makes it one line and 130: nothing is
half-written there (run.json, the metrics log and the lock are written atomically). After it, a
SIGINT only sets a flag; at the end of every optimizer step the ranks agree on it (:func:`agree`),
save a checkpoint of that step together and stop with :class:`Interrupted` (exit 130 = 128 +
SIGINT). A second Ctrl-C, more than :data:`REPEAT_GRACE_S` after the first, stops at once with a
``KeyboardInterrupt`` (the save already committed stays valid; one cut short is never resumed from).

**Preemption (SIGTERM, SIGUSR1).** Schedulers stop jobs politely before they kill them: SLURM sends
SIGTERM on ``scancel`` and at the time limit (``--signal=USR1@N`` gives N seconds of warning),
Kubernetes sends SIGTERM and waits its grace period. :func:`install` makes these signals set a flag
instead of killing the process (a handler the script had before is called too, so users' own
handlers keep working); the ranks agree on it with the Ctrl-C flag, in the same all-reduce, so a
signal that reached one rank stops all of them at the same step and no rank ever saves alone. A
signal during an evaluation, a save or data loading only sets the flag; it is answered at the next
agreement. The run saves the step it reached and stops with :class:`Preempted` (exit
:data:`PREEMPTED_EXIT`). A second signal, more than :data:`REPEAT_GRACE_S` after the first, means
"now": the process exits at once with ``128 + signal`` (``os._exit``: no save, nothing more
written). Checkpoints are committed by a rename, so the newest committed one is intact.

:data:`EXIT_STATUSES` is the one table of exit statuses (the launcher's own status depends on who
got the signal: docs/runbook.md).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

from fsdp_presets.checkpoint.manager import RECIPE_NAMING, CheckpointNaming
from fsdp_presets.checkpoint.resume import resume_note
from fsdp_presets.errors import Finding, UsageError, raise_on_every_rank

DEFAULT_SIGNALS = "TERM,USR1"
"""``--preempt-signals`` default: what SLURM, Kubernetes and spot notices send."""
REPEAT_GRACE_S = 3.0
"""A signal this soon after the first is the same one delivered twice (to the whole process group
and forwarded again by the launcher), not a second request."""
PREEMPTED_EXIT = 75
"""Exit status of a rank that saved and stopped on a preemption signal (EX_TEMPFAIL of sysexits.h:
"try again later"); 128 + signal after a second signal."""
INTERRUPTED_EXIT = 128 + signal.SIGINT
"""Exit status of a run stopped by Ctrl-C (130, as a shell reports a process SIGINT ended)."""


class Interrupted(Exception):
    """The run stopped on Ctrl-C at a clean point (exit :data:`INTERRUPTED_EXIT`)."""


class Preempted(Exception):
    """The run saved the step it reached and stopped on a preemption signal (exit :data:`PREEMPTED_EXIT`)."""


EXIT_STATUSES: tuple[tuple[type[BaseException], int], ...] = (
    (UsageError, 2),                          # bad input, a read-only or size-limited output
    (Finding, 1),                             # something about the run itself: it diverged, the disk is full
    (Preempted, PREEMPTED_EXIT),
    (Interrupted, INTERRUPTED_EXIT),
    (KeyboardInterrupt, INTERRUPTED_EXIT),    # Ctrl-C before training started, or a second one
)
"""How each way a run stops becomes its exit status (0: it finished)."""


def exit_status(error: BaseException) -> int | None:
    """The exit status of a run stopped by ``error`` (:data:`EXIT_STATUSES`), None for an error
    that is a bug (its traceback is the report)."""
    return next((status for kind, status in EXIT_STATUSES if isinstance(error, kind)), None)


def report(error: BaseException, *, program: str | None = None) -> int:
    """Print ``error`` as one line on stderr (``PROGRAM: error: ...``; the main process, or the
    rank an error marked :func:`fsdp_presets.errors.rank_local` names) and return its exit status."""
    printed_here = getattr(error, "print_on_this_rank", None)
    if printed_here if printed_here is not None else int(os.environ.get("RANK", "0")) == 0:
        from fsdp_presets.fileio import printable  # names from a checkpoint may hold control characters

        print(f"{program or Path(sys.argv[0]).name}: error: {printable(str(error))}", file=sys.stderr, flush=True)
    return exit_status(error)


# ---- the handlers ----
_state: dict = {"signals": (), "previous": {}, "deferring": False, "interrupted_at": None, "first": None,
                "first_at": None, "naming": RECIPE_NAMING, "checkpoints": None}


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


def install(preempt_signals: tuple[signal.Signals, ...] = (), *, naming: CheckpointNaming = RECIPE_NAMING,
            checkpoints: str | os.PathLike | None = None) -> None:
    """Take over SIGINT and ``preempt_signals`` in this process (main thread only; elsewhere nothing
    changes), with nothing received yet and Ctrl-C not deferred. Called again, it replaces the set.
    ``naming`` and ``checkpoints`` (the folder that holds the run's checkpoints): what the messages
    name to continue from (:func:`fsdp_presets.checkpoint.resume.resume_note`)."""
    if threading.current_thread() is not threading.main_thread():
        return
    restore()
    _state.update(signals=tuple(preempt_signals), deferring=False, interrupted_at=None, first=None, first_at=None,
                  naming=naming, checkpoints=checkpoints)
    for signum in (signal.SIGINT, *preempt_signals):
        _state["previous"][signum] = signal.signal(signum, _on_signal)


def restore() -> None:
    """Put back the handlers :func:`install` replaced (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum, previous in _state["previous"].items():
        signal.signal(signum, previous)
    _state.update(previous={}, signals=(), deferring=False)


def defer() -> None:
    """From now on a Ctrl-C is answered at the end of the current optimizer step."""
    _state["deferring"] = True


def _on_signal(signum, frame) -> None:
    now = time.monotonic()
    if signum == signal.SIGINT:
        if not _state["deferring"]:
            raise KeyboardInterrupt
        if _state["interrupted_at"] is None:
            _state["interrupted_at"] = now
        elif now - _state["interrupted_at"] >= REPEAT_GRACE_S:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        return
    if _state["first_at"] is None:
        _state.update(first=signal.Signals(signum).name, first_at=now)
    elif now - _state["first_at"] >= REPEAT_GRACE_S:  # a second request: stop now, save nothing
        print(f"{Path(sys.argv[0]).name}: error: second {signal.Signals(signum).name}: stopping at once without a "
              f"save. {_kept_note()}", file=sys.stderr, flush=True)
        os._exit(128 + signum)
    previous = _state["previous"].get(signum)
    if callable(previous) and previous is not _on_signal:  # the script's own handler keeps working
        previous(signum, frame)


def _kept_note() -> str:
    """What a stop without a save leaves to continue from (the run's checkpoints are committed by a
    rename or a manifest: the newest committed one is intact)."""
    naming, checkpoints = _state["naming"], _state["checkpoints"]
    try:
        committed = naming.committed(Path(checkpoints)) if checkpoints is not None else []
    except OSError:
        committed = []
    return resume_note(committed[-1][1] if committed else None, how=naming.resume)


def received() -> str | None:
    """The name of the first preemption signal this process got (``SIGTERM``), or None."""
    return _state["first"]


def interrupted() -> bool:
    """Whether this process got a Ctrl-C since :func:`defer`."""
    return _state["interrupted_at"] is not None


def agree(accelerator) -> tuple[bool, bool]:
    """``(interrupted, preempted)``: whether any rank got a Ctrl-C (since :func:`defer`) or a
    preemption signal. Collective: every rank calls it at the same point and gets the same answer
    (one all-reduce of two numbers)."""
    flags = (interrupted(), received() is not None)
    if accelerator.num_processes == 1:
        return flags
    import torch

    local = torch.tensor([1.0 if flag else 0.0 for flag in flags], device=accelerator.device)
    return tuple(value > 0 for value in accelerator.reduce(local, reduction="sum").tolist())


def stop(accelerator, *, step: int, checkpoint, interrupted: bool) -> None:
    """Raise :class:`Interrupted` (Ctrl-C) or :class:`Preempted` once the checkpoint of ``step`` is
    committed (``checkpoint``; None: nothing was trained to save), on every rank (the main process
    prints the line, the others leave a moment later)."""
    where = resume_note(checkpoint, how=_state["naming"].resume, saved=True)
    raise_on_every_rank(accelerator, Interrupted(f"interrupted (Ctrl-C) after step {step}: {where}") if interrupted
                        else Preempted(f"preempted ({received() or 'signal on another rank'}) at step {step}: {where}; "
                                       f"exit status {PREEMPTED_EXIT}"))
