"""Fine-tune a causal language model (supervised fine-tuning or continued pre-training) with FSDP.

    accelerate launch --config_file accelerate_configs/cpu_fsdp2_demo.yaml recipes/causal_lm.py \
        --model runs/models/smollm2-135m-instruct --data data/kjv_sft/train.jsonl \
        --eval-data data/kjv_sft/eval.jsonl --output-dir runs/sft --max-steps 20 --seq-len 64

Data: JSONL with `prompt`/`response` (the prompt is masked out of the loss) or `text`, or plain
text. Samples are packed into blocks of --seq-len tokens (--no-packing: one padded sample each).
Writes OUTPUT_DIR/{run.json, metrics.jsonl, checkpoints/step-NNNNNNNN/, final/, plots/}.
Restarting the same command continues from the last valid checkpoint (--resume auto), also on
another number of processes (the gradient accumulation changes to keep the global batch);
--resume PATH also takes a checkpoint written by `fsdp-presets import` (weights only, step 0).
Launch, checks, run folder, resume, metrics, saves and export are fsdp_presets.train.recipe's.
Adapt by copying: the sections below are data, model, resume, train, save.
"""

import math
import time

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
from fsdp_presets.numerics import param_groups

from fsdp_presets.train import data as recipe_data
from fsdp_presets.train import loop, recipe
from fsdp_presets.train import lora as recipe_lora  # LoRA/QLoRA
from fsdp_presets.train import model_setup


def parse_args():
    parser = loop.recipe_argument_parser(__doc__)  # the flags every recipe shares (LoRA/QLoRA included)
    parser.add_argument("--no-packing", action="store_true", help="one padded sample per row instead of packing")
    return parser.parse_args()


def summed_loss(model, batch):
    """Sum of the token losses of a batch, the number of tokens it counts (labels != -100), how many
    of them the model predicts, and a mixture of experts' router load-balancing loss (else None).
    The caller divides by the count over all ranks and micro-batches, so each token weighs the same
    whatever the split of the global batch (DDP = FSDP = another GPU count)."""
    # use_cache=False: with activation checkpointing the recomputed forward would find a KV
    # cache already filled by the first one (wrong shapes, or silently wasted memory).
    outputs = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), use_cache=False)
    logits = outputs.logits
    shifted_logits = logits[:, :-1, :].float()
    shifted_labels = batch["labels"][:, 1:]
    loss = F.cross_entropy(shifted_logits.reshape(-1, shifted_logits.size(-1)), shifted_labels.reshape(-1),
                           ignore_index=recipe_data.IGNORE_INDEX, reduction="sum")
    counted = shifted_labels != recipe_data.IGNORE_INDEX
    correct = ((shifted_logits.argmax(-1) == shifted_labels) & counted).sum()
    # A mixture of experts whose config sets output_router_logits: its load-balancing loss (None otherwise).
    return loss, counted.sum(), correct, getattr(outputs, "aux_loss", None)


def main():
    args = parse_args()
    # ---- launch and checks: real FSDP/DDP on a CPU-only host too; flags, ranks, run folder, lock ----
    run = recipe.start(args, recipe="causal_lm")  # nothing is written before every check has passed
    accelerator, tokenizer = run.accelerator, run.tokenizer
    rank, dp_size = run.data_rank, run.data_parallel_size  # this rank's share of the data (TP ranks share one)

    # ---- data ----
    with accelerator.main_process_first():
        train_set, eval_set = recipe_data.causal_lm_splits(
            data=args.data, eval_data=args.eval_data, eval_fraction=args.eval_fraction, tokenizer=tokenizer,
            seq_len=args.seq_len, packing=not args.no_packing, seed=args.seed,
            max_eval_samples=args.max_eval_samples, started_on=run.record.started_on)  # chat: the first day's date
    columns = ("input_ids", "labels") + (("attention_mask",) if args.no_packing else ())
    stream = loop.SampleStream(len(train_set), seed=args.seed)

    # ---- model ----
    model = model_setup.load_model(AutoModelForCausalLM, args.model, run.lora, task_type="CAUSAL_LM",  # LoRA: peft
                                   mixed_precision=accelerator.mixed_precision, mesh=run.mesh)  # TP/EP mesh
    key_map = recipe_lora.adapter_key_map(model) if run.lora else None  # LoRA/QLoRA
    balance_weight = model_setup.router_balance_weight(model)  # MoE with output_router_logits, else None

    def build_optimizer(model):
        optimizer = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.learning_rate,
                                      betas=(0.9, 0.95))
        return optimizer, loop.lr_scheduler(args.lr_scheduler, optimizer, num_warmup_steps=args.warmup_steps,
                                              num_training_steps=args.max_steps)

    # The optimizer before or after the model is wrapped, as the FSDP version needs (LoRA on FSDP1: after).
    model, optimizer, scheduler = model_setup.prepare(accelerator, model, build_optimizer, lora=run.lora)

    # ---- resume: a checkpoint (any process count: the global batch is kept), imported weights, or step 0 ----
    run.resume(model, optimizer, key_map=key_map)

    def evaluate():
        model.eval()
        totals = torch.zeros(3, dtype=torch.float64, device=accelerator.device)  # loss sum, tokens, correct tokens
        with torch.no_grad():
            for slots in loop.eval_micro_batches(len(eval_set), micro_batch_size=args.micro_batch,
                                                 rank=rank, data_parallel_size=dp_size):
                batch = loop.collate(eval_set, [index for index, _ in slots], columns, accelerator.device)
                batch["labels"][torch.tensor([not counts for _, counts in slots], device=accelerator.device)] = \
                    recipe_data.IGNORE_INDEX
                loss, count, correct, _ = summed_loss(model, batch)
                totals += torch.stack([loss.double(), count.double(), correct.double()])
        model.train()
        loss_sum, count, correct = run.reduce(totals).tolist()  # over the ranks, each sample once
        eval_loss = loss_sum / max(count, 1)
        return {"eval_loss": eval_loss, "perplexity": math.exp(min(eval_loss, 50.0)),
                "token_accuracy": correct / max(count, 1)}

    # ---- train ----
    run.begin_training(evaluate, shown="perplexity")  # evaluates at step 0; Ctrl-C now saves, then stops
    while run.step < args.max_steps:
        started = time.perf_counter()
        batches = [loop.collate(train_set, indices, columns, accelerator.device)
                   for indices in run.micro_batches(stream)]
        local_targets = sum(int((batch["labels"][:, 1:] != recipe_data.IGNORE_INDEX).sum()) for batch in batches)
        global_targets = run.reduce(torch.tensor(float(local_targets), device=accelerator.device)).item()
        loss_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)
        balance_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)  # MoE router loss
        for index, batch in enumerate(batches):
            with run.gradient_sync(last_micro_batch=index == len(batches) - 1):
                loss, _, _, balance = summed_loss(model, batch)
                # DDP and FSDP average gradients over ranks: scale by dp so the result is sum / tokens.
                objective = loss * dp_size / max(global_targets, 1.0)
                balanced = balance is not None and balance_weight is not None  # MoE with output_router_logits
                if balanced:  # weighted as transformers does, averaged over micro-batches
                    objective = objective + balance_weight * balance / len(batches)
                    balance_sum += balance.detach().double()
                accelerator.backward(objective)
            loss_sum += loss.detach().double()
        grad_norm, lr = run.optimizer_step(optimizer, scheduler)
        step_loss = run.reduce(loss_sum).item()
        router = {} if not balanced else {  # the load-balancing loss, a mean over every micro-batch
            "router_aux_loss": run.reduce(balance_sum).item() / (dp_size * len(batches))}
        # metrics, NaN/inf stop (exit 1), evaluation and checkpoint when due, Ctrl-C: save and stop (exit 130)
        run.end_step(loss=step_loss / max(global_targets, 1.0), grad_norm=grad_norm, lr=lr,
                     tokens=run.global_batch * args.seq_len, started=started, extra=router)

    # ---- save: the trained model as a Hugging Face folder (LoRA: a PEFT adapter folder), and the plots ----
    run.export(model_class=AutoModelForCausalLM)
    model = optimizer = scheduler = None  # freed before the process group goes (see loop.finish)
    run.finish()


if __name__ == "__main__":
    raise SystemExit(loop.run_recipe(main))
