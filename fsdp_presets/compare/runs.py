"""Step-by-step comparison of two training runs: does the candidate train like the baseline?

Reads two run folders of the recipes (``run.json`` + ``metrics.jsonl``, written by
:mod:`fsdp_presets.checkpoint.run_folder` and :mod:`fsdp_presets.train.metrics`), aligns their train lines by optimizer step and decides:

- **identical**: every compared value is bitwise equal at every common step;
- **within tolerance**: the largest relative deviation stays under the tolerance;
- **diverged**: some step goes over it. The first such step, the metric that shows it and the
  place where it starts give the diagnosis hint (:func:`diagnose`).

Which values are compared, and why each one:

``samples_seen``  exact. A different data position means the runs no longer train on the same
                  samples (a skipped or repeated batch after a resume, a global batch mismatch).
``loss``          the loss of step *s* comes from the weights after *s - 1* updates: it shows a
                  difference in the forward pass at step 1, a difference in the updates from step 2.
``grad_norm``     the gradient norm of step *s* comes from step *s*'s own backward and gradient
                  reduction: a reduce dtype or a parameter left out of gradient synchronisation
                  shows here at step 1, one step before the loss sees it.
``lr``            compared to float64 round-off whatever the tolerance: the schedule is computed
                  in Python floats, so any difference is a different schedule, never noise.
``eval_loss``     evaluation lines, at the steps both runs evaluated.

Pure functions apart from :func:`load_run`, which reads the files. The text summary, the Markdown
report and the overlay plot are in :mod:`fsdp_presets.compare.report`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from fsdp_presets.checkpoint.layout import MANIFEST, METRICS, RUN_JSON, step_in_path
from fsdp_presets.errors import UsageError

METRICS_FILE = METRICS
RUN_FILE = RUN_JSON

# Compared series, in the order that breaks ties at the same step: the data decides what the
# forward sees, the forward comes before the backward, the backward before the update.
METRIC_ORDER: tuple[str, ...] = ("samples_seen", "loss", "grad_norm", "lr", "eval_loss")

# run.json fields that must agree for a step-by-step comparison to mean anything. Two runs that
# differ here train on different samples at the same step: that is bad input, not a divergence.
COMPARABLE_FIELDS: tuple[tuple[str, str], ...] = (
    ("data_sha256", "data (sha256 of the data files)"),
    ("global_batch_samples", "global batch (samples per optimizer step)"),
    ("seed", "seed"),
    ("seq_len", "sequence length"),
)

# NOTE: fp32 epsilon is 2**-23 = 1.19e-7 (IEEE 754 binary32). Two correct fp32 runs that sum in a
# different order (another sharding, another ring) differ by round-off only. Measured here with
# scripts/convergence_check.py (tiny Llama, 12 steps, AdamW, clipping at 1.0; docs/convergence.md):
# - loss: FSDP1 and FSDP2 against DDP at most 5.3e-8 relative (under 1 ulp); one process against
#   two, 9.5e-7 absolute on a loss near 7 (FIELD-NOTES.md). Tolerance 1e-6, about 8 ulp.
# - grad_norm: FSDP2 computes the norm from per-shard partial sums (DTensor), DDP from whole
#   tensors; the two roundings differ by up to 1.85e-6 relative (9.2e-7 already at step 1, not
#   growing). Tolerance 1e-5, about 84 ulp.
# The smallest planted faults sit well above both: gradients reduced in bf16 or norms left out of
# gradient synchronisation move grad_norm by 5.6e-5 at step 1 and the loss by 1.5e-6 or more from
# step 2.
FP32_RELATIVE_TOLERANCE = {"loss": 1e-6, "grad_norm": 1e-5}

# NOTE: the sharded norm's round-off grows with the model: on SmolLM2-135M (fp32, no clipping)
# FSDP2 and DDP logged norms 1.5e-5 apart while every loss and eval loss was bitwise equal. When
# the losses agree exactly, the norm cannot have changed the training (a clipped update would have
# moved the next loss), so the norm is then held to this looser bound, 6x that measurement.
FP32_GRAD_NORM_WHEN_LOSSES_IDENTICAL = 1e-4

# NOTE: bf16 keeps 8 significant bits (epsilon 2**-7 = 7.8e-3): every matmul rounds, and two correct
# bf16 runs that shard differently round differently at every step. Measured here with
# scripts/convergence_check.py (method in docs/convergence.md): tiny Llama, bf16 mixed precision,
# 20 steps, seeds 1234 and 7, pairs DDP-FSDP2, DDP-FSDP1 and FSDP2-FSDP1 (plus one 12-step pair):
# largest relative deviation loss 7.8e-4, grad_norm 2.9e-3, eval_loss 4.2e-4; at that level by
# step 5, then fluctuating without growth. Tolerance: 3 to 4 times the largest (3.8x for the loss, 3.4x for
# grad_norm), so a correct bf16 run passes and an effect a few times the bf16 noise does not.
BF16_RELATIVE_TOLERANCE = {"loss": 3e-3, "grad_norm": 1e-2}
BF16_TOLERANCE_SOURCE = (
    "loss 3e-3 and grad_norm 1e-2 relative, 3 to 4x the largest deviation measured between two "
    "correct bf16 runs that shard differently (loss 7.8e-4, grad_norm 2.9e-3; docs/convergence.md)"
)

# NOTE: the learning rate is a Python float from the schedule: equal runs give equal bits.
# 1e-9 only absorbs a float32 round trip through a logger.
LR_RELATIVE_TOLERANCE = 1e-9

# A divergence within this many steps after a resume point is blamed on the resume: a lost
# optimizer moment shows in the loss two steps after the checkpoint's step (the first resumed
# update is step r + 1, its effect is seen by the loss of step r + 2), a lost scheduler or RNG
# state from step r + 1.
RESUME_WINDOW_STEPS = 3
# A divergence by this step (and not at a resume point) is "early": the runs differ in every
# update, so the first updates already show it.
EARLY_STEPS = 5

Verdict = Literal["identical", "within_tolerance", "diverged"]


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class RunRecord:
    """One run as the comparison sees it: its run.json and its per-step series."""

    path: Path
    """The run folder (the folder that holds metrics.jsonl)."""
    metrics_path: Path
    """The metrics.jsonl that was read."""
    info: dict | None
    """The parsed run.json, None when the folder has none."""
    series: dict[str, dict[int, float]]
    """Metric name -> {step: value}; only metrics the file records."""
    notes: list[str] = field(default_factory=list)
    """Things worth saying about the file that did not stop the comparison."""

    def __post_init__(self) -> None:
        if not self.series.get("loss"):
            raise ValueError(f"{self.metrics_path}: a run needs at least one train loss")

    @property
    def precision(self) -> str | None:
        """``no`` (fp32), ``bf16`` or ``fp16`` from run.json; None when unknown."""
        if self.info is None:
            return None
        value = self.info.get("precision")
        return str(value) if value is not None else None

    @property
    def resume_step(self) -> int | None:
        """The step of the checkpoint this run was resumed from (run.json ``resumed_from``)."""
        if self.info is None or not self.info.get("resumed_from"):
            return None
        return checkpoint_step(str(self.info["resumed_from"]))

    @property
    def train_steps(self) -> list[int]:
        return sorted(self.series["loss"])

    def describe(self) -> dict:
        """The run.json facts a report shows (missing ones as None)."""
        info = self.info or {}
        fsdp = info.get("fsdp") or {}
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
            layout = ", ".join(parts)
        steps = self.train_steps
        return {
            "path": str(self.path),
            "model": info.get("model"),
            "distributed_type": info.get("distributed_type"),
            "fsdp": layout,
            "precision": info.get("precision"),
            "world_size": info.get("world_size"),
            "global_batch_samples": info.get("global_batch_samples"),
            "learning_rate": info.get("learning_rate"),
            "seed": info.get("seed"),
            "resumed_from": info.get("resumed_from"),
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


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def load_run(path: str | os.PathLike) -> RunRecord:
    """Read a run folder (or a metrics.jsonl file and the run.json beside it).

    Raises UsageError, listing every problem found, when the run cannot be compared.
    """
    given = Path(path)
    if given.is_dir():
        folder, metrics_path = given, given / METRICS_FILE
        if not metrics_path.is_file():
            raise UsageError(
                f"{given} holds no {METRICS_FILE}; give a run folder written by a recipe "
                f"(--output-dir) or the path of a {METRICS_FILE} file"
            )
    elif given.is_file():
        folder, metrics_path = given.parent, given
    else:
        raise UsageError(f"{given} does not exist; give a run folder or a {METRICS_FILE} file")

    problems: list[str] = []
    notes: list[str] = []
    info = None
    run_file = folder / RUN_FILE
    if run_file.is_file():
        try:
            info = json.loads(run_file.read_text())
        except ValueError as error:
            problems.append(f"{run_file} is not valid JSON ({error})")
        else:
            if not isinstance(info, dict):
                problems.append(f"{run_file} does not hold a JSON object")
                info = None
            elif info.get("format", 1) != 1:
                problems.append(f"{run_file} has format {info.get('format')!r}; this version reads format 1")
    else:
        notes.append(f"{folder} has no {RUN_FILE}: its data, global batch, seed and precision are unknown")

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
        wanted = ("loss", "grad_norm", "lr", "samples_seen") if kind == "train" else ("eval_loss",)
        if kind == "train" and not _is_number(record.get("loss")):
            problems.append(f"{where}: train line without a numeric 'loss' (got {record.get('loss')!r})")
            continue
        for name in wanted:
            value = record.get(name)
            if value is None:
                continue
            if not _is_number(value):
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
    for key, label in COMPARABLE_FIELDS:
        ours, theirs = baseline.info.get(key), candidate.info.get(key)
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


# ---------------------------------------------------------------------------------------------
# Tolerance
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Tolerance:
    """Largest relative deviation |a - b| / max(|a|, |b|) accepted per compared metric."""

    loss: float
    """For ``loss`` and ``eval_loss``."""
    grad_norm: float
    """For ``grad_norm``."""
    source: str
    """Where the numbers come from (shown in every report)."""

    def __post_init__(self) -> None:
        problems = [
            f"{name} tolerance must be a finite number >= 0 (got {value!r})"
            for name, value in (("loss", self.loss), ("grad_norm", self.grad_norm))
            if not (_is_number(value) and math.isfinite(value) and value >= 0)
        ]
        if problems:
            raise ValueError("; ".join(problems))

    def for_metric(self, metric: str) -> float:
        if metric == "samples_seen":
            return 0.0
        if metric == "lr":
            return LR_RELATIVE_TOLERANCE
        if metric == "grad_norm":
            return self.grad_norm
        return self.loss


def parse_tolerance(text: str) -> float | None:
    """``auto`` -> None; ``1e-4`` -> 1e-4. UsageError otherwise."""
    if text.strip().lower() == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and 0 <= value < 1):
        raise UsageError(
            f"--tolerance must be 'auto' or a relative deviation in [0, 1), e.g. 1e-5 (got {text!r})"
        )
    return value


def auto_tolerance(baseline: RunRecord, candidate: RunRecord) -> Tolerance:
    """The tolerance that fits the lower of the two runs' precisions (run.json ``precision``)."""
    precisions = {baseline.precision, candidate.precision}
    low = precisions & {"bf16", "fp16"}
    if low:
        names = " and ".join(sorted(low))
        note = "" if low == {"bf16"} else "; fp16 is not measured here, the bf16 values are used"
        return Tolerance(
            loss=BF16_RELATIVE_TOLERANCE["loss"],
            grad_norm=BF16_RELATIVE_TOLERANCE["grad_norm"],
            source=f"auto for {names}: {BF16_TOLERANCE_SOURCE}{note}",
        )
    unknown = None in precisions
    return Tolerance(
        loss=FP32_RELATIVE_TOLERANCE["loss"],
        grad_norm=FP32_RELATIVE_TOLERANCE["grad_norm"],
        source=(
            "auto for fp32: loss 1e-6 relative (about 8 ulp of fp32, epsilon 1.19e-7), grad_norm 1e-5 "
            "(its sharded computation rounds differently)"
            + (" (a run's precision is unknown: fp32 assumed; pass --tolerance for a bf16 run)" if unknown else "")
        ),
    )


# ---------------------------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------------------------


# Metrics where two equal non-finite values still agree: with fp16 loss scaling an overflowing
# step has an inf (or NaN) gradient norm in both runs and is skipped by both. A NaN or inf loss is
# never agreement: a run whose loss is not finite has stopped training, whatever the other did.
NON_FINITE_MAY_AGREE: frozenset[str] = frozenset({"grad_norm"})


def relative_deviation(baseline: float, candidate: float, *, metric: str = "loss") -> float:
    """|a - b| / max(|a|, |b|): 0 for equal values, inf when either is NaN or infinite (two NaN
    losses are a divergence, not a match), except two equal non-finite values of a metric in
    :data:`NON_FINITE_MAY_AGREE`."""
    both_finite = math.isfinite(baseline) and math.isfinite(candidate)
    if not both_finite:
        same = baseline == candidate or (math.isnan(baseline) and math.isnan(candidate))
        return 0.0 if same and metric in NON_FINITE_MAY_AGREE else math.inf
    if baseline == candidate:
        return 0.0
    return abs(baseline - candidate) / max(abs(baseline), abs(candidate))


@dataclass(kw_only=True)
class MetricComparison:
    """How one metric compares over the steps both runs recorded."""

    metric: str
    """``loss``, ``grad_norm``, ``lr``, ``samples_seen`` or ``eval_loss``."""
    tolerance: float
    """Largest relative deviation accepted."""
    steps: list[int]
    """Common steps, ascending."""
    deviations: list[float]
    """Relative deviation at each common step."""
    baseline_values: list[float]
    """The baseline's value at each common step."""
    candidate_values: list[float]
    """The candidate's value at each common step."""

    def __post_init__(self) -> None:
        lengths = {len(self.steps), len(self.deviations), len(self.baseline_values), len(self.candidate_values)}
        if len(lengths) != 1:
            raise ValueError(f"{self.metric}: steps, deviations and values differ in length")

    @property
    def identical_steps(self) -> int:
        return sum(1 for deviation in self.deviations if deviation == 0.0)

    @property
    def max_deviation(self) -> float:
        return max(self.deviations, default=0.0)

    @property
    def max_deviation_step(self) -> int | None:
        """Where the largest deviation is; None when every step is identical."""
        if self.max_deviation == 0.0:
            return None
        return self.steps[self.deviations.index(self.max_deviation)]

    @property
    def first_divergent_index(self) -> int | None:
        for index, deviation in enumerate(self.deviations):
            if deviation > self.tolerance:
                return index
        return None

    @property
    def first_divergent_step(self) -> int | None:
        index = self.first_divergent_index
        return None if index is None else self.steps[index]

    @property
    def verdict(self) -> Verdict:
        if self.first_divergent_index is not None:
            return "diverged"
        return "identical" if self.max_deviation == 0.0 else "within_tolerance"

    def to_json(self) -> dict:
        index = self.first_divergent_index
        return {
            "metric": self.metric,
            "verdict": self.verdict,
            "tolerance": self.tolerance,
            "steps_compared": len(self.steps),
            "identical_steps": self.identical_steps,
            "max_deviation": _json_number(self.max_deviation),
            "max_deviation_step": self.max_deviation_step,
            "first_divergent_step": self.first_divergent_step,
            "at_first_divergence": None
            if index is None
            else {
                "baseline": _json_number(self.baseline_values[index]),
                "candidate": _json_number(self.candidate_values[index]),
                "deviation": _json_number(self.deviations[index]),
            },
        }


def _json_number(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)


@dataclass(kw_only=True)
class Comparison:
    """The verdict on a candidate run against its baseline."""

    baseline: RunRecord
    """The reference run (usually DDP)."""
    candidate: RunRecord
    """The run under test (usually FSDP)."""
    tolerance: Tolerance
    """What was accepted, and why."""
    metrics: list[MetricComparison]
    """One entry per metric both runs record, in :data:`METRIC_ORDER`."""
    notes: list[str]
    """Facts that did not change the verdict (unchecked fields, steps only one run has, ...)."""

    @property
    def verdict(self) -> Verdict:
        verdicts = {metric.verdict for metric in self.metrics}
        if "diverged" in verdicts:
            return "diverged"
        return "within_tolerance" if "within_tolerance" in verdicts else "identical"

    @property
    def agrees(self) -> bool:
        return self.verdict != "diverged"

    @property
    def first_divergence(self) -> MetricComparison | None:
        """The metric that goes over its tolerance first (ties: data, forward, backward, update)."""
        diverged = [metric for metric in self.metrics if metric.first_divergent_step is not None]
        if not diverged:
            return None
        return min(diverged, key=lambda metric: (metric.first_divergent_step, METRIC_ORDER.index(metric.metric)))

    @property
    def first_divergent_step(self) -> int | None:
        first = self.first_divergence
        return None if first is None else first.first_divergent_step

    def metric(self, name: str) -> MetricComparison | None:
        return next((metric for metric in self.metrics if metric.metric == name), None)

    @property
    def diagnosis(self) -> str | None:
        return diagnose(self)

    def to_json(self) -> dict:
        first = self.first_divergence
        return {
            "verdict": self.verdict,
            "agrees": self.agrees,
            "first_divergent_step": self.first_divergent_step,
            "first_divergent_metric": None if first is None else first.metric,
            "diagnosis": self.diagnosis,
            "tolerance": {
                "loss": self.tolerance.loss,
                "grad_norm": self.tolerance.grad_norm,
                "lr": LR_RELATIVE_TOLERANCE,
                "samples_seen": 0.0,
                "source": self.tolerance.source,
            },
            "baseline": self.baseline.describe(),
            "candidate": self.candidate.describe(),
            "metrics": [metric.to_json() for metric in self.metrics],
            "notes": list(self.notes),
        }


def compare_runs(baseline: RunRecord, candidate: RunRecord, tolerance: float | Tolerance | None = None) -> Comparison:
    """Align two runs by step and compare every metric both record.

    ``tolerance``: None for automatic (from the runs' precision), a float for one relative
    tolerance on loss, grad_norm and eval_loss, or a :class:`Tolerance`. Raises UsageError when the runs
    are not comparable (different data, global batch, seed or sequence length; no common step).
    """
    notes = check_comparable(baseline, candidate)
    if tolerance is None:
        chosen = auto_tolerance(baseline, candidate)
    elif isinstance(tolerance, Tolerance):
        chosen = tolerance
    else:
        chosen = Tolerance(loss=float(tolerance), grad_norm=float(tolerance), source=f"given: {float(tolerance):g} relative")

    base_steps, cand_steps = set(baseline.series["loss"]), set(candidate.series["loss"])
    common = sorted(base_steps & cand_steps)
    if not common:
        raise UsageError(
            f"the runs have no train step in common: baseline {_span(base_steps)}, candidate "
            f"{_span(cand_steps)}; compare runs of the same job from the same start"
        )
    only_base, only_cand = sorted(base_steps - cand_steps), sorted(cand_steps - base_steps)
    if only_base:
        notes.append(f"{len(only_base)} step(s) only in the baseline ({_span(only_base)}); not compared")
    if only_cand:
        notes.append(f"{len(only_cand)} step(s) only in the candidate ({_span(only_cand)}); not compared")
    if baseline.precision and candidate.precision and baseline.precision != candidate.precision:
        notes.append(
            f"the runs use different precisions (baseline {baseline.precision}, candidate "
            f"{candidate.precision}); the tolerance of the lower one applies"
        )

    metrics = []
    for name in METRIC_ORDER:
        ours, theirs = baseline.series.get(name), candidate.series.get(name)
        if not ours or not theirs:
            if ours or theirs:
                notes.append(f"{name} is recorded by only one run; not compared")
            continue
        steps = sorted(set(ours) & set(theirs))
        if not steps:
            notes.append(f"{name}: no step in common; not compared")
            continue
        metrics.append(
            MetricComparison(
                metric=name,
                tolerance=chosen.for_metric(name),
                steps=steps,
                deviations=[relative_deviation(ours[step], theirs[step], metric=name) for step in steps],
                baseline_values=[ours[step] for step in steps],
                candidate_values=[theirs[step] for step in steps],
            )
        )
    if tolerance is None:
        metrics = _loosen_norm_when_losses_identical(metrics, chosen, notes)
    for record, role in ((baseline, "baseline"), (candidate, "candidate")):
        notes.extend(f"{role}: {note}" for note in record.notes)
    return Comparison(baseline=baseline, candidate=candidate, tolerance=chosen, metrics=metrics, notes=notes)


def _loosen_norm_when_losses_identical(metrics, chosen: Tolerance, notes: list[str]):
    """See :data:`FP32_GRAD_NORM_WHEN_LOSSES_IDENTICAL` (automatic fp32 tolerance only)."""
    by_name = {metric.metric: metric for metric in metrics}
    norm, loss = by_name.get("grad_norm"), by_name.get("loss")
    losses = [by_name[name] for name in ("loss", "eval_loss") if name in by_name]
    if norm is None or loss is None or chosen.grad_norm >= FP32_GRAD_NORM_WHEN_LOSSES_IDENTICAL:
        return metrics
    if any(deviation != 0 for metric in losses for deviation in metric.deviations):
        return metrics
    notes.append(f"every loss is bitwise equal: grad_norm held to {FP32_GRAD_NORM_WHEN_LOSSES_IDENTICAL:g} "
                 "relative (a sharded norm rounds differently; it did not change the training)")
    loosened = dataclasses.replace(norm, tolerance=FP32_GRAD_NORM_WHEN_LOSSES_IDENTICAL)
    return [loosened if metric is norm else metric for metric in metrics]


def _span(steps) -> str:
    steps = sorted(steps)
    if not steps:
        return "no steps"
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"


# ---------------------------------------------------------------------------------------------
# Diagnosis
# ---------------------------------------------------------------------------------------------


def diagnose(comparison: Comparison) -> str | None:
    """A hint at the cause, read off where and in which metric the divergence starts.

    None when the runs agree. The hint names likely causes in the order they are usually found;
    it is a place to start looking, not a proof.
    """
    first = comparison.first_divergence
    if first is None:
        return None
    step = first.first_divergent_step
    index = first.first_divergent_index
    base_value, cand_value = first.baseline_values[index], first.candidate_values[index]
    where = f"{first.metric} first goes over tolerance at step {step} (baseline {base_value:.9g}, candidate {cand_value:.9g})"
    resume_steps = sorted(
        {s for s in (comparison.baseline.resume_step, comparison.candidate.resume_step) if s is not None}
    )
    resumed_before = [r for r in resume_steps if r < step <= r + RESUME_WINDOW_STEPS]

    if not (math.isfinite(base_value) and math.isfinite(cand_value)):
        runs = [role for role, value in (("baseline", base_value), ("candidate", cand_value)) if not math.isfinite(value)]
        cause = (
            f"the {' and the '.join(runs)} {'runs' if len(runs) > 1 else 'run'} logged a {first.metric} that is "
            "not a number (NaN or inf): the training blew up there (learning rate too high, fp16 overflow "
            "without loss scaling, bad data). A run that is not finite matches nothing, not even another "
            "such run: fix it and compare again"
        )
    elif first.metric == "samples_seen":
        cause = (
            "the runs consumed a different number of samples by this step: a batch skipped or "
            "repeated (data position not restored exactly on resume, a changed micro-batch or "
            "accumulation), or a different global batch"
        )
    elif first.metric == "lr":
        ratio = cand_value / base_value if base_value else math.inf
        cause = (
            f"the learning rate itself differs (candidate / baseline = {ratio:.4g}): a different "
            "schedule or peak learning rate. After the global batch changed (another GPU count, "
            "micro-batch or accumulation), check that the learning rate was rescaled with it"
        )
        if resumed_before:
            cause += f"; it starts right after the resume from step {resumed_before[-1]}: the LR scheduler state was not restored"
    elif first.metric == "eval_loss":
        cause = (
            "training agrees but evaluation differs: a different evaluation set or split across "
            "ranks, eval batches padded or dropped differently, or dropout left on during evaluation"
        )
    elif resumed_before:
        resume = resumed_before[-1]
        cause = (
            f"it starts right after the resume from the checkpoint of step {resume}: state that "
            "was not restored. Optimizer state lost (Adam moments restart: the loss differs from "
            f"step {resume + 2}), LR scheduler state (the lr column differs from step {resume + 1}), "
            "RNG state (dropout masks, data shuffling) or data position"
        )
    elif step == 1 and first.metric == "loss":
        cause = (
            "the forward pass differs before any update: different initial weights (seed, init, "
            "weights loaded on one rank only), a different batch at step 1, or a precision policy "
            "that changes the forward (parameter dtype, norms or embeddings kept in another "
            "precision, autocast) or wrapping that changes the computation"
        )
    elif step == 1:
        cause = (
            "same forward pass, different gradients at the first step: the gradient reduction "
            "differs. A reduce dtype lower than the baseline's, parameters left out of gradient "
            "synchronisation (FSDP ignored modules: each rank keeps its own gradient), or a loss "
            "scaled differently across gradient accumulation or ranks"
        )
    elif step <= EARLY_STEPS:
        cause = (
            "it starts in the first updates, so every update differs a little: the reduce dtype "
            "or precision policy, parameters not gradient-synchronised, or an optimizer setting "
            "(learning rate, weight-decay groups, epsilon, betas, gradient clipping)"
        )
    else:
        earlier = first.deviations[:index]
        before = max(earlier, default=0.0)
        if before > 0.0 and before >= first.tolerance / 100:
            cause = (
                f"a gradual drift (already {before:.2g} before step {step}, growing): round-off "
                "accumulated from a different reduction order or non-deterministic kernels "
                "(communication order, mesh shape, atomics). If the runs use bf16, the tolerance "
                "may be tight for this many steps: check docs/convergence.md before blaming the run"
            )
        else:
            cause = (
                f"a jump at step {step} after {index} agreeing steps: something happened at that "
                "step. A resume without state, a batch skipped or repeated, a schedule boundary "
                "(end of warm-up), or a loss spike that the two runs handle differently"
            )
    hint = f"{where}: {cause}."
    lr = comparison.metric("lr")
    if first.metric != "lr" and lr is not None and lr.first_divergent_step is not None:
        hint += f" Note: the learning rate also differs, from step {lr.first_divergent_step}."
    return hint
