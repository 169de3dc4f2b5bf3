"""A run's measured throughput against what its preset predicted, in one line: what ``compare``
prints for each run and a recipe prints when it ends, so that a cluster slower than the plan shows
at once.

The measured figure is the median over the run's steps after its first (warm-up, the allocator's
growth) of ``tokens_per_s`` (all ranks' tokens per second, ``metrics.jsonl``) over the run's
processes; the predicted one is the ``predicted`` entry of the metadata line ``generate`` writes in
the accelerate config the run was launched with (None: no such config, or a CPU preset). Standard
library only.
"""

from __future__ import annotations

import statistics
from typing import Any


def measured_per_process(tokens_per_s: dict[int, float], processes: Any) -> float | None:
    """Median tokens/s per process over the steps after the first (``tokens_per_s``: by step);
    None without enough steps or without a process count."""
    steps = sorted(tokens_per_s)[1:]
    if not steps or not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
        return None
    return statistics.median(tokens_per_s[step] for step in steps) / processes


def throughput_text(role: str, tokens_per_s: dict[int, float], processes: Any,
                    predicted: dict[str, Any] | None) -> str | None:
    """``ROLE 1,234 tokens/s per process measured (median after step 1); its preset predicts 2,345 on
    H100-SXM (0.53x)``, or None when the run records no throughput."""
    measured = measured_per_process(tokens_per_s, processes)
    if measured is None:
        return None
    line = f"{role} {measured:,.0f} tokens/s per process measured (median after step 1)"
    expected = predicted.get("tokens_per_s_per_gpu") if isinstance(predicted, dict) else None
    if isinstance(expected, (int, float)) and not isinstance(expected, bool) and expected > 0:
        line += f"; its preset predicts {expected:,.0f} on {predicted.get('gpu', '?')} ({measured / expected:.2f}x)"
    return line


__all__ = ["measured_per_process", "throughput_text"]
