"""Launching a config on this machine, as a user does: the ``accelerate launch`` command line
(through this interpreter, on a free port), the job's environment, and a run with its output in a
log file. The convergence check (:mod:`fsdp_presets.compare.converge`) and the demo launch
through it; so do the tests and benchmarks (``fsdp_harness.launch``).

    command = launch_command("accelerate_configs/cpu_fsdp2_demo.yaml", "recipes/causal_lm.py", ["--max-steps", "4"])
    status = run_logged(command, Path("run.log"), env=launch_env())
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TRANSFORMERS_VERBOSITY": "error",
}
"""No model hub, no tokenizer threads, no transformers chatter: a job whose model and data are local."""


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it; never a fixed number)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_env(extra: dict[str, str] | None = None, *, offline: bool = True) -> dict[str, str]:
    """The environment of a launched job: this one, with one OpenMP thread per process unless
    ``OMP_NUM_THREADS`` says otherwise (torchrun's default too: the processes share the cores),
    unbuffered output, :data:`OFFLINE_ENV` when ``offline``, then ``extra``."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    if offline:
        env.update(OFFLINE_ENV)
    env.update(extra or {})
    return env


def launch_command(config_file: str | os.PathLike | None, script: str | os.PathLike, script_args=(), *,
                   num_processes: int | None = None, main_process_port: int | None = None,
                   launch_args=()) -> list[str]:
    """The ``accelerate launch`` command line (through this interpreter, so a venv is honoured)."""
    command = [sys.executable, "-m", "accelerate.commands.launch"]
    if config_file is not None:
        command += ["--config_file", str(config_file)]
    if num_processes is not None:
        command += ["--num_processes", str(num_processes)]
    command += ["--main_process_port", str(main_process_port or free_port()), *map(str, launch_args)]
    return command + [str(script), *map(str, script_args)]


def run_logged(command: list[str], log: Path, *, env: dict[str, str], timeout: float | None = None,
               cwd=None) -> int:
    """Run a :func:`launch_command` line with both output streams appended to ``log``: its exit
    status (``subprocess.TimeoutExpired`` after ``timeout`` seconds)."""
    with open(log, "a") as handle:
        return subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, env=env, timeout=timeout,
                              stdin=subprocess.DEVNULL, cwd=cwd).returncode
