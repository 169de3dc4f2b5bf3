"""Launch scripts for a multi-node job: a SLURM batch script, or per-node torchrun or accelerate
commands, all consistent with one accelerate config.

    job = job_from_config("accelerate_configs/llama_hsdp.yaml", nodes=2, gpus_per_node=8,
                          command=["recipes/causal_lm.py", "--model", "...", "--output-dir", "runs/x"])
    write_launcher("slurm", job, generated_by="fsdp-presets launcher ...")   # llama_hsdp.slurm.sh

Every node runs ``accelerate launch --config_file CONFIG --num_machines M --num_processes M*N
--machine_rank R --main_process_ip ADDRESS --main_process_port PORT --rdzv_conf timeout=T``;
accelerate hands that to torchrun with torch's *static* rendezvous: node 0 hosts the TCP store
and the other nodes connect to it. Addresses, ports and secrets are read from the environment
when the script runs (``MAIN_PROCESS_IP``, ``MAIN_PROCESS_PORT``, ``HF_TOKEN``...), never
written into it.

A node that never joins: node 0 waits ``T`` seconds for the others, then fails with torch's
"Timed out after T seconds waiting for clients. 1/2 clients joined." (torch's static rendezvous
reads ``timeout`` from ``--rdzv_conf``; its own default is 600 s). The scripts pass it
explicitly so that it is visible, and adjustable at run time through ``JOIN_TIMEOUT``.

``render_*`` and the ``*_command`` functions are pure; :func:`job_from_config` and
:func:`accelerate_environment` read the config; :func:`write_launcher` writes the script.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fsdp_presets.schema import ACCELERATE_ENV_PREFIXES, T
from fsdp_presets.errors import UsageError, unknown_name_message
from fsdp_presets.fileio import YAML_MAX_BYTES, load_yaml_data, read_regular_bytes, read_regular_text
from fsdp_presets.launching.quoting import comment_text, shell_word

LauncherKind = Literal["slurm", "torchrun", "accelerate"]
LAUNCHER_KINDS: tuple[str, ...] = ("slurm", "torchrun", "accelerate")

DEFAULT_PORT = 29500
"""torch's own default rendezvous port (``torchrun --master-port``)."""
DEFAULT_JOIN_TIMEOUT_S = 600
"""torch's static rendezvous default (``static_tcp_rendezvous._default_timeout_seconds``)."""

# A flag or value that is a secret belongs in the environment, not in a script on shared storage.
_SECRET_FLAG = re.compile(r"^--?[\w-]*(token|secret|password|api[-_]?key)[\w-]*(=.*)?$", re.IGNORECASE)
_SECRET_VALUE = re.compile(r"(^|[=:])(hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,})$")
_TOKEN_ANYWHERE = re.compile(r"(?<![A-Za-z0-9_-])(hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,})")


def carries_token(text: str) -> bool:
    """True when ``text`` holds a value that looks like an access token (``hf_...``, ``sk-...``):
    a generated file must not (it lands on shared storage and in version control)."""
    return bool(_TOKEN_ANYWHERE.search(text))


MADE_BY_PREFIX = "# Made by: fsdp-presets"
"""Start of the header line that names the command that wrote a script: how a script this module
wrote is told from one a person wrote (only the former is replaced without ``--force``)."""


def _secret_names(arguments) -> list[str]:
    """How to point at each secret in ``arguments`` without saying it: the flag name (its value
    withheld), or the position of a bare value that looks like a token."""
    names = []
    for index, argument in enumerate(arguments):
        if _SECRET_FLAG.match(argument):
            names.append(argument.split("=", 1)[0] + ("=..." if "=" in argument else ""))
        elif _SECRET_VALUE.search(argument):
            names.append(f"word {index + 1} (a token-like value, not shown)")
    return names


def is_generated_launcher(text: str) -> bool:
    """True when ``text`` is a script :func:`write_launcher` wrote: its opening comment block holds
    the ``# Made by: fsdp-presets`` line."""
    for line in text.splitlines():
        if line.startswith(MADE_BY_PREFIX):
            return True
        if line and not line.startswith("#"):
            return False
    return False


@dataclass(frozen=True)
class FromEnvironment:
    """One shell word that the script reads from its environment when it runs:
    ``prefix`` followed by ``$name`` (``"timeout=$JOIN_TIMEOUT"``)."""

    name: str
    """The environment variable."""
    prefix: str = ""
    """Literal text before the value."""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.name) or not re.fullmatch(r"[\w=.:,-]*", self.prefix):
            raise ValueError(f"not a plain shell variable word: {self.prefix!r} + ${self.name}")

    def __str__(self) -> str:
        return f'"{self.prefix}${self.name}"'


MAIN_PROCESS_IP = FromEnvironment("MAIN_PROCESS_IP")
MAIN_PROCESS_PORT = FromEnvironment("MAIN_PROCESS_PORT")
JOIN_TIMEOUT = FromEnvironment("JOIN_TIMEOUT", prefix="timeout=")
Word = str | int | FromEnvironment


@dataclass(kw_only=True, frozen=True)
class Job:
    """What a multi-node launch needs to know besides the accelerate config itself."""

    config_file: str
    """The accelerate config as every node sees it (relative to the directory the job starts in,
    or an absolute path on storage all nodes share)."""
    nodes: int
    """Machines in the job (``--num_machines``)."""
    gpus_per_node: int
    """Processes per machine, one per GPU (``--num_processes`` is ``nodes * gpus_per_node``)."""
    command: tuple[str, ...]
    """The training script and its arguments, e.g. ``("recipes/causal_lm.py", "--model", ...)``."""
    port: int = DEFAULT_PORT
    """Rendezvous port on the first node when ``MAIN_PROCESS_PORT`` is not set at run time."""
    join_timeout_s: int = DEFAULT_JOIN_TIMEOUT_S
    """Seconds the first node waits for the others to join before failing (``JOIN_TIMEOUT``
    overrides it at run time)."""
    job_name: str = "fsdp-presets"
    """SLURM job name (``#SBATCH --job-name``)."""
    time_limit: str | None = None
    """SLURM wall-clock limit (``#SBATCH --time``, e.g. ``"24:00:00"``); None: the partition's."""
    cpus_per_task: int | None = None
    """SLURM CPUs for each node's task (``#SBATCH --cpus-per-task``); None: the partition's."""

    def __post_init__(self) -> None:
        problems = []
        if self.nodes < 1:
            problems.append(f"nodes {self.nodes} < 1")
        if self.gpus_per_node < 1:
            problems.append(f"GPUs per node {self.gpus_per_node} < 1")
        if not 1 <= self.port <= 65535:
            problems.append(f"port {self.port} is not a TCP port (1-65535)")
        if self.join_timeout_s < 1:
            problems.append(f"join timeout {self.join_timeout_s} s < 1 s")
        if not self.command:
            problems.append("no training command (give the script and its arguments after --)")
        if not re.fullmatch(r"[\w.-]+", self.job_name):
            problems.append(f"job name {self.job_name!r}: use letters, digits, '.', '-', '_'")
        if self.time_limit is not None and not re.fullmatch(r"[\d:-]+", self.time_limit):
            problems.append(f"time limit {self.time_limit!r}: use SLURM's form, e.g. 24:00:00 or 1-12:00:00")
        if self.cpus_per_task is not None and self.cpus_per_task < 1:
            problems.append(f"CPUs per task {self.cpus_per_task} < 1")
        secrets = _secret_names(self.command)
        if secrets:
            problems.append(f"the training command carries secrets ({', '.join(secrets)}); pass them "
                            "through the environment (export HF_TOKEN=... before launching), never in a script")
        if problems:
            raise UsageError("invalid launch: " + "; ".join(problems))

    @property
    def num_processes(self) -> int:
        """Processes in the whole job."""
        return self.nodes * self.gpus_per_node


# ---- reading the config ----
def job_from_config(config_file: str | os.PathLike, *, command, nodes: int | None = None,
                    gpus_per_node: int | None = None, config: dict | None = None, **settings) -> Job:
    """A :class:`Job` for ``config_file``. Nodes and GPUs per node default to what the config says
    (``num_machines``, else the HSDP mesh's ``dp_replicate_size``; ``num_processes`` or the mesh
    size over the nodes); given ones must agree with it. ``config``: the config's settings when
    the file is still to be written (it is not read then). ``settings``: the other :class:`Job` fields."""
    import yaml

    path = Path(config_file)
    if config is None:
        if not path.exists():
            raise UsageError(f"{path}: no such accelerate config")
        try:
            config = load_yaml_data(read_regular_text(path, limit=YAML_MAX_BYTES)) or {}
        except OSError as error:
            raise UsageError(f"cannot read {path}: {error}") from None
        except (yaml.YAMLError, UnicodeDecodeError) as error:
            raise UsageError(f"{path} is not valid YAML ({error})") from None
    if not isinstance(config, dict):
        raise UsageError(f"{path} is not an accelerate config (expected a mapping of settings)")
    parallelism = config.get(T.parallelism_config) or {}
    if not isinstance(parallelism, dict):
        raise UsageError(f"{path}: parallelism_config must be a mapping of settings; regenerate the config "
                         "(fsdp-presets generate)")
    mesh = {name: _count_setting(path, parallelism, f"parallelism_config_{name}", 1)
            for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size")}
    mesh_size = mesh["dp_replicate_size"] * mesh["dp_shard_size"] * mesh["tp_size"] * mesh["cp_size"]
    config_machines = _count_setting(path, config, T.num_machines, 1)
    config_processes = _count_setting(path, config, T.num_processes, 0)

    if nodes is None:
        nodes = config_machines if config_machines > 1 else mesh["dp_replicate_size"]
    if gpus_per_node is None:
        total = mesh_size if parallelism else config_processes
        if total < 1 or total % nodes:
            raise UsageError(f"{path}: cannot tell the GPUs per node ({total} processes over {nodes} "
                             "nodes); give them (--gpus N)")
        gpus_per_node = total // nodes
    problems = []
    if config_machines > 1 and config_machines != nodes:
        problems.append(f"the config says num_machines {config_machines}, the job has {nodes} nodes")
    if parallelism and mesh_size != nodes * gpus_per_node:
        problems.append(f"the config's mesh (dp_replicate {mesh['dp_replicate_size']} x dp_shard "
                        f"{mesh['dp_shard_size']} x tp {mesh['tp_size']} x cp {mesh['cp_size']} = "
                        f"{mesh_size} processes) does not fill {nodes} nodes x {gpus_per_node} GPUs")
    if problems:
        raise UsageError(f"{path}: " + "; ".join(problems) + "; regenerate the config for this cluster "
                         "(fsdp-presets generate ... --nodes M --gpus N) or give matching --nodes/--gpus")
    return Job(config_file=str(config_file), nodes=nodes, gpus_per_node=gpus_per_node,
               command=tuple(map(str, command)), **settings)


# Larger than any cluster (the largest hold about 10^5 GPUs); a bigger count is a typo.
_MAX_COUNT = 2**20


def _count_setting(path: Path, settings: dict, key: str, default: int) -> int:
    """A whole-number setting of the config (``num_processes: 16``), or a UsageError naming it."""
    value = settings.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_COUNT:
        raise UsageError(f"{path}: {key} must be a whole number from 0 to {_MAX_COUNT}, got {comment_text(repr(value))}; "
                         "fix it in the config (or regenerate it with fsdp-presets generate)")
    return value or default


def accelerate_environment(config_file: str | os.PathLike) -> dict[str, str]:
    """The variables ``accelerate launch --config_file CONFIG`` gives its processes
    (``ACCELERATE_USE_FSDP``, ``FSDP_*``, ``PARALLELISM_CONFIG_*``...), computed by accelerate's
    own launch code. A script started by plain ``torchrun`` needs them: ``Accelerator()`` reads
    the FSDP and mesh settings from these variables, never from the config file."""
    from unittest import mock

    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    # Start from an environment without accelerate's variables, so that only the config speaks.
    clean = {key: value for key, value in os.environ.items() if not key.startswith(ACCELERATE_ENV_PREFIXES)}
    with mock.patch.dict(os.environ, clean, clear=True):
        # NOTE: machine rank 1 of 2: accelerate checks that the rendezvous port is free only on
        # the machine that would host it (rank 0); the variables do not depend on the rank.
        args = launch_command_parser().parse_args([
            "--config_file", str(config_file), "--num_machines", "2", "--num_processes", "2",
            "--machine_rank", "1", "--main_process_ip", "127.0.0.1", "--main_process_port",
            str(DEFAULT_PORT), "train.py"])
        try:
            args, _, _ = _validate_launch_command(args)
        except (ValueError, TypeError) as error:
            raise UsageError(f"{config_file}: accelerate refuses this config ({error})") from None
        environment = prepare_multi_gpu_env(args)
    return {key: value for key, value in sorted(environment.items()) if key.startswith(ACCELERATE_ENV_PREFIXES)}


# ---- per-node commands ----
def accelerate_node_command(job: Job, machine_rank: int | FromEnvironment, *,
                            main_process_ip: str | FromEnvironment = MAIN_PROCESS_IP,
                            main_process_port: int | FromEnvironment = MAIN_PROCESS_PORT,
                            join_timeout: int | FromEnvironment = JOIN_TIMEOUT,
                            program: tuple[str, ...] = ("accelerate", "launch")) -> list[Word]:
    """The ``accelerate launch`` command of one node. With concrete values (no
    :class:`FromEnvironment`) it runs as it is: see :func:`concrete`."""
    if isinstance(machine_rank, int) and not 0 <= machine_rank < job.nodes:
        raise UsageError(f"machine rank {machine_rank} is outside 0..{job.nodes - 1}")
    rdzv_conf = join_timeout if isinstance(join_timeout, FromEnvironment) else f"timeout={join_timeout}"
    return [*program, "--config_file", job.config_file, "--num_machines", job.nodes,
            "--num_processes", job.num_processes, "--machine_rank", machine_rank,
            "--main_process_ip", main_process_ip, "--main_process_port", main_process_port,
            "--rdzv_conf", rdzv_conf, *job.command]


def torchrun_node_command(job: Job, node_rank: int | FromEnvironment, *,
                          master_addr: str | FromEnvironment = MAIN_PROCESS_IP,
                          master_port: int | FromEnvironment = MAIN_PROCESS_PORT,
                          join_timeout: int | FromEnvironment = JOIN_TIMEOUT,
                          program: tuple[str, ...] = ("torchrun",)) -> list[Word]:
    """The ``torchrun`` command of one node: the static rendezvous ``accelerate launch`` sets up.
    The accelerate settings travel in the environment (:func:`accelerate_environment`)."""
    rdzv_conf = join_timeout if isinstance(join_timeout, FromEnvironment) else f"timeout={join_timeout}"
    return [*program, "--nnodes", job.nodes, "--nproc-per-node", job.gpus_per_node,
            "--node-rank", node_rank, "--rdzv-backend", "static", "--master-addr", master_addr,
            "--master-port", master_port, "--rdzv-conf", rdzv_conf, *job.command]


def concrete(command: list[Word]) -> list[str]:
    """A command as ``subprocess`` takes it; refuses words still to be read from the environment."""
    pending = [str(word) for word in command if isinstance(word, FromEnvironment)]
    if pending:
        raise ValueError(f"the command still reads {', '.join(pending)} from the environment")
    return [str(word) for word in command]


def shell_command(command: list[Word], *, indent: str = "  ", width: int = 92, script_at: int | None = None) -> str:
    """A command as shell text: quoted, continued over lines (`` \\``) before flags once a line is
    long, and before word ``script_at`` (where the training script starts) in any case."""
    words = [str(word) if isinstance(word, FromEnvironment) else shell_word(str(word)) for word in command]
    lines, current = [], ""
    for index, word in enumerate(words):
        breaks = current and (index == script_at or len(current) + len(word) + 1 > width
                              or (word.startswith("--") and len(current) > width // 2))
        if breaks:
            lines.append(current)
            current = indent + word
        else:
            current = f"{current} {word}" if current else word
    lines.append(current)
    return " \\\n".join(lines)


def _script_at(job: Job, command: list[Word]) -> int:
    return len(command) - len(job.command)


# ---- scripts ----
def _header(title: str, job: Job, generated_by: str, run_lines: list[str]) -> list[str]:
    # Every value in a comment goes through comment_text: a line break in it would end the comment
    # and make the rest of the value a line of the script.
    lines = [f"# {title}",
             f"# {comment_text(job.config_file)}: {job.nodes} node(s) x {job.gpus_per_node} GPU(s) = "
             f"{job.num_processes} processes.",
             f"# Made by: {comment_text(generated_by)}", "# Run:"]
    lines += [f"#   {comment_text(line)}" for line in run_lines]
    lines += [
        "#",
        "# Read from the environment when it runs, never written here: MAIN_PROCESS_PORT (default",
        f"# {job.port}), JOIN_TIMEOUT (seconds the first node waits for the others before failing,",
        f"# default {job.join_timeout_s}) and the secrets the training needs (HF_TOKEN, WANDB_API_KEY...:",
        "# export them before launching).",
        "# The run folder (--output-dir) must be on storage every node sees: each rank writes its",
        "# checkpoint shards there, and only the job's main process (rank 0) commits them.",
    ]
    return lines


def _run_time_settings(job: Job) -> list[str]:
    return [f'MAIN_PROCESS_PORT="${{MAIN_PROCESS_PORT:-{job.port}}}"',
            f'JOIN_TIMEOUT="${{JOIN_TIMEOUT:-{job.join_timeout_s}}}"']


def _config_check(job: Job) -> list[str]:
    config = shell_word(job.config_file)
    # The path is a quoted word of its own: only "$(pwd)" is expanded in the message.
    return [f"if [[ ! -f {config} ]]; then",
            f'  echo {config}": no such accelerate config in $(pwd); start from the directory '
            'that holds it (or use an absolute path on shared storage)" >&2',
            "  exit 2", "fi"]


def render_slurm(job: Job, *, script_name: str, generated_by: str) -> str:
    """A SLURM batch script: one task per node, each running its node's ``accelerate launch``
    with ``--machine_rank $SLURM_NODEID``, rendezvous on the allocation's first node."""
    command = accelerate_node_command(job, FromEnvironment("SLURM_NODEID"))
    inner = "exec " + shell_command(command, indent="    ", script_at=_script_at(job, command))
    lines = ["#!/bin/bash"]
    lines += _header("SLURM batch script of a multi-node FSDP job: one `accelerate launch` per node.", job, generated_by,
                     [f"sbatch {shell_word(script_name)}      (from the directory that holds {job.config_file})"])
    lines += [f"#SBATCH --job-name={job.job_name}", f"#SBATCH --nodes={job.nodes}", "#SBATCH --ntasks-per-node=1",
              f"#SBATCH --gpus-per-node={job.gpus_per_node}"]
    if job.cpus_per_task is not None:
        lines.append(f"#SBATCH --cpus-per-task={job.cpus_per_task}")
    if job.time_limit is not None:
        lines.append(f"#SBATCH --time={job.time_limit}")
    lines += ["#SBATCH --output=%x-%j.out", "set -euo pipefail", "",
              f"NODES={job.nodes}",
              ': "${SLURM_JOB_NODELIST:?not inside a SLURM allocation: submit this script with sbatch}"',
              'ALLOCATED="${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-unknown}}"',
              'if [[ "$ALLOCATED" != "$NODES" ]]; then',
              '  echo "this script and its accelerate config are for $NODES nodes, the allocation has '
              '$ALLOCATED; generate them for that count (--nodes)" >&2',
              "  exit 2", "fi"]
    lines += _config_check(job)
    lines += ["",
              "# The allocation's first node hosts the rendezvous (torch's static TCP store). NOTE: not",
              "# `| head -n1`: under pipefail, scontrol dies of SIGPIPE when head exits first.",
              'MAIN_PROCESS_IP="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"',
              *_run_time_settings(job),
              "export MAIN_PROCESS_IP MAIN_PROCESS_PORT JOIN_TIMEOUT",
              "",
              "# One task per node starts that node's processes; SLURM_NODEID (0..NODES-1) is its machine",
              "# rank, read inside each task (hence the single quotes). srun passes this environment on",
              "# (--export=ALL, also where the cluster's default is NONE);",
              "# --kill-on-bad-exit stops every node when one fails instead of leaving them waiting.",
              # NOTE: shlex.quote, not shell_word: the only line breaks in `inner` are its own
              # continuations (every value in it is already one quoted line), kept readable.
              'srun --nodes="$NODES" --ntasks-per-node=1 --export=ALL --kill-on-bad-exit=1 bash -c ' + shlex.quote(inner),
              ""]
    return "\n".join(lines)


def _per_node_preamble(job: Job, script_name: str) -> list[str]:
    usage = (f"usage: MAIN_PROCESS_IP=<address of node 0> bash {shell_word(script_name)} NODE_RANK "
             f"(0..{job.nodes - 1}, the rank of this node)")
    return ["set -euo pipefail", "",
            f"NODES={job.nodes}",
            'NODE_RANK="${1:-${NODE_RANK:-}}"',
            'if ! [[ "$NODE_RANK" =~ ^[0-9]+$ ]] || (( NODE_RANK >= NODES )); then',
            f"  echo {shell_word(usage)} >&2", "  exit 2", "fi",
            ': "${MAIN_PROCESS_IP:?set MAIN_PROCESS_IP to the address of node 0 (it hosts the rendezvous)}"',
            *_run_time_settings(job), *_config_check(job), ""]


def _per_node_run_lines(job: Job, script_name: str) -> list[str]:
    return [f"MAIN_PROCESS_IP=<address of node 0> bash {shell_word(script_name)} {rank}      # on node {rank}"
            for rank in range(job.nodes)]


def render_accelerate(job: Job, *, script_name: str, generated_by: str) -> str:
    """A per-node script: ``bash SCRIPT NODE_RANK`` on every node runs that node's ``accelerate launch``."""
    lines = ["#!/usr/bin/env bash"]
    lines += _header("Per-node launch of a multi-node FSDP job: `accelerate launch` on every node.", job, generated_by,
                     _per_node_run_lines(job, script_name))
    lines += _per_node_preamble(job, script_name)
    command = accelerate_node_command(job, FromEnvironment("NODE_RANK"))
    lines += ["exec " + shell_command(command, script_at=_script_at(job, command)), ""]
    return "\n".join(lines)


def render_torchrun(job: Job, *, script_name: str, generated_by: str, environment: dict[str, str]) -> str:
    """A per-node script that runs ``torchrun`` itself, with the accelerate settings of the config
    as environment variables (``environment``: :func:`accelerate_environment`)."""
    lines = ["#!/usr/bin/env bash"]
    lines += _header("Per-node launch of a multi-node FSDP job: `torchrun` on every node.", job, generated_by,
                     _per_node_run_lines(job, script_name))
    lines += _per_node_preamble(job, script_name)
    lines += [f"# The settings of {comment_text(job.config_file)}, as accelerate launch would pass them to its "
              "processes."]
    lines += [f"export {key}={shell_word(value)}" for key, value in sorted(environment.items())
              if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key)]
    command = torchrun_node_command(job, FromEnvironment("NODE_RANK"))
    lines += ["", "exec " + shell_command(command, script_at=_script_at(job, command)), ""]
    return "\n".join(lines)


def default_script_path(config_file: str | os.PathLike, kind: str) -> Path:
    """``CONFIG_STEM.KIND.sh`` next to the config."""
    config = Path(config_file)
    return config.with_name(f"{config.stem}.{kind}.sh")


def check_launcher_output(path: str | os.PathLike, *, config_file: str | os.PathLike, force: bool = False) -> None:
    """Refuse to write a launcher over its own accelerate config (ever), or over an existing file
    that is not a launcher this module wrote (unless ``force``). Nothing is written."""
    path, config = Path(path), Path(config_file)
    if path.resolve() == config.resolve():
        raise UsageError(f"the launch script {path} would replace the accelerate config {config_file} it "
                         "launches; give another file (-o/--launch-output) or leave it out for "
                         f"{default_script_path(config_file, 'KIND').name} next to the config (nothing was written)")
    if path.is_dir():
        raise UsageError(f"{path} is a folder; give the script file to write (nothing was written)")
    if force or not (path.exists() or path.is_symlink()):
        return
    try:
        ours = not path.is_symlink() and is_generated_launcher(
            read_regular_bytes(path, limit=YAML_MAX_BYTES).decode("utf-8", errors="replace"))
    except OSError:
        ours = False
    if not ours:
        raise UsageError(f"{path} exists and is not a launch script written by fsdp-presets (no "
                         f"'{MADE_BY_PREFIX}' header line); choose another file, or pass --force to replace "
                         "it (nothing was written)")


def write_launcher(kind: LauncherKind, job: Job, *, generated_by: str, output: str | os.PathLike | None = None,
                   force: bool = False) -> Path:
    """Render the ``kind`` launcher of ``job`` and write it (executable) to ``output``, by default
    next to the config. Returns the path written. An existing file is replaced only when this
    module wrote it, or with ``force`` (:func:`check_launcher_output`); the write is atomic."""
    from fsdp_presets.fileio import write_text_atomic

    if kind not in LAUNCHER_KINDS:
        raise UsageError(unknown_name_message("launcher", kind, LAUNCHER_KINDS))
    path = Path(output) if output is not None else default_script_path(job.config_file, kind)
    check_launcher_output(path, config_file=job.config_file, force=force)
    name = path.name
    if kind == "slurm":
        text = render_slurm(job, script_name=name, generated_by=generated_by)
    elif kind == "accelerate":
        text = render_accelerate(job, script_name=name, generated_by=generated_by)
    else:
        text = render_torchrun(job, script_name=name, generated_by=generated_by,
                               environment=accelerate_environment(job.config_file))
    if carries_token(text):
        raise UsageError(f"the launch script {path} would carry a value that looks like an access token (hf_..., "
                         "sk-...; not shown); pass secrets through the environment (export HF_TOKEN=... before "
                         "launching), never on the command line that writes a file (nothing was written)")
    write_text_atomic(path, text, mode=0o755)
    return path
