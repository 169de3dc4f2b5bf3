"""Benchmark FSDP against DDP on this host and against the planner, all ratios from one run.

    python scripts/bench.py                 # regenerates docs/benchmarks.md(+.json), docs/img/*.png
    python scripts/bench.py --quick         # a smoke test: tiny model, two launches, no campaign
    python scripts/bench.py --render docs/benchmarks.json   # rewrite the report only, no launches
    python scripts/bench.py --side-by-side [--model DIR]    # DDP, accelerate's FSDP2 defaults and the
        # presets on a real model (default: the demo's SmolLM2-135M), step time; fsdp_harness.step_bench

About 15 minutes on 2 shared cores (each of the 8 cases is one launch; the campaign 21 more).

Every case is one ``accelerate launch`` of ``scripts/bench_worker.py`` under an accelerate config
written the way users write them (real FSDP/DDP over gloo on CPU: ``enable_cpu_fsdp``). The model
is a Llama built from a config (:data:`BENCH_MODEL`, 33.7M parameters, fp32, AdamW): large
enough that compute, not gloo latency, dominates a step. Cases: DDP, FSDP2 FULL_SHARD (with and
without activation checkpointing), FSDP1 FULL_SHARD and FSDP2 SHARD_GRAD_OP on 2 processes; DDP,
FSDP2 FULL_SHARD and HSDP 2x2 on 4. Measured per case (see the worker): per-rank parameters,
gradients and optimizer state after a step, every collective of a step, step time (wall and CPU),
the memory a step adds, and for FSDP2 on 2 processes checkpoint save/load, sharded vs full state
dict. Then
a kill-and-resume drill of ``recipes/causal_lm.py`` on the same model (resume cost) and the
fault campaign (``scripts/fault_campaign.py``).

The benchmark itself is :mod:`fsdp_harness.bench` (cases, launches, analysis) and
:mod:`fsdp_harness.bench_report` (the report and its charts).

Exit status 1 (after writing the report, with the failure at its top) when a rank's measured
parameters, gradients or optimizer state differ from the planner's prediction by more than 1%,
when a fault trial lost a committed checkpoint (or failed to resume, or diverged), or when the
resume drill failed. Absolute times move with the load of a shared host; CPU time per step and
ratios within one run much less.
"""

import sys

from fsdp_harness import bench


def main(argv: list[str] | None = None) -> int:
    """The benchmark (:mod:`fsdp_harness.bench`), or with ``--side-by-side`` the step benchmark
    (:mod:`fsdp_harness.step_bench`) with the other arguments."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--side-by-side" in argv:
        from fsdp_harness import step_bench

        return step_bench.main([arg for arg in argv if arg != "--side-by-side"])
    return bench.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
