"""Campaign records that add up over several runs: ``scripts/exit_campaign.py`` and
``scripts/preemption_campaign.py`` take ``--merge FILE`` (the repository keeps
``docs/data/exit_campaign.json`` and ``docs/data/preemption_campaign.json``), add the launches or
trials they made to those already in FILE, rewrite it, and render their section of
``docs/benchmarks.md`` from the whole record: the totals, how many runs made them, each run's date,
settings and load averages. A note written into a run by hand (``"note"``) shows in its row;
``python -m fsdp_harness.campaign_record docs/data/exit_campaign.json`` renders the section again.

A record::

    {"campaign": "exit", "settings": {"processes": 2, "fix_off": false},
     "runs": [{"started": "2026-12-04T19:04Z", "load_before": 11.2, "load_after": 11.9, ...}, ...],
     "cells": [{"ending": "none", "strategy": "ddp", "items": [{"ok": true, "run": 0, ...}, ...]}, ...]}

Each item (a launch, a trial) names the run that made it (its index in ``runs``; a record of one
run, as a campaign writes it while it runs, may leave that out). Runs merge only
when their ``settings`` agree (an exit campaign with the exit handler off is another experiment).
A single run's file in the older layout (``launches_asked``/``cells``/``launches``, or
``trials_asked``/``strategies``) loads as a record of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from fsdp_harness import doc_sections
from fsdp_presets.fileio import write_text_atomic

EXIT_ENDINGS = ("none", "end-training", "delete", "trainer-end", "trainer-save")
EXIT_STRATEGIES = ("ddp", "fsdp1", "fsdp2")
PREEMPTION_STRATEGIES = ("fsdp2", "fsdp1")
KEYS = {"exit": ("ending", "strategy"), "preemption": ("strategy",)}
FULL_CHECK = {"exit": 50, "preemption": 20}
SECTIONS = {"exit": "exit-campaign", "preemption": "preemption-campaign"}
"""Each campaign's section of docs/benchmarks.md."""
ENDING_TEXT = {
    "none": "`none` (the script returns)",
    "end-training": "`end-training` (`accelerator.end_training()`)",
    "delete": "`delete` (`del model, optimizer`, then `end_training()`)",
    "trainer-end": "`trainer-end` (a `Trainer` trains, then `trainer.end()`)",
    "trainer-save": "`trainer-save` (a `Trainer` with `FSDPPresetsCallback` trains, then `trainer.save_model(dir)`)",
}


class RecordError(ValueError):
    """A campaign record that cannot be read or merged (the message names the file and the fix)."""


def new_record(campaign: str, settings: dict, run: dict, cells: list[dict]) -> dict:
    """A record of one run whose ``cells`` (keys plus ``items``) and ``run`` are still being filled
    (both are kept, not copied)."""
    return {"campaign": campaign, "settings": dict(settings), "runs": [run], "cells": cells}


def _upgrade(data: dict, campaign: str) -> dict:
    """A single run's file in the older layout, as a record of one run."""
    if campaign == "exit" and "launches_asked" in data:
        run = {key: data[key] for key in ("date", "host", "torch", "accelerate", "busy", "load_before",
                                           "load_after") if key in data}
        run["per_cell_asked"] = data["launches_asked"]
        cells = [{"ending": cell["ending"], "strategy": cell["strategy"],
                  "items": [dict(item, run=0) for item in cell["launches"]]} for cell in data["cells"]]
        return new_record("exit", {"processes": data["processes"], "fix_off": data["fix_off"]}, run, cells)
    if campaign == "preemption" and "trials_asked" in data:
        run = {key: data[key] for key in ("date", "load_before", "load_after") if key in data}
        run["per_cell_asked"] = data["trials_asked"]
        cells = [{"strategy": strategy, "items": [dict(item, run=0) for item in items]}
                 for strategy, items in data["strategies"].items()]
        # 16 steps: the only length the script had before its records kept it
        return new_record("preemption", {"steps": 16}, run, cells)
    return data


def load(path: str | os.PathLike, campaign: str) -> dict:
    """The record in ``path`` (a missing file is an empty record); :class:`RecordError` when it is
    not a record of ``campaign``."""
    path = Path(path)
    if not path.exists():
        return {"campaign": campaign, "settings": None, "runs": [], "cells": []}
    try:
        data = _upgrade(json.loads(path.read_text()), campaign)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
        raise RecordError(f"{path}: not a readable record of the {campaign} campaign ({error}); "
                          "pass another --merge file or move this one away") from None
    if not isinstance(data, dict) or data.get("campaign") != campaign or not isinstance(data.get("runs"), list) \
            or not isinstance(data.get("cells"), list):
        raise RecordError(f"{path}: not a record of the {campaign} campaign (no campaign/runs/cells of that kind); "
                          f"pass a file that scripts/{campaign}_campaign.py wrote with --merge")
    return data


def check_settings(record: dict, settings: dict) -> None:
    """:class:`RecordError` unless a run with ``settings`` may be added to ``record``."""
    if record["runs"] and record["settings"] != settings:
        raise RecordError(f"the record's runs were made with {record['settings']} and this one would be made "
                          f"with {settings}: merge it into another file")


def commit(repo: Path) -> str | None:
    """The checkout's commit (short), with ``+changes`` when its tracked files differ from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True,
                              text=True, timeout=30)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def shown_path(path: str | os.PathLike, repo: Path) -> str:
    """``path`` as the docs show it: relative to the checkout when inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(repo)) if path.is_relative_to(repo) else str(path)


def _key(cell: dict, campaign: str) -> tuple:
    return tuple(cell[name] for name in KEYS[campaign])


def _order(campaign: str, key: tuple) -> tuple:
    if campaign == "exit":
        ending, strategy = key
        return (EXIT_ENDINGS.index(ending) if ending in EXIT_ENDINGS else len(EXIT_ENDINGS), ending,
                EXIT_STRATEGIES.index(strategy) if strategy in EXIT_STRATEGIES else len(EXIT_STRATEGIES), strategy)
    strategy, = key
    return (PREEMPTION_STRATEGIES.index(strategy) if strategy in PREEMPTION_STRATEGIES else 2, strategy)


def merge(previous: dict, new: dict) -> dict:
    """``previous`` and ``new`` as one record: the runs of both (``new``'s after), each cell's items
    added up (``new``'s items renumbered to its runs' new indices), cells in the campaign's order.
    A run that made nothing (stopped before its first item) adds nothing. :class:`RecordError` when
    the campaigns or the settings differ."""
    campaign = new["campaign"]
    if previous["campaign"] != campaign:
        raise RecordError(f"cannot add a {campaign} campaign to a record of the {previous['campaign']} campaign")
    check_settings(previous, new["settings"])
    if not any(cell["items"] for cell in new["cells"]):
        return previous
    offset = len(previous["runs"])
    cells = {_key(cell, campaign): {**cell, "items": list(cell["items"])} for cell in previous["cells"]}
    for cell in new["cells"]:
        items = [dict(item, run=item.get("run", 0) + offset) for item in cell["items"]]
        key = _key(cell, campaign)
        if key in cells:
            cells[key]["items"] += items
        else:
            cells[key] = {**cell, "items": items}
    return {"campaign": campaign, "settings": new["settings"], "runs": previous["runs"] + new["runs"],
            "cells": [cells[key] for key in sorted(cells, key=lambda key: _order(campaign, key)) if cells[key]["items"]]}


def counts(record: dict) -> dict[tuple, int]:
    """Items per cell (what a campaign that adds to ``record`` starts its turns from)."""
    return {_key(cell, record["campaign"]): len(cell["items"]) for cell in record["cells"]}


def dumps(value, indent: int = 0) -> str:
    """JSON with one line per flat object or list (a launch, a trial, a run), so that the file stays
    short and a merge's diff shows the items it added."""
    flat = not any(isinstance(inner, (dict, list)) and inner
                   for inner in (value.values() if isinstance(value, dict) else value)) \
        if isinstance(value, (dict, list)) else True
    if flat:
        return json.dumps(value)
    pad, inner_pad = " " * indent, " " * (indent + 1)
    if isinstance(value, dict):
        body = [f"{inner_pad}{json.dumps(key)}: {dumps(inner, indent + 1)}" for key, inner in value.items()]
        return "{\n" + ",\n".join(body) + f"\n{pad}}}"
    return "[\n" + ",\n".join(inner_pad + dumps(inner, indent + 1) for inner in value) + f"\n{pad}]"


def write(path: str | os.PathLike, record: dict) -> None:
    """Rewrite ``path`` with ``record`` atomically."""
    write_text_atomic(path, dumps(record) + "\n")


def save_run(record: dict, run: dict, *, path: Path, previous: dict | None,
             merge_into: str | os.PathLike | None) -> dict:
    """Write this run's record to ``path`` (its load average now as ``load_after``) and, with a
    ``previous`` record, the two merged to ``merge_into``; returns what the report shows."""
    run["load_after"] = os.getloadavg()[0]
    write(path, record)
    if previous is None:
        return record
    merged = merge(previous, record)
    write(merge_into, merged)
    return merged


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def runs_table(record: dict) -> list[str]:
    """One row per run: when, what it made, and the host's load (1-minute averages)."""
    lines = ["| run | started (UTC) | ran | items | asked per cell | load average before / during (median) / after "
             "| notes |",
             "|---:|---|---|---:|---:|---|---|"]
    for index, run in enumerate(record["runs"]):
        items = [item for cell in record["cells"] for item in cell["items"] if item.get("run", 0) == index]
        ran: dict[str, list[str]] = {}
        for cell in record["cells"]:
            if any(item.get("run", 0) == index for item in cell["items"]):
                ran.setdefault(cell.get("ending", ""), []).append(cell["strategy"])
        ran_text = "; ".join(f"{ending} ({', '.join(strategies)})" if ending else ", ".join(strategies)
                             for ending, strategies in ran.items())
        during = [item["load"] for item in items if "load" in item]
        notes = [f"{run['busy']} extra CPU-bound processes" if run.get("busy") else "no extra CPU-bound processes"]
        notes += [f"{run['parallel']} launches at a time"] if run.get("parallel", 1) > 1 else []
        notes += [f"commit {run['commit']}"] if run.get("commit") else []
        notes += [f"torch {run['torch']}, accelerate {run['accelerate']}"] if run.get("torch") else []
        notes += [run["note"]] if run.get("note") else []  # written into the record by hand
        lines.append(f"| {index + 1} | {run.get('started', run.get('date', '?'))} | {ran_text} | {len(items)} | "
                     f"{run.get('per_cell_asked', '?')} | {run['load_before']:.1f} / "
                     f"{f'{_median(during):.1f}' if during else 'not recorded'} / {run['load_after']:.1f} | "
                     f"{'; '.join(notes)} |")
    return lines


def _load_span(record: dict) -> str:
    loads = [value for run in record["runs"] for value in (run["load_before"], run["load_after"])]
    loads += [item["load"] for cell in record["cells"] for item in cell["items"] if "load" in item]
    dates = sorted({run.get("started", run.get("date", "?"))[:10] for run in record["runs"]})
    return (f"{len(record['runs'])} run(s) on {', '.join(dates)}, load average {min(loads):.1f}-{max(loads):.1f} "
            "(1-minute averages, the campaign's own launches included; a run's notes say what else ran)")


def render_exit(record: dict, record_path: str) -> str:
    """The ``exit-campaign`` section of docs/benchmarks.md from a whole (merged) record."""
    cells, full = record["cells"], FULL_CHECK["exit"]
    endings = [ending for ending in EXIT_ENDINGS if any(cell["ending"] == ending for cell in cells)]
    endings += sorted({cell["ending"] for cell in cells} - set(EXIT_ENDINGS))
    strategies = [strategy for strategy in EXIT_STRATEGIES if any(cell["strategy"] == strategy for cell in cells)]
    total = sum(len(cell["items"]) for cell in cells)
    fix_off = record["settings"]["fix_off"]
    lines = [
        "## Exit campaign: every way a script ends", "",
        f"`python scripts/exit_campaign.py --merge {record_path}`{' --fix-off' if fix_off else ''}: "
        f"{record['settings']['processes']}-process launches of `tests/workers/script_endings.py` (enable_cpu_fsdp, a "
        "tiny Llama, 3 steps), the cells taking turns; exit handler (collection before `destroy_process_group`, then "
        f"a wait until gloo's worker threads are idle) {'off' if fix_off else 'on'}. {total} launches in "
        f"{len(record['runs'])} run(s) added up in `{record_path}`. Endings run: "
        f"{', '.join(ENDING_TEXT.get(ending, f'`{ending}`') for ending in endings)}; under "
        f"{', '.join(strategies)}.", "",
        f"| ending | strategy | launches | exit 0 | gloo abort | seconds per launch (median) | of the full check's {full} |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for cell in cells:
        items = cell["items"]
        failed = [item for item in items if not item["ok"]]
        codes = sorted({item["returncode"] for item in failed})
        lines.append(f"| {cell['ending']} | {cell['strategy']} | {len(items)} | {len(items) - len(failed)}"
                     f"{' (failed: exit ' + ', '.join(map(str, codes)) + ')' if failed else ''} "
                     f"| {sum(item['gloo_abort'] for item in items)} | {_median([item['seconds'] for item in items]):.1f} "
                     f"| {'done' if len(items) >= full else f'{full - len(items)} to go'} |")
    missing = [f"{ending} under {strategy}" for ending in EXIT_ENDINGS for strategy in EXIT_STRATEGIES
               if not any(cell["ending"] == ending and cell["strategy"] == strategy for cell in cells)]
    lines += ["", *runs_table(record), "",
              f"Measured in {_load_span(record)}. The full check is {full} launches of every ending under every "
              "strategy on a host kept busy by two other CPU-bound processes (`--busy 2`, or other work; with "
              "`--parallel P` each launch also shares the host with P - 1 other launches); a run adds to the record "
              "with `--merge`."
              + (f" Not run yet: {', '.join(missing)}." if missing else "")]
    return "\n".join(lines)


def _moments(items: list[dict]) -> str:
    """The trials' moments, grouped: random ones by the steps they followed, held ones by name."""
    random_steps = [item["step_seen_at_signal"] for item in items if " s after step " in item["moment"]]
    held: dict[str, int] = {}
    for item in items:
        if " s after step " not in item["moment"]:
            held[item["moment"]] = held.get(item["moment"], 0) + 1
    parts = [f"{len(random_steps)} at random (signalled at steps {min(random_steps)}-{max(random_steps)})"] if random_steps else []
    return "; ".join(parts + [f"{count} {moment}" for moment, count in held.items()])


def render_preemption(record: dict, record_path: str) -> str:
    """The ``preemption-campaign`` section of docs/benchmarks.md from a whole (merged) record."""
    full, steps = FULL_CHECK["preemption"], record["settings"]["steps"]
    total = sum(len(cell["items"]) for cell in record["cells"])
    lines = ["## Preemption campaign: SIGTERM at random moments, then --resume auto", "",
             f"`python scripts/preemption_campaign.py --merge {record_path}`: 2-process launches of "
             f"`recipes/causal_lm.py` (tiny Llama, {steps} steps, evaluation every 3, checkpoint every 4), SIGTERM "
             "to the `accelerate launch` process at a random moment, or as the evaluation after step 6 starts, or inside "
             f"the save of step 8 (the three take turns), then the same command again. {total} trials in "
             f"{len(record['runs'])} run(s) added up in `{record_path}`.", "",
             "| strategy | trials | passed | steps lost (max) | signal to launcher exit, s (median / max) | moments "
             f"| of the full check's {full} |",
             "|---|---:|---:|---:|---:|---|---|"]
    for cell in record["cells"]:
        items = cell["items"]
        stops = [item["stop_s"] for item in items]
        lost = max(item["last_logged"] - (item["preempted_at"] or 0) for item in items)
        lines.append(f"| {cell['strategy']} | {len(items)} | {sum(item['ok'] for item in items)} | {lost} | "
                     f"{_median(stops):.1f} / {max(stops):.1f} | {_moments(items)} | "
                     f"{'done' if len(items) >= full else f'{full - len(items)} to go'} |")
    lines += ["", *runs_table(record), "",
              f"Measured in {_load_span(record)}. A trial passes when the launcher exits 143 within torchrun's 30 s "
              "grace, the newest committed checkpoint is the step reached (at most 1 step lost), metrics.jsonl says "
              "`preempted` at that step, and the relaunch ends with losses bitwise equal to an uninterrupted run of "
              "the same strategy made at the start of the same run. The stop times of the held trials include the fault's 8 s hold. A second "
              "signal is `tests/test_preemption.py`'s (the previous checkpoint stays intact)."]
    return "\n".join(lines)


def section(record: dict, record_path: str) -> str:
    """The record's section of docs/benchmarks.md, between its markers (:mod:`fsdp_harness.doc_sections`)."""
    render = render_exit if record["campaign"] == "exit" else render_preemption
    return doc_sections.wrap(SECTIONS[record["campaign"]], render(record, record_path))


def write_section(doc: str | os.PathLike, record: dict, record_path: str) -> str:
    """Rewrite the record's section of ``doc`` (``record_path``: the record's file as the section
    names it); returns the section's name."""
    doc_sections.replace_in_file(doc, SECTIONS[record["campaign"]], section(record, record_path))
    return SECTIONS[record["campaign"]]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Render a campaign record's section of the benchmarks page "
                                     "again (after a note was written into a run by hand).")
    parser.add_argument("record", help="docs/data/exit_campaign.json or docs/data/preemption_campaign.json")
    parser.add_argument("--doc", default="docs/benchmarks.md", help="the markdown file whose section is rewritten")
    args = parser.parse_args(argv)
    try:
        campaign = json.loads(Path(args.record).read_text()).get("campaign")
        if campaign not in SECTIONS:
            raise RecordError(f"{args.record}: not a campaign record (campaign is {campaign!r}, not one of "
                              f"{', '.join(SECTIONS)}); give a file that scripts/exit_campaign.py or "
                              "scripts/preemption_campaign.py wrote with --merge")
        record = load(args.record, campaign)
    except (OSError, ValueError, AttributeError) as error:
        print(f"campaign_record: {error}", file=sys.stderr)
        return 2
    name = write_section(args.doc, record, shown_path(args.record, Path.cwd()))
    print(f"wrote the {name} section of {args.doc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
