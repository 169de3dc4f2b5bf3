"""Rehearsed peaks of the shipped presets (``accelerate_configs/``): data, one entry per file,
each the result of ``fsdp-presets rehearse accelerate_configs/NAME.yaml --json`` on the settings it
names. ``generate`` writes the entry into a preset's header when the preset's settings are the
recorded ones (and only then: a changed preset is rehearsed again before it claims a number).
``tests/test_rehearse.py`` checks that every shipped GPU preset has a current entry, that it fits
the GPU, that the planner agrees with it within 10%, and rehearses one again to check the record.

Presets sharded over the same group size with the same micro-batch, checkpointing and gradient
reduction hold the same bytes per GPU (the accumulation count beyond two and the HSDP replicas
change the traffic, not the peak: see :data:`fsdp_presets.rehearsal.REHEARSED_MICRO_BATCHES`);
their entries name the rehearsal they share (``same_as``).
"""

from __future__ import annotations

SETTING_KEYS = ("processes", "sharding", "precision", "activation_checkpointing", "offload", "seq_len",
                "micro_batch", "reduce_every_micro_batch")
"""The preset summary fields a record depends on (``Preset.summary()``)."""

REHEARSED = {
}
"""``file name -> {"settings", "peak_bytes", "planner_bytes", "where", "command", ["same_as"], ["change"]}``."""


def recorded_rehearsal(output: str, summary: dict) -> dict | None:
    """The record of the shipped preset written to ``output`` when ``summary`` has its settings."""
    from pathlib import PurePosixPath

    record = REHEARSED.get(PurePosixPath(output).name)
    if record is None or record["settings"] != {key: summary.get(key) for key in SETTING_KEYS}:
        return None
    return record
