"""A tiny, deterministic accelerate training script for the multi-process tests.

    accelerate launch --config_file CONFIG tests/workers/tiny_train.py --family llama \
        --steps 20 --result-dir OUT [--save-at 10 --checkpoint DIR] [--resume DIR]

Every rank writes OUT/rank-N.json: distributed type, world size, the per-step global loss, the
local/total element counts of the sharded parameters, and (main rank) a digest of the final
full weights. The global batch is fixed (``--global-batch``) and split across ranks, so every
world size trains on the same samples in the same order.
"""

import argparse
import gc
import hashlib
import json
import os
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM

import fsdp_presets
from fsdp_presets.train import loop

TINY_CONFIGS = {
    "llama": dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                  max_position_embeddings=64, tie_word_embeddings=False),
    "llama-tied": dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                       max_position_embeddings=64, tie_word_embeddings=True),
    "gpt2": dict(model_type="gpt2", n_embd=32, n_layer=2, n_head=4, vocab_size=96, n_positions=64),
    "qwen2": dict(model_type="qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                  max_position_embeddings=64, tie_word_embeddings=False),
}
BLOCK_CLASSES = {"llama": "LlamaDecoderLayer", "llama-tied": "LlamaDecoderLayer", "gpt2": "GPT2Block",
                 "qwen2": "Qwen2DecoderLayer"}


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default="llama", choices=sorted(TINY_CONFIGS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--result-dir", required=True)
    parser.add_argument("--save-at", type=int, default=0, help="save the state after this step")
    parser.add_argument("--checkpoint", help="where --save-at saves")
    parser.add_argument("--resume", help="load this state, then continue from the step it holds")
    parser.add_argument("--no-enable", action="store_true", help="skip enable_cpu_fsdp() (negative test)")
    parser.add_argument("--guard", action="store_true", help="call check_launch() after Accelerator()")
    parser.add_argument("--max-grad-norm", type=float, default=0.0, help="clip gradients to this norm (0: off)")
    parser.add_argument("--clip-with", choices=("package", "accelerate"), default="package",
                        help="fsdp_presets.train.loop.clip_grad_norm or accelerate's clip_grad_norm_")
    parser.add_argument("--seed-per-rank", action="store_true",
                        help="initialise each rank differently (only rank 0 matches the usual init)")
    return parser.parse_args()


def batch_for(step: int, args, rank: int, world_size: int) -> torch.Tensor:
    """Rows of global batch `step`, this rank's slice. Sequences count up modulo the vocab from a
    per-row start, so the model has a pattern to learn (random tokens barely move the loss)."""
    per_rank = args.global_batch // world_size
    rows = torch.arange(args.global_batch * (step - 1), args.global_batch * step)
    starts = (rows * 7919) % 96
    tokens = (starts[:, None] + torch.arange(args.seq_len)[None, :] * ((rows[:, None] % 3) + 1)) % 96
    return tokens[rank * per_rank:(rank + 1) * per_rank]


def sharded_element_counts(model) -> dict:
    """Elements this rank holds of the sharded parameters, and their unsharded total."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    local = total = 0
    if isinstance(model, FSDP1):  # FSDP1: one flat parameter per unit, sharded into equal pieces
        for unit in FSDP1.fsdp_modules(model):
            if unit._handle is not None:
                flat_param = unit._handle.flat_param
                local += flat_param.numel()
                total += flat_param._unpadded_unsharded_size.numel()
        return {"local": local, "total": total}
    for param in model.parameters():  # FSDP2: every parameter a DTensor sharded on dim 0
        if hasattr(param, "to_local"):
            local += param.to_local().numel()
            total += param.numel()
    return {"local": local, "total": total}


def main():
    args = parse_args()
    if not args.no_enable:
        fsdp_presets.enable_cpu_fsdp()
    accelerator = Accelerator()
    if args.guard:
        fsdp_presets.check_launch(accelerator)
    rank, world_size = accelerator.process_index, accelerator.num_processes
    if args.global_batch % world_size:
        raise SystemExit(f"--global-batch {args.global_batch} is not divisible by {world_size} processes")

    # ---- model: identical initial weights on every rank (seeded), built from a tiny config ----
    from transformers import AutoConfig

    settings = dict(TINY_CONFIGS[args.family])
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    torch.manual_seed(rank if args.seed_per_rank else 0)
    model = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)

    first_step = 1
    if args.resume:
        accelerator.load_state(args.resume)
        first_step = json.loads((Path(args.resume) / "worker_step.json").read_text())["step"] + 1

    # ---- train ----
    losses, grad_norms = {}, {}
    for step in range(first_step, args.steps + 1):
        input_ids = batch_for(step, args, rank, world_size).to(accelerator.device)
        loss = model(input_ids=input_ids, labels=input_ids).loss
        accelerator.backward(loss)
        if args.max_grad_norm and args.clip_with == "accelerate":
            grad_norms[step] = loop.scalar(accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm))
        elif args.max_grad_norm:
            grad_norms[step] = loop.clip_grad_norm(accelerator, model, args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        losses[step] = accelerator.reduce(loss.detach(), reduction="mean").item()
        if step == args.save_at:
            accelerator.save_state(args.checkpoint)
            if accelerator.is_main_process:
                (Path(args.checkpoint) / "worker_step.json").write_text(json.dumps({"step": step}))
            accelerator.wait_for_everyone()

    # ---- report ----
    state_dict = accelerator.get_state_dict(model)
    digest = None
    if accelerator.is_main_process:
        hasher = hashlib.sha256()
        for name in sorted(state_dict):
            hasher.update(name.encode())
            hasher.update(state_dict[name].detach().float().contiguous().numpy().tobytes())
        digest = hasher.hexdigest()
    result = {
        "rank": rank,
        "world_size": world_size,
        "distributed_type": accelerator.distributed_type.value,
        "model_class": type(model).__name__,
        "losses": losses,
        "grad_norms": grad_norms,
        "sharded": sharded_element_counts(model),
        "weights_sha256": digest,
        "tied": getattr(accelerator.unwrap_model(model), "lm_head").weight is
        accelerator.unwrap_model(model).get_input_embeddings().weight,
    }
    Path(args.result_dir).mkdir(parents=True, exist_ok=True)
    Path(args.result_dir, f"rank-{rank}.json").write_text(json.dumps(result))

    # NOTE: gloo can abort a process at exit ("terminate called without an active exception") when
    # the process group is torn down while tensors it references are alive: free them first.
    del model, optimizer, state_dict
    gc.collect()
    accelerator.end_training()


if __name__ == "__main__":
    main()
