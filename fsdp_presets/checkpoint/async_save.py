"""Checkpoint saves that do not stop training (``--async-save``), and the record of every save.

A synchronous save (:meth:`CheckpointManager.save`) stops every rank until the last byte is on
disk. With ``--async-save`` a save of step N:

1. writes the small files at once, through accelerate's own writer (``save_accelerator_state``:
   scheduler, every rank's random state, the gradient scaler) and the model config (main process);
2. takes the rank's model and optimizer state dicts the way accelerate's ``save_fsdp_model`` and
   ``save_fsdp_optimizer`` do (FSDP2, ``SHARDED_STATE_DICT``: this rank's shards) and copies (stages)
   their tensors into host memory with DCP's stager, so the files hold step N's values while
   training moves on;
3. returns to training. One background thread per process, at the lowest scheduling priority
   (training keeps its cores; the write takes the time training leaves idle first), writes each
   staged state dict with ``torch.distributed.checkpoint.save`` into accelerate's folders
   (``pytorch_model_fsdp_0/``, ``optimizer_0/``), so ``accelerator.load_state`` reads the
   checkpoint as if ``save_state`` wrote it: the rank's shard files past the page cache, hashed for
   the manifest on their way to the disk (:mod:`~fsdp_presets.checkpoint.direct_write`), then the
   rest of its share of the small files. At the end of each later step the ranks ask each other (one small all-reduce) whether
   every rank is done; when all are, the save is committed as a synchronous one
   (:meth:`CheckpointManager.commit`: manifest, one rename, pruning, which keeps the new checkpoint,
   so the last committed one is never removed).

At most one save is in flight: the next save, the final save, a Ctrl-C save, the export and the end
of the run wait for it first. A background write that fails on any rank is reported on every rank
(a :class:`Finding`, exit 1) naming the last committed checkpoint, which ``--resume auto`` continues
from; the unfinished folder has no manifest, so nothing would ever resume from it.

NOTE: the background writes run on a gloo process group of their own (created once on every rank):
DCP's save on the training's own group hangs, because the write's collectives and the step's
interleave on one group (FIELD-NOTES, measured 2026-12-04).

Each save is one ``kind: save`` line in metrics.jsonl (:meth:`MetricsLog.log_save`): ``blocked_s``
is the training time rank 0 lost to it (the small files and the staging copy, then, at the commit,
any wait for the background work, the manifest and the rename), ``total_s`` the time until it was
committed.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from fsdp_presets.checkpoint.layout import DCP_MODEL, DCP_OPTIMIZER
from fsdp_presets.checkpoint.manager import CheckpointManager, hash_share
from fsdp_presets.errors import (Finding, UsageError, disk_full_cause, disk_full_message, raise_on_every_rank,
                                 refused_write_class)
from fsdp_presets.faults import fault_point


def async_save_problem(accelerator, *, lora: bool, sharded_at_load: bool = False) -> str | None:
    """Why this run cannot save asynchronously, or None: the background write is DCP's, so the run
    must be FSDP2 with ``SHARDED_STATE_DICT`` training every weight (``sharded_at_load``: a Trainer's
    model transformers sharded over a TP/EP mesh, which launches without accelerate's FSDP2)."""
    if sharded_at_load:
        return ("--async-save writes accelerate's FSDP2 state, and a Trainer trains a model transformers sharded at "
                "load time (TP/EP) without it (its launch is the DDP-type NAME.trainer.yaml): drop --async-save; "
                "its checkpoints are written whole at each save")
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if accelerator.distributed_type.value != "FSDP" or plugin is None:
        return ("--async-save needs an FSDP accelerate config (sharded DCP checkpoints); this run is "
                f"{accelerator.distributed_type.value}: drop --async-save or launch with an FSDP2 config")
    state_dict_type = str(getattr(plugin.state_dict_type, "name", plugin.state_dict_type))
    if plugin.fsdp_version != 2 or not state_dict_type.endswith("SHARDED_STATE_DICT"):
        return (f"--async-save needs FSDP2 with SHARDED_STATE_DICT; this run is FSDP{plugin.fsdp_version} with "
                f"{state_dict_type}: drop --async-save or generate an FSDP2 config (fsdp-presets generate)")
    if lora:
        return ("--async-save saves every weight's shards and this is a LoRA/QLoRA run (trainable weights only, "
                "small and quick to save): drop --async-save")
    return None


@dataclass(kw_only=True)
class _InFlight:
    step: int
    samples_consumed: int
    temporary: Path
    written: Any
    """The background work: both DCP writes, then this rank's share of the hashing (a future)."""
    started: float
    blocked_s: float


@dataclass(kw_only=True)
class CheckpointSaver:
    """Every save of a run, synchronous or in the background (one instance per process)."""

    manager: CheckpointManager
    """Writes, commits and prunes the checkpoints."""
    background: bool
    """``--async-save``: write model and optimizer shards in the background."""
    on_saved: Callable[..., None]
    """Called with ``step, async_, blocked_s, total_s, bytes`` once a save is committed (the metrics line)."""
    write_state_files: Callable[[Path], None] | None = None
    """Writes, on every rank, what a background save holds besides the model and optimizer shards
    (None: accelerate's own files, as ``save_state`` writes them; the Trainer integration: Trainer's)."""
    records: list[dict[str, Any]] = field(default_factory=list)
    """One entry per committed save of this process (for the summary)."""
    _group: Any = None
    _worker: Any = None
    _file_system: Any = None
    _stagers: dict[str, Any] = field(default_factory=dict)
    _in_flight: _InFlight | None = None

    def __post_init__(self) -> None:
        if self.background:
            import torch.distributed as dist
            from concurrent.futures import ThreadPoolExecutor

            # The background writes' own gloo group, created once on every rank (NOTE above).
            self._group = dist.new_group(backend="gloo")
            # One thread per process writes the model's shards, then the optimizer's, then hashes this
            # rank's share of the files, at a lower scheduling priority than training (_yield_to_training).
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-write",
                                              initializer=_yield_to_training)
            from fsdp_presets.checkpoint.direct_write import HashingFileSystem

            # The thread's shard files: past the page cache, hashed as they are written (direct_write).
            self._file_system = HashingFileSystem()
            # Pruned checkpoints are deleted by the same thread (after the rename that takes them out of
            # the way, in the commit): a training step never waits for an old checkpoint's files to go.
            self.manager.delete_pruned = self._delete_in_background

    def _delete_in_background(self, folder: Path) -> None:
        import shutil

        if self._worker is None:  # closed: at once
            shutil.rmtree(folder, ignore_errors=True)
        else:
            self._worker.submit(shutil.rmtree, folder, ignore_errors=True)

    @property
    def accelerator(self):
        return self.manager.accelerator

    # ---- save ----
    def save(self, *, step: int, samples_consumed: int, write_extra: Callable[[Path], None] | None,
             wait: bool) -> Path | None:
        """Save step ``step`` (after any save in flight is committed). Synchronous, or with
        ``--async-save`` in the background; ``wait`` (the final save, Ctrl-C) commits it before
        returning. Returns the committed folder, or None while the write is in flight. Collective."""
        self.wait()
        started = time.perf_counter()
        if not self.background:
            committed, size = self.manager.commit(self.manager.write(step, write_extra), step=step,
                                                  samples_consumed=samples_consumed)
            elapsed = time.perf_counter() - started
            self._record(step=step, background=False, blocked_s=elapsed, total_s=elapsed, size=size)
            return committed
        temporary = self.manager.begin_save(step)
        try:
            staged = self._start_background(temporary, step=step, write_extra=write_extra)
        except BaseException as error:
            self.manager.stop_if_disk_full(error, step=step, temporary=temporary)
            raise
        accelerator = self.accelerator
        written = self._worker.submit(_write_then_hash, staged, temporary, group=self._group,
                                      file_system=self._file_system, rank=accelerator.process_index,
                                      world_size=accelerator.num_processes)
        self._in_flight = _InFlight(step=step, samples_consumed=samples_consumed, temporary=temporary,
                                    written=written, started=started, blocked_s=time.perf_counter() - started)
        return self.wait() if wait else None

    def _start_background(self, temporary: Path, *, step: int, write_extra) -> list[tuple[str, Any]]:
        """The small files now; the model and optimizer shards staged (copied into host memory) for
        the background write: ``(folder name, staged state dict)`` of each."""
        import torch
        from accelerate.checkpointing import save_accelerator_state
        from accelerate.utils.fsdp_utils import _get_model_state_dict, _prepare_sd_options
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        accelerator = self.accelerator
        temporary.mkdir(parents=True, exist_ok=True)  # every rank: save_state makes it too
        if self.write_state_files is not None:
            self.write_state_files(temporary)
        else:  # What save_state writes besides the FSDP model and optimizer (scheduler, random states, scaler).
            save_accelerator_state(str(temporary), [], [], accelerator._schedulers, accelerator._dataloaders,
                                   accelerator.state.process_index, accelerator.step, accelerator.scaler)
        if accelerator.is_main_process and write_extra is not None:
            write_extra(temporary)
        fault_point("async-save", step=step, rank=accelerator.process_index, folder=temporary)
        options = _prepare_sd_options(accelerator.state.fsdp_plugin)
        [model], [optimizer] = accelerator._models, accelerator._optimizers
        model_state = _get_model_state_dict(model, sd_options=options)
        optimizer_state = get_optimizer_state_dict(model, getattr(optimizer, "optimizer", optimizer), options=options)
        staged = []
        for key, state, name in (("model", model_state, DCP_MODEL), ("optimizer", optimizer_state, DCP_OPTIMIZER)):
            (temporary / name).mkdir(parents=True, exist_ok=True)
            # One DCP stager per folder kind for the whole run (host memory, no pinning on a CPU-only
            # host), which keeps its copies' storage between saves: no fresh allocation of the rank's
            # shards per save. Safe: the next save stages only after this one's write finished (wait()).
            stager = self._stagers.get(name)
            if stager is None:
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

                on_gpu = torch.cuda.is_available()
                stager = self._stagers[name] = DefaultStager(StagingOptions(
                    use_pinned_memory=on_gpu, use_shared_memory=False, use_async_staging=False,
                    use_non_blocking_copy=False))
            # The copy is done when stage() returns: the files hold this step's values while training moves on.
            staged.append((name, stager.stage({key: state})))
        return staged

    # ---- commit ----
    def poll(self, *, step: int) -> None:
        """At the end of step ``step``: commit the save in flight if every rank's write has finished.
        Collective (one small all-reduce while a save is in flight, nothing otherwise)."""
        if self._in_flight is None:
            return
        fault_point("save-in-flight", step=step, rank=self.accelerator.process_index)
        local = 1.0 if self._in_flight.written.done() else 0.0
        if self._agree(local, reduction="min") > 0:
            self.wait()

    def wait(self) -> Path | None:
        """Wait for the save in flight, if any, and commit it; returns the committed folder (None
        when nothing was in flight). A write that failed on any rank stops the run on every rank
        (:class:`Finding`) naming the last committed checkpoint. Collective."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return None
        waited_from = time.perf_counter()
        failure: BaseException | None = None
        hashed = None
        try:
            hashed = in_flight.written.result()
        except BaseException as error:  # noqa: BLE001 (reported on every rank below)
            failure = error
        if self._agree(1.0 if failure else 0.0, reduction="max") > 0:
            self._stop(in_flight, failure)
        committed, size = self.manager.commit(in_flight.temporary, step=in_flight.step,
                                              samples_consumed=in_flight.samples_consumed, hashed=hashed)
        now = time.perf_counter()  # waiting for the writes and the commit (hashing, manifest) block training too
        self._record(step=in_flight.step, background=True, blocked_s=in_flight.blocked_s + now - waited_from,
                     total_s=now - in_flight.started, size=size)
        return committed

    def close(self) -> None:
        """The end of the run: commit the save in flight, if any, and end the background thread. Collective."""
        self.wait()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        for stager in self._stagers.values():
            stager.close()
        self._stagers.clear()

    def _stop(self, in_flight: _InFlight, failure: BaseException | None) -> None:
        from accelerate.utils import gather_object

        accelerator = self.accelerator
        mine = f"rank {accelerator.process_index}: {_first_line(failure)}" if failure else None
        reports = gather_object([mine]) if accelerator.num_processes > 1 else [mine]
        first = next((report for report in reports if report), "unknown error")
        self.manager.abandon(in_flight.temporary)
        accelerator.wait_for_everyone()
        kept = self.manager.kept_note()
        cause = disk_full_cause(failure, in_flight.temporary) if failure else None
        what = f"writing the checkpoint of step {in_flight.step} in the background"
        message = (disk_full_message(cause, what, self.manager.directory, kept=kept) if cause else
                   f"{what} failed ({first}); the run stopped and its unfinished folder was removed. {kept} "
                   "Fix the cause (a writable output folder with space), then run the same command again")
        raise_on_every_rank(accelerator, message, error=refused_write_class(message) if cause else Finding)

    def _agree(self, local: float, *, reduction: str) -> float:
        accelerator = self.accelerator
        if accelerator.num_processes == 1:
            return local
        import torch
        import torch.distributed as dist

        value = torch.tensor(local, dtype=torch.float64, device=accelerator.device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN if reduction == "min" else dist.ReduceOp.MAX)
        return value.item()

    def _record(self, *, step: int, background: bool, blocked_s: float, total_s: float, size: int) -> None:
        record = {"step": step, "async_": background, "blocked_s": blocked_s, "total_s": total_s, "bytes": size}
        self.records.append(record)
        self.on_saved(**record)

    def summary(self) -> str | None:
        """One line about this run's saves (main process values), or None when none was made."""
        if not self.records:
            return None
        from fsdp_presets.fileio import format_bytes

        count = len(self.records)
        blocked = sum(record["blocked_s"] for record in self.records) / count
        total = sum(record["total_s"] for record in self.records) / count
        mode = "in the background (--async-save)" if self.background else "synchronously"
        return (f"saves: {count} {mode}, training blocked {blocked:.2f} s per save on average, "
                f"{total:.2f} s until committed, {format_bytes(self.records[-1]['bytes'])} each")


def _write_then_hash(staged: list[tuple[str, Any]], folder: Path, *, group: Any, file_system: Any, rank: int,
                     world_size: int) -> list[tuple[str, str, int]]:
    """In the background: write each staged state dict into its folder through DCP on the writes' own
    group (each ``dcp.save`` returns once every rank's files and the metadata are written, and raises
    on every rank when one rank's write failed), the rank's shard files through ``file_system``
    (:class:`~fsdp_presets.checkpoint.direct_write.HashingFileSystem`: hashed as they are written),
    then hash the rest of this rank's share of the complete folder."""
    import torch.distributed.checkpoint as dcp

    from fsdp_presets.checkpoint.direct_write import HashingWriter

    file_system.digests.clear()
    for name, state in staged:
        dcp.save(state, storage_writer=HashingWriter(folder / name, file_system), process_group=group,
                 planner=_planner_classes()[name](enable_plan_caching=True))
    written = {str(path.relative_to(folder)): digest for path, digest in file_system.digests.items()}
    return hash_share(folder, rank=rank, world_size=world_size, written=written)


@functools.cache
def _planner_classes() -> dict[str, type]:
    """DCP's default save planner, one subclass per folder: with plan caching, DCP keeps the plans of
    a save by planner class and reuses them while every rank's plan is unchanged (the same shards
    every save), so the coordinator neither merges nor validates the plans again and the ranks
    exchange empty ones; a class each keeps the model's plans apart from the optimizer's."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    return {name: type(f"_{kind}SavePlanner", (DefaultSavePlanner,), {"__module__": __name__})
            for name, kind in ((DCP_MODEL, "Model"), (DCP_OPTIMIZER, "Optimizer"))}


BACKGROUND_NICE = 19
"""Scheduling priority (Linux ``nice``) of the background writer thread: the lowest, so that where
training keeps every core busy (a CPU-only host) the write takes the time training leaves idle
before it takes the training's own."""


def _yield_to_training() -> None:
    """The background thread's initializer: lower its own priority (on Linux ``nice`` is per thread:
    the training thread and the rest of the process keep theirs; elsewhere nothing changes)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (AttributeError, OSError):
        pass


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    detail = text[0] if text else ""
    return f"{type(error).__name__}: {detail[:300]}" if detail else type(error).__name__


def check_async_save(accelerator, *, lora: bool) -> None:
    """Refuse ``--async-save`` where it cannot work (every rank decides alike; exit 2)."""
    raise_on_every_rank(accelerator, async_save_problem(accelerator, lora=lora), error=UsageError)
