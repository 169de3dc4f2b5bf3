"""A minimal user script that never calls ``accelerator.end_training()``.

    accelerate launch --config_file CONFIG tests/workers/no_end_training.py

It trains a tiny Llama for 3 steps and returns from the script with the process group still
initialised. Its exit status is the test: ``fsdp_presets.enable_cpu_fsdp()`` must tear the group
down at interpreter exit so that gloo does not abort the process. An ``atexit`` handler that is
registered first (so it runs after the library's) prints whether the group was still alive then.
"""

import atexit

import torch
import torch.distributed as dist


def report_group_at_exit():
    state = "alive" if dist.is_available() and dist.is_initialized() else "destroyed"
    print(f"process group at exit: {state}", flush=True)


atexit.register(report_group_at_exit)  # atexit runs handlers last-in first-out

from accelerate import Accelerator  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

import fsdp_presets  # noqa: E402

fsdp_presets.enable_cpu_fsdp()
accelerator = Accelerator()
config = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                              max_position_embeddings=64)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = accelerator.prepare(model, optimizer)
for step in range(3):
    input_ids = torch.randint(0, 96, (2, 16))
    loss = model(input_ids=input_ids, labels=input_ids).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
print(f"rank {accelerator.process_index} trained, distributed type {accelerator.distributed_type.value}", flush=True)
# no accelerator.end_training(): model, optimizer and the process group are alive at exit
