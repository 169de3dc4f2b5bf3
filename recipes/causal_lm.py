"""Fine-tune a causal language model (supervised fine-tuning or continued pre-training) with FSDP.

    accelerate launch --config_file accelerate_configs/cpu_fsdp2_demo.yaml recipes/causal_lm.py \
        --model runs/models/smollm2-135m-instruct --data data/kjv_sft/train.jsonl \
        --eval-data data/kjv_sft/eval.jsonl --output-dir runs/sft --max-steps 20 --seq-len 64

Data: JSONL with `prompt`/`response` (the prompt is masked out of the loss) or `text`, or plain
text. Samples are packed into blocks of --seq-len tokens (--no-packing: one padded sample each).
Writes OUTPUT_DIR/{run.json, metrics.jsonl, checkpoints/step-NNNNNNNN/, final/, plots/}.
Restarting the same command continues from the last valid checkpoint (--resume auto).
Adapt by copying: the sections below are data, model, resume, train, save.
"""

import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, get_scheduler

import fsdp_presets
from fsdp_presets.train import data as recipe_data
from fsdp_presets.train import interrupts
from fsdp_presets.train import startup
from fsdp_presets.train import loop
from fsdp_presets.checkpoint import resume
from fsdp_presets.train import lora as recipe_lora  # LoRA/QLoRA
from fsdp_presets.checkpoint.manager import CheckpointManager, Manifest
from fsdp_presets.fileio import config_digest, sha256_files
from fsdp_presets.train.final_model import export_model
from fsdp_presets.train.metrics import MetricsLog
from fsdp_presets.train.plots import plot_run
from fsdp_presets.checkpoint.run_folder import (acquire_run_lock, check_output_dir, distributed_settings, launch_config_file,
                                     training_settings, write_run_json)


def parse_args():
    parser = loop.recipe_argument_parser(__doc__)
    parser.add_argument("--no-packing", action="store_true", help="one padded sample per row instead of packing")
    parser.add_argument("--fsdp-reduce-dtype", choices=("fp32", "bf16"),
                        help="dtype FSDP reduces gradients in (default: accelerate's, which follows "
                        "mixed_precision; no accelerate config key sets it)")
    recipe_lora.add_arguments(parser)  # LoRA/QLoRA: --lora-r/-alpha/-dropout/-target-modules, --load-in-4bit
    return parser.parse_args()


def summed_loss(model, batch):
    """Sum of the token losses of a batch and the number of tokens it counts (labels != -100).
    The caller divides by the count over all ranks and micro-batches, so each token weighs the
    same whatever the split of the global batch (DDP = FSDP = another GPU count)."""
    # use_cache=False: with activation checkpointing the recomputed forward would find a KV
    # cache already filled by the first one (wrong shapes, or silently wasted memory).
    logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                   use_cache=False).logits
    shifted_logits = logits[:, :-1, :].float()
    shifted_labels = batch["labels"][:, 1:]
    loss = F.cross_entropy(shifted_logits.reshape(-1, shifted_logits.size(-1)), shifted_labels.reshape(-1),
                           ignore_index=recipe_data.IGNORE_INDEX, reduction="sum")
    counted = shifted_labels != recipe_data.IGNORE_INDEX
    correct = ((shifted_logits.argmax(-1) == shifted_labels) & counted).sum()
    return loss, counted.sum(), correct


def main():
    args = parse_args()
    # ---- launch: real FSDP/DDP on a CPU-only host too, refused if processes would train alone ----
    fsdp_presets.enable_cpu_fsdp()
    accelerator = Accelerator(step_scheduler_with_optimizer=False)  # the schedule counts optimizer steps
    fsdp_presets.check_launch(accelerator)
    if args.fsdp_reduce_dtype:
        _set_fsdp_reduce_dtype(accelerator, args.fsdp_reduce_dtype)
    say = loop.main_process_print(accelerator)
    rank, world = accelerator.process_index, accelerator.num_processes
    distributed = distributed_settings(accelerator)
    dp_size = distributed["data_parallel_size"]

    # ---- checks before anything is written ----
    startup.check_start(accelerator, args)  # every rank, then: do all ranks agree? (exit 2 if not)
    data_files = [args.data] + ([args.eval_data] if args.eval_data else [])
    identity = {"recipe": "causal_lm", "model": str(Path(args.model).resolve()),
                "data_sha256": sha256_files(data_files), "seed": args.seed, "seq_len": args.seq_len}
    settings = training_settings(args)  # a continued run keeps them
    method = recipe_lora.settings(args)  # LoRA/QLoRA: method and shape (None: every weight trains)
    settings["lora"] = dict(method) if method else None  # LoRA/QLoRA: a continued run keeps it
    run = check_output_dir(args.output_dir, identity, args.resume, settings)
    accelerator.wait_for_everyone()  # every rank has checked before rank 0 writes run.json
    acquire_run_lock(run, accelerator, log=say)  # one job per run folder (run.lock, released at exit)
    config = loop.load_model_config(args.model)  # never runs code from the model folder
    loop.check_seq_len(args.seq_len, config)
    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=False)
    set_seed(args.seed)

    # ---- data ----
    with accelerator.main_process_first():
        train_set, eval_set = recipe_data.causal_lm_splits(
            data=args.data, eval_data=args.eval_data, eval_fraction=args.eval_fraction, tokenizer=tokenizer,
            seq_len=args.seq_len, packing=not args.no_packing, seed=args.seed,
            max_eval_samples=args.max_eval_samples)
    columns = ("input_ids", "labels") + (("attention_mask",) if args.no_packing else ())
    stream = loop.SampleStream(len(train_set), seed=args.seed)
    global_batch = args.micro_batch_size * args.gradient_accumulation_steps * dp_size

    # ---- model ----
    model = recipe_lora.load_model(AutoModelForCausalLM, args.model, method, task_type="CAUSAL_LM",  # LoRA: peft
                                   mixed_precision=accelerator.mixed_precision)
    key_map = recipe_lora.adapter_key_map(model) if method else None  # LoRA/QLoRA

    def build_optimizer(model):
        optimizer = torch.optim.AdamW(loop.param_groups(model, args.weight_decay), lr=args.learning_rate,
                                      betas=(0.9, 0.95))
        return optimizer, get_scheduler(args.lr_scheduler, optimizer, num_warmup_steps=args.warmup_steps,
                                        num_training_steps=args.max_steps)

    # The optimizer before or after the model is wrapped, as the FSDP version needs (LoRA on FSDP1: after).
    model, optimizer, scheduler = recipe_lora.prepare(accelerator, model, build_optimizer, lora=method)

    # ---- resume ----
    checkpoints = CheckpointManager(accelerator=accelerator, directory=run.checkpoints, keep_last=args.keep_last,
                                    config_digest=config_digest(config), distributed=distributed, log=say,
                                    training=method,  # LoRA/QLoRA: trainable weights only, base from --model
                                    state=recipe_lora.TrainableState(accelerator, model, optimizer) if method else None)
    resume_from = checkpoints.resolve(args.resume, max_steps=args.max_steps)
    step = samples = 0
    if resume_from is not None and resume.is_imported(resume_from):  # `fsdp-presets import`: weights only
        resume.load_imported(model, resume_from, config_digest=config_digest(config))
        say(f"started from imported weights {resume_from}: step 0, fresh optimizer and schedule")
    elif resume_from is not None:
        saved = Manifest.read(resume_from)
        # Another process count: keep the global batch (and so the samples of every step).
        args.gradient_accumulation_steps, note = resume.keep_global_batch(
            resume_from, step=saved.step, samples_consumed=saved.samples_consumed,
            micro_batch_size=args.micro_batch_size, gradient_accumulation_steps=args.gradient_accumulation_steps,
            data_parallel_size=dp_size)
        global_batch = args.micro_batch_size * args.gradient_accumulation_steps * dp_size
        if note:
            say(note)
        manifest = checkpoints.load(resume_from)
        step, samples = manifest.step, manifest.samples_consumed
        say(f"resumed from {resume_from}: step {step}, {samples} samples consumed "
            f"(saved by {manifest.world_size} processes, now {world})")
    memory = recipe_lora.memory_record(accelerator, model) if method else {}  # LoRA/QLoRA: bytes per rank
    if accelerator.is_main_process:
        write_run_json(run, {**identity, "training": method, **memory, "data": args.data, "max_steps": args.max_steps,
                             "micro_batch_size": args.micro_batch_size,
                             "gradient_accumulation_steps": args.gradient_accumulation_steps,
                             "global_batch_samples": global_batch, "learning_rate": args.learning_rate,
                             **distributed, "accelerate_config": launch_config_file(),
                             **settings, "resumed_from": str(resume_from) if resume_from else None})
    metrics = MetricsLog(run.metrics, enabled=accelerator.is_main_process, keep_through_step=step)

    def evaluate():
        model.eval()
        totals = torch.zeros(3, dtype=torch.float64)  # loss sum, tokens, correct tokens
        with torch.no_grad():
            for slots in loop.eval_micro_batches(len(eval_set), micro_batch_size=args.micro_batch_size,
                                                     rank=rank, data_parallel_size=dp_size):
                batch = loop.collate(eval_set, [index for index, _ in slots], columns)
                batch["labels"][torch.tensor([not counts for _, counts in slots])] = recipe_data.IGNORE_INDEX
                loss, count, correct = summed_loss(model, batch)
                totals += torch.stack([loss.double(), count.double(), correct.double()])
        model.train()
        loss_sum, count, correct = accelerator.reduce(totals.to(accelerator.device), reduction="sum").tolist()
        eval_loss = loss_sum / max(count, 1)
        return {"eval_loss": eval_loss, "perplexity": math.exp(min(eval_loss, 50.0)),
                "token_accuracy": correct / max(count, 1)}

    if step == 0:
        results = evaluate()
        metrics.log_eval(step=0, **results)
        say(f"before training: eval loss {results['eval_loss']:.4f}, perplexity {results['perplexity']:.2f}")

    # ---- train ----
    model.train()
    interrupts.defer()  # Ctrl-C from here on: this step ends, is saved, and the run stops (exit 130)
    progress = tqdm(total=args.max_steps, initial=step, disable=not accelerator.is_main_process,
                    desc="train", dynamic_ncols=True)
    while step < args.max_steps:
        started = time.perf_counter()
        batches = [loop.collate(train_set, indices, columns) for indices in loop.rank_micro_batches(
            stream, samples_consumed=samples, micro_batch_size=args.micro_batch_size,
            accumulation_steps=args.gradient_accumulation_steps, rank=rank, data_parallel_size=dp_size)]
        local_targets = sum(int((batch["labels"][:, 1:] != recipe_data.IGNORE_INDEX).sum()) for batch in batches)
        global_targets = accelerator.reduce(torch.tensor(float(local_targets), device=accelerator.device),
                                            reduction="sum").item()
        loss_sum = torch.zeros((), dtype=torch.float64)
        for index, batch in enumerate(batches):
            with loop.gradient_sync(accelerator, model, last_micro_batch=index == len(batches) - 1,
                                         reduce_every_micro_batch=args.reduce_every_micro_batch):
                loss, _, _ = summed_loss(model, batch)
                # DDP and FSDP average gradients over ranks: scale by dp so the result is sum / tokens.
                accelerator.backward(loss * dp_size / max(global_targets, 1.0))
            loss_sum += loss.detach().double()
        # Norm summed in float64: the same number, and so the same clipping, under DDP, FSDP1 and FSDP2.
        grad_norm = loop.clip_grad_norm(accelerator, model, args.max_grad_norm)
        lr = scheduler.get_last_lr()[0]  # the rate this step uses (the scheduler steps after it)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step, samples = step + 1, samples + global_batch
        step_loss = accelerator.reduce(loss_sum.to(accelerator.device), reduction="sum").item()
        step_loss /= max(global_targets, 1.0)
        step_time = time.perf_counter() - started
        tokens = global_batch * args.seq_len
        metrics.log_train(step=step, loss=step_loss, lr=lr, grad_norm=grad_norm,
                          tokens_per_s=tokens / step_time, step_time_s=step_time, samples_seen=samples)
        progress.update(1)
        progress.set_postfix(loss=f"{step_loss:.4f}", lr=f"{lr:.2e}")
        startup.stop_if_diverged(accelerator, checkpoints, step=step, loss=step_loss, grad_norm=grad_norm,
                                       learning_rate=args.learning_rate)  # NaN/inf: exit 1, nothing saved
        if step == args.max_steps or (args.eval_every and step % args.eval_every == 0):
            results = evaluate()
            metrics.log_eval(step=step, **results)
            if accelerator.is_main_process:
                progress.write(f"step {step}: eval loss {results['eval_loss']:.4f}, "
                               f"perplexity {results['perplexity']:.2f}")
        stopping = interrupts.requested(accelerator)  # a Ctrl-C on any rank: save this step, then stop
        if stopping or step == args.max_steps or (args.save_every and step % args.save_every == 0):
            startup.check_weights_finite(accelerator, model, checkpoints, step=step)
            saved = checkpoints.save(step=step, samples_consumed=samples,
                                     write_extra=lambda folder: _save_config(folder, accelerator, model, tokenizer,
                                                                             method, key_map))
        if stopping:
            interrupts.stop(accelerator, saved, step=step)
    progress.close()

    # ---- save: the trained model as a Hugging Face folder, and the plots ----
    if method:  # LoRA/QLoRA: final/ is a PEFT adapter folder; --export-merged adds OUTPUT_DIR/merged
        recipe_lora.export_adapter(accelerator, model, tokenizer, run.final, key_map=key_map, lora=method,
                                   base_path=args.model,
                                   model_class=AutoModelForCausalLM,
                                   merged_dir=run.root / recipe_lora.MERGED if args.export_merged else None)
    else:
        export_model(accelerator, model, tokenizer, run.final)
    if accelerator.is_main_process:
        plots = plot_run(run.root)
        say(f"done: model in {run.final}, metrics in {run.metrics}, plots {', '.join(map(str, plots))}")
    model = optimizer = scheduler = None  # freed before the process group goes (see loop.finish)
    loop.finish(accelerator)


def _set_fsdp_reduce_dtype(accelerator, name):
    """Keep the FSDP mixed-precision policy, change only the dtype gradients are reduced in."""
    import dataclasses

    from fsdp_presets.errors import UsageError

    plugin = accelerator.state.fsdp_plugin
    if accelerator.distributed_type.value != "FSDP" or plugin is None:
        raise UsageError("--fsdp-reduce-dtype needs an FSDP accelerate config")
    if plugin.fsdp_version == 2:
        from torch.distributed.fsdp import MixedPrecisionPolicy as Policy
    else:
        from torch.distributed.fsdp import MixedPrecision as Policy
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
    plugin.mixed_precision_policy = dataclasses.replace(plugin.mixed_precision_policy or Policy(), reduce_dtype=dtype)


def _save_config(folder, accelerator, model, tokenizer, method=None, key_map=None):
    """Config, generation config and tokenizer inside each checkpoint, so it describes itself."""
    target = Path(folder) / "model_config"
    unwrapped = accelerator.unwrap_model(model)
    if method:  # LoRA/QLoRA: adapter_config.json and the PEFT key names, for `fsdp-presets export`
        recipe_lora.write_checkpoint_extra(folder, method, key_map, unwrapped.peft_config["default"])
    unwrapped.config.save_pretrained(target)
    if getattr(unwrapped, "generation_config", None) is not None:
        unwrapped.generation_config.save_pretrained(target)
    tokenizer.save_pretrained(target)


if __name__ == "__main__":
    raise SystemExit(loop.run_recipe(main))
