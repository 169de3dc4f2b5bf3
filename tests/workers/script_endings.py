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
  0, which then writes the folder while the other ranks could already be at exit);
- ``slow-release``: the script returns right after a collective whose tensor gloo's worker thread
  releases late and slowly (:func:`slow_release`), as after ``wait_for_everyone()`` following a
  save's gather on a loaded host: without the exit handler's wait this aborts on every launch.

The launch's exit status is the test: whatever the ending, a finished training exits 0.
"""

import argparse
import atexit

import torch
import torch.distributed as dist

ENDINGS = ("none", "end-training", "delete", "trainer-end", "trainer-save", "slow-release")


def report_group_at_exit():
    state = "alive" if dist.is_available() and dist.is_initialized() else "destroyed"
    print(f"process group at exit: {state}", flush=True)


atexit.register(report_group_at_exit)  # atexit runs handlers last-in first-out: this one runs last


def slow_release(rank: int, seconds: float = 3.0) -> None:
    """A collective whose tensor gloo's worker thread releases after the script has returned.

    Rank 0 joins the all-reduce 0.5 s late, so on rank 1 it is still running when the barrier
    snapshots the work in flight: the barrier's work keeps the all-reduce's work, and its tensor,
    alive, and gloo's worker thread releases it when it releases the barrier's work, once the
    barrier completes (the script keeps only the barrier's future). On rank 1 that release takes
    ``seconds`` on the worker thread, giving the GIL up every 5 ms, as a thread starved of CPU does
    on a loaded host; the script has returned long before."""
    import threading
    import time
    import weakref

    def released(_):
        where = "the main thread" if threading.current_thread() is threading.main_thread() else "a gloo worker thread"
        print(f"rank {rank}: the collective's tensor released on {where}", flush=True)
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            time.sleep(0.005)

    tensor = torch.ones(1024)
    slow_release.watch = weakref.ref(tensor, released) if rank == 1 else None
    if rank == 0:
        time.sleep(0.5)
    work = dist.all_reduce(tensor, async_op=True)
    barrier = dist.barrier(async_op=True)
    done = barrier.get_future()
    del work, barrier, tensor
    done.wait()

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
    if ending == "slow-release":
        slow_release(accelerator.process_index)
