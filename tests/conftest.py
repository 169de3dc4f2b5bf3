"""Shared test helpers: accelerate configs written the way users write them, and the launcher."""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from pathlib import Path

import pytest

from fsdp_harness.forked_launch import FORKED_LAUNCH
from fsdp_harness.launch import write_accelerate_config

# Launches made through fsdp_harness.launch (run_launch, and the scripts the tests run) fork their
# launcher and ranks from a pre-imported server: the same accelerate and torchrun code, a fraction
# of the start-up CPU (harness/fsdp_harness/forked_launch.py says what differs). Tests that control
# processes (kill a rank, Ctrl-C) launch for real; FSDP_HARNESS_FORKED_LAUNCH=0 makes every launch real.
os.environ.setdefault(FORKED_LAUNCH, "1")

# `plan` rehearses each model's activation terms on first use (fsdp_presets/preset/measured_activations.py).
# The suite plans with the family constants, as before, and never touches the user's cache; the
# tests of the rehearsed terms (tests/test_planner_rehearsed.py) turn it on with a temporary cache.
os.environ["FSDP_PRESETS_PLAN_REHEARSAL"] = "off"
os.environ["FSDP_PRESETS_CACHE"] = "off"

REPO = Path(__file__).resolve().parent.parent
WORKERS = REPO / "tests" / "workers"

# NOTE: gloo prints this when a process exits while the process group still references live
# tensors. Clean teardown (free model/optimizer, destroy the group) removes it; tests assert it
# never appears instead of retrying launches that hit it.
GLOO_EXIT_ABORT = "terminate called without an active exception"


def accelerate_config(directory: Path, name: str, *, distributed_type: str = "FSDP", num_processes: int = 2,
                      fsdp: dict | None = None, parallelism: dict | None = None,
                      mixed_precision: str = "no") -> Path:
    """Write an accelerate config YAML (the schema `accelerate config` writes) and return its path.

    ``fsdp`` entries (short names such as ``version``, or full key names) override an FSDP2
    full-shard, sharded-state-dict default for a tiny Llama; the emitter's writer spells the keys
    (:func:`fsdp_harness.launch.write_accelerate_config`).
    """
    return write_accelerate_config(Path(directory) / f"{name}.yaml", num_processes=num_processes,
                                   distributed_type=distributed_type, fsdp=fsdp, parallelism=parallelism,
                                   mixed_precision=mixed_precision)


@contextlib.contextmanager
def real_launches():
    """Launches made inside run for real, not forked: each user-facing proof (FSDP == DDP, exact
    resume, a world-size change, LoRA == DDP, the convergence check catching a fault, FSDP x TP ==
    DDP) runs once as users run it, with every rank a new interpreter (its own str hash salt, its
    own imports)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(FORKED_LAUNCH, "0")
        yield


LONGEST_MODULES = ("test_planner_rehearsed", "test_recipes", "test_multinode", "test_rehearse", "test_bench",
                   "test_trainer_callback", "test_reshard_resume", "test_lora", "test_convergence_check", "test_mesh_training",
                   "test_async_save", "test_preemption", "test_recipe_bad_input", "test_cpu_fsdp", "test_presets")
"""The modules that take longest (``scripts/test.sh`` lists the slowest tests), longest first."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``scripts/test.sh`` runs ``-n N --dist loadfile --no-loadscope-reorder``:
    each module runs whole on one worker, in the order the workers collected them; without
    ``--no-loadscope-reorder`` xdist orders the modules by their number of tests instead) the
    longest modules start first, then the others by their number of slow tests, so that no long
    module starts last. The runs that ``tests/*_runs.py`` make once per
    session are made once, in a folder every worker shares (``recipe_helpers.made_once``)."""
    if not hasattr(config, "workerinput"):  # the workers collect and order; xdist sends their order
        return
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))

    def order(item) -> tuple[int, int]:
        stem = item.path.stem
        return (LONGEST_MODULES.index(stem) if stem in LONGEST_MODULES else len(LONGEST_MODULES), -slow[item.path])

    items.sort(key=order)  # stable: a module's tests keep their order


@pytest.fixture
def python() -> str:
    return sys.executable


@pytest.fixture(scope="module")
def rehearsal_cache_folder(tmp_path_factory) -> Path:
    """The planner's cache of one module's rehearsal tests (shared by its tests, never the user's)."""
    return tmp_path_factory.mktemp("fsdp-presets-cache")


@pytest.fixture
def rehearsal_cache(rehearsal_cache_folder, monkeypatch):
    """Plan rehearsals on (the suite turns them off) for one test, the cache in the module's
    temporary folder: for the tests that compare the planner with rehearsals. Function-scoped, so
    the module's other tests plan as the rest of the suite does."""
    monkeypatch.setenv("FSDP_PRESETS_CACHE", str(rehearsal_cache_folder))
    monkeypatch.setenv("FSDP_PRESETS_PLAN_REHEARSAL", "on")
    return rehearsal_cache_folder
