"""The planner's FULL_SHARD FSDP2 per-GPU total against a full rehearsal of the same model, over a
grid: each published config in fsdp_harness/published_configs.py at 8 and 64 GPUs, micro-batch 1
and 2, accumulation 1 and 4, activation checkpointing off and on (fsdp_harness/planner_grid.py).
``--record`` rehearses every point (one process, one rehearsal at a time) and records them with the
short rehearsal the planner composes from in tests/data/planner_grid.json; without it the script
composes the planner from the recorded table (seconds). Prints one line per point (planned,
rehearsed, difference, the fit verdicts) and the largest difference; exits 1 when a point is off by
10% or more or its verdict differs::

    nice -n 5 python scripts/planner_accuracy.py --record tests/data/planner_grid.json   # ~30 min, 2 cores
    python scripts/planner_accuracy.py --doc docs/benchmarks.md     # the section, from the table

``--doc`` writes the table and its settings into that file's ``planner-accuracy`` section.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile


def main(argv: list[str] | None = None) -> int:
    from fsdp_harness import planner_grid
    from fsdp_harness.published_configs import FAMILIES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", metavar="TABLE", help="rehearse every point and record it in this file")
    parser.add_argument("--table", default=str(planner_grid.TABLE), help="the recorded table to compare with")
    parser.add_argument("--families", nargs="+", default=sorted(FAMILIES), choices=sorted(FAMILIES))
    parser.add_argument("--layers", type=int, default=4, help="blocks (the planner composes per block)")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--gpu-memory", type=float, default=24, help="GiB of one GPU, for the verdicts")
    parser.add_argument("--doc", help="write the table into this markdown file's planner-accuracy section")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="planner-accuracy-") as folder:
        os.environ["FSDP_PRESETS_CACHE"] = os.path.join(folder, "cache")  # never the user's cache
        table_path = args.record or args.table
        table = planner_grid.load(table_path)
        if args.record:
            for family in args.families:
                record, points = planner_grid.rehearse_family(folder, family, layers=args.layers, seq_len=args.seq_len,
                                                              gpu_memory_gib=args.gpu_memory,
                                                              log=lambda line: print(line, flush=True))
                table = planner_grid.save(table_path, table, family, record, points)
        lines, worst, failed = planner_grid.compare(table, folder)
    lines.append(f"largest difference {worst:.2%}; {len(failed)} point(s) off by 10% or more or with another verdict")
    print("\n".join(lines))
    if args.doc:
        from fsdp_harness import doc_sections

        doc_sections.replace_in_file(args.doc, SECTION, doc_sections.wrap(SECTION, render(table, lines)))
    return 1 if failed else 0


SECTION = "planner-accuracy"


def render(table: dict, lines: list[str]) -> str:
    """The section: what was compared, how it was run, the table."""
    from fsdp_presets.fileio import GiB

    points, families = table["points"], table["families"]
    first = points[0]
    minutes = (sum(point["seconds"] for point in points) + sum(record["seconds"] for record in families.values())) / 60
    refused = sum(not point["fits"] for point in points)
    return "\n".join([
        "## Planner accuracy: composed from a short rehearsal vs a full one", "",
        "The planner's FULL_SHARD FSDP2 per-GPU total, its activation terms read off a short cached rehearsal of "
        "the model's own config (`fsdp_presets/preset/measured_activations.py`), against a full rehearsal of the "
        "same config (`fsdp-presets rehearse`), for published configs of families the planner keeps no constants "
        f"for (`harness/fsdp_harness/published_configs.py`, cut to {first['layers']} blocks at sequence length "
        f"{first['seq_len']}: the planner composes per block), over 8 and 64 GPUs, micro-batch 1 and 2, "
        f"accumulation 1 and 4, activation checkpointing off and on: {len(families)} families, {len(points)} "
        f"points. Verdicts on a {first['gpu_memory_bytes'] / GiB:g} GiB GPU less the planner's reserve "
        f"({refused} points do not fit). The rehearsals are recorded in `tests/data/planner_grid.json` "
        f"(torch {first['torch']}, transformers {first['transformers']}, {minutes:.0f} minutes of rehearsal); "
        "`tests/test_planner_grid.py` holds the planner to every point and this section to the table, and the "
        "live rehearsals of `tests/test_planner_rehearsed.py` hold the table to a rehearsal. Render it with "
        "`python scripts/planner_accuracy.py --doc docs/benchmarks.md`; record it again with `--record`.", "",
        "```text", *lines, "```"])


if __name__ == "__main__":
    sys.exit(main())
