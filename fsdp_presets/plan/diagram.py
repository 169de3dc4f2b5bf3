"""The picture of a :class:`~fsdp_presets.plan.planner.MemoryPlan` (``fsdp-presets plan --diagram``).

Left: per-GPU memory of each strategy, stacked by category, against the GPU's memory.
Right: how the FSDP units are split across the ranks of one shard group for the recommended
FSDP strategy (FULL_SHARD on FSDP2 when the recommendation is not a sharded one).
"""

from __future__ import annotations

from fsdp_presets.fileio import GiB, byte_unit
from fsdp_presets.plan.results import MemoryPlan, StrategyPlan
from fsdp_presets.plan.model_state import fsdp_units, shard_numel
from fsdp_presets.model.model_profile import ModelProfile

CATEGORIES = ("params", "grads", "optimizer", "activations", "buffers")
COLORS = {
    "params": "#4C72B0",
    "grads": "#DD8452",
    "optimizer": "#55A868",
    "activations": "#C44E52",
    "buffers": "#8172B3",
}
MAX_RANKS_DRAWN = 16
"""Shard groups larger than this are drawn as their first ranks and one "..." segment."""


def _count(params: int) -> str:
    """``855.7 M``, ``9.3 K``: parameters at a glance."""
    for size, suffix in ((10**9, "B"), (10**6, "M"), (10**3, "K")):
        if params >= size:
            return f"{params / size:.2f} {suffix}"
    return str(params)


def _sharded_strategy(memory_plan: MemoryPlan) -> StrategyPlan:
    recommended = memory_plan.recommended
    if recommended is not None and recommended.name in ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"):
        return recommended
    return memory_plan.get("FULL_SHARD", 2)


def draw_plan(memory_plan: MemoryPlan, profile: ModelProfile, path: str) -> None:
    """Write the two-panel diagram to ``path`` (format from its suffix; its folder is made)."""
    from pathlib import Path

    import matplotlib

    from fsdp_presets.fileio import atomic_path

    matplotlib.use("Agg")  # no display needed (servers, CI)
    import matplotlib.pyplot as plt

    figure, (memory_axes, split_axes) = plt.subplots(
        1, 2, figsize=(15, 6.5), gridspec_kw={"width_ratios": [1.1, 1]}
    )
    _draw_memory(memory_axes, memory_plan)
    _draw_split(split_axes, memory_plan, profile)
    figure.suptitle(
        f"{profile.architecture}, {_count(profile.total_params)} parameters: "
        f"{memory_plan.hardware.gpus} GPUs x {memory_plan.hardware.gpu_memory_bytes / GiB:g} GiB, "
        f"seq {memory_plan.shape.seq_len}, micro-batch {memory_plan.shape.micro_batch}, "
        f"{memory_plan.shape.precision}, {memory_plan.shape.optimizer}"
    )
    figure.tight_layout()
    try:
        with atomic_path(path, suffix=Path(path).suffix) as temporary:  # never half an image
            figure.savefig(temporary, dpi=110, format=Path(path).suffix.lstrip(".") or None)
    finally:
        plt.close(figure)


def _draw_memory(axes, memory_plan: MemoryPlan) -> None:
    hardware = memory_plan.hardware
    largest = max(s.per_gpu.total for s in memory_plan.strategies)
    # Bars far below the GPU's memory (tiny models) are drawn at their own scale.
    zoomed = largest < 0.05 * hardware.gpu_memory_bytes
    unit_name, unit = byte_unit(largest) if zoomed else ("GiB", GiB)
    labels = [s.label + (" *" if s is memory_plan.recommended else "") for s in memory_plan.strategies]
    positions = range(len(labels))
    bottoms = [0.0] * len(labels)
    for category in CATEGORIES:
        heights = [getattr(s.per_gpu, category) / unit for s in memory_plan.strategies]
        axes.bar(positions, heights, bottom=bottoms, color=COLORS[category], label=category)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    if zoomed:
        axes.set_ylim(0, max(bottoms) * 1.3)
        axes.text(0.02, 0.97, f"GPU memory {hardware.gpu_memory_bytes / GiB:g} GiB: off this scale",
                  transform=axes.transAxes, va="top", fontsize=8)
    else:
        axes.axhline(hardware.gpu_memory_bytes / GiB, color="black", linewidth=1.2, label="GPU memory")
        axes.axhline(hardware.usable_bytes / GiB, color="black", linestyle="--", linewidth=0.8, label="usable")
        # Keep the GPU line in view even when one strategy is many times larger.
        axes.set_ylim(0, max(max(bottoms), hardware.gpu_memory_bytes / GiB) * 1.15)
    for position, strategy, top in zip(positions, memory_plan.strategies, bottoms):
        axes.text(position, top, f"{top:.1f}\nmax mb {strategy.max_micro_batch}", ha="center", va="bottom", fontsize=7)
    axes.set_xticks(list(positions), labels, rotation=35, ha="right", fontsize=8)
    axes.set_ylabel(f"{unit_name} per GPU (peak)")
    axes.set_title("per-GPU memory by strategy (* recommended)")
    axes.legend(fontsize=8, loc="upper right")


def _draw_split(axes, memory_plan: MemoryPlan, profile: ModelProfile) -> None:
    import matplotlib.pyplot as plt

    strategy = _sharded_strategy(memory_plan)
    ranks = strategy.shard_world_size
    drawn = min(ranks, MAX_RANKS_DRAWN)
    colormap = plt.get_cmap("tab20")
    units = fsdp_units(profile, strategy.fsdp_version)
    largest = max((unit.params for unit in units), default=1) or 1
    for row, unit in enumerate(units):
        each = shard_numel(unit.params, ranks)
        width = unit.params / largest
        segment = width / ranks
        for rank in range(drawn):
            axes.barh(
                row,
                segment,
                left=rank * segment,
                color=colormap(rank % 20),
                edgecolor="white",
                linewidth=0.5,
                hatch=None if unit.reshards_after_forward else "//",
            )
        if drawn < ranks:
            axes.barh(row, width - drawn * segment, left=drawn * segment, color="lightgrey", edgecolor="white")
        axes.text(
            width + 0.01,
            row,
            f"{_count(unit.params)} -> {_count(each)} per rank",
            va="center",
            fontsize=7,
        )
    axes.set_yticks(range(len(units)), [f"{unit.name} x{unit.count}" if unit.count > 1 else unit.name for unit in units], fontsize=8)
    axes.invert_yaxis()
    axes.set_xlim(0, 1.75)
    axes.set_xticks([])
    group = f"{ranks} ranks"
    if strategy.replicate_world_size > 1:
        group += f" of a node (x{strategy.replicate_world_size} replicas, one per node)"
    shown = f"; first {drawn} drawn" if drawn < ranks else ""
    axes.set_title(f"{strategy.label}: each unit split across {group}{shown}\n"
                   "(colour = rank; width = unit size; hatched = kept unsharded forward to backward)", fontsize=9)
