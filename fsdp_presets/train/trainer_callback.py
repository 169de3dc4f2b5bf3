"""``FSDPPresetsCallback``: a ``transformers.Trainer`` (or TRL trainer) script launched with a
preset gets what the recipes give, with one added line::

    from fsdp_presets import FSDPPresetsCallback
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[FSDPPresetsCallback()])

    accelerate launch --config_file accelerate_configs/cpu_fsdp2_demo.yaml train.py

The callback is the adapter between Trainer's events and the run lifecycle the recipes drive: the
run record (:class:`fsdp_presets.checkpoint.run_folder.RunInfo`), the checkpoint manager under
Trainer's names (:mod:`fsdp_presets.train.trainer_saves`), the signals and exit statuses
(:mod:`fsdp_presets.train.signals`), the global batch kept on resume
(:func:`fsdp_presets.checkpoint.resume.keep_global_batch`):

- made before the ``Trainer``, it switches on real FSDP on a CPU-only host; once the Trainer exists
  it refuses a launch whose processes would each train alone, and at ``train()``, before anything
  is written, a launch that is not what the generated preset's header planned or whose config wraps
  block classes the model does not have: one line, exit 2 on every rank;
- ``trainer.save_model(dir)`` writes a complete Hugging Face folder (or the PEFT adapter) whatever
  the preset's state-dict type (Trainer writes no weights under SHARDED_STATE_DICT, transformers
  issue 30491), and returns on every rank once the folder is written;
- ``OUTPUT_DIR/run.json`` and ``OUTPUT_DIR/metrics.jsonl`` as the recipes write them (one line per
  optimizer step with the exact loss), so ``fsdp-presets compare`` reads the run;
- every ``checkpoint-N`` gets a ``trainer``-kind manifest (its commit), holds data only
  (``training_args.json`` for Trainer's pickle), and ``resume_from_checkpoint=True`` takes the newest
  committed one; a resume at another process count keeps the global batch, or refuses saying how; a
  model sharded at load time (TP/EP, ``save_only_model=True``) is checkpointed whole (best model too);
- Ctrl-C during training, SIGTERM or SIGUSR1 (``preempt_signals="none"`` turns those two off): the
  ranks agree at the next optimizer-step boundary, Trainer saves ``checkpoint-N`` of the step
  reached and every rank exits 130 (Ctrl-C) or 75 (a preemption, with a ``preempted`` metrics line);
- ``async_save=True`` (FSDP2, ``SHARDED_STATE_DICT``, every weight trained): shards written in the
  background; clipping with the recipes' norm (:func:`fsdp_presets.numerics.clip_grad_norm`, the
  same under DDP, FSDP1 and FSDP2); the recipes' ``throughput:`` line at the end of ``train()``.

NOTE: a ``TrainerCallback`` is given no reference to its Trainer, and the exact loss, the gradient norm and the
user's ``save_model`` calls never reach a callback event. The callback finds its Trainer once, at ``on_init_end``
(the end of ``Trainer.__init__``), and wraps eleven of that instance's methods (``train``, ``training_step``,
``_clip_grad_norm``, ``_get_grad_norm``, ``_maybe_log_save_evaluate``, ``save_model``, ``_save_checkpoint``,
``_save_optimizer_and_scheduler``, ``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``,
``_load_best_model``), not its class.
"""

from __future__ import annotations

import functools
import inspect
import time
from pathlib import Path
from typing import NoReturn

from transformers import Trainer, TrainerCallback

from fsdp_presets.checkpoint.layout import MANIFEST, METRICS, RunFolder
from fsdp_presets.checkpoint.manager import TRAINER_NAMING, trainer_resume_choice
from fsdp_presets.checkpoint.manifest import Manifest
from fsdp_presets.checkpoint.resume import TRAINER_BATCH_NAMES, keep_global_batch
from fsdp_presets.checkpoint.run_folder import (agreed_first_day, distributed_settings, launch_config_file,
                                                schedule_change_note, training_settings)
from fsdp_presets.errors import Finding, UsageError, raise_on_every_rank
from fsdp_presets.train import lora, signals
from fsdp_presets.train.metrics import MetricsLog, device_memory_peaks, throughput_at_end
from fsdp_presets.train.model_mesh import mesh_of, mesh_settings, sum_over_samples, trainer_launch_problem
from fsdp_presets.train.trainer_saves import TrainerSaves


def _calling_trainer() -> Trainer | None:
    """The Trainer whose ``__init__`` is running the callback event (see the module's NOTE)."""
    frame = inspect.currentframe()
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    return None


class FSDPPresetsCallback(TrainerCallback):
    """The recipes' guarantees for a Trainer/TRL script (see the module docstring)."""

    def __init__(self, preempt_signals: str = signals.DEFAULT_SIGNALS, async_save: bool = False) -> None:
        from fsdp_presets.cpu_fsdp import enable_cpu_fsdp

        self._signals = signals.parse_signals(preempt_signals)  # "none": no preemption saves
        self._async_save = async_save  # checkpoint-N's model and optimizer shards written in the background
        enable_cpu_fsdp()  # before the Trainer builds its Accelerator
        self.trainer: Trainer | None = None
        self.saves: TrainerSaves | None = None
        self.metrics: MetricsLog | None = None
        self._step_loss, self._step_tokens, self._step_started = 0.0, 0.0, None  # the step in training (perf_counter)
        self._logged_step = 0
        self._first_day: str | None = None  # first_day(): the day the script's data was rendered with

    def first_day(self, output_dir, resume="auto") -> str:
        """The day the run in ``output_dir`` first started (``YYYY-MM-DD``: run.json's ``started_on``,
        kept by a resume; ``resume`` a checkpoint of another folder: that run's; a new run: the main
        process's today), the same on every rank, and the day this run's run.json records. A script
        whose chat template writes today's date (Llama 3.2/3.3) renders its data with it, so that a
        resume on another day renders the same tokens: ``tokenizer.chat_template =
        fsdp_presets.train.chat_data.rendering_template(tokenizer, callback.first_day(output_dir))``,
        before the trainer tokenizes (TRL's at its construction), once the training arguments exist."""
        self._first_day = agreed_first_day(RunFolder(root=Path(output_dir)), str(resume))
        return self._first_day

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
        adapter_keys = None
        if lora.settings_of(trainer.model) is not None:  # before FSDP wraps it: peft's names of the adapter
            adapter_keys = lora.adapter_key_map(trainer.model)
            lora.keep_4bit_layout(trainer.model)  # QLoRA: an evaluation must not repack the sharded 4-bit weights
        self.saves = TrainerSaves(trainer, async_save=self._async_save, adapter_keys=adapter_keys, say=self._say)
        for name in ("train", "training_step", "_clip_grad_norm", "_get_grad_norm", "_maybe_log_save_evaluate"):
            setattr(trainer, name, functools.partial(getattr(self, f"_{name.lstrip('_')}"), getattr(trainer, name)))
        for name in ("save_model", "_save_checkpoint", "_save_optimizer_and_scheduler", "_load_from_checkpoint",
                     "_load_optimizer_and_scheduler", "_load_best_model"):  # trainer_saves does them
            setattr(trainer, name, functools.partial(self._exits, getattr(self.saves, name.lstrip("_")),
                                                     getattr(trainer, name)))
        return control

    def on_train_begin(self, args, state, control, **kwargs):
        signals.defer()  # Ctrl-C from the first step on: that step ends, is saved, and every rank exits 130
        return control

    @property
    def _accelerator(self):
        return self.trainer.accelerator

    def _say(self, message: str) -> None:
        if self._accelerator.is_main_process:
            print(f"fsdp-presets: {message}", flush=True)

    def _refuse(self, message: str) -> NoReturn:
        """One line on the main process and exit 2 on every rank, as the recipes refuse bad input."""
        self._exits(raise_on_every_rank, self._accelerator, message)

    def _exits(self, call, *args, **kwargs):
        """``call``, with the recipes' one line (main process) and exit status on every rank when it
        stops the run (:func:`fsdp_presets.train.signals.report`), e.g. a failed background write."""
        try:
            return call(*args, **kwargs)
        except (Finding, UsageError, signals.Interrupted, signals.Preempted) as error:
            raise SystemExit(signals.report(error, program="fsdp-presets")) from None

    def _global_batch(self) -> int:
        args = self.trainer.args
        return args.per_device_train_batch_size * args.gradient_accumulation_steps * self._data_parallel_size()

    def _data_parallel_size(self) -> int:
        return distributed_settings(self._accelerator, model_mesh=mesh_settings(self.trainer.model))[
            "data_parallel_size"]

    # ---- train: resume check, run.json, metrics log ----
    def _train(self, original, resume_from_checkpoint=None, *args, **kwargs):
        trainer = self.trainer
        if resume_from_checkpoint is True:
            resume_from_checkpoint = self._newest_committed(Path(trainer.args.output_dir))
        checkpoint = resume_from_checkpoint if resume_from_checkpoint is not True else None
        self._check_launch(resuming=bool(checkpoint))
        step = 0
        output = Path(trainer.args.output_dir)
        if checkpoint:
            step = self._keep_global_batch(Path(checkpoint))
            resume_from_checkpoint = str(checkpoint)
            # before run.json is rewritten: the length the run was launched with
            if note := schedule_change_note(output, trainer.args.max_steps, training_settings(trainer.args),
                                            flag="max_steps="):
                self._say(f"note: {note}")
        self.metrics = MetricsLog(output / METRICS, enabled=self._accelerator.is_main_process, keep_through_step=step)
        self._logged_step = step
        started_on = self._first_day or agreed_first_day(RunFolder(root=output), str(checkpoint or "none"))
        self.saves.begin(self.metrics, global_batch=self._global_batch(), resumed_from=checkpoint,
                         started_on=started_on)
        signals.install(self._signals, naming=TRAINER_NAMING, checkpoints=output)  # Ctrl-C: deferred (on_train_begin)
        try:
            result = original(resume_from_checkpoint, *args, **kwargs)
            self._exits(self.saves.close)  # the last save in flight committed before train() returns
            if (line := throughput_at_end(output / METRICS, self._accelerator.num_processes)) is not None:
                self._say(line)  # tokens/s per process against the preset's prediction, as the recipes end
            return result
        finally:
            signals.restore()  # the process's own handlers again (save_model after train is not a step)

    def _check_launch(self, *, resuming: bool) -> None:
        """The recipes' launch checks, before anything is written: the launch against the generated
        preset's header (another process count is fine for a resume, which keeps its global batch)
        and the config's wrap classes against the model (a config made for another model fails
        inside accelerate's prepare otherwise); every problem in one line, exit 2 on every rank."""
        from fsdp_presets.train.model_setup import check_wrap_classes
        from fsdp_presets.train.startup import preset_launch_problem

        trainer = self.trainer
        problems = [preset_launch_problem(self._accelerator, launch_config_file(), resuming=resuming),
                    trainer_launch_problem(self._accelerator, trainer.model, launch_config_file())]
        if self._async_save:
            from fsdp_presets.checkpoint.async_save import async_save_problem

            problem = async_save_problem(self._accelerator, lora=self.saves.adapter_keys is not None,
                                         sharded_at_load=mesh_of(trainer.model, 0) is not None)
            problems.append(problem and f"FSDPPresetsCallback(async_save=True): {problem}")
        try:
            check_wrap_classes(self._accelerator.state.fsdp_plugin if trainer.is_fsdp_enabled else None, trainer.model)
        except UsageError as error:
            problems.append(str(error))
        if any(problems):
            self._refuse("; ".join(problem for problem in problems if problem))

    def _newest_committed(self, output: Path) -> Path | bool | None:
        """The checkpoint ``resume_from_checkpoint=True`` continues from (:func:`trainer_resume_choice`):
        None (from step 0) when every folder there is uncommitted, True (Trainer's own error) when there is none."""
        checkpoint, note = trainer_resume_choice(output)
        if note:
            self._say(note)
        return checkpoint if checkpoint is not None or note else True

    def _keep_global_batch(self, checkpoint: Path) -> int:
        """The checkpoint's step; on another process count, the gradient accumulation that keeps its
        global batch (or exit 2 on every rank saying how)."""
        try:
            saved = Manifest.read(checkpoint)
        except (OSError, ValueError):
            self._say(f"{checkpoint} has no {MANIFEST} (not written with FSDPPresetsCallback): its global batch is "
                      "unknown and not checked")
            return 0
        args = self.trainer.args
        try:
            accumulation, note = keep_global_batch(
                checkpoint, step=saved.step, samples_consumed=saved.samples_consumed, names=TRAINER_BATCH_NAMES,
                micro_batch_size=args.per_device_train_batch_size, data_parallel_size=self._data_parallel_size(),
                gradient_accumulation_steps=args.gradient_accumulation_steps)
        except UsageError as error:
            self._refuse(f"{error}, or launch {saved.world_size} processes as it was saved (nothing was written)")
        if note:
            self._say(f"resume from {checkpoint}: {note} (saved by {saved.world_size})")
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

            from fsdp_presets.numerics import scalar

            # The step's loss as Trainer sums it over micro-batches, averaged over the ranks as its log
            # does, but for this one step and unrounded; tokens summed over the ranks (a TP group's once).
            local = torch.stack([torch.as_tensor(self._step_loss, dtype=torch.float64).detach().cpu().reshape(()),
                                 torch.tensor(self._step_tokens, dtype=torch.float64)]).to(self._accelerator.device)
            total = sum_over_samples(self._accelerator, local, mesh_of(trainer.model, self._accelerator.process_index))
            step_time = time.perf_counter() - self._step_started
            learning_rate = kwargs.get("learning_rate")
            self.metrics.log_train(
                step=step, loss=float(total[0]) / self._data_parallel_size(),
                lr=float(learning_rate if learning_rate is not None else trainer._get_learning_rate()),
                grad_norm=None if grad_norm is None else scalar(grad_norm), tokens_per_s=float(total[1]) / step_time,
                step_time_s=step_time, samples_seen=step * self._global_batch(),
                memory=device_memory_peaks(self._accelerator.device))
            self._logged_step = step
        self._step_loss, self._step_tokens, self._step_started = 0.0, 0.0, None
        self._exits(self.saves.poll, step)  # async_save: commit the save in flight once every rank's write is done
        # Ctrl-C or a preemption signal on any rank (one all-reduce, every rank at this step boundary):
        # Trainer saves this step through its own _save_checkpoint, then every rank stops.
        if self.saves.saved_step != step and any(stop := signals.agree(self._accelerator)):
            trainer.control.should_save = True
            original(tr_loss, grad_norm, *args, **kwargs)
            self._stop(step, *stop)  # does not return
        result = original(tr_loss, grad_norm, *args, **kwargs)
        if self.saves.saved_step == step and any(stop := signals.agree(self._accelerator)):
            self._stop(step, *stop)  # the signal came during this step's save: it is saved, stop now
        return result

    def _stop(self, step: int, interrupted: bool, preempted: bool) -> NoReturn:
        """The step's checkpoint committed, then one line on stderr and exit 130 (Ctrl-C) or 75 (a
        preemption, after its ``preempted`` metrics line) on every rank."""
        self._exits(self.saves.wait)  # async_save: the save in flight (this step's, or an earlier) committed
        checkpoint = self.saves.checkpoint(step)
        if preempted:
            self.metrics.log_preempted(step=step, signal=signals.received(),
                                       checkpoint=str(checkpoint) if checkpoint else None)
        self._exits(signals.stop, self._accelerator, step=step, checkpoint=checkpoint, interrupted=not preempted)

