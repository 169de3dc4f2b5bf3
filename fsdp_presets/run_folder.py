"""The run folder a recipe writes (see the run-folder contract in docs):

    OUTPUT_DIR/run.json          what was run, by whom, on what (written atomically at start)
    OUTPUT_DIR/metrics.jsonl     one line per optimizer step, plus evaluation lines
    OUTPUT_DIR/checkpoints/step-NNNNNNNN/   committed checkpoints, each with manifest.json
    OUTPUT_DIR/final/            Hugging Face folder of the trained model
    OUTPUT_DIR/plots/            loss.png, throughput.png

:func:`check_output_dir` runs before anything is written: a folder that holds another run (other
recipe, model, data, seed or sequence length), or any other files, is refused so that nothing of
it is overwritten.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_presets.digest import write_json_atomic
from fsdp_presets.errors import UsageError

RUN_FORMAT = 1
RUN_JSON = "run.json"
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
FINAL = "final"
PLOTS = "plots"

# run.json keys that must agree for `--resume` to continue a run in the same folder. The number of
# processes and the batch split may change (resume on another GPU count); these may not.
IDENTITY_KEYS = ("recipe", "model", "data_sha256", "seed", "seq_len")


@dataclass(frozen=True, kw_only=True)
class RunFolder:
    """Paths of one run folder."""

    root: Path
    """OUTPUT_DIR as given on the command line."""

    @property
    def run_json(self) -> Path:
        return self.root / RUN_JSON

    @property
    def metrics(self) -> Path:
        return self.root / METRICS

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS

    @property
    def final(self) -> Path:
        return self.root / FINAL

    @property
    def plots(self) -> Path:
        return self.root / PLOTS


def distributed_settings(accelerator) -> dict[str, Any]:
    """How the processes share the work, as run.json and checkpoint manifests record it."""
    state = accelerator.state
    world_size = accelerator.num_processes
    parallelism = getattr(accelerator, "parallelism_config", None)
    mesh = None
    model_parallel = 1
    if parallelism is not None:
        mesh = {name: int(getattr(parallelism, name, 1) or 1)
                for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size")}
        model_parallel = mesh["tp_size"] * mesh["cp_size"]
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


def read_run_json(root: str | os.PathLike) -> dict[str, Any] | None:
    """The run.json of a folder, or None when there is none."""
    path = Path(root) / RUN_JSON
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise UsageError(f"{path} is not valid JSON ({error}); this folder's run record is damaged, "
                         "choose another --output-dir") from None


def check_output_dir(root: str | os.PathLike, identity: dict[str, Any], resume: str) -> RunFolder:
    """Refuse a folder that holds another run or other files; nothing is written here.

    ``identity`` holds the :data:`IDENTITY_KEYS` of the run about to start; ``resume`` is the
    recipe's ``--resume`` value (``auto``, ``none`` or a checkpoint path).
    """
    folder = RunFolder(root=Path(root))
    if folder.root.exists() and not folder.root.is_dir():
        raise UsageError(f"--output-dir {folder.root} is a file; give a folder")
    if not folder.root.is_dir() or not any(folder.root.iterdir()):
        return folder
    recorded = read_run_json(folder.root)
    if recorded is None:
        entries = ", ".join(sorted(entry.name for entry in folder.root.iterdir())[:5])
        raise UsageError(f"--output-dir {folder.root} is not empty and holds no run ({entries}); "
                         "choose a new or empty folder (nothing was written)")
    def shown(value):  # digests are long: their first 12 hex digits identify them for a reader
        return repr(value[:12] + "...") if isinstance(value, str) and len(value) == 64 else repr(value)

    differences = [f"{key} {shown(recorded.get(key))} there, {shown(identity.get(key))} now"
                   for key in IDENTITY_KEYS if recorded.get(key) != identity.get(key)]
    if differences:
        raise UsageError(f"--output-dir {folder.root} holds another run ({'; '.join(differences)}); "
                         "choose a new --output-dir (nothing was written)")
    if resume == "none":
        raise UsageError(f"--output-dir {folder.root} already holds this run; pass --resume auto to "
                         "continue it, or choose a new --output-dir to start over (nothing was written)")
    return folder


def write_run_json(folder: RunFolder, record: dict[str, Any]) -> None:
    """Write run.json atomically (main process only)."""
    folder.root.mkdir(parents=True, exist_ok=True)
    write_json_atomic(folder.run_json, {"format": RUN_FORMAT, **record})
