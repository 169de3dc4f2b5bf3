"""Fine-tune an encoder (BERT, MiniLM, RoBERTa, ...) for sequence classification with FSDP.

    python scripts/prepare_models.py     # all-MiniLM-L6-v2 into runs/models/
    fsdp-presets generate runs/models/all-minilm-l6-v2 --device cpu --gpus 2 \
        --seq-len 40 --micro-batch 8 --global-batch 16 -o runs/minilm_fsdp2.yaml
    accelerate launch --config_file runs/minilm_fsdp2.yaml recipes/sequence_classification.py \
        --model runs/models/all-minilm-l6-v2 \
        --data data/kjv_genres/train.jsonl --eval-data data/kjv_genres/eval.jsonl \
        --output-dir runs/genres --max-steps 60 --micro-batch 8 --learning-rate 3e-4 --seq-len 40

Data: JSONL (or CSV, Parquet) with `text` and `label` columns; labels may be names or numbers and
are numbered in sorted order (the names go into the exported config's id2label); a model that already
has a classification head keeps its labels, and data that does not fit them is refused (--new-head:
a head for the data's labels in its place). Accuracy is the share of evaluation samples whose
predicted label is right (no `evaluate` import: it costs seconds per process; for other metrics,
`evaluate.load(fsdp_presets.train.eval_metrics.metric_path(NAME))` loads a local metric module).
Writes OUTPUT_DIR/{run.json, metrics.jsonl, checkpoints/step-NNNNNNNN/, final/, plots/}.
Restarting the same command continues from the last valid checkpoint (--resume auto), also on
another number of processes (the gradient accumulation changes to keep the global batch);
--resume PATH also takes a checkpoint written by `fsdp-presets import` (weights only, step 0).
Launch, checks, run folder, resume, metrics, saves and export are fsdp_presets.train.recipe's.
Adapt by copying: the sections below are data, model, resume, train, save.
"""

import time

import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification
from fsdp_presets.numerics import param_groups

from fsdp_presets.train import data as recipe_data
from fsdp_presets.train import loop, recipe, startup
from fsdp_presets.train import lora as recipe_lora  # LoRA/QLoRA
from fsdp_presets.train import model_setup

COLUMNS = ("input_ids", "attention_mask", "labels")


def parse_args():
    parser = loop.recipe_argument_parser(__doc__)  # the flags every recipe shares (LoRA/QLoRA included)
    parser.add_argument("--new-head", action="store_true", help="a model that has a classification head for "
                        "other labels: train a head for the data's labels in its place")
    return parser.parse_args()


def sample_losses(model, batch):
    """The loss of each sample of a batch and the predicted labels (the caller sums and divides by
    the number of samples over all ranks and micro-batches, so the split does not matter)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    return F.cross_entropy(logits, batch["labels"], reduction="none"), logits.argmax(-1)


def main():
    args = parse_args()
    # ---- launch and checks: real FSDP/DDP on a CPU-only host too; flags, ranks, run folder, lock ----
    run = recipe.start(args, recipe="sequence_classification")  # nothing is written before every check passed
    accelerator, tokenizer, config = run.accelerator, run.tokenizer, run.config
    rank, dp_size = run.data_rank, run.data_parallel_size  # this rank's share of the data (TP ranks share one)

    # ---- data ----
    with accelerator.main_process_first():
        train_set, eval_set, label_names = recipe_data.classification_splits(
            data=args.data, eval_data=args.eval_data, eval_fraction=args.eval_fraction, tokenizer=tokenizer,
            seq_len=args.seq_len, seed=args.seed, max_eval_samples=args.max_eval_samples,
            head_labels=None if args.new_head else startup.classifier_head_labels(config))
    stream = loop.SampleStream(len(train_set), seed=args.seed)

    # ---- model: a new classification head, initialised from --seed identically on every rank ----
    config.num_labels = len(label_names)
    config.id2label = dict(enumerate(label_names))
    config.label2id = {name: index for index, name in enumerate(label_names)}
    # LoRA/QLoRA: a peft model whose adapters and classification head train (else every weight)
    model = model_setup.load_model(AutoModelForSequenceClassification, args.model, run.lora, task_type="SEQ_CLS",
                                   mixed_precision=accelerator.mixed_precision, config=config,
                                   ignore_mismatched_sizes=args.new_head, mesh=run.mesh)  # TP/EP mesh
    key_map = recipe_lora.adapter_key_map(model) if run.lora else None  # LoRA/QLoRA

    def build_optimizer(model):
        optimizer = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.learning_rate)
        return optimizer, loop.lr_scheduler(args.lr_scheduler, optimizer, num_warmup_steps=args.warmup_steps,
                                              num_training_steps=args.max_steps)

    # The optimizer before or after the model is wrapped, as the FSDP version needs (LoRA on FSDP1: after).
    model, optimizer, scheduler = model_setup.prepare(accelerator, model, build_optimizer, lora=run.lora)

    # ---- resume: a checkpoint (any process count: the global batch is kept), imported weights, or step 0 ----
    run.resume(model, optimizer, key_map=key_map, record={"labels": label_names})

    def evaluate_model():
        model.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=accelerator.device)  # loss sum, correct samples
        with torch.no_grad():
            for slots in loop.eval_micro_batches(len(eval_set), micro_batch_size=args.micro_batch,
                                                 rank=rank, data_parallel_size=dp_size):
                batch = loop.collate(eval_set, [index for index, _ in slots], COLUMNS, accelerator.device)
                keep = torch.tensor([counts for _, counts in slots], device=accelerator.device)
                losses, predicted = sample_losses(model, batch)
                totals += torch.stack([losses[keep].sum().double(),
                                       (predicted[keep] == batch["labels"][keep]).sum().double()])
        model.train()
        total_loss, correct = run.reduce(totals).tolist()  # over the ranks, each sample once
        return {"eval_loss": total_loss / len(eval_set), "accuracy": correct / len(eval_set)}

    # ---- train ----
    run.begin_training(evaluate_model, shown="accuracy")  # evaluates at step 0; Ctrl-C now saves, then stops
    while run.step < args.max_steps:
        started = time.perf_counter()
        batches = [loop.collate(train_set, indices, COLUMNS, accelerator.device)
                   for indices in run.micro_batches(stream)]
        global_batch = run.global_batch
        loss_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)
        for index, batch in enumerate(batches):
            with run.gradient_sync(last_micro_batch=index == len(batches) - 1):
                loss = sample_losses(model, batch)[0].sum()
                # DDP and FSDP average gradients over ranks: scale by dp so the result is sum / samples.
                accelerator.backward(loss * dp_size / global_batch)
            loss_sum += loss.detach().double()
        grad_norm, lr = run.optimizer_step(optimizer, scheduler)
        step_loss = run.reduce(loss_sum).item() / global_batch
        local_tokens = sum(batch["attention_mask"].sum() for batch in batches).float()
        tokens = run.reduce(local_tokens).item()
        # metrics, NaN/inf stop (exit 1), evaluation and checkpoint when due, Ctrl-C: save and stop (exit 130)
        run.end_step(loss=step_loss, grad_norm=grad_norm, lr=lr, tokens=tokens, started=started)

    # ---- save: the trained model as a Hugging Face folder (LoRA: a PEFT adapter folder), and the plots ----
    run.export(model_class=AutoModelForSequenceClassification)
    model = optimizer = scheduler = None  # freed before the process group goes (see loop.finish)
    run.finish()


if __name__ == "__main__":
    raise SystemExit(loop.run_recipe(main))
