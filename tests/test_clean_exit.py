"""Clean exits: a finished training exits 0 whatever the script's ending (no ``end_training``,
``accelerator.end_training()``, objects deleted first, ``trainer.end()``: fsdp_presets.clean_exit), and
what a usage error (exit status 2) looks like through a multi-process ``accelerate launch``.

The abort this prevents is a race at interpreter exit (1 launch in about 20 here without the
handler), so a few launches cannot prove its absence: ``scripts/exit_campaign.py`` runs 100
(docs/benchmarks.md), and every launch of the suite asserts the abort's message is absent. What
these tests pin down deterministically is the mechanism, so one launch each shows it: with the
handler the process group is destroyed before the interpreter shuts down; without it, it is not;
and the ``slow-release`` ending makes the abort itself certain (gloo's worker thread still releasing
a collective's tensors when the script returns), which the handler's wait for gloo's worker
threads turns into exit 0.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fsdp_presets.clean_exit import CLEAN_EXIT, GLOO_WORKER_THREAD, wait_for_gloo_workers
from fsdp_harness.launch import run_launch

from conftest import GLOO_EXIT_ABORT, WORKERS, accelerate_config
from recipe_helpers import CAUSAL_LM, SFT_TRAIN

WORKER = WORKERS / "script_endings.py"


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return accelerate_config(tmp_path_factory.mktemp("clean_exit"), "fsdp2")


@pytest.mark.slow
def test_script_without_end_training_exits_0_with_the_group_destroyed(config):
    result = run_launch(config, WORKER, ["--ending", "none"]).check()
    output = result.stdout + result.stderr
    assert GLOO_EXIT_ABORT not in output
    assert output.count(" trained, distributed type FSDP") == 2
    assert output.count("process group at exit: destroyed") == 2, output[-3000:]


@pytest.mark.slow
def test_without_the_exit_handler_the_group_is_alive_at_exit(config):
    result = run_launch(config, WORKER, ["--ending", "none"], env={"FSDP_PRESETS_CPU_PATCHES_OFF": CLEAN_EXIT})
    output = result.stdout + result.stderr
    assert output.count(" trained, distributed type FSDP") == 2
    assert output.count("process group at exit: alive") == 2, output[-3000:]


def test_check_launch_installs_the_handler_and_a_single_process_exits_quietly():
    code = ("import fsdp_presets, fsdp_presets.clean_exit as c\n"
            "from accelerate import Accelerator\n"
            "print(c.installed())\n"
            "fsdp_presets.check_launch(Accelerator())\n"
            "print(c.installed())\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "True"]
    assert "not destroyed" not in result.stderr


def test_end_training_collects_garbage_while_the_group_still_exists():
    """What removes the abort when a script calls ``end_training()`` with its model alive: garbage
    that references the group is collected before accelerate destroys it (one process, gloo)."""
    code = ("import gc, os, torch.distributed as dist, fsdp_presets\n"
            "from accelerate import Accelerator\n"
            "from fsdp_presets.launching.local import free_port\n"
            "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(free_port()), RANK='0', WORLD_SIZE='1', "
            "LOCAL_RANK='0')\n"
            "fsdp_presets.enable_cpu_fsdp()\n"
            "dist.init_process_group('gloo')\n"
            "accelerator = Accelerator()\n"
            "class Cycle:\n"
            "    def __del__(self): print('collected with the group', dist.is_initialized(), flush=True)\n"
            "gc.disable(); cycle = Cycle(); cycle.me = cycle; del cycle\n"
            "accelerator.end_training()\n"
            "print('after end_training', dist.is_initialized(), flush=True)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[:2] == ["collected with the group True", "after end_training False"], result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("ending, strategy", [("end-training", "ddp"), ("delete", "fsdp1"), ("trainer-end", "fsdp2"),
                                              ("slow-release", "fsdp2")])
def test_a_finished_training_exits_0_whatever_the_scripts_ending(ending, strategy, tmp_path):
    """Real launches (not forked) of a user-style script; scripts/exit_campaign.py repeats every
    ending under every strategy (docs/benchmarks.md). ``slow-release`` is the abort made
    deterministic: gloo's worker thread still releases a collective's tensor, slowly, after the
    script has returned; without the exit handler's wait for it, every launch aborts."""
    config = (accelerate_config(tmp_path, "ddp", distributed_type="MULTI_GPU") if strategy == "ddp"
              else accelerate_config(tmp_path, strategy, fsdp={"version": int(strategy[-1])}))
    result = run_launch(config, WORKER, ["--ending", ending], forked=False).check()
    output = result.stdout + result.stderr
    assert GLOO_EXIT_ABORT not in output
    assert output.count(" trained, distributed type ") == 2
    assert output.count("process group at exit: destroyed") == 2, output[-3000:]
    if ending == "slow-release":
        assert "rank 1: the collective's tensor released on a gloo worker thread" in output, output[-3000:]


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread states from /proc (Linux)")
def test_the_exit_waits_until_gloos_worker_threads_are_idle():
    """A thread with the name of gloo's workers that keeps taking the GIL for 0.6 s, then sleeps on
    an event: the wait returns only once it is idle, and says so; cut shorter, it says it is not."""
    names = ctypes.CDLL(None, use_errno=True)
    named, idle = threading.Semaphore(0), threading.Event()

    def worker(seconds):
        names.prctl(15, GLOO_WORKER_THREAD.encode(), 0, 0, 0)  # PR_SET_NAME, as torch names its threads
        named.release()
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            time.sleep(0.005)
        idle.wait()

    threads = [threading.Thread(target=worker, args=(seconds,), daemon=True) for seconds in (0.6, 30)]
    try:
        threads[0].start()
        named.acquire()
        started = time.monotonic()
        assert wait_for_gloo_workers(timeout_s=10)
        assert time.monotonic() - started >= 0.5
        threads[1].start()
        named.acquire()
        assert not wait_for_gloo_workers(timeout_s=0.2)
    finally:
        idle.set()


@pytest.mark.slow
def test_usage_error_under_a_2_process_launch_shows_exit_code_2(config, tmp_path):
    """accelerate launch reports any failed rank as its own exit status 1 (torch's ChildFailedError);
    the recipe's status 2 and its one-line message are what the output shows
    (docs/troubleshooting.md)."""
    result = run_launch(config, CAUSAL_LM, ["--model", tmp_path / "missing", "--data", SFT_TRAIN,
                                            "--output-dir", tmp_path / "out"])
    assert result.returncode == 1
    assert "exitcode  : 2" in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("causal_lm.py: error:")]
    assert len(errors) == 1 and "--model" in errors[0]
    assert not (tmp_path / "out").exists()
