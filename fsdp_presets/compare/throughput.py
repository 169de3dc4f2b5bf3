"""A run's measured throughput against what its preset predicted: the line ``compare`` prints for each
run, so that a cluster slower than the plan shows at once.

The measured figure is the median over the run's steps after its first (warm-up, the allocator's
growth) of ``tokens_per_s`` (all ranks' tokens per second, :mod:`fsdp_presets.train.metrics`) over
the run's processes. The predicted one is the ``predicted`` entry of the metadata line of the
accelerate config the run was launched with (``generate`` writes it:
:func:`fsdp_presets.preset.emit.predicted_time`), read only when the file is still where run.json says.
"""

from __future__ import annotations

import statistics

from fsdp_presets.compare.records import RunRecord


def measured_tokens_per_s_per_process(record: RunRecord) -> float | None:
    """Median tokens/s per process over the steps after the first; None without enough steps or
    without the run's process count."""
    series = record.series.get("tokens_per_s") or {}
    steps = sorted(series)[1:]
    processes = record.info.world_size if record.info else None
    if not steps or not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
        return None
    return statistics.median(series[step] for step in steps) / processes


def predicted(record: RunRecord) -> dict | None:
    """The ``predicted`` entry of the run's accelerate config, or None (no config, a CPU preset, a
    config not written by ``generate``, or one that cannot be read)."""
    from fsdp_presets.preset.emit import file_metadata

    config = record.info.accelerate_config if record.info else None
    if not isinstance(config, str) or not config:
        return None
    entry = file_metadata(config).get("predicted")
    return entry if isinstance(entry, dict) else None


def throughput_line(record: RunRecord, role: str) -> str | None:
    """``baseline 1,234 tokens/s per process measured ...; its preset predicts 2,345 on H100-SXM
    (0.53x)``, or None when the run records no throughput."""
    measured = measured_tokens_per_s_per_process(record)
    if measured is None:
        return None
    line = f"{role} {measured:,.0f} tokens/s per process measured (median after step 1)"
    entry = predicted(record)
    expected = entry.get("tokens_per_s_per_gpu") if entry else None
    if isinstance(expected, (int, float)) and not isinstance(expected, bool) and expected > 0:
        line += f"; its preset predicts {expected:,.0f} on {entry.get('gpu', '?')} ({measured / expected:.2f}x)"
    return line
