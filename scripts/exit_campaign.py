"""Exit campaign: launch a user script that never calls ``end_training`` many times; every launch
must exit 0.

    python scripts/exit_campaign.py [--launches 100] [--processes 2] [--fix-off] [--doc docs/benchmarks.md]

Each launch runs ``tests/workers/no_end_training.py`` (``enable_cpu_fsdp()``, a tiny Llama,
3 FSDP2 steps, then the script simply ends with the process group alive) through
``accelerate launch`` with ``--processes`` gloo processes, one after another. A launch passes when
the launcher exits 0, every rank printed that it trained, and nobody printed gloo's exit abort
("terminate called without an active exception"). ``--fix-off`` runs the same launches with the
exit handler of :mod:`fsdp_presets.clean_exit` switched off, for comparison.

Results: ``WORK_DIR/exit_campaign.json`` and, unless ``--no-doc``, the ``exit-campaign`` section
of ``docs/benchmarks.md`` (rewritten in place). Exit status 1 when any launch failed. About 6 s
per launch on an idle 2-core host (100 launches: about 10 minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

from fsdp_harness import doc_sections
from fsdp_harness.launch import launch_command, launch_env, write_accelerate_config
from fsdp_presets.clean_exit import CLEAN_EXIT

REPO = Path(__file__).resolve().parent.parent

WORKER = REPO / "tests" / "workers" / "no_end_training.py"
DOC = REPO / "docs" / "benchmarks.md"
SECTION = "exit-campaign"
GLOO_EXIT_ABORT = "terminate called without an active exception"


def write_config(directory: Path, processes: int) -> Path:
    """An FSDP2 accelerate config as `accelerate config` writes it (the harness's writer)."""
    return write_accelerate_config(directory / "fsdp2.yaml", num_processes=processes)


def one_launch(config: Path, processes: int, fix_off: bool) -> dict:
    env = launch_env({"FSDP_PRESETS_CPU_PATCHES_OFF": CLEAN_EXIT} if fix_off else None)
    command = launch_command(config, WORKER)
    started = time.perf_counter()
    completed = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300,
                               stdin=subprocess.DEVNULL, cwd=REPO)
    output = completed.stdout + completed.stderr
    trained = output.count(" trained, distributed type FSDP")
    aborted = GLOO_EXIT_ABORT in output
    ok = completed.returncode == 0 and trained == processes and not aborted
    return {"returncode": completed.returncode, "ranks_trained": trained, "gloo_abort": aborted,
            "group_destroyed_at_exit": output.count("process group at exit: destroyed"),
            "seconds": round(time.perf_counter() - started, 2), "ok": ok,
            "tail": "" if ok else output[-3000:]}


def render(summary: dict) -> str:
    failed = [launch for launch in summary["launches"] if not launch["ok"]]
    codes = sorted({launch["returncode"] for launch in failed})
    lines = [
        "## Exit campaign: scripts that never call end_training",
        "",
        f"`python scripts/exit_campaign.py --launches {summary['launches_asked']}"
        f"{' --fix-off' if summary['fix_off'] else ''}`: {summary['launches_asked']} consecutive "
        f"{summary['processes']}-process FSDP2 launches of `tests/workers/no_end_training.py` (enable_cpu_fsdp, "
        "3 steps, the script ends without `accelerator.end_training()`), "
        f"exit handler {'off' if summary['fix_off'] else 'on'}.",
        "",
        "| launches | exit 0 | failed | gloo abort | group destroyed at exit (ranks) | seconds per launch (median) |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {len(summary['launches'])} | {len(summary['launches']) - len(failed)} | {len(failed)}"
        f"{' (exit ' + ', '.join(map(str, codes)) + ')' if failed else ''} "
        f"| {sum(launch['gloo_abort'] for launch in summary['launches'])} "
        f"| {sum(launch['group_destroyed_at_exit'] for launch in summary['launches'])} "
        f"| {summary['median_seconds']:.1f} |",
        "",
        f"Measured {summary['date']} on {summary['host']} (torch {summary['torch']}, accelerate "
        f"{summary['accelerate']}), load average {summary['load_before']:.1f} before and "
        f"{summary['load_after']:.1f} after (a shared host: other work was running). Without the exit handler "
        "(`FSDP_PRESETS_CPU_PATCHES_OFF=clean-exit`) the same script died with SIGABRT at exit in 1 launch of "
        "about 20 on this host (`terminate called without an active exception`, launcher exit status 1); "
        "`tests/test_clean_exit.py` shows the group is still alive at exit then and destroyed with the handler.",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=100)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--fix-off", action="store_true", help="switch the exit handler off (comparison)")
    parser.add_argument("--work-dir", help="where exit_campaign.json goes (default: a temporary folder)")
    parser.add_argument("--doc", default=str(DOC), help="markdown file whose exit-campaign section is rewritten")
    parser.add_argument("--no-doc", action="store_true", help="write no documentation")
    args = parser.parse_args(argv)
    if args.launches < 1 or args.processes < 2:
        parser.error("--launches must be >= 1 and --processes >= 2")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="exit-campaign-"))
    work.mkdir(parents=True, exist_ok=True)
    config = write_config(work, args.processes)

    import accelerate
    import torch

    load_before = os.getloadavg()[0]
    launches = []
    for index in range(1, args.launches + 1):
        result = one_launch(config, args.processes, args.fix_off)
        launches.append(result)
        status = "ok" if result["ok"] else f"FAILED (exit {result['returncode']}, abort {result['gloo_abort']})"
        print(f"launch {index}/{args.launches}: {status}, {result['seconds']:.1f} s", flush=True)
    seconds = sorted(launch["seconds"] for launch in launches)
    summary = {"launches_asked": args.launches, "processes": args.processes, "fix_off": args.fix_off,
               "date": time.strftime("%Y-%m-%d", time.gmtime()), "host": f"{platform.machine()} "
               f"{os.cpu_count()} cores", "torch": torch.__version__,
               "accelerate": accelerate.__version__, "load_before": load_before,
               "load_after": os.getloadavg()[0],
               "median_seconds": seconds[len(seconds) // 2], "launches": launches}
    (work / "exit_campaign.json").write_text(json.dumps(summary, indent=1))
    failed = sum(not launch["ok"] for launch in launches)
    print(f"{len(launches) - failed}/{len(launches)} launches exited 0 without an abort "
          f"(results: {work / 'exit_campaign.json'})", flush=True)
    if not args.no_doc:
        doc_sections.replace_in_file(args.doc, SECTION, doc_sections.wrap(SECTION, render(summary)))
        print(f"wrote the {SECTION} section of {args.doc}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
