"""Measure what one real optimizer step holds and sends, for the planner's tests.

    accelerate launch --config_file CONFIG tests/workers/plan_measure.py \
        --model-config config.json --result-dir OUT

Builds the model from ``config.json`` (fp32, seeded), prepares it with AdamW through accelerate
(so the wrapping is exactly what users get), runs one forward/backward/optimizer step while
:class:`fsdp_harness.measure.CollectiveRecorder` (a dispatch mode that records each c10d
collective with its payload; DDP's all-reduces through a communication hook) watches every collective, and writes
``OUT/rank-N.json``:

- ``held``: bytes of this rank's local shards of parameters, gradients and optimizer state after
  the step (the optimizer's per-parameter ``step`` counters included);
- ``collectives``: every collective of the step: op, payload bytes (the full, unsharded buffer:
  all-gather output, reduce-scatter input, all-reduce tensor) and group size;
- ``params``: each parameter's full shape and this rank's local shape.
"""

import argparse
import json
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from transformers import AutoConfig, AutoModelForCausalLM

import fsdp_presets
from fsdp_harness import measure
from fsdp_presets.train import loop

def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-config", required=True, help="a config.json")
    parser.add_argument("--result-dir", required=True)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=2)
    args = parser.parse_args()

    fsdp_presets.enable_cpu_fsdp()
    accelerator = Accelerator()
    fsdp_presets.check_launch(accelerator)

    config = AutoConfig.from_pretrained(args.model_config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    ddp_records: list[dict] = []
    if accelerator.distributed_type == DistributedType.MULTI_CPU:
        measure.record_ddp_allreduce(model, ddp_records)

    generator = torch.Generator().manual_seed(accelerator.process_index)
    input_ids = torch.randint(0, config.vocab_size, (args.micro_batch, args.seq_len), generator=generator)
    with measure.CollectiveRecorder() as comm:
        loss = model(input_ids=input_ids, labels=input_ids).loss
        accelerator.backward(loss)
        optimizer.step()

    held = measure.held_state_bytes(model, optimizer)
    shapes = []
    for name, param in model.named_parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        shapes.append({"name": name, "shape": list(param.shape), "local_shape": list(local.shape)})

    result = {
        "rank": accelerator.process_index,
        "world_size": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "model_class": type(model).__name__,
        "held": held,
        "collectives": ddp_records or comm.records,
        "comm_counts": {str(op): count for op, count in comm.get_comm_counts().items()},
        "params": shapes,
    }
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank-{accelerator.process_index}.json").write_text(json.dumps(result, indent=1))

    del model, optimizer, loss  # freed before the process group goes (see loop.finish)
    loop.finish(accelerator)


if __name__ == "__main__":
    main()
