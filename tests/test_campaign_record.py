"""Campaign records add up over runs (fsdp_harness.campaign_record, ``--merge`` of
scripts/exit_campaign.py and scripts/preemption_campaign.py): counts accumulate, each item keeps
the run that made it, the report lists only what ran and states the runs and their load; a record
of other settings or another campaign is refused in one line, before any launch, the file untouched.
No launches: records are built as the scripts write them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_harness import campaign_record as cr
from fsdp_harness import doc_sections

REPO = Path(__file__).resolve().parent.parent
RECORDS = REPO / "docs" / "data"


def launch(ok=True, seconds=20.0, load=None):
    item = {"returncode": 0 if ok else 1, "ranks_trained": 2, "gloo_abort": not ok, "seconds": seconds, "ok": ok,
            "tail": ""}
    return item if load is None else dict(item, load=load)


def legacy_exit_run(cells, *, date="2026-12-04", load=(11.2, 11.9), fix_off=False):
    """A single run's file as the script wrote it before records (``launches_asked``, ``launches``)."""
    return {"launches_asked": max(len(items) for items in cells.values()), "processes": 2, "busy": 0,
            "fix_off": fix_off, "date": date, "host": "x86_64 2 cores", "torch": "2.13.0+cpu", "accelerate": "1.16.0",
            "load_before": load[0], "load_after": load[1],
            "cells": [{"ending": ending, "strategy": strategy, "launches": items}
                      for (ending, strategy), items in cells.items()]}


def new_exit_run(cells, *, started="2026-12-05T09:00Z", fix_off=False, load=(3.0, 4.0), parallel=None):
    run = {"started": started, "busy": 0, "per_cell_asked": 2, "load_before": load[0], "load_after": load[1],
           "commit": "abc1234"}
    if parallel is not None:  # written since launches could run side by side; older runs have no such key
        run["parallel"] = parallel
    return cr.new_record("exit", {"processes": 2, "fix_off": fix_off}, run,
                         [{"ending": ending, "strategy": strategy, "items": list(items)}  # no "run": as a script writes
                          for (ending, strategy), items in cells.items()])


def test_runs_add_up_per_cell_each_item_keeps_its_run_and_the_report_lists_only_what_ran(tmp_path):
    old = tmp_path / "old.json"
    old.write_text(json.dumps(legacy_exit_run({("trainer-save", "fsdp2"): [launch()] * 3,
                                               ("trainer-save", "fsdp1"): [launch()] * 3})))
    first = cr.load(old, "exit")
    assert len(first["runs"]) == 1 and cr.counts(first) == {("trainer-save", "fsdp2"): 3, ("trainer-save", "fsdp1"): 3}
    second = new_exit_run({("none", "ddp"): [launch(load=5.0), launch(ok=False, load=7.0)],
                           ("trainer-save", "fsdp1"): [launch(load=6.0)] * 2})
    merged = cr.merge(first, second)
    assert cr.counts(merged) == {("none", "ddp"): 2, ("trainer-save", "fsdp1"): 5, ("trainer-save", "fsdp2"): 3}
    assert [cell["ending"] + "/" + cell["strategy"] for cell in merged["cells"]] == \
        ["none/ddp", "trainer-save/fsdp1", "trainer-save/fsdp2"]  # the campaign's order, not arrival order
    runs_of = {(cell["ending"], cell["strategy"]): [item["run"] for item in cell["items"]] for cell in merged["cells"]}
    assert runs_of[("trainer-save", "fsdp1")] == [0, 0, 0, 1, 1] and runs_of[("none", "ddp")] == [1, 1]
    assert "run" not in second["cells"][0]["items"][0]  # the run's own record is left as it was

    record = tmp_path / "record.json"
    cr.write(record, merged)
    assert cr.load(record, "exit") == merged  # the compact layout reads back as written
    third = cr.merge(cr.load(record, "exit"), new_exit_run({("none", "ddp"): [launch(load=2.0)]},
                                                           started="2026-12-06T10:00Z", parallel=3))
    assert cr.counts(third)[("none", "ddp")] == 3 and len(third["runs"]) == 3

    text = cr.render_exit(third, "docs/data/exit_campaign.json")
    assert "| none | ddp | 3 | 2 (failed: exit 1) | 1 | 20.0 | 47 to go |" in text
    assert "| trainer-save | fsdp1 | 5 | 5 | 0 | 20.0 | 45 to go |" in text
    assert "11 launches in 3 run(s)" in text and "2026-12-04, 2026-12-05, 2026-12-06" in text
    assert "`none` (the script returns)" in text and "`trainer-save` (" in text
    for absent in ("`end-training` (", "`delete` (", "`trainer-end` ("):  # never ran: not described as run
        assert absent not in text
    assert "Not run yet: none under fsdp1, none under fsdp2, end-training under ddp," in text and "trainer-save under ddp." in text
    # one row per run: when, how many, the load before / during (median of the items') / after
    assert "| 1 | 2026-12-04 | trainer-save (fsdp1, fsdp2) | 6 | 3 | 11.2 / not recorded / 11.9 |" in text
    assert "| 2 | 2026-12-05T09:00Z | none (ddp); trainer-save (fsdp1) | 4 | 2 | 3.0 / 6.0 / 4.0 |" in text
    assert "commit abc1234" in text and "| 3 | 2026-12-06T10:00Z | none (ddp) | 1 | 2 | 3.0 / 2.0 / 4.0 | " \
        "no extra CPU-bound processes; 3 launches at a time; commit abc1234 |" in text
    assert "launches at a time" not in text.split("| 3 | 2026-12-06")[0]  # runs one launch at a time say nothing


def test_a_run_with_other_settings_or_of_another_campaign_is_refused(tmp_path):
    on = new_exit_run({("none", "ddp"): [launch()]})
    with pytest.raises(cr.RecordError, match="merge it into another file"):
        cr.merge(on, new_exit_run({("none", "ddp"): [launch()]}, fix_off=True))
    cr.check_settings(cr.load(tmp_path / "missing.json", "exit"), {"processes": 2, "fix_off": True})  # a new file takes any
    assert cr.merge(on, new_exit_run({("none", "ddp"): []})) == on  # a run stopped before its first launch adds nothing
    path = tmp_path / "exit.json"
    cr.write(path, on)
    with pytest.raises(cr.RecordError, match=f"{path}: not a record of the preemption campaign"):
        cr.load(path, "preemption")
    path.write_text("{not json")
    with pytest.raises(cr.RecordError, match=f"{path}: not a readable record of the exit campaign"):
        cr.load(path, "exit")


def test_preemption_trials_add_up_and_the_moments_are_grouped(tmp_path):
    def trial(moment, seen=6):
        return {"moment": moment, "step_seen_at_signal": seen, "preempted_at": seen, "last_logged": seen,
                "stop_s": 18.0, "launcher_status": 143, "ok": True, "problems": []}

    legacy = tmp_path / "old.json"
    legacy.write_text(json.dumps({"trials_asked": 2, "date": "2026-12-04", "load_before": 10.2, "load_after": 8.7,
                                  "strategies": {"fsdp2": [trial("0.23 s after step 8", 8), trial("inside the save of step 8")],
                                                 "fsdp1": [trial("0.04 s after step 3", 3)]}}))
    run = {"started": "2026-12-05T09:00Z", "per_cell_asked": 1, "load_before": 5.0, "load_after": 6.0,
           "note": "a note written into the record"}
    new = cr.new_record("preemption", {"steps": 16}, run, [
        {"strategy": "fsdp1", "items": [dict(trial("as the evaluation after step 6 starts"), load=5.5)]}])
    merged = cr.merge(cr.load(legacy, "preemption"), new)
    assert cr.counts(merged) == {("fsdp2",): 2, ("fsdp1",): 2}
    text = cr.render_preemption(merged, "docs/data/preemption_campaign.json")
    assert "| fsdp1 | 2 | 2 | 0 | 18.0 / 18.0 | 1 at random (signalled at steps 3-3); 1 as the evaluation after step 6 starts | 18 to go |" in text
    assert "4 trials in 2 run(s)" in text and "| 2 | 2026-12-05T09:00Z | fsdp1 | 1 | 1 | 5.0 / 5.5 / 6.0 | no extra CPU-bound processes; a note written into the record |" in text


def test_the_repository_records_load_and_their_cells_are_the_reports():
    for campaign, render in (("exit", lambda record: cr.render_exit(record, "x")),
                             ("preemption", lambda record: cr.render_preemption(record, "x"))):
        record = cr.load(RECORDS / f"{campaign}_campaign.json", campaign)
        assert record["runs"] and all(0 <= item["run"] < len(record["runs"])
                                      for cell in record["cells"] for item in cell["items"])
        text = render(record)
        for cell in record["cells"]:
            assert f"| {cell['strategy']} | " in text


@pytest.mark.parametrize("script, campaign", [("exit_campaign.py", "exit"), ("preemption_campaign.py", "preemption")])
def test_a_merge_file_that_is_no_record_stops_the_script_before_any_launch(tmp_path, script, campaign):
    bad = tmp_path / "record.json"
    bad.write_text('{"campaign": "other"}')
    done = subprocess.run([sys.executable, str(REPO / "scripts" / script), "--merge", str(bad), "--no-doc",
                           "--work-dir", str(tmp_path / "work")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0 and f"not a record of the {campaign} campaign" in done.stderr
    assert bad.read_text() == '{"campaign": "other"}' and not (tmp_path / "work").exists()


def test_the_benchmarks_page_shows_each_record_as_it_is_now():
    document = (REPO / "docs" / "benchmarks.md").read_text()
    for campaign, name in cr.SECTIONS.items():
        shown = f"docs/data/{campaign}_campaign.json"
        assert doc_sections.find(document, name) == cr.section(cr.load(REPO / shown, campaign), shown), \
            f"docs/benchmarks.md's {name} section is not {shown} rendered: python -m fsdp_harness.campaign_record {shown}"


def test_the_section_is_rendered_again_from_a_record_with_a_note_written_by_hand(tmp_path, monkeypatch, capsys):
    record = new_exit_run({("none", "ddp"): [launch(load=3.0)]})
    record["runs"][0]["note"] = "the host was shared with other work"
    cr.write(tmp_path / "exit.json", record)
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n<!-- other:start -->\nkept\n<!-- other:end -->\n")
    monkeypatch.chdir(tmp_path)
    assert cr.main(["exit.json", "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert "kept" in text and doc_sections.find(text, "exit-campaign") == cr.section(record, "exit.json")
    assert "| no extra CPU-bound processes; commit abc1234; the host was shared with other work |" in text
    (tmp_path / "other.json").write_text('{"campaign": "other"}')
    capsys.readouterr()
    assert cr.main(["other.json", "--doc", str(doc)]) == 2 and doc.read_text() == text
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "other.json: not a campaign record" in error and "wrote with --merge" in error
