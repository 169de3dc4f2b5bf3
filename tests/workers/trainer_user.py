"""A user's own Trainer script (full fine-tuning), as Trainer users write them, plus the one line
that gives it the project's guarantees (marked below).

    accelerate launch --config_file PRESET.yaml tests/workers/trainer_user.py \
        --model MODEL_DIR --data train.jsonl --output-dir OUT [--max-steps 6] [--resume]
"""

import argparse

from datasets import load_dataset
from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer,
                          TrainingArguments)

from fsdp_presets import FSDPPresetsCallback  # the added line (1/2)

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--data", required=True)
parser.add_argument("--output-dir", required=True)
parser.add_argument("--max-steps", type=int, default=6)
parser.add_argument("--save-steps", type=int, default=3)
parser.add_argument("--save-total-limit", type=int, default=None)
parser.add_argument("--learning-rate", type=float, default=3e-3)
parser.add_argument("--batch-size", type=int, default=2)
parser.add_argument("--gradient-accumulation-steps", type=int, default=2)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--no-callback", action="store_true")
parser.add_argument("--async-save", action="store_true", help="checkpoint shards written in the background")
parser.add_argument("--distributed-config", help="a TP/EP mesh's NAME.distributed.json: the model sharded at load "
                    "time (launch with NAME.trainer.yaml)")
parser.add_argument("--best-is-first", action="store_true",
                    help="tests: evaluate at every save and load the best checkpoint at the end, the best being the "
                         "highest evaluation loss (the first checkpoint, never the last weights)")
parser.add_argument("--signal-rank-at-step", nargs=2, type=int, metavar=("RANK", "STEP"),
                    help="tests: that rank sends itself SIGUSR1 after that step (a scheduler's signal)")
args = parser.parse_args()

callbacks = [] if args.no_callback else [FSDPPresetsCallback(async_save=args.async_save)]  # the added line (2/2)
if args.signal_rank_at_step:
    import os
    import signal

    from transformers import TrainerCallback

    class SignalAtStep(TrainerCallback):
        def on_step_end(self, arguments, state, control, **kwargs):
            if [int(os.environ.get("RANK", "0")), state.global_step] == args.signal_rank_at_step:
                os.kill(os.getpid(), signal.SIGUSR1)

    callbacks.append(SignalAtStep())

tokenizer = AutoTokenizer.from_pretrained(args.model)
if tokenizer.pad_token is None:
    tokenizer.pad_token = tokenizer.eos_token
dataset = load_dataset("json", data_files=args.data, split="train")
dataset = dataset.map(lambda row: tokenizer(row["prompt"] + row["response"], truncation=True, max_length=32),
                      remove_columns=dataset.column_names)

mesh = {}
if args.distributed_config:
    import json

    from transformers.distributed.configuration_utils import DistributedConfig

    with open(args.distributed_config) as stream:
        mesh = {"distributed_config": DistributedConfig.from_dict(json.load(stream))}
model = AutoModelForCausalLM.from_pretrained(args.model, **mesh)
best = ({"eval_strategy": "steps", "eval_steps": args.save_steps, "load_best_model_at_end": True,
         "metric_for_best_model": "eval_loss", "greater_is_better": True} if args.best_is_first else {})
training_args = TrainingArguments(
    output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
    gradient_accumulation_steps=args.gradient_accumulation_steps, learning_rate=args.learning_rate,
    warmup_steps=2, weight_decay=0.1, logging_steps=2, save_steps=args.save_steps, save_strategy="steps",
    save_total_limit=args.save_total_limit,
    report_to=[], seed=0, data_seed=0, disable_tqdm=True, use_cpu=True,
    save_only_model=bool(mesh),  # what Trainer asks of a model sharded at load time
    **best,
)
trainer = Trainer(model=model, args=training_args, train_dataset=dataset, processing_class=tokenizer,
                  eval_dataset=dataset.select(range(8)) if args.best_is_first else None,
                  data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False), callbacks=callbacks)
trainer.train(resume_from_checkpoint=True if args.resume else None)
trainer.save_model(f"{args.output_dir}/final")
trainer.end()  # as transformers documents: the process group destroyed once, at the very end of the script
