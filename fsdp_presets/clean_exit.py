"""Tear the process group down in the right order when the interpreter exits, and let gloo's worker
threads finish before the interpreter shuts down.

A training script that never calls ``accelerator.end_training()`` leaves the default process
group alive at exit, and even a script that does call it leaves gloo's threads running:
``destroy_process_group`` only forgets the group, and torch joins gloo's worker threads when the
last reference to the group goes, which the script's prepared model (FSDP keeps the group) holds
until interpreter shutdown. A gloo worker thread that finishes a collective releases the work's
tensors itself, and releasing a tensor that Python has seen takes the GIL (torch's
``TensorImpl::decref_pyobject``, a ``noexcept`` function). A barrier right after a collective
(``accelerator.wait_for_everyone()`` after a save's gather) keeps that collective's work, and its
tensors, alive until the barrier's own work is released on the worker thread, just after the
barrier returns, that is just as the script ends. When the worker asks for the GIL while the
interpreter starts finalizing, CPython ends that thread (``pthread_exit``) inside the ``noexcept``
function, and the C++ runtime aborts the process after a normal finish::

    terminate called without an active exception      (SIGABRT, launcher exit status 1)

(stack: ``ProcessGroupGloo::runLoop`` -> ``~AsyncBarrierWork`` -> ``~AsyncAllreduceWork`` ->
``TensorImpl::decref_pyobject`` -> ``std::terminate``). Seen in 2 of 16 Trainer launches ending with
``trainer.save_model`` on a loaded host (in the log kept, on the rank that waited in the barrier
while rank 0 wrote the model); ``tests/workers/script_endings.py --ending slow-release`` reproduces
it on every launch without the wait.

:func:`install` (called by :func:`fsdp_presets.enable_cpu_fsdp` and
:func:`fsdp_presets.check_launch`) registers one ``atexit`` handler that does what
``end_training`` would have done: drop every prepared object accelerate still references, collect
garbage (tensors that hold gloo buffers go while the group still exists), then
``destroy_process_group``; and then, however the group was destroyed, it waits, with the GIL free,
until every gloo worker thread of the process is idle (:func:`wait_for_gloo_workers`), so no
worker needs the interpreter once it shuts down.

A process that dies of an uncaught exception is left alone: its peers may still be inside a
collective with it, and a shutdown that waits for them would turn a failed run into a hung one.

``FSDP_PRESETS_CPU_PATCHES_OFF=clean-exit`` switches the handler off (the tests use it to show
that the group is otherwise still alive at exit).
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import time
import weakref

CLEAN_EXIT = "clean-exit"
"""Name of this fix in ``FSDP_PRESETS_CPU_PATCHES_OFF``."""

GLOO_WORKER_THREAD = "pt_gloo_runloop"
"""The name torch gives gloo's worker threads (``ProcessGroupGloo::runLoop``), which run the
collectives and release their tensors."""

GLOO_WORKERS_WAIT_S = 10.0
"""At most this long at exit for gloo's worker threads to go idle (they take milliseconds; a
starved thread on a loaded host, a second or so)."""

_accelerators: "weakref.WeakSet" = weakref.WeakSet()
_installed = False
_failed = False


def installed() -> bool:
    """Whether the exit handler is registered in this process."""
    return _installed


def install(accelerator=None) -> None:
    """Register the exit handler once; remember ``accelerator`` so that its prepared objects are
    released before the group goes. Safe to call any number of times."""
    global _installed
    if accelerator is not None:
        _accelerators.add(accelerator)
    if _installed or CLEAN_EXIT in {name.strip() for name in
                                    os.environ.get("FSDP_PRESETS_CPU_PATCHES_OFF", "").split(",")}:
        return
    _track_accelerators()
    _collect_before_destroy()
    _note_uncaught_exceptions()
    atexit.register(_tear_down)
    _installed = True


def _track_accelerators() -> None:
    """Every ``Accelerator`` built after this call is remembered (weakly) for the exit handler."""
    from accelerate import Accelerator

    original = Accelerator.__init__
    if getattr(original, "_fsdp_presets_patch", False):
        return

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _accelerators.add(self)

    __init__.__wrapped__ = original
    __init__.__doc__ = original.__doc__
    __init__._fsdp_presets_patch = True
    Accelerator.__init__ = __init__


def _collect_before_destroy() -> None:
    """``accelerator.end_training()`` (and ``Trainer.end()``, which calls it) destroy the default
    group through ``PartialState.destroy_process_group`` while the script still holds its prepared
    model and optimizer: gloo then aborted the process at exit in 2 of 6 FSDP1 launches here. The
    same release and collection as the exit handler's, first, removes it (docs/benchmarks.md)."""
    from accelerate.state import PartialState

    original = PartialState.destroy_process_group
    if getattr(original, "_fsdp_presets_patch", False):
        return

    def destroy_process_group(self, group=None):
        import torch.distributed as dist

        if group is None and dist.is_available() and dist.is_initialized():
            _release_and_collect()
        return original(self, group)

    destroy_process_group.__wrapped__ = original
    destroy_process_group.__doc__ = original.__doc__
    destroy_process_group._fsdp_presets_patch = True
    PartialState.destroy_process_group = destroy_process_group


def _release_and_collect() -> None:
    """Drop what accelerate still references of everything it prepared, then collect garbage:
    tensors and work objects that hold gloo buffers go while the group still exists."""
    for accelerator in list(_accelerators):
        # The lists accelerate keeps of everything it prepared (what free_memory() clears),
        # without free_memory's device cache calls.
        for name in ("_models", "_optimizers", "_schedulers", "_dataloaders"):
            if isinstance(getattr(accelerator, name, None), list):
                setattr(accelerator, name, [])
    gc.collect()


def _note_uncaught_exceptions() -> None:
    previous = sys.excepthook

    def excepthook(kind, value, traceback):
        global _failed
        _failed = True
        previous(kind, value, traceback)

    sys.excepthook = excepthook


def _tear_down() -> None:
    """The atexit handler: release, collect, destroy, then wait for gloo's worker threads (see the
    module docstring)."""
    import torch.distributed as dist

    if _failed:
        return
    if dist.is_available() and dist.is_initialized():
        _release_and_collect()
        try:
            dist.destroy_process_group()
        except Exception as error:  # exiting anyway: say why the group could not be closed
            print(f"fsdp_presets: process group not destroyed at exit ({error})", file=sys.stderr, flush=True)
    if not wait_for_gloo_workers():
        print(f"fsdp_presets: gloo's worker threads still busy after {GLOO_WORKERS_WAIT_S:.0f} s at exit; exiting "
              "anyway", file=sys.stderr, flush=True)


def wait_for_gloo_workers(timeout_s: float = GLOO_WORKERS_WAIT_S) -> bool:
    """Wait, with the GIL free, until every gloo worker thread of this process is idle: False when
    one is still busy after ``timeout_s``. True at once where there is none, or no ``/proc``.

    A thread is idle when it slept through a whole interval (4 switch intervals, at least 20 ms)
    without being switched in once: a worker that is still releasing a collective's tensors is
    running, runnable, or waiting for the GIL, which it gets during the interval (the GIL's own wait
    wakes every switch interval), so it shows a context switch or a state other than sleeping.
    Limits: the threads are found by torch's name for them (:data:`GLOO_WORKER_THREAD`; a torch that
    names them otherwise gets no wait), and a release that itself sleeps longer than the interval
    would pass for idle."""
    interval = max(0.02, 4 * sys.getswitchinterval())
    deadline = time.monotonic() + timeout_s
    before = _gloo_worker_activity()
    while before:
        time.sleep(interval)  # releases the GIL
        after = _gloo_worker_activity()
        if after == before and all(state == "S" for state, _ in before.values()):
            return True
        if time.monotonic() > deadline:
            return False
        before = after
    return True


def _gloo_worker_activity() -> dict[str, tuple[str, str]]:
    """Thread id -> (state letter, context-switch counts) of this process's gloo worker threads."""
    activity = {}
    try:
        threads = os.listdir("/proc/self/task")
    except OSError:  # not Linux: nothing to wait for
        return activity
    for thread in threads:
        try:
            with open(f"/proc/self/task/{thread}/status") as handle:
                fields = dict(line.rstrip("\n").split(":\t", 1) for line in handle if ":\t" in line)
        except OSError:  # the thread ended meanwhile
            continue
        if fields.get("Name") == GLOO_WORKER_THREAD:
            activity[thread] = (fields.get("State", "?")[:1],
                                f"{fields.get('voluntary_ctxt_switches')}/{fields.get('nonvoluntary_ctxt_switches')}")
    return activity
