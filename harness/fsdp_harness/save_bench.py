"""Synchronous vs background (``--async-save``) checkpoint saves of ``recipes/causal_lm.py`` on a
real model, launches interleaved (sync, async, async, sync, ...) so that a shared host's load falls
on both alike.

    python scripts/bench_async_save.py [--model DIR] [--rounds 2] [--max-steps 8] [--save-every 2]

Each launch is the recipe on 2 CPU processes (FSDP2, the demo config), a save every
``--save-every`` steps. From its ``metrics.jsonl``: the ``blocked_s`` and ``bytes`` of every save
but the final one (which waits for its write by design), and the step time of the steps that
trained while a background write was in flight (between a save's step and its ``save`` line)
against the other steps of the same launches (step 1, the warm-up, left out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from fsdp_harness.launch import run_launch
from fsdp_presets.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]  # harness/fsdp_harness/x.py -> the checkout
CAUSAL_LM = REPO / "recipes" / "causal_lm.py"
FSDP2_CONFIG = REPO / "accelerate_configs" / "cpu_fsdp2_demo.yaml"
SFT_TRAIN = REPO / "data" / "kjv_sft" / "train.jsonl"
SFT_EVAL = REPO / "data" / "kjv_sft" / "eval.jsonl"


def launch(model: Path, output: Path, *, background: bool, max_steps: int, save_every: int) -> list[dict]:
    """One launch; its metrics lines."""
    args = ["--model", model, "--data", SFT_TRAIN, "--eval-data", SFT_EVAL, "--max-eval-samples", 2,
            "--output-dir", output, "--seq-len", 64, "--micro-batch", 1, "--max-steps", max_steps,
            "--save-every", save_every, "--keep-last", 1, *(["--async-save"] if background else [])]
    run_launch(FSDP2_CONFIG, CAUSAL_LM, [str(arg) for arg in args], num_processes=2, cwd=REPO, timeout=1800).check()
    return read_metrics(output / "metrics.jsonl")


def split_steps(lines: list[dict]) -> tuple[list[float], list[float]]:
    """Step times of the steps that trained while a background write was in flight, and of the others
    (step 1 left out). The save of step S is written from the end of step S until its ``save`` line,
    which follows the train line of the step it was committed at (a later poll, or the next save)."""
    committed_at = {line["step"]: index for index, line in enumerate(lines) if line["kind"] == "save" and line["async"]}
    in_flight, normal = [], []
    for index, line in enumerate(lines):
        if line["kind"] == "train" and line["step"] > 1:
            busy = any(step < line["step"] and index < committed for step, committed in committed_at.items())
            (in_flight if busy else normal).append(line["step_time_s"])
    return in_flight, normal


def run(model: Path, work_dir: Path, *, rounds: int, max_steps: int, save_every: int, log=print) -> dict:
    results = {"sync": [], "async": []}
    order, load_before = [], os.getloadavg()[0]
    for round_index in range(rounds):
        modes = ("sync", "async") if round_index % 2 == 0 else ("async", "sync")
        for mode in modes:
            started = time.perf_counter()
            lines = launch(model, work_dir / f"{mode}-{round_index}", background=mode == "async",
                           max_steps=max_steps, save_every=save_every)
            results[mode].append(lines)
            order.append(mode)
            log(f"round {round_index} {mode}: {time.perf_counter() - started:.0f} s")
    report = {"model": str(model), "rounds": rounds, "max_steps": max_steps, "save_every": save_every,
              "order": order, "load_before": load_before, "load_after": os.getloadavg()[0]}
    for mode, launches in results.items():
        saves = [line for lines in launches for line in lines if line["kind"] == "save" and line["step"] < max_steps]
        in_flight, normal = [], []
        for lines in launches:
            busy, idle = split_steps(lines)
            in_flight += busy
            normal += idle
        report[mode] = {"blocked_s": [save["blocked_s"] for save in saves],
                        "total_s": [save["total_s"] for save in saves],
                        "bytes": sorted({save["bytes"] for save in saves}),
                        "step_s_in_flight": in_flight, "step_s_normal": normal}
    sync, background = report["sync"], report["async"]
    report["blocked_ratio"] = statistics.mean(background["blocked_s"]) / statistics.mean(sync["blocked_s"])
    everyday = statistics.median(background["step_s_normal"] + sync["step_s_normal"])
    report["in_flight_step_ratio"] = statistics.median(background["step_s_in_flight"]) / everyday
    return report


SECTION = "async-save"
"""Section of docs/benchmarks.md this benchmark writes (``fsdp_harness.doc_sections``)."""


def planner_figures() -> list[str]:
    """The planner's save cost of the 8B and 70B presets (``fsdp-presets plan ... --mtbf 24``)."""
    from fsdp_presets.preset.generate import load_profile
    from fsdp_presets.fileio import GiB
    from fsdp_presets.plan.shapes import Hardware, TrainingShape
    from fsdp_presets.plan.planner import plan
    from fsdp_presets.plan.save_cost import format_save_costs
    from fsdp_presets.preset.request import DEFAULT_HOST_MEMORY_GIB

    lines = []
    for model, gpus, nodes, checkpointing, step_s in (("llama-3.1-8b", 8, 1, False, 10.0),
                                                      ("llama-3.1-70b", 64, 8, True, 20.0)):
        memory_plan = plan(load_profile(str(REPO / "model_configs" / model)),
                           Hardware(gpus=gpus, nodes=nodes, gpu_memory_bytes=80 * GiB),
                           TrainingShape(seq_len=4096, micro_batch=1, activation_checkpointing=checkpointing))
        chosen = memory_plan.recommended
        text = format_save_costs(memory_plan, storage_bytes_per_s=2e9, mtbf_hours=24, step_time_s=step_s,
                                 host_bytes=DEFAULT_HOST_MEMORY_GIB["gpu"] * GiB)
        row = next(line for line in text if chosen is not None and line.startswith(chosen.label + " "))
        lines += [f"- {model}, {gpus} GPUs on {nodes} node(s), {step_s:g} s per step (assumed), 2 GB/s per node:",
                  "  `" + " ".join(row.split()) + "` (strategy, checkpoint, per GPU, blocked sync, blocked async, "
                  "staging per process, staging per node, fits host memory)", *("  " + line.strip() for line in text[-2:])]
    return lines


def load_text(report: dict) -> str:
    if "load_before" in report:
        return f"Load average {report['load_before']:.1f} before and {report['load_after']:.1f} after,"
    return f"Load average {report['load_note']}" if "load_note" in report else "Load average not recorded,"


def render(report: dict) -> str:
    from fsdp_presets.fileio import format_bytes

    sync, background = report["sync"], report["async"]

    def spread(values):
        return f"{statistics.mean(values):.2f} s (median {statistics.median(values):.2f}, {min(values):.2f}-{max(values):.2f})"

    lines = [
        "## Background checkpoint saves (`--async-save`) on a real model",
        "",
        "<!-- Generated by `python scripts/bench_async_save.py`: regenerate, do not edit. -->",
        "",
        f"`recipes/causal_lm.py` on SmolLM2-135M (fp32, AdamW), 2 CPU processes, FSDP2 (the demo config), "
        f"2 x 64 tokens per step, a save every {report['save_every']} steps, {report['max_steps']} steps per launch; "
        f"{report['rounds']} rounds of one synchronous and one `--async-save` launch, interleaved "
        f"({', '.join(report['order'])}). Saves counted: all but the last one of each launch (the final save waits "
        "for its write by design). Step times: the steps that trained while a background write was in flight "
        "(between a save's step and its `save` line) against all other steps of both kinds of launch but step 1.",
        "",
        f"- {load_text(report)} on 2 cores: " + (
            "**other work ran on the host just before or during this run** (a 1-minute load average of 1 or "
            "more at its start), so absolute times may be inflated and noisy."
            if report.get("load_before", 2.0) >= 1.0 else
            "nothing else ran; the benchmark's own processes are the load after."),
        f"- Checkpoint size: {', '.join(format_bytes(size) for size in sync['bytes'] + background['bytes'])} "
        "(sync, async: the same files; DCP's metadata differs by a few bytes).",
        "",
        "```",
        "python scripts/bench_async_save.py",
        "```",
        "",
        "| | synchronous | `--async-save` | ratio |",
        "|---|---:|---:|---:|",
        f"| training blocked per save | {spread(sync['blocked_s'])} | {spread(background['blocked_s'])} | "
        f"{report['blocked_ratio']:.2f} |",
        f"| save until committed | {spread(sync['total_s'])} | {spread(background['total_s'])} | |",
        f"| step time, no save in flight | {statistics.median(sync['step_s_normal']):.2f} s | "
        f"{statistics.median(background['step_s_normal']):.2f} s | |",
        f"| step time, a background write in flight | | {statistics.median(background['step_s_in_flight']):.2f} s "
        f"({len(background['step_s_in_flight'])} steps) | {report['in_flight_step_ratio']:.2f} |",
        "",
        "Ratios: mean blocked time async / sync; median step time with a write in flight / median of the other "
        "steps (both kinds of launch). What stays: training does not wait for the write; what costs: on this "
        "host training and the background write (one thread per process at the lowest scheduling priority: "
        "DCP serialising the rank's shards and writing them past the page cache, hashed for the manifest on "
        "their way to the disk) share the same 2 cores. The write takes the time training leaves idle first, so the steps that overlap it slow "
        "down less, and a save due before the previous write finished waits for it (counted as blocked); the "
        "blocked time is mostly the staging copy and the commit. On a GPU host the step runs on the "
        "GPU while the host writes. The planner's figures for the presets "
        "(`fsdp-presets plan MODEL --gpus N --mtbf 24 --seconds-per-step S`, recommended strategy):",
        "",
        *planner_figures(),
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="a causal-LM folder (default: SmolLM2-135M, prepared)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--work-dir", type=Path, default=REPO / "runs" / "bench-async-save")
    parser.add_argument("--output", type=Path, default=REPO / "docs" / "benchmarks.md", help="the report's file")
    parser.add_argument("--render", type=Path, metavar="REPORT.json", help="rewrite the section from a saved report")
    args = parser.parse_args(argv)
    from fsdp_harness import doc_sections

    if args.render:
        report = json.loads(args.render.read_text())
    else:
        model = args.model
        if model is None:
            from fsdp_presets.checkpoint.pretrained import default_cache, prepare_smollm2

            model = prepare_smollm2(default_cache(REPO))
        import shutil

        shutil.rmtree(args.work_dir, ignore_errors=True)
        report = run(model, args.work_dir, rounds=args.rounds, max_steps=args.max_steps, save_every=args.save_every)
        (args.work_dir / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    doc_sections.replace_in_file(args.output, SECTION, doc_sections.wrap(SECTION, render(report)))
    print(render(report))
    return 0
