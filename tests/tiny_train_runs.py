"""Launches of the tiny worker (tests/workers/tiny_train.py) shared by tests/test_cpu_fsdp.py and
tests/test_numerics.py.

Each run is made once per pytest session (in the folder the session's xdist workers share) by
whichever module asks first.
"""

from __future__ import annotations

from pathlib import Path

from fsdp_harness.launch import read_rank_results, run_launch

from conftest import GLOO_EXIT_ABORT, WORKERS, accelerate_config
from recipe_helpers import made_once, session_folder

WORKER = WORKERS / "tiny_train.py"
HSDP_STEPS, HSDP_SAVE_AT = 20, 10
HSDP_MAX_NORM = 0.5  # below every step's gradient norm of this run: every step is clipped


def hsdp_2x2_clipped(tmp_path_factory) -> tuple[Path, Path, dict[int, dict]]:
    """HSDP 2 x 2 (4 processes, shard in pairs, replicate across them), every step's gradients
    clipped by fsdp_presets.numerics.clip_grad_norm, the state saved after step 10:
    ``(config, checkpoint, {rank: result})``."""
    root = session_folder(tmp_path_factory, "tiny-train-runs")
    config = accelerate_config(root, "hsdp-2x2", num_processes=4,
                               parallelism={"dp_replicate_size": 2, "dp_shard_size": 2})
    checkpoint, out = root / "hsdp-2x2-checkpoint", root / "hsdp-2x2"

    def make() -> None:
        result = run_launch(config, WORKER, ["--result-dir", out, "--steps", HSDP_STEPS, "--max-grad-norm",
                                             HSDP_MAX_NORM, "--save-at", HSDP_SAVE_AT, "--checkpoint", checkpoint])
        result.check()
        assert GLOO_EXIT_ABORT not in result.stderr

    made_once(out, make)
    return config, checkpoint, read_rank_results(out)
