"""The Python half of ``scripts/gpu_bench.sh``: one GPU, ``recipes/causal_lm.py`` on a ~1B Llama.

    python scripts/gpu_bench.py prepare --work-dir DIR [--steps 30 --micro-batch 4 --seq-len 2048]
    accelerate launch --config_file DIR/single_gpu.yaml scripts/gpu_bench.py train --work-dir DIR
    python scripts/gpu_bench.py report --work-dir DIR [--doc docs/benchmarks.md]

``prepare`` checks the arguments and the GPU, plans the run (:func:`fsdp_presets.plan.planner.plan`),
and writes DIR/{settings.json, plan.json, single_gpu.yaml, model/} (random bf16 weights of the
config below, a word tokenizer of the shipped data). ``--dry-run`` does everything except
touching a GPU and writing weights, so that it runs anywhere (the tests run it).
``train`` runs the unchanged recipe in this process (``runpy``) and records
``torch.cuda.max_memory_allocated()``. ``report`` turns DIR/run/metrics.jsonl and the peak into
tokens/s, model FLOPs utilisation (MFU) and peak memory against the planner, and rewrites the
``gpu-bench`` section of docs/benchmarks.md (the figures: :mod:`fsdp_harness.gpu_report`).
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
from pathlib import Path

from fsdp_harness import doc_sections
from fsdp_presets.schema import T
from fsdp_presets.checkpoint.layout import METRICS
from fsdp_harness.gpu_report import SECTION, UsageProblem, peak_tflops_for, summarise, to_markdown

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "causal_lm.py"
TRAIN_DATA = REPO / "data" / "kjv_sft" / "train.jsonl"
EVAL_DATA = REPO / "data" / "kjv_sft" / "eval.jsonl"
DOC = REPO / "docs" / "benchmarks.md"

# TinyLlama-1.1B's shape (TinyLlama/TinyLlama_v1.1 config.json; Zhang et al. 2024,
# arXiv:2401.02385): 1.1B parameters, a Llama-2 architecture with grouped-query attention.
MODEL_1B = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 2048,
    "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
    "vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}

# --------------------------------------------------------------------------- prepare


def check_arguments(args: argparse.Namespace) -> None:
    problems = []
    if args.warmup_steps < 0:
        problems.append(f"--warmup-steps {args.warmup_steps} < 0")
    elif args.steps < args.warmup_steps + 3:
        problems.append(f"--steps {args.steps}: at least --warmup-steps + 3 = {args.warmup_steps + 3} "
                        "(warm-up steps are left out; at least 3 are timed)")
    if args.micro_batch < 1:
        problems.append(f"--micro-batch {args.micro_batch} < 1")
    if not 16 <= args.seq_len <= MODEL_1B["max_position_embeddings"]:
        problems.append(f"--seq-len {args.seq_len} must be 16..{MODEL_1B['max_position_embeddings']}")
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        problems.append(f"--peak-tflops {args.peak_tflops} must be > 0")
    if args.precision not in ("bf16", "fp16", "no"):
        problems.append(f"--precision {args.precision!r}: bf16, fp16 or no")
    if problems:
        raise UsageProblem("; ".join(problems))


def detect_gpu(args: argparse.Namespace) -> dict:
    """Name, memory and peak of GPU 0 (``--gpu-name`` stands in for a dry run without one)."""
    import torch

    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        name, memory = properties.name, properties.total_memory
    elif args.dry_run:
        name, memory = args.gpu_name or "NVIDIA H100 80GB HBM3 (dry run, no GPU here)", 80 * 1024**3
    else:
        raise UsageProblem("no CUDA GPU is visible (torch.cuda.is_available() is False); run on a GPU "
                           "machine, or pass --dry-run to check the arguments and the plan only")
    peak = args.peak_tflops or peak_tflops_for(args.gpu_name or name)
    return {"name": name, "memory_bytes": memory, "peak_bf16_tflops": peak,
            "peak_source": "--peak-tflops" if args.peak_tflops else ("datasheet table" if peak else None)}


def planned(settings: dict, gpu: dict) -> dict:
    """The planner's single-GPU figures for this run (its DDP row with one GPU)."""
    from fsdp_presets.plan.shapes import Hardware, TrainingShape
    from fsdp_presets.plan.planner import plan
    from fsdp_presets.model.model_loading import build_meta_model
    from fsdp_presets.model.profile import profile_module
    from transformers import AutoConfig

    values = {key: value for key, value in settings["model"].items() if key not in ("model_type", "architectures")}
    config = AutoConfig.for_model(settings["model"]["model_type"], **values)
    profile = profile_module(build_meta_model(config))
    precision = {"no": "fp32"}.get(settings["precision"], settings["precision"])
    shape = TrainingShape(seq_len=settings["seq_len"], micro_batch=settings["micro_batch"], precision=precision,
                          optimizer="adamw")
    row = plan(profile, Hardware(gpus=1, gpu_memory_bytes=gpu["memory_bytes"]), shape).get("DDP")
    # One process needs no DDP wrapper, hence none of the gradient buckets the DDP row counts.
    buckets = profile.total_params * 4
    return {"params": profile.total_params, "per_gpu": row.per_gpu.to_json(), "fits": row.fits,
            "max_micro_batch": row.max_micro_batch, "ddp_bucket_bytes": buckets,
            "single_process_total": row.per_gpu.total - buckets}


def recipe_arguments(settings: dict, work_dir: Path) -> list[str]:
    return ["--model", str(work_dir / "model"), "--data", str(TRAIN_DATA), "--eval-data", str(EVAL_DATA),
            "--max-eval-samples", "0", "--output-dir", str(work_dir / "run"), "--seq-len", str(settings["seq_len"]),
            "--micro-batch", str(settings["micro_batch"]), "--max-steps", str(settings["steps"]),
            "--learning-rate", "1e-4", "--warmup-steps", "2", "--resume", "none"]


def accelerate_yaml(settings: dict) -> str:
    import yaml

    return yaml.safe_dump({T.compute_environment: "LOCAL_MACHINE", T.distributed_type: "NO", T.num_processes: 1,
                           T.num_machines: 1, T.machine_rank: 0, T.mixed_precision: settings["precision"],
                           T.gpu_ids: "0", T.use_cpu: False}, sort_keys=False)


def write_model(folder: Path, model_config: dict) -> None:
    """Random weights of ``model_config`` (saved in bf16: half the disk; the recipe loads fp32) and
    a word tokenizer of the shipped data."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    from fsdp_harness.tiny_model import write_tiny_model

    logging.disable_progress_bar()
    write_tiny_model(folder, kind="llama", text=TRAIN_DATA.read_text(), vocab_size=model_config["vocab_size"],
                     max_positions=model_config["max_position_embeddings"])
    values = {key: value for key, value in model_config.items() if key not in ("model_type", "architectures")}
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**values)).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)


def prepare(args: argparse.Namespace) -> int:
    check_arguments(args)
    model_config = json.loads(Path(args.model_config).read_text()) if args.model_config else MODEL_1B
    gpu = detect_gpu(args)
    settings = {"model": model_config, "steps": args.steps, "warmup_steps": args.warmup_steps,
                "micro_batch": args.micro_batch, "seq_len": args.seq_len, "precision": args.precision}
    plan_figures = planned(settings, gpu)
    work_dir = Path(args.work_dir)
    launch = (f"accelerate launch --config_file {work_dir / 'single_gpu.yaml'} scripts/gpu_bench.py train "
              f"--work-dir {work_dir}")
    print(f"gpu_bench: {gpu['name']}, {gpu['memory_bytes'] / 1024**3:.0f} GiB, peak bf16 "
          f"{gpu['peak_bf16_tflops'] or 'unknown (pass --peak-tflops for MFU)'} TFLOP/s", flush=True)
    print(f"gpu_bench: model {plan_figures['params'] / 1e9:.2f}B parameters, sequence {args.seq_len}, "
          f"micro-batch {args.micro_batch}, {args.precision}; planner: "
          f"{plan_figures['single_process_total'] / 1024**3:.1f} GiB per GPU "
          f"({'fits' if plan_figures['single_process_total'] <= gpu['memory_bytes'] else 'does NOT fit'})", flush=True)
    if args.dry_run:
        print(f"gpu_bench: dry run; would write {work_dir}/model and run:\n  {launch}\n  recipes/causal_lm.py "
              + " ".join(recipe_arguments(settings, work_dir)), flush=True)
        return 0
    work_dir.mkdir(parents=True, exist_ok=True)
    (work_dir / "settings.json").write_text(json.dumps({**settings, "gpu": gpu}, indent=1))
    (work_dir / "plan.json").write_text(json.dumps(plan_figures, indent=1))
    (work_dir / "single_gpu.yaml").write_text(accelerate_yaml(settings))
    if not (work_dir / "model" / "config.json").is_file():
        print(f"gpu_bench: writing random weights to {work_dir / 'model'} ...", flush=True)
        write_model(work_dir / "model", model_config)
    return 0


# --------------------------------------------------------------------------- train


def train(args: argparse.Namespace) -> int:
    """Run the recipe unchanged in this process, then record the CUDA memory peak."""
    import torch

    work_dir = Path(args.work_dir)
    settings = json.loads((work_dir / "settings.json").read_text())
    run_dir = work_dir / "run"
    if run_dir.exists():
        raise UsageProblem(f"{run_dir} exists from an earlier run; remove it (or use another --work-dir)")
    torch.cuda.reset_peak_memory_stats()
    sys.argv = [str(RECIPE), *recipe_arguments(settings, work_dir)]
    code = 0
    try:
        runpy.run_path(str(RECIPE), run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code or 0
    (work_dir / "peak.json").write_text(json.dumps({
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "max_memory_reserved": torch.cuda.max_memory_reserved(), "recipe_exit_status": code}, indent=1))
    return int(code)


# --------------------------------------------------------------------------- report


def report(args: argparse.Namespace) -> int:
    from fsdp_presets.train.metrics import read_metrics

    work_dir = Path(args.work_dir)
    settings = json.loads((work_dir / "settings.json").read_text())
    plan_figures = json.loads((work_dir / "plan.json").read_text())
    peak = json.loads((work_dir / "peak.json").read_text())
    if peak["recipe_exit_status"] != 0:
        print(f"gpu_bench: the recipe failed (exit status {peak['recipe_exit_status']})", file=sys.stderr)
        return 1
    figures = summarise(settings, plan_figures, peak, read_metrics(work_dir / "run" / METRICS))
    (work_dir / "gpu_bench.json").write_text(json.dumps({"settings": settings, "plan": plan_figures,
                                                         "figures": figures}, indent=1))
    doc_sections.replace_in_file(args.doc, SECTION, to_markdown(settings, plan_figures, figures))
    for key, value in figures.items():
        print(f"  {key}: {value}")
    print(f"gpu_bench: section written to {args.doc}", flush=True)
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    stages = parser.add_subparsers(dest="stage", required=True)
    first = stages.add_parser("prepare", help="check, plan, write the model and configs")
    first.add_argument("--work-dir", default="runs/gpu_bench")
    first.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    first.add_argument("--warmup-steps", type=int, default=5, help="first steps left out of the medians (default 5)")
    first.add_argument("--micro-batch", type=int, default=4, help="sequences per step (default 4)")
    first.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    first.add_argument("--precision", default="bf16", help=f"accelerate {T.mixed_precision}: bf16 (default), fp16, no")
    first.add_argument("--peak-tflops", type=float, help="peak dense TFLOP/s of the GPU (default: datasheet table)")
    first.add_argument("--gpu-name", help="GPU name for the peak lookup (default: the detected one)")
    first.add_argument("--model-config", help="another model's config.json (default: the ~1B Llama above)")
    first.add_argument("--dry-run", action="store_true", help="check and plan only: no GPU, nothing written")
    second = stages.add_parser("train", help="run the recipe in this process (under accelerate launch)")
    second.add_argument("--work-dir", default="runs/gpu_bench")
    third = stages.add_parser("report", help="figures and the docs/benchmarks.md section")
    third.add_argument("--work-dir", default="runs/gpu_bench")
    third.add_argument("--doc", default=str(DOC))
    return parser.parse_args(argv)


def main(argv=None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = parse_args(argv)
    return {"prepare": prepare, "train": train, "report": report}[args.stage](args)


if __name__ == "__main__":
    raise SystemExit(main())
