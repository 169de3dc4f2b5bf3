"""Numerics and bookkeeping across layouts, with real gloo processes.

- gradient clipping keeps FSDP2 bitwise equal to DDP (fsdp_presets.numerics.clip_grad_norm),
  where accelerate's own clip_grad_norm_ does not (tiny worker, 10 steps, every step clipped);
- the recipe with clipping on: DDP, FSDP2 and FSDP1 (FULL_SHARD, SHARD_GRAD_OP) runs log the same
  losses, gradient norms and learning rates, bit for bit, and export the same tied model;
- metrics.jsonl's ``lr`` is the rate the step used; run.json names the FSDP1 sharding strategy;
- checkpoints resumed at another world size (full state dict 2 -> 1, DDP 2 -> 4) and across FSDP
  versions (FSDP2 -> FSDP1 sharded, FSDP1 -> FSDP2 full state dict);
- fp16 as far as a CPU host allows (see test_fp16_* for what it cannot show).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fsdp_presets.compare.records import load_run
from fsdp_presets.train.metrics import read_metrics
from fsdp_harness.launch import read_rank_results, run_launch

import checkpoint_runs as runs
import tiny_train_runs
from conftest import GLOO_EXIT_ABORT, WORKERS, accelerate_config
from recipe_helpers import causal_lm_args, checkpoint

pytestmark = pytest.mark.slow

WORKER = WORKERS / "tiny_train.py"
WORKER_STEPS = 10
MAX_NORM = 0.5  # below every step's gradient norm of the tiny worker run: every step is clipped
RESUME_TOLERANCE = 1e-6  # another world size changes the reduction order (docs/checkpoints.md)


# ---- the tiny worker: clipping, layout against layout ----
def worker(config: Path, out: Path, *args, env=None) -> dict[int, dict]:
    result = run_launch(config, WORKER, ["--result-dir", out, "--steps", WORKER_STEPS, *args], env=env).check()
    assert GLOO_EXIT_ABORT not in result.stderr
    return read_rank_results(out)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("numerics")


@pytest.fixture(scope="module")
def clipped(workdir) -> dict[str, dict]:
    """Rank 0's results of every layout, clipped by the package and by accelerate."""
    configs = {"ddp": accelerate_config(workdir, "ddp", distributed_type="MULTI_GPU"),
               "fsdp2": accelerate_config(workdir, "fsdp2")}
    plan = {"ddp": ("ddp", "package"), "fsdp2": ("fsdp2", "package"),
            "ddp-accelerate": ("ddp", "accelerate"), "fsdp2-accelerate": ("fsdp2", "accelerate")}
    return {name: worker(configs[layout], workdir / f"clip-{name}", "--max-grad-norm", MAX_NORM,
                         "--clip-with", clipper)[0] for name, (layout, clipper) in plan.items()}


def test_clipping_keeps_fsdp2_bitwise_equal_to_ddp(clipped):
    """(FSDP1 with clipping: the recipe test below.)"""
    ddp = clipped["ddp"]
    assert len(ddp["losses"]) == WORKER_STEPS
    assert min(ddp["grad_norms"].values()) > MAX_NORM  # every step really was clipped
    for layout in ("fsdp2",):
        assert clipped[layout]["distributed_type"] == "FSDP"
        assert clipped[layout]["grad_norms"] == ddp["grad_norms"], layout
        assert clipped[layout]["losses"] == ddp["losses"], layout
        assert clipped[layout]["weights_sha256"] == ddp["weights_sha256"], layout


def test_accelerate_clipping_lets_fsdp2_drift_from_ddp(clipped):
    """The reason for clip_grad_norm: fp32 norms summed per shard and per tensor differ in the last
    bits, and so do the clipped runs."""
    ours, theirs = clipped["fsdp2-accelerate"], clipped["ddp-accelerate"]
    assert ours["grad_norms"] != theirs["grad_norms"]
    assert ours["weights_sha256"] != theirs["weights_sha256"]
    # ... by round-off only: the norms agree to fp32 precision.
    for step, norm in theirs["grad_norms"].items():
        assert ours["grad_norms"][step] == pytest.approx(norm, rel=1e-5)


def test_hsdp_clipping_reduces_over_the_shard_group_only(workdir, tmp_path_factory):
    """HSDP 2 x 2: gradients are sharded over one mesh dimension and replicated over the other;
    summing over the replicas too would give sqrt(2) times the norm. HSDP reduces in another order
    than a 4-way DDP all-reduce, so the runs agree to round-off here, not bitwise (measured: equal
    for 2 steps, 1 fp32 ulp apart from step 3). The HSDP run is test_cpu_fsdp's (20 steps, clipped
    at the same norm); its first 4 steps are compared."""
    _, _, hsdp = tiny_train_runs.hsdp_2x2_clipped(tmp_path_factory)
    assert tiny_train_runs.HSDP_MAX_NORM == MAX_NORM
    ddp = accelerate_config(workdir, "ddp4", distributed_type="MULTI_GPU", num_processes=4)
    ours = hsdp[0]
    theirs = worker(ddp, workdir / "clip-ddp4", "--max-grad-norm", MAX_NORM, "--steps", 4)[0]  # the later --steps wins
    assert sorted(theirs["grad_norms"]) == ["1", "2", "3", "4"]
    assert ours["distributed_type"] == "FSDP" and ours["world_size"] == 4
    assert ours["grad_norms"]["1"] == theirs["grad_norms"]["1"]
    for step, norm in theirs["grad_norms"].items():
        assert ours["grad_norms"][step] == pytest.approx(norm, rel=1e-6)
        assert ours["losses"][step] == pytest.approx(theirs["losses"][step], rel=1e-6)


# ---- the recipe: clipping on (default --max-grad-norm 1.0), every layout ----
LAYOUTS = {  # name: (accelerate config settings, checkpoints every 2 steps)
    "ddp": dict(distributed_type="MULTI_GPU"),
    "fsdp2-full": dict(fsdp={"version": 2, "state_dict_type": "FULL_STATE_DICT"}),
    "fsdp1-sharded": dict(fsdp={"version": 1, "state_dict_type": "SHARDED_STATE_DICT"}),
    "fsdp1-full-shard-grad-op": dict(fsdp={"version": 1, "state_dict_type": "FULL_STATE_DICT",
                                           "sharding_strategy": "SHARD_GRAD_OP"}),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return runs.base(tmp_path_factory)


@pytest.fixture(scope="module")
def recipe_runs(root) -> dict[str, tuple[Path, Path]]:
    """``{layout: (accelerate config, run folder)}``: 10 steps on 2 processes, like the shared FSDP2
    reference run (``fsdp2-sharded``), checkpoints every 2 steps."""
    model = runs.tiny_model(root)
    made = {"fsdp2-sharded": (runs.fsdp_config(root, 2), runs.reference_run(root))}
    for name, settings in LAYOUTS.items():
        config = accelerate_config(root, f"numerics-{name}", **settings)
        run_dir = root / f"numerics-{name}"
        if not (run_dir / "final").is_dir():
            runs.launch(config, causal_lm_args(model, run_dir, *runs.SCHEDULE, "--max-steps", runs.REFERENCE_STEPS),
                        processes=2)
        made[name] = (config, run_dir)
    return made


def train_records(run_dir: Path, fields=("step", "loss", "lr", "grad_norm", "samples_seen")) -> list[dict]:
    return [{key: record[key] for key in fields}
            for record in read_metrics(run_dir / "metrics.jsonl") if record["kind"] == "train"]


def test_recipe_with_clipping_is_bitwise_equal_across_ddp_fsdp2_fsdp1(recipe_runs):
    reference = train_records(recipe_runs["ddp"][1])
    assert len(reference) == runs.REFERENCE_STEPS
    assert max(record["grad_norm"] for record in reference) > 1.0  # --max-grad-norm 1.0 clipped
    for name, (_, run_dir) in recipe_runs.items():
        assert train_records(run_dir) == reference, name


def test_lr_is_the_rate_the_step_used(recipe_runs):
    """constant_with_warmup, 2 warm-up steps, peak 3e-3: step 1 uses 0, step 2 half, then the peak
    (the scheduler's value before its step() of that optimizer step)."""
    import torch
    from transformers import get_scheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-3)
    schedule = get_scheduler("constant_with_warmup", optimizer, num_warmup_steps=2, num_training_steps=10)
    expected = []
    for _ in range(runs.REFERENCE_STEPS):
        expected.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    logged = [record["lr"] for record in train_records(recipe_runs["ddp"][1])]
    assert logged == expected
    assert logged[:3] == [0.0, 1.5e-3, 3e-3]


def test_run_json_and_compare_name_the_fsdp1_sharding_strategy(recipe_runs):
    for name, strategy in (("fsdp1-sharded", "FULL_SHARD"), ("fsdp1-full-shard-grad-op", "SHARD_GRAD_OP")):
        run_dir = recipe_runs[name][1]
        recorded = json.loads((run_dir / "run.json").read_text())["fsdp"]
        assert recorded["version"] == 1 and recorded["sharding_strategy"] == strategy
        manifest = json.loads((run_dir / "checkpoints" / "step-00000002" / "manifest.json").read_text())
        assert manifest["fsdp"]["sharding_strategy"] == strategy
        assert f"FSDP1, sharding_strategy={strategy}" in load_run(run_dir).describe()["fsdp"]
    fsdp2 = json.loads((recipe_runs["fsdp2-full"][1] / "run.json").read_text())["fsdp"]
    assert fsdp2["sharding_strategy"] is None and fsdp2["reshard_after_forward"] is True


@pytest.mark.parametrize("layout", ["ddp", "fsdp1-full-shard-grad-op", "fsdp2-sharded"])
def test_export_writes_the_tied_head_once_and_reloads_tied(recipe_runs, layout):
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    final = recipe_runs[layout][1] / "final"
    with safe_open(str(final / "model.safetensors"), "pt") as handle:
        names = set(handle.keys())
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    model = AutoModelForCausalLM.from_pretrained(final)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    # Every layout trained the same model, bit for bit.
    reference = load_file(str(recipe_runs["ddp"][1] / "final" / "model.safetensors"))
    ours = load_file(str(final / "model.safetensors"))
    assert ours.keys() == reference.keys()
    assert all(torch.equal(ours[name], reference[name]) for name in reference)


# ---- resume at another world size, and across FSDP versions ----
RESUMES = {  # name: (layout that saved, layout that resumes, processes that resume, bitwise)
    "full-state-dict-2-to-1": ("fsdp2-full", "fsdp2-full", 1, False),
    "ddp-2-to-4": ("ddp", "ddp", 4, False),
    "fsdp2-to-fsdp1-sharded": ("fsdp2-sharded", "fsdp1-sharded", 2, True),
    "fsdp1-to-fsdp2-full": ("fsdp1-full-shard-grad-op", "fsdp2-full", 2, True),
}
RESUME_AT, RESUME_TO = 2, 4


@pytest.mark.parametrize("name", sorted(RESUMES))
def test_resume_at_another_world_size_or_fsdp_version(root, recipe_runs, name):
    saved_by, resumed_by, processes, bitwise = RESUMES[name]
    config, _ = recipe_runs[resumed_by]
    source = recipe_runs[saved_by][1]
    run_dir = root / f"numerics-resume-{name}"
    result = runs.launch(config, causal_lm_args(runs.tiny_model(root), run_dir, *runs.SCHEDULE, "--max-steps",
                                                RESUME_TO, "--resume", checkpoint(source, RESUME_AT)),
                         processes=processes)
    assert f"resumed from {checkpoint(source, RESUME_AT)}: step {RESUME_AT}" in result.stdout
    got = train_records(run_dir)
    expected = [record for record in train_records(source) if RESUME_AT < record["step"] <= RESUME_TO]
    assert [record["step"] for record in got] == [3, 4]
    if bitwise:  # same world size: FSDP1 = FSDP2 = DDP bit for bit, so the resumed steps too
        assert got == expected
        return
    for ours, theirs in zip(got, expected):
        assert ours["samples_seen"] == theirs["samples_seen"] and ours["lr"] == theirs["lr"]
        assert math.isclose(ours["loss"], theirs["loss"], rel_tol=RESUME_TOLERANCE)
        assert math.isclose(ours["grad_norm"], theirs["grad_norm"], rel_tol=10 * RESUME_TOLERANCE)


# ---- fp16: what a CPU host can show ----
@pytest.fixture(scope="module")
def fp16_runs(workdir) -> dict[str, dict[int, dict]]:
    """FSDP2 with mixed_precision fp16: 10 steps saving after step 5, then a resume from it."""
    config = accelerate_config(workdir, "fsdp2-fp16", mixed_precision="fp16")
    checkpoint = workdir / "fp16-checkpoint"
    full = run_launch(config, WORKER, ["--result-dir", workdir / "fp16", "--steps", WORKER_STEPS,
                                       "--max-grad-norm", MAX_NORM, "--save-at", 5, "--checkpoint", checkpoint]).check()
    resumed = run_launch(config, WORKER, ["--result-dir", workdir / "fp16-resumed", "--steps", WORKER_STEPS,
                                          "--max-grad-norm", MAX_NORM, "--resume", checkpoint]).check()
    return {"full": read_rank_results(workdir / "fp16"), "resumed": read_rank_results(workdir / "fp16-resumed"),
            "stderr": full.stderr + resumed.stderr}


def test_fp16_fsdp2_computes_in_fp16_and_resumes_exactly(fp16_runs, clipped):
    """What CPU shows: FSDP's fp16 policy is applied (the run differs from fp32 by fp16 round-off
    and still learns), clipping works on fp16-computed gradients, and a resume is bitwise exact.
    What it cannot show: accelerate creates no GradScaler on CPU, so dynamic loss scaling and the
    skipping of overflowed steps are untested here (GPU only); DDP ignores fp16 on CPU (it trains
    fp32), so there is no fp16 DDP twin to compare with. The CPU mode warns about both."""
    full = fp16_runs["full"][0]
    fp32 = clipped["fsdp2"]
    assert full["distributed_type"] == "FSDP"
    assert full["losses"] != fp32["losses"]
    for step, loss in fp32["losses"].items():
        assert full["losses"][step] == pytest.approx(loss, rel=5e-3)
    assert full["losses"][str(WORKER_STEPS)] < full["losses"]["1"] - 0.3
    resumed = fp16_runs["resumed"][0]
    assert resumed["losses"] == {step: loss for step, loss in full["losses"].items() if int(step) > 5}
    assert resumed["weights_sha256"] == full["weights_sha256"]
    assert "mixed_precision fp16 on a CPU host" in fp16_runs["stderr"]
