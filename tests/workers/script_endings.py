"""A minimal user script that trains a tiny Llama for 3 steps and ends the way ``--ending`` says.

    accelerate launch --config_file CONFIG tests/workers/script_endings.py --ending end-training

Endings (what user scripts do after a finished training):

- ``none``: the script simply returns; model, optimizer and the process group are alive at exit;
- ``end-training``: ``accelerator.end_training()``, as accelerate's documentation ends its examples;
- ``delete``: ``del model, optimizer`` (no garbage collection), then ``accelerator.end_training()``;
- ``trainer-end``: a ``transformers.Trainer`` trains and the script calls ``trainer.end()`` (which
  calls ``end_training()``);
- ``trainer-save``: a ``Trainer`` with :class:`fsdp_presets.FSDPPresetsCallback` trains and the script
  ends with ``trainer.save_model(dir)``, as Trainer scripts do (under FSDP a full-state gather to rank
  0, which then writes the folder while the other ranks could already be at exit).

The launch's exit status is the test: whatever the ending, a finished training exits 0.
"""

import argparse
import atexit

import torch
import torch.distributed as dist

ENDINGS = ("none", "end-training", "delete", "trainer-end", "trainer-save")


def report_group_at_exit():
    state = "alive" if dist.is_available() and dist.is_initialized() else "destroyed"
    print(f"process group at exit: {state}", flush=True)


atexit.register(report_group_at_exit)  # atexit runs handlers last-in first-out: this one runs last

from accelerate import Accelerator  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

import fsdp_presets  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--ending", choices=ENDINGS, required=True)
ending = parser.parse_args().ending

fsdp_presets.enable_cpu_fsdp()
config = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                              max_position_embeddings=64)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config)

if ending in ("trainer-end", "trainer-save"):
    import tempfile

    from transformers import Trainer, TrainingArguments

    samples = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 96, (16, 16))]
    output_dir = tempfile.mkdtemp(prefix="script-endings-")
    trainer = Trainer(model=model, train_dataset=samples,
                      args=TrainingArguments(output_dir=output_dir, max_steps=3, per_device_train_batch_size=2,
                                             save_strategy="no", report_to=[], use_cpu=True,
                                             disable_tqdm=True, logging_strategy="no"),
                      callbacks=[fsdp_presets.FSDPPresetsCallback()] if ending == "trainer-save" else None)
    trainer.train()
    accelerator = trainer.accelerator
    print(f"rank {accelerator.process_index} trained, distributed type {accelerator.distributed_type.value}",
          flush=True)
    if ending == "trainer-end":
        trainer.end()
    else:
        trainer.save_model(f"{output_dir}/final")
else:
    accelerator = Accelerator()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    for step in range(3):
        input_ids = torch.randint(0, 96, (2, 16))
        loss = model(input_ids=input_ids, labels=input_ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    print(f"rank {accelerator.process_index} trained, distributed type {accelerator.distributed_type.value}",
          flush=True)
    if ending == "delete":
        del model, optimizer
    if ending in ("end-training", "delete"):
        accelerator.end_training()
