"""Helpers of the recipe and checkpoint tests: tiny model folders, recipe command lines, file
snapshots, and finding the rank processes of a launch (to SIGKILL one)."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

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
    from fsdp_presets.tiny_model import write_tiny_model

    return write_tiny_model(folder, kind="llama-tied" if tied else "llama",
                            text=SFT_TRAIN.read_text(), max_positions=128)


def tiny_bert(folder: Path) -> Path:
    from fsdp_presets.tiny_model import write_tiny_model

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


def descendants(pid: int) -> list[int]:
    """Process ids under ``pid`` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def rank_pid(launcher_pid: int, rank: int) -> int | None:
    """The process of ``rank`` under an ``accelerate launch`` process, from its environment."""
    wanted = f"RANK={rank}".encode()
    for pid in descendants(launcher_pid):
        try:
            environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if wanted in environment and b"LOCAL_RANK=" + str(rank).encode() in environment:
            return pid
    return None


def python() -> str:
    return sys.executable


def offline_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error"})
    env.update(extra)
    return env
