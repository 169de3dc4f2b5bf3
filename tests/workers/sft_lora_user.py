"""A user's own TRL SFT + LoRA script, as TRL users write them, plus the one line that gives it the
project's guarantees (marked below).

    accelerate launch --config_file PRESET.yaml tests/workers/sft_lora_user.py \
        --model MODEL_DIR --data train.jsonl --output-dir OUT
"""

import argparse

from datasets import load_dataset
from peft import LoraConfig
from trl import SFTConfig, SFTTrainer

from fsdp_presets import FSDPPresetsCallback  # the added line (1/2)

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--data", required=True)
parser.add_argument("--output-dir", required=True)
parser.add_argument("--max-steps", type=int, default=6)
args = parser.parse_args()

callbacks = [FSDPPresetsCallback()]  # the added line (2/2)

dataset = load_dataset("json", data_files=args.data, split="train").rename_column("response", "completion")
config = SFTConfig(
    output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=2, gradient_accumulation_steps=2,
    learning_rate=3e-3, warmup_steps=2, logging_steps=2, save_steps=3, max_length=32, report_to=[], seed=0,
    data_seed=0, disable_tqdm=True, use_cpu=True, bf16=False, model_init_kwargs={"dtype": "float32"},
)
trainer = SFTTrainer(model=args.model, args=config, train_dataset=dataset, callbacks=callbacks,
                     peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
trainer.train()
trainer.save_model(f"{args.output_dir}/final")
