"""What every recipe does that is not its model, data or loss, in one object from the launch to
the exported model, so that ``recipes/causal_lm.py`` and ``recipes/sequence_classification.py``
(and a recipe copied from them) behave the same: the same flags, checks, run folder, resume
(exact, at another process count, from an imported checkpoint), metrics, saves and export.

    run = recipe.start(args, recipe="my_task")   # launch, start-up checks, run folder + lock, config, tokenizer
    ...                                          # the recipe's data, model, optimizer (accelerator.prepare)
    run.resume(model, optimizer)                 # checkpoint / imported weights / fresh; run.json; metrics
    run.begin_training(evaluate, shown="accuracy")   # evaluation at step 0, Ctrl-C deferred to step ends
    while run.step < args.max_steps:
        started = time.perf_counter()
        for index, indices in enumerate(run.micro_batches(stream)):   # this rank's share of the step
            with run.gradient_sync(last_micro_batch=...):
                ...                              # the recipe's forward, loss and accelerator.backward
        grad_norm, lr = run.optimizer_step(optimizer, scheduler)     # float64 clipping, step, zero_grad
        run.end_step(loss=..., grad_norm=grad_norm, lr=lr, tokens=..., started=started)
    run.export(model_class=AutoModelForXxx)      # final/ (LoRA: the adapter), plots
    model = optimizer = scheduler = None
    run.finish()                                 # the process group goes last (see loop.finish)

:meth:`RecipeRun.end_step` is the end of every optimizer step: the metrics line, a NaN/inf stop
(exit 1, nothing saved), the evaluation when due, then, when due or on Ctrl-C, a check that the
weights are finite and a checkpoint save; Ctrl-C then stops (exit 130).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from fsdp_presets.checkpoint import resume as checkpoint_resume
from fsdp_presets.checkpoint.async_save import CheckpointSaver, check_async_save
from fsdp_presets.checkpoint.layout import MERGED, MODEL_CONFIG, RunFolder
from fsdp_presets.checkpoint.manager import CheckpointManager, committed_checkpoints
from fsdp_presets.checkpoint.manifest import Manifest, is_imported
from fsdp_presets.checkpoint.run_folder import (METHOD_KEY, RunInfo, acquire_run_lock, check_output_dir,
                                                agreed_first_day, distributed_settings, launch_config_file, run_identity,
                                                schedule_change_note, training_settings)
from fsdp_presets.errors import UsageError, raise_on_every_rank
from fsdp_presets.faults import fault_point
from fsdp_presets.fileio import config_digest, sha256_files
from fsdp_presets.numerics import clip_grad_norm, gradient_sync
from fsdp_presets.train import loop, signals, startup
from fsdp_presets.checkpoint.adapter import TrainableState, write_adapter_files
from fsdp_presets.train import lora as recipe_lora
from fsdp_presets.train.final_adapter import export_adapter
from fsdp_presets.train.final_model import export_model
from fsdp_presets.train.metrics import MetricsLog, device_memory_peaks, throughput_at_end
from fsdp_presets.train.model_mesh import ModelMesh, check_mesh_launch, load_model_mesh, sum_over_samples
from fsdp_presets.train.plots import plot_run

@dataclass(kw_only=True)
class RecipeRun:
    """One recipe run in progress (one per process). Made by :func:`start`."""

    accelerator: Any
    """The run's ``accelerate.Accelerator`` (FSDP on a CPU-only host too)."""
    args: Any
    """The parsed flags (:func:`fsdp_presets.train.loop.recipe_argument_parser` plus the recipe's)."""
    folder: RunFolder
    """OUTPUT_DIR: run.json, metrics.jsonl, checkpoints/, final/, plots/."""
    record: RunInfo
    """What run.json records of the run; :func:`start` gives its identity and settings (a continued
    run keeps them), :meth:`resume` the rest."""
    lora: dict[str, Any] | None
    """LoRA/QLoRA method and shape, None when every weight trains."""
    config: Any
    """The model's transformers config (read without running code from the model folder)."""
    tokenizer: Any
    """The model folder's tokenizer."""
    distributed: dict[str, Any]
    """How the processes share the work (run.json and manifests record it)."""
    mesh: ModelMesh | None = None
    """The mesh transformers shards the model over (``--distributed-config``), None for FSDP or DDP alone."""
    say: Callable[[str], None]
    """``print`` on the main process."""
    step: int = 0
    """Optimizer steps done."""
    samples: int = 0
    """Training samples consumed by all ranks together: the data position."""
    checkpoints: CheckpointManager | None = None
    """Made by :meth:`resume`."""
    metrics: MetricsLog | None = None
    """Made by :meth:`resume`."""
    saver: CheckpointSaver | None = None
    """Made by :meth:`resume`: every save, synchronous or in the background (--async-save)."""
    _live: dict[str, Any] = field(default_factory=dict)
    """The model, evaluation, LoRA key map and progress bar, until :meth:`finish` lets them go."""

    # ---- the split of the global batch ----
    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def data_rank(self) -> int:
        """This rank's share of the data: its rank, or under a TP mesh its TP group's index."""
        return self.mesh.data_rank if self.mesh is not None else self.rank

    @property
    def data_parallel_size(self) -> int:
        return self.distributed["data_parallel_size"]

    def reduce(self, tensor):
        """The sum of ``tensor`` over the ranks, each sample counted once (the ranks of a TP group
        computed it from the same samples; :meth:`ModelMesh.data_share`). Collective."""
        return sum_over_samples(self.accelerator, tensor, self.mesh)

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step: micro-batch x accumulation x data-parallel ranks."""
        args = self.args
        return args.micro_batch * args.grad_accum * self.data_parallel_size

    # ---- resume ----
    def resume(self, model, optimizer, *, key_map: dict[str, str] | None = None,
               record: dict[str, Any] | None = None) -> None:
        """Continue as ``--resume`` says, after ``accelerator.prepare``: a recipe checkpoint (model,
        optimizer, scheduler, RNG and data position; on another process count the gradient
        accumulation changes so that the global batch, and so every step's samples, stay the same),
        an ``fsdp-presets import``ed checkpoint (its weights; step 0, fresh optimizer and schedule)
        or nothing. Then run.json (``record``: the recipe's own entries) and the metrics log.
        Collective."""
        accelerator, args, say = self.accelerator, self.args, self.say
        self._live.update(model=model, key_map=key_map)
        digest = config_digest(self.config)
        self.checkpoints = CheckpointManager(
            accelerator=accelerator, directory=self.folder.checkpoints, keep_last=args.keep_last,
            config_digest=digest, distributed=self.distributed, log=say,
            training=self.lora,  # LoRA/QLoRA: trainable weights only, the base from --model
            state=TrainableState(accelerator, model, optimizer) if self.lora else None)
        if args.async_save:
            check_async_save(accelerator, lora=bool(self.lora))
        resume_from = self.checkpoints.resolve(args.resume, max_steps=args.max_steps)
        if resume_from is not None and is_imported(resume_from):  # weights only
            checkpoint_resume.load_imported(model, resume_from, config_digest=digest)
            say(f"started from imported weights {resume_from}: step 0, fresh optimizer and schedule")
        elif resume_from is not None:
            saved = Manifest.read(resume_from)
            # Another process count: keep the global batch (and so the samples of every step).
            args.grad_accum, note = checkpoint_resume.keep_global_batch(
                resume_from, step=saved.step, samples_consumed=saved.samples_consumed,
                micro_batch_size=args.micro_batch, gradient_accumulation_steps=args.grad_accum,
                data_parallel_size=self.data_parallel_size)
            if note:
                say(note)
            manifest = self.checkpoints.load(resume_from)
            self.step, self.samples = manifest.step, manifest.samples_consumed
            say(f"resumed from {resume_from}: step {self.step}, {self.samples} samples consumed "
                f"(saved by {manifest.world_size} processes, now {accelerator.num_processes})")
        memory = recipe_lora.memory_record(accelerator, model) if self.lora else {}  # LoRA/QLoRA: bytes per rank
        self.record = dataclasses.replace(
            self.record, training=self.lora, data=args.data, max_steps=args.max_steps,
            micro_batch_size=args.micro_batch, gradient_accumulation_steps=args.grad_accum,
            global_batch_samples=self.global_batch, distributed=self.distributed,
            accelerate_config=launch_config_file(), resumed_from=str(resume_from) if resume_from else None,
            extra={**memory, **(record or {})})
        if accelerator.is_main_process:
            self.record.write(self.folder)
        self.metrics = MetricsLog(self.folder.metrics, enabled=accelerator.is_main_process,
                                  keep_through_step=self.step)
        self.saver = CheckpointSaver(manager=self.checkpoints, background=args.async_save,
                                     on_saved=self.metrics.log_save)

    # ---- train ----
    def begin_training(self, evaluate: Callable[[], dict[str, float]], *, shown: str) -> None:
        """Evaluate before the first step (a fresh start), put the model in training mode and
        defer Ctrl-C to the end of a step. ``evaluate()`` returns ``eval_loss`` and other values
        (collective); ``shown`` is the one printed beside the loss."""
        self._live.update(evaluate=evaluate, shown=shown)
        if self.step == 0:
            results = evaluate()
            self.metrics.log_eval(step=0, **results)
            self.say(f"before training: {self._describe(results)}")
        if signals.agree(self.accelerator)[1]:  # preempted while loading or evaluating: nothing new to save
            self._stop(None, interrupted=False)
        self._live["model"].train()
        signals.defer()  # Ctrl-C from here on: this step ends, is saved, and the run stops (exit 130)
        from tqdm.auto import tqdm

        self._live["progress"] = tqdm(total=self.args.max_steps, initial=self.step, desc="train", dynamic_ncols=True,
                                      disable=not self.accelerator.is_main_process)

    def micro_batches(self, stream: loop.SampleStream) -> list[list[int]]:
        """This rank's micro-batches (dataset indices) of the next optimizer step."""
        args = self.args
        return loop.rank_micro_batches(stream, samples_consumed=self.samples, micro_batch_size=args.micro_batch,
                                       accumulation_steps=args.grad_accum, rank=self.data_rank,
                                       data_parallel_size=self.data_parallel_size)

    def gradient_sync(self, *, last_micro_batch: bool):
        """Reduce gradients on the last micro-batch only (or on each: --reduce-every-micro-batch)."""
        return gradient_sync(self.accelerator, self._live["model"], last_micro_batch=last_micro_batch,
                                  reduce_every_micro_batch=self.args.reduce_every_micro_batch)

    def optimizer_step(self, optimizer, scheduler) -> tuple[float, float]:
        """Clip (norm summed in float64: the same number, and so the same clipping, under DDP,
        FSDP1 and FSDP2), step, zero the gradients; returns the norm and the learning rate the
        step used (read before the scheduler steps)."""
        grad_norm = clip_grad_norm(self.accelerator, self._live["model"], self.args.max_grad_norm)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return grad_norm, lr

    def end_step(self, *, loss: float, grad_norm: float, lr: float, tokens: float, started: float,
                 extra: dict[str, float] | None = None) -> None:
        """After ``optimizer_step``: count the step, log it, stop on a NaN/inf loss or norm (exit 1,
        nothing saved), evaluate and save when due, save and stop on Ctrl-C (exit 130).
        ``loss`` is the step's loss over all ranks, ``tokens`` the tokens all ranks trained on,
        ``started`` the ``time.perf_counter()`` at the start of the step, ``extra`` more values of the
        step for its metrics line (e.g. ``router_aux_loss``). Collective."""
        accelerator, args, live = self.accelerator, self.args, self._live
        self.step, self.samples = self.step + 1, self.samples + self.global_batch
        step, progress = self.step, live["progress"]
        step_time = time.perf_counter() - started
        self.metrics.log_train(step=step, loss=loss, lr=lr, grad_norm=grad_norm, tokens_per_s=tokens / step_time,
                               step_time_s=step_time, samples_seen=self.samples,
                               memory=device_memory_peaks(accelerator.device), **(extra or {}))
        progress.update(1)
        progress.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}")
        startup.stop_if_diverged(accelerator, self.checkpoints, step=step, loss=loss, grad_norm=grad_norm,
                                 learning_rate=args.learning_rate)  # NaN/inf: exit 1, nothing saved
        if step == args.max_steps or (args.eval_every and step % args.eval_every == 0):
            fault_point("evaluation", step=step, rank=self.rank)  # drills only (FSDP_PRESETS_FAULT)
            results = live["evaluate"]()
            self.metrics.log_eval(step=step, **results)
            if accelerator.is_main_process:
                progress.write(f"step {step}: {self._describe(results)}")
        # Ctrl-C or a preemption signal on any rank (one all-reduce): save this step, then stop.
        stopping, preempted = signals.agree(accelerator)
        if stopping or preempted or step == args.max_steps or (args.save_every and step % args.save_every == 0):
            startup.check_weights_finite(accelerator, live["model"], self.checkpoints, step=step)
            # --async-save: returns once the shards are staged; the final, a Ctrl-C and a preemption save
            # are committed here
            saved = self.saver.save(step=step, samples_consumed=self.samples, write_extra=self._write_model_config,
                                    wait=stopping or preempted or step == args.max_steps)
            if not (stopping or preempted):  # a signal during the save: this step is saved, stop now
                stopping, preempted = signals.agree(accelerator)
                if stopping or preempted:
                    saved = self.saver.wait() or saved  # --async-save: the save in flight is committed first
        else:
            self.saver.poll(step=step)  # --async-save: commit the save in flight once every rank's write is done
        if stopping or preempted:
            self._stop(saved, interrupted=not preempted)  # both: the preemption (exit 75)

    def _stop(self, saved, *, interrupted: bool) -> None:
        """Stop on Ctrl-C (exit 130) or a preemption signal (its metrics line, exit 75), the step
        reached saved (:func:`fsdp_presets.train.signals.stop`)."""
        checkpoint = saved if saved is not None else dict(committed_checkpoints(self.checkpoints.directory)).get(self.step)
        if not interrupted:
            self.metrics.log_preempted(step=self.step, signal=signals.received(),
                                       checkpoint=str(checkpoint) if checkpoint else None)
        signals.stop(self.accelerator, step=self.step, checkpoint=checkpoint, interrupted=interrupted)

    def _describe(self, results: dict[str, float]) -> str:
        shown = self._live["shown"]
        return f"eval loss {results['eval_loss']:.4f}, {shown} {results[shown]:.4g}"

    def _write_model_config(self, folder: Path) -> None:
        """Config, generation config and tokenizer inside each checkpoint, so it describes itself
        (main process, before the checkpoint's files are hashed)."""
        target = Path(folder) / MODEL_CONFIG
        unwrapped = self.accelerator.unwrap_model(self._live["model"])
        if self.lora:  # adapter_config.json and the PEFT key names, for `fsdp-presets export`
            write_adapter_files(folder, self.lora, self._live["key_map"], unwrapped.peft_config["default"])
        unwrapped.config.save_pretrained(target)
        if getattr(unwrapped, "generation_config", None) is not None:
            unwrapped.generation_config.save_pretrained(target)
        self.tokenizer.save_pretrained(target)

    # ---- save ----
    def export(self, *, model_class) -> None:
        """The trained model as a Hugging Face folder in ``final/`` (LoRA/QLoRA: a PEFT adapter
        folder; with --export-merged also ``merged/``), then the plots. Collective."""
        accelerator, args, model = self.accelerator, self.args, self._live["model"]
        self._live["progress"].close()
        self.saver.wait()  # a save still in flight is committed before the export
        if self.lora:
            export_adapter(accelerator, model, self.tokenizer, self.folder.final, key_map=self._live["key_map"],
                           lora=self.lora, base_path=args.model, model_class=model_class,
                           merged_dir=self.folder.root / MERGED if args.export_merged else None)
        else:
            export_model(accelerator, model, self.tokenizer, self.folder.final)
        if accelerator.is_main_process:
            if self.saver.summary():
                self.say(self.saver.summary())
            if (line := throughput_at_end(self.folder.metrics, self.accelerator.num_processes)) is not None:
                self.say(line)
            plots = plot_run(self.folder.root)
            self.say(f"done: model in {self.folder.final}, metrics in {self.folder.metrics}, "
                     f"plots {', '.join(map(str, plots))}")

    def finish(self) -> None:
        """Let go of the model, optimizer state and evaluation, then end the process group (the
        recipe drops its own references first; see :func:`fsdp_presets.train.loop.finish`)."""
        if self.saver is not None:
            self.saver.close()  # a clean exit never leaves a save in flight
        self._live.clear()
        self.checkpoints = self.saver = None
        loop.finish(self.accelerator)


def start(args, *, recipe: str) -> RecipeRun:
    """Launch and check, before anything is written: real FSDP/DDP on a CPU-only host too
    (refused if the processes would train alone, or if the launch is not what the generated
    preset's header planned), the flags and input paths on every rank and
    the ranks' agreement (exit 2), the run folder (another run's, or other files: refused), the
    run lock (one job per folder), the run's first day (``started_on``, kept by a continued run), the
    model config (no code from the model folder) and ``--seq-len`` against it, the tokenizer, the
    seed. ``recipe`` names the run in run.json."""
    import fsdp_presets
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from transformers import AutoTokenizer

    try:  # SIGTERM/SIGUSR1 from here on set a flag; the ranks answer it together (train/signals.py)
        signals.install(signals.parse_signals(args.preempt_signals),
                        checkpoints=RunFolder(root=Path(args.output_dir)).checkpoints)
    except UsageError:
        pass  # refused with the other flags by startup.check_start
    fsdp_presets.enable_cpu_fsdp()
    accelerator = Accelerator(step_scheduler_with_optimizer=False)  # the schedule counts optimizer steps
    fsdp_presets.check_launch(accelerator)
    try:  # a checkpoint to continue keeps its global batch, at any process count
        resuming = args.resume not in ("auto", "none") or (
            args.resume == "auto" and bool(committed_checkpoints(RunFolder(root=Path(args.output_dir)).checkpoints)))
    except OSError:  # an unreadable output folder: check_output_dir names it below
        resuming = True
    raise_on_every_rank(accelerator, startup.preset_launch_problem(accelerator, launch_config_file(),
                                                                   resuming=resuming)  # the header's plan
                        or startup.mesh_launch_problem(launch_config_file(), args.distributed_config))
    if args.fsdp_reduce_dtype:
        loop.set_fsdp_reduce_dtype(accelerator, args.fsdp_reduce_dtype)
    say = loop.main_process_print(accelerator)
    # --distributed-config: transformers shards the model over the file's mesh (checked against the launch)
    mesh = None
    if args.distributed_config:
        mesh = load_model_mesh(args.distributed_config, rank=accelerator.process_index,
                               world_size=accelerator.num_processes, lora=recipe_lora.settings(args))
        check_mesh_launch(accelerator, mesh)
        say(f"mesh: {mesh.label()} ({args.distributed_config}): transformers shards the model at load time")
    distributed = distributed_settings(accelerator, model_mesh=mesh.settings() if mesh is not None else None)

    startup.check_start(accelerator, args)  # every rank, then: do all ranks agree? (exit 2 if not)
    data_files = [args.data] + ([args.eval_data] if args.eval_data else [])
    identity = run_identity(recipe=recipe, model=str(Path(args.model).resolve()), data_sha256=sha256_files(data_files),
                            seed=args.seed, seq_len=args.seq_len)
    settings = training_settings(args)  # a continued run keeps them
    method = recipe_lora.settings(args)  # LoRA/QLoRA: method and shape (None: every weight trains)
    settings[METHOD_KEY] = dict(method) if method else None  # LoRA/QLoRA: a continued run keeps it
    folder = check_output_dir(args.output_dir, identity, args.resume, settings)
    if args.resume != "none" and (note := schedule_change_note(folder.root, args.max_steps, settings)):
        say(f"note: {note}")
    accelerator.wait_for_everyone()  # every rank has checked before rank 0 writes run.json
    acquire_run_lock(folder, accelerator, log=say)  # one job per run folder (run.lock, released at exit)
    started_on = agreed_first_day(folder, args.resume)  # the date a dated chat template renders (chat_data)
    config = loop.load_model_config(args.model)  # never runs code from the model folder
    loop.check_seq_len(args.seq_len, config)
    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=False)
    set_seed(args.seed)
    return RecipeRun(accelerator=accelerator, args=args, folder=folder,
                     record=RunInfo(identity=identity, settings=settings, started_on=started_on),
                     lora=method, config=config, tokenizer=tokenizer, distributed=distributed, mesh=mesh, say=say)
