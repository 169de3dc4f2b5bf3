"""Rehearse a two-node HSDP job on one host: train, lose a node, resume on the node that is left.

    python scripts/rehearse_multinode.py --work-dir runs/rehearsal-multinode
    python scripts/rehearse_multinode.py --work-dir runs/rehearsal-join --drill missing-node --join-timeout 20

Every launch is ``accelerate launch`` of ``recipes/causal_lm.py`` (a tiny Llama built from the
shipped data's words, ``data/kjv_sft``), real FSDP2 over gloo on this host's CPUs. The configs
and the launch script are the ones users get: ``fsdp-presets generate MODEL --device cpu --gpus 4
--nodes 2 --launcher accelerate`` (the HSDP 2x2 preset: dp_replicate 2 nodes x dp_shard 2, and
its per-node script), and ``fsdp-presets generate --from`` it for 1 node of 2 (the node left). Both
run in this process, with their command line as ``sys.argv``, as the console script runs them.

1. **baseline**: one node, 4 processes, the HSDP 2x2 preset, ``--max-steps`` steps (forked from a
   pre-imported server when ``FSDP_HARNESS_FORKED_LAUNCH=1``, as the test suite sets: tests/conftest.py).
2. **two nodes**: the generated per-node script, run twice (``bash SCRIPT 0`` and ``bash SCRIPT
   1`` with ``MAIN_PROCESS_IP=127.0.0.1`` and a free ``MAIN_PROCESS_PORT``): two ``accelerate
   launch --num_machines 2 --machine_rank 0|1`` of 2 processes each, checkpoints every 2 steps
   into the run folder both "nodes" share. During the save of step ``--lose-node-at``, rank 2 (on
   node 1) is killed (``FSDP_PRESETS_FAULT``): node 1 is lost and node 0 fails at once (gloo:
   "connection closed by peer").
3. **one node left**: the same recipe on one node of 2 processes (the rescaled preset: FSDP2
   full shard, micro-batch 4, so the global batch stays 8 samples) in the same run folder:
   ``--resume auto`` skips the unfinished save, loads the last committed checkpoint (written by 4
   processes as HSDP 2x2; DCP reshards it) and trains to the end.

It passes (exit 0) when the two-node losses equal the baseline's (max |difference| <= 1e-6, in
practice bitwise) and the resumed steps continue the run (<= 1e-5 from the baseline: another
process count sums in another order). ``summary.json`` in the work folder holds every loss.

``--drill missing-node`` starts node 0 only: it must fail within ``--join-timeout`` seconds
(``JOIN_TIMEOUT`` of the script: torch's static rendezvous, ``--rdzv_conf timeout=N``) with a
message that says a node did not join, instead of waiting for ever.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from fsdp_harness.launch import launch_env, run_launch_logged
from fsdp_presets.launching.local import free_port
from fsdp_presets.checkpoint.layout import MANIFEST, METRICS, RunFolder
from fsdp_presets.train.metrics import train_losses

REPO = Path(__file__).resolve().parent.parent

ACCELERATE_LAUNCH = (sys.executable, "-m", "accelerate.commands.launch")
NODES, PROCESSES_PER_NODE = 2, 2
GLOBAL_BATCH = 8  # samples per optimizer step: micro-batch 2 x 4 ranks, or 4 x 2 ranks after the loss
SEQ_LEN = 32
SAME_RUN_TOLERANCE = 1e-6  # same ranks, same collectives: equal (field notes: FSDP vs 1 process 9.5e-7)
RESUME_TOLERANCE = 1e-5  # 2 instead of 4 ranks, 2 micro-steps: other summation order (notes: within 1e-6)
# torch's static rendezvous, when the other nodes do not come: "Timed out after N seconds waiting
# for clients. 1/2 clients joined." (torch/distributed/elastic/rendezvous/static_tcp_rendezvous.py)
JOIN_FAILURE = "waiting for clients"


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", default="runs/rehearsal-multinode", help="folder for everything (emptied)")
    parser.add_argument("--drill", choices=("lost-node", "missing-node"), default="lost-node",
                        help="lost-node: the full rehearsal; missing-node: node 1 never starts")
    parser.add_argument("--max-steps", type=int, default=6, help="optimizer steps of the run")
    parser.add_argument("--lose-node-at", type=int, default=4,
                        help="node 1 dies during the save of this step (even, < --max-steps)")
    parser.add_argument("--join-timeout", type=int, default=60,
                        help="seconds node 0 waits for node 1 to join (--rdzv_conf timeout=N)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the single-node 4-process run")
    args = parser.parse_args()
    if args.lose_node_at % 2 or not 2 < args.lose_node_at < args.max_steps:
        parser.error("--lose-node-at must be even (checkpoints every 2 steps), > 2 and < --max-steps")
    return args


# ---- setup: presets and launch script ----
def run_logged(command: list[str], log: Path, *, env=None, timeout: float = 900) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as stream:
        stream.write("$ " + " ".join(command) + "\n")
        stream.flush()
        return subprocess.run(command, stdout=stream, stderr=subprocess.STDOUT, cwd=REPO, stdin=subprocess.DEVNULL,
                              env=launch_env(env), timeout=timeout).returncode


def generate_presets(work: Path, model: Path, args, *, rescaled: bool = True) -> tuple[Path, Path, Path]:
    """``fsdp-presets generate``: the HSDP 2x2 preset with its per-node launch script, and the
    preset rescaled to the one node left. Returns (HSDP config, its launch script, 1-node config)."""
    hsdp, one_node = work / "configs" / "hsdp_2x2.yaml", work / "configs" / "fsdp2_1x2.yaml"
    script = work / "configs" / "hsdp_2x2.accelerate.sh"
    log = work / "logs" / "generate.log"
    command = " ".join(recipe_command(model, work / "run", args, micro_batch=2))
    steps = [["generate", str(model), "--device", "cpu", "--gpus", str(NODES * PROCESSES_PER_NODE),
              "--nodes", str(NODES), "--seq-len", str(SEQ_LEN), "--global-batch", str(GLOBAL_BATCH), "-o", str(hsdp),
              "--launcher", "accelerate", "--command", command, "--join-timeout", str(args.join_timeout),
              "--launch-output", str(script)],
             ["generate", "--from", str(hsdp), "--gpus", str(PROCESSES_PER_NODE), "--nodes", "1", "-o", str(one_node)]]
    for step in steps if rescaled else steps[:1]:
        if fsdp_presets_command(step, log) != 0:
            raise SystemExit(f"FAILED: fsdp-presets generate failed:\n{tail(log)}")
    return hsdp, script, one_node


def fsdp_presets_command(argv: list[str], log: Path) -> int:
    """``fsdp-presets ARGV`` in this process (which has imported torch and transformers already:
    a child process would import them again), its output appended to ``log``, its command line in
    ``sys.argv`` (a generated script's ``# Made by:`` line) while it runs."""
    from fsdp_presets import cli

    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as stream:
        stream.write("$ fsdp-presets " + " ".join(argv) + "\n")
        stream.flush()
        saved_argv, sys.argv = sys.argv, ["fsdp-presets", *argv]
        try:
            with contextlib.redirect_stdout(stream), contextlib.redirect_stderr(stream):
                return cli.main(argv)
        finally:
            sys.argv = saved_argv


def recipe_command(model: Path, output_dir: Path, args, *, micro_batch: int) -> tuple[str, ...]:
    """The training command (constant learning rate is not needed: the run keeps --max-steps)."""
    return ("recipes/causal_lm.py", "--model", str(model), "--data", "data/kjv_sft/train.jsonl",
            "--eval-data", "data/kjv_sft/eval.jsonl", "--output-dir", str(output_dir),
            "--max-steps", str(args.max_steps), "--save-every", "2", "--keep-last", "2", "--seq-len", str(SEQ_LEN),
            "--micro-batch", str(micro_batch), "--learning-rate", "1e-3")


# ---- launches ----
def start_node(script: Path, rank: int, port: int, log: Path, *, join_timeout: int, extra_env=None) -> subprocess.Popen:
    """One "node": the generated per-node script, as a user runs it on machine ``rank``."""
    settings = {"MAIN_PROCESS_IP": "127.0.0.1", "MAIN_PROCESS_PORT": str(port), "JOIN_TIMEOUT": str(join_timeout),
                # the script runs `accelerate`: this interpreter's, as on a cluster node with the venv active
                "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", **(extra_env or {})}
    command = ["bash", str(script), str(rank)]
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as stream:
        stream.write("$ " + " ".join(f"{key}={value}" for key, value in settings.items() if key != "PATH")
                     + " " + " ".join(command) + "\n")
        stream.flush()
        return subprocess.Popen(command, stdout=stream, stderr=subprocess.STDOUT, cwd=REPO,
                                env=launch_env(settings), stdin=subprocess.DEVNULL)


def wait_all(processes: list[subprocess.Popen], deadline_s: float) -> list[int]:
    """Exit codes; processes still running at the deadline are killed (a rehearsal never hangs)."""
    end = time.monotonic() + deadline_s
    codes = []
    for process in processes:
        try:
            codes.append(process.wait(timeout=max(1.0, end - time.monotonic())))
        except subprocess.TimeoutExpired:
            process.kill()
            codes.append(process.wait())
    return codes


def single_node(config: Path, command: tuple[str, ...], processes: int, log: Path, *, reference: bool = False) -> int:
    """One node's ``accelerate launch``. ``reference``: a run that only gives the numbers the
    rehearsal is compared with, which forks from a pre-imported server where the test suite asks
    for it (``FSDP_HARNESS_FORKED_LAUNCH=1``: the same launch, less CPU; tests/conftest.py)."""
    # --num_machines 1: the HSDP preset says 2 machines; for the baseline all 4 processes share one.
    line = [*ACCELERATE_LAUNCH, "--config_file", str(config), "--num_machines", "1",
            "--num_processes", str(processes), "--main_process_port", str(free_port()), *command]
    if not reference:
        return run_logged(line, log)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as stream:
        stream.write("$ " + " ".join(line) + "\n")
    return run_launch_logged(line, log, env=launch_env(), timeout=900, cwd=REPO)


def tail(path: Path, lines: int = 25) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def max_difference(losses: dict[int, float], reference: dict[int, float], steps) -> float:
    return max(abs(losses[step] - reference[step]) for step in steps)


# ---- drills ----
def missing_node(args, work: Path, script: Path) -> int:
    """Node 0 alone: it must give up after the join timeout, saying that a node did not join."""
    log = work / "logs" / "node-0.log"
    started = time.monotonic()
    process = start_node(script, 0, free_port(), log, join_timeout=args.join_timeout)
    [code] = wait_all([process], args.join_timeout + 180)
    elapsed = time.monotonic() - started
    output = log.read_text(errors="replace")
    reason = next((line.strip() for line in output.splitlines() if JOIN_FAILURE in line), None)
    summary = {"drill": "missing-node", "exit_code": code, "elapsed_s": round(elapsed, 1),
               "join_timeout_s": args.join_timeout, "reason": reason}
    (work / "summary.json").write_text(json.dumps(summary, indent=2))
    if code != 0 and reason:
        print(f"node 0 gave up after {elapsed:.0f} s (join timeout {args.join_timeout} s): node 1 never "
              f"joined the rendezvous at 127.0.0.1. torch: {reason.split('DistStoreError:')[-1].strip()}")
        return 0
    print(f"FAILED: node 0 exited with {code} after {elapsed:.0f} s without the join-timeout message:\n{tail(log)}")
    return 1


def lost_node(args, work: Path, model: Path, hsdp: Path, script: Path, one_node: Path) -> int:
    run = work / "run"  # the run folder both "nodes" share, as a cluster's shared file system
    summary = {"drill": "lost-node", "max_steps": args.max_steps, "lost_node_at_save_of": args.lose_node_at}
    started = time.monotonic()

    if not args.no_baseline:
        print(f"[1/3] baseline: one node, 4 processes, HSDP 2x2, {args.max_steps} steps", flush=True)
        code = single_node(hsdp, recipe_command(model, work / "baseline", args, micro_batch=2), 4,
                           work / "logs" / "baseline.log", reference=True)
        if code != 0:
            print(f"FAILED: the baseline exited with {code}:\n{tail(work / 'logs' / 'baseline.log')}")
            return 1
        summary["baseline"] = train_losses(work / "baseline" / METRICS)

    print(f"[2/3] two nodes x 2 processes on 127.0.0.1; node 1 dies during the save of step {args.lose_node_at}",
          flush=True)
    port = free_port()
    fault = {"FSDP_PRESETS_FAULT": f"kill-during-save:step={args.lose_node_at}:rank={PROCESSES_PER_NODE}"}
    nodes = [start_node(script, 0, port, work / "logs" / "node-0.log", join_timeout=args.join_timeout),
             start_node(script, 1, port, work / "logs" / "node-1.log", join_timeout=args.join_timeout,
                        extra_env=fault)]
    codes = wait_all(nodes, 900)
    summary["two_nodes_exit_codes"] = codes
    summary["two_nodes"] = train_losses(run / METRICS)
    if "[fault] kill" not in (work / "logs" / "node-1.log").read_text(errors="replace") or 0 in codes:
        print(f"FAILED: node 1 was not lost as planned (exit codes {codes}):\n{tail(work / 'logs' / 'node-1.log')}")
        return 1
    resumable = args.lose_node_at - 2
    manifest = json.loads((RunFolder(root=run).step(resumable) / MANIFEST).read_text())
    summary["checkpoint_mesh"] = {"world_size": manifest["world_size"], "hsdp_mesh": manifest["fsdp"]["hsdp_mesh"]}

    print(f"[3/3] one node left: 2 processes, the rescaled preset, --resume auto (last committed checkpoint: "
          f"step {resumable})", flush=True)
    # micro-batch 4 x 2 ranks: the rescaled preset's choice, the same 8 samples per step
    code = single_node(one_node, recipe_command(model, run, args, micro_batch=4), 2, work / "logs" / "resume.log")
    resume_log = (work / "logs" / "resume.log").read_text(errors="replace")
    summary["resume_exit_code"] = code
    summary["resumed"] = train_losses(run / METRICS)
    summary["resume_message"] = next((line for line in resume_log.splitlines() if line.startswith("resumed from")), None)
    summary["elapsed_s"] = round(time.monotonic() - started, 1)
    (work / "summary.json").write_text(json.dumps(summary, indent=2))
    if code != 0:
        print(f"FAILED: the resume exited with {code}:\n{tail(work / 'logs' / 'resume.log')}")
        return 1

    # ---- verdict ----
    two_nodes, resumed = summary["two_nodes"], summary["resumed"]
    trained_on_two = sorted(two_nodes)
    continued = list(range(resumable + 1, args.max_steps + 1))
    problems = []
    if trained_on_two != list(range(1, args.lose_node_at + 1)):
        problems.append(f"the two nodes logged steps {trained_on_two}, expected 1..{args.lose_node_at}")
    if sorted(resumed) != list(range(1, args.max_steps + 1)):
        problems.append(f"the resumed run folder holds steps {sorted(resumed)}, expected 1..{args.max_steps}")
    if not summary["resume_message"] or f"step {resumable}," not in summary["resume_message"]:
        problems.append(f"the single node did not resume from step {resumable} ({summary['resume_message']})")
    print(f"\n{'step':>4}  {'baseline 1x4':>14}  {'two nodes 2x2':>14}  {'one node left':>14}")
    baseline = summary.get("baseline", {})
    for step in range(1, args.max_steps + 1):
        cells = [baseline.get(step), two_nodes.get(step) if step <= args.lose_node_at else None,
                 resumed.get(step) if step > resumable else None]
        print(f"{step:>4}  " + "  ".join(f"{value:14.8f}" if value is not None else f"{'':>14}" for value in cells))
    if not problems and baseline:
        summary["two_nodes_vs_baseline"] = max_difference(two_nodes, baseline, trained_on_two)
        summary["resumed_vs_baseline"] = max_difference(resumed, baseline, continued)
        if summary["two_nodes_vs_baseline"] > SAME_RUN_TOLERANCE:
            problems.append(f"two nodes differ from one node by {summary['two_nodes_vs_baseline']:.2e} "
                            f"(> {SAME_RUN_TOLERANCE:.0e})")
        if summary["resumed_vs_baseline"] > RESUME_TOLERANCE:
            problems.append(f"the resumed steps differ from the uninterrupted run by "
                            f"{summary['resumed_vs_baseline']:.2e} (> {RESUME_TOLERANCE:.0e})")
        print(f"\ntwo nodes vs one node: max |loss difference| {summary['two_nodes_vs_baseline']:.2e} "
              f"(steps 1-{args.lose_node_at})")
        print(f"resumed on one node vs uninterrupted: {summary['resumed_vs_baseline']:.2e} "
              f"(steps {continued[0]}-{continued[-1]})")
    (work / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"checkpoint of step {resumable}: written by {manifest['world_size']} processes, mesh "
          f"{manifest['fsdp']['hsdp_mesh']}; {summary['resume_message']}")
    if problems:
        print("FAILED: " + "; ".join(problems))
        return 1
    print(f"rehearsal passed in {summary['elapsed_s']:.0f} s; logs and summary.json in {work}")
    return 0


def main() -> int:
    args = parse_args()
    work = Path(args.work_dir).resolve()
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    from fsdp_harness.tiny_model import write_tiny_model

    model = write_tiny_model(work / "model", kind="llama",
                             text=(REPO / "data" / "kjv_sft" / "train.jsonl").read_text())
    hsdp, script, one_node = generate_presets(work, model, args, rescaled=args.drill == "lost-node")
    if args.drill == "missing-node":
        return missing_node(args, work, script)
    return lost_node(args, work, model, hsdp, script, one_node)


if __name__ == "__main__":
    sys.exit(main())
