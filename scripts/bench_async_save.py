"""Synchronous vs background (--async-save) checkpoint saves on SmolLM2-135M, 2 CPU processes.

    python scripts/bench_async_save.py [--rounds 2] [--max-steps 12] [--save-every 4]
    python scripts/bench_async_save.py --render runs/bench-async-save/report.json   # the section only

Interleaved launches of recipes/causal_lm.py; the blocked time per save and the step time while a
background write is in flight. The logic: fsdp_harness.save_bench; results: docs/benchmarks.md.
"""

from fsdp_harness.save_bench import main

if __name__ == "__main__":
    raise SystemExit(main())
