"""Is it still the same training: ``records`` loads two run folders, ``tolerance`` says how far
two correct runs may drift apart, ``runs`` compares them step by step, ``report`` writes the table
and the plot."""

from fsdp_presets.compare.records import RunRecord, check_comparable, checkpoint_step, load_pair, load_run
from fsdp_presets.compare.report import render_report, short_label, summary_lines, write_plot, write_report
from fsdp_presets.compare.runs import EARLY_STEPS, Comparison, MetricComparison, compare_runs, diagnose
from fsdp_presets.compare.tolerance import (BF16_RELATIVE_TOLERANCE, FP32_RELATIVE_TOLERANCE, Tolerance,
                                            auto_tolerance, parse_tolerance, relative_deviation)

__all__ = ["BF16_RELATIVE_TOLERANCE", "EARLY_STEPS", "FP32_RELATIVE_TOLERANCE", "Comparison", "MetricComparison", "RunRecord", "Tolerance", "auto_tolerance",
           "check_comparable", "checkpoint_step", "compare_runs", "diagnose", "load_pair", "load_run", "parse_tolerance",
           "relative_deviation", "render_report", "short_label", "summary_lines", "write_plot", "write_report"]
