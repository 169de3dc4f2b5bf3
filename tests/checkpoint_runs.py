"""Recipe runs shared by tests/test_convert.py and tests/test_reshard_resume.py.

Each run is made once per pytest session (in the folder the session's xdist workers share) by
whichever module asks first, so the two modules together launch the reference run once.
"""

from __future__ import annotations

from pathlib import Path

from conftest import accelerate_config
from recipe_helpers import CAUSAL_LM, causal_lm_args, launch_recipe, made_once, session_folder, tiny_llama


# Constant learning rate after the warm-up (steps 1-2): a run that stops at --max-steps 4 and one
# that goes on to 10 follow the same schedule, so a chain of short legs can be compared with one
# uninterrupted run. Checkpoints every 2 steps, all kept.
SCHEDULE = ("--lr-scheduler", "constant_with_warmup", "--save-every", "2", "--keep-last", "10")
GLOBAL_BATCH = 8  # causal_lm_args: micro-batch 2 x accumulation 2 x 2 processes
REFERENCE_STEPS = 10


def base(tmp_path_factory) -> Path:
    return session_folder(tmp_path_factory, "checkpoint-runs")


def tiny_model(root: Path, *, tied: bool = True) -> Path:
    folder = root / ("tiny-llama-tied" if tied else "tiny-llama")
    return made_once(folder, lambda: tiny_llama(folder, tied=tied))


def fsdp_config(root: Path, version: int, state_dict_type: str = "SHARDED_STATE_DICT") -> Path:
    return accelerate_config(root, f"fsdp{version}-{state_dict_type.lower()}",
                             fsdp={"version": version, "state_dict_type": state_dict_type})


def launch(config: Path, args: list[str], *, processes: int):
    """One causal LM launch that must succeed and exit cleanly."""
    return launch_recipe(config, CAUSAL_LM, args, processes=processes)


def reference_run(root: Path) -> Path:
    """FSDP2, 2 processes, tied tiny Llama, steps 1-10 uninterrupted, a checkpoint every 2 steps."""
    run_dir = root / "reference-fsdp2-x2"
    return made_once(run_dir, lambda: launch(fsdp_config(root, 2), causal_lm_args(
        tiny_model(root), run_dir, *SCHEDULE, "--max-steps", REFERENCE_STEPS), processes=2))
