"""Exit campaign: launch small user scripts with each way a script ends, under DDP, FSDP1 and FSDP2;
every finished training must exit 0.

    python scripts/exit_campaign.py [--launches 50] [--busy 2] [--endings none,end-training,...]
        [--strategies ddp,fsdp1,fsdp2] [--parallel 1] [--fix-off] [--merge docs/data/exit_campaign.json]
        [--minutes M] [--doc docs/benchmarks.md]

Each launch runs ``tests/workers/script_endings.py --ending ENDING`` (``enable_cpu_fsdp()``, a tiny
Llama, 3 steps, then ``none``: the script just returns; ``end-training``: ``accelerator.end_training()``;
``delete``: ``del model, optimizer`` then ``end_training()``; ``trainer-end``: a ``transformers.Trainer``
trains and ``trainer.end()``; ``trainer-save``: a Trainer with ``FSDPPresetsCallback`` trains and the script
ends with ``trainer.save_model(dir)``) through ``accelerate launch`` with 2 gloo processes. ``--launches`` is per
ending and strategy; the cells take turns, so a campaign cut short still covers each of them. A
launch passes when the launcher exits 0, every rank printed that it trained, and nobody printed
gloo's exit abort ("terminate called without an active exception"). ``--busy K`` keeps K other
CPU-bound processes running during the campaign (a loaded host makes the abort likelier);
``--parallel P`` keeps P launches running at a time (each round's launches still start in the cells'
order), so that a launch also shares the host with P - 1 others: a busier host, and on a few cores
more launches per hour than one at a time beside the busy processes.
``--fix-off`` switches :mod:`fsdp_presets.clean_exit` off, for comparison.

Results: ``WORK_DIR/exit_campaign.json`` (this run) and, unless ``--no-doc``, the ``exit-campaign``
section of ``docs/benchmarks.md`` (rewritten in place). ``--merge FILE`` adds this run to the record in
FILE (rewritten after every round; the repository keeps ``docs/data/exit_campaign.json``) and the
section reports the whole record: totals, runs, their dates and load averages
(:mod:`fsdp_harness.campaign_record`); runs with other settings (``--fix-off``, ``--processes``) are
refused (exit status 2). ``--minutes M`` starts no round that would end later than M minutes in.
Exit status 1 when any launch failed. About 15-45 s per launch on a loaded 2-core host; with
``--parallel 4 --busy 2`` there, 45-65 s each, a launch finished every 12-17 s.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fsdp_harness import campaign_record
from fsdp_harness.launch import launch_env, write_accelerate_config
from fsdp_presets.launching.local import launch_command
from fsdp_presets.clean_exit import CLEAN_EXIT

REPO = Path(__file__).resolve().parent.parent

WORKER = REPO / "tests" / "workers" / "script_endings.py"
ENDINGS = campaign_record.EXIT_ENDINGS
STRATEGIES = campaign_record.EXIT_STRATEGIES
DOC = REPO / "docs" / "benchmarks.md"
RECORD = REPO / "docs" / "data" / "exit_campaign.json"
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
            "seconds": round(time.perf_counter() - started, 2), "load": round(os.getloadavg()[0], 2), "ok": ok,
            "tail": "" if ok else output[-3000:]}


def _spin(_: int) -> None:
    while True:
        pass


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=50, help="launches per ending and strategy")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--endings", default=",".join(ENDINGS), help=f"comma-separated, of {', '.join(ENDINGS)}")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help=f"comma-separated, of {', '.join(STRATEGIES)}")
    parser.add_argument("--busy", type=int, default=2, help="other CPU-bound processes kept running meanwhile")
    parser.add_argument("--parallel", type=int, default=1, help="launches running at a time")
    parser.add_argument("--fix-off", action="store_true", help="switch the exit handler off (comparison)")
    parser.add_argument("--merge", metavar="FILE", help="add this run to the campaign record in FILE (created when "
                        f"missing; the repository's is {RECORD.relative_to(REPO)}) and report the total")
    parser.add_argument("--minutes", type=float, help="start no round that would end after this many minutes "
                        "(judged by the last round's time), so every cell gets the same count")
    parser.add_argument("--work-dir", help="where exit_campaign.json goes (default: a temporary folder)")
    parser.add_argument("--doc", default=str(DOC), help="markdown file whose exit-campaign section is rewritten")
    parser.add_argument("--no-doc", action="store_true", help="write no documentation")
    args = parser.parse_args(argv)
    endings, strategies = args.endings.split(","), args.strategies.split(",")
    if args.launches < 1 or args.processes < 2 or args.busy < 0 or args.parallel < 1 or \
            (args.minutes is not None and args.minutes <= 0):
        parser.error("--launches must be >= 1, --processes >= 2, --busy >= 0, --parallel >= 1 and --minutes > 0")
    if set(endings) - set(ENDINGS) or set(strategies) - set(STRATEGIES):
        parser.error(f"--endings takes {', '.join(ENDINGS)}; --strategies takes {', '.join(STRATEGIES)}")
    settings = {"processes": args.processes, "fix_off": args.fix_off}
    try:
        previous = campaign_record.load(args.merge, "exit") if args.merge else None
        if previous is not None:
            campaign_record.check_settings(previous, settings)
    except campaign_record.RecordError as error:
        print(f"exit_campaign.py: {error}", file=sys.stderr)
        return 2
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="exit-campaign-"))
    work.mkdir(parents=True, exist_ok=True)
    configs = {strategy: write_config(work, strategy, args.processes) for strategy in strategies}

    import accelerate
    import torch

    cells = [{"ending": ending, "strategy": strategy, "items": []} for ending in endings for strategy in strategies]
    this_run = {"started": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), "host": f"{platform.machine()} "
                f"{os.cpu_count()} cores", "torch": torch.__version__, "accelerate": accelerate.__version__,
                "busy": args.busy, "parallel": args.parallel, "per_cell_asked": args.launches,
                "load_before": os.getloadavg()[0],
                "commit": campaign_record.commit(REPO)}
    record = campaign_record.new_record("exit", settings, this_run, cells)

    def save() -> dict:
        return campaign_record.save_run(record, this_run, path=work / "exit_campaign.json", previous=previous,
                                        merge_into=args.merge)

    spinners = [multiprocessing.Process(target=_spin, args=(index,), daemon=True) for index in range(args.busy)]
    for spinner in spinners:
        spinner.start()
    started, round_s = time.monotonic(), 0.0
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=args.parallel)
    try:
        for round_index in range(1, args.launches + 1):
            if args.minutes is not None and time.monotonic() - started + round_s > args.minutes * 60:
                print(f"stopped before round {round_index}: it would not end within --minutes {args.minutes:g}",
                      flush=True)
                break
            round_started = time.monotonic()
            futures = [pool.submit(one_launch, configs[cell["strategy"]], cell["ending"], args.processes, args.fix_off)
                       for cell in cells]
            for cell, future in zip(cells, futures):
                result = future.result()
                cell["items"].append(result)
                status = "ok" if result["ok"] else f"FAILED (exit {result['returncode']}, abort {result['gloo_abort']})"
                print(f"round {round_index}/{args.launches} {cell['ending']} {cell['strategy']}: {status}, "
                      f"{result['seconds']:.1f} s, load {result['load']:.1f}", flush=True)
            round_s = time.monotonic() - round_started
            save()
    except KeyboardInterrupt:
        print("stopped: the launches done so far are reported", flush=True)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        for spinner in spinners:
            spinner.terminate()
    total = save()
    launches = [launch for cell in cells for launch in cell["items"]]
    failed = sum(not launch["ok"] for launch in launches)
    print(f"{len(launches) - failed}/{len(launches)} launches exited 0 without an abort (results: "
          f"{work / 'exit_campaign.json'}{'; record: ' + args.merge if args.merge else ''})", flush=True)
    if not args.no_doc and launches:
        shown = args.merge or str(work / "exit_campaign.json")
        name = campaign_record.write_section(args.doc, total, campaign_record.shown_path(shown, REPO))
        print(f"wrote the {name} section of {args.doc}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
