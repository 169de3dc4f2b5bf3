"""Measure what one real optimizer step holds and sends, for the planner's tests.

    accelerate launch --config_file CONFIG tests/workers/plan_measure.py \
        --model-config config.json --result-dir OUT

Builds the model from ``config.json`` (fp32, seeded), prepares it with AdamW through accelerate
(so the wrapping is exactly what users get), runs one forward/backward/optimizer step while a
``CommDebugMode`` that also records tensor sizes watches every collective, and writes
``OUT/rank-N.json``:

- ``held``: bytes of this rank's local shards of parameters, gradients and optimizer state after
  the step (the optimizer's per-parameter ``step`` counters included);
- ``collectives``: every collective of the step: op, payload bytes (the full, unsharded buffer:
  all-gather output, reduce-scatter input, all-reduce tensor) and group size;
- ``params``: each parameter's full shape and this rank's local shape.
"""

import argparse
import gc
import json
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.distributed.tensor.debug import CommDebugMode
from transformers import AutoConfig, AutoModelForCausalLM

import fsdp_presets

C10D = torch.ops.c10d
COLLECTIVES = {
    C10D._allgather_base_: "all_gather",
    C10D._reduce_scatter_base_: "reduce_scatter",
    C10D.allreduce_: "all_reduce",
}


class SizedCommDebugMode(CommDebugMode):
    """torch's comm debug mode (it counts collectives), also recording each one's payload bytes."""

    def __init__(self):
        super().__init__()
        self.records = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = COLLECTIVES.get(func._overloadpacket)
        if kind is not None:
            output, inputs = args[0], args[1]
            if kind == "all_gather":  # (output, input, group, ...): output is the full buffer
                payload, group_size = output, output.numel() // inputs.numel()
            elif kind == "reduce_scatter":  # (output, input, group, ...): input is the full buffer
                payload, group_size = inputs, inputs.numel() // output.numel()
            else:  # allreduce_(tensors, process_group, ...); the group arrives boxed for the dispatcher
                payload, group_size = args[0][0], dist.ProcessGroup.unbox(args[1]).size()
            self.records.append(
                {"op": kind, "payload_bytes": payload.numel() * payload.element_size(), "group_size": group_size}
            )
        return super().__torch_dispatch__(func, types, args, kwargs)


def local_bytes(tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


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

    generator = torch.Generator().manual_seed(accelerator.process_index)
    input_ids = torch.randint(0, config.vocab_size, (args.micro_batch, args.seq_len), generator=generator)
    with SizedCommDebugMode() as comm:
        loss = model(input_ids=input_ids, labels=input_ids).loss
        accelerator.backward(loss)
        optimizer.step()

    held = {"params": 0, "grads": 0, "optimizer": 0}
    shapes = []
    for name, param in model.named_parameters():
        held["params"] += local_bytes(param)
        if param.grad is not None:
            held["grads"] += local_bytes(param.grad)
        local = param.to_local() if hasattr(param, "to_local") else param
        shapes.append({"name": name, "shape": list(param.shape), "local_shape": list(local.shape)})
    for state in optimizer.optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                held["optimizer"] += local_bytes(value)

    result = {
        "rank": accelerator.process_index,
        "world_size": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "model_class": type(model).__name__,
        "held": held,
        "collectives": comm.records,
        "comm_counts": {str(op): count for op, count in comm.get_comm_counts().items()},
        "params": shapes,
    }
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank-{accelerator.process_index}.json").write_text(json.dumps(result, indent=1))

    # Free everything before the process group goes (gloo can abort at exit otherwise).
    del model, optimizer, loss
    gc.collect()
    accelerator.wait_for_everyone()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
