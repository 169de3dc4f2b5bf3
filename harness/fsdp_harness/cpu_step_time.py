"""``plan --device cpu`` against the recipes' own CPU runs, measured in one run: the host measured
(:mod:`fsdp_presets.preset.host_rates`), then real ``accelerate launch`` runs of the recipes' training
step (``scripts/bench_worker.py``: forward, loss, backward, AdamW, as ``recipes/causal_lm.py`` runs
them) of SmolLM2-135M (its published config, random weights), a 33M and a 10M Llama, under DDP and
FSDP2 FULL_SHARD and SHARD_GRAD_OP on 2 gloo processes. Prints predicted against measured (median of
the timed steps, slowest rank; a case more than 25% off is launched again and the faster of the two
counts) for each; exits 1 when one is more than 25% off.

    python -m fsdp_harness.cpu_step_time [--work-dir DIR]      # about 3 minutes on 2 cores

A wall-time measurement: run it on an otherwise idle host (another program on the same cores changes
the host's measurement and the runs differently). Recorded in docs/benchmarks.md;
tests/test_cpu_step_time.py runs it alone in the suite.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from fsdp_harness import bench

SMALL_MODEL = {**bench._LLAMA, "hidden_size": 320, "intermediate_size": 864, "num_hidden_layers": 4,
               "num_attention_heads": 5, "num_key_value_heads": 5, "vocab_size": 8192, "max_position_embeddings": 256}
"""A 10M-parameter Llama."""
MODELS = {
    "smollm2-135m": (json.loads((bench.REPO / "model_configs" / "smollm2-135m" / "config.json").read_text()), 64),
    "llama-33m": (bench.BENCH_MODEL, 256),
    "llama-10m": (SMALL_MODEL, 256),
}
CASES = ("ddp-x2", "fsdp2-x2", "sgo-x2")
TOLERANCE = 0.25


def within(measured: float, predicted: float) -> bool:
    """Whether ``predicted`` is within :data:`TOLERANCE` of ``measured``."""
    return abs(predicted - measured) / measured <= TOLERANCE


def predicted_step_times(config_path: Path, seq_len: int) -> dict[tuple[str, int | None], float]:
    """``plan --device cpu --gpus 2 --json``'s step time per (strategy, FSDP version)."""
    import contextlib
    import io

    from fsdp_presets.cli import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["plan", str(config_path), "--device", "cpu", "--gpus", "2", "--seq-len", str(seq_len), "--json"])
    if code:
        raise RuntimeError(f"plan --device cpu exited {code}")
    return {(row["name"], row["fsdp_version"]): row["step_time_s"] for row in json.loads(printed.getvalue())["strategies"]}


def run(work: Path) -> list[tuple[str, str, float, float]]:
    """``(model, case label, measured s, predicted s)`` for every model and case."""
    os.environ["FSDP_PRESETS_CACHE"] = str(work / "cache")  # the host measured now, in this run
    rows = []
    for name, (config, seq_len) in MODELS.items():
        folder = work / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config))
        predicted = predicted_step_times(folder / "config.json", seq_len)
        settings = bench.BenchSettings(model=config, seq_len=seq_len, timed_steps=3)
        for case in bench.FULL_CASES:
            if case.name not in CASES:
                continue
            case = bench.Case(**{**case.__dict__, "checkpoints": False})
            expected = predicted[(case.strategy, case.fsdp_version)]
            measured = bench._slowest_rank_median(bench.run_case(case, settings, folder))
            if not within(measured, expected):
                # Other work on the host only adds time: the faster of two launches is the host's own.
                again = bench._slowest_rank_median(bench.run_case(case, settings, folder))
                print(f"{name:14} {case.label:24} measured {measured:.4f} s, launched again: {again:.4f} s")
                measured = min(measured, again)
            rows.append((name, case.label, measured, expected))
            print(f"{name:14} {case.label:24} measured {measured:.4f} s predicted "
                  f"{expected:.4f} s ({expected / measured:.2f}x)", flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", help="where the runs go (default: a temporary folder)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cpu-step-time-") as scratch:
        rows = run(Path(args.work_dir or scratch))
    outside = [row for row in rows if not within(*row[2:])]
    print(f"{len(rows) - len(outside)} of {len(rows)} predicted within {TOLERANCE:.0%} of the measured median")
    return 1 if outside else 0


if __name__ == "__main__":
    sys.exit(main())
