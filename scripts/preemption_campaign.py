"""Preemption campaign: signal the launcher of a running recipe at random moments (mid-step,
mid-evaluation, mid-save), relaunch it, and check that nothing is lost.

    python scripts/preemption_campaign.py [--trials 20] [--strategies fsdp2,fsdp1] [--doc docs/benchmarks.md]
        [--merge docs/data/preemption_campaign.json] [--minutes M]

Each trial launches ``recipes/causal_lm.py`` (a tiny Llama, 2 gloo processes, 16 steps, an evaluation
every 3 steps, a checkpoint every 4) and sends SIGTERM to the ``accelerate launch`` process, as
``scancel`` or a time limit does: at a random delay after a random step (the moment lands in a step,
an evaluation or a save), or, in every second and third trial of three, as an evaluation starts
(after step 6) or inside the save of step 8 (held there by the ``stall-evaluation`` and
``stall-during-save`` faults). A trial passes when the launcher exits within torchrun's 30 s grace, the
newest committed checkpoint is the step the run reached (at most 1 step lost), metrics.jsonl has its
``preempted`` line, and the same command relaunched (``--resume auto``) finishes with losses equal,
bitwise, to an uninterrupted run of the same strategy.

The strategies take turns (one trial each per round), after one uninterrupted run of each.
Results: ``WORK_DIR/preemption_campaign.json`` (this run) and the ``preemption-campaign`` section of
``docs/benchmarks.md``. ``--merge FILE`` adds this run to the record in FILE (rewritten after every
round; the repository keeps ``docs/data/preemption_campaign.json``; the held moments continue their
turns) and the section reports the whole record: totals, runs, their dates and load averages
(:mod:`fsdp_harness.campaign_record`). ``--minutes M`` starts no round that would end later than M
minutes in. Exit status 1 when any trial failed, 2 when the --merge file is not a record.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fsdp_harness import campaign_record
from fsdp_harness.launch import launch_command, launch_env, write_accelerate_config
from fsdp_harness.tiny_model import write_tiny_model
from fsdp_presets.checkpoint.layout import CHECKPOINTS, METRICS
from fsdp_presets.checkpoint.manager import committed_checkpoints
from fsdp_presets.checkpoint.verify import checkpoint_verdict
from fsdp_presets.faults import FAULT_ENV
from fsdp_presets.train.metrics import read_metrics, train_losses

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "causal_lm.py"
SFT = REPO / "data" / "kjv_sft"
DOC = REPO / "docs" / "benchmarks.md"
RECORD = REPO / "docs" / "data" / "preemption_campaign.json"
STEPS = 16
GRACE_S = 30.0  # torchrun's shutdown timeout (TORCH_ELASTIC_SHUTDOWN_TIMEOUT unset)


def recipe_args(model: Path, output: Path) -> list[str]:
    return ["--model", model, "--data", SFT / "train.jsonl", "--eval-data", SFT / "eval.jsonl", "--max-eval-samples",
            "16", "--output-dir", output, "--seq-len", "32", "--micro-batch", "2", "--max-steps", STEPS,
            "--eval-every", "3", "--save-every", "4", "--keep-last", "3", "--lr-scheduler", "constant_with_warmup",
            "--warmup-steps", "2", "--learning-rate", "3e-3"]


def run(command: list[str], log: Path, env=None) -> int:
    with open(log, "a") as handle:
        return subprocess.run(command, cwd=REPO, env=launch_env(env), stdout=handle, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, timeout=900).returncode


HELD = {"mid-evaluation": ("stall-evaluation:step=6", "[fault] stall at evaluation", "as the evaluation after step 6 starts"),
        "mid-save": ("stall-during-save:step=8", "[fault] stall at during-save", "inside the save of step 8")}


def trial(config: Path, model: Path, output: Path, reference: dict, rng: random.Random, held: str | None) -> dict:
    command = launch_command(config, RECIPE, recipe_args(model, output))
    log = output.with_suffix(".log")
    env = launch_env({FAULT_ENV: HELD[held][0]} if held else None)
    with open(log, "w") as handle:
        launcher = subprocess.Popen(command, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
    after_step, delay = rng.randint(2, STEPS - 4), rng.uniform(0.0, 0.3)
    moment = HELD[held][2] if held else f"{delay:.2f} s after step {after_step}"
    deadline = time.monotonic() + 600
    while launcher.poll() is None and time.monotonic() < deadline:
        if held:
            if HELD[held][1] in log.read_text():
                break
        elif max(train_losses(output / METRICS), default=0) >= after_step:
            time.sleep(delay)
            break
        time.sleep(0.02)
    reached = max(train_losses(output / METRICS), default=0)
    os.kill(launcher.pid, signal.SIGTERM)
    signalled = time.monotonic()
    code = launcher.wait(timeout=120)
    stop_s = time.monotonic() - signalled
    last = max(train_losses(output / METRICS), default=0)
    preempted = [record for record in read_metrics(output / METRICS) if record.get("kind") == "preempted"]
    committed = committed_checkpoints(output / CHECKPOINTS)
    newest = committed[-1][0] if committed else None
    problems = []
    if code != 128 + signal.SIGTERM:
        problems.append(f"launcher exit status {code}")
    if stop_s > GRACE_S:
        problems.append(f"stopped after {stop_s:.1f} s")
    if len(preempted) != 1 or preempted[0]["step"] != newest:
        problems.append(f"preempted lines {preempted}, newest committed {newest}")
    if newest is None or last - newest > 1 or not checkpoint_verdict(committed[-1][1]).ok:
        problems.append(f"newest committed {newest}, last logged step {last}")
    resumed = run(command, log)
    if resumed != 0:
        problems.append(f"relaunch exit status {resumed}")
    if train_losses(output / METRICS) != reference:
        problems.append("losses differ from the uninterrupted run")
    return {"moment": moment, "step_seen_at_signal": reached, "preempted_at": newest, "last_logged": last,
            "stop_s": round(stop_s, 2), "launcher_status": code, "load": round(os.getloadavg()[0], 2),
            "ok": not problems, "problems": problems}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20, help="trials per strategy")
    parser.add_argument("--strategies", default="fsdp2,fsdp1")
    parser.add_argument("--seed", type=int, default=0, help="of the random moments (mixed with the number of "
                        "runs already in the --merge record, so an added run draws new moments)")
    parser.add_argument("--merge", metavar="FILE", help="add this run to the campaign record in FILE (created when "
                        f"missing; the repository's is {RECORD.relative_to(REPO)}) and report the total")
    parser.add_argument("--minutes", type=float, help="start no round (one trial per strategy) that would end after "
                        "this many minutes (judged by the last round's time)")
    parser.add_argument("--work-dir")
    parser.add_argument("--doc", default=str(DOC))
    parser.add_argument("--no-doc", action="store_true")
    args = parser.parse_args(argv)
    strategies = args.strategies.split(",")
    if args.trials < 1 or set(strategies) - {"fsdp1", "fsdp2"} or (args.minutes is not None and args.minutes <= 0):
        parser.error("--trials must be >= 1, --minutes > 0 and --strategies a list of fsdp1, fsdp2")
    settings = {"steps": STEPS}
    try:
        previous = campaign_record.load(args.merge, "preemption") if args.merge else None
        if previous is not None:
            campaign_record.check_settings(previous, settings)
    except campaign_record.RecordError as error:
        print(f"preemption_campaign.py: {error}", file=sys.stderr)
        return 2
    done = campaign_record.counts(previous) if previous else {}
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="preemption-campaign-"))
    work.mkdir(parents=True, exist_ok=True)
    model = write_tiny_model(work / "tiny-llama", kind="llama-tied", text=(SFT / "train.jsonl").read_text(),
                             max_positions=128)
    rng = random.Random(f"{args.seed}:{len(previous['runs']) if previous else 0}")
    cells = [{"strategy": strategy, "items": []} for strategy in strategies]
    this_run = {"started": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), "per_cell_asked": args.trials,
                "seed": args.seed, "load_before": os.getloadavg()[0], "commit": campaign_record.commit(REPO)}
    record = campaign_record.new_record("preemption", settings, this_run, cells)

    def save() -> dict:
        return campaign_record.save_run(record, this_run, path=work / "preemption_campaign.json", previous=previous,
                                        merge_into=args.merge)

    started, round_s = time.monotonic(), 0.0
    try:
        configs, references = {}, {}
        for strategy in strategies:
            configs[strategy] = write_accelerate_config(work / f"{strategy}.yaml", num_processes=2,
                                                        fsdp={"version": int(strategy[-1])})
            reference_dir = work / f"reference-{strategy}"
            if run(launch_command(configs[strategy], RECIPE, recipe_args(model, reference_dir)), work / f"{strategy}.log"):
                raise SystemExit(f"the uninterrupted {strategy} run failed: see {work / f'{strategy}.log'}")
            references[strategy] = train_losses(reference_dir / METRICS)
        for index in range(args.trials):
            if args.minutes is not None and time.monotonic() - started + round_s > args.minutes * 60:
                print(f"stopped before round {index + 1}: it would not end within --minutes {args.minutes:g}", flush=True)
                break
            round_started = time.monotonic()
            for cell in cells:
                strategy = cell["strategy"]
                turn = done.get((strategy,), 0) + index  # the held moments take turns across runs too
                result = trial(configs[strategy], model, work / f"{strategy}-{index}", references[strategy], rng,
                               held=(None, "mid-evaluation", "mid-save")[turn % 3])
                cell["items"].append(result)
                print(f"{strategy} trial {index + 1}/{args.trials}: {'ok' if result['ok'] else 'FAILED'} "
                      f"({result['moment']}: preempted at {result['preempted_at']}, {result['stop_s']} s, load "
                      f"{result['load']:.1f}) {'; '.join(result['problems'])}", flush=True)
            round_s = time.monotonic() - round_started
            save()
    except KeyboardInterrupt:
        print("stopped: the trials done so far are reported", flush=True)
    total = save()
    trials = [item for cell in cells for item in cell["items"]]
    failed = sum(not item["ok"] for item in trials)
    print(f"{len(trials) - failed}/{len(trials)} trials passed ({work / 'preemption_campaign.json'}"
          f"{'; record: ' + args.merge if args.merge else ''})", flush=True)
    if not args.no_doc and trials:
        shown = campaign_record.shown_path(args.merge or work / "preemption_campaign.json", REPO)
        campaign_record.write_section(args.doc, total, shown)
    return 1 if failed else 0

if __name__ == "__main__":
    raise SystemExit(main())
