"""Trainer's own saves under ``FSDPPresetsCallback``: every ``checkpoint-N`` through the recipes'
checkpoint manager under Trainer's names (:data:`fsdp_presets.checkpoint.manager.TRAINER_NAMING`),
and ``save_model``'s folder.

A synchronous save (``Trainer._save_checkpoint``: ``save_model`` (no weights under
``SHARDED_STATE_DICT``), then accelerate's ``save_fsdp_model`` and ``save_fsdp_optimizer`` (DCP,
every rank), the scheduler, the scaler, every rank's RNG state, ``trainer_state.json``, then the
rotation of old checkpoints) writes ``checkpoint-N`` emptied first (a killed run's leftover of that
step would stay beside the new files); then Trainer's pickled ``training_args.bin`` is replaced by
``training_args.json`` (a checkpoint holds data only: a pickle runs code when it is loaded), the
ranks hash their shares and the manifest is written (the commit), and Trainer's rotation runs, after
the commit rather than before it: it would remove the last committed checkpoint for one that is not
committed yet.

``FSDPPresetsCallback(async_save=True)`` (``recipes/sft_trainer.py --async-save``) writes the model
and optimizer shards in the background through the recipes' writer
(:class:`fsdp_presets.checkpoint.async_save.CheckpointSaver`):

1. the save in flight, if any, is committed first (at most one in flight);
2. Trainer's own ``_save_checkpoint`` runs with its model and optimizer writes left out
   (:meth:`TrainerSaves.save_optimizer_and_scheduler` writes only the scheduler, as Trainer does)
   and its rotation deferred: every other file is Trainer's, written by Trainer, at once;
3. the writer stages this rank's model and optimizer shards in host memory and hands them to DCP's
   ``async_save`` into ``pytorch_model_fsdp_0/`` and ``optimizer_0/`` (the folders and keys
   ``save_fsdp_model``/``save_fsdp_optimizer`` write, so Trainer's resume reads them unchanged), on
   gloo process groups of their own; training goes on;
4. once every rank's background write has finished (asked at each optimizer step's end, one small
   all-reduce; the next save, a preemption, ``train()``'s end and ``save_model`` wait for it), the
   manifest is written (the commit) and then Trainer's rotation runs, so it never removes the last
   committed checkpoint for one still in flight.

A model transformers sharded at load time (``from_pretrained(distributed_config=...)``, FSDP2 x TP or
x EP): Trainer refuses to checkpoint it unless ``save_only_model=True`` ("Resuming is not supported"),
and its own optimizer save would write rank 0's shards alone. Its ``checkpoint-N`` is
written here whole: the model and optimizer as DCP of its 2-D DTensors into ``pytorch_model_fsdp_0/``
and ``optimizer_0/`` (the folders and keys accelerate's FSDP2 saves write, so a resume on another mesh
or under plain FSDP2 reshards them on load), then Trainer's scheduler, RNG and ``trainer_state.json``
files, whatever ``save_only_model`` says; ``resume_from_checkpoint`` loads them back
(:meth:`TrainerSaves.load_from_checkpoint`, :meth:`TrainerSaves.load_optimizer_and_scheduler`) and
Trainer skips the data already trained on as for any run; ``load_best_model_at_end`` loads the best
one's model shards (:meth:`TrainerSaves.load_best_model`).

Until its manifest is written a ``checkpoint-N`` is not committed, and
``trainer.train(resume_from_checkpoint=True)`` with the callback skips it for the newest committed
one (:func:`fsdp_presets.checkpoint.manager.trainer_resume_choice`).
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import Callable

from fsdp_presets.checkpoint.layout import TRAINER_ARGS_JSON, TRAINER_ARGS_PICKLE, RunFolder, trainer_checkpoint_name
from fsdp_presets.checkpoint.manager import TRAINER_NAMING, CheckpointManager
from fsdp_presets.checkpoint.run_folder import (RunInfo, distributed_settings, launch_config_file, run_identity,
                                                training_settings)
from fsdp_presets.errors import UsageError
from fsdp_presets.faults import fault_point
from fsdp_presets.fileio import config_digest, write_text_atomic
from fsdp_presets.train import lora
from fsdp_presets.train.model_mesh import is_sharded_by_transformers, mesh_settings


class TrainerSaves:
    """The saves of one Trainer (one instance per process): :meth:`begin` and :meth:`close` frame
    each ``train()``; the other methods stand in for Trainer's own."""

    def __init__(self, trainer, *, async_save: bool, adapter_keys: dict[str, str] | None,
                 say: Callable[[str], None]) -> None:
        self.trainer, self.async_save, self.adapter_keys, self.say = trainer, async_save, adapter_keys, say
        self.checkpoints: CheckpointManager | None = None  # during train()
        self.saver = None  # during train() with async_save: the background writer (CheckpointSaver)
        self.metrics = None
        self.saved_step: int | None = None
        self._trainer_save = None  # async_save, during a save: Trainer's own _save_checkpoint of that step
        self._save_total_limit = None  # during a save: the user's save_total_limit (Trainer's is set aside)

    def begin(self, metrics, *, global_batch: int, resumed_from: str | os.PathLike | None, started_on: str) -> None:
        """The start of a ``train()``: its run.json (main process; ``started_on``: the run's first day),
        its checkpoint manager and, with async_save, its background writer."""
        trainer = self.trainer
        accelerator, args = trainer.accelerator, trainer.args
        model = accelerator.unwrap_model(trainer.model)
        self.metrics, self.global_batch = metrics, global_batch
        distributed = distributed_settings(accelerator, model_mesh=mesh_settings(model))  # a TP/EP mesh too
        if accelerator.is_main_process:
            identity = run_identity(recipe=type(trainer).__name__, seed=args.seed,
                                    model=str(getattr(trainer.model.config, "_name_or_path", "") or ""))
            RunInfo(identity=identity, settings=training_settings(args), training=lora.settings_of(trainer.model),
                    max_steps=args.max_steps, micro_batch_size=args.per_device_train_batch_size,
                    gradient_accumulation_steps=args.gradient_accumulation_steps, global_batch_samples=global_batch,
                    distributed=distributed, accelerate_config=launch_config_file(),
                    resumed_from=str(resumed_from) if resumed_from else None, started_on=started_on,
                    ).write(RunFolder(root=Path(args.output_dir)))
        self.checkpoints = CheckpointManager(
            accelerator=accelerator, directory=Path(trainer.args.output_dir), keep_last=1,
            config_digest=config_digest(model.config), distributed=distributed, log=self.say,
            training=lora.settings_of(model), naming=TRAINER_NAMING, rotate=self._rotate)
        if self.async_save:
            from fsdp_presets.checkpoint.async_save import CheckpointSaver

            self.saver = CheckpointSaver(manager=self.checkpoints, background=True, on_saved=metrics.log_save,
                                         write_state_files=self._write_trainer_files)

    def wait(self) -> None:
        """async_save: the save in flight, if any, committed. Collective."""
        if self.saver is not None:
            self.saver.wait()

    def poll(self, step: int) -> None:
        """async_save: the save in flight committed if every rank's write is done. Collective."""
        if self.saver is not None:
            self.saver.poll(step=step)

    def close(self) -> None:
        """The last save in flight committed; the background writer ended. Collective."""
        saver, self.saver = self.saver, None
        if saver is not None:
            saver.close()

    def checkpoint(self, step: int) -> Path | None:
        """The committed ``checkpoint-N`` of ``step``, None when it has none."""
        committed = dict(TRAINER_NAMING.committed(Path(self.trainer.args.output_dir)))
        return committed.get(step)

    # ---- checkpoint-N ----
    def save_checkpoint(self, original, model, trial, *args, **kwargs):
        trainer, accelerator = self.trainer, self.trainer.accelerator
        step = trainer.state.global_step
        folder = Path(trainer.args.output_dir) / trainer_checkpoint_name(step)
        started = time.perf_counter()
        save_total_limit, trainer.args.save_total_limit = trainer.args.save_total_limit, None
        self._save_total_limit = save_total_limit  # a save in flight committed by this one rotates with it
        # a model sharded at load time: the whole state, whatever save_only_model (see the module notes)
        save_only_model = trainer.args.save_only_model
        trainer.args.save_only_model = save_only_model and not self._sharded_at_load
        try:
            if self.saver is not None:  # async_save: Trainer's files now, the shards in the background
                self._trainer_save = functools.partial(original, model, trial, *args, **kwargs)
                # The last step's save is committed at once: no training is left to overlap, and the
                # end of train() reads (load_best_model_at_end) or removes (save_total_limit=1 and a
                # best checkpoint) checkpoints, which must not meet a folder still being written.
                self.saver.save(step=step, samples_consumed=step * self.global_batch, write_extra=None,
                                wait=step >= trainer.state.max_steps)
            else:
                self.checkpoints.begin_save(step)
                original(model, trial, *args, **kwargs)
        finally:
            trainer.args.save_total_limit, trainer.args.save_only_model = save_total_limit, save_only_model
            self._trainer_save, self._save_total_limit = None, None
        # drills: sync, Trainer's files written and no manifest yet; async, the shards still being written
        fault_point("during-save", step=step, rank=accelerator.process_index, folder=folder)
        self.saved_step = step
        if self.saver is not None:
            return
        if accelerator.is_main_process:
            self.settings_as_json(folder)
        _, size = self.checkpoints.commit(folder, step=step, samples_consumed=step * self.global_batch)
        elapsed = time.perf_counter() - started
        self.metrics.log_save(step=step, async_=False, blocked_s=elapsed, total_s=elapsed, bytes=size)

    def _write_trainer_files(self, folder: Path) -> None:
        """async_save, on every rank: Trainer's own ``_save_checkpoint`` of this step without its
        FSDP model and optimizer writes (:meth:`save_optimizer_and_scheduler`), then data only."""
        self._trainer_save()
        if self.trainer.accelerator.is_main_process:
            self.settings_as_json(folder)

    def save_optimizer_and_scheduler(self, original, output_dir):
        if self._sharded_at_load:
            self._sharded_state(output_dir, save=True, model=False)
            return save_scheduler(self.trainer, output_dir)
        if self._trainer_save is None:
            return original(output_dir)
        save_scheduler(self.trainer, output_dir)  # the shards: by the background writer

    # ---- a model sharded at load time: model and optimizer as DCP (see the module notes) ----
    @property
    def _sharded_at_load(self) -> bool:
        return is_sharded_by_transformers(self.trainer.model)

    def load_from_checkpoint(self, original, resume_from_checkpoint, model=None):
        if not self._sharded_at_load:
            return original(resume_from_checkpoint, model)
        self._sharded_state(resume_from_checkpoint, save=False, model=True)

    def load_optimizer_and_scheduler(self, original, checkpoint):
        if not self._sharded_at_load or checkpoint is None:
            return original(checkpoint)
        self._sharded_state(checkpoint, save=False, model=False)
        load_scheduler(self.trainer, checkpoint)

    def load_best_model(self, original):
        """``load_best_model_at_end``: Trainer looks for a weights file its own saves write, which a
        model sharded at load time has not (its checkpoints are DCP): the best checkpoint's model
        shards are loaded back here instead (Trainer alone warns and keeps the last weights)."""
        if not self._sharded_at_load:
            return original()
        self._sharded_state(self.trainer.state.best_model_checkpoint, save=False, model=True)

    def _sharded_state(self, folder, *, save: bool, model: bool) -> None:
        """The model's (``model``) or the optimizer's state as DCP in accelerate's FSDP2 layout
        (``pytorch_model_fsdp_0/`` under ``model``, ``optimizer_0/`` under ``optimizer``), saved or
        loaded in place (DCP reshards what another mesh saved). Collective."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                             set_model_state_dict, set_optimizer_state_dict)

        from fsdp_presets.checkpoint.layout import DCP_METADATA, DCP_MODEL, DCP_OPTIMIZER
        from fsdp_presets.checkpoint.safe_unpickle import safe_dcp_load

        trainer = self.trainer
        network = trainer.model  # the DTensor parameters themselves (the Trainer does not wrap this model)
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        key, name = ("model", DCP_MODEL) if model else ("optimizer", DCP_OPTIMIZER)
        target = Path(folder) / name
        if not save and not (target / DCP_METADATA).is_file():
            raise UsageError(f"resume_from_checkpoint {folder}: no {name}/ (DCP) in it, so it was not saved from a "
                             "model sharded at load time with FSDPPresetsCallback; resume from a checkpoint-N this "
                             "callback wrote")
        state = {key: get_model_state_dict(network) if model else get_optimizer_state_dict(network, optimizer)}
        if save:
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(target)))
            return
        safe_dcp_load(state, target, no_dist=False)
        if model:
            set_model_state_dict(network, state[key])
        else:
            set_optimizer_state_dict(network, optimizer, state[key])

    def _rotate(self) -> None:
        """Trainer's own rotation with the user's ``save_total_limit`` (set aside while Trainer saves)."""
        trainer = self.trainer
        rotate(trainer, save_total_limit=trainer.args.save_total_limit if self._save_total_limit is None
               else self._save_total_limit)

    def settings_as_json(self, folder: Path) -> None:
        """Data only: Trainer's pickle of TrainingArguments in ``folder`` replaced by the same settings
        as JSON (a pickle runs code when it is loaded). Main process."""
        pickled = folder / TRAINER_ARGS_PICKLE
        if pickled.is_file():
            write_text_atomic(folder / TRAINER_ARGS_JSON, self.trainer.args.to_json_string())
            pickled.unlink()

    # ---- save_model ----
    def save_model(self, original, output_dir=None, _internal_call=False):
        trainer, accelerator = self.trainer, self.trainer.accelerator
        plugin = getattr(accelerator.state, "fsdp_plugin", None)
        if _internal_call and self._sharded_at_load:  # checkpoint-N: the shards, not a gathered folder
            self._sharded_state(output_dir, save=True, model=True)
            if accelerator.is_main_process:  # the settings Trainer's own save writes, as data (settings_as_json)
                write_text_atomic(Path(output_dir) / TRAINER_ARGS_JSON, trainer.args.to_json_string())
            return None
        if _internal_call:
            return original(output_dir, _internal_call)
        self.wait()  # async_save: save_model inside train() (a callback's) waits too
        if not trainer.is_fsdp_enabled or plugin is None:
            result = original(output_dir, _internal_call)
            self._after_save_model(output_dir)
            return result
        if self.adapter_keys is not None:
            return self._save_adapter(Path(output_dir or trainer.args.output_dir))
        previous = plugin.state_dict_type
        if "FULL_STATE_DICT" not in str(previous):
            self.say(f"save_model({output_dir or trainer.args.output_dir}): the preset checkpoints with "
                     f"{getattr(previous, 'name', previous)}, under which Trainer writes no weights; gathering the "
                     "full state dict to rank 0 with CPU offload (accelerate get_state_dict, FULL_STATE_DICT) for "
                     "this save")
            plugin.set_state_dict_type("FULL_STATE_DICT")
        try:
            result = original(output_dir, _internal_call)
        finally:
            plugin.set_state_dict_type(previous)
        # Under FSDP the save is collective (the gather), but Trainer returns on the other ranks as soon
        # as they have sent their shards, while rank 0 still writes. Every rank returns once the folder
        # is complete, so a script may read it on any rank next.
        accelerator.wait_for_everyone()
        self._after_save_model(output_dir)
        return result

    def _after_save_model(self, output_dir) -> None:
        if self.trainer.accelerator.is_main_process:
            folder = Path(output_dir or self.trainer.args.output_dir)
            if folder.is_dir():
                self.settings_as_json(folder)

    def _save_adapter(self, output_dir: Path) -> None:
        """A peft model's ``save_model`` under FSDP: only the trainable weights are gathered (torch's
        ``get_model_state_dict(ignore_frozen_params=True)``), and rank 0 writes the PEFT folder under
        the key names peft gave them before FSDP wrapped the model (peft's own ``save_pretrained`` on
        an FSDP1-wrapped model writes an empty adapter), as the recipes export it. The files go into
        ``output_dir`` beside what it holds, as Trainer's own save puts them (``save_model()`` with
        no folder writes into the output folder, next to ``checkpoint-N`` and the metrics)."""
        from fsdp_presets.train.final_adapter import export_adapter

        trainer = self.trainer
        self.say(f"save_model({output_dir}): the PEFT adapter under FSDP: its trainable weights gathered from the "
                 "shards (the frozen base is not gathered), written by rank 0 under peft's key names")
        # the tokenizer Trainer's own save writes: processing_class, else the collator's
        tokenizer = trainer.processing_class or getattr(trainer.data_collator, "tokenizer", None)
        export_adapter(trainer.accelerator, trainer.model_wrapped, tokenizer, output_dir, key_map=self.adapter_keys,
                       merge=True)  # complete before any file of it is moved into output_dir


def save_scheduler(trainer, output_dir: str) -> None:
    """The scheduler file Trainer's ``_save_optimizer_and_scheduler`` writes (main process), without
    its synchronous FSDP model and optimizer save (written in the background instead)."""
    import warnings

    import torch
    from transformers.trainer import SCHEDULER_NAME
    from transformers.trainer_pt_utils import reissue_pt_warnings

    if trainer.args.should_save:
        with warnings.catch_warnings(record=True) as caught_warnings:
            torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
        reissue_pt_warnings(caught_warnings)


def load_scheduler(trainer, checkpoint: str) -> None:
    """The scheduler state :func:`save_scheduler` wrote, loaded as Trainer loads it (``weights_only``)."""
    import torch
    from transformers.trainer import SCHEDULER_NAME

    trainer.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))


def rotate(trainer, *, save_total_limit: int | None) -> None:
    """Trainer's own rotation of old ``checkpoint-N`` folders (main process), run after a commit."""
    from transformers.trainer_utils import rotate_checkpoints

    rotate_checkpoints(output_dir=trainer._get_output_dir(trial=None), save_total_limit=save_total_limit,
                       best_model_checkpoint=trainer.state.best_model_checkpoint, use_mtime=True)
