"""One benchmark case: a model built from a config, trained a few steps under the accelerate
config it is launched with, measured. ``scripts/bench.py`` launches it once per case::

    accelerate launch --config_file CASE.yaml scripts/bench_worker.py \
        --model-config config.json --result-dir OUT [--checkpoint-dir DIR]

Every rank writes ``OUT/rank-N.json`` with:

- ``held``: bytes of its parameters, gradients and optimizer state after the first optimizer
  step (:func:`fsdp_harness.measure.held_state_bytes`);
- ``collectives``: every collective of the first step with payload and group size (a
  dispatch mode, ``fsdp_harness.measure.CollectiveRecorder``, for FSDP; a communication hook for DDP, whose all-reduces start in C++);
- ``step_times_s``: wall time of each timed step (forward, backward, optimizer, zero_grad), each
  started together on all ranks (barrier); ``cpu_times_s``: the CPU time this process (all its
  threads) used in each, which other programs on a shared host barely change, as they change
  the wall time;
- ``rss_before_bytes``/``rss_peak_bytes``: resident memory before the third step and its peak
  during it (Linux ``VmRSS``/``VmHWM``, the peak reset first), glibc returning freed memory at
  once until then (:func:`fsdp_harness.measure.follow_live_memory`): on a CPU host the
  activations, gathered parameters and gradients of a step all live in this memory (the second
  step settles DDP, which rebuilds its gradient buckets in its second forward);
- ``checkpoints`` (with ``--checkpoint-dir``): save and load time of a committed checkpoint
  (:class:`fsdp_presets.checkpoint.manager.CheckpointManager`, SHA-256 of every file included) as
  sharded (DCP) and as full state dicts, and the files each rank wrote.
"""

import argparse
import gc
import json
import re
import time
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DistributedType
from transformers import AutoConfig, AutoModelForCausalLM

import fsdp_presets
from fsdp_harness import measure
from fsdp_presets.checkpoint.layout import RNG_STATE_PREFIX
from fsdp_presets.checkpoint.manager import CheckpointManager
from fsdp_presets.train import loop
from fsdp_presets.fileio import config_digest
from fsdp_presets.checkpoint.run_folder import distributed_settings

STATE_DICT_TYPES = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")
# Files accelerate writes per rank: DCP shards (__RANK_0.distcp) and RNG states; the rest (full
# state dicts, scheduler, manifest) comes from the main process.
RANK_FILE = re.compile(rf"(?:__(\d+)_\d+\.distcp|{RNG_STATE_PREFIX}(\d+)\.pkl)$")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-config", required=True, help="config.json of the model to build")
    parser.add_argument("--result-dir", required=True, help="where rank-N.json go")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--warmup-steps", type=int, default=1, help="untimed steps before the timed ones")
    parser.add_argument("--timed-steps", type=int, default=3)
    parser.add_argument("--checkpoint-dir", help="also time checkpoint save/load (sharded and full) here")
    return parser.parse_args()


def file_owner(relative: str) -> int:
    """The rank that wrote a checkpoint file."""
    match = RANK_FILE.search(relative)
    if match is None:
        return 0
    return int(match.group(1) or match.group(2))


def main():
    args = parse_args()
    live_memory = measure.follow_live_memory()  # before anything large is allocated
    fsdp_presets.enable_cpu_fsdp()
    accelerator = Accelerator()
    fsdp_presets.check_launch(accelerator)
    rank, world_size = accelerator.process_index, accelerator.num_processes

    # ---- model: the same initial weights on every rank, fp32, AdamW ----
    config = AutoConfig.from_pretrained(args.model_config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    ddp_records: list[dict] = []
    if accelerator.distributed_type == DistributedType.MULTI_CPU:
        measure.record_ddp_allreduce(model, ddp_records)

    generator = torch.Generator().manual_seed(1000 + rank)
    total_steps = 3 + args.warmup_steps + args.timed_steps  # measured, settle, memory, warm-up, timed
    batches = [torch.randint(0, config.vocab_size, (args.micro_batch, args.seq_len), generator=generator)
               for _ in range(total_steps)]
    losses = []

    def train_step(batch):
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        losses.append(loss.item())

    # ---- step 1: what is sent, then what is held ----
    with measure.CollectiveRecorder() as recorder:
        train_step(batches[0])
    held = measure.held_state_bytes(model, optimizer)
    optimizer.zero_grad(set_to_none=True)
    records = list(ddp_records) if ddp_records else recorder.records  # the hook records every later step too

    # ---- memory: a settling step, then the peak of one step ----
    train_step(batches[1])
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    dist.barrier()
    rss_before = measure.current_rss_bytes()
    peak_reset = measure.reset_peak_rss()
    train_step(batches[2])
    optimizer.zero_grad(set_to_none=True)
    rss_peak = measure.peak_rss_bytes()

    # ---- time: the allocator back to caching, warm-up, timed steps ----
    measure.cache_freed_memory()
    for batch in batches[3:3 + args.warmup_steps]:
        train_step(batch)
        optimizer.zero_grad(set_to_none=True)
    step_times, cpu_times = [], []
    for batch in batches[3 + args.warmup_steps:]:
        dist.barrier()
        started, cpu_started = time.perf_counter(), time.process_time()
        train_step(batch)
        optimizer.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - started)
        cpu_times.append(time.process_time() - cpu_started)

    # ---- checkpoints: sharded and full, save (commit) and load ----
    checkpoints = {}
    if args.checkpoint_dir:
        for state_dict_type in STATE_DICT_TYPES:
            plugin = accelerator.state.fsdp_plugin
            # accelerate fills the (optimizer) state-dict configs only when unset: clear them first.
            plugin.state_dict_config = plugin.optim_state_dict_config = None
            plugin.set_state_dict_type(state_dict_type)
            manager = CheckpointManager(accelerator=accelerator, directory=Path(args.checkpoint_dir) / state_dict_type,
                                        keep_last=1, config_digest=config_digest(config),
                                        distributed=distributed_settings(accelerator), log=lambda message: None)
            dist.barrier()
            started = time.perf_counter()
            folder = manager.save(step=total_steps, samples_consumed=0)
            save_s = time.perf_counter() - started
            dist.barrier()
            started = time.perf_counter()
            manager.load(folder)
            load_s = time.perf_counter() - started
            files = {str(path.relative_to(folder)): path.stat().st_size for path in folder.rglob("*") if path.is_file()}
            per_rank = [0] * world_size
            for relative, size in files.items():
                per_rank[file_owner(relative)] += size
            checkpoints[state_dict_type] = {"save_s": save_s, "load_s": load_s, "bytes_per_rank": per_rank,
                                            "files": len(files)}

    result = {
        "rank": rank,
        "world_size": world_size,
        "distributed_type": accelerator.distributed_type.value,
        "model_class": type(model).__name__,
        "fsdp": distributed_settings(accelerator)["fsdp"],
        "held": held,
        "collectives": records,
        "comm_counts": {str(op): count for op, count in recorder.get_comm_counts().items()},
        "losses": losses,
        "step_times_s": step_times,
        "cpu_times_s": cpu_times,
        "rss_before_bytes": rss_before,
        "rss_peak_bytes": rss_peak,
        "rss_peak_reset": peak_reset,
        "rss_follows_live_memory": live_memory,
        "checkpoints": checkpoints,
    }
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank-{rank}.json").write_text(json.dumps(result, indent=1))

    del model, optimizer, batches  # freed before the process group goes (see loop.finish)
    loop.finish(accelerator)


if __name__ == "__main__":
    main()
