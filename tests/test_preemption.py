"""Preemption (fsdp_presets.train.signals): a signalled run saves the step it reached, says so in
metrics.jsonl, exits 75 (the launcher 143 when it got the SIGTERM), and ``--resume auto`` continues
bitwise; a second signal stops at once with the newest committed checkpoint intact.

The signalled launches are real (executed, not forked: signals reach a real torchrun agent and real
ranks); the resume, which nothing signals, is forked (tests/conftest.py).
``scripts/preemption_campaign.py`` signals at random moments (docs/benchmarks.md).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

import checkpoint_runs as runs
from fsdp_harness.drill import rank_pid
from fsdp_harness.launch import launch_env, run_launch
from fsdp_presets.launching.local import launch_command
from fsdp_presets.checkpoint.manager import committed_checkpoints
from fsdp_presets.checkpoint.verify import checkpoint_verdict
from fsdp_presets.errors import UsageError
from fsdp_presets.faults import FAULT_ENV
from fsdp_presets.train import signals
from fsdp_presets.train.metrics import read_metrics, train_losses
from recipe_helpers import CAUSAL_LM, REPO, causal_lm_args


# ---- fast ----
def test_signal_names_parse_and_bad_ones_are_refused_in_one_line():
    assert signals.parse_signals("TERM,USR1") == (signal.SIGTERM, signal.SIGUSR1)
    assert signals.parse_signals(" sigusr2 ") == (signal.SIGUSR2,)
    assert signals.parse_signals("none") == ()
    for bad in ("KILL", "TERM,BOGUS", "INT", ""):
        with pytest.raises(UsageError, match="--preempt-signals .* none to turn preemption saves off"):
            signals.parse_signals(bad)


def test_a_signal_sets_the_flag_and_the_scripts_own_handler_still_runs():
    seen = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: seen.append(signum))
    try:
        signals.install((signal.SIGUSR2,))
        assert signals.received() is None
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.05)
        assert signals.received() == "SIGUSR2" and seen == [signal.SIGUSR2]
    finally:
        signals.restore()  # the handlers it installed are put back
        assert signal.getsignal(signal.SIGUSR2) is not signals._on_signal
        assert signal.getsignal(signal.SIGINT) is not signals._on_signal
        signal.signal(signal.SIGUSR2, previous)


# ---- real launches ----
def _start(config, args, log, env=None):
    handle = open(log, "w")
    return subprocess.Popen(launch_command(config, CAUSAL_LM, args), cwd=REPO, env=launch_env(env), stdout=handle,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _wait_for(condition, timeout_s=240.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError("timed out")


@pytest.mark.slow
def test_sigterm_at_the_launcher_saves_the_step_reached_and_resume_auto_continues_bitwise(tmp_path_factory, tmp_path):
    root = runs.base(tmp_path_factory)
    reference = runs.reference_run(root)  # FSDP2 x2, steps 1-10 uninterrupted, the same flags
    output = tmp_path / "run"
    args = causal_lm_args(runs.tiny_model(root), output, *runs.SCHEDULE, "--max-steps", 20)
    launcher = _start(runs.fsdp_config(root, 2), args, tmp_path / "launch.log")
    _wait_for(lambda: len(train_losses(output / "metrics.jsonl")) >= 3)
    os.kill(launcher.pid, signal.SIGTERM)  # what scancel / a time limit / Kubernetes send the job's launcher
    signalled = time.monotonic()
    assert launcher.wait(timeout=120) == 128 + signal.SIGTERM
    within_s = time.monotonic() - signalled
    log = (tmp_path / "launch.log").read_text()
    assert within_s < 30, log[-3000:]  # torchrun's grace: it kills the ranks 30 s after forwarding
    preempted = [record for record in read_metrics(output / "metrics.jsonl") if record["kind"] == "preempted"]
    assert len(preempted) == 1, log[-3000:]
    step = preempted[0]["step"]
    saved = output / "checkpoints" / f"step-{step:08d}"
    assert preempted[0] == {"kind": "preempted", "step": step, "signal": "SIGTERM", "checkpoint": str(saved)}
    assert max(train_losses(output / "metrics.jsonl")) == step  # the step in progress was finished and saved
    assert 3 <= step < 10 and checkpoint_verdict(saved).ok
    assert f"causal_lm.py: error: preempted (SIGTERM) at step {step}: saved {saved}; " in log
    resumed = run_launch(runs.fsdp_config(root, 2), CAUSAL_LM, [*args[:-1], "10"], cwd=REPO, timeout=300).check()
    assert f"resumed from {saved}: step {step}" in resumed.stdout
    assert train_losses(output / "metrics.jsonl") == train_losses(reference / "metrics.jsonl")  # bitwise


@pytest.mark.slow
def test_a_second_signal_stops_at_once_and_the_committed_checkpoint_stays_intact(tmp_path_factory, tmp_path):
    root = runs.base(tmp_path_factory)
    output = tmp_path / "run"
    args = causal_lm_args(runs.tiny_model(root), output, *runs.SCHEDULE, "--max-steps", 10)
    log = tmp_path / "launch.log"
    launcher = _start(runs.fsdp_config(root, 2), args, log, env={FAULT_ENV: "stall-during-save:step=4"})
    _wait_for(lambda: "[fault] stall at during-save, step 4" in log.read_text())  # shards written, not committed
    os.kill(launcher.pid, signal.SIGTERM)  # the first: answered after this save...
    time.sleep(signals.REPEAT_GRACE_S + 0.5)
    ranks = [rank_pid(launcher.pid, rank) for rank in (0, 1)]
    for pid in ranks:  # ...the second: now
        os.kill(pid, signal.SIGTERM)
    launcher.wait(timeout=60)
    text = log.read_text()
    # "At once": the stalled save of step 4 was never committed (below), not a time bound (the
    # launcher's teardown takes seconds more on a loaded host).
    assert "second SIGTERM: stopping at once without a save" in text, text[-3000:]
    assert (f"The last committed checkpoint, {output / 'checkpoints' / 'step-00000002'}, is intact and --resume auto "
            "continues from it") in text, text[-3000:]
    assert [step for step, _ in committed_checkpoints(output / "checkpoints")] == [2]
    assert checkpoint_verdict(output / "checkpoints" / "step-00000002").ok
    assert not [record for record in read_metrics(output / "metrics.jsonl") if record["kind"] == "preempted"]
