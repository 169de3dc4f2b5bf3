"""Ctrl-C (SIGINT) in a recipe: stop at a clean point, save, say so in one line, exit 130.

A Ctrl-C at a terminal reaches every process of the launch at once (the launcher and every rank),
and the launcher (torchrun's agent) forwards it to the ranks again a moment later; it kills ranks
still running 30 s after that. Python's default turns each SIGINT into a ``KeyboardInterrupt``
wherever each rank happens to be (a traceback on every rank, a save cut in half, peers left in a
collective). Instead:

- before training (loading, the first evaluation) a Ctrl-C ends the recipe at once with one line
  (:func:`fsdp_presets.train.loop.run_recipe`): nothing is half-written there (run.json, the metrics
  log and the lock are written atomically);
- once :func:`defer` is called (the training loop), a SIGINT only sets a flag; at the end of every
  optimizer step the ranks agree on it (:func:`requested`, one small all-reduce), save a
  checkpoint of that step together and stop with :class:`Interrupted` (exit 130 = 128 + SIGINT).
  SIGTERM and SIGUSR1 (preemption) take the same path: :mod:`fsdp_presets.train.preemption`.
  ``--resume auto`` continues from that checkpoint. A second Ctrl-C, more than
  :data:`REPEAT_GRACE_S` after the first, stops at once (the save already committed stays valid;
  one cut short is ignored by ``--resume auto``).
"""

from __future__ import annotations

import signal
import threading
import time

REPEAT_GRACE_S = 3.0
"""A SIGINT this soon after the first is the same Ctrl-C (the launcher forwarding it)."""

_state: dict = {"deferring": False, "first_at": None}


class Interrupted(Exception):
    """The run stopped on Ctrl-C at a clean point (exit status 130)."""


def install() -> None:
    """Take over SIGINT in this process (main thread only; elsewhere Python's default stays)."""
    if threading.current_thread() is threading.main_thread():
        _state.update(deferring=False, first_at=None)
        signal.signal(signal.SIGINT, _on_sigint)


def _on_sigint(signum, frame) -> None:
    now = time.monotonic()
    if _state["deferring"]:
        if _state["first_at"] is None:
            _state["first_at"] = now
            return
        if now - _state["first_at"] < REPEAT_GRACE_S:
            return
    raise KeyboardInterrupt


def defer() -> None:
    """From now on a Ctrl-C is answered at the end of the current optimizer step."""
    _state["deferring"] = True


def pending() -> bool:
    """Whether this process got a Ctrl-C since :func:`defer` (the ranks agree on it together with
    preemption: :func:`fsdp_presets.train.preemption.agree`)."""
    return _state["first_at"] is not None


def stop(accelerator, checkpoint, *, step: int) -> None:
    """Raise :class:`Interrupted` after the checkpoint of ``step`` was saved (the main process
    prints the line; the others leave a moment later)."""
    from fsdp_presets.errors import COLLECTIVE_EXIT_DELAY_S

    if not accelerator.is_main_process:
        time.sleep(COLLECTIVE_EXIT_DELAY_S)
    raise Interrupted(f"interrupted (Ctrl-C) after step {step}: saved {checkpoint}; run the same command again "
                      "to continue from it (--resume auto)")
