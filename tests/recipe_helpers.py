"""Helpers of the recipe and checkpoint tests: tiny model folders, recipe command lines, file
snapshots, and finding the rank processes of a launch (to SIGKILL one)."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from fsdp_harness.drill import descendants, rank_pid  # noqa: F401 (re-exported for the tests)
from fsdp_harness.launch import launch_env

REPO = Path(__file__).resolve().parent.parent
CAUSAL_LM = REPO / "recipes" / "causal_lm.py"
CLASSIFICATION = REPO / "recipes" / "sequence_classification.py"
SFT_TRAIN = REPO / "data" / "kjv_sft" / "train.jsonl"
SFT_EVAL = REPO / "data" / "kjv_sft" / "eval.jsonl"
GENRES_TRAIN = REPO / "data" / "kjv_genres" / "train.jsonl"
GENRES_EVAL = REPO / "data" / "kjv_genres" / "eval.jsonl"
FSDP2_CONFIG = REPO / "accelerate_configs" / "cpu_fsdp2_demo.yaml"
DDP_CONFIG = REPO / "accelerate_configs" / "cpu_ddp_demo.yaml"


def tiny_llama(folder: Path, *, tied: bool = True) -> Path:
    from fsdp_harness.tiny_model import write_tiny_model

    return write_tiny_model(folder, kind="llama-tied" if tied else "llama",
                            text=SFT_TRAIN.read_text(), max_positions=128)


def tiny_bert(folder: Path) -> Path:
    from fsdp_harness.tiny_model import write_tiny_model

    return write_tiny_model(folder, kind="bert", text=GENRES_TRAIN.read_text(), max_positions=128, num_labels=4)


def causal_lm_args(model: Path, output_dir: Path, *extra) -> list[str]:
    """A short, fast causal LM run on the shipped SFT data (packed 32-token blocks)."""
    return ["--model", str(model), "--data", str(SFT_TRAIN), "--eval-data", str(SFT_EVAL),
            "--max-eval-samples", "16", "--output-dir", str(output_dir), "--seq-len", "32",
            "--micro-batch-size", "2", "--gradient-accumulation-steps", "2", "--learning-rate", "3e-3",
            "--warmup-steps", "2", "--weight-decay", "0.1", *map(str, extra)]


def tree_digest(folder: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``folder`` (to prove nothing changed)."""
    if not folder.exists():
        return {}
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()}


def python() -> str:
    return sys.executable


def offline_env(**extra: str) -> dict[str, str]:
    """The launched jobs' environment (offline, one thread per process) plus ``extra``."""
    return launch_env(extra)
