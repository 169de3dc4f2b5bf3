"""The planner-accuracy grid, recorded. Each published config of a family the planner keeps no
constants for (:mod:`fsdp_harness.published_configs`) is rehearsed in full at every point of
:data:`GRID`, and once briefly as the planner rehearses it (the short runs of
:func:`fsdp_presets.preset.measured_activations.measure`). Both go into one JSON file,
:data:`TABLE`, so that a fast test holds the planner's composition to every recorded point
without rehearsing, and the live tests hold the file to a live rehearsal (a stale table fails)::

    python scripts/planner_accuracy.py --record tests/data/planner_grid.json   # rehearse and record
    table = load(TABLE)
    for family, point, row in planned_rows(table, folder): ...                # the planner, composed

The table::

    {"format": 1, "families": {model_type: {"config_hash", "layers", "seq_len", "precision",
                                            "short_rehearsal": <a measured_activations cache entry>,
                                            "seconds"}},
     "points": [{"family", "config_hash", "layers", "seq_len", "precision", "gpus", "micro_batch",
                 "grad_accum", "activation_checkpointing", "rehearsed_per_gpu_bytes",
                 "gpu_memory_bytes", "usable_bytes", "fits", "seconds", "torch", "transformers"}]}

``fits`` is the rehearsal's verdict on the planner's budget: its per-GPU peak within the GPU's
memory less the reserve the planner keeps for what a CPU rehearsal cannot see
(:attr:`fsdp_presets.plan.shapes.Hardware.usable_bytes`), so both verdicts answer one question.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

from fsdp_harness.published_configs import config_hash, write_config

GRID = tuple(itertools.product((8, 64), (1, 2), (1, 4), (False, True)))
"""(GPUs, micro-batch, accumulation, activation checkpointing) of every point: 16 per family."""
FORMAT = 1
"""Bumped when what the table holds changes."""
TABLE = Path(__file__).resolve().parents[2] / "tests" / "data" / "planner_grid.json"
"""The recorded table (in the checkout the harness is installed from)."""
FULL_DEPTH_TABLE = TABLE.with_name("planner_full_depth.json")
"""The same grid for a few families at their published depth and a 4096-token sequence
(``scripts/planner_accuracy.py --record ... --full-depth --seq-len 4096``): the 4-block cut does not
show how the terms compose with depth."""
LIMIT = 0.10
"""The largest difference allowed between the planner and the rehearsal."""


def versions() -> dict[str, str]:
    """The torch and transformers versions a measurement depends on."""
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def load(path=TABLE, *, current: bool = True) -> dict:
    """The recorded table at ``path`` (an empty one when there is none). ``current``: refuse short
    rehearsals of another format than the planner reads (a table about to be recorded again may
    hold them)."""
    path = Path(path)
    if not path.is_file():
        return {"format": FORMAT, "families": {}, "points": []}
    from fsdp_presets.preset.measured_activations import CACHE_FORMAT

    table = json.loads(path.read_text(encoding="utf-8"))
    if table.get("format") != FORMAT:
        raise ValueError(f"{path}: format {table.get('format')}, expected {FORMAT}: record it again")
    stale = sorted(family for family, record in table["families"].items()
                   if record["short_rehearsal"].get("format") != CACHE_FORMAT)
    if stale and current:
        raise ValueError(f"{path}: the short rehearsals of {', '.join(stale)} are not of format {CACHE_FORMAT}: "
                         f"record them again (scripts/planner_accuracy.py --record {path} --short-only)")
    return table


def save(path, table: dict, family: str, record: dict, points: list[dict]) -> dict:
    """``table`` with ``family``'s record and points replaced, written atomically to ``path``."""
    from fsdp_presets.fileio import write_json_atomic

    families = {**table["families"], family: record}
    kept = [point for point in table["points"] if point["family"] != family]
    table = {"format": FORMAT, "families": dict(sorted(families.items())),
             "points": sorted(kept + points, key=point_key)}
    write_json_atomic(path, table)
    return table


def point_key(point: dict) -> tuple:
    """A point's place in the table: family, then the grid's order."""
    return (point["family"], point["gpus"], point["micro_batch"], point["grad_accum"],
            point["activation_checkpointing"])


def find_point(table: dict, family: str, gpus: int, micro_batch: int, grad_accum: int, checkpointing: bool) -> dict:
    """The recorded point of ``family`` at these settings (KeyError when the table has none)."""
    for point in table["points"]:
        if point_key(point) == (family, gpus, micro_batch, grad_accum, checkpointing):
            return point
    raise KeyError(f"no recorded point for {family} at {gpus} GPUs, micro-batch {micro_batch}, "
                   f"accumulation {grad_accum}, checkpointing {checkpointing}")


def rehearse_short(folder, family: str, *, layers: int, seq_len: int, precision: str = "bf16", log=print) -> dict:
    """``family``'s record: the short rehearsal the planner composes from (no full rehearsal)."""
    from fsdp_presets.model.model_loading import load_config
    from fsdp_presets.preset.measured_activations import measure

    source = write_config(folder, family, layers=layers)
    started = time.monotonic()
    entry = measure(load_config(source), seq_len=seq_len, precision=precision)
    record = {"config_hash": config_hash(family, layers=layers), "layers": layers, "seq_len": seq_len,
              "precision": precision, "short_rehearsal": entry, "seconds": round(time.monotonic() - started, 1),
              **versions()}
    log(f"{family:12} short rehearsal {record['seconds']:.1f} s")
    return record


def rehearse_family(folder, family: str, *, layers: int, seq_len: int, gpu_memory_gib: float,
                    precision: str = "bf16", log=print) -> tuple[dict, list[dict]]:
    """``(record, points)``: ``family``'s short rehearsal and a full rehearsal at every point of
    :data:`GRID` (one after another, in this process)."""
    from fsdp_presets.fileio import GiB
    from fsdp_presets.plan.shapes import Hardware
    from fsdp_presets.preset.rehearse_request import rehearse_request, request_from_flags

    record = rehearse_short(folder, family, layers=layers, seq_len=seq_len, precision=precision, log=log)
    source = write_config(folder, family, layers=layers)
    digest, found = record["config_hash"], versions()
    hardware_of = {gpus: Hardware(gpus=gpus, gpu_memory_bytes=int(gpu_memory_gib * GiB)) for gpus, *_ in GRID}
    points = []
    for gpus, micro, accumulation, checkpointing in GRID:
        started = time.monotonic()
        request = request_from_flags(source, gpus=gpus, seq_len=seq_len, micro_batch=micro, precision=precision,
                                     activation_checkpointing="on" if checkpointing else "off",
                                     gpu_memory_gib=gpu_memory_gib)
        document, _, _ = rehearse_request(request, source=source, preset_file=False, grad_accum=accumulation)
        rehearsed = document["rehearsal"]["per_gpu_peak_bytes"]
        usable = hardware_of[gpus].usable_bytes
        points.append({"family": family, "config_hash": digest, "layers": layers, "seq_len": seq_len,
                       "precision": precision, "gpus": gpus, "micro_batch": micro, "grad_accum": accumulation,
                       "activation_checkpointing": checkpointing, "rehearsed_per_gpu_bytes": rehearsed,
                       "gpu_memory_bytes": hardware_of[gpus].gpu_memory_bytes, "usable_bytes": usable,
                       "fits": rehearsed <= usable, "seconds": round(time.monotonic() - started, 1), **found})
        log(f"{family:12} gpus {gpus:2} mb {micro} accum {accumulation} ac {'on ' if checkpointing else 'off'} "
            f"rehearsed {rehearsed / GiB:7.2f} GiB in {points[-1]['seconds']:.1f} s")
    return record, points


def planned_rows(table: dict, folder):
    """``(point, row)`` for every recorded point: the planner's FULL_SHARD FSDP2 row, its
    activation terms composed from the family's recorded short rehearsal (no rehearsal runs).
    ``folder`` receives the configs the profiles are read from."""
    from fsdp_presets.plan.planner import plan
    from fsdp_presets.plan.shapes import Hardware, TrainingShape
    from fsdp_presets.preset.generate import load_profile
    from fsdp_presets.preset.measured_activations import terms_from_entry

    profiles, terms = {}, {}
    for point in table["points"]:
        family = point["family"]
        if family not in profiles:
            record = table["families"][family]
            profiles[family] = load_profile(write_config(folder, family, layers=record["layers"]))
            terms[family] = terms_from_entry(record["short_rehearsal"])
        shape = TrainingShape(seq_len=point["seq_len"], precision=point["precision"], micro_batch=point["micro_batch"],
                              grad_accum=point["grad_accum"],
                              activation_checkpointing=point["activation_checkpointing"], measured=terms[family])
        hardware = Hardware(gpus=point["gpus"], gpu_memory_bytes=point["gpu_memory_bytes"])
        yield point, plan(profiles[family], hardware, shape).get("FULL_SHARD", 2)


def difference(point: dict, row) -> float:
    """The planner's per-GPU total less the rehearsed peak, as a fraction of the peak."""
    rehearsed = point["rehearsed_per_gpu_bytes"]
    return (row.per_gpu.total - rehearsed) / rehearsed


def compare(table: dict, folder) -> tuple[list[str], float, list[str]]:
    """``(lines, largest difference, failures)``: one line per recorded point (planned, rehearsed,
    difference, both verdicts); the failures are the lines of a difference of :data:`LIMIT` or more
    or another verdict."""
    from fsdp_presets.fileio import GiB

    lines, worst, failed = [], 0.0, []
    for point, row in planned_rows(table, folder):
        off = difference(point, row)
        worst = max(worst, abs(off))
        lines.append(f"{point['family']:12} gpus {point['gpus']:2} mb {point['micro_batch']} "
                     f"accum {point['grad_accum']} ac {'on ' if point['activation_checkpointing'] else 'off'} "
                     f"planned {row.per_gpu.total / GiB:7.2f} GiB "
                     f"rehearsed {point['rehearsed_per_gpu_bytes'] / GiB:7.2f} GiB {off:+7.2%} "
                     f"fits {row.fits}/{point['fits']}")
        if abs(off) >= LIMIT or row.fits != point["fits"]:
            failed.append(lines[-1])
    return lines, worst, failed
