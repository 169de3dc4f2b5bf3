"""A user's own TRL SFT + LoRA script, as TRL users write them, plus the one line that gives it the
project's guarantees (marked below).

    accelerate launch --config_file PRESET.yaml tests/workers/sft_lora_user.py \
        --model MODEL_DIR --data train.jsonl --output-dir OUT [--load-in-4bit] [--resume]

--load-in-4bit: QLoRA, the base loaded in 4 bits by bitsandbytes (nf4, stored as bfloat16 so that
FSDP shards it), as TRL's QLoRA examples load it.
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
parser.add_argument("--load-in-4bit", action="store_true")
parser.add_argument("--resume", action="store_true")
parser.add_argument("--kill-rank-at-step", nargs=2, type=int, metavar=("RANK", "STEP"),
                    help="tests: that rank SIGKILLs itself after that step (the out-of-memory killer, a lost node)")
args = parser.parse_args()

callbacks = [FSDPPresetsCallback()]  # the added line (2/2)
if args.kill_rank_at_step:
    import os
    import signal

    from transformers import TrainerCallback

    class KillAtStep(TrainerCallback):
        def on_step_end(self, arguments, state, control, **kwargs):
            if [int(os.environ.get("RANK", "0")), state.global_step] == args.kill_rank_at_step:
                os.kill(os.getpid(), signal.SIGKILL)

    callbacks.append(KillAtStep())

dataset = load_dataset("json", data_files=args.data, split="train").rename_column("response", "completion")
config = SFTConfig(
    output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=2, gradient_accumulation_steps=2,
    learning_rate=3e-3, warmup_steps=2, logging_steps=2, save_steps=3, max_length=32, report_to=[], seed=0,
    data_seed=0, disable_tqdm=True, use_cpu=True, bf16=False, model_init_kwargs={"dtype": "float32"},
)
model = args.model
if args.load_in_4bit:
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32,
                                      bnb_4bit_quant_storage=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(args.model, quantization_config=quantization, dtype=torch.float32)
trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, callbacks=callbacks,
                     peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
trainer.train(resume_from_checkpoint=True if args.resume else None)
trainer.save_model(args.output_dir)  # as TRL's examples save: into the output folder, beside checkpoint-N
trainer.end()  # as transformers documents: the process group destroyed once, at the very end of the script
