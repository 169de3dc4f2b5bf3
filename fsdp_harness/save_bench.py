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
import statistics
import time
from pathlib import Path

from fsdp_harness.launch import run_launch
from fsdp_presets.train.metrics import read_metrics

REPO = Path(__file__).resolve().parent.parent
CAUSAL_LM = REPO / "recipes" / "causal_lm.py"
FSDP2_CONFIG = REPO / "accelerate_configs" / "cpu_fsdp2_demo.yaml"
SFT_TRAIN = REPO / "data" / "kjv_sft" / "train.jsonl"
SFT_EVAL = REPO / "data" / "kjv_sft" / "eval.jsonl"


def launch(model: Path, output: Path, *, background: bool, max_steps: int, save_every: int) -> list[dict]:
    """One launch; its metrics lines."""
    args = ["--model", model, "--data", SFT_TRAIN, "--eval-data", SFT_EVAL, "--max-eval-samples", 2,
            "--output-dir", output, "--seq-len", 64, "--micro-batch-size", 1, "--max-steps", max_steps,
            "--save-every", save_every, "--keep-last", 1, *(["--async-save"] if background else [])]
    run_launch(FSDP2_CONFIG, CAUSAL_LM, [str(arg) for arg in args], num_processes=2, cwd=REPO, timeout=1800).check()
    return read_metrics(output / "metrics.jsonl")


def split_steps(lines: list[dict]) -> tuple[list[float], list[float]]:
    """Step times of the steps that trained while a background write was in flight, and of the others
    (step 1 left out)."""
    in_flight, normal, pending = [], [], False
    for line in lines:
        if line["kind"] == "save":
            pending = False
        elif line["kind"] == "train":
            if line["step"] > 1:
                (in_flight if pending else normal).append(line["step_time_s"])
        if line["kind"] == "train" and any(other["kind"] == "save" and other["step"] == line["step"]
                                           and other["async"] for other in lines):
            pending = True  # the next steps train while this step's save is written
    return in_flight, normal


def run(model: Path, work_dir: Path, *, rounds: int, max_steps: int, save_every: int, log=print) -> dict:
    results = {"sync": [], "async": []}
    order = []
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
              "order": order}
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="a causal-LM folder (default: SmolLM2-135M, prepared)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--work-dir", type=Path, default=REPO / "runs" / "bench-async-save")
    parser.add_argument("--output", type=Path, default=None, help="write the report as JSON here")
    args = parser.parse_args(argv)
    model = args.model
    if model is None:
        from fsdp_harness.pretrained import default_cache, prepare_smollm2

        model = prepare_smollm2(default_cache())
    import shutil

    shutil.rmtree(args.work_dir, ignore_errors=True)
    report = run(model, args.work_dir, rounds=args.rounds, max_steps=args.max_steps, save_every=args.save_every)
    text = json.dumps(report, indent=2)
    if args.output:
        args.output.write_text(text + "\n")
    print(text)
    return 0
