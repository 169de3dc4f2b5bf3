"""A tiny, deterministic accelerate training script for the multi-process tests.

    accelerate launch --config_file CONFIG tests/workers/tiny_train.py --family llama \
        --steps 20 --result-dir OUT [--save-at 10 --checkpoint DIR] [--resume DIR]

Every rank writes OUT/rank-N.json: distributed type, world size, the per-step global loss, the
local/total element counts of the sharded parameters, and (main rank) a digest of the final
full weights. The global batch is fixed (``--global-batch``) and split across ranks, so every
world size trains on the same samples in the same order.
"""

import argparse
import hashlib
import json
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM

import fsdp_presets
from fsdp_harness.measure import sharded_element_counts
from fsdp_harness.tiny_model import counting_batch
from fsdp_presets.numerics import clip_grad_norm, scalar
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
                        help="fsdp_presets.train.clip_grad_norm or accelerate's clip_grad_norm_")
    parser.add_argument("--seed-per-rank", action="store_true",
                        help="initialise each rank differently (only rank 0 matches the usual init)")
    return parser.parse_args()


def batch_for(step: int, args, rank: int, world_size: int) -> torch.Tensor:
    """This rank's slice of global batch ``step`` (the same rows at every world size)."""
    per_rank = args.global_batch // world_size
    tokens = counting_batch(step, global_batch=args.global_batch, seq_len=args.seq_len, vocab_size=96)
    return tokens[rank * per_rank:(rank + 1) * per_rank]


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
            grad_norms[step] = scalar(accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm))
        elif args.max_grad_norm:
            grad_norms[step] = clip_grad_norm(accelerator, model, args.max_grad_norm)
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

    del model, optimizer, state_dict  # freed before the process group goes (see loop.finish)
    loop.finish(accelerator)


if __name__ == "__main__":
    main()
