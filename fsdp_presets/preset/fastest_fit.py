"""Which configuration a GPU preset runs when several fit: the one with the shortest optimizer step
predicted on the request's GPU type (``--gpu``, else :data:`~fsdp_presets.plan.gpus.DEFAULT_GPU`;
:mod:`fsdp_presets.plan.step_time`, the figure the preset's header prints), and each decision's
reason with the numbers::

    chosen = fastest_candidate(fitting)             # fitting: Candidates in the default order
    strategy_comparison(chosen, fitting)            # "SHARD_GRAD_OP 8: predicted 2.9 s per optimizer
                                                    #  step on H100-SXM against FULL_SHARD 8's 3.1 s ...; both fit"

Candidates are the strategies, activation-checkpointing settings and gradient reductions that fit,
each at the largest micro-batch it allows (:func:`fsdp_presets.preset.presets.decide` makes them).
Steps less than :data:`~fsdp_presets.plan.step_time.MODEL_ERROR` apart are a tie, which the default
order decides (the simpler strategy, no memory saver). Across nodes the slower of two predictions
decides, at the GPU type's network and at :data:`SLOW_NETWORK_SHARE` of it. CPU presets and TP/EP
meshes do not come here: a CPU host's speed is measured, not predicted, and a mesh is what was asked
for.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_presets.plan.results import MemoryPlan, StrategyPlan
from fsdp_presets.plan.shapes import TrainingShape
from fsdp_presets.plan.step_time import clearly_faster

__all__ = ["HEADROOM", "SLOW_NETWORK_SHARE", "Candidate", "checkpointing_comparison", "fastest_candidate", "reduction_comparison",
           "strategy_comparison"]

SLOW_NETWORK_SHARE = 0.5
"""Across nodes a choice must hold on a network half as fast as the one predicted on too. The GPU
type's network is the best case (one 400 Gb/s NDR adapter per GPU, as in an NVIDIA DGX H100, see
:mod:`fsdp_presets.plan.gpus`) and a preset does not know the cluster's: FULL_SHARD across 4 nodes of
Llama 3.1 8B at micro-batch 2 is predicted 1.3% faster than HSDP 4x8 at micro-batch 1 there, and
1.8% slower at half of it. ``generate --inter-node-gbps`` gives the cluster's: then that network alone
decides."""


HEADROOM = 0.95
"""A configuration planned above this share of the usable memory is chosen for its speed only when
none below it fits: the planner is within about 1% of a rehearsal, but the allocator's fragmentation
over a long run is not in either, and a few percent of step time are not worth an out-of-memory stop."""


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One configuration that fits, at the micro-batch it would run."""

    name: str
    """Sharding strategy (FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, NO_SHARD)."""
    shape: TrainingShape
    """Micro-batch, accumulation, activation checkpointing, offload and reduction as it would run."""
    memory_plan: MemoryPlan
    """The planner's table at ``shape``."""
    row: StrategyPlan
    """The strategy's row of ``memory_plan``."""
    gpu: str = ""
    """The GPU type ``step_s`` is predicted on."""
    step_s: float | None = None
    """Seconds per optimizer step predicted on ``gpu``; None where not predicted (CPU)."""
    slow_network_s: float | None = None
    """The same at :data:`SLOW_NETWORK_SHARE` of its network between nodes; None on one node."""

    @property
    def memory_share(self) -> float:
        """The planned peak per GPU as a share of the usable memory."""
        return self.row.per_gpu.total / self.memory_plan.hardware.usable_bytes

    @property
    def roomy(self) -> bool:
        """Planned within :data:`HEADROOM` of the usable memory."""
        return self.memory_share <= HEADROOM

    @property
    def deciding_s(self) -> float:
        """The step the choice compares: the slower of the two predictions."""
        return max(self.step_s, self.slow_network_s or 0.0)

    @property
    def predicted(self) -> str:
        """``4.33 s`` or, across nodes, ``4.33 s (4.36 s at half the network)``."""
        if self.slow_network_s is None:
            return f"{self.step_s:.3g} s"
        return f"{self.step_s:.3g} s ({self.slow_network_s:.3g} s at {SLOW_NETWORK_SHARE:.0%} of its network)"

    @property
    def settings(self) -> str:
        """``micro-batch 2 x 16, activation checkpointing on``: what else it runs with."""
        accumulation = f" x {self.shape.grad_accum}" if self.shape.grad_accum > 1 else ""
        reduce = ", reduced every micro-batch" if self.shape.reduce_every_micro_batch else ""
        return (f"micro-batch {self.shape.micro_batch}{accumulation}, activation checkpointing "
                f"{'on' if self.shape.activation_checkpointing else 'off'}{reduce}")


def fastest_candidate(candidates: list[Candidate]) -> Candidate:
    """The candidate with the shortest predicted step among those within :data:`HEADROOM` of the
    memory (all, when none is); of those within the model's error of it, the first in the default
    order (a tie is no reason to leave the simpler configuration)."""
    roomy = [candidate for candidate in candidates if candidate.roomy] or candidates
    best_s = min(candidate.deciding_s for candidate in roomy)
    return next(candidate for candidate in roomy if not clearly_faster(best_s, candidate.deciding_s))


def _best_of(candidates: list[Candidate]) -> Candidate | None:
    return fastest_candidate(candidates) if candidates else None


def _against(chosen: Candidate, other: Candidate) -> str:
    """``2.9 s per optimizer step on H100-SXM against FULL_SHARD 8's 3.1 s (micro-batch ...)``, with a
    note when the other is as fast within the model's error."""
    text = f"{chosen.predicted} per optimizer step on {chosen.gpu} against {other.row.label}'s {other.predicted}"
    text += f" at {other.settings}"
    if clearly_faster(other.deciding_s, chosen.deciding_s) and not other.roomy:
        text += (f", which is planned at {other.memory_share:.0%} of the usable memory (above {HEADROOM:.0%}: "
                 "no room for the allocator's fragmentation)")
    elif not clearly_faster(chosen.deciding_s, other.deciding_s):
        text += ": a tie within the model's 1%, which the default order decides"
    return text


def strategy_comparison(chosen: Candidate, candidates: list[Candidate], considered: list[str]) -> str:
    """Why ``chosen``'s strategy: its predicted step against the fastest fitting configuration of
    each other strategy, or, when none of the others of ``considered`` fits, that they do not."""
    others = [best for name in considered if name != chosen.name
              if (best := _best_of([c for c in candidates if c.name == name])) is not None]
    head = f"{chosen.row.label} at {chosen.settings}: predicted "
    if not others:
        missing = [name for name in considered if name != chosen.name]
        text = f"{head}{chosen.predicted} per optimizer step on {chosen.gpu}"
        if missing:
            text += (f"; the only strategy that fits ({' and '.join(missing)} "
                     f"{'does' if len(missing) == 1 else 'do'} not, even with the memory savers allowed)")
        return text
    text = head + "; ".join(_against(chosen, other) for other in others)
    text += "; both fit" if len(others) == 1 else "; all fit"
    if chosen.slow_network_s is not None:
        text += "; across nodes the slower of the two predictions decides"
    return text


def checkpointing_comparison(chosen: Candidate, candidates: list[Candidate]) -> str | None:
    """Why activation checkpointing is on or off when the other setting fits too (same strategy and
    offload): the two predicted steps. None when only one setting fits (the memory says why)."""
    on = chosen.shape.activation_checkpointing
    other = _best_of([c for c in candidates if c.name == chosen.name and c.shape.offload == chosen.shape.offload
                      and c.shape.activation_checkpointing != on])
    if other is None:
        return None
    why = ("recomputing each block in backward costs about a third more compute, which the larger micro-batch it "
           "allows outweighs" if on else "no recomputation")
    return (f"activation checkpointing {'on' if on else 'off'} (auto): predicted {chosen.predicted} per optimizer "
            f"step at micro-batch {chosen.shape.micro_batch} against {other.predicted} "
            f"{'without' if on else 'with'} it at micro-batch {other.shape.micro_batch}; both fit; {why}")


def reduction_comparison(chosen: Candidate, candidates: list[Candidate]) -> str | None:
    """The predicted step of the other way to reduce accumulated gradients (every micro-batch, or
    once under no_sync) when it fits too with the same strategy and savers; None when it does not."""
    shape = chosen.shape
    other = _best_of([c for c in candidates if c.name == chosen.name and c.shape.grad_accum > 1
                      and (c.shape.activation_checkpointing, c.shape.offload) == (shape.activation_checkpointing,
                                                                                   shape.offload)
                      and c.shape.reduce_every_micro_batch != shape.reduce_every_micro_batch])
    if other is None or shape.grad_accum == 1:
        return None
    how = "accumulating under no_sync" if shape.reduce_every_micro_batch else "reducing every micro-batch"
    return (f"predicted {chosen.predicted} per optimizer step against {other.predicted} {how} "
            f"(micro-batch {other.shape.micro_batch}); both fit")
