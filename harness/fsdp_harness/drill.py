"""Fault drills: kill one rank of a running recipe, resume it, and time the recovery.

    plan = KillPlan(rank=1, mode="timer", after_step=5, delay_s=0.4)
    result = kill_and_resume(command, run_dir=Path("runs/x"), plan=plan)
    result.recovery_s, result.steps_lost, result.problems

``command`` is the full ``accelerate launch ... recipes/causal_lm.py ... --output-dir RUN_DIR``
line of a recipe that follows the run-folder contract (``metrics.jsonl``, ``run.json`` with
``resumed_from``, committed ``checkpoints/step-NNNNNNNN`` with manifests). The drill:

1. starts it and kills rank ``plan.rank`` with SIGKILL (no handler, no cleanup: what the
   out-of-memory killer or a lost node does), either ``timer``: ``delay_s`` seconds after the
   ``after_step`` line appears in ``metrics.jsonl`` (mid-step or mid-save, depending on where
   the delay lands), or ``during-save``: at the :mod:`fsdp_presets.faults` point inside the save
   of step ``after_step`` (shards written, manifest not yet);
2. waits for the launcher to give up (it stops the other ranks);
3. starts the same command again (the recipe's ``--resume auto`` picks the newest valid
   checkpoint) and notes when the first new optimizer step is logged.

The recovery time is kill to first new step: launcher tear-down, start-up, checkpoint load and
one step. ``problems`` lists what went wrong for the caller to judge, above all a resume from
anything older than the newest checkpoint committed before the kill (a lost checkpoint).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from fsdp_presets.checkpoint.layout import CHECKPOINTS, METRICS, step_of
from fsdp_presets.checkpoint.manager import committed_checkpoints
from fsdp_presets.checkpoint.run_folder import read_run_info
from fsdp_presets.checkpoint.verify import verify_checkpoint
from fsdp_presets.faults import FAULT_ENV
from fsdp_presets.train.metrics import read_metrics
from fsdp_harness.launch import forked_launches, launch_env, run_launch_logged

KillMode = Literal["timer", "during-save"]
KILL_MODES = ("timer", "during-save")
POLL_S = 0.02
"""How often the run folder is looked at (seconds): well under a step of any model worth timing."""


@dataclass(frozen=True, kw_only=True)
class KillPlan:
    """Where and when one rank dies."""

    rank: int
    """Global rank to kill."""
    mode: KillMode
    """``timer`` (SIGKILL from outside, ``delay_s`` after step ``after_step`` is logged) or
    ``during-save`` (SIGKILL from inside, at the fault point of the save of step ``after_step``)."""
    after_step: int
    """Optimizer step the kill follows (timer) or whose save it interrupts (during-save)."""
    delay_s: float = 0.0
    """Seconds between the ``after_step`` line and the kill (timer only)."""

    def __post_init__(self) -> None:
        problems = []
        if self.rank < 0:
            problems.append(f"rank {self.rank} < 0")
        if self.mode not in KILL_MODES:
            problems.append(f"mode {self.mode!r} is not one of {KILL_MODES}")
        if self.after_step < 1:
            problems.append(f"after_step {self.after_step} < 1")
        if self.delay_s < 0:
            problems.append(f"delay_s {self.delay_s} < 0")
        if problems:
            raise ValueError("invalid kill plan: " + "; ".join(problems))

    def describe(self) -> str:
        if self.mode == "timer":
            return f"rank {self.rank} killed {self.delay_s:.2f} s after step {self.after_step}"
        return f"rank {self.rank} killed during the save of step {self.after_step}"


@dataclass(kw_only=True)
class DrillResult:
    """What one kill-and-resume drill observed (times in seconds)."""

    plan: KillPlan
    """The kill that was planned."""
    killed: bool = False
    """Whether the kill happened while the run was still training."""
    last_step_before_kill: int = 0
    """Newest optimizer step logged when the killed run ended."""
    committed_before_kill: int | None = None
    """Newest committed checkpoint step seen just before the kill (None: none yet)."""
    valid_after_crash: list[int] = field(default_factory=list)
    """Steps of the committed checkpoints that verify after the crash."""
    resumed_step: int | None = None
    """Step of the checkpoint the second launch resumed from (0: started over)."""
    kill_to_exit_s: float | None = None
    """Kill to launcher exit (the launcher notices and stops the other ranks)."""
    kill_to_loaded_s: float | None = None
    """Kill to the resumed launch having loaded its checkpoint (it rewrites its metrics file)."""
    recovery_s: float | None = None
    """Kill to the first new optimizer step logged by the resumed launch."""
    resume_returncode: int | None = None
    """Exit status of the resumed launch (None when it was stopped after its first step)."""
    problems: list[str] = field(default_factory=list)
    """Everything that went wrong, in words."""

    @property
    def steps_lost(self) -> int | None:
        """Optimizer steps done before the kill that the resumed run had to redo."""
        if self.resumed_step is None:
            return None
        return max(0, self.last_step_before_kill - self.resumed_step)

    @property
    def lost_checkpoint(self) -> bool:
        """The resume did not start from the newest checkpoint committed before the kill."""
        if self.committed_before_kill is None:
            return False
        return self.resumed_step is None or self.resumed_step < self.committed_before_kill

    def to_json(self) -> dict:
        return {"plan": vars(self.plan), "killed": self.killed, "last_step_before_kill": self.last_step_before_kill,
                "committed_before_kill": self.committed_before_kill, "valid_after_crash": self.valid_after_crash,
                "resumed_step": self.resumed_step, "steps_lost": self.steps_lost,
                "kill_to_exit_s": self.kill_to_exit_s, "kill_to_loaded_s": self.kill_to_loaded_s,
                "recovery_s": self.recovery_s,
                "resume_returncode": self.resume_returncode, "lost_checkpoint": self.lost_checkpoint,
                "problems": self.problems}


# ---- processes ----
def descendants(pid: int) -> list[int]:
    """Process ids under ``pid`` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def rank_pid(launcher_pid: int, rank: int) -> int | None:
    """The process of global ``rank`` under an ``accelerate launch`` process (its ``RANK``
    environment variable, which torch's elastic agent sets for each worker)."""
    wanted = f"RANK={rank}".encode()
    for pid in descendants(launcher_pid):
        try:
            environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if wanted in environment:
            return pid
    return None


class _Launch:
    """A launch in its own session, its output read by a thread (each line timestamped)."""

    def __init__(self, command: list[str], *, log_path: Path, env: dict[str, str], cwd=None) -> None:
        self.lines: list[tuple[float, str]] = []
        self.log_path = log_path
        self.started = time.monotonic()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "w")
        self.process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line))
            self._log.write(line)
        self._log.flush()

    def first_line_containing(self, text: str) -> float | None:
        return next((when for when, line in list(self.lines) if text in line), None)

    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Signal the whole session (launcher and ranks)."""
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass

    def wait(self, deadline: float) -> int | None:
        """Exit status, or None (and everything killed) when ``deadline`` passes first."""
        try:
            code = self.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.stop(signal.SIGKILL)
            self.process.wait()
            code = None
        self._reader.join(timeout=10)
        self._log.close()
        return code


# ---- the run folder ----
def train_steps(run_dir: Path) -> list[int]:
    """Steps of the train lines in ``metrics.jsonl`` (a line cut by a kill is skipped)."""
    return [record["step"] for record in read_metrics(run_dir / METRICS) if record.get("kind") == "train"]


def newest_committed(run_dir: Path) -> int | None:
    """Step of the newest ``step-NNNNNNNN`` folder (renamed into place: committed)."""
    found = committed_checkpoints(run_dir / CHECKPOINTS)
    return found[-1][0] if found else None


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except OSError:
        return None


def _resumed_step(run_dir: Path) -> int | None:
    """The step ``run.json``'s ``resumed_from`` names (0 when the run started over)."""
    try:
        record = read_run_info(run_dir)
    except (OSError, ValueError):
        return None
    if record is None:
        return None
    resumed_from = record.resumed_from
    if not resumed_from:
        return 0
    return step_of(resumed_from)


# ---- the drill ----
def run_watched(command: list[str], *, run_dir: Path, log_path: Path, env: dict[str, str] | None = None,
                cwd=None, timeout_s: float = 900) -> tuple[int | None, dict[int, float]]:
    """Run ``command`` to the end; ``(exit status, {step: seconds from start until its train
    line appeared})``: when steps and saves happen, for choosing kill moments. Nothing signals
    this run, so it forks from a pre-imported server where the test suite asks for it
    (:func:`fsdp_harness.launch.forked_launches`)."""
    if forked_launches():
        return _run_watched_forked(command, run_dir=run_dir, log_path=log_path, env=launch_env(env), cwd=cwd,
                                   timeout_s=timeout_s)
    launch = _Launch(command, log_path=log_path, env=launch_env(env), cwd=cwd)
    deadline = launch.started + timeout_s
    seen: dict[int, float] = {}
    while launch.running() and time.monotonic() < deadline:
        for step in train_steps(run_dir):
            seen.setdefault(step, time.monotonic() - launch.started)
        time.sleep(POLL_S)
    code = launch.wait(deadline)
    return code, seen


def _run_watched_forked(command: list[str], *, run_dir: Path, log_path: Path, env: dict[str, str], cwd,
                        timeout_s: float) -> tuple[int | None, dict[int, float]]:
    """:func:`run_watched` through :func:`fsdp_harness.launch.run_launch_logged` (forked): the
    launch runs in a thread while this one watches ``metrics.jsonl``; None when it timed out."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text("")
    outcome: dict[str, int | None] = {"code": None}

    def launch() -> None:
        try:
            outcome["code"] = run_launch_logged(command, log_path, env=env, timeout=timeout_s, cwd=cwd)
        except subprocess.TimeoutExpired:
            pass

    started = time.monotonic()
    thread = threading.Thread(target=launch, daemon=True)
    thread.start()
    seen: dict[int, float] = {}
    while thread.is_alive():
        for step in train_steps(run_dir):
            seen.setdefault(step, time.monotonic() - started)
        thread.join(timeout=POLL_S)
    for step in train_steps(run_dir):
        seen.setdefault(step, time.monotonic() - started)
    return outcome["code"], seen


def kill_and_resume(command: list[str], *, run_dir: Path, plan: KillPlan, log_dir: Path | None = None,
                    env: dict[str, str] | None = None, cwd=None, timeout_s: float = 900,
                    finish: bool = True) -> DrillResult:
    """Run ``command``, kill a rank as ``plan`` says, run it again and time the recovery.

    ``finish=False`` stops the resumed launch (SIGTERM to its session) once it has logged its
    first new step: enough to time the recovery when the rest of the run is not needed."""
    run_dir = Path(run_dir)
    log_dir = Path(log_dir) if log_dir else run_dir.parent
    result = DrillResult(plan=plan)
    deadline = time.monotonic() + timeout_s
    extra = {FAULT_ENV: f"kill-during-save:step={plan.after_step}:rank={plan.rank}"} if plan.mode == "during-save" else {}

    # ---- 1. train, then kill ----
    first = _Launch(command, log_path=log_dir / f"{run_dir.name}.killed.log", env=launch_env({**(env or {}), **extra}),
                    cwd=cwd)
    killed_at = None
    if plan.mode == "timer":
        reached = None
        while first.running() and time.monotonic() < deadline:
            now = time.monotonic()
            if reached is None and (steps := train_steps(run_dir)) and steps[-1] >= plan.after_step:
                reached = now
            if reached is not None and now - reached >= plan.delay_s:
                victim = rank_pid(first.process.pid, plan.rank)
                if victim is not None:
                    result.committed_before_kill = newest_committed(run_dir)
                    os.kill(victim, signal.SIGKILL)
                    killed_at = time.monotonic()
                    break
            time.sleep(POLL_S)
    code = first.wait(deadline)
    if plan.mode == "during-save":
        killed_at = first.first_line_containing("[fault] kill")
        # Nothing commits after the fault point: the save it interrupts needs every rank.
        result.committed_before_kill = newest_committed(run_dir) if killed_at else None
    exited_at = time.monotonic()
    result.killed = killed_at is not None and code != 0
    result.last_step_before_kill = max(train_steps(run_dir), default=0)
    if code is None:
        result.problems.append("the killed launch did not exit before the time limit")
    if not result.killed:
        result.problems.append(
            "the run ended before the kill: the kill came too late" if code == 0
            else f"the run failed before the kill (exit status {code}; see {first.log_path})")
        return result
    result.kill_to_exit_s = exited_at - killed_at
    for step, folder in committed_checkpoints(run_dir / CHECKPOINTS):
        manifest, problem = verify_checkpoint(folder)
        if problem is None:
            result.valid_after_crash.append(step)
        else:
            result.problems.append(f"committed checkpoint {folder.name} does not verify after the crash: {problem}")

    # ---- 2. resume ----
    metrics_inode = _inode(run_dir / METRICS)
    second = _Launch(command, log_path=log_dir / f"{run_dir.name}.resumed.log", env=launch_env(env), cwd=cwd)
    while second.running() and time.monotonic() < deadline:
        # The resumed run rewrites metrics.jsonl (a new file) after it wrote run.json.
        if result.resumed_step is None and _inode(run_dir / METRICS) not in (None, metrics_inode):
            result.kill_to_loaded_s = time.monotonic() - killed_at
            result.resumed_step = _resumed_step(run_dir)
        if result.resumed_step is not None and (steps := train_steps(run_dir)) and steps[-1] > result.resumed_step:
            result.recovery_s = time.monotonic() - killed_at
            if not finish:
                second.stop()
            break
        time.sleep(POLL_S)
    code = second.wait(deadline)
    if result.resumed_step is None:
        result.resumed_step = _resumed_step(run_dir)
    result.resume_returncode = code if (finish or result.recovery_s is None) else None
    if result.recovery_s is None:
        result.problems.append(f"the resumed launch logged no new step (exit status {code})")
    elif finish and code != 0:
        result.problems.append(f"the resumed launch failed (exit status {code})")
    newest_valid = max(result.valid_after_crash, default=0)
    if result.resumed_step is not None and result.resumed_step != newest_valid:
        result.problems.append(f"resumed from step {result.resumed_step}, but the newest valid checkpoint "
                               f"was step {newest_valid}")
    if result.lost_checkpoint:
        result.problems.append(f"lost a committed checkpoint: step {result.committed_before_kill} was committed "
                               f"before the kill, the run resumed from step {result.resumed_step}")
    return result
