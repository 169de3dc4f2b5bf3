"""The figures and report section of the GPU benchmark (``scripts/gpu_bench.sh``,
``scripts/gpu_bench.py``): the bf16 peak table, tokens/s, model FLOPs utilisation (MFU) and peak
memory against the planner.

MFU = 6 x parameters x tokens/s / peak dense bf16 FLOP/s (the 6N FLOPs per token of a
forward and backward pass, Kaplan et al. 2020, arXiv:2001.08361, Sec. 2.1; attention's
sequence-dependent FLOPs are left out, so this slightly understates utilisation at long
sequences).
"""

from __future__ import annotations

import statistics
import sys

from fsdp_harness import doc_sections

SECTION = "gpu-bench"
"""Section of docs/benchmarks.md the GPU benchmark writes (:mod:`fsdp_harness.doc_sections`)."""

# Dense (no sparsity) bf16 tensor-core peaks in TFLOP/s, from NVIDIA's datasheets, which print
# the sparse figure (twice these). Checked in order: the first name contained in
# torch.cuda.get_device_name() wins, so more specific names come first.
PEAK_BF16_TFLOPS = (
    ("H200 NVL", 835.0),   # H200 datasheet: 1,671 TFLOPS with sparsity (NVL)
    ("H200", 989.0),       # H200 datasheet: 1,979 TFLOPS with sparsity (SXM), the H100 SXM's compute
    ("GH200", 989.0),      # GH200 datasheet: 1,979 TFLOPS with sparsity
    ("H100 NVL", 835.0),   # H100 datasheet: 1,671 TFLOPS with sparsity (NVL)
    ("H100 PCIe", 756.0),  # H100 datasheet: 1,513 TFLOPS with sparsity (PCIe)
    ("H100", 989.0),       # H100 datasheet: 1,979 TFLOPS with sparsity (SXM: "H100 80GB HBM3")
    ("A100", 312.0),       # A100 datasheet: 312 TFLOPS (624 with sparsity), SXM and PCIe
    ("L40S", 362.0),       # L40S datasheet: 733 TFLOPS with sparsity
    ("L4", 121.0),         # L4 datasheet: 242 TFLOPS with sparsity
    ("A10", 125.0),        # A10 datasheet: 250 TFLOPS with sparsity
)


class UsageProblem(SystemExit):
    """Bad arguments: one line on stderr, exit status 2."""

    def __init__(self, message: str) -> None:
        print(f"gpu_bench.py: error: {message}", file=sys.stderr, flush=True)
        super().__init__(2)


def peak_tflops_for(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU by its CUDA name, or None when it is not in the table."""
    for name, tflops in PEAK_BF16_TFLOPS:
        if name.lower() in device_name.lower():
            return tflops
    return None


def summarise(settings: dict, plan_figures: dict, peak: dict, metrics: list[dict]) -> dict:
    """tokens/s (median after warm-up), MFU and the peak against the planner."""
    train_lines = [line for line in metrics if line.get("kind") == "train"]
    timed = [line for line in train_lines if line["step"] > settings["warmup_steps"]]
    if not timed:
        raise UsageProblem("no train steps after the warm-up in metrics.jsonl; did the recipe run?")
    tokens_per_s = statistics.median(line["tokens_per_s"] for line in timed)
    peak_flops = (settings["gpu"]["peak_bf16_tflops"] or 0) * 1e12
    model_flops = 6 * plan_figures["params"] * tokens_per_s
    measured, predicted = peak["max_memory_allocated"], plan_figures["single_process_total"]
    return {"tokens_per_s": tokens_per_s, "step_time_s": statistics.median(line["step_time_s"] for line in timed),
            "model_tflops": model_flops / 1e12, "mfu": model_flops / peak_flops if peak_flops else None,
            "peak_allocated_bytes": measured, "peak_reserved_bytes": peak["max_memory_reserved"],
            "planned_bytes": predicted, "planner_error": (predicted - measured) / measured if measured else None,
            "timed_steps": len(timed)}


def to_markdown(settings: dict, plan_figures: dict, figures: dict) -> str:
    gib = 1024**3
    gpu, model = settings["gpu"], settings["model"]
    mfu = "n/a (unknown peak: pass --peak-tflops)" if figures["mfu"] is None else f"{figures['mfu']:.1%}"
    lines = [
        "## GPU: throughput, MFU and peak memory", "",
        "Command: `bash scripts/gpu_bench.sh` (one GPU, `recipes/causal_lm.py` unchanged, run in-process "
        "so that `torch.cuda.max_memory_allocated()` sees the whole run).", "",
        f"- GPU: {gpu['name']}, {gpu['memory_bytes'] / gib:.0f} GiB; peak dense bf16 "
        f"{gpu['peak_bf16_tflops'] or 'unknown'} TFLOP/s ({gpu['peak_source'] or 'not in the table'}).",
        f"- Model: Llama, {plan_figures['params'] / 1e9:.2f}B parameters (TinyLlama-1.1B shape: hidden "
        f"{model['hidden_size']}, {model['num_hidden_layers']} layers, {model['num_attention_heads']} heads, "
        f"{model['num_key_value_heads']} key/value heads, vocabulary {model['vocab_size']}); "
        f"{settings['precision']} mixed precision, fp32 master weights, AdamW; sequence {settings['seq_len']}, "
        f"micro-batch {settings['micro_batch']}; median of {figures['timed_steps']} steps after "
        f"{settings['warmup_steps']} warm-up steps.", "",
        "| figure | value |", "|---|---:|",
        f"| tokens/s | {figures['tokens_per_s']:,.0f} |",
        f"| step time | {figures['step_time_s']:.3f} s |",
        f"| model TFLOP/s (6 x params x tokens/s) | {figures['model_tflops']:.1f} |",
        f"| MFU | {mfu} |",
        f"| peak memory, `torch.cuda.max_memory_allocated()` | {figures['peak_allocated_bytes'] / gib:.2f} GiB |",
        f"| peak reserved by the caching allocator | {figures['peak_reserved_bytes'] / gib:.2f} GiB |",
        f"| planner, one GPU (DDP row without DDP's gradient buckets) | {figures['planned_bytes'] / gib:.2f} GiB |",
        f"| planner error (planned - measured) / measured | "
        f"{'n/a' if figures['planner_error'] is None else format(figures['planner_error'], '+.1%')} |",
    ]
    return doc_sections.wrap(SECTION, "\n".join(lines))
