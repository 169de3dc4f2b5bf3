"""Classification recipe runs shared by tests/test_recipes.py and tests/test_reshard_resume.py.

The reference is made once per pytest session (in the folder the session's xdist workers share)
by whichever module asks first: FSDP2, 2 processes, the tiny BERT with dropout off (so that a run resumed on
another process count, whose new ranks draw other dropout masks, must still give the same
losses), steps 1-12 uninterrupted, a checkpoint every 2 steps, all kept.
"""

from __future__ import annotations

import json
from pathlib import Path

from conftest import accelerate_config
from recipe_helpers import (CLASSIFICATION, GENRES_EVAL, GENRES_TRAIN, launch_recipe, made_once,
                            session_folder, tiny_bert)


# Constant learning rate after the warm-up: a leg that stops early follows the same schedule.
SCHEDULE = ("--lr-scheduler", "constant_with_warmup", "--warmup-steps", "2", "--save-every", "2",
            "--keep-last", "10", "--eval-every", "4")
GLOBAL_BATCH = 8  # micro-batch 2 x accumulation 2 x 2 processes
REFERENCE_STEPS = 12


def base(tmp_path_factory) -> Path:
    return session_folder(tmp_path_factory, "classification-runs")


def tiny_model(root: Path) -> Path:
    """The tiny BERT (4 placeholder labels: the genres fit them) without dropout."""
    folder = root / "tiny-bert-no-dropout"

    def make() -> None:
        tiny_bert(folder)
        config = json.loads((folder / "config.json").read_text())
        config.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        (folder / "config.json").write_text(json.dumps(config, indent=2))

    return made_once(folder, make)


def fsdp_config(root: Path) -> Path:
    return accelerate_config(root, "fsdp2-bert", fsdp={"transformer_layer_cls_to_wrap": "BertLayer"})


def args(model: Path, output_dir: Path, *extra) -> list[str]:
    """A short classification run on the shipped genres data (32 tokens per sample)."""
    return ["--model", str(model), "--data", str(GENRES_TRAIN), "--eval-data", str(GENRES_EVAL),
            "--max-eval-samples", "16", "--output-dir", str(output_dir), "--seq-len", "32",
            "--micro-batch", "2", "--grad-accum", "2", "--learning-rate", "3e-3",
            "--weight-decay", "0.01", *SCHEDULE, *map(str, extra)]


def launch(root: Path, args: list[str], *, processes: int = 2):
    """One recipe launch (under the shared FSDP2 config) that must succeed and exit cleanly."""
    return launch_recipe(fsdp_config(root), CLASSIFICATION, args, processes=processes)


def reference_run(root: Path) -> Path:
    run_dir = root / "reference-fsdp2-x2"
    return made_once(run_dir, lambda: launch(root, args(tiny_model(root), run_dir, "--max-steps", REFERENCE_STEPS)))
