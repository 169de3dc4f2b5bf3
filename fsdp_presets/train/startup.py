"""Checks the recipes make at start-up and after every step, so that bad input or a broken run
stops with one line that names the problem and the fix, never a traceback, a hang or a silently
wrong model.

- :func:`check_start`: the shared flags and input paths on every rank, then a start-up agreement
  over the process group: every rank reports its problems and the settings that must match
  (flags, data and model contents). A problem only one rank has (a data file missing on one node)
  is printed on that rank; ranks started with different settings are named with their values.
  The exchange goes through the launch's key-value store with a timeout, so a rank that never
  arrives is named instead of waited for forever.
- :func:`classifier_head_labels`: the labels of a classification head the model folder already
  has (the data must fit it).
- :func:`stop_if_diverged` / :func:`check_weights_finite`: a NaN or infinite loss, gradient norm or
  weight stops the run with the step and the last good checkpoint (exit 1), before it is saved.
"""

from __future__ import annotations

import json
import math
import os
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

from fsdp_presets import environment
from fsdp_presets.errors import Finding, UsageError, raise_on_every_rank, rank_local

STARTUP_TIMEOUT_ENV = environment.STARTUP_TIMEOUT.name
STARTUP_TIMEOUT_S = 600.0
"""How long a rank waits at the start-up agreement for the others (model loading and imports can
take minutes on a busy node; a rank that has not arrived by then is named)."""

# Flags whose value is a path: ranks on other nodes may see the same file under another mount, so
# their contents are compared instead (data and model-config digests below).
_PATH_FLAGS = ("model", "data", "eval_data", "output_dir")
_store_round = 0


# ---- start-up ----
def check_start(accelerator, args) -> None:
    """:func:`fsdp_presets.train.loop.check_common_args` on every rank, then the agreement: raise
    :class:`UsageError` (exit 2) on every rank when any rank has a problem or the ranks disagree."""
    from fsdp_presets.train.loop import check_common_args

    problem = environment_problem()
    try:
        check_common_args(args)
    except UsageError as error:
        problem = "; ".join(filter(None, (problem, str(error))))
    agree_at_start(accelerator, problem=problem, settings=_settings(args))


def environment_problem() -> str | None:
    """What is wrong with the ``FSDP_PRESETS_*`` variables this rank was started with (None: nothing),
    so that a malformed one stops every rank at start, not at the save or fault point that reads it."""
    from fsdp_presets.cpu_fsdp import PATCH_NAMES, PATCHES_OFF_ENV, UNTESTED_ACCELERATE_OK
    from fsdp_presets.faults import fault_spec_problem

    problems = [fault_spec_problem()]
    if os.environ.get(STARTUP_TIMEOUT_ENV) is not None and _startup_timeout_s(None) is None:
        problems.append(f"{STARTUP_TIMEOUT_ENV}={os.environ[STARTUP_TIMEOUT_ENV]!r}: give a number of seconds "
                        "above 0, such as 600")
    if os.environ.get(UNTESTED_ACCELERATE_OK, "1") not in ("0", "1", ""):
        problems.append(f"{UNTESTED_ACCELERATE_OK}={os.environ[UNTESTED_ACCELERATE_OK]!r}: give 1 (or leave it unset)")
    unknown = sorted({name.strip() for name in os.environ.get(PATCHES_OFF_ENV, "").split(",")} - {"", *PATCH_NAMES})
    if unknown:  # a misspelt name would leave the patch on and the run looking like proof that it is not needed
        problems.append(f"{PATCHES_OFF_ENV}={os.environ[PATCHES_OFF_ENV]!r}: {', '.join(unknown)} names no patch "
                        f"(the patches: {', '.join(PATCH_NAMES)})")
    problems = [problem for problem in problems if problem]
    return "; ".join(problems) + "; fix or unset the variable" if problems else None


def _startup_timeout_s(default: float | None = STARTUP_TIMEOUT_S) -> float | None:
    """``FSDP_PRESETS_STARTUP_TIMEOUT_S`` as seconds; ``default`` when unset or malformed (a
    malformed value is reported by :func:`environment_problem`)."""
    try:
        value = float(os.environ.get(STARTUP_TIMEOUT_ENV, STARTUP_TIMEOUT_S))
    except ValueError:
        return default
    return value if math.isfinite(value) and value > 0 else default


def _settings(args) -> dict[str, Any]:
    """The values every rank must share: the flags (paths replaced by what they hold)."""
    from fsdp_presets.fileio import sha256_file

    settings = {f"--{key.replace('_', '-')}": value for key, value in sorted(vars(args).items())
                if key not in _PATH_FLAGS}
    for flag, value in (("--data", args.data), ("--eval-data", args.eval_data)):
        if value is not None and Path(value).is_file():
            settings[f"{flag} contents (sha256)"] = sha256_file(value)[:16]
    config = Path(args.model) / "config.json"
    if config.is_file():
        settings["--model config.json (sha256)"] = sha256_file(config)[:16]
    return settings


def agree_at_start(accelerator, *, problem: str | None, settings: dict[str, Any]) -> None:
    """Exchange each rank's ``problem`` (or None) and ``settings``; raise on every rank if any rank
    has a problem or a setting differs. One process: only its own problem."""
    if accelerator.num_processes == 1:
        if problem:
            raise UsageError(problem)
        return
    rank = accelerator.process_index
    mine = {"rank": rank, "host": socket.gethostname(), "problem": problem,
            "settings": {key: repr(value) for key, value in settings.items()}}
    reports = exchange(mine, rank=rank, world_size=accelerator.num_processes)
    problems = {report["rank"]: report for report in reports if report["problem"]}
    if problems:
        texts = {report["problem"] for report in problems.values()}
        if len(problems) == len(reports) and len(texts) == 1:  # the same on every rank: said once
            raise_on_every_rank(accelerator, problem)
        if problem:  # this rank's own: said here, wherever "here" is
            raise rank_local(UsageError(f"rank {rank} ({mine['host']}): {problem}"), print_here=True)
        others = ", ".join(f"rank {index} ({report['host']})" for index, report in sorted(problems.items()))
        elsewhere = any(report["host"] != mine["host"] for report in problems.values())
        raise_on_every_rank(accelerator, rank_local(  # the rank with the problem prints before torchrun stops us
            UsageError(f"stopped: {others} could not start (its message is in that rank's output)"),
            print_here=accelerator.is_main_process and elsewhere), printed_elsewhere=True)
    differences = []
    for key in reports[0]["settings"].keys() | set().union(*(report["settings"] for report in reports)):
        values = [report["settings"].get(key, "(not given)") for report in reports]
        if len(set(values)) > 1:
            shown = ", ".join(f"rank {report['rank']}: {value}" for report, value in zip(reports, values))
            differences.append(f"{key} ({shown})")
    if differences:
        raise_on_every_rank(accelerator, (
            f"the ranks were started with different settings that must match: {'; '.join(sorted(differences))}; "
            "launch every rank with the same flags, data and model (nothing was written)"))


def exchange(payload: dict[str, Any], *, rank: int, world_size: int, timeout_s: float | None = None) -> list[dict]:
    """Every rank's ``payload``, in rank order, through the launch's key-value store (the default
    process group's ``TCPStore``): no collective of the process group, so a rank that is missing
    or elsewhere in its program cannot make the others hang; after ``timeout_s`` the missing ranks
    are named (:class:`Finding`, exit 1)."""
    import torch.distributed as dist

    global _store_round
    _store_round += 1
    timeout_s = timeout_s if timeout_s is not None else _startup_timeout_s()
    try:
        store = dist.distributed_c10d._get_default_store()  # private in torch 2.13: fall back if it goes
    except Exception:
        from accelerate.utils import gather_object

        return sorted(gather_object([payload]), key=lambda report: report["rank"])
    keys = [f"fsdp_presets/start/{_store_round}/{index}" for index in range(world_size)]
    store.set(keys[rank], json.dumps(payload))
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception:  # DistStoreError on timeout (its type moved between torch versions)
        missing = [index for index, key in enumerate(keys) if not store.check([key])]
        raise Finding(f"rank {rank}: ranks {missing} did not reach the start-up check within {timeout_s:.0f} s "
                      f"(of {world_size} processes); look at their output (were they started with this recipe "
                      f"and these flags? stuck reading a file?), or give slow nodes more time with "
                      f"{STARTUP_TIMEOUT_ENV}=SECONDS") from None
    return [json.loads(store.get(key)) for key in keys]


# ---- the launch against the preset's header ----
def preset_launch_problem(accelerator, config_file: str | None, *, resuming: bool = False) -> str | None:
    """How this launch differs from what the generated preset it was launched with was planned for
    (the ``# fsdp-presets:`` line of its header): another process count (``accelerate launch
    --num_processes N``, or ``num_processes`` edited in the file), another distributed type or FSDP
    version, or another mixed precision (``--mixed_precision``). The header's plan (memory per
    process, the global batch) then describes another run. None when the launch agrees, or the file
    is not a generated preset (no such line) or cannot be read (accelerate read it already).

    ``resuming``: the run continues a checkpoint, whose global batch the recipes and the Trainer
    callback keep at another process count (or refuse); another process count alone is then the
    documented way to resume on another number of GPUs, not a problem."""
    from fsdp_presets.preset.emit import file_metadata

    if not config_file:
        return None
    metadata = file_metadata(config_file)
    summary, kind = metadata.get("summary"), metadata.get("kind")
    if kind not in ("fsdp", "ddp-baseline", "trainer") or not isinstance(summary, dict):
        return None
    fsdp = accelerator.distributed_type.value == "FSDP"
    running = f"FSDP{accelerator.state.fsdp_plugin.fsdp_version}" if fsdp else "DDP"
    planned = f"FSDP{summary.get('fsdp_version')}" if kind == "fsdp" else "DDP"
    precision = str(accelerator.mixed_precision)
    differences, flags = [], []
    if summary.get("processes") != accelerator.num_processes and not resuming:
        planned_processes = summary.get("processes")
        differences.append(f"{planned_processes} process{'' if planned_processes == 1 else 'es'}, launched "
                           f"{accelerator.num_processes}")
        flags.append(f"--gpus {accelerator.num_processes}")
    if planned != running:  # e.g. --use_fsdp or --fsdp_version on the launch line
        differences.append(f"{planned}, launched {running}")
    if summary.get("precision") != precision:
        differences.append(f"mixed_precision {summary.get('precision')}, launched {precision}")
        flags.append(f"--precision {'fp32' if precision == 'no' else precision}")
    if not differences:
        return None
    regenerate = "" if not flags else ", or regenerate it for this launch: " + (
        f"fsdp-presets generate --from {config_file} {' '.join(flags)} -o NEW.yaml" if kind == "fsdp" else
        f"its FSDP preset's `fsdp-presets generate` command with {' '.join(flags)}")
    return (f"{config_file} was generated for {'; '.join(differences)}: its header's plan (memory per process, a "
            f"global batch of {summary.get('global_batch')} sequences) does not describe this launch; launch it as "
            f"generated (without the `accelerate launch` flags that override it){regenerate} (nothing was written)")


def mesh_launch_problem(config_file: str | None, distributed_config: str | None) -> str | None:
    """How a launch without ``--distributed-config`` differs from a generated mesh preset (``generate
    --tp/--ep``: its header plans the model sharded over the mesh of the NAME.distributed.json beside
    it): the model would train as FSDP alone over every process, another memory per process and
    another global batch than the header's. None when a mesh file is given, or the file is not a
    generated mesh preset."""
    from fsdp_presets.preset.emit import file_metadata
    from fsdp_presets.preset.emit_distributed import distributed_config_path

    if distributed_config or not config_file:
        return None
    metadata = file_metadata(config_file)
    request, summary = metadata.get("request"), metadata.get("summary")
    if metadata.get("kind") != "fsdp" or not isinstance(request, dict) or not isinstance(summary, dict):
        return None
    if int(request.get("tp") or 1) == 1 and int(request.get("ep") or 1) == 1:
        return None
    return (f"{config_file} was generated for {summary.get('sharding')}, the model sharded over the mesh of "
            f"{distributed_config_path(config_file)}: launch the recipe with --distributed-config "
            f"{distributed_config_path(config_file)} (the header's launch line has it); without it the model would "
            f"train as FSDP alone over every process, which the header's plan (memory per process, a global batch "
            f"of {summary.get('global_batch')} sequences) does not describe (nothing was written)")


# ---- the classification head ----
def classifier_head_labels(config) -> list[str] | None:
    """The label names of the classification head in the model folder, in output order, or None
    when it holds none (a base encoder: the recipe trains a new head). A folder saved from a
    ``...ForSequenceClassification`` model has one, of ``config.num_labels`` outputs."""
    architectures = getattr(config, "architectures", None) or []
    if not any(str(name).endswith("ForSequenceClassification") for name in architectures):
        return None
    id2label = {int(key): str(value) for key, value in (getattr(config, "id2label", None) or {}).items()}
    return [id2label.get(index, f"LABEL_{index}") for index in range(config.num_labels)]


# ---- every step ----
def last_checkpoint(checkpoints) -> str:
    """How a message names the newest committed checkpoint of a run (or that there is none)."""
    from fsdp_presets.checkpoint.manager import committed_checkpoints

    found = committed_checkpoints(checkpoints.directory)
    return (f"the last good checkpoint is {found[-1][1]} (step {found[-1][0]}): resume from it with "
            f"--resume {found[-1][1]}" if found else "no checkpoint was saved before it")


def stop_if_diverged(accelerator, checkpoints, *, step: int, loss: float, grad_norm: float,
                     learning_rate: float) -> None:
    """Stop (:class:`Finding`, exit 1) when the step's loss or gradient norm is NaN or infinite.
    Both are reduced over the ranks, so every rank decides the same; the main process prints."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    raise_on_every_rank(accelerator, error=Finding, message=(
        f"step {step}: the loss is {loss} (gradient norm {grad_norm}): training diverged and was stopped, "
        f"nothing of step {step} was saved; {last_checkpoint(checkpoints)} and a lower --learning-rate "
        f"(now {learning_rate:g}), a longer --warmup-steps or --max-grad-norm clipping, or check the data "
        "and the model's weights"))


def check_weights_finite(accelerator, model, checkpoints, *, step: int) -> None:
    """Before a save: stop (:class:`Finding`) if any weight of the model (this rank's shards, then
    over all ranks) is NaN or infinite, so that no checkpoint ever holds a diverged model."""
    import torch

    bad = 0.0
    with torch.no_grad():
        for param in model.parameters():
            if not param.requires_grad:  # frozen (LoRA's base, 4-bit bytes stored as bf16) cannot diverge
                continue
            local = param.to_local() if hasattr(param, "to_local") else param
            if local.numel() and not bool(torch.isfinite(local).all()):
                bad = 1.0
                break
    bad = accelerator.reduce(torch.tensor(bad, device=accelerator.device), reduction="sum").item()
    if bad:
        raise_on_every_rank(accelerator, error=Finding, message=(
            f"step {step}: the model's weights hold NaN or infinite values after this step (the learning rate or "
            f"the data made them diverge) and it was not saved; {last_checkpoint(checkpoints)} and a lower "
            "--learning-rate or --max-grad-norm clipping"))
