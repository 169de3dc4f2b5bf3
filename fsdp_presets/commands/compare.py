"""``fsdp-presets compare BASELINE_RUN CANDIDATE_RUN``: does the candidate train like the baseline?

Exit 0 when the runs agree (identical or within tolerance), 1 when they diverge, 2 on bad input.
"""

from __future__ import annotations

import argparse

HELP = "compare two runs step by step (e.g. FSDP against its DDP baseline): exit 0 agree, 1 diverge"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("baseline", metavar="BASELINE_RUN",
                        help="reference run: a run folder (run.json + metrics.jsonl) or a metrics.jsonl file")
    parser.add_argument("candidate", metavar="CANDIDATE_RUN", help="run under test, same forms")
    from fsdp_presets import arguments

    arguments.add_tolerance(parser)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="write the overlay plot (loss and deviation)")
    parser.add_argument("--report", metavar="FILE.md", help="write a Markdown report with the verdict table")


def run(args: argparse.Namespace) -> int:
    import json

    from fsdp_presets.compare.records import load_pair
    from fsdp_presets.compare.report import summary_lines, write_plot, write_report
    from fsdp_presets.compare.runs import compare_runs
    from fsdp_presets.compare.tolerance import parse_tolerance
    from fsdp_presets.errors import UsageError

    tolerance = parse_tolerance(args.tolerance)
    for option, path, suffix in (("--plot", args.plot, ".png"), ("--report", args.report, ".md")):
        if path is not None and not path.lower().endswith(suffix):
            raise UsageError(f"{option} needs a {suffix} file name (got {path!r})")
    baseline, candidate = load_pair(args.baseline, args.candidate)
    comparison = compare_runs(baseline, candidate, tolerance)
    if args.plot:
        write_plot(comparison, args.plot)
    if args.report:
        write_report(comparison, args.report, plot_path=args.plot)
    if args.json:
        result = comparison.to_json()
        result["plot"], result["report"] = args.plot, args.report
        print(json.dumps(result, indent=2))
    else:
        print("\n".join(summary_lines(comparison)))
        for label, path in (("plot", args.plot), ("report", args.report)):
            if path:
                print(f"{label}: {path}")
    return 0 if comparison.agrees else 1
