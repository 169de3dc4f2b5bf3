"""Loss and throughput plots of run folders (PNG, matplotlib's Agg backend: no display needed)."""

from __future__ import annotations

import os
from pathlib import Path

from fsdp_presets.checkpoint.layout import LOSS_PLOT, METRICS, PLOTS, THROUGHPUT_PLOT
from fsdp_presets.fileio import atomic_path
from fsdp_presets.train.metrics import read_metrics


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


def plot_runs(runs: dict[str, str | os.PathLike], output_dir: str | os.PathLike) -> list[Path]:
    """``loss.png`` (train loss per step, evaluation loss as markers) and ``throughput.png``
    (tokens per second per step) of one or more runs, labelled by the dict keys."""
    pyplot = _pyplot()
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    records = {label: read_metrics(Path(run) / METRICS) for label, run in runs.items()}

    def draw_loss(axes, label, train, evals):
        drawn = axes.plot([line["step"] for line in train], [line["loss"] for line in train],
                          label=f"{label} train", linewidth=1.4)
        if evals:
            axes.plot([line["step"] for line in evals], [line["eval_loss"] for line in evals], "o--",
                      color=drawn[0].get_color() if drawn else None, label=f"{label} eval", markersize=5)

    def draw_throughput(axes, label, train, evals):
        axes.plot([line["step"] for line in train], [line["tokens_per_s"] for line in train], label=label)

    loss_png = _plot(pyplot, records, draw_loss, output_dir / LOSS_PLOT, ylabel="loss (cross-entropy)", title="Loss")
    throughput_png = _plot(pyplot, records, draw_throughput, output_dir / THROUGHPUT_PLOT,
                           ylabel="tokens / s (all ranks)", title="Throughput")
    return [loss_png, throughput_png]


def _plot(pyplot, records: dict[str, list[dict]], draw, path: Path, *, ylabel: str, title: str) -> Path:
    """One figure over optimizer steps: ``draw(axes, label, train_lines, eval_lines)`` per run."""
    figure, axes = pyplot.subplots(figsize=(7, 4.2))
    for label, lines in records.items():
        draw(axes, label, [line for line in lines if line.get("kind") == "train"],
             [line for line in lines if line.get("kind") == "eval"])
    axes.set(xlabel="optimizer step", ylabel=ylabel, title=title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    try:
        with atomic_path(path, suffix=path.suffix) as temporary:  # never half an image
            figure.savefig(temporary, dpi=110, format=path.suffix.lstrip(".") or None)
    finally:
        pyplot.close(figure)
    return path


def plot_run(run_dir: str | os.PathLike) -> list[Path]:
    """The plots of one run, into ``RUN/plots/``."""
    return plot_runs({Path(run_dir).name: run_dir}, Path(run_dir) / PLOTS)
