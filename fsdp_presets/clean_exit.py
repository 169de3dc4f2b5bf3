"""Tear the process group down in the right order when the interpreter exits.

A training script that never calls ``accelerator.end_training()`` leaves the default process
group alive at exit. Python then frees the prepared model, optimizer and gloo's process group in
whatever order interpreter shutdown and C++ static destruction reach them, and gloo sometimes
aborts the process after a normal finish::

    terminate called without an active exception      (SIGABRT, launcher exit status 1)

Measured: 1 launch in 12 of a minimal 2-process FSDP2 script on a loaded 2-core host. The
launcher then reports a finished training as failed.

:func:`install` (called by :func:`fsdp_presets.enable_cpu_fsdp` and
:func:`fsdp_presets.check_launch`) registers one ``atexit`` handler that does what
``end_training`` would have done, in the order that removes the abort: drop every prepared
object accelerate still references, collect garbage (tensors that hold gloo buffers go while the
group still exists), then ``destroy_process_group`` (which shuts every backend down and joins
gloo's threads while the interpreter is alive). A script that did call ``end_training`` finds the
group gone and the handler does nothing.

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
import weakref

CLEAN_EXIT = "clean-exit"
"""Name of this fix in ``FSDP_PRESETS_CPU_PATCHES_OFF``."""

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
    """The atexit handler: release, collect, destroy (see the module docstring)."""
    import torch.distributed as dist

    if _failed or not (dist.is_available() and dist.is_initialized()):
        return
    _release_and_collect()
    try:
        dist.destroy_process_group()
    except Exception as error:  # exiting anyway: say why the group could not be closed
        print(f"fsdp_presets: process group not destroyed at exit ({error})", file=sys.stderr, flush=True)
