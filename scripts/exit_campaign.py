"""Exit campaign: launch small user scripts with each way a script ends, under DDP, FSDP1 and FSDP2;
every finished training must exit 0.

    python scripts/exit_campaign.py [--launches 50] [--busy 2] [--endings none,end-training,...]
        [--strategies ddp,fsdp1,fsdp2] [--fix-off] [--doc docs/benchmarks.md]

Each launch runs ``tests/workers/script_endings.py --ending ENDING`` (``enable_cpu_fsdp()``, a tiny
Llama, 3 steps, then ``none``: the script just returns; ``end-training``: ``accelerator.end_training()``;
``delete``: ``del model, optimizer`` then ``end_training()``; ``trainer-end``: a ``transformers.Trainer``
trains and ``trainer.end()``; ``trainer-save``: a Trainer with ``FSDPPresetsCallback`` trains and the script
ends with ``trainer.save_model(dir)``) through ``accelerate launch`` with 2 gloo processes. ``--launches`` is per
ending and strategy; the cells take turns, so a campaign cut short still covers each of them. A
launch passes when the launcher exits 0, every rank printed that it trained, and nobody printed
gloo's exit abort ("terminate called without an active exception"). ``--busy K`` keeps K other
CPU-bound processes running during the campaign (a loaded host makes the abort likelier).
``--fix-off`` switches :mod:`fsdp_presets.clean_exit` off, for comparison.

Results: ``WORK_DIR/exit_campaign.json`` and, unless ``--no-doc``, the ``exit-campaign`` section of
``docs/benchmarks.md`` (rewritten in place). Exit status 1 when any launch failed. About 6-12 s per
launch on a 2-core host (``trainer-end`` about twice that).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

from fsdp_harness import doc_sections
from fsdp_harness.launch import launch_env, write_accelerate_config
from fsdp_presets.preset.local_launch import launch_command
from fsdp_presets.clean_exit import CLEAN_EXIT

REPO = Path(__file__).resolve().parent.parent

WORKER = REPO / "tests" / "workers" / "script_endings.py"
ENDINGS = ("none", "end-training", "delete", "trainer-end", "trainer-save")
STRATEGIES = ("ddp", "fsdp1", "fsdp2")
DOC = REPO / "docs" / "benchmarks.md"
SECTION = "exit-campaign"
GLOO_EXIT_ABORT = "terminate called without an active exception"


def write_config(directory: Path, strategy: str, processes: int) -> Path:
    """An accelerate config as `accelerate config` writes it (the harness's writer)."""
    if strategy == "ddp":
        return write_accelerate_config(directory / "ddp.yaml", num_processes=processes, distributed_type="MULTI_GPU")
    return write_accelerate_config(directory / f"{strategy}.yaml", num_processes=processes,
                                   fsdp={"version": int(strategy[-1])})


def one_launch(config: Path, ending: str, processes: int, fix_off: bool) -> dict:
    env = launch_env({"FSDP_PRESETS_CPU_PATCHES_OFF": CLEAN_EXIT} if fix_off else None)
    command = launch_command(config, WORKER, ["--ending", ending])
    started = time.perf_counter()
    completed = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600,
                               stdin=subprocess.DEVNULL, cwd=REPO)
    output = completed.stdout + completed.stderr
    trained = output.count(" trained, distributed type ")
    aborted = GLOO_EXIT_ABORT in output
    ok = completed.returncode == 0 and trained == processes and not aborted
    return {"returncode": completed.returncode, "ranks_trained": trained, "gloo_abort": aborted,
            "seconds": round(time.perf_counter() - started, 2), "ok": ok, "tail": "" if ok else output[-3000:]}


def _spin(_: int) -> None:
    while True:
        pass


def render(summary: dict) -> str:
    lines = [
        "## Exit campaign: every way a script ends",
        "",
        f"`python scripts/exit_campaign.py --launches {summary['launches_asked']} --busy {summary['busy']}"
        f"{' --fix-off' if summary['fix_off'] else ''}`: {summary['processes']}-process launches of "
        "`tests/workers/script_endings.py` (enable_cpu_fsdp, a tiny Llama, 3 steps) for each ending and strategy, "
        f"taking turns, with {summary['busy'] or 'no'} extra CPU-bound processes started by the campaign; exit handler "
        f"(collection before `destroy_process_group`, then a wait until gloo's worker threads are idle) "
        f"{'off' if summary['fix_off'] else 'on'}. Endings: `none` (the "
        "script returns), `end-training` (`accelerator.end_training()`), `delete` (`del model, optimizer`, then "
        "`end_training()`), `trainer-end` (a `Trainer` trains, then `trainer.end()`), `trainer-save` (a `Trainer` "
        "with `FSDPPresetsCallback` trains, then `trainer.save_model(dir)`).",
        "",
        "| ending | strategy | launches | exit 0 | gloo abort | seconds per launch (median) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for cell in summary["cells"]:
        launches = cell["launches"]
        if not launches:
            continue
        seconds = sorted(launch["seconds"] for launch in launches)
        failed = [launch for launch in launches if not launch["ok"]]
        codes = sorted({launch["returncode"] for launch in failed})
        lines.append(f"| {cell['ending']} | {cell['strategy']} | {len(launches)} | {len(launches) - len(failed)}"
                     f"{' (failed: exit ' + ', '.join(map(str, codes)) + ')' if failed else ''} "
                     f"| {sum(launch['gloo_abort'] for launch in launches)} | {seconds[len(seconds) // 2]:.1f} |")
    lines += ["", f"Measured {summary['date']} on {summary['host']} (torch {summary['torch']}, accelerate "
              f"{summary['accelerate']}), load average {summary['load_before']:.1f} before and "
              f"{summary['load_after']:.1f} after (a shared host: other work was running too). The full check is "
              "`--launches 50 --busy 2` (50 launches of every ending under every strategy, two CPU-bound processes "
              f"beside them); this run made {summary['launches_asked']} of each."]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=50, help="launches per ending and strategy")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--endings", default=",".join(ENDINGS), help=f"comma-separated, of {', '.join(ENDINGS)}")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help=f"comma-separated, of {', '.join(STRATEGIES)}")
    parser.add_argument("--busy", type=int, default=2, help="other CPU-bound processes kept running meanwhile")
    parser.add_argument("--fix-off", action="store_true", help="switch the exit handler off (comparison)")
    parser.add_argument("--work-dir", help="where exit_campaign.json goes (default: a temporary folder)")
    parser.add_argument("--doc", default=str(DOC), help="markdown file whose exit-campaign section is rewritten")
    parser.add_argument("--no-doc", action="store_true", help="write no documentation")
    args = parser.parse_args(argv)
    endings, strategies = args.endings.split(","), args.strategies.split(",")
    if args.launches < 1 or args.processes < 2 or args.busy < 0:
        parser.error("--launches must be >= 1, --processes >= 2 and --busy >= 0")
    if set(endings) - set(ENDINGS) or set(strategies) - set(STRATEGIES):
        parser.error(f"--endings takes {', '.join(ENDINGS)}; --strategies takes {', '.join(STRATEGIES)}")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="exit-campaign-"))
    work.mkdir(parents=True, exist_ok=True)
    configs = {strategy: write_config(work, strategy, args.processes) for strategy in strategies}

    import accelerate
    import torch

    load_before = os.getloadavg()[0]
    cells = [{"ending": ending, "strategy": strategy, "launches": []} for ending in endings for strategy in strategies]
    summary = {"launches_asked": args.launches, "processes": args.processes, "busy": args.busy,
               "fix_off": args.fix_off, "date": time.strftime("%Y-%m-%d", time.gmtime()),
               "host": f"{platform.machine()} {os.cpu_count()} cores", "torch": torch.__version__,
               "accelerate": accelerate.__version__, "load_before": load_before, "cells": cells}
    spinners = [multiprocessing.Process(target=_spin, args=(index,), daemon=True) for index in range(args.busy)]
    for spinner in spinners:
        spinner.start()
    try:
        for round_index in range(1, args.launches + 1):
            for cell in cells:
                result = one_launch(configs[cell["strategy"]], cell["ending"], args.processes, args.fix_off)
                cell["launches"].append(result)
                status = "ok" if result["ok"] else f"FAILED (exit {result['returncode']}, abort {result['gloo_abort']})"
                print(f"round {round_index}/{args.launches} {cell['ending']} {cell['strategy']}: {status}, "
                      f"{result['seconds']:.1f} s", flush=True)
    except KeyboardInterrupt:
        print("stopped: the launches done so far are reported", flush=True)
    finally:
        for spinner in spinners:
            spinner.terminate()
    summary["load_after"] = os.getloadavg()[0]
    (work / "exit_campaign.json").write_text(json.dumps(summary, indent=1))
    launches = [launch for cell in cells for launch in cell["launches"]]
    failed = sum(not launch["ok"] for launch in launches)
    print(f"{len(launches) - failed}/{len(launches)} launches exited 0 without an abort "
          f"(results: {work / 'exit_campaign.json'})", flush=True)
    if not args.no_doc and launches:
        doc_sections.replace_in_file(args.doc, SECTION, doc_sections.wrap(SECTION, render(summary)))
        print(f"wrote the {SECTION} section of {args.doc}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
