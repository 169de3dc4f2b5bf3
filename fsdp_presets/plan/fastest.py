"""The fastest configuration that fits: strategy (FSDP/HSDP, or on a TP/EP mesh planned beside),
micro-batch and activation checkpointing, for the same sequences per data-parallel rank per optimizer
step (``micro_batch x grad_accum`` of the shape asked for). Fastest is the most tokens per second per
GPU, as the planner ranks its rows: a TP group's GPUs share one micro-batch, so a mesh's step is not
comparable with another's by its seconds alone (and its global batch is ``tp_size`` times smaller;
as much more accumulation keeps the batch at about the same tokens per second).

    found = fastest(profile, hardware, shape, meshes)   # a Fastest, or None when nothing fits
    found.row, found.shape, found.reason
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_presets.model.model_profile import ModelProfile
from fsdp_presets.plan.planner import plan
from fsdp_presets.plan.results import StrategyPlan
from fsdp_presets.plan.shapes import Hardware, TrainingShape
from fsdp_presets.plan.step_time import clearly_faster
from fsdp_presets.rehearse.mesh import Mesh

MAX_CANDIDATE_MICRO_BATCHES = 24
"""Micro-batches tried at most (the divisors of the sequences per GPU nearest the one asked for)."""


@dataclass(frozen=True, kw_only=True)
class Fastest:
    row: StrategyPlan
    """The strategy row, planned at ``shape``."""
    shape: TrainingShape
    """The micro-batch, accumulation and activation checkpointing it runs with."""
    asked: StrategyPlan | None
    """The fastest row that fits at the shape as asked (None: nothing fits as asked)."""
    reason: str
    """Why, in one sentence."""

    def to_json(self) -> dict:
        return {"name": self.row.name, "fsdp_version": self.row.fsdp_version, "micro_batch": self.shape.micro_batch,
                "grad_accum": self.shape.grad_accum, "activation_checkpointing": self.shape.activation_checkpointing,
                **self.row.time.to_json(), "reason": self.reason}


def _micro_batches(sequences: int, asked: int) -> list[int]:
    divisors = [d for d in range(1, sequences + 1) if sequences % d == 0] if sequences <= 4096 else [asked]
    return sorted(divisors, key=lambda d: abs(d - asked))[:MAX_CANDIDATE_MICRO_BATCHES]


def seconds_per_token(row: StrategyPlan) -> float:
    """Seconds per training token per GPU: what makes two rows' speeds comparable across meshes,
    micro-batches and GPU counts."""
    return 1 / row.time.tokens_per_s_per_gpu


def fastest(profile: ModelProfile, hardware: Hardware, shape: TrainingShape,
            meshes: tuple[Mesh, ...] = ()) -> Fastest | None:
    """The configuration with the most tokens per second per GPU among the strategies (on
    ``meshes`` too, as :func:`~fsdp_presets.plan.planner.plan` plans them), micro-batches and
    activation-checkpointing settings that fit (offload as asked); None when nothing fits or the
    GPU type is not known."""
    if hardware.gpu is None:
        return None
    sequences = shape.micro_batch * shape.grad_accum
    asked = plan(profile, hardware, shape, meshes).recommended
    best: tuple[StrategyPlan, TrainingShape] | None = (asked, shape) if asked is not None else None
    for micro in _micro_batches(sequences, shape.micro_batch):
        for checkpointing in (False, True):
            candidate = shape.replace(micro_batch=micro, grad_accum=sequences // micro,
                                      activation_checkpointing=checkpointing)
            row = plan(profile, hardware, candidate, meshes).recommended
            if row is not None and (best is None or clearly_faster(seconds_per_token(row),
                                                                   seconds_per_token(best[0]))):
                best = (row, candidate)
    if best is None:
        return None
    row, chosen = best
    return Fastest(row=row, shape=chosen, asked=asked, reason=_reason(row, chosen, asked, shape))


def _settings(shape: TrainingShape) -> str:
    accumulation = f" x {shape.grad_accum} accumulation" if shape.grad_accum > 1 else ""
    return (f"micro-batch {shape.micro_batch}{accumulation}, activation checkpointing "
            f"{'on' if shape.activation_checkpointing else 'off'}")


def _reason(row: StrategyPlan, chosen: TrainingShape, asked: StrategyPlan | None, asked_shape: TrainingShape) -> str:
    head = (f"{row.label} at {_settings(chosen)}: {row.time.step_s:.3g} s per step, "
            f"{row.time.tokens_per_s_per_gpu:,.0f} tokens/s per GPU")
    if asked is None:
        return head + f"; nothing fits at {_settings(asked_shape)}"
    if chosen == asked_shape:
        return head + ": the settings asked for are the fastest that fit"
    why = []
    fewer_tp = row.tp_size < asked.tp_size
    if chosen.activation_checkpointing != asked_shape.activation_checkpointing:
        if not chosen.activation_checkpointing:
            why.append("no recomputation of the forward")
        elif chosen.micro_batch > asked_shape.micro_batch:
            why.append("checkpointing frees memory for a larger micro-batch")
        else:
            why.append(f"checkpointing frees the memory {row.label} needs")
    if chosen.micro_batch > asked_shape.micro_batch:
        why.append("fewer, larger micro-batches re-gather the parameters less often")
    elif chosen.micro_batch < asked_shape.micro_batch:
        why.append("a smaller micro-batch fits without recomputation")
    if fewer_tp:
        why.append(f"each of {asked.label}'s TP groups of {asked.tp_size} GPUs computes one micro-batch")
    return (head + f", {seconds_per_token(asked) / seconds_per_token(row):.2f}x the tokens/s of {asked.label} at "
            f"{_settings(asked_shape)} ({'; '.join(why) or 'less exposed communication'})")
