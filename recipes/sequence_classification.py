"""Fine-tune an encoder (BERT, MiniLM, RoBERTa, ...) for sequence classification with FSDP.

    python scripts/prepare_models.py     # all-MiniLM-L6-v2 into runs/models/
    fsdp-presets generate runs/models/all-minilm-l6-v2 --device cpu --gpus 2 \
        --seq-len 40 --micro-batch 8 --global-batch 16 -o runs/minilm_fsdp2.yaml
    accelerate launch --config_file runs/minilm_fsdp2.yaml recipes/sequence_classification.py \
        --model runs/models/all-minilm-l6-v2 \
        --data data/kjv_genres/train.jsonl --eval-data data/kjv_genres/eval.jsonl \
        --output-dir runs/genres --max-steps 60 --micro-batch-size 8 --learning-rate 3e-4 --seq-len 40

Data: JSONL (or CSV, Parquet) with `text` and `label` columns; labels may be names or numbers and
are numbered in sorted order (the names go into the exported config's id2label); a model that already
has a classification head keeps its labels, and data that does not fit them is refused (--new-head:
a head for the data's labels in its place). Accuracy comes
from `evaluate` through a local metric module (Hub metrics cannot load offline).
Writes OUTPUT_DIR/{run.json, metrics.jsonl, checkpoints/step-NNNNNNNN/, final/, plots/}.
Restarting the same command continues from the last valid checkpoint (--resume auto).
Adapt by copying: the sections below are data, model, resume, train, save.
"""

import time
from pathlib import Path

import evaluate
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_scheduler

import fsdp_presets
from fsdp_presets.train import data as recipe_data
from fsdp_presets.train import interrupts
from fsdp_presets.train import startup
from fsdp_presets.train import loop
from fsdp_presets.train import lora as recipe_lora  # LoRA/QLoRA
from fsdp_presets.checkpoint.manager import CheckpointManager
from fsdp_presets.fileio import config_digest, sha256_files
from fsdp_presets.train.eval_metrics import metric_path
from fsdp_presets.train.final_model import export_model
from fsdp_presets.train.metrics import MetricsLog
from fsdp_presets.train.plots import plot_run
from fsdp_presets.checkpoint.run_folder import (acquire_run_lock, check_output_dir, distributed_settings, launch_config_file,
                                     training_settings, write_run_json)

COLUMNS = ("input_ids", "attention_mask", "labels")


def sample_losses(model, batch):
    """The loss of each sample of a batch and the predicted labels (the caller sums and divides by
    the number of samples over all ranks and micro-batches, so the split does not matter)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    return F.cross_entropy(logits, batch["labels"], reduction="none"), logits.argmax(-1)


def main():
    parser = loop.recipe_argument_parser(__doc__)
    parser.add_argument("--new-head", action="store_true", help="a model that has a classification head for "
                        "other labels: train a head for the data's labels in its place")
    recipe_lora.add_arguments(parser)  # LoRA/QLoRA: --lora-r/-alpha/-dropout/-target-modules, --load-in-4bit
    args = parser.parse_args()
    # ---- launch: real FSDP/DDP on a CPU-only host too, refused if processes would train alone ----
    fsdp_presets.enable_cpu_fsdp()
    accelerator = Accelerator(step_scheduler_with_optimizer=False)  # the schedule counts optimizer steps
    fsdp_presets.check_launch(accelerator)
    say = loop.main_process_print(accelerator)
    rank = accelerator.process_index
    distributed = distributed_settings(accelerator)
    dp_size = distributed["data_parallel_size"]

    # ---- checks before anything is written ----
    startup.check_start(accelerator, args)  # every rank, then: do all ranks agree? (exit 2 if not)
    data_files = [args.data] + ([args.eval_data] if args.eval_data else [])
    identity = {"recipe": "sequence_classification", "model": str(Path(args.model).resolve()),
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
        train_set, eval_set, label_names = recipe_data.classification_splits(
            data=args.data, eval_data=args.eval_data, eval_fraction=args.eval_fraction, tokenizer=tokenizer,
            seq_len=args.seq_len, seed=args.seed, max_eval_samples=args.max_eval_samples,
            head_labels=None if args.new_head else startup.classifier_head_labels(config))
        accuracy_metric = evaluate.load(metric_path("accuracy"))
    stream = loop.SampleStream(len(train_set), seed=args.seed)
    global_batch = args.micro_batch_size * args.gradient_accumulation_steps * dp_size

    # ---- model: a new classification head, initialised from --seed identically on every rank ----
    config.num_labels = len(label_names)
    config.id2label = dict(enumerate(label_names))
    config.label2id = {name: index for index, name in enumerate(label_names)}
    # LoRA/QLoRA: a peft model whose adapters and classification head train (else every weight)
    model = recipe_lora.load_model(AutoModelForSequenceClassification, args.model, method, task_type="SEQ_CLS",
                                   mixed_precision=accelerator.mixed_precision, config=config, ignore_mismatched_sizes=args.new_head)
    key_map = recipe_lora.adapter_key_map(model) if method else None  # LoRA/QLoRA

    def build_optimizer(model):
        optimizer = torch.optim.AdamW(loop.param_groups(model, args.weight_decay), lr=args.learning_rate)
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
    if resume_from is not None:
        manifest = checkpoints.load(resume_from)
        step, samples = manifest.step, manifest.samples_consumed
        say(f"resumed from {resume_from}: step {step}, {samples} samples consumed "
            f"(saved by {manifest.world_size} processes, now {accelerator.num_processes})")
    memory = recipe_lora.memory_record(accelerator, model) if method else {}  # LoRA/QLoRA: bytes per rank
    if accelerator.is_main_process:
        write_run_json(run, {**identity, "training": method, **memory, "data": args.data, "max_steps": args.max_steps,
                             "micro_batch_size": args.micro_batch_size,
                             "gradient_accumulation_steps": args.gradient_accumulation_steps,
                             "global_batch_samples": global_batch, "learning_rate": args.learning_rate,
                             **distributed, "accelerate_config": launch_config_file(),
                             **settings, "resumed_from": str(resume_from) if resume_from else None,
                             "labels": label_names})
    metrics = MetricsLog(run.metrics, enabled=accelerator.is_main_process, keep_through_step=step)

    def evaluate_model():
        model.eval()
        loss_sum = torch.zeros((), dtype=torch.float64)
        predictions, references, counted = [], [], []
        with torch.no_grad():
            for slots in loop.eval_micro_batches(len(eval_set), micro_batch_size=args.micro_batch_size,
                                                     rank=rank, data_parallel_size=dp_size):
                batch = loop.collate(eval_set, [index for index, _ in slots], COLUMNS)
                keep = torch.tensor([counts for _, counts in slots])
                losses, predicted = sample_losses(model, batch)
                loss_sum += losses[keep].sum().double()
                predictions.append(predicted), references.append(batch["labels"]), counted.append(keep)
        model.train()
        # Every rank ran the same number of equal batches, so gather needs no padding.
        predicted, reference, keep = (accelerator.gather(torch.cat(part).to(accelerator.device))
                                      for part in (predictions, references, counted))
        total_loss = accelerator.reduce(loss_sum.to(accelerator.device), reduction="sum").item()
        keep = keep.bool()
        accuracy = accuracy_metric.compute(predictions=predicted[keep].tolist(),
                                           references=reference[keep].tolist())["accuracy"]
        return {"eval_loss": total_loss / len(eval_set), "accuracy": accuracy}

    if step == 0:
        results = evaluate_model()
        metrics.log_eval(step=0, **results)
        say(f"before training: eval loss {results['eval_loss']:.4f}, accuracy {results['accuracy']:.3f}")

    # ---- train ----
    model.train()
    interrupts.defer()  # Ctrl-C from here on: this step ends, is saved, and the run stops (exit 130)
    progress = tqdm(total=args.max_steps, initial=step, disable=not accelerator.is_main_process,
                    desc="train", dynamic_ncols=True)
    while step < args.max_steps:
        started = time.perf_counter()
        batches = [loop.collate(train_set, indices, COLUMNS) for indices in loop.rank_micro_batches(
            stream, samples_consumed=samples, micro_batch_size=args.micro_batch_size,
            accumulation_steps=args.gradient_accumulation_steps, rank=rank, data_parallel_size=dp_size)]
        loss_sum = torch.zeros((), dtype=torch.float64)
        for index, batch in enumerate(batches):
            with loop.gradient_sync(accelerator, model, last_micro_batch=index == len(batches) - 1,
                                         reduce_every_micro_batch=args.reduce_every_micro_batch):
                loss = sample_losses(model, batch)[0].sum()
                # DDP and FSDP average gradients over ranks: scale by dp so the result is sum / samples.
                accelerator.backward(loss * dp_size / global_batch)
            loss_sum += loss.detach().double()
        # Norm summed in float64: the same number, and so the same clipping, under DDP, FSDP1 and FSDP2.
        grad_norm = loop.clip_grad_norm(accelerator, model, args.max_grad_norm)
        lr = scheduler.get_last_lr()[0]  # the rate this step uses (the scheduler steps after it)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step, samples = step + 1, samples + global_batch
        step_loss = accelerator.reduce(loss_sum.to(accelerator.device), reduction="sum").item() / global_batch
        step_time = time.perf_counter() - started
        local_tokens = sum(batch["attention_mask"].sum() for batch in batches).float().to(accelerator.device)
        tokens = accelerator.reduce(local_tokens, reduction="sum").item()
        metrics.log_train(step=step, loss=step_loss, lr=lr, grad_norm=grad_norm,
                          tokens_per_s=tokens / step_time, step_time_s=step_time, samples_seen=samples)
        progress.update(1)
        progress.set_postfix(loss=f"{step_loss:.4f}", lr=f"{lr:.2e}")
        startup.stop_if_diverged(accelerator, checkpoints, step=step, loss=step_loss, grad_norm=grad_norm,
                                       learning_rate=args.learning_rate)  # NaN/inf: exit 1, nothing saved
        if step == args.max_steps or (args.eval_every and step % args.eval_every == 0):
            results = evaluate_model()
            metrics.log_eval(step=step, **results)
            if accelerator.is_main_process:
                progress.write(f"step {step}: eval loss {results['eval_loss']:.4f}, accuracy {results['accuracy']:.3f}")
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
                                   base_path=args.model, model_class=AutoModelForSequenceClassification,
                                   merged_dir=run.root / recipe_lora.MERGED if args.export_merged else None)
    else:
        export_model(accelerator, model, tokenizer, run.final)
    if accelerator.is_main_process:
        plots = plot_run(run.root)
        say(f"done: model in {run.final}, metrics in {run.metrics}, plots {', '.join(map(str, plots))}")
    model = optimizer = scheduler = None  # freed before the process group goes (see loop.finish)
    loop.finish(accelerator)


def _save_config(folder, accelerator, model, tokenizer, method=None, key_map=None):
    """Config and tokenizer inside each checkpoint, so it describes itself."""
    target = Path(folder) / "model_config"
    accelerator.unwrap_model(model).config.save_pretrained(target)
    if method:  # LoRA/QLoRA: adapter_config.json and the PEFT key names, for `fsdp-presets export`
        recipe_lora.write_checkpoint_extra(folder, method, key_map,
                                           accelerator.unwrap_model(model).peft_config["default"])
    tokenizer.save_pretrained(target)


if __name__ == "__main__":
    raise SystemExit(loop.run_recipe(main))
