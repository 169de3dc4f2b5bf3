"""``FSDPPresetsCallback``: a ``transformers.Trainer`` (or TRL trainer) script launched with a
preset gets what the recipes give, with one added line::

    from fsdp_presets import FSDPPresetsCallback
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[FSDPPresetsCallback()])

    accelerate launch --config_file accelerate_configs/cpu_fsdp2_demo.yaml train.py

- Made before the ``Trainer``, it switches on real FSDP on a CPU-only host
  (:func:`fsdp_presets.enable_cpu_fsdp`); once the Trainer exists it refuses a launch whose
  processes would each train alone (:func:`fsdp_presets.check_launch`), and at ``train()``, before
  anything is written, as the recipes do, a launch that is not what the generated preset's header
  planned (:func:`fsdp_presets.train.startup.preset_launch_problem`; another process count is
  fine for a resume) or whose config wraps block classes the model does not have
  (:func:`fsdp_presets.train.model_setup.check_wrap_classes`): one line, exit 2 on every rank.
- ``trainer.save_model(dir)`` writes a complete Hugging Face folder (or the PEFT adapter) whatever
  the preset's state-dict type: Trainer writes weights under FSDP only for FULL_STATE_DICT and
  silently writes nothing under SHARDED_STATE_DICT (transformers issue 30491), so around a
  user's ``save_model`` the plugin is switched to FULL_STATE_DICT, whose gather
  (``accelerator.get_state_dict``) collects the full state on rank 0 with CPU offload. A peft
  model's adapter is gathered alone and written as the recipes export it
  (:func:`fsdp_presets.train.final_adapter.export_adapter`): peft's own save of an FSDP1-wrapped model
  writes an adapter with no tensors. Under FSDP, ``save_model`` returns on every rank once the
  folder is written.
- ``OUTPUT_DIR/run.json`` and ``OUTPUT_DIR/metrics.jsonl`` as the recipes write them: one line per
  optimizer step with the exact loss (not rounded nor averaged over ``logging_steps``), gradient
  norm, learning rate, tokens per second and the step's wall time, so ``fsdp-presets compare``
  reads the run.
- every ``checkpoint-N`` Trainer writes gets a ``trainer``-kind manifest (SHA-256 of every file,
  step, samples, world size), so ``fsdp-presets inspect-checkpoint`` verifies it and ``export``
  takes it; Trainer's pickled ``training_args.bin`` is replaced there by ``training_args.json``
  (a checkpoint holds data only: a pickle runs code when loaded); the same in ``save_model``'s folder.
- ``trainer.train(resume_from_checkpoint=...)`` at another process count keeps the global batch
  (it changes ``gradient_accumulation_steps`` and says so), or refuses in one line saying how.
  ``resume_from_checkpoint=True`` takes the newest *committed* ``checkpoint-N`` (one with its
  manifest), not a folder a killed run left half-written.
- Ctrl-C and preemption, as in the recipes (:mod:`fsdp_presets.train.signals`): on Ctrl-C during
  training, or on SIGTERM or SIGUSR1 (``FSDPPresetsCallback(preempt_signals="none")`` turns those
  off), the ranks agree at the next optimizer-step boundary, Trainer saves ``checkpoint-N`` of the
  step reached through its own ``_save_checkpoint`` (with its manifest) and every rank exits with
  status 130 (Ctrl-C) or 75 (a preemption, with a ``preempted`` line in ``metrics.jsonl``);
  ``trainer.train(resume_from_checkpoint=True)`` continues from it.
- ``FSDPPresetsCallback(async_save=True)`` (FSDP2, ``SHARDED_STATE_DICT``, every weight trained):
  each ``checkpoint-N``'s model and optimizer shards are written in the background while training
  goes on, committed (its manifest) once every rank's write has finished, at most one save in
  flight (:mod:`fsdp_presets.train.trainer_saves`). Every save, synchronous or not, is one ``save``
  line in ``metrics.jsonl``.
- gradient clipping (``max_grad_norm``) with the recipes' norm
  (:func:`fsdp_presets.numerics.clip_grad_norm`): accelerate's norm is summed in the gradients'
  dtype in an order that depends on the sharding, so an FSDP run's clip coefficient differed from
  its DDP baseline's in the last bits (float32) or by a bfloat16 step (TRL's QLoRA adapters), and
  its losses drifted from the baseline's; with this norm they are equal, bit for bit.

NOTE: a ``TrainerCallback`` is given no reference to its Trainer, and the exact loss, the
gradient norm and the user's ``save_model`` calls never reach a callback event. The callback
finds its Trainer once, at ``on_init_end`` (called at the end of ``Trainer.__init__``), and wraps
eight of that instance's methods (``train``, ``training_step``, ``_clip_grad_norm``,
``_get_grad_norm``, ``_maybe_log_save_evaluate``, ``save_model``, ``_save_checkpoint``,
``_save_optimizer_and_scheduler``): the class and other Trainers are untouched.
"""

from __future__ import annotations

import functools
import inspect
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, NoReturn

from transformers import Trainer, TrainerCallback

from fsdp_presets.checkpoint.layout import (MANIFEST, METRICS, TRAINER_ARGS_JSON, TRAINER_ARGS_PICKLE, RunFolder,
                                            trainer_checkpoint_name)
from fsdp_presets.checkpoint.manifest import TRAINER_KIND, Manifest
from fsdp_presets.checkpoint.resume import TRAINER_RESUME, accumulation_for
from fsdp_presets.checkpoint.run_folder import distributed_settings, launch_config_file, write_run_json
from fsdp_presets.errors import Finding, UsageError, raise_on_every_rank
from fsdp_presets.faults import fault_point
from fsdp_presets.fileio import config_digest, sha256_file, write_json_atomic, write_text_atomic
from fsdp_presets.train import lora, signals, trainer_saves
from fsdp_presets.train.metrics import MetricsLog, device_memory_peaks


def _calling_trainer() -> Trainer | None:
    """The Trainer whose ``__init__`` is running the callback event (see the module's NOTE)."""
    frame = inspect.currentframe()
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    return None


def _number(value) -> float | None:
    """A float from a tensor (DTensor included), a number, or None."""
    if value is None:
        return None
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return float(value.item() if hasattr(value, "item") else value)


class FSDPPresetsCallback(TrainerCallback):
    """The recipes' guarantees for a Trainer/TRL script (see the module docstring)."""

    def __init__(self, preempt_signals: str = signals.DEFAULT_SIGNALS, async_save: bool = False) -> None:
        from fsdp_presets.cpu_fsdp import enable_cpu_fsdp

        self._signals = signals.parse_signals(preempt_signals)  # "none": no preemption saves
        self._async_save = async_save  # checkpoint-N's model and optimizer shards written in the background
        self._saver = None  # during train() with async_save: the background writer (CheckpointSaver)
        enable_cpu_fsdp()  # before the Trainer builds its Accelerator
        self._saved_step: int | None = None
        self.trainer: Trainer | None = None
        self.metrics: MetricsLog | None = None
        self._step_loss = 0.0
        self._step_tokens = 0.0
        self._step_started: float | None = None
        self._logged_step = 0
        self._adapter_keys: dict[str, str] | None = None  # a peft model's trainable names -> peft's keys
        self._trainer_save = None  # async_save, during a save: Trainer's own _save_checkpoint of that step
        self._save_total_limit = None  # during a save: the user's save_total_limit (Trainer's is set aside)

    # ---- attach ----
    def on_init_end(self, args, state, control, **kwargs):
        trainer = _calling_trainer()
        if trainer is None:
            raise RuntimeError("FSDPPresetsCallback: no Trainer found calling on_init_end; pass the callback to "
                               "Trainer(callbacks=[FSDPPresetsCallback()])")
        if self.trainer is trainer:
            return control
        self.trainer = trainer
        from fsdp_presets.cpu_fsdp import check_launch

        check_launch(trainer.accelerator)  # N processes that would each train alone: refused
        if lora.settings_of(trainer.model) is not None:  # before FSDP wraps it: peft's names of the adapter
            self._adapter_keys = lora.adapter_key_map(trainer.model)
            lora.keep_4bit_layout(trainer.model)  # QLoRA: an evaluation must not repack the sharded 4-bit weights
        for name in ("train", "training_step", "_clip_grad_norm", "_get_grad_norm", "_maybe_log_save_evaluate",
                     "save_model", "_save_checkpoint", "_save_optimizer_and_scheduler"):
            setattr(trainer, name, functools.partial(getattr(self, f"_{name.lstrip('_')}"), getattr(trainer, name)))
        return control

    @property
    def _accelerator(self):
        return self.trainer.accelerator

    def _say(self, message: str) -> None:
        if self._accelerator.is_main_process:
            print(f"fsdp-presets: {message}", flush=True)

    def _refuse(self, message: str) -> NoReturn:
        """One line on the main process and exit 2 on every rank, as the recipes refuse bad input."""
        try:
            raise_on_every_rank(self._accelerator, message)
        except UsageError as error:
            self._exit(error)

    def _exit(self, error: BaseException) -> NoReturn:
        """The recipes' one line (main process) and exit status (:func:`fsdp_presets.train.signals.report`)."""
        raise SystemExit(signals.report(error, program="fsdp-presets")) from None

    def _global_batch(self) -> int:
        args = self.trainer.args
        return args.per_device_train_batch_size * args.gradient_accumulation_steps * self._data_parallel_size()

    def _data_parallel_size(self) -> int:
        return distributed_settings(self._accelerator)["data_parallel_size"]

    # ---- train: resume check, run.json, metrics log ----
    def _train(self, original, resume_from_checkpoint=None, *args, **kwargs):
        trainer = self.trainer
        if resume_from_checkpoint is True:
            resume_from_checkpoint = self._newest_committed(Path(trainer.args.output_dir))
        checkpoint = resume_from_checkpoint if resume_from_checkpoint is not True else None
        self._check_launch(resuming=bool(checkpoint))
        step = 0
        if checkpoint:
            step = self._keep_global_batch(Path(checkpoint))
            resume_from_checkpoint = str(checkpoint)
        output = Path(trainer.args.output_dir)
        if self._accelerator.is_main_process:
            model = trainer.model
            settings = distributed_settings(self._accelerator)
            write_run_json(RunFolder(root=output), {
                "recipe": type(trainer).__name__, "model": str(getattr(model.config, "_name_or_path", "") or ""),
                "seed": trainer.args.seed, "learning_rate": trainer.args.learning_rate,
                "lr_scheduler": str(getattr(trainer.args.lr_scheduler_type, "value", trainer.args.lr_scheduler_type)),
                "warmup_steps": trainer.args.warmup_steps, "weight_decay": trainer.args.weight_decay,
                "max_grad_norm": trainer.args.max_grad_norm, "training": lora.settings_of(model),
                "max_steps": trainer.args.max_steps, "micro_batch_size": trainer.args.per_device_train_batch_size,
                "gradient_accumulation_steps": trainer.args.gradient_accumulation_steps,
                "global_batch_samples": self._global_batch(), **settings,
                "accelerate_config": launch_config_file(), "resumed_from": str(checkpoint) if checkpoint else None})
        self.metrics = MetricsLog(output / METRICS, enabled=self._accelerator.is_main_process, keep_through_step=step)
        self._logged_step = step
        if self._async_save:
            from fsdp_presets.checkpoint.async_save import CheckpointSaver

            checkpoints = trainer_saves.TrainerCheckpoints(accelerator=self._accelerator, directory=output,
                                                           commit_folder=self._commit)
            self._saver = CheckpointSaver(manager=checkpoints, background=True, on_saved=self.metrics.log_save,
                                          write_state_files=self._write_trainer_files)
        signals.install(self._signals, resume=TRAINER_RESUME)  # Ctrl-C deferred from on_train_begin
        try:
            result = original(resume_from_checkpoint, *args, **kwargs)
            self._saves(self._close_saver)  # the last save in flight committed before train() returns
            return result
        finally:
            signals.restore()  # the process's own handlers again (save_model after train is not a step)

    def on_train_begin(self, args, state, control, **kwargs):
        signals.defer()  # Ctrl-C from the first step on: that step ends, is saved, and every rank exits 130
        return control

    def _check_launch(self, *, resuming: bool) -> None:
        """The recipes' launch checks, before anything is written: the launch against the generated
        preset's header (another process count is fine for a resume, which keeps its global batch)
        and the config's wrap classes against the model (a config made for another model fails
        inside accelerate's prepare otherwise); every problem in one line, exit 2 on every rank."""
        from fsdp_presets.train.model_setup import check_wrap_classes
        from fsdp_presets.train.startup import preset_launch_problem

        trainer = self.trainer
        problems = [preset_launch_problem(self._accelerator, launch_config_file(), resuming=resuming)]
        if self._async_save:
            from fsdp_presets.checkpoint.async_save import async_save_problem

            problem = async_save_problem(self._accelerator, lora=self._adapter_keys is not None)
            problems.append(problem and f"FSDPPresetsCallback(async_save=True): {problem}")
        try:
            check_wrap_classes(self._accelerator.state.fsdp_plugin if trainer.is_fsdp_enabled else None, trainer.model)
        except UsageError as error:
            problems.append(str(error))
        if any(problems):
            self._refuse("; ".join(problem for problem in problems if problem))

    def _newest_committed(self, output: Path) -> Path | bool | None:
        """The checkpoint ``resume_from_checkpoint=True`` continues from (:func:`trainer_saves.resume_choice`):
        None (from step 0) when every folder there is uncommitted, True (Trainer's own error) when there is none."""
        checkpoint, note = trainer_saves.resume_choice(output)
        if note:
            self._say(note)
        return checkpoint if checkpoint is not None or note else True

    def _keep_global_batch(self, checkpoint: Path) -> int:
        """The checkpoint's step; on another process count, the gradient accumulation that keeps its
        global batch (or :class:`UsageError` on every rank saying how)."""
        try:
            saved = Manifest.read(checkpoint)
        except (OSError, ValueError):
            self._say(f"{checkpoint} has no {MANIFEST} (not written with FSDPPresetsCallback): its global batch is "
                      "unknown and not checked")
            return 0
        if saved.step <= 0 or saved.samples_consumed % saved.step:
            return saved.step
        recorded = saved.samples_consumed // saved.step
        args = self.trainer.args
        if recorded == self._global_batch():
            return saved.step
        data_parallel = self._data_parallel_size()
        accumulation = accumulation_for(recorded, micro_batch_size=args.per_device_train_batch_size,
                                        data_parallel_size=data_parallel)
        if accumulation is None:
            self._refuse(f"resume from {checkpoint}: it trained with a global batch of {recorded} samples, which "
                         f"per_device_train_batch_size {args.per_device_train_batch_size} x {data_parallel} processes "
                         f"cannot split; set per_device_train_batch_size so that it times {data_parallel} divides "
                         f"{recorded}, or launch {saved.world_size} processes as it was saved (nothing was written)")
        self._say(f"resume from {checkpoint}: global batch kept at {recorded} samples: gradient_accumulation_steps "
                  f"{args.gradient_accumulation_steps} -> {accumulation} for {data_parallel} processes x "
                  f"per_device_train_batch_size {args.per_device_train_batch_size} (saved by {saved.world_size})")
        args.gradient_accumulation_steps = accumulation
        return saved.step

    # ---- every micro-batch and every optimizer step ----
    def _training_step(self, original, model, inputs, *args, **kwargs):
        if self._step_started is None:
            self._step_started = time.perf_counter()
        loss = original(model, inputs, *args, **kwargs)
        self._step_loss = self._step_loss + loss.detach().float()
        mask = inputs.get("attention_mask") if hasattr(inputs, "get") else None
        ids = inputs.get("input_ids") if hasattr(inputs, "get") else None
        self._step_tokens += float(mask.sum()) if mask is not None else float(ids.numel()) if ids is not None else 0.0
        return loss

    def _clip_grad_norm(self, original, model):
        """Trainer's clipping (``max_grad_norm`` > 0) with the norm that is the same, bit for bit, under
        DDP, FSDP1 and FSDP2 (:func:`fsdp_presets.numerics.clip_grad_norm`)."""
        from fsdp_presets.numerics import EXACT_NORM_TYPES, clip_grad_norm

        if self._accelerator.distributed_type.value not in EXACT_NORM_TYPES:
            return original(model)
        return clip_grad_norm(self._accelerator, model, self.trainer.args.max_grad_norm)

    def _get_grad_norm(self, original, model, grad_norm=None):
        """The logged norm when nothing is clipped (``max_grad_norm`` 0): the same norm, only measured."""
        from fsdp_presets.numerics import EXACT_NORM_TYPES, clip_grad_norm

        if grad_norm is None and self._accelerator.distributed_type.value in EXACT_NORM_TYPES:
            grad_norm = clip_grad_norm(self._accelerator, model, 0.0)
        return original(model, grad_norm=grad_norm)

    def _maybe_log_save_evaluate(self, original, tr_loss, grad_norm, *args, **kwargs):
        trainer = self.trainer
        step = trainer.state.global_step
        if step > self._logged_step and self._step_started is not None:
            import torch

            # The step's loss as Trainer sums it over micro-batches, averaged over the ranks as its log
            # does, but for this one step and unrounded; tokens summed over the ranks.
            local = torch.stack([torch.as_tensor(self._step_loss, dtype=torch.float64).detach().cpu().reshape(()),
                                 torch.tensor(self._step_tokens, dtype=torch.float64)]).to(self._accelerator.device)
            total = self._accelerator.reduce(local, reduction="sum").cpu()
            step_time = time.perf_counter() - self._step_started
            learning_rate = kwargs.get("learning_rate")
            self.metrics.log_train(
                step=step, loss=float(total[0]) / self._accelerator.num_processes,
                lr=float(learning_rate if learning_rate is not None else trainer._get_learning_rate()),
                grad_norm=_number(grad_norm), tokens_per_s=float(total[1]) / step_time, step_time_s=step_time,
                samples_seen=step * self._global_batch(), memory=device_memory_peaks(self._accelerator.device))
            self._logged_step = step
        self._step_loss, self._step_tokens, self._step_started = 0.0, 0.0, None
        if self._saver is not None:  # async_save: commit the save in flight once every rank's write is done
            self._saves(self._saver.poll, step=step)
        # Ctrl-C or a preemption signal on any rank (one all-reduce, every rank at this step boundary):
        # Trainer saves this step through its own _save_checkpoint, then every rank stops.
        if self._saved_step != step and any(stop := signals.agree(self._accelerator)):
            trainer.control.should_save = True
            original(tr_loss, grad_norm, *args, **kwargs)
            self._stop(step, *stop)  # does not return
        result = original(tr_loss, grad_norm, *args, **kwargs)
        if self._saved_step == step and any(stop := signals.agree(self._accelerator)):
            self._stop(step, *stop)  # the signal came during this step's save: it is saved, stop now
        return result

    def _stop(self, step: int, interrupted: bool, preempted: bool) -> NoReturn:
        """The step's checkpoint committed, then one line on stderr and exit 130 (Ctrl-C) or 75 (a
        preemption, after its ``preempted`` metrics line) on every rank."""
        if self._saver is not None:
            self._saves(self._saver.wait)  # async_save: the save in flight (this step's, or an earlier) committed
        folder = Path(self.trainer._get_output_dir(trial=None)) / trainer_checkpoint_name(step)
        checkpoint = folder if (folder / MANIFEST).is_file() else None
        if preempted:
            self.metrics.log_preempted(step=step, signal=signals.received(),
                                       checkpoint=str(checkpoint) if checkpoint else None)
        try:
            signals.stop(self._accelerator, step=step, checkpoint=checkpoint, interrupted=not preempted)
        except (signals.Interrupted, signals.Preempted) as error:
            self._exit(error)

    # ---- saves ----
    def _save_model(self, original, output_dir=None, _internal_call=False):
        trainer = self.trainer
        plugin = getattr(self._accelerator.state, "fsdp_plugin", None)
        if _internal_call:
            return original(output_dir, _internal_call)
        if self._saver is not None:
            self._saves(self._saver.wait)  # async_save: save_model inside train() (a callback's) waits too
        if not trainer.is_fsdp_enabled or plugin is None:
            result = original(output_dir, _internal_call)
            self._after_save_model(output_dir)
            return result
        if self._adapter_keys is not None:
            return self._save_adapter(Path(output_dir or trainer.args.output_dir))
        previous = plugin.state_dict_type
        if "FULL_STATE_DICT" not in str(previous):
            self._say(f"save_model({output_dir or trainer.args.output_dir}): the preset checkpoints with "
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
        self._accelerator.wait_for_everyone()
        self._after_save_model(output_dir)
        return result

    def _after_save_model(self, output_dir) -> None:
        if self._accelerator.is_main_process:
            folder = Path(output_dir or self.trainer.args.output_dir)
            if folder.is_dir():
                self._settings_as_json(folder)

    def _save_adapter(self, output_dir: Path) -> None:
        """A peft model's ``save_model`` under FSDP: only the trainable weights are gathered (torch's
        ``get_model_state_dict(ignore_frozen_params=True)``), and rank 0 writes the PEFT folder under
        the key names peft gave them before FSDP wrapped the model (peft's own ``save_pretrained`` on
        an FSDP1-wrapped model writes an empty adapter), as the recipes export it. The files go into
        ``output_dir`` beside what it holds, as Trainer's own save puts them (``save_model()`` with
        no folder writes into the output folder, next to ``checkpoint-N`` and the metrics)."""
        from fsdp_presets.train.final_adapter import export_adapter

        trainer, accelerator = self.trainer, self._accelerator
        self._say(f"save_model({output_dir}): the PEFT adapter under FSDP: its trainable weights gathered from the "
                  "shards (the frozen base is not gathered), written by rank 0 under peft's key names")
        # the tokenizer Trainer's own save writes: processing_class, else the collator's
        tokenizer = trainer.processing_class or getattr(trainer.data_collator, "tokenizer", None)
        export_adapter(accelerator, trainer.model_wrapped, tokenizer, output_dir, key_map=self._adapter_keys,
                       merge=True)  # complete before any file of it is moved into output_dir

    def _save_checkpoint(self, original, model, trial, *args, **kwargs):
        trainer, accelerator = self.trainer, self._accelerator
        step = trainer.state.global_step
        folder = Path(trainer._get_output_dir(trial=trial)) / trainer_checkpoint_name(step)
        started = time.perf_counter()
        # Trainer's rotation runs after the commit (self._commit), never before it: it would remove
        # the last committed checkpoint for one that is not committed yet.
        save_total_limit, trainer.args.save_total_limit = trainer.args.save_total_limit, None
        self._save_total_limit = save_total_limit  # a save in flight committed by this one rotates with it
        try:
            if self._saver is not None:  # async_save: Trainer's files now, the shards in the background
                self._trainer_save = functools.partial(original, model, trial, *args, **kwargs)
                # The last step's save is committed at once: no training is left to overlap, and the
                # end of train() reads (load_best_model_at_end) or removes (save_total_limit=1 and a
                # best checkpoint) checkpoints, which must not meet a folder still being written.
                self._saves(self._saver.save, step=step, samples_consumed=step * self._global_batch(),
                            write_extra=None, wait=step >= trainer.state.max_steps)
            else:
                trainer_saves.clear_folder(accelerator, folder)
                original(model, trial, *args, **kwargs)
        finally:
            trainer.args.save_total_limit = save_total_limit
            self._trainer_save, self._save_total_limit = None, None
        # drills: sync, Trainer's files written and no manifest yet; async, the shards still being written
        fault_point("during-save", step=step, rank=accelerator.process_index, folder=folder)
        self._saved_step = step
        if self._saver is not None:
            return
        accelerator.wait_for_everyone()  # every rank's files (its RNG state, its DCP shards) are written
        if accelerator.is_main_process and folder.is_dir():
            self._commit(folder, step)
        accelerator.wait_for_everyone()
        elapsed = time.perf_counter() - started
        committed = self.metrics.enabled and (folder / MANIFEST).is_file()  # main process
        size = sum(entry["bytes"] for entry in Manifest.read(folder).files.values()) if committed else 0
        self.metrics.log_save(step=step, async_=False, blocked_s=elapsed, total_s=elapsed, bytes=size)

    def _write_trainer_files(self, folder: Path) -> None:
        """async_save, on every rank: Trainer's own ``_save_checkpoint`` of this step without its
        FSDP model and optimizer writes (``_save_optimizer_and_scheduler`` below), then data only."""
        self._trainer_save()
        if self._accelerator.is_main_process:
            self._settings_as_json(folder)

    def _save_optimizer_and_scheduler(self, original, output_dir):
        if self._trainer_save is None:
            return original(output_dir)
        trainer_saves.save_scheduler(self.trainer, output_dir)  # the shards: by the background writer

    def _saves(self, call, *args, **kwargs):
        """``call`` of the background writer; a write that failed (reported on every rank by the
        writer) becomes one line on the main process and exit 1 on every rank (2: refused input)."""
        try:
            return call(*args, **kwargs)
        except (Finding, UsageError) as error:
            self._exit(error)

    def _close_saver(self) -> None:
        saver, self._saver = self._saver, None
        if saver is not None:
            saver.close()

    def _settings_as_json(self, folder: Path) -> None:
        """Data only: Trainer's pickle of TrainingArguments in ``folder`` replaced by the same settings
        as JSON (a pickle runs code when it is loaded)."""
        pickled = folder / TRAINER_ARGS_PICKLE
        if pickled.is_file():
            write_text_atomic(folder / TRAINER_ARGS_JSON, self.trainer.args.to_json_string())
            pickled.unlink()

    def _commit(self, folder: Path, step: int, files: dict[str, dict[str, Any]] | None = None) -> None:
        """Write ``manifest.json`` into a checkpoint Trainer finished (main process; ``files``: the
        hashes the ranks made, async_save), then Trainer's rotation of older ones."""
        import accelerate
        import torch
        import transformers

        trainer = self.trainer
        if files is None:
            self._settings_as_json(folder)
            files = {}
            for path in sorted(folder.rglob("*")):
                if path.is_file() and path.name != MANIFEST:
                    files[str(path.relative_to(folder))] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
        settings = distributed_settings(self._accelerator)
        model = self._accelerator.unwrap_model(trainer.model)
        manifest = Manifest(
            step=step, samples_consumed=step * self._global_batch(), world_size=settings["world_size"],
            distributed_type=settings["distributed_type"], fsdp=settings["fsdp"],
            config_digest=config_digest(model.config), files=files, kind=TRAINER_KIND,
            versions={"torch": torch.__version__, "accelerate": accelerate.__version__,
                      "transformers": transformers.__version__},
            created_unix=time.time(), training=lora.settings_of(model))
        write_json_atomic(folder / MANIFEST, asdict(manifest))
        trainer_saves.rotate(trainer, save_total_limit=trainer.args.save_total_limit if self._save_total_limit is None
                             else self._save_total_limit)

