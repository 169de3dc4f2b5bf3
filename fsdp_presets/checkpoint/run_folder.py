"""The run folder a recipe or a Trainer run writes (its names and paths:
:mod:`fsdp_presets.checkpoint.layout`) and its record, ``run.json``.

:class:`RunInfo` is what ``run.json`` records (the one type its writers and readers use: the
recipes, the Trainer callback, ``compare``, ``inspect-checkpoint``, ``export``, resume); its keys
are spelled here only.

:func:`check_output_dir` runs before anything is written: a folder that holds another run (other
recipe, model, data, seed or sequence length), or any other files, is refused so that nothing of
it is overwritten; so is continuing a run with other training settings (learning rate, schedule,
warm-up, weight decay, clipping) than it was started with.

:func:`acquire_run_lock` then makes the folder one job's: ``run.lock`` is created exclusively
(``O_CREAT | O_EXCL``) by the main process and records the host and PID (and the PID's start
time, so a reused PID is not mistaken for the holder) of every rank. A second job is refused
while any of them lives, e.g. the orphaned ranks of a killed launcher that still train and would
delete the new job's checkpoints. A lock whose processes are all gone on this host is stale: the
next job says so and takes it over. A lock held from another host cannot be checked from here:
the message names the holder and says to delete the file once that job is gone.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdp_presets.checkpoint.layout import (RUN_JSON, RUN_LOCK, STALE_LOCK_GLOB, RunFolder, run_json_of,
                                            stale_lock_name)
from fsdp_presets.errors import UsageError, raise_on_every_rank
from fsdp_presets.fileio import write_json_atomic

# run.json keys that must agree for `--resume` to continue a run in the same folder. The number of
# processes and the batch split may change (resume on another GPU count); these may not.
IDENTITY_KEYS = ("recipe", "model", "data_sha256", "seed", "seq_len")
# run.json keys of the training settings (recipe flags with "-" for "_"): a run continued in its
# folder keeps them, or it would silently become another training. --max-steps may grow (train
# on), never fall below the step already reached (checked on resume).
SETTING_KEYS = ("learning_rate", "lr_scheduler", "warmup_steps", "weight_decay", "max_grad_norm")
METHOD_KEY = "lora"
"""The setting that holds the LoRA/QLoRA shape a continued run keeps (None: full fine-tuning)."""
# run.json keys of distributed_settings(): how the processes share the work.
DISTRIBUTED_KEYS = ("world_size", "data_parallel_size", "precision", "distributed_type", "fsdp", "model_mesh")
# run.json keys two runs must agree on for a step-by-step comparison to mean anything (they train
# on the same samples at every step), with the words a report uses for them.
COMPARABLE_KEYS: tuple[tuple[str, str], ...] = (
    ("data_sha256", "data (sha256 of the data files)"),
    ("global_batch_samples", "global batch (samples per optimizer step)"),
    ("seed", "seed"),
    ("seq_len", "sequence length"),
)


@dataclass(kw_only=True)
class RunInfo:
    """What ``run.json`` records of a run: what was trained on what, how, split over how many
    processes, and where it continued from. Written once per launch by the main process (a
    continued run rewrites it); in the file every entry is a top-level key."""

    identity: dict[str, Any] = field(default_factory=dict)
    """:data:`IDENTITY_KEYS` (recipe, model, data digest, seed, sequence length): a run continued
    in its folder keeps them (a Trainer run records its class, model and seed)."""
    settings: dict[str, Any] = field(default_factory=dict)
    """:data:`SETTING_KEYS` and :data:`METHOD_KEY`: a continued run keeps them too."""
    training: dict[str, Any] | None = None
    """LoRA/QLoRA method and shape (:func:`fsdp_presets.train.lora.settings`), None: every weight trains."""
    data: str | None = None
    """The training data file (``--data``)."""
    max_steps: int | None = None
    """Optimizer steps the launch trains to."""
    micro_batch_size: int | None = None
    """Samples per forward pass per rank."""
    gradient_accumulation_steps: int | None = None
    """Micro-batches per optimizer step (changed on a resume at another process count)."""
    global_batch_samples: int | None = None
    """Samples per optimizer step: micro-batch x accumulation x data-parallel ranks."""
    distributed: dict[str, Any] = field(default_factory=dict)
    """:data:`DISTRIBUTED_KEYS` (:func:`distributed_settings`)."""
    accelerate_config: str | None = None
    """The ``--config_file`` of the launch (:func:`launch_config_file`)."""
    resumed_from: str | None = None
    """The checkpoint this launch continued from, None for a start from step 0."""
    started_on: str | None = None
    """The day the run first started (``YYYY-MM-DD``), kept by every launch that continues it: a chat
    template that writes today's date renders this one (:mod:`fsdp_presets.train.chat_data`)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The recipe's own entries (a classifier's labels) and a LoRA run's bytes per rank."""
    format: int = 1
    """run.json format version."""

    _SCALARS = ("training", "data", "max_steps", "micro_batch_size", "gradient_accumulation_steps",
                "global_batch_samples", "started_on")

    # ---- what readers ask ----
    @property
    def model(self) -> str | None:
        return self.identity.get("model")

    @property
    def seed(self) -> int | None:
        return self.identity.get("seed")

    @property
    def learning_rate(self) -> float | None:
        return self.settings.get("learning_rate")

    @property
    def world_size(self) -> int | None:
        return self.distributed.get("world_size")

    @property
    def precision(self) -> str | None:
        return self.distributed.get("precision")

    @property
    def distributed_type(self) -> str | None:
        return self.distributed.get("distributed_type")

    @property
    def fsdp(self) -> dict[str, Any] | None:
        return self.distributed.get("fsdp")

    @property
    def model_mesh(self) -> dict[str, Any] | None:
        """The TP/EP mesh transformers sharded the model over (``--distributed-config``), None without one."""
        return self.distributed.get("model_mesh")

    def comparable(self) -> list[tuple[str, Any]]:
        """``(words, value)`` of each of :data:`COMPARABLE_KEYS` (None where not recorded)."""
        values = {**self.identity, "global_batch_samples": self.global_batch_samples}
        return [(label, values.get(key)) for key, label in COMPARABLE_KEYS]

    # ---- the file ----
    def to_json(self) -> dict[str, Any]:
        """The flat JSON object of run.json."""
        return {"format": self.format, **self.identity, **self.settings,
                **{name: getattr(self, name) for name in self._SCALARS}, **self.distributed,
                "accelerate_config": self.accelerate_config, "resumed_from": self.resumed_from, **self.extra}

    @classmethod
    def from_json(cls, payload: Any) -> "RunInfo":
        """A record from a parsed run.json (``ValueError`` when it is not a format-1 object); keys
        it does not know go to :attr:`extra`, missing ones are None."""
        if not isinstance(payload, dict):
            raise ValueError("does not hold a JSON object")
        if payload.get("format", 1) != 1:
            raise ValueError(f"has format {payload.get('format')!r}; this version reads format 1")
        groups = {"identity": IDENTITY_KEYS, "settings": (*SETTING_KEYS, METHOD_KEY), "distributed": DISTRIBUTED_KEYS}
        values: dict[str, Any] = {name: {key: payload[key] for key in keys if key in payload}
                                  for name, keys in groups.items()}
        values.update({name: payload.get(name) for name in (*cls._SCALARS, "accelerate_config", "resumed_from")})
        known = {key for keys in groups.values() for key in keys} | set(values) | {"format"}
        values["extra"] = {key: value for key, value in payload.items() if key not in known}
        return cls(**values)

    def write(self, folder: RunFolder) -> None:
        """Write run.json atomically (main process only)."""
        folder.root.mkdir(parents=True, exist_ok=True)
        write_json_atomic(folder.run_json, self.to_json())


def read_run_info(root: str | os.PathLike) -> RunInfo | None:
    """The :class:`RunInfo` of a run folder, None when it has no run.json; ``ValueError`` naming
    the file when it is not valid JSON, not an object or of another format."""
    path = Path(root) / RUN_JSON
    if not path.is_file():
        return None
    try:
        return RunInfo.from_json(json.loads(path.read_text()))
    except ValueError as error:  # JSONDecodeError too
        text = str(error) if error.__class__ is ValueError else f"is not valid JSON ({error})"
        raise ValueError(f"{path} {text}") from None


def run_info_of(checkpoint: str | os.PathLike) -> RunInfo | None:
    """The :class:`RunInfo` of the run that wrote a recipe checkpoint, None when it has none or it
    cannot be read (an imported or moved checkpoint)."""
    try:
        return read_run_info(run_json_of(checkpoint).parent)
    except (OSError, ValueError):
        return None


def first_day(folder: RunFolder, resume: str) -> str | None:
    """The day the run in ``folder`` first started (:attr:`RunInfo.started_on`), or where it continues
    a checkpoint of another folder (``--resume PATH``), that run's; None for a new run."""
    recorded = read_run_info(folder.root) if resume != "none" else None
    if recorded is None and resume not in ("auto", "none"):
        recorded = run_info_of(resume)
    return recorded.started_on if recorded is not None else None


def agreed_first_day(folder: RunFolder, resume: str) -> str:
    """:func:`first_day`, else (a new run) today: the main process's, on every rank, so that ranks on
    both sides of midnight agree. Collective: every rank calls it."""
    import datetime

    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([first_day(folder, resume) or datetime.date.today().isoformat()])[0]


def run_identity(*, recipe: str, model: str, seed: int, data_sha256: str | None = None,
                 seq_len: int | None = None) -> dict[str, Any]:
    """The :data:`IDENTITY_KEYS` of a run (a Trainer run records no data digest nor sequence length)."""
    values = dict(zip(IDENTITY_KEYS, (recipe, model, data_sha256, seed, seq_len)))
    return {key: value for key, value in values.items() if value is not None}


def training_settings(args) -> dict[str, Any]:
    """The :data:`SETTING_KEYS` of a recipe's parsed arguments, or of Trainer's ``TrainingArguments``
    (whose ``lr_scheduler_type`` is the schedule)."""
    values = {key: getattr(args, key) for key in SETTING_KEYS if hasattr(args, key)}
    if "lr_scheduler" not in values and hasattr(args, "lr_scheduler_type"):
        kind = args.lr_scheduler_type
        values["lr_scheduler"] = str(getattr(kind, "value", kind))
    return {key: values[key] for key in SETTING_KEYS if key in values}


def distributed_settings(accelerator, *, model_mesh: dict[str, Any] | None = None) -> dict[str, Any]:
    """How the processes share the work, as run.json and checkpoint manifests record it.
    ``model_mesh``: the sizes of the mesh transformers shards the model over (``--distributed-config``;
    :meth:`fsdp_presets.train.model_mesh.ModelMesh.settings`), recorded as ``model_mesh``."""
    state = accelerator.state
    world_size = accelerator.num_processes
    parallelism = getattr(accelerator, "parallelism_config", None)
    mesh = None
    model_parallel = 1
    if parallelism is not None:
        mesh = {name: int(getattr(parallelism, name, 1) or 1)
                for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size")}
        model_parallel = mesh["tp_size"] * mesh["cp_size"]
    if model_mesh is not None:  # the TP ranks of a group share their samples
        model_parallel = int(model_mesh["tp_size"])
    fsdp = None
    plugin = getattr(state, "fsdp_plugin", None)
    if accelerator.distributed_type.value == "FSDP" and plugin is not None:
        def plain(value):  # enums (ShardingStrategy, StateDictType) as their names
            return value.name if hasattr(value, "name") else value

        version = int(getattr(plugin, "fsdp_version", 1))
        # FSDP1 takes its ShardingStrategy from `sharding_strategy`, or from `reshard_after_forward`
        # when that is unset (accelerate's FSDP1 prepare); FSDP2 has no strategy, only the bool.
        strategy = (getattr(plugin, "sharding_strategy", None) or getattr(plugin, "reshard_after_forward", None)
                    if version == 1 else None)
        fsdp = {
            "version": version,
            "sharding_strategy": plain(strategy),
            "reshard_after_forward": plain(getattr(plugin, "reshard_after_forward", None)),
            "state_dict_type": plain(getattr(plugin, "state_dict_type", None)),
            "activation_checkpointing": bool(getattr(plugin, "activation_checkpointing", False)),
            "hsdp_mesh": mesh if mesh and mesh["dp_replicate_size"] > 1 else None,
        }
    return {
        "world_size": world_size,
        "data_parallel_size": world_size // model_parallel,
        "precision": str(accelerator.mixed_precision),
        "distributed_type": accelerator.distributed_type.value,
        "fsdp": fsdp,
        **({"model_mesh": dict(model_mesh)} if model_mesh is not None else {}),
    }


def launch_config_file() -> str | None:
    """The ``--config_file`` given to ``accelerate launch``, read from the launcher's command line
    (accelerate passes it to no environment variable); None when not launched that way."""
    try:
        parent = Path(f"/proc/{os.getppid()}")
        arguments = (parent / "cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    if not any(argument.endswith(("accelerate", "accelerate.commands.launch", "launch")) for argument in arguments):
        return None
    for flag, value in zip(arguments, arguments[1:]):
        if flag in ("--config_file", "--config-file"):
            path = Path(value)
            if not path.is_absolute():
                try:
                    path = Path(os.readlink(parent / "cwd")) / path
                except OSError:
                    pass
            return str(path)
        if flag.startswith(("--config_file=", "--config-file=")):
            return flag.split("=", 1)[1]
    return None


def check_output_dir(root: str | os.PathLike, identity: dict[str, Any], resume: str,
                     settings: dict[str, Any] | None = None) -> RunFolder:
    """Refuse a folder that holds another run or other files, or this run with other training
    settings; nothing is written here.

    ``identity`` holds the :data:`IDENTITY_KEYS` of the run about to start, ``settings`` its
    :data:`SETTING_KEYS`; ``resume`` is the recipe's ``--resume`` value (``auto``, ``none`` or a
    checkpoint path).
    """
    folder = RunFolder(root=Path(root))
    if folder.root.exists() and not folder.root.is_dir():
        raise UsageError(f"--output-dir {folder.root} is a file; give a folder")
    contents = [entry for entry in folder.root.iterdir() if entry.name != RUN_LOCK] if folder.root.is_dir() else []
    if not contents:
        return folder
    try:
        recorded = read_run_info(folder.root)
    except ValueError as error:
        raise UsageError(f"{error}; this folder's run record is damaged, choose another --output-dir") from None
    if recorded is None:
        entries = ", ".join(sorted(entry.name for entry in contents)[:5])
        raise UsageError(f"--output-dir {folder.root} is not empty and holds no run ({entries}); "
                         "choose a new or empty folder (nothing was written)")
    def shown(value):  # digests are long: their first 12 hex digits identify them for a reader
        return repr(value[:12] + "...") if isinstance(value, str) and len(value) == 64 else repr(value)

    differences = [f"{key} {shown(recorded.identity.get(key))} there, {shown(identity.get(key))} now"
                   for key in IDENTITY_KEYS if recorded.identity.get(key) != identity.get(key)]
    if differences:
        raise UsageError(f"--output-dir {folder.root} holds another run ({'; '.join(differences)}); "
                         "choose a new --output-dir (nothing was written)")
    if resume == "none":
        raise UsageError(f"--output-dir {folder.root} already holds this run; pass --resume auto to "
                         "continue it, or choose a new --output-dir to start over (nothing was written)")
    changed = [f"--{key.replace('_', '-')} {recorded.settings[key]!r} there, {value!r} now"
               for key, value in (settings or {}).items()
               if key in recorded.settings and recorded.settings[key] != value]
    if changed:
        raise UsageError(f"--output-dir {folder.root} holds this run trained with other settings ({'; '.join(changed)}); "
                         "continuing it so would make it another training: pass the settings it was started with, "
                         "or choose a new --output-dir (nothing was written)")
    return folder


# --lr-scheduler values whose learning rate at a step depends on --max-steps (the decay's length)
_DECAYS_OVER_MAX_STEPS = ("cosine", "linear")


def schedule_change_note(root: str | os.PathLike, max_steps: int, settings: dict[str, Any], *,
                         flag: str = "--max-steps ") -> str | None:
    """What continuing the run in ``root`` with another ``--max-steps`` does to its learning-rate
    schedule (None when nothing): a decaying schedule is rebuilt over the new length, so from the
    resumed step the rate follows the new curve, higher (longer run) or lower (shorter) than the old
    curve gave at that step (Trainer rebuilds its scheduler so too). ``flag``: how the script is
    given the length (a Trainer script: ``max_steps=``)."""
    recorded = read_run_info(root) or RunInfo()
    before, scheduler = recorded.max_steps, settings.get("lr_scheduler")
    if (type(before) is not int or before == max_steps or min(before, max_steps) < 1  # Trainer's -1: epochs
            or scheduler not in _DECAYS_OVER_MAX_STEPS):
        return None
    direction = "higher" if max_steps > before else "lower"
    return (f"{flag}{max_steps}, the run was launched with {before}: its {scheduler} learning-rate schedule is "
            f"rebuilt to decay over {max_steps} steps, so from the resumed step (after warm-up) the learning rate "
            f"is the new schedule's, {direction} than the old one gave there; relaunch with {flag}{before} "
            "to keep the schedule")


# ---- the run lock ----
def _process_start(pid: int) -> str | None:
    """The start time of a process on this host (field 22 of /proc/PID/stat, clock ticks since
    boot), or None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def _this_process() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _process_start(os.getpid())}


def _alive(holder: dict[str, Any]) -> bool | None:
    """True/False for a process on this host (a PID reused by another process is dead), None for
    one on another host (cannot be checked from here)."""
    if holder.get("host") != socket.gethostname():
        return None
    pid = holder.get("pid")
    if type(pid) is not int or pid <= 0:
        return False
    start = _process_start(pid)
    return start is not None and (holder.get("start") is None or start == holder.get("start"))


def _describe(lock: Path, payload: dict[str, Any] | None) -> str:
    if not payload:
        return f"{lock} (unreadable)"
    holders = payload.get("processes") or []
    who = ", ".join(f"{item.get('host')} PID {item.get('pid')}" for item in holders[:4] if isinstance(item, dict))
    since = payload.get("since_unix")
    when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else ""
    return f"{who or 'an unknown process'}{when}"


def _read_lock(lock: Path) -> dict[str, Any] | None:
    try:
        payload = json.loads(lock.read_text())
    except (OSError, ValueError):
        return None
    return payload if isinstance(payload, dict) else None


def _lock_problem(lock: Path, payload: dict[str, Any] | None) -> tuple[str | None, str]:
    """``(refusal, note)``: the refusal when the lock's holder may still run, else None and a
    note that the lock is stale."""
    holders = [item for item in (payload or {}).get("processes") or [] if isinstance(item, dict)]
    if payload is None or not holders:
        if payload is None and lock.is_file() and time.time() - lock.stat().st_mtime < 60:
            # NOTE: written by a job that is starting right now (it fills the file just after creating it).
            return (f"--output-dir {lock.parent} is being taken by another job (lock {lock} just created); wait "
                    "for it or choose another --output-dir (nothing was written)"), ""
        return None, f"run lock {lock}: unreadable, from a job that did not finish starting; taking it over"
    states = [_alive(holder) for holder in holders]
    if any(state is True for state in states):
        live = [holder for holder, state in zip(holders, states) if state]
        pids = " ".join(str(holder["pid"]) for holder in live)
        return (f"--output-dir {lock.parent} is in use by another job ({_describe(lock, payload)}; lock file "
                f"{lock}); two jobs writing one run folder delete each other's checkpoints. Wait for it to end, "
                f"or stop it (kill {pids}) and relaunch (nothing was written)"), ""
    if any(state is None for state in states):
        return (f"--output-dir {lock.parent} is locked by a job on another host ({_describe(lock, payload)}; lock "
                f"file {lock}), which cannot be checked from here. If that job is gone (e.g. its node failed), "
                f"delete {lock} and relaunch; otherwise wait for it (nothing was written)"), ""
    return None, (f"run lock {lock}: its job ({_describe(lock, payload)}) is gone (no such process on this host); "
                  "taking it over")


def _try_lock(lock: Path, record: dict[str, Any]) -> tuple[bool, str | None, str | None]:
    """One attempt by the main process: ``(taken, refusal, note)``."""
    try:
        descriptor = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        refusal, note = _lock_problem(lock, _read_lock(lock))
        if refusal:
            return False, refusal, None
        try:  # only one of several jobs that found it stale can move it away
            os.rename(lock, stale_lock_name(lock))
        except FileNotFoundError:
            pass
        return False, None, note
    with os.fdopen(descriptor, "w") as handle:
        handle.write(json.dumps(record))
        handle.flush()
        os.fsync(handle.fileno())
    return True, None, None


def acquire_run_lock(folder: RunFolder, accelerator, *, log=print) -> Path:
    """Make the run folder this job's (see the module docstring). Collective: the main process
    takes the lock, every rank adds its host and PID, every rank raises the same
    :class:`UsageError` when the folder is in use. The lock goes when the main process exits."""
    from accelerate.utils import broadcast_object_list, gather_object

    lock = folder.lock
    multi = accelerator.num_processes > 1
    processes = gather_object([_this_process()]) if multi else [_this_process()]
    refusal = None
    if accelerator.is_main_process:
        record = {"processes": processes, "since_unix": time.time()}
        try:
            created = not folder.root.exists()
            folder.root.mkdir(parents=True, exist_ok=True)
            for _ in range(3):
                taken, refusal, note = _try_lock(lock, record)
                if note:
                    log(note)
                for stale in lock.parent.glob(STALE_LOCK_GLOB):
                    stale.unlink(missing_ok=True)
                if taken or refusal:
                    break
            else:
                refusal = f"--output-dir {folder.root}: could not take {lock}; another job is starting there"
        except OSError as error:
            refusal = f"--output-dir {folder.root}: cannot write its lock ({error}); give a writable folder"
        if refusal is None:
            atexit.register(release_run_lock, folder, remove_empty=created)
    refusal = broadcast_object_list([refusal], from_process=0)[0] if multi else refusal
    raise_on_every_rank(accelerator, refusal)
    return lock


def release_run_lock(folder: RunFolder, *, remove_empty: bool = False) -> None:
    """Remove the lock if this process holds it (main process; also run at exit), and with
    ``remove_empty`` the folder too when the job wrote nothing else (a refusal after the lock)."""
    payload = _read_lock(folder.lock)
    holders = (payload or {}).get("processes") or []
    if holders and holders[0].get("pid") == os.getpid() and holders[0].get("host") == socket.gethostname():
        folder.lock.unlink(missing_ok=True)
        if remove_empty:
            try:
                folder.root.rmdir()
            except OSError:  # not empty: the run wrote into it
                pass
