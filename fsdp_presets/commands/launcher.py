"""``fsdp-presets launcher CONFIG --launcher slurm|torchrun|accelerate --command "SCRIPT ARGS"``: the launch
script of a multi-node job for an accelerate config (see :mod:`fsdp_presets.preset.launchers`).

    fsdp-presets launcher accelerate_configs/llama_hsdp.yaml --launcher slurm --time 24:00:00 \\
        --command "recipes/causal_lm.py --model runs/models/llama --data data/kjv_sft/train.jsonl --output-dir runs/x"
    sbatch accelerate_configs/llama_hsdp.slurm.sh

:func:`add_launch_arguments` and :func:`write_from_args` are what another command needs to offer
the same options (``generate ... --launcher slurm``).
"""

from __future__ import annotations

import argparse
import shlex
import sys

NAME = "launcher"
HELP = "write the SLURM, torchrun or per-node accelerate launch script of a (multi-node) accelerate config"


def add_launch_arguments(parser: argparse.ArgumentParser, *, with_mesh: bool = True,
                         with_output: bool = True) -> None:
    """The launcher options. ``with_mesh=False`` leaves out --nodes/--gpus and ``with_output=False``
    --launch-output (for a command that already has them)."""
    from fsdp_presets import arguments
    from fsdp_presets.preset.launchers import DEFAULT_JOIN_TIMEOUT_S, DEFAULT_PORT, LAUNCHER_KINDS

    group = parser.add_argument_group("launch script")
    group.add_argument("--launcher", choices=LAUNCHER_KINDS,
                       help="slurm: a batch script (sbatch FILE); torchrun / accelerate: a per-node script "
                       "(bash FILE NODE_RANK on every node)")
    if with_mesh:
        group.add_argument("--nodes", type=arguments.node_count, help="machines in the job (default: what the config says)")
        group.add_argument("--gpus", type=arguments.gpus_per_node, dest="gpus_per_node",
                           help="GPUs (processes) per machine (default: what the config says)")
    group.add_argument("--command", dest="train_command", metavar='"SCRIPT ARGS"',
                       help="the training script and its arguments as one string, as you would type them "
                       "after `accelerate launch` (quotes work as in the shell); secrets belong in the "
                       "environment, never here")
    group.add_argument("--port", type=arguments.tcp_port, default=DEFAULT_PORT,
                       help=f"rendezvous port when MAIN_PROCESS_PORT is unset at run time (default {DEFAULT_PORT})")
    group.add_argument("--join-timeout", type=arguments.join_timeout_s, default=DEFAULT_JOIN_TIMEOUT_S,
                       metavar="SECONDS", help="how long the first node waits for the others before failing "
                       f"(default {DEFAULT_JOIN_TIMEOUT_S}; JOIN_TIMEOUT overrides it at run time)")
    group.add_argument("--job-name", default="fsdp-presets", help="SLURM job name")
    group.add_argument("--time", dest="time_limit", help="SLURM time limit, e.g. 24:00:00")
    group.add_argument("--cpus-per-task", type=arguments.cpus_per_task, help="SLURM CPUs per node task")
    if with_output:
        group.add_argument("--launch-output", dest="launch_output", metavar="FILE",
                           help="where to write the script (default: CONFIG_STEM.LAUNCHER.sh next to the config)")


def job_from_args(args: argparse.Namespace, config_file, *, nodes=None, gpus_per_node=None,
                  default_command: list[str] | None = None, config: dict | None = None):
    """The :class:`~fsdp_presets.preset.launchers.Job` of ``args`` for ``config_file`` (None when no
    ``--launcher`` was asked for): every launcher flag checked, nothing written. Without
    ``--command``, the training command is taken from ``default_command`` (a full ``accelerate
    launch ... SCRIPT.py ARGS`` line: from the script on). ``config``: the config's settings when
    the file is not written yet."""
    from fsdp_presets.errors import UsageError
    from fsdp_presets.preset.launchers import job_from_config

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
    from pathlib import Path

    from fsdp_presets.preset.launchers import default_script_path

    return Path(args.launch_output) if args.launch_output else default_script_path(config_file, args.launcher)


def made_by() -> str:
    """The command line that is running, for a script's ``# Made by:`` line (quoted there)."""
    from fsdp_presets.preset.quoting import shell_join

    return "fsdp-presets " + shell_join(sys.argv[1:]) if sys.argv[1:] else "fsdp-presets"


def write_from_args(args: argparse.Namespace, config_file, *, nodes=None, gpus_per_node=None,
                    default_command: list[str] | None = None, job=None):
    """Write the launcher ``args.launcher`` for ``config_file``; returns its path (None when no
    ``--launcher`` was asked for). ``job``: one :func:`job_from_args` made already."""
    from fsdp_presets.preset.launchers import write_launcher

    if job is None:
        job = job_from_args(args, config_file, nodes=nodes, gpus_per_node=gpus_per_node,
                            default_command=default_command)
    if job is None:
        return None
    return write_launcher(args.launcher, job, generated_by=made_by(), output=launcher_path(args, config_file),
                          force=getattr(args, "force", False))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="the accelerate config (e.g. the HSDP preset of fsdp-presets generate)")
    add_launch_arguments(parser, with_output=False)
    parser.add_argument("-o", "--output", dest="launch_output", metavar="FILE",
                        help="where to write the script (default: CONFIG_STEM.LAUNCHER.sh next to the config); "
                        "an existing file is replaced only when fsdp-presets wrote it")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing output file that fsdp-presets did not write")
    parser.set_defaults(launcher="slurm")


def run(args: argparse.Namespace) -> int:
    from fsdp_presets.preset.quoting import shell_word

    path = write_from_args(args, args.config)
    hint = (f"sbatch {shell_word(str(path))}" if args.launcher == "slurm"
            else f"MAIN_PROCESS_IP=<address of node 0> bash {shell_word(str(path))} NODE_RANK")
    print(f"wrote {path}\nrun: {hint}")
    return 0
