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

Pure functions. Loading a run folder (:func:`load_run`) is in :mod:`fsdp_presets.compare.records`,
the tolerances and their measurements in :mod:`fsdp_presets.compare.tolerance`; both are
re-exported here. The text summary, the Markdown report and the overlay plot are in
:mod:`fsdp_presets.compare.report`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

from fsdp_presets.compare.records import RunRecord, check_comparable
from fsdp_presets.compare.tolerance import (FP32_GRAD_NORM_WHEN_LOSSES_IDENTICAL, LR_RELATIVE_TOLERANCE,
                                            Tolerance, auto_tolerance, relative_deviation)
from fsdp_presets.errors import UsageError

# Compared series, in the order that breaks ties at the same step: the data decides what the
# forward sees, the forward comes before the backward, the backward before the update.
METRIC_ORDER: tuple[str, ...] = ("samples_seen", "loss", "grad_norm", "lr", "eval_loss")

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
# Comparison
# ---------------------------------------------------------------------------------------------


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
    if all(deviation <= chosen.grad_norm for deviation in norm.deviations):
        return metrics  # within the strict bound: nothing to loosen, nothing to say
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
