"""``scripts/bench_async_save.py --render``: the docs section is rebuilt from a saved report
(tests/data/bench_async_save_report.json, the run recorded in docs/benchmarks.md) with the
planner's save figures beside it, so the benchmark's own code stays runnable between its runs."""

from __future__ import annotations

import json
from pathlib import Path

from fsdp_harness.save_bench import render

REPORT = Path(__file__).resolve().parent / "data" / "bench_async_save_report.json"


def test_the_section_renders_from_a_saved_report_with_the_planners_figures():
    report = json.loads(REPORT.read_text())
    text = render(report)
    assert "| training blocked per save |" in text and "| step time, a background write in flight |" in text
    blocked = sum(report["async"]["blocked_s"]) / len(report["async"]["blocked_s"])
    ratio = blocked / (sum(report["sync"]["blocked_s"]) / len(report["sync"]["blocked_s"]))
    assert f"| {ratio:.2f} |" in text  # the ratio printed is the one the report's numbers give
    assert "llama-3.1-8b, 8 GPUs on 1 node(s)" in text and "llama-3.1-70b, 64 GPUs on 8 node(s)" in text
    assert "--async-save: save every " in text
