"""Loading a run folder for comparison: its train and eval lines, its run.json, the checkpoint
steps it resumed from, and the check that two runs trained on the same samples.

Pure apart from :func:`load_run`, which reads the files. The tolerances are in
:mod:`fsdp_presets.compare.tolerance`, the step-by-step comparison in :mod:`fsdp_presets.compare.runs`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from fsdp_presets.checkpoint.layout import MANIFEST, METRICS, RUN_JSON, step_in_path
from fsdp_presets.checkpoint.run_folder import RunInfo, read_run_info
from fsdp_presets.compare.trainer_log import read_trainer_log, trainer_state_file
from fsdp_presets.errors import UsageError


@dataclass(kw_only=True)
class RunRecord:
    """One run as the comparison sees it: its run.json and its per-step series."""

    path: Path
    """The run folder (the folder that holds metrics.jsonl)."""
    metrics_path: Path
    """The metrics.jsonl that was read."""
    info: RunInfo | None
    """The run's run.json, None when the folder has none."""
    series: dict[str, dict[int, float]]
    """Metric name -> {step: value}; only metrics the file records."""
    notes: list[str] = field(default_factory=list)
    """Things worth saying about the file that did not stop the comparison."""
    averaged_steps: int | None = None
    """Read from Trainer's own log (:mod:`fsdp_presets.compare.trainer_log`): each loss is the mean
    over this many steps (``logging_steps``); None for a metrics.jsonl (exact per step)."""

    def __post_init__(self) -> None:
        if not self.series.get("loss"):
            raise ValueError(f"{self.metrics_path}: a run needs at least one train loss")

    @property
    def precision(self) -> str | None:
        """``no`` (fp32), ``bf16`` or ``fp16`` from run.json; None when unknown."""
        value = self.info.precision if self.info is not None else None
        return str(value) if value is not None else None

    @property
    def resume_step(self) -> int | None:
        """The step of the checkpoint this run was resumed from (run.json ``resumed_from``)."""
        if self.info is None or not self.info.resumed_from:
            return None
        return checkpoint_step(str(self.info.resumed_from))

    @property
    def train_steps(self) -> list[int]:
        return sorted(self.series["loss"])

    def describe(self) -> dict:
        """The run.json facts a report shows (missing ones as None)."""
        info = self.info or RunInfo()
        fsdp = info.fsdp or {}
        layout = None
        if fsdp:
            parts = [f"FSDP{fsdp.get('version', '?')}"]
            # FSDP1's reshard_after_forward holds its strategy too (accelerate's fallback): said once.
            shown = ("sharding_strategy", "activation_checkpointing") if fsdp.get("version") == 1 else (
                "sharding_strategy", "reshard_after_forward", "activation_checkpointing")
            for key in shown:
                if key in fsdp and fsdp[key] is not None:
                    parts.append(f"{key}={fsdp[key]}")
            mesh = fsdp.get("hsdp_mesh")
            if isinstance(mesh, dict):
                parts.append(f"HSDP {mesh.get('dp_replicate_size')} x {mesh.get('dp_shard_size')} "
                             "(replicate x shard)")
            model_mesh = info.model_mesh
            if isinstance(model_mesh, dict):  # --distributed-config: sharded by transformers
                sizes = [f"{name} {model_mesh.get(f'{key}_size')}" for key, name in
                         (("dp_replicate", "HSDP"), ("fsdp", "FSDP"), ("tp", "TP"), ("ep", "EP"))
                         if (model_mesh.get(f"{key}_size") or 1) > 1 or key == "fsdp"]
                parts.append(f"mesh {' x '.join(sizes)} (transformers' DistributedConfig)")
            layout = ", ".join(parts)
        steps = self.train_steps
        return {
            "path": str(self.path),
            "model": info.model,
            "distributed_type": info.distributed_type,
            "fsdp": layout,
            "precision": info.precision,
            "world_size": info.world_size,
            "global_batch_samples": info.global_batch_samples,
            "learning_rate": info.learning_rate,
            "seed": info.seed,
            "resumed_from": info.resumed_from,
            "steps": f"{steps[0]}-{steps[-1]} ({len(steps)} lines)",
        }


def checkpoint_step(path: str) -> int | None:
    """The optimizer step of a checkpoint: its manifest's ``step``, else the ``step-NNNNNNNN`` name."""
    manifest = Path(path) / MANIFEST
    try:
        step = json.loads(manifest.read_text()).get("step")
        if isinstance(step, int) and not isinstance(step, bool):
            return step
    except (OSError, ValueError, AttributeError):
        pass
    return step_in_path(path)


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def load_run(path: str | os.PathLike, *, prefer_trainer_log: bool = False) -> RunRecord:
    """Read a run folder (or a metrics.jsonl file and the run.json beside it). A Trainer output
    folder without metrics.jsonl (or any with ``prefer_trainer_log``) is read from Trainer's log.

    Raises UsageError, listing every problem found, when the run cannot be compared.
    """
    given = Path(path)
    if given.is_dir():
        folder, metrics_path = given, given / METRICS
        if not metrics_path.is_file() and not prefer_trainer_log:
            prefer_trainer_log = trainer_state_file(given) is not None
        if prefer_trainer_log:
            return _load_trainer_log(given)
        if not metrics_path.is_file():
            raise UsageError(
                f"{given} holds no {METRICS}; give a run folder written by a recipe "
                f"(--output-dir) or the path of a {METRICS} file"
            )
    elif given.is_file():
        folder, metrics_path = given.parent, given
    else:
        raise UsageError(f"{given} does not exist; give a run folder or a {METRICS} file")

    problems: list[str] = []
    notes: list[str] = []
    info = None
    run_file = folder / RUN_JSON
    if run_file.is_file():
        try:
            info = read_run_info(folder)
        except (OSError, ValueError) as error:
            problems.append(str(error))
    else:
        notes.append(f"{folder} has no {RUN_JSON}: its data, global batch, seed and precision are unknown")

    series: dict[str, dict[int, float]] = {}
    duplicates = 0
    try:
        lines = metrics_path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"cannot read {metrics_path}: {error}") from None
    last_content = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        where = f"{metrics_path}:{index + 1}"
        try:
            record = json.loads(line)
        except ValueError:
            if index == last_content:
                # A run killed while writing leaves half a line at the end; the rest is sound.
                notes.append(f"{where}: last line is incomplete (run stopped while writing it); ignored")
                continue
            problems.append(f"{where}: not a JSON object")
            continue
        if not isinstance(record, dict):
            problems.append(f"{where}: not a JSON object")
            continue
        kind = record.get("kind", "train" if "loss" in record else None)
        if kind not in ("train", "eval"):
            continue  # other line kinds (future ones) are not compared
        step = record.get("step")
        # Train steps count optimizer steps from 1; an evaluation may run before training (step 0).
        first_step = 1 if kind == "train" else 0
        if not isinstance(step, int) or isinstance(step, bool) or step < first_step:
            problems.append(f"{where}: {kind} line without an integer 'step' >= {first_step} (got {step!r})")
            continue
        wanted = ("loss", "grad_norm", "lr", "samples_seen", "tokens_per_s") if kind == "train" else ("eval_loss",)
        if kind == "train" and not is_number(record.get("loss")):
            problems.append(f"{where}: train line without a numeric 'loss' (got {record.get('loss')!r})")
            continue
        for name in wanted:
            value = record.get(name)
            if value is None:
                continue
            if not is_number(value):
                problems.append(f"{where}: {name!r} is not a number (got {value!r})")
                continue
            values = series.setdefault(name, {})
            if name == wanted[0] and step in values:
                duplicates += 1
            # NOTE: the contract rewrites the file on resume, so a step appears once; an older
            # file that was appended to holds the resumed value last, which is the one kept.
            values[step] = float(value)
    if duplicates:
        notes.append(
            f"{metrics_path}: {duplicates} step(s) appear more than once; the last line of each is used"
        )
    if not problems and not series.get("loss"):
        problems.append(f"{metrics_path} has no train lines (kind 'train' with 'step' and 'loss')")
    if problems:
        shown = problems[:10] + ([f"... and {len(problems) - 10} more"] if len(problems) > 10 else [])
        raise UsageError(f"cannot read run {given}: " + "; ".join(shown))
    return RunRecord(path=folder, metrics_path=metrics_path, info=info, series=series, notes=notes)


def _load_trainer_log(folder: Path) -> RunRecord:
    """A Trainer/TRL output folder read from its trainer_state.json (see :mod:`.trainer_log`)."""
    state = trainer_state_file(folder)
    if state is None:
        raise UsageError(f"{folder} holds no {METRICS} and no Trainer trainer_state.json; give a run folder "
                         f"written by a recipe, a Trainer output folder, or a {METRICS} file")
    series, logging_steps = read_trainer_log(state)
    if not series.get("loss"):
        raise UsageError(f"cannot read run {folder}: {state} logs no training loss")
    try:
        info = read_run_info(folder)
    except (OSError, ValueError):
        info = None
    note = (f"read from Trainer's log {state}: each loss is the mean over logging_steps={logging_steps} steps "
            "(a float32 sum), steps between log lines are not compared")
    return RunRecord(path=folder, metrics_path=state, info=info, series=series, notes=[note], averaged_steps=logging_steps)


def load_pair(baseline: str | os.PathLike, candidate: str | os.PathLike) -> tuple[RunRecord, RunRecord]:
    """Both runs; when one is read from Trainer's log and the other folder has one too, that one is
    read from its Trainer log as well, so both losses are averaged over the same steps."""
    runs = [load_run(baseline), load_run(candidate)]
    averaged = [run.averaged_steps is not None for run in runs]
    if any(averaged) and not all(averaged):
        index = averaged.index(False)
        if runs[index].path.is_dir() and trainer_state_file(runs[index].path) is not None:
            runs[index] = load_run(runs[index].path, prefer_trainer_log=True)
    return runs[0], runs[1]


def check_comparable(baseline: RunRecord, candidate: RunRecord) -> list[str]:
    """Refuse two runs that did not train on the same samples in the same order.

    Returns notes (fields that could not be checked); raises UsageError naming both values of
    every field that differs.
    """
    notes = []
    if baseline.info is None or candidate.info is None:
        notes.append(
            "data, global batch, seed and sequence length could not be checked (a run.json is "
            "missing); the comparison assumes they are the same"
        )
        return notes
    mismatches = []
    for (label, ours), (_, theirs) in zip(baseline.info.comparable(), candidate.info.comparable()):
        if ours is None or theirs is None:
            if ours is not None or theirs is not None:
                notes.append(f"{label} is recorded in only one run.json; not checked")
            continue
        if ours != theirs:
            mismatches.append(f"{label}: baseline {ours!r}, candidate {theirs!r}")
    if mismatches:
        raise UsageError(
            "the runs did not train on the same samples, a step-by-step comparison means nothing: "
            + "; ".join(mismatches)
            + ". Rerun the candidate with the baseline's data, seed, sequence length and global batch "
            "(micro-batch x accumulation x data-parallel size)"
        )
    return notes
