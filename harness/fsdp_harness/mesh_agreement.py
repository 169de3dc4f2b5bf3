"""The planner's per-GPU total on FSDP x TP and FSDP x EP meshes against a rehearsed step of the
whole model on that mesh, at full size: ``fsdp-presets rehearse MODEL --gpus N --tp|--ep S --json``
for shipped configs at 8 and 64 GPUs (each composes the planner's row from a short rehearsal on the
mesh, then rehearses all the blocks). Prints rehearsed, planned and their ratio; exits 1 when one
is more than 10% off. Recorded in docs/parallelism.md.

    python -m fsdp_harness.mesh_agreement [--seq-len 1024]     # about 4 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from fsdp_harness import bench

CASES = (  # (model, GPUs, flag, size)
    ("llama-3.1-8b", 8, "--tp", 2), ("llama-3.1-8b", 64, "--tp", 8),
    ("qwen2.5-7b", 8, "--tp", 4), ("qwen2.5-7b", 64, "--tp", 4),
    ("mixtral-8x7b", 8, "--ep", 8), ("mixtral-8x7b", 64, "--ep", 4),
    ("llama-3.1-70b", 64, "--tp", 8),
)
TOLERANCE = 0.10


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=1024)
    args = parser.parse_args(argv)
    failures = 0
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "FSDP_PRESETS_CACHE": cache, "FSDP_PRESETS_PLAN_REHEARSAL": "on",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        print(f"{'model':16} {'GPUs':>4}  {'mesh':18} {'rehearsed GiB':>13} {'planned GiB':>11} {'planned/rehearsed':>17} {'s':>4}")
        for model, gpus, flag, size in CASES:
            started = time.perf_counter()
            command = [sys.executable, "-m", "fsdp_presets.cli", "rehearse", str(bench.REPO / "model_configs" / model),
                       "--gpus", str(gpus), "--nodes", str(max(1, gpus // 8)), "--strategy", "full", flag, str(size),
                       "--seq-len", str(args.seq_len), "--json"]
            done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
            if done.returncode not in (0, 1):
                print(f"{model} {gpus} {flag} {size}: rehearse failed: {done.stderr.strip().splitlines()[-1:]}")
                failures += 1
                continue
            document = json.loads(done.stdout)
            rehearsed = document["rehearsal"]["per_gpu_peak_bytes"] / 2**30
            planned = document["planner"]["total"] / 2**30
            ratio = planned / rehearsed
            failures += abs(ratio - 1) > TOLERANCE
            print(f"{model:16} {gpus:>4}  {document['strategy']:18} {rehearsed:>13.2f} {planned:>11.2f} {ratio:>17.3f} "
                  f"{time.perf_counter() - started:>4.0f}")
    print(f"seq {args.seq_len}, micro-batch 1, bf16, activation checkpointing off; within {TOLERANCE:.0%}: "
          f"{len(CASES) - failures}/{len(CASES)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
