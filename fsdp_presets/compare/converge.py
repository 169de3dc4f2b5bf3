"""The convergence check in one call: train a recipe under an FSDP config and under its DDP
baseline with the same seed, data and global batch, then compare the two runs step by step
(``fsdp-presets converge``; ``scripts/convergence_check.py`` calls that command).

    comparison = converge(ConvergeRequest(training=Training(model="runs/models/m", data="train.jsonl"),
                                          config="accelerate_configs/cpu_fsdp2_demo.yaml"))

It writes ``OUTPUT_DIR/{baseline,candidate}/`` (two recipe runs, launched with ``accelerate
launch``), ``OUTPUT_DIR/report.md``, ``OUTPUT_DIR/overlay.png`` and ``OUTPUT_DIR/comparison.json``
(what ``fsdp-presets compare --json`` prints).

The baseline is ``baseline`` (a config) when given, else a DDP config derived from ``config``
(same processes, machines and mixed precision; no ``fsdp_config``, no HSDP mesh: with data
parallelism only, DDP over all processes has the same data-parallel size, hence the same global
batch). ``baseline_run`` reuses a baseline run that already exists.

A TP/EP candidate (``distributed_config``, by default the ``NAME.distributed.json`` that
``generate --tp/--ep`` wrote beside ``config``) trains with ``--distributed-config``; its derived
DDP baseline has one process per TP group, which sees that group's micro-batches, so the global
batch and every step's samples are the same.

``resume_at=K`` checks exact resume too: the candidate saves every K steps and is killed
(SIGKILL, as a crash would; ``FSDP_PRESETS_FAULT``) during its next save after step K, so that its
last committed checkpoint is step K; a second launch resumes from that checkpoint and trains to
``max_steps``. The resumed run must still match the uninterrupted baseline.

Each launch goes through ``runner`` (default :func:`~fsdp_presets.launching.local.run_logged`,
a subprocess): any function with its signature, e.g. one that forks the ranks from a pre-imported
server in tests.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from fsdp_presets.compare.records import load_run
from fsdp_presets.compare.report import summary_lines, write_plot, write_report
from fsdp_presets.compare.runs import Comparison, compare_runs
from fsdp_presets.compare.tolerance import parse_tolerance
from fsdp_presets import flags
from fsdp_presets.errors import UsageError
from fsdp_presets.fileio import CONFIG_MAX_BYTES, read_regular_text, write_text_atomic
from fsdp_presets.launching.local import launch_command, launch_env, run_logged
from fsdp_presets.schema import P, PARALLELISM_CONFIG, T

DEFAULT_RECIPE = "recipes/causal_lm.py"
"""The recipe both runs train, relative to the working directory (a checkout)."""
DEFAULT_MAX_STEPS = 20
DEFAULT_SEED = 1234
DEFAULT_TIMEOUT_S = 3600.0

Runner = Callable[..., int]
"""``runner(command, log, *, env, timeout) -> exit status``, as :func:`run_logged`."""


@dataclass(kw_only=True)
class Training:
    """What both runs train, the same in each. Unset settings (None) leave the recipe's default."""

    model: str
    """The model folder (or config) the recipe fine-tunes."""
    data: str
    """The training data file the recipe reads."""
    recipe: str = DEFAULT_RECIPE
    """The training script."""
    max_steps: int = DEFAULT_MAX_STEPS
    """Optimizer steps per run."""
    seed: int = DEFAULT_SEED
    micro_batch: int | None = None
    grad_accum: int | None = None
    learning_rate: float | None = None
    seq_len: int | None = None
    recipe_args: list[str] = field(default_factory=list)
    """Extra recipe arguments for both runs."""


@dataclass(kw_only=True)
class ConvergeRequest:
    """What to check: the flags of ``fsdp-presets converge``."""

    training: Training
    config: str
    """The candidate's accelerate config (FSDP)."""
    baseline: str | None = None
    """The baseline's accelerate config (default: DDP derived from ``config``)."""
    baseline_run: str | None = None
    """An existing baseline run folder (no baseline launch)."""
    output_dir: str = "runs/convergence"
    """Where both runs, the report, the plot and the JSON result go."""
    resume_at: int | None = None
    """Stop the candidate after its checkpoint of this step and resume it in a second launch."""
    tolerance: str = "auto"
    """``auto`` (by precision) or a relative tolerance (:func:`~fsdp_presets.compare.tolerance.parse_tolerance`)."""
    candidate_args: list[str] = field(default_factory=list)
    """Extra recipe arguments for the candidate only."""
    baseline_args: list[str] = field(default_factory=list)
    """Extra recipe arguments for the baseline only."""
    timeout: float = DEFAULT_TIMEOUT_S
    """Seconds allowed per launch."""
    distributed_config: str | None = None
    """The candidate's TP/EP mesh (``--distributed-config``); default: the one beside ``config``, if any."""


def load_config(path: str | os.PathLike) -> dict:
    """An accelerate config as a dict: a bounded regular file, read as accelerate's YAML loader reads it
    (without anchors, which no config needs and a few of which make gigabytes)."""
    import yaml

    from fsdp_presets.fileio import YAML_MAX_BYTES, load_yaml_data

    config_path = Path(path)
    if not (config_path.exists() or config_path.is_symlink()):
        raise UsageError(f"accelerate config {config_path} does not exist")
    try:
        config = load_yaml_data(read_regular_text(config_path, limit=YAML_MAX_BYTES))
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"accelerate config {config_path}: {error}") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        why = getattr(error, "problem", None) or (str(error).splitlines() or [""])[0]
        raise UsageError(f"{config_path} is not valid YAML{where}: {why}; give an accelerate config file") from None
    if not isinstance(config, dict) or T.distributed_type not in config:
        raise UsageError(f"{config_path} is not an accelerate config (no {T.distributed_type})")
    return config


def ddp_baseline_config(candidate: dict, source: str, *, tp_size: int = 1) -> tuple[dict, str]:
    """The DDP config that matches a candidate config: same processes (``tp_size`` > 1, a mesh
    transformers shards: one per TP group), machines and precision.

    Returns (config, header). Raises UsageError when no DDP run can have the candidate's global
    batch (accelerate's tensor or context parallelism shrink the data-parallel size).
    """
    from fsdp_presets.preset.emit import ddp_baseline_of

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
    processes = "same processes" if tp_size == 1 else f"one process per TP group of {tp_size}"
    header = (
        f"# DDP baseline of {source}, written by `fsdp-presets converge`: {processes},\n"
        "# machines and mixed precision, no FSDP. Launch: accelerate launch --config_file THIS_FILE RECIPE ...\n"
    )
    baseline = ddp_baseline_of(candidate)
    if tp_size > 1:
        processes = int(candidate.get(T.num_processes, 1) or 1)
        if processes % tp_size or processes // tp_size < 1:
            raise UsageError(f"{source}: num_processes {processes} is not a whole number of TP groups of {tp_size} "
                             "(its --distributed-config); regenerate both files for your process count "
                             "(`fsdp-presets generate --gpus N --tp T`)")
        baseline[T.num_processes] = processes // tp_size
    return baseline, header


def candidate_mesh(request: ConvergeRequest) -> tuple[str | None, int]:
    """The candidate's ``--distributed-config`` file (given, or the one ``generate`` wrote beside its
    config) and its TP size; ``(None, 1)`` for FSDP alone."""
    from fsdp_presets.preset.emit_distributed import distributed_config_path

    path = request.distributed_config
    beside = Path(distributed_config_path(request.config))
    if path is None and (beside.exists() or beside.is_symlink()):
        path = str(beside)
    if path is None:
        return None, 1
    try:
        document = json.loads(read_regular_text(path, limit=CONFIG_MAX_BYTES))
        tp_size = int(document.get("tp_size") or 1)
    except (OSError, ValueError, TypeError, AttributeError) as error:
        raise UsageError(f"{flags.DISTRIBUTED_CONFIG.name} {path}: not a DistributedConfig file ({error}); give the "
                         "NAME.distributed.json `fsdp-presets generate --tp N` or `--ep N` wrote") from None
    return path, tp_size


def write_config(config: dict, header: str, path: Path) -> Path:
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, header + yaml.safe_dump(config, sort_keys=False))
    return path


def recipe_arguments(training: Training, output_dir: Path, extra: list[str]) -> list[str]:
    """The recipe flags both runs share (only those the user set, so recipe defaults apply alike)."""
    values = [
        (flags.MODEL, training.model), (flags.DATA, training.data), (flags.OUTPUT_DIR, output_dir),
        (flags.MAX_STEPS, training.max_steps), (flags.SEED, training.seed), (flags.MICRO_BATCH, training.micro_batch),
        (flags.GRAD_ACCUM, training.grad_accum), (flags.LEARNING_RATE, training.learning_rate),
        (flags.SEQ_LEN, training.seq_len),
    ]
    words = [item for flag, value in values if value is not None for item in (flag.name, str(value))]
    # A fresh run: never continue a checkpoint found in the folder (a resume is asked explicitly).
    return words + [flags.RESUME.name, "none"] + list(training.recipe_args) + list(extra)


def _problems(request: ConvergeRequest) -> list[str]:
    problems, training = [], request.training
    if not Path(training.recipe).is_file():
        problems.append(f"recipe {training.recipe} does not exist")
    if training.max_steps < 1:
        problems.append(f"--max-steps must be >= 1 (got {training.max_steps})")
    if request.resume_at is not None and not 1 <= request.resume_at < training.max_steps:
        problems.append(f"--resume-at must be between 1 and --max-steps - 1 = {training.max_steps - 1} "
                        f"(got {request.resume_at})")
    if request.baseline and request.baseline_run:
        problems.append("give --baseline (a config to launch) or --baseline-run (a finished run), not both")
    return problems


@dataclass(kw_only=True)
class _Launcher:
    recipe: str
    timeout: float
    runner: Runner
    say: Callable[[str], None]

    def __call__(self, config: Path, recipe_args: list[str], log: Path, label: str,
                 extra_env: dict[str, str] | None = None, expect_kill: bool = False) -> None:
        """``accelerate launch`` the recipe, output to a log file; UsageError with its tail when it
        fails (or, with ``expect_kill``, when it finishes although a fault should have stopped it)."""
        command = launch_command(config, self.recipe, recipe_args)
        log.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        self.say(f"[{label}] {shlex.join(command)}")
        log.write_text(shlex.join(command) + "\n")
        try:
            returncode = self.runner(command, log, env=launch_env(extra_env, offline=False), timeout=self.timeout)
        except subprocess.TimeoutExpired:
            returncode = None
        elapsed = time.monotonic() - started
        if expect_kill:
            if returncode == 0:
                raise UsageError(f"the {label} launch finished although {extra_env} should have stopped it; "
                                 f"output in {log}")
            self.say(f"[{label}] stopped as planned after {elapsed:.1f} s (log {log})")
            return
        if returncode != 0:
            print("\n".join(log.read_text().splitlines()[-40:]), file=sys.stderr)  # the launch's last lines
            reason = f"timed out after {self.timeout:.0f} s" if returncode is None else f"exit status {returncode}"
            raise UsageError(f"the {label} launch failed ({reason}); full output in {log}")
        self.say(f"[{label}] done in {elapsed:.1f} s (log {log})")


def converge(request: ConvergeRequest, *, runner: Runner = run_logged,
             say: Callable[[str], None] = lambda line: print(line, flush=True)) -> Comparison:
    """Launch the baseline (unless ``baseline_run``) and the candidate, compare them and write the
    report, the plot and the JSON result into ``output_dir``. UsageError on bad input (before any
    launch) or a failed launch; ``say`` gets a line per launch."""
    output = Path(request.output_dir)
    tolerance = parse_tolerance(request.tolerance)
    problems = _problems(request)
    if problems:
        raise UsageError("; ".join(problems))
    candidate_config = Path(request.config)
    load_config(candidate_config)  # fail before any launch
    runs = [output / "candidate"] + ([] if request.baseline_run else [output / "baseline"])
    taken = [str(run) for run in runs if run.exists()]
    if taken:
        raise UsageError(f"{' and '.join(taken)} already exist; choose a new --output-dir (or remove them) "
                         "so that no earlier run is mixed into this check (nothing was run)")
    mesh_file, tp_size = candidate_mesh(request)
    candidate_args = list(request.candidate_args) + ([flags.DISTRIBUTED_CONFIG.name, mesh_file] if mesh_file else [])
    if mesh_file:
        say(f"[candidate] the model sharded over the mesh of {mesh_file}")
    launch = _Launcher(recipe=request.training.recipe, timeout=request.timeout, runner=runner, say=say)

    # ---- baseline -----------------------------------------------------------------------------
    if request.baseline_run:
        baseline_dir = Path(request.baseline_run)
        load_run(baseline_dir)
    else:
        if request.baseline:
            baseline_config = Path(request.baseline)
            load_config(baseline_config)
        else:
            config, header = ddp_baseline_config(load_config(candidate_config), str(candidate_config),
                                                 tp_size=tp_size)
            baseline_config = write_config(config, header, output / "baseline-ddp.yaml")
        baseline_dir = output / "baseline"
        launch(baseline_config, recipe_arguments(request.training, baseline_dir, request.baseline_args),
               output / "baseline.log", "baseline")

    # ---- candidate ----------------------------------------------------------------------------
    candidate_dir = output / "candidate"
    if request.resume_at is None:
        launch(candidate_config, recipe_arguments(request.training, candidate_dir, candidate_args),
               output / "candidate.log", "candidate")
    else:
        _interrupted_and_resumed(request, launch, candidate_config, candidate_dir, output, candidate_args)

    # ---- compare ------------------------------------------------------------------------------
    comparison = compare_runs(load_run(baseline_dir), load_run(candidate_dir), tolerance)
    plot, report, result = output / "overlay.png", output / "report.md", output / "comparison.json"
    write_plot(comparison, plot)
    write_report(comparison, report, plot_path=plot)
    write_text_atomic(result, json.dumps(comparison.to_json(), indent=2) + "\n")
    return comparison


def result_lines(comparison: Comparison, output_dir: str | os.PathLike) -> list[str]:
    """The verdict and where the report, the plot and the JSON result are."""
    output = Path(output_dir)
    return [*summary_lines(comparison), f"report: {output / 'report.md'}", f"plot: {output / 'overlay.png'}",
            f"result: {output / 'comparison.json'}"]


def _interrupted_and_resumed(request: ConvergeRequest, launch: _Launcher, config: Path, run_dir: Path,
                             output: Path, candidate_args: list[str]) -> None:
    """Train the candidate to step K's checkpoint, kill it in its next save, resume from step K."""
    from fsdp_presets.checkpoint.layout import CHECKPOINTS, step_folder
    from fsdp_presets.checkpoint.verify import verify_checkpoint
    from fsdp_presets.faults import FAULT_ENV

    resume_at = request.resume_at
    # NOTE: the save of step K must commit; the kill comes in the next save (step 2K, or the final
    # save at --max-steps), after every rank wrote its shards and before the manifest: the worst
    # moment, and it leaves step K as the last committed checkpoint.
    kill_step = min(2 * resume_at, request.training.max_steps)
    recipe_args = (recipe_arguments(request.training, run_dir, candidate_args)
                   + [flags.SAVE_EVERY.name, str(resume_at)])
    launch(config, recipe_args, output / "candidate-part1.log", f"candidate, killed during the save of step {kill_step}",
           extra_env={FAULT_ENV: f"kill-during-save:step={kill_step}"}, expect_kill=True)
    checkpoint = step_folder(run_dir / CHECKPOINTS, resume_at)
    _, problem = verify_checkpoint(checkpoint)
    if problem is not None:
        raise UsageError(f"the interrupted candidate left no usable checkpoint of step {resume_at} "
                         f"({checkpoint}: {problem}); see {output / 'candidate-part1.log'}")
    launch(config, recipe_args + [flags.RESUME.name, str(checkpoint)], output / "candidate-part2.log",
           f"candidate, resumed from step {resume_at}")
