"""A run record's measured throughput against what its preset predicted: the line ``compare`` prints
for each run (:func:`fsdp_presets.throughput.throughput_text`, which says how each figure is made),
the prediction read from the accelerate config the run was launched with, when the file is still
where run.json says."""

from __future__ import annotations

from fsdp_presets.compare.records import RunRecord
from fsdp_presets.throughput import throughput_text


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
    (0.53x)`` (:func:`fsdp_presets.throughput.throughput_text`), or None when the run records no
    throughput."""
    return throughput_text(role, record.series.get("tokens_per_s") or {},
                           record.info.world_size if record.info else None, predicted(record))
