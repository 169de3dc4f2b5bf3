"""A ``transformers.Trainer``/TRL output folder without ``metrics.jsonl`` (a script run without
``fsdp_presets.FSDPPresetsCallback``): its per-step series from Trainer's own log.

Trainer keeps its log in ``trainer_state.json`` (``log_history``): ``OUTPUT_DIR/trainer_state.json``
when the script called ``trainer.save_state()``, else the one in its newest ``checkpoint-N``. Each
``loss`` there is the mean over the ``logging_steps`` optimizer steps since the previous log line,
summed in a float32 tensor (the printed values are rounded, the stored ones are not); ``grad_norm``
and ``learning_rate`` are the logged step's own. :data:`RunRecord.averaged_steps` records the window
so the tolerance and the report can say so (:func:`fsdp_presets.compare.tolerance.auto_tolerance`).

Bounded: a ``trainer_state.json`` over :data:`MAX_STATE_BYTES` is refused (it is JSON, parsed as data).
"""

from __future__ import annotations

import json
from pathlib import Path

from fsdp_presets.checkpoint.layout import TRAINER_CHECKPOINT_PATTERN, TRAINER_STATE
from fsdp_presets.errors import UsageError

MAX_STATE_BYTES = 256 * 1024 * 1024
"""Largest trainer_state.json read (a log of millions of steps is far below it)."""


def trainer_state_file(folder: Path) -> Path | None:
    """``folder/trainer_state.json``, else the one of the newest ``checkpoint-N`` in ``folder``, else None."""
    if (folder / TRAINER_STATE).is_file():
        return folder / TRAINER_STATE
    found = []
    for entry in folder.iterdir() if folder.is_dir() else ():
        match = TRAINER_CHECKPOINT_PATTERN.match(entry.name)
        if match and (entry / TRAINER_STATE).is_file():
            found.append((int(match.group(1)), entry / TRAINER_STATE))
    return max(found)[1] if found else None


def read_trainer_log(path: Path) -> tuple[dict[str, dict[int, float]], int]:
    """``(series, logging_steps)`` from a trainer_state.json: ``loss``, ``grad_norm``, ``lr`` by step."""
    if path.stat().st_size > MAX_STATE_BYTES:
        raise UsageError(f"{path} is larger than {MAX_STATE_BYTES} bytes; not a Trainer state file")
    try:
        state = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise UsageError(f"cannot read {path} as Trainer's state ({error})") from None
    history = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(history, list):
        raise UsageError(f"{path} has no log_history list; give a Trainer output folder or a run folder")
    series: dict[str, dict[int, float]] = {}
    for entry in history:
        if not isinstance(entry, dict) or not isinstance(entry.get("step"), int) or "loss" not in entry:
            continue  # evaluation and summary lines
        for name, key in (("loss", "loss"), ("grad_norm", "grad_norm"), ("lr", "learning_rate")):
            value = entry.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                series.setdefault(name, {})[entry["step"]] = float(value)
    logging_steps = state.get("logging_steps")
    return series, int(logging_steps) if isinstance(logging_steps, int) and logging_steps > 0 else 1
