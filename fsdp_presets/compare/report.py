"""How a :class:`~fsdp_presets.compare.runs.Comparison` is shown: a text summary, a Markdown report
with the verdict table, and an overlay plot (loss of both runs, relative deviation on a log axis,
first divergent step marked). The two writers replace their target atomically."""

from __future__ import annotations

import math
import os
from pathlib import Path

from fsdp_presets.compare.runs import Comparison
from fsdp_presets.compare.records import RunRecord
from fsdp_presets.compare.throughput import throughput_line
from fsdp_presets.fileio import atomic_path

VERDICT_WORDS = {
    "identical": "IDENTICAL: every compared value is bitwise equal",
    "within_tolerance": "AGREE within tolerance",
    "diverged": "DIVERGED",
}


def headline(comparison: Comparison) -> str:
    """``DIVERGED at step 4 (loss)`` / ``AGREE within tolerance`` / ``IDENTICAL: ...``"""
    words = VERDICT_WORDS[comparison.verdict]
    first = comparison.first_divergence
    return words if first is None else f"{words} at step {first.first_divergent_step} ({first.metric})"


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if not math.isfinite(value):
        return str(value)
    return "0" if value == 0 else f"{value:.3g}"


def summary_lines(comparison: Comparison) -> list[str]:
    """The verdict as a few lines of plain text (the CLI's output)."""
    lines = [
        headline(comparison),
        f"baseline:  {comparison.baseline.path} ({short_label(comparison.baseline)})",
        f"candidate: {comparison.candidate.path} ({short_label(comparison.candidate)})",
        f"tolerance: {comparison.tolerance.source}",
    ]
    for metric in comparison.metrics:
        lines.append(
            f"  {metric.metric:<12} {metric.verdict:<16}  {len(metric.steps):>5} steps, "
            f"{metric.identical_steps:>5} identical, max deviation {_fmt(metric.max_deviation)}"
            + (f" at step {metric.max_deviation_step}" if metric.max_deviation_step else "")
            + f", tolerance {_fmt(metric.tolerance)}"
            + (f", first over at step {metric.first_divergent_step}" if metric.first_divergent_step else "")
        )
    if comparison.diagnosis:
        lines.append(f"diagnosis: {comparison.diagnosis}")
    lines.extend(f"throughput: {line}" for record, role in ((comparison.baseline, "baseline"),
                                                            (comparison.candidate, "candidate"))
                 if (line := throughput_line(record, role)))
    lines.extend(f"note: {note}" for note in comparison.notes)
    return lines


def short_label(record: RunRecord) -> str:
    """``FSDP2, reshard_after_forward=True, fp32`` or ``MULTI_CPU, bf16``; the folder name if unknown."""
    described = record.describe()
    precision = {"no": "fp32"}.get(described["precision"], described["precision"])
    parts = [described["fsdp"] or described["distributed_type"], precision]
    if described["world_size"]:
        parts.append(f"{described['world_size']} processes")
    return ", ".join(str(part) for part in parts if part) or record.path.name


def render_report(comparison: Comparison, plot_path: str | os.PathLike | None = None,
                  report_path: str | os.PathLike | None = None) -> str:
    """The Markdown report: verdict, both runs, per-metric table, where it starts, plot, notes."""
    first = comparison.first_divergence
    out = ["# Convergence check", "", f"**Verdict: {headline(comparison)}**", ""]
    out += ["## Runs", "", "| | baseline | candidate |", "|---|---|---|"]
    base, cand = comparison.baseline.describe(), comparison.candidate.describe()
    for key in base:
        out.append(f"| {key} | {_cell(base[key])} | {_cell(cand[key])} |")
    out += ["", "## Step by step", "", f"Tolerance: {comparison.tolerance.source}.", ""]
    out += [
        "| metric | verdict | steps compared | identical steps | max relative deviation | at step | tolerance | first step over |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for metric in comparison.metrics:
        out.append(
            f"| {metric.metric} | {metric.verdict.replace('_', ' ')} | {len(metric.steps)} | "
            f"{metric.identical_steps} | {_fmt(metric.max_deviation)} | {metric.max_deviation_step or '-'} | "
            f"{_fmt(metric.tolerance)} | {metric.first_divergent_step or '-'} |"
        )
    if first is not None:
        index = first.first_divergent_index
        out += ["", "## Where it starts", ""]
        out.append(
            f"At step {first.first_divergent_step}, {first.metric}: baseline "
            f"{first.baseline_values[index]:.9g}, candidate {first.candidate_values[index]:.9g} "
            f"(relative deviation {_fmt(first.deviations[index])}, tolerance {_fmt(first.tolerance)})."
        )
        out += ["", f"Diagnosis: {comparison.diagnosis}"]
    if plot_path is not None:
        target = Path(plot_path)
        if report_path is not None:
            target = Path(os.path.relpath(Path(plot_path).resolve(), Path(report_path).resolve().parent))
        out += ["", "## Overlay", "", f"![loss of both runs and their relative deviation]({target.as_posix()})"]
    if comparison.notes:
        out += ["", "## Notes", ""] + [f"- {note}" for note in comparison.notes]
    return "\n".join(out) + "\n"


def _cell(value: object) -> str:
    return "-" if value is None else str(value).replace("|", "\\|")


def write_report(comparison: Comparison, report_path: str | os.PathLike,
                 plot_path: str | os.PathLike | None = None) -> None:
    text = render_report(comparison, plot_path=plot_path, report_path=report_path)
    with atomic_path(report_path, suffix=Path(report_path).suffix) as temporary:
        temporary.write_text(text)


def write_plot(comparison: Comparison, plot_path: str | os.PathLike) -> None:
    """Loss of both runs (top); relative |difference| per metric on a log axis with the
    tolerances (bottom); the first divergent step marked in both."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, height_ratios=(3, 2))
    for record, role, style in ((comparison.baseline, "baseline", "-"), (comparison.candidate, "candidate", "--")):
        losses = record.series["loss"]
        steps = sorted(losses)
        top.plot(steps, [losses[s] for s in steps], style, label=f"{role}: {short_label(record)}")
    top.set_ylabel("train loss")
    top.set_title(f"Convergence check: {headline(comparison)}", fontsize=11)

    for metric in comparison.metrics:
        points = [(s, d) for s, d in zip(metric.steps, metric.deviations) if d > 0 and math.isfinite(d)]
        if points:
            bottom.plot(*zip(*points), marker=".", label=f"{metric.metric}")
    by_value: dict[float, list[str]] = {}
    for metric in comparison.metrics:
        if metric.metric in ("loss", "grad_norm", "eval_loss") and metric.tolerance > 0:
            by_value.setdefault(metric.tolerance, []).append(metric.metric)
    for (tolerance, names), style in zip(sorted(by_value.items()), (":", "-.", "--")):
        bottom.axhline(tolerance, color="grey", linestyle=style, linewidth=1,
                       label=f"tolerance {tolerance:g} ({', '.join(names)})")
    bottom.set_yscale("log")
    bottom.set_ylabel("relative |difference|")
    bottom.set_xlabel("optimizer step")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    identical = [m.metric for m in comparison.metrics if m.max_deviation == 0.0]
    if identical:
        bottom.text(0.99, 0.97, "bitwise identical at every step (no point on a log axis): " + ", ".join(identical),
                    transform=bottom.transAxes, fontsize=7, ha="right", va="top")
    resumes = {(record.resume_step, role) for record, role in ((comparison.baseline, "baseline"),
                                                                (comparison.candidate, "candidate"))
               if record.resume_step is not None}
    for resume_step, role in sorted(resumes):
        for axis in (top, bottom):
            axis.axvline(resume_step, color="grey", linestyle="--", linewidth=1,
                         label=f"{role} resumed after step {resume_step}" if axis is top else None)
    if comparison.first_divergent_step is not None:
        for axis in (top, bottom):
            axis.axvline(comparison.first_divergent_step, color="red", linewidth=1,
                         label=f"first divergence: step {comparison.first_divergent_step}" if axis is top else None)
    top.legend(fontsize=8)
    if bottom.get_legend_handles_labels()[0]:
        bottom.legend(fontsize=7, loc="upper left")
    figure.tight_layout()
    try:
        with atomic_path(plot_path, suffix=Path(plot_path).suffix) as temporary:
            figure.savefig(temporary, dpi=110, format="png")
    finally:
        plt.close(figure)
