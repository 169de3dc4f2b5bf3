"""Run ``accelerate launch`` the way a user does, on a free port, for tests and benchmarks.

    result = run_launch("accelerate_configs/cpu_fsdp2_demo.yaml", "recipes/causal_lm.py",
                        ["--max-steps", "4"], num_processes=2)
    result.check()            # raises with both output streams when the launch failed

The command line and the environment are the package's (:mod:`fsdp_presets.launching.local`);
this module adds forked launches, captured output and the tests' config writer.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from fsdp_presets.fileio import write_text_atomic
from fsdp_presets.launching import local
from fsdp_presets.launching.local import launch_command


def launch_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a launched test job: offline, exactly one thread per process (2 cores
    shared by N processes: oversubscription costs more than it gives), unbuffered output."""
    return local.launch_env({"OMP_NUM_THREADS": "1", **(extra or {})})


@dataclass(kw_only=True)
class LaunchResult:
    """What one ``accelerate launch`` produced."""

    command: list[str]
    """The exact command that ran."""
    returncode: int
    """The launcher's exit status (non-zero when any rank failed)."""
    stdout: str
    """Everything the ranks printed to standard output."""
    stderr: str
    """Everything the ranks and the launcher printed to standard error."""
    forked: bool = False
    """Whether the launcher and its ranks were forked from a pre-imported server
    (:mod:`fsdp_harness.forked_launch`) instead of executed."""

    def check(self) -> "LaunchResult":
        """Raise with the command and both streams unless the launch succeeded."""
        if self.returncode != 0:
            raise AssertionError(
                f"launch failed with exit code {self.returncode}: {' '.join(self.command)}\n"
                f"--- stdout ---\n{self.stdout[-6000:]}\n--- stderr ---\n{self.stderr[-10000:]}"
            )
        return self


def run_launch(config_file, script, script_args=(), *, num_processes: int | None = None,
               env: dict[str, str] | None = None, timeout: float = 600, cwd=None,
               launch_args=(), forked: bool | None = None) -> LaunchResult:
    """Run ``accelerate launch --config_file CONFIG SCRIPT ARGS`` to completion on a free port.

    ``forked`` (default: ``FSDP_HARNESS_FORKED_LAUNCH=1`` in the environment) runs the same launch
    forked from a pre-imported server (:mod:`fsdp_harness.forked_launch`): a few times less CPU."""
    from fsdp_harness import forked_launch

    command = launch_command(config_file, script, script_args, num_processes=num_processes,
                             launch_args=launch_args)
    if forked is None:
        forked = forked_launches()
    if forked:
        returncode, stdout, stderr = forked_launch.run(command, env=launch_env(env), cwd=cwd, timeout=timeout)
        return LaunchResult(command=command, returncode=returncode, stdout=stdout, stderr=stderr, forked=True)
    completed = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                               env=launch_env(env), stdin=subprocess.DEVNULL)
    return LaunchResult(command=command, returncode=completed.returncode, stdout=completed.stdout,
                        stderr=completed.stderr)


def forked_launches() -> bool:
    """Whether launches fork from a pre-imported server (``FSDP_HARNESS_FORKED_LAUNCH=1``)."""
    from fsdp_harness import forked_launch

    return os.environ.get(forked_launch.FORKED_LAUNCH) == "1" and forked_launch.available()


def run_launch_logged(command: list[str], log: Path, *, env: dict[str, str], timeout: float | None = None,
                      cwd=None) -> int:
    """Run a :func:`launch_command` line with both output streams appended to ``log``: its exit
    status (``subprocess.TimeoutExpired`` after ``timeout`` seconds); forked as :func:`run_launch`."""
    if forked_launches():
        from fsdp_harness import forked_launch

        return forked_launch.run_logged(command, log, env=env, cwd=cwd, timeout=timeout)
    return local.run_logged(command, log, env=env, timeout=timeout, cwd=cwd)


def read_rank_results(directory: str | os.PathLike) -> dict[int, dict]:
    """``{rank: result}`` from the ``rank-N.json`` files a test worker wrote."""
    results = {}
    for path in sorted(Path(directory).glob("rank-*.json")):
        results[int(path.stem.split("-")[1])] = json.loads(path.read_text())
    return results


def write_accelerate_config(path: Path, *, num_processes: int, distributed_type: str = "FSDP",
                            fsdp: dict | None = None, parallelism: dict | None = None,
                            mixed_precision: str = "no") -> Path:
    """An accelerate config in accelerate's own schema (what ``accelerate config`` writes), built by
    the emitter's writer (:func:`fsdp_presets.preset.emit.written_config`): FSDP2 FULL_SHARD per
    ``LlamaDecoderLayer``, sharded state dicts, fp32, unless ``fsdp`` (short names such as
    ``version``, or full key names) says otherwise; FSDP1 gets the settings the emitter writes for
    FSDP1 presets; ``distributed_type: MULTI_GPU`` is DDP."""
    from fsdp_presets.preset.emit import emitted_constants, written_config
    from fsdp_presets.schema import fsdp_key

    settings = {}
    if distributed_type == "FSDP":
        settings = {"version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                    "transformer_layer_cls_to_wrap": "LlamaDecoderLayer", "reshard_after_forward": True,
                    "state_dict_type": "SHARDED_STATE_DICT", "cpu_ram_efficient_loading": False,
                    "offload_params": False, "activation_checkpointing": False}
        settings.update({fsdp_key(name).short: value for name, value in (fsdp or {}).items()})
        if settings["version"] == 1:
            settings.pop("reshard_after_forward", None)
            settings.setdefault("sharding_strategy", fsdp_key("sharding_strategy").fsdp1_default)
            for name, value in emitted_constants(1).items():
                settings.setdefault(name, value)
    config = written_config(distributed_type=distributed_type, num_processes=num_processes,
                            mixed_precision=mixed_precision, fsdp=settings or None, parallelism=parallelism)
    write_text_atomic(path, yaml.safe_dump(config, sort_keys=False))  # workers may write one config at once
    return path
