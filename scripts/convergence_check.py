"""One-command convergence check: train a recipe under an FSDP config and under its DDP baseline
with the same seed, data and global batch, then compare the two runs step by step.

    python scripts/convergence_check.py --model MODEL_DIR --data DATA.jsonl \
        --config accelerate_configs/cpu_fsdp2_demo.yaml --output-dir runs/convergence

It writes ``OUTPUT_DIR/{baseline,candidate}/`` (two recipe runs), ``OUTPUT_DIR/report.md``,
``OUTPUT_DIR/overlay.png`` and ``OUTPUT_DIR/comparison.json`` (``fsdp-presets compare --json``),
prints the verdict and exits like ``fsdp-presets compare``: 0 the
runs agree, 1 they diverge, 2 bad input or a launch that failed.

The baseline is ``--baseline CONFIG`` when given, else a DDP config derived from ``--config``
(same processes, machines and mixed precision; no ``fsdp_config``, no HSDP mesh: with
data parallelism only, DDP over all processes has the same data-parallel size, hence the same
global batch). ``--baseline-run DIR`` reuses a baseline run that already exists.

The same command runs on a CPU host (the recipe calls ``fsdp_presets.enable_cpu_fsdp()``: real
FSDP over gloo) and on a GPU node, unchanged. For a multi-node job, run the recipe on every node
with your launcher (scripts/ has SLURM and multi-node launchers) and compare the two run folders
with ``fsdp-presets compare``.

``--resume-at K`` checks exact resume too: the candidate saves every K steps and is killed
(SIGKILL, as a crash would; ``FSDP_PRESETS_FAULT``) during its next save after step K, so that its
last committed checkpoint is step K; a second launch resumes from that checkpoint and trains to
``--max-steps``. The resumed run must still match the uninterrupted baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from fsdp_presets import compare
from fsdp_presets.errors import UsageError
from fsdp_presets.preset.emit import ddp_baseline_of
from fsdp_presets.schema import P, PARALLELISM_CONFIG, T

REPO = Path(__file__).resolve().parent.parent

DEFAULT_RECIPE = REPO / "recipes" / "causal_lm.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train a recipe under an FSDP config and its DDP baseline, then compare them step by step.",
        epilog="Arguments after `--` go to the recipe in both runs.",
    )
    parser.add_argument("--model", required=True, help="model folder (or config) the recipe fine-tunes")
    parser.add_argument("--data", required=True, help="training data file the recipe reads")
    parser.add_argument("--config", required=True, help="accelerate config of the candidate (FSDP)")
    parser.add_argument("--baseline", help="accelerate config of the baseline (default: DDP derived from --config)")
    parser.add_argument("--baseline-run", help="an existing baseline run folder to compare against (no baseline launch)")
    parser.add_argument("--output-dir", default="runs/convergence", help="where both runs, the report and the plot go")
    parser.add_argument("--recipe", default=str(DEFAULT_RECIPE), help="training script (default recipes/causal_lm.py)")
    parser.add_argument("--max-steps", type=int, default=20, help="optimizer steps per run (default 20)")
    parser.add_argument("--seed", type=int, default=1234, help="seed of both runs (default 1234)")
    parser.add_argument("--micro-batch-size", type=int, help="per-process micro-batch (recipe default if unset)")
    parser.add_argument("--gradient-accumulation-steps", type=int, help="accumulation steps (recipe default if unset)")
    parser.add_argument("--learning-rate", type=float, help="learning rate of both runs (recipe default if unset)")
    parser.add_argument("--seq-len", type=int, help="sequence length (recipe default if unset)")
    parser.add_argument("--resume-at", type=int, metavar="K",
                        help="stop the candidate after its checkpoint of step K and resume it in a second launch")
    parser.add_argument("--tolerance", default="auto", help="auto (by precision) or a relative tolerance")
    parser.add_argument("--candidate-args", default="", metavar="ARGS",
                        help="extra recipe arguments for the candidate only (one shell-quoted string)")
    parser.add_argument("--baseline-args", default="", metavar="ARGS",
                        help="extra recipe arguments for the baseline only (one shell-quoted string)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds allowed per launch (default 3600)")
    parser.add_argument("recipe_args", nargs="*", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def load_config(path: str | os.PathLike) -> dict:
    """An accelerate config as a dict, read with the YAML loader accelerate uses."""
    import yaml

    config_path = Path(path)
    if not config_path.is_file():
        raise UsageError(f"accelerate config {config_path} does not exist")
    try:
        config = yaml.safe_load(config_path.read_text())
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise UsageError(f"{config_path} is not valid YAML{where}; give an accelerate config file") from None
    if not isinstance(config, dict) or T.distributed_type not in config:
        raise UsageError(f"{config_path} is not an accelerate config (no distributed_type)")
    return config


def ddp_baseline_config(candidate: dict, source: str) -> tuple[dict, str]:
    """The DDP config that matches a candidate config: same processes, machines and precision.

    Returns (config, header). Raises UsageError when no DDP run can have the candidate's global
    batch (tensor or context parallelism shrink the data-parallel size).
    """
    parallelism = candidate.get(PARALLELISM_CONFIG) or {}
    model_parallel = {
        key: value for key, value in parallelism.items()
        if key in (P.tp_size, P.cp_size, P.sp_size) and int(value or 1) > 1
    }
    if model_parallel:
        raise UsageError(
            f"{source} uses model parallelism ({model_parallel}): DDP over the same processes would have "
            "another data-parallel size and global batch; give the baseline with --baseline"
        )
    if int(candidate.get(T.num_machines, 1) or 1) > 1:
        raise UsageError(
            f"{source} spans {candidate[T.num_machines]} machines: run the recipe on every node with your "
            "launcher, once with this config and once with its DDP baseline, then compare the two run "
            "folders with `fsdp-presets compare`"
        )
    # The machine and precision keys stay; every FSDP- or mesh-specific section goes.
    baseline = ddp_baseline_of(candidate)
    header = (
        f"# DDP baseline of {source}, written by scripts/convergence_check.py: same processes,\n"
        "# machines and mixed precision, no FSDP. Launch: accelerate launch --config_file THIS_FILE RECIPE ...\n"
    )
    return baseline, header


def write_config(config: dict, header: str, path: Path) -> Path:
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + yaml.safe_dump(config, sort_keys=False))
    return path


def recipe_arguments(args: argparse.Namespace, output_dir: Path, max_steps: int, extra: list[str]) -> list[str]:
    """The recipe flags both runs share (only those the user set, so recipe defaults apply alike)."""
    values = [
        ("--model", args.model), ("--data", args.data), ("--output-dir", output_dir),
        ("--max-steps", max_steps), ("--seed", args.seed),
        ("--micro-batch-size", args.micro_batch_size),
        ("--gradient-accumulation-steps", args.gradient_accumulation_steps),
        ("--learning-rate", args.learning_rate), ("--seq-len", args.seq_len),
    ]
    flags = [item for flag, value in values if value is not None for item in (flag, str(value))]
    # A fresh run: never continue a checkpoint found in the folder (a resume is asked explicitly).
    return flags + ["--resume", "none"] + list(args.recipe_args) + extra


def launch(config: Path, recipe: str, recipe_args: list[str], log: Path, timeout: float, label: str,
           extra_env: dict[str, str] | None = None, expect_kill: bool = False) -> None:
    """``accelerate launch`` the recipe, output to a log file; UsageError with its tail when it
    fails (or, with ``expect_kill``, when it finishes although a fault should have stopped it)."""
    from fsdp_harness.launch import launch_command, run_launch_logged

    command = launch_command(config, recipe, recipe_args)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default too: N processes share the cores
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra_env or {})
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    print(f"[{label}] {shlex.join(command)}", flush=True)
    log.write_text(shlex.join(command) + "\n")
    try:
        returncode = run_launch_logged(command, log, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        returncode = None
    elapsed = time.monotonic() - started
    if expect_kill:
        if returncode == 0:
            raise UsageError(f"the {label} launch finished although {extra_env} should have stopped it; "
                             f"output in {log}")
        print(f"[{label}] stopped as planned after {elapsed:.1f} s (log {log})", flush=True)
        return
    if returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-40:])
        print(tail, file=sys.stderr)
        reason = f"timed out after {timeout:.0f} s" if returncode is None else f"exit status {returncode}"
        raise UsageError(f"the {label} launch failed ({reason}); full output in {log}")
    print(f"[{label}] done in {elapsed:.1f} s (log {log})", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return check(args)
    except UsageError as error:
        print(f"convergence_check: error: {error}", file=sys.stderr)
        return 2


def check(args: argparse.Namespace) -> int:
    output = Path(args.output_dir)
    tolerance = compare.parse_tolerance(args.tolerance)
    problems = []
    if not Path(args.recipe).is_file():
        problems.append(f"recipe {args.recipe} does not exist")
    if args.max_steps < 1:
        problems.append(f"--max-steps must be >= 1 (got {args.max_steps})")
    if args.resume_at is not None and not 1 <= args.resume_at < args.max_steps:
        problems.append(f"--resume-at must be between 1 and --max-steps - 1 = {args.max_steps - 1} (got {args.resume_at})")
    if args.baseline and args.baseline_run:
        problems.append("give --baseline (a config to launch) or --baseline-run (a finished run), not both")
    if problems:
        raise UsageError("; ".join(problems))
    candidate_config = Path(args.config)
    load_config(candidate_config)  # fail before any launch
    runs = [output / "candidate"] + ([] if args.baseline_run else [output / "baseline"])
    taken = [str(run) for run in runs if run.exists()]
    if taken:
        raise UsageError(f"{' and '.join(taken)} already exist; choose a new --output-dir (or remove them) "
                         "so that no earlier run is mixed into this check (nothing was run)")

    # ---- baseline -----------------------------------------------------------------------------
    if args.baseline_run:
        baseline_dir = Path(args.baseline_run)
        compare.load_run(baseline_dir)
    else:
        if args.baseline:
            baseline_config = Path(args.baseline)
            load_config(baseline_config)
        else:
            config, header = ddp_baseline_config(load_config(candidate_config), str(candidate_config))
            baseline_config = write_config(config, header, output / "baseline-ddp.yaml")
        baseline_dir = output / "baseline"
        launch(baseline_config, args.recipe,
               recipe_arguments(args, baseline_dir, args.max_steps, shlex.split(args.baseline_args)),
               output / "baseline.log", args.timeout, "baseline")

    # ---- candidate ----------------------------------------------------------------------------
    candidate_dir = output / "candidate"
    extra = shlex.split(args.candidate_args)
    if args.resume_at is None:
        launch(candidate_config, args.recipe, recipe_arguments(args, candidate_dir, args.max_steps, extra),
               output / "candidate.log", args.timeout, "candidate")
    else:
        interrupted_and_resumed(args, candidate_config, candidate_dir, extra, output)

    # ---- compare ------------------------------------------------------------------------------
    comparison = compare.compare_runs(compare.load_run(baseline_dir), compare.load_run(candidate_dir), tolerance)
    plot, report, result = output / "overlay.png", output / "report.md", output / "comparison.json"
    compare.write_plot(comparison, plot)
    compare.write_report(comparison, report, plot_path=plot)
    result.write_text(json.dumps(comparison.to_json(), indent=2) + "\n")
    print("\n".join(compare.summary_lines(comparison)))
    print(f"report: {report}\nplot: {plot}\nresult: {result}")
    return 0 if comparison.agrees else 1


def interrupted_and_resumed(args: argparse.Namespace, config: Path, run_dir: Path, extra: list[str],
                            output: Path) -> None:
    """Train the candidate to step K's checkpoint, kill it in its next save, resume from step K."""
    from fsdp_presets.checkpoint.layout import CHECKPOINTS, step_folder
    from fsdp_presets.checkpoint.manager import verify_checkpoint
    from fsdp_presets.faults import FAULT_ENV

    resume_at = args.resume_at
    # NOTE: the save of step K must commit; the kill comes in the next save (step 2K, or the final
    # save at --max-steps), after every rank wrote its shards and before the manifest: the worst
    # moment, and it leaves step K as the last committed checkpoint.
    kill_step = min(2 * resume_at, args.max_steps)
    save_every = ["--save-every", str(resume_at)]
    recipe_args = recipe_arguments(args, run_dir, args.max_steps, extra) + save_every
    launch(config, args.recipe, recipe_args, output / "candidate-part1.log", args.timeout,
           f"candidate, killed during the save of step {kill_step}",
           extra_env={FAULT_ENV: f"kill-during-save:step={kill_step}"}, expect_kill=True)
    checkpoint = step_folder(run_dir / CHECKPOINTS, resume_at)
    _, problem = verify_checkpoint(checkpoint)
    if problem is not None:
        raise UsageError(f"the interrupted candidate left no usable checkpoint of step {resume_at} "
                         f"({checkpoint}: {problem}); see {output / 'candidate-part1.log'}")
    launch(config, args.recipe, recipe_args + ["--resume", str(checkpoint)], output / "candidate-part2.log",
           args.timeout, f"candidate, resumed from step {resume_at}")


if __name__ == "__main__":
    sys.exit(main())
