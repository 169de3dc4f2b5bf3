"""How far two correct runs may drift apart: the measured fp32 and bf16 tolerances, the
:class:`Tolerance` a comparison uses, ``--tolerance`` parsing and the relative deviation itself."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fsdp_presets.compare.records import RunRecord, is_number
from fsdp_presets.errors import UsageError

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
# - a TP/EP mesh (--distributed-config, tests/test_mesh_training.py: tiny Llama FSDP 2 x TP 2 and
#   tiny Mixtral FSDP 2 x EP 2 against DDP, 20 steps): loss at most 1.2e-7 relative, grad_norm
#   1.8e-7 (tensor and expert parallelism sum in another order), so the same tolerance holds them
#   by a factor of 8 and 50; the faults planted there (a TP rank that drops its all-reduce, TP
#   ranks fed different samples, experts changed after loading) move a metric by 5e-3 or more at
#   step 0 or 1. The loss counted tp_size times leaves every loss within 5e-8 (AdamW and clipping
#   do not see a gradient's scale) and doubles the gradient norm: the norm catches it at step 1.
FP32_RELATIVE_TOLERANCE = {"loss": 1e-6, "grad_norm": 1e-5}
FP32_EPSILON = 2.0 ** -23

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
            if not (is_number(value) and math.isfinite(value) and value >= 0)
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
    averaged = max(run.averaged_steps or 0 for run in (baseline, candidate))
    return Tolerance(
        # Trainer's log: the window's losses summed in a float32 tensor, each addition rounding once.
        loss=FP32_RELATIVE_TOLERANCE["loss"] + averaged * FP32_EPSILON,
        grad_norm=FP32_RELATIVE_TOLERANCE["grad_norm"],
        source=(
            "auto for fp32: loss 1e-6 relative (about 8 ulp of fp32, epsilon 1.19e-7), grad_norm 1e-5 "
            "(its sharded computation rounds differently)"
            + (" (a run's precision is unknown: fp32 assumed; pass --tolerance for a bf16 run)" if unknown else "")
            + (f"; loss read from Trainer's log, averaged over logging_steps={averaged} steps in a float32 sum: "
               f"{averaged} x 1.19e-7 added for that sum's rounding" if averaged else "")
        ),
    )


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
