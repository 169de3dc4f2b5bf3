"""The launch-script options a command offers (``--launcher slurm|torchrun|accelerate``,
``--command``, ``--port``, ...: :func:`add_launch_arguments`) and what they make: the checked
:class:`~fsdp_presets.launching.launchers.Job` (:func:`job_from_args`) and the script written next to
the config (:func:`write_from_args`). ``fsdp-presets launcher`` and ``fsdp-presets generate ...
--launcher slurm`` both use them, so each option has one spelling, default and check."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from fsdp_presets.errors import UsageError
from fsdp_presets.plan.limits import MAX_GPUS, count_check, node_count
from fsdp_presets.launching.launchers import (DEFAULT_JOIN_TIMEOUT_S, DEFAULT_PORT, LAUNCHER_KINDS, default_script_path,
                                           job_from_config, write_launcher)
from fsdp_presets.launching.quoting import shell_join

MAX_JOIN_TIMEOUT_S = 7 * 24 * 3600
"""Seconds the first node waits for the others: a week."""
MAX_CPUS_PER_TASK = 2**16
"""SLURM CPUs for one node's task."""

gpus_per_node = count_check("--gpus", high=MAX_GPUS, example="8", doc="``launcher --gpus``: GPUs (processes) per machine.")
tcp_port = count_check("--port", high=65535, example="29500", doc="``--port``: a TCP port.")
join_timeout_s = count_check("--join-timeout", high=MAX_JOIN_TIMEOUT_S, example="600",
                             doc="``--join-timeout``: seconds, 1 .. :data:`MAX_JOIN_TIMEOUT_S`.")
cpus_per_task = count_check("--cpus-per-task", high=MAX_CPUS_PER_TASK, example="32",
                            doc="``--cpus-per-task``: SLURM CPUs for one node's task.")

def add_launch_arguments(parser: argparse.ArgumentParser, *, with_mesh: bool = True,
                         with_output: bool = True) -> None:
    """The launcher options. ``with_mesh=False`` leaves out --nodes/--gpus and ``with_output=False``
    --launch-output (for a command that already has them)."""
    group = parser.add_argument_group("launch script")
    group.add_argument("--launcher", choices=LAUNCHER_KINDS,
                       help="slurm: a batch script (sbatch FILE); torchrun / accelerate: a per-node script "
                       "(bash FILE NODE_RANK on every node)")
    if with_mesh:
        group.add_argument("--nodes", type=node_count, help="machines in the job (default: what the config says)")
        group.add_argument("--gpus", type=gpus_per_node, dest="gpus_per_node",
                           help="GPUs (processes) per machine (default: what the config says)")
    group.add_argument("--command", dest="train_command", metavar='"SCRIPT ARGS"',
                       help="the training script and its arguments as one string, as you would type them "
                       "after `accelerate launch` (quotes work as in the shell); secrets belong in the "
                       "environment, never here")
    group.add_argument("--port", type=tcp_port, default=DEFAULT_PORT,
                       help=f"rendezvous port when MAIN_PROCESS_PORT is unset at run time (default {DEFAULT_PORT})")
    group.add_argument("--join-timeout", type=join_timeout_s, default=DEFAULT_JOIN_TIMEOUT_S,
                       metavar="SECONDS", help="how long the first node waits for the others before failing "
                       f"(default {DEFAULT_JOIN_TIMEOUT_S}; JOIN_TIMEOUT overrides it at run time)")
    group.add_argument("--job-name", default="fsdp-presets", help="SLURM job name")
    group.add_argument("--time", dest="time_limit", help="SLURM time limit, e.g. 24:00:00")
    group.add_argument("--cpus-per-task", type=cpus_per_task, help="SLURM CPUs per node task")
    if with_output:
        group.add_argument("--launch-output", dest="launch_output", metavar="FILE",
                           help="where to write the script (default: CONFIG_STEM.LAUNCHER.sh next to the config)")


def job_from_args(args: argparse.Namespace, config_file, *, nodes=None, gpus_per_node=None,
                  default_command: list[str] | None = None, config: dict | None = None):
    """The :class:`~fsdp_presets.launching.launchers.Job` of ``args`` for ``config_file`` (None when no
    ``--launcher`` was asked for): every launcher flag checked, nothing written. Without
    ``--command``, the training command is taken from ``default_command`` (a full ``accelerate
    launch ... SCRIPT.py ARGS`` line: from the script on). ``config``: the config's settings when
    the file is not written yet."""
    if not getattr(args, "launcher", None):
        return None
    if args.train_command:
        try:
            command = shlex.split(args.train_command)
        except ValueError as error:
            # NOTE: the command is not repeated: it may hold a secret that the refusal would print.
            raise UsageError(f"--command cannot be read as shell words ({error}); close every quote") from None
    elif default_command and any(word.endswith(".py") for word in default_command):
        command = default_command[next(index for index, word in enumerate(default_command) if word.endswith(".py")):]
    else:
        raise UsageError(f"--launcher {args.launcher} needs the training command: --command "
                         '"recipes/causal_lm.py --model M --data D --output-dir runs/x"')
    return job_from_config(config_file, command=command, config=config,
                           nodes=nodes if nodes is not None else getattr(args, "nodes", None),
                           gpus_per_node=gpus_per_node if gpus_per_node is not None else getattr(args, "gpus_per_node", None),
                           port=args.port, join_timeout_s=args.join_timeout, job_name=args.job_name,
                           time_limit=args.time_limit, cpus_per_task=args.cpus_per_task)


def launcher_path(args: argparse.Namespace, config_file):
    """Where ``args.launcher``'s script goes: ``--launch-output``/``-o``, else next to the config."""
    return Path(args.launch_output) if args.launch_output else default_script_path(config_file, args.launcher)


def made_by() -> str:
    """The command line that is running, for a script's ``# Made by:`` line (quoted there)."""
    return "fsdp-presets " + shell_join(sys.argv[1:]) if sys.argv[1:] else "fsdp-presets"


def write_from_args(args: argparse.Namespace, config_file, *, nodes=None, gpus_per_node=None,
                    default_command: list[str] | None = None, job=None):
    """Write the launcher ``args.launcher`` for ``config_file``; returns its path (None when no
    ``--launcher`` was asked for). ``job``: one :func:`job_from_args` made already."""
    if job is None:
        job = job_from_args(args, config_file, nodes=nodes, gpus_per_node=gpus_per_node,
                            default_command=default_command)
    if job is None:
        return None
    return write_launcher(args.launcher, job, generated_by=made_by(), output=launcher_path(args, config_file),
                          force=getattr(args, "force", False))
