"""Rehearsed peaks of the shipped presets (``accelerate_configs/``), read from the data file
``rehearsed_presets.json`` beside this module (shipped with the package): one entry per file, each
the result of ``fsdp-presets rehearse accelerate_configs/NAME.yaml --json`` on the settings it
names. ``generate`` writes the entry into a preset's header when the preset's settings are the
recorded ones (and only then: a changed preset is rehearsed again before it claims a number).
``tests/test_rehearse.py`` checks that every shipped GPU preset has a current entry, that it fits
the GPU, that the planner agrees with it within 10%, and rehearses one again to check the record.

The file holds three tables:

- ``runs``: ``file name -> {"settings", "peak_bytes", "planner_bytes", "where", "command",
  ["change"]}``, the presets rehearsed themselves (``settings``: the :data:`SETTING_KEYS` of
  ``Preset.summary()``; ``change``: why the preset's settings changed since an earlier release).
- ``same_as``: ``file name -> {"same_as": a file name of runs, "change"}``: HSDP presets
  (``NAME_NxG``) whose shard group is the rehearsed preset's G GPUs with the same micro-batch.
  Presets sharded over the same group size with the same micro-batch, checkpointing and gradient
  reduction hold the same bytes per GPU (the accumulation count beyond two and the HSDP replicas
  change the traffic, not the peak: see :data:`fsdp_presets.rehearse.rehearsal.REHEARSED_MICRO_BATCHES`).
- ``not_rehearsed``: ``file name -> why``, shipped presets whose own settings are not rehearsed yet.

:data:`REHEARSED`, every file's full record, is derived from the first two. Whoever records a new
rehearsal writes the tables with :func:`write_records` (atomically: a reader sees the old file or
the new one).
"""

from __future__ import annotations

import json
import os
import re
from importlib import resources
from pathlib import PurePosixPath

DATA_FILE = "rehearsed_presets.json"
"""The records, in this package (``[tool.setuptools.package-data]`` in pyproject.toml ships it)."""
SETTING_KEYS = ("processes", "sharding", "precision", "activation_checkpointing", "offload", "seq_len",
                "micro_batch", "reduce_every_micro_batch")
"""The preset summary fields a record depends on (``Preset.summary()``)."""


def read_records(text: str | None = None) -> tuple[dict, dict, dict]:
    """``(runs, same_as, not_rehearsed)`` of the records' JSON ``text`` (default: the shipped file)."""
    if text is None:
        text = resources.files(__package__).joinpath(DATA_FILE).read_text(encoding="utf-8")
    document = json.loads(text)
    return document["runs"], document["same_as"], document["not_rehearsed"]


def write_records(path: str | os.PathLike, *, runs: dict, same_as: dict, not_rehearsed: dict) -> None:
    """Write the three tables to ``path`` (the package's :data:`DATA_FILE` when regenerating it),
    atomically, after checking that every ``same_as`` entry names a rehearsed run and an
    ``NAME_NxG.yaml`` file."""
    from fsdp_presets.fileio import write_json_atomic

    for name, entry in same_as.items():
        _shared_record(name, entry, runs)
    write_json_atomic(path, {"runs": runs, "same_as": same_as, "not_rehearsed": not_rehearsed})


def _shared_record(name: str, entry: dict, runs: dict) -> dict:
    """The full record of an HSDP preset that shares ``entry["same_as"]``'s rehearsal: its numbers and
    command, with this preset's processes, mesh and change note."""
    match = re.fullmatch(r".+_(\d+)x(\d+)\.ya?ml", name)
    if match is None:
        raise ValueError(f"{name}: a same_as entry needs a NAME_NxG.yaml file name (N nodes of G GPUs)")
    if entry.get("same_as") not in runs:
        raise ValueError(f"{name}: same_as {entry.get('same_as')!r} is not a rehearsed run")
    nodes, per_node = int(match[1]), int(match[2])
    base = runs[entry["same_as"]]
    return {**base, "settings": {**base["settings"], "processes": nodes * per_node, "sharding": f"HSDP {nodes}x{per_node}"},
            "same_as": f"{entry['same_as']} (HSDP shards over the same {per_node} GPUs with the same micro-batch)",
            **{key: value for key, value in entry.items() if key != "same_as"}}


REHEARSED_RUNS, SAME_AS, NOT_REHEARSED = read_records()
REHEARSED = {**REHEARSED_RUNS, **{name: _shared_record(name, entry, REHEARSED_RUNS) for name, entry in SAME_AS.items()}}
"""``file name -> {"settings", "peak_bytes", "planner_bytes", "where", "command", ["same_as"], ["change"]}``."""


def recorded_rehearsal(output: str, summary: dict) -> dict | None:
    """The record of the shipped preset written to ``output`` when ``summary`` has its settings."""
    record = REHEARSED.get(PurePosixPath(output).name)
    if record is None or record["settings"] != {key: summary.get(key) for key in SETTING_KEYS}:
        return None
    return record


def missing_rehearsal(output: str) -> str | None:
    """Why the shipped preset written to ``output`` has no rehearsal of its own, or None."""
    return NOT_REHEARSED.get(PurePosixPath(output).name)
