"""Train any registry family's tiny debug model a few steps under a generated preset.

    accelerate launch --config_file PRESET.yaml tests/workers/preset_train.py --family mistral \
        --micro-batch-size M --gradient-accumulation-steps A --seq-len 16 --steps 3 --result-dir OUT

The batch flags are the ones the preset's header passes to the recipe. Every rank writes
OUT/rank-N.json: distributed type, world size, FSDP version and mesh, per-step global loss, the
local/total elements of its sharded parameters, and whether a tied embedding is still tied.
"""

import argparse
import json
from pathlib import Path

import torch
from accelerate import Accelerator

import fsdp_presets
from fsdp_harness.measure import sharded_element_counts
from fsdp_harness.tiny_model import counting_batch
from fsdp_presets.model import families
from fsdp_presets.numerics import gradient_sync
from fsdp_presets.train import loop


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", required=True, choices=families.FAMILY_NAMES)
    parser.add_argument("--micro-batch-size", type=int, required=True)
    parser.add_argument("--gradient-accumulation-steps", type=int, required=True)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--result-dir", required=True)
    return parser.parse_args()


def build_model(family: str):
    """The class the tiny config names in ``architectures``, with seeded (identical) weights."""
    import transformers

    config = families.tiny_config(family)
    model_class = getattr(transformers, config.architectures[0])
    torch.manual_seed(0)
    return model_class._from_config(config, dtype=torch.float32)


def micro_batches(step: int, args, rank: int, world_size: int, vocab: int) -> list[torch.Tensor]:
    """This rank's micro-batches of global batch ``step`` (counting sequences: a pattern to learn)."""
    per_rank = args.micro_batch_size * args.gradient_accumulation_steps
    tokens = counting_batch(step, global_batch=per_rank * world_size, seq_len=args.seq_len, vocab_size=vocab)
    return list(tokens[rank * per_rank:(rank + 1) * per_rank].split(args.micro_batch_size))


def main():
    args = parse_args()
    fsdp_presets.enable_cpu_fsdp()
    accelerator = Accelerator()
    fsdp_presets.check_launch(accelerator)
    rank, world_size = accelerator.process_index, accelerator.num_processes

    model = build_model(args.family)
    vocab = model.config.get_text_config().vocab_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = accelerator.prepare(model, optimizer)

    losses = {}
    for step in range(1, args.steps + 1):
        step_loss = torch.zeros(())
        batches = micro_batches(step, args, rank, world_size, vocab)
        for index, input_ids in enumerate(batches):
            # Gradients are reduced on the last micro-batch only, as the recipes do (gradient_sync).
            with gradient_sync(accelerator, model, last_micro_batch=index == len(batches) - 1):
                # NOTE: use_cache=False: with fsdp_activation_checkpointing accelerate re-runs each block in
                # backward, and a KV cache would be appended twice (Gemma 2's masked attention then fails).
                batch = input_ids.to(accelerator.device)
                loss = model(input_ids=batch, labels=batch, use_cache=False).loss
                accelerator.backward(loss / args.gradient_accumulation_steps)
            step_loss += loss.detach().cpu() / args.gradient_accumulation_steps
        optimizer.step()
        optimizer.zero_grad()
        losses[step] = accelerator.reduce(step_loss.to(accelerator.device), reduction="mean").item()

    plugin = accelerator.state.fsdp_plugin
    mesh = getattr(accelerator, "torch_device_mesh", None)
    unwrapped = accelerator.unwrap_model(model)
    inputs, outputs = unwrapped.get_input_embeddings(), unwrapped.get_output_embeddings()
    result = {
        "rank": rank,
        "world_size": world_size,
        "distributed_type": accelerator.distributed_type.value,
        "fsdp_version": getattr(plugin, "fsdp_version", None),
        "mixed_precision": accelerator.mixed_precision,
        "mesh": None if mesh is None else {"names": list(mesh.mesh_dim_names or ()), "shape": list(mesh.mesh.shape)},
        "losses": losses,
        "sharded": sharded_element_counts(model),
        "tied": outputs is not None and inputs.weight is outputs.weight,
        "config_tied": bool(getattr(unwrapped.config.get_text_config(), "tie_word_embeddings", False)),
    }
    Path(args.result_dir).mkdir(parents=True, exist_ok=True)
    Path(args.result_dir, f"rank-{rank}.json").write_text(json.dumps(result))

    del model, optimizer, unwrapped, inputs, outputs  # freed before the process group goes (see loop.finish)
    loop.finish(accelerator)


if __name__ == "__main__":
    main()
