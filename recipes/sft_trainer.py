"""Supervised fine-tuning with TRL's SFTTrainer under a preset, on the data and flags of
recipes/causal_lm.py, with fsdp_presets.FSDPPresetsCallback (run.json, metrics.jsonl, verified
checkpoints, a complete final/ under any state-dict type, the global batch kept on resume).

    accelerate launch --config_file accelerate_configs/cpu_fsdp2_demo.yaml recipes/sft_trainer.py \
        --model runs/models/smollm2-135m-instruct --data data/kjv_sft/train.jsonl \
        --output-dir runs/sft-trl --max-steps 20 --seq-len 64 [--method lora|qlora --lora-r 8]

Data: as causal_lm.py reads it (JSONL/JSON/CSV/Parquet or plain text) with `prompt`/`response` (the
prompt is masked out of the loss: TRL's prompt-completion format), `text`, or `messages` (TRL's
conversational format, as TRL trains it; a template that writes today's date renders the run's first
day). One sample per row, truncated to --seq-len tokens (no packing).
Writes OUTPUT_DIR/{run.json, metrics.jsonl, checkpoint-N/, final/}. Restarting the same command
continues from the last checkpoint (--resume auto). Needs the `trl` extra (scripts/setup.sh installs
it). Not taken by Trainer, and refused here: --reduce-every-micro-batch, --fsdp-reduce-dtype,
--export-merged. With --distributed-config (a TP/EP mesh of `fsdp-presets generate --tp/--ep`) launch
with NAME.trainer.yaml (DDP type, every rank of the mesh; the Trainer's optimizer cannot be prepared
under FSDP); Trainer checkpoints such a model only with save_only_model=True, and the callback then
saves and resumes its whole state (model and optimizer shards as DCP, scheduler, RNG).
"""

import os
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.trainer_utils import get_last_checkpoint

from fsdp_presets import FSDPPresetsCallback
from fsdp_presets.cpu_fsdp import fsdp_launch
from fsdp_presets.errors import UsageError
from fsdp_presets.train import chat_data
from fsdp_presets.train import data as recipe_data
from fsdp_presets.train import loop, model_mesh, model_setup
from fsdp_presets.train import lora as recipe_lora


def parse_args():
    return loop.recipe_argument_parser(__doc__).parse_args()  # the flags of causal_lm.py


def main():
    args = parse_args()
    loop.check_common_args(args)
    unsupported = [flag for flag, value in (("--reduce-every-micro-batch", args.reduce_every_micro_batch),
                                            ("--fsdp-reduce-dtype", args.fsdp_reduce_dtype),
                                            ("--export-merged", args.export_merged)) if value]
    if unsupported:
        raise UsageError(f"{', '.join(unsupported)}: not available with SFTTrainer; use recipes/causal_lm.py")
    lora = recipe_lora.settings(args)  # LoRA/QLoRA: method and shape (None: every weight trains)
    # before the trainer: real FSDP on CPU too; --async-save: checkpoint shards written in the background
    callback = FSDPPresetsCallback(preempt_signals=args.preempt_signals, async_save=args.async_save)
    from trl import SFTConfig, SFTTrainer

    # ---- data: read and checked as causal_lm.py reads it (bad data: one line, exit 2);
    # prompt/response -> TRL's prompt/completion (the prompt is not trained on) ----
    def load(path, flag):
        records = recipe_data.load_records(path, flag)
        recipe_data.causal_lm_columns(records, flag, path)
        return records.rename_column("response", "completion") if "response" in records.column_names else records

    dataset = load(args.data, "--data")
    eval_dataset = None
    if args.eval_data:
        eval_dataset = load(args.eval_data, "--eval-data")
        if args.max_eval_samples:
            eval_dataset = eval_dataset.select(range(min(args.max_eval_samples, len(eval_dataset))))

    # ---- model (LoRA: a peft model; QLoRA: its 4-bit base; --distributed-config: sharded over a TP/EP mesh) ----
    mesh = None
    if args.distributed_config:
        mesh = model_mesh.load_model_mesh(args.distributed_config, rank=int(os.environ.get("RANK", 0)),
                                          world_size=int(os.environ.get("WORLD_SIZE", 1)), lora=lora)
    model = model_setup.load_model(AutoModelForCausalLM, args.model, lora, task_type="CAUSAL_LM", mesh=mesh)

    # ---- train ----
    config = SFTConfig(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.micro_batch,
        per_device_eval_batch_size=args.micro_batch, gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.learning_rate, weight_decay=args.weight_decay, warmup_steps=args.warmup_steps,
        lr_scheduler_type=args.lr_scheduler, max_grad_norm=args.max_grad_norm, max_length=args.seq_len,
        # a TP/EP model: Trainer checkpoints it only with save_only_model=True (the callback saves the rest); under
        # an FSDP launch Trainer refuses that flag at once, and the callback's refusal at train() names the fix
        save_strategy="no" if mesh is not None and fsdp_launch() else "steps",
        save_only_model=mesh is not None and not fsdp_launch(),
        save_steps=args.save_every or args.max_steps, save_total_limit=args.keep_last,
        eval_strategy="steps" if eval_dataset is not None and args.eval_every else "no",
        eval_steps=args.eval_every or None, logging_steps=1, seed=args.seed, data_seed=args.seed, report_to=[],
        bf16=False, disable_tqdm=True)  # precision: the preset's mixed_precision
    # chat data: a template that writes today's date (Llama 3.2/3.3) renders the run's first day on every
    # launch and rank (run.json's started_on), so that a resume on another day trains on the same tokens
    tokenizer = None
    if chat_data.MESSAGES in dataset.column_names:
        tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=False)
        chat_data.check_chat_data(dataset, tokenizer, "--data", args.data)  # no template: one line, exit 2
        if eval_dataset is not None and chat_data.MESSAGES in eval_dataset.column_names:
            chat_data.check_chat_data(eval_dataset, tokenizer, "--eval-data", args.eval_data)
        tokenizer.chat_template = chat_data.rendering_template(tokenizer, callback.first_day(args.output_dir,
                                                                                             args.resume))
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, eval_dataset=eval_dataset,
                         processing_class=tokenizer, callbacks=[callback])
    # auto: the newest committed checkpoint-N (the callback skips one a killed run left unfinished)
    resume = {"auto": True if Path(args.output_dir).is_dir() and get_last_checkpoint(args.output_dir) else None,
              "none": None}.get(args.resume, args.resume)
    trainer.train(resume_from_checkpoint=resume)

    # ---- save: a Hugging Face folder (LoRA: the PEFT adapter) ----
    trainer.save_model(f"{args.output_dir}/final")
    trainer.end()  # as transformers documents: the process group destroyed once, at the end


if __name__ == "__main__":
    raise SystemExit(loop.run_recipe(main))
