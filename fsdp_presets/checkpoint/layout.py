"""Every file and folder name of a run folder and of a checkpoint, and the path rules between them.

This is the only module that spells them; every other module (and the tests) imports them from
here. A run folder (``--output-dir`` of a recipe)::

    OUTPUT_DIR/run.json                      what was run, by whom, on what (atomic, at start)
    OUTPUT_DIR/run.lock                      who is writing the folder now, while a job runs
    OUTPUT_DIR/metrics.jsonl                 one line per optimizer step, plus evaluation lines
    OUTPUT_DIR/checkpoints/step-NNNNNNNN/    committed checkpoints (below)
    OUTPUT_DIR/checkpoints/.tmp-step-NNNNNNNN/   a save in progress (no manifest yet)
    OUTPUT_DIR/final/                        the trained model (Hugging Face folder; LoRA: PEFT folder)
    OUTPUT_DIR/merged/                       LoRA with --export-merged: the adapter merged into the base
    OUTPUT_DIR/plots/{loss,throughput}.png

A checkpoint folder (``step-NNNNNNNN``, or the output of ``fsdp-presets import``)::

    manifest.json                            step, samples, world size, kind, format, SHA-256 of every file
    pytorch_model_fsdp_0/  optimizer_0/      accelerate's DCP folders (FSDP, SHARDED_STATE_DICT)
    pytorch_model_fsdp.bin optimizer.bin     accelerate's full files (FSDP, FULL_STATE_DICT)
    model.safetensors      optimizer.bin     accelerate's files without FSDP (DDP, one process)
    adapter_model_0/ adapter_optimizer_0/    a LoRA run: trainable weights and their optimizer (DCP)
    random_states_<rank>.pkl, scheduler.bin  accelerate's per-rank RNG state and the scheduler
    model_config/                            config, generation config, tokenizer (+ LoRA: adapter_config.json,
                                             adapter_keys.json)

A ``transformers.Trainer`` run with ``fsdp_presets.FSDPPresetsCallback`` keeps Trainer's own folder
names (``OUTPUT_DIR/checkpoint-N/``, its ``rng_state_<rank>.pth`` and ``trainer_state.json``); the
callback adds run.json, metrics.jsonl and a ``trainer``-kind manifest.json to each checkpoint, and
replaces Trainer's pickled ``training_args.bin`` there by ``training_args.json``.

The accelerate names are accelerate 1.x's (``FSDP_MODEL_NAME``, ``OPTIMIZER_NAME``,
``RNG_STATE_NAME``, ``SAFE_WEIGHTS_NAME`` in ``accelerate.utils.constants``); this module spells
them rather than importing accelerate so that reading a checkpoint stays cheap.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

# ---- hidden siblings a folder is written under before it is renamed into place ----
STAGING_MARK = ".tmp-"
RETIRED_MARK = ".old-"

# ---- run folder ----
RUN_JSON = "run.json"
RUN_LOCK = "run.lock"
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
FINAL = "final"
MERGED = "merged"
PLOTS = "plots"
LOSS_PLOT = "loss.png"
THROUGHPUT_PLOT = "throughput.png"

# ---- checkpoint folder ----
MANIFEST = "manifest.json"
STEP_PREFIX = "step-"
STEP_DIGITS = 8
"""``step-00000012``: eight digits so that names sort like steps."""
STEP_PATTERN = re.compile(rf"^{STEP_PREFIX}(\d{{{STEP_DIGITS}}})$")
TEMPORARY_STEP_PREFIX = f"{STAGING_MARK}{STEP_PREFIX}"
"""A save in progress: ``checkpoints/.tmp-step-NNNNNNNN`` (renamed to ``step-NNNNNNNN`` on commit)."""
DELETING_PREFIX = ".deleting-"
"""A folder renamed away before it is deleted (a kill mid-delete leaves it, and it is ignored)."""
MODEL_CONFIG = "model_config"
"""Config, generation config and tokenizer the recipes save into every checkpoint."""
DCP_MODEL = "pytorch_model_fsdp_0"
"""accelerate's folder of the first model's DCP shards (``FSDP_MODEL_NAME`` + ``_0``)."""
DCP_OPTIMIZER = "optimizer_0"
FULL_MODEL = "pytorch_model_fsdp.bin"
DDP_MODEL = "model.safetensors"
"""accelerate's model file without FSDP (``SAFE_WEIGHTS_NAME``, the name transformers uses too)."""
OPTIMIZER_BIN = "optimizer.bin"
SCHEDULER_BIN = "scheduler.bin"
DCP_METADATA = ".metadata"
"""DCP's index of a DCP folder (every tensor's shape, dtype and where its chunks are)."""
DCP_RANK_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
"""One writing rank's data file of a DCP folder."""
ADAPTER_MODEL = "adapter_model_0"
"""A LoRA checkpoint's trainable weights (DCP); the frozen base reloads from ``--model``."""
ADAPTER_OPTIMIZER = "adapter_optimizer_0"
RNG_STATE_PREFIX = "random_states_"
RNG_STATE_GLOB = f"{RNG_STATE_PREFIX}*.pkl"
RNG_STATE_PATTERN = re.compile(rf"^{RNG_STATE_PREFIX}(\d+)\.pkl$")
"""accelerate's per-rank random state (``RNG_STATE_NAME`` + ``_<rank>.pkl``)."""

# ---- Hugging Face and PEFT folders (final/, merged/, model_config/, export output) ----
HF_CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
HF_WEIGHTS = DDP_MODEL
SAFETENSORS_INDEX = f"{HF_WEIGHTS}.index.json"
HF_LEGACY_WEIGHTS = "pytorch_model.bin"
HF_WEIGHT_FILES = ((SAFETENSORS_INDEX, HF_WEIGHTS), (f"{HF_LEGACY_WEIGHTS}.index.json", HF_LEGACY_WEIGHTS))
"""transformers' weight files, as ``(shard index, single file)`` in the order they are looked for."""
SAFETENSORS_SHARDS = "model{suffix}.safetensors"
"""``huggingface_hub``'s file-name pattern for the shards of an export."""
WEIGHTS_SUFFIX = ".safetensors"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_KEYS = "adapter_keys.json"
"""In a LoRA checkpoint's ``model_config/``: checkpoint tensor name -> key in ``adapter_model.safetensors``."""
EXPORT_RECORD = "fsdp_presets_export.json"
"""In an export's folder: the files ``export`` wrote there; ``--force`` replaces only a folder that
holds it and nothing it does not list."""


def step_folder_name(step: int) -> str:
    """``step-00000012`` for step 12."""
    return f"{STEP_PREFIX}{step:0{STEP_DIGITS}d}"


def step_folder(checkpoints: str | os.PathLike, step: int) -> Path:
    """``CHECKPOINTS_DIR/step-NNNNNNNN``."""
    return Path(checkpoints) / step_folder_name(step)


def temporary_step_folder(checkpoints: str | os.PathLike, step: int) -> Path:
    """``CHECKPOINTS_DIR/.tmp-step-NNNNNNNN``: where a save is written before it is committed."""
    return Path(checkpoints) / f"{TEMPORARY_STEP_PREFIX}{step:0{STEP_DIGITS}d}"


def step_of(name: str | os.PathLike) -> int | None:
    """The step of a committed checkpoint folder's name (``step-00000012`` -> 12), else None."""
    match = STEP_PATTERN.match(Path(name).name)
    return int(match.group(1)) if match else None


def step_in_path(path: str | os.PathLike) -> int | None:
    """The step a checkpoint path names (``.../step-00000012/...`` -> 12; any number of digits),
    looked for in its last part first, else anywhere in it; None when it names none."""
    found = re.search(rf"{STEP_PREFIX}(\d+)", Path(path).name) or re.search(rf"{STEP_PREFIX}(\d+)", str(path))
    return int(found.group(1)) if found else None


def run_folder_of(checkpoint: str | os.PathLike) -> Path:
    """The run folder of a checkpoint: ``OUTPUT_DIR`` for a recipe's ``OUTPUT_DIR/checkpoints/step-N``
    and for Trainer's ``OUTPUT_DIR/checkpoint-N`` (symbolic links resolved, as the checkpoint was
    written)."""
    path = Path(checkpoint).resolve()
    return path.parent if TRAINER_CHECKPOINT_PATTERN.match(path.name) else path.parent.parent


def run_json_of(checkpoint: str | os.PathLike) -> Path:
    """The ``run.json`` of the run that wrote a checkpoint (it may not exist: an imported or
    moved checkpoint has none)."""
    return run_folder_of(checkpoint) / RUN_JSON


def rng_state_file(rank: int) -> str:
    """``random_states_<rank>.pkl``."""
    return f"{RNG_STATE_PREFIX}{rank}.pkl"


# ---- names transformers.Trainer writes (transformers 5.x, trainer.py / trainer_utils.py) ----
TRAINER_CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
TRAINER_STATE = "trainer_state.json"
TRAINER_ARGS_PICKLE = "training_args.bin"
TRAINER_ARGS_JSON = "training_args.json"


def trainer_checkpoint_name(step: int) -> str:
    """``checkpoint-<step>``: Trainer's checkpoint folder of optimizer step ``step``."""
    return f"checkpoint-{step}"


def trainer_rng_state_file(rank: int, world_size: int) -> str:
    """Trainer's per-rank RNG file: ``rng_state.pth`` for one process, else ``rng_state_<rank>.pth``."""
    return "rng_state.pth" if world_size <= 1 else f"rng_state_{rank}.pth"


def rng_state_rank(name: str) -> int | None:
    """The rank of a ``random_states_<rank>.pkl`` file name, else None."""
    match = RNG_STATE_PATTERN.match(name)
    return int(match.group(1)) if match else None


def deleting_name(path: Path) -> Path:
    """The sibling a folder is renamed to before it is deleted (unique, hidden)."""
    return path.with_name(f"{DELETING_PREFIX}{path.name}-{time.time_ns()}")


def staging_sibling(path: Path, *, unique: bool = True) -> Path:
    """A hidden sibling of ``path`` to write into before renaming it into place; ``unique`` adds
    the process and time, so two writers never share one (without it: ``.tmp-NAME``)."""
    if not unique:
        return path.with_name(f"{STAGING_MARK}{path.name}")
    return path.with_name(f".{path.name}{STAGING_MARK}{os.getpid()}-{time.time_ns()}")


def retired_sibling(path: Path) -> Path:
    """The hidden sibling the folder being replaced is renamed to, then deleted."""
    return path.with_name(f".{path.name}{RETIRED_MARK}{os.getpid()}-{time.time_ns()}")


STALE_LOCK_GLOB = f".{RUN_LOCK}.stale-*"


def stale_lock_name(lock: Path) -> Path:
    """Where a stale ``run.lock`` is moved before the new job takes the lock (only one of several
    jobs that found it stale can move it)."""
    return lock.with_name(f".{RUN_LOCK}.stale-{os.getpid()}-{time.time_ns()}")


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
    def merged(self) -> Path:
        return self.root / MERGED

    @property
    def plots(self) -> Path:
        return self.root / PLOTS

    @property
    def lock(self) -> Path:
        return self.root / RUN_LOCK

    def step(self, step: int) -> Path:
        """The committed checkpoint folder of ``step``."""
        return step_folder(self.checkpoints, step)
