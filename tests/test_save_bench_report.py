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


def test_a_step_counts_as_in_flight_until_its_saves_line_also_when_the_next_save_commits_it():
    from fsdp_harness.save_bench import split_steps

    def train(step):
        return {"kind": "train", "step": step, "step_time_s": float(step)}

    def save(step):
        return {"kind": "save", "step": step, "async": True}

    # Save 2 committed at the poll after step 3; save 4 only when save 6 began (after step 6's train line).
    lines = [train(1), train(2), train(3), save(2), train(4), train(5), train(6), save(4), train(7), save(6), train(8)]
    assert split_steps(lines) == ([3.0, 5.0, 6.0, 7.0], [2.0, 4.0, 8.0])
