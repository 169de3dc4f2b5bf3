"""Rehearse a two-node HSDP job on one host: train, lose a node, resume on the node that is left.

    python scripts/rehearse_multinode.py --work-dir runs/rehearsal-multinode
    python scripts/rehearse_multinode.py --work-dir runs/rehearsal-join --drill missing-node --join-timeout 20

Every launch is ``accelerate launch`` of ``recipes/causal_lm.py`` (a tiny Llama built from the
shipped data's words, ``data/kjv_sft``), real FSDP2 over gloo on this host's CPUs:

1. **baseline**: one node, 4 processes, HSDP 2x2 (``parallelism_config``: dp_replicate 2 x
   dp_shard 2), ``--max-steps`` steps.
2. **two nodes**: two ``accelerate launch`` (the per-node commands of
   :func:`fsdp_presets.launchers.accelerate_node_command`: ``--num_machines 2 --machine_rank 0|1
   --main_process_ip 127.0.0.1`` on a free port), 2 processes each, same config and command,
   a checkpoint every 2 steps into the run folder both "nodes" share. During the save of step
   ``--lose-node-at``, rank 2 (on node 1) is killed (``FSDP_PRESETS_FAULT``): node 1 is lost and
   node 0 fails at once (gloo: "connection closed by peer").
3. **one node left**: the same recipe command on one node of 2 processes (FSDP2, gradient
   accumulation 2, so the global batch stays 8 samples) in the same run folder: ``--resume auto``
   skips the unfinished save, loads the last committed checkpoint (written by 4 processes as HSDP
   2x2; DCP reshards it) and trains to the end.

It passes (exit 0) when the two-node losses equal the baseline's (max |difference| <= 1e-6, in
practice bitwise) and the resumed steps continue the run (<= 1e-5 from the baseline: another
process count sums in another order). ``summary.json`` in the work folder holds every loss.

``--drill missing-node`` starts node 0 only: it must fail within ``--join-timeout`` seconds
(torch's static rendezvous, ``--rdzv_conf timeout=N``) with a message that says a node did not
join, instead of waiting for ever.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fsdp_presets.launchers import Job, accelerate_node_command, concrete  # noqa: E402
from fsdp_presets.metrics import train_losses  # noqa: E402
from fsdp_presets.testing import free_port, launch_env  # noqa: E402

ACCELERATE_LAUNCH = (sys.executable, "-m", "accelerate.commands.launch")
NODES, PROCESSES_PER_NODE = 2, 2
MICRO_BATCH = 2  # samples per rank per micro-step: global batch 2 x 4 ranks = 8 samples
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


# ---- setup: model, configs ----
def write_config(path: Path, *, num_processes: int, mesh: tuple[int, int] | None) -> Path:
    """An accelerate config in accelerate's own schema: FSDP2 full shard per decoder layer,
    sharded (DCP) checkpoints, fp32; with ``mesh`` = (replicate, shard) the HSDP preset."""
    config = {
        "compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "num_processes": num_processes,
        "num_machines": mesh[0] if mesh else 1, "machine_rank": 0, "mixed_precision": "no",
        "rdzv_backend": "static", "same_network": True, "use_cpu": False,
        "fsdp_config": {
            "fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer", "fsdp_reshard_after_forward": True,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_cpu_ram_efficient_loading": False,
            "fsdp_offload_params": False, "fsdp_activation_checkpointing": False,
        },
    }
    label = "FSDP2 on 1 node"
    if mesh:
        config["parallelism_config"] = {"parallelism_config_dp_replicate_size": mesh[0],
                                        "parallelism_config_dp_shard_size": mesh[1]}
        label = f"HSDP {mesh[0]}x{mesh[1]}: shard inside a node, replicate across {mesh[0]} nodes"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# {label}, {num_processes} processes (written by scripts/rehearse_multinode.py)\n"
                    + yaml.safe_dump(config, sort_keys=False))
    return path


def recipe_command(model: Path, output_dir: Path, args, *, accumulation: int = 1) -> tuple[str, ...]:
    return ("recipes/causal_lm.py", "--model", str(model), "--data", "data/kjv_sft/train.jsonl",
            "--eval-data", "data/kjv_sft/eval.jsonl", "--output-dir", str(output_dir),
            "--max-steps", str(args.max_steps), "--save-every", "2", "--keep-last", "2", "--seq-len", "32",
            "--micro-batch-size", str(MICRO_BATCH), "--gradient-accumulation-steps", str(accumulation),
            "--learning-rate", "1e-3")


# ---- launches ----
def start_node(job: Job, rank: int, port: int, log: Path, *, join_timeout: int, extra_env=None) -> subprocess.Popen:
    """One "node": the accelerate launch command that the launch scripts run on machine ``rank``."""
    command = concrete(accelerate_node_command(job, rank, main_process_ip="127.0.0.1", main_process_port=port,
                                               join_timeout=join_timeout, program=ACCELERATE_LAUNCH))
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as stream:
        stream.write("$ " + " ".join(command) + "\n")
        stream.flush()
        return subprocess.Popen(command, stdout=stream, stderr=subprocess.STDOUT, cwd=REPO,
                                env=launch_env(extra_env), stdin=subprocess.DEVNULL)


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


def single_node(config: Path, command: tuple[str, ...], processes: int, log: Path) -> int:
    # --num_machines 1: the HSDP config is written for 2 machines; here all 4 processes share one.
    launch = [*ACCELERATE_LAUNCH, "--config_file", str(config), "--num_machines", "1",
              "--num_processes", str(processes),
              "--main_process_port", str(free_port()), *command]
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as stream:
        stream.write("$ " + " ".join(launch) + "\n")
        stream.flush()
        return subprocess.run(launch, stdout=stream, stderr=subprocess.STDOUT, cwd=REPO, env=launch_env(),
                              stdin=subprocess.DEVNULL, timeout=900).returncode


def tail(path: Path, lines: int = 25) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def max_difference(losses: dict[int, float], reference: dict[int, float], steps) -> float:
    return max(abs(losses[step] - reference[step]) for step in steps)


# ---- drills ----
def missing_node(args, work: Path, job: Job) -> int:
    """Node 0 alone: it must give up after the join timeout, saying that a node did not join."""
    log = work / "logs" / "node-0.log"
    started = time.monotonic()
    process = start_node(job, 0, free_port(), log, join_timeout=args.join_timeout)
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


def lost_node(args, work: Path, model: Path) -> int:
    configs = work / "configs"
    hsdp = write_config(configs / "hsdp_2x2.yaml", num_processes=4, mesh=(NODES, PROCESSES_PER_NODE))
    one_node = write_config(configs / "fsdp2_1x2.yaml", num_processes=2, mesh=None)
    run = work / "run"  # the run folder both "nodes" share, as a cluster's shared file system
    summary = {"drill": "lost-node", "max_steps": args.max_steps, "lost_node_at_save_of": args.lose_node_at}
    started = time.monotonic()

    if not args.no_baseline:
        print(f"[1/3] baseline: one node, 4 processes, HSDP 2x2, {args.max_steps} steps", flush=True)
        code = single_node(hsdp, recipe_command(model, work / "baseline", args), 4, work / "logs" / "baseline.log")
        if code != 0:
            print(f"FAILED: the baseline exited with {code}:\n{tail(work / 'logs' / 'baseline.log')}")
            return 1
        summary["baseline"] = train_losses(work / "baseline" / "metrics.jsonl")

    print(f"[2/3] two nodes x 2 processes on 127.0.0.1; node 1 dies during the save of step {args.lose_node_at}",
          flush=True)
    job = Job(config_file=str(hsdp), nodes=NODES, gpus_per_node=PROCESSES_PER_NODE,
              command=recipe_command(model, run, args), join_timeout_s=args.join_timeout)
    port = free_port()
    fault = {"FSDP_PRESETS_FAULT": f"kill-during-save:step={args.lose_node_at}:rank={PROCESSES_PER_NODE}"}
    nodes = [start_node(job, 0, port, work / "logs" / "node-0.log", join_timeout=args.join_timeout),
             start_node(job, 1, port, work / "logs" / "node-1.log", join_timeout=args.join_timeout, extra_env=fault)]
    codes = wait_all(nodes, 900)
    summary["two_nodes_exit_codes"] = codes
    summary["two_nodes"] = train_losses(run / "metrics.jsonl")
    if "[fault] kill" not in (work / "logs" / "node-1.log").read_text(errors="replace") or 0 in codes:
        print(f"FAILED: node 1 was not lost as planned (exit codes {codes}):\n{tail(work / 'logs' / 'node-1.log')}")
        return 1
    resumable = args.lose_node_at - 2
    manifest = json.loads((run / "checkpoints" / f"step-{resumable:08d}" / "manifest.json").read_text())
    summary["checkpoint_mesh"] = {"world_size": manifest["world_size"], "hsdp_mesh": manifest["fsdp"]["hsdp_mesh"]}

    print(f"[3/3] one node left: 2 processes, FSDP2, --resume auto (last committed checkpoint: step {resumable})",
          flush=True)
    code = single_node(one_node, recipe_command(model, run, args, accumulation=2), 2, work / "logs" / "resume.log")
    resume_log = (work / "logs" / "resume.log").read_text(errors="replace")
    summary["resume_exit_code"] = code
    summary["resumed"] = train_losses(run / "metrics.jsonl")
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
    from fsdp_presets.tiny_model import write_tiny_model

    model = write_tiny_model(work / "model", kind="llama",
                             text=(REPO / "data" / "kjv_sft" / "train.jsonl").read_text())
    if args.drill == "missing-node":
        hsdp = write_config(work / "configs" / "hsdp_2x2.yaml", num_processes=4, mesh=(NODES, PROCESSES_PER_NODE))
        job = Job(config_file=str(hsdp), nodes=NODES, gpus_per_node=PROCESSES_PER_NODE,
                  command=recipe_command(model, work / "run", args), join_timeout_s=args.join_timeout)
        return missing_node(args, work, job)
    return lost_node(args, work, model)


if __name__ == "__main__":
    sys.exit(main())
