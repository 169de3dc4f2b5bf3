"""Real FSDP and DDP over gloo on a CPU-only host, through `accelerate launch` and an accelerate
config, exactly as a user launches them (fsdp_presets.enable_cpu_fsdp)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from fsdp_harness.launch import read_rank_results, run_launch

import tiny_train_runs
from conftest import GLOO_EXIT_ABORT, WORKERS, accelerate_config, real_launches

WORKER = WORKERS / "tiny_train.py"
STEPS = 20
SAVE_AT = 10
BLOCKS = {"llama": "LlamaDecoderLayer", "gpt2": "GPT2Block"}

pytestmark = pytest.mark.slow


def train(config: Path, out: Path, *args, env=None, expect_success=True) -> dict[int, dict]:
    """Launch the tiny worker and return {rank: result}."""
    result = run_launch(config, WORKER, ["--result-dir", out, "--steps", STEPS, *args], env=env)
    if expect_success:
        result.check()
        assert GLOO_EXIT_ABORT not in result.stderr
        return read_rank_results(out)
    return result


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cpu_fsdp")


@pytest.fixture(scope="module")
def ddp_runs(workdir) -> dict[str, dict[int, dict]]:
    """The DDP baseline (a MULTI_GPU config, 2 processes) for each family, trained once."""
    config = accelerate_config(workdir, "ddp", distributed_type="MULTI_GPU")
    # Forked: the baseline's numbers do not depend on how it started (tests/test_forked_launch.py);
    # the FSDP runs it is compared with are launched for real (PROOFS).
    return {family: train(config, workdir / f"ddp-{family}", "--family", family) for family in ("llama", "gpt2")}


# Every FSDP variant trains the same 20 steps as DDP and saves its state after step 10; the
# checkpoints then serve the resume tests, so each variant costs one launch plus one resume.
VARIANTS = {
    "fsdp2-sharded": ("llama", {"version": 2, "state_dict_type": "SHARDED_STATE_DICT"}),
    "fsdp2-full": ("llama", {"version": 2, "state_dict_type": "FULL_STATE_DICT"}),
    "fsdp1-sharded": ("llama", {"version": 1, "state_dict_type": "SHARDED_STATE_DICT"}),
    "fsdp1-full": ("llama", {"version": 1, "state_dict_type": "FULL_STATE_DICT"}),
    "fsdp1-shard-grad-op": ("llama", {"version": 1, "sharding_strategy": "SHARD_GRAD_OP"}),
    "fsdp2-gpt2": ("gpt2", {"version": 2}),
    "fsdp1-gpt2": ("gpt2", {"version": 1}),
}
RESUMED = ["fsdp2-sharded", "fsdp2-full", "fsdp1-sharded", "fsdp1-full"]
# This variant's ranks start from different weights (--seed-per-rank: rank 0 the usual ones): FSDP1's
# sync_module_states must broadcast rank 0's, or it cannot match DDP (its launch also serves the
# sync_module_states test).
SEEDED_PER_RANK = "fsdp1-shard-grad-op"
# FSDP == DDP and its exact resume, launched for real (conftest.real_launches) once, with FSDP2; the
# other variants (FSDP1 among them) fork their launches: the same script, accelerate and torchrun.
PROOFS = ("fsdp2-sharded",)


@pytest.fixture(scope="module")
def fsdp_runs(workdir) -> dict[str, tuple[Path, Path, dict[int, dict]]]:
    """For each variant: (config, checkpoint saved after step 10, results of the 20-step run)."""
    runs = {}
    for name, (family, fsdp) in VARIANTS.items():
        config = accelerate_config(workdir, name, fsdp=dict(fsdp, transformer_layer_cls_to_wrap=BLOCKS[family]))
        checkpoint = workdir / f"checkpoint-{name}"
        seeded = ("--seed-per-rank",) if name == SEEDED_PER_RANK else ()
        with real_launches() if name in PROOFS else contextlib.nullcontext():
            results = train(config, workdir / name, "--family", family, "--save-at", SAVE_AT,
                            "--checkpoint", checkpoint, *seeded)
        runs[name] = (config, checkpoint, results)
    return runs


def test_ddp_baseline_is_real_multiprocess_ddp(ddp_runs):
    for results in ddp_runs.values():
        assert sorted(results) == [0, 1]
        assert {r["distributed_type"] for r in results.values()} == {"MULTI_CPU"}
        assert {r["model_class"] for r in results.values()} == {"DistributedDataParallel"}
        assert {r["world_size"] for r in results.values()} == {2}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fsdp_shards_and_matches_ddp_bitwise(ddp_runs, fsdp_runs, variant):
    family, _ = VARIANTS[variant]
    _, _, results = fsdp_runs[variant]
    baseline = ddp_runs[family][0]
    assert len(baseline["losses"]) == STEPS
    for rank, result in results.items():
        assert result["distributed_type"] == "FSDP"
        assert result["world_size"] == 2
        # Each rank holds half of every sharded tensor (FSDP1 pads a flat parameter to an even split).
        sharded = result["sharded"]
        assert sharded["total"] > 0
        assert sharded["local"] == pytest.approx(sharded["total"] / 2, abs=1)
        assert result["losses"] == baseline["losses"], f"rank {rank} losses differ from DDP"
    assert results[0]["weights_sha256"] == baseline["weights_sha256"]


@pytest.mark.parametrize("variant", RESUMED)
def test_resume_in_a_new_launch_is_exact(workdir, fsdp_runs, variant):
    config, checkpoint, uninterrupted = fsdp_runs[variant]
    with real_launches() if variant in PROOFS else contextlib.nullcontext():
        resumed = train(config, workdir / f"resumed-{variant}", "--resume", checkpoint)
    expected = {step: loss for step, loss in uninterrupted[0]["losses"].items() if int(step) > SAVE_AT}
    assert len(expected) == STEPS - SAVE_AT
    assert resumed[0]["losses"] == expected
    assert resumed[1]["losses"] == expected
    assert resumed[0]["weights_sha256"] == uninterrupted[0]["weights_sha256"]


def test_fsdp1_sharded_resume_needs_the_optimizer_fix(workdir, fsdp_runs):
    """Without initialising the optimizer state before DCP loads it, Adam's moments restart at
    zero: the first resumed step still matches, the next ones do not."""
    config, checkpoint, uninterrupted = fsdp_runs["fsdp1-sharded"]
    resumed = train(config, workdir / "resumed-no-fix", "--resume", checkpoint,
                    env={"FSDP_PRESETS_CPU_PATCHES_OFF": "fsdp1-optimizer-resume"})
    expected = uninterrupted[0]["losses"]
    got = resumed[0]["losses"]
    assert got[str(SAVE_AT + 1)] == expected[str(SAVE_AT + 1)]
    assert any(got[step] != expected[step] for step in got if int(step) > SAVE_AT + 1)


def test_fsdp1_full_state_dict_keeps_distinct_optimizer_moments(fsdp_runs):
    """With the fix, the saved full optimizer state holds exp_avg and exp_avg_sq as different
    tensors (torch's CPU "offload" made them alias each other)."""
    _, checkpoint, _ = fsdp_runs["fsdp1-full"]
    optimizer_state = torch.load(checkpoint / "optimizer.bin", weights_only=True)["state"]
    assert optimizer_state
    for state in optimizer_state.values():
        assert not torch.equal(state["exp_avg"], state["exp_avg_sq"])


# The upstream FSDP1 crash this reproduces (offload_to_cpu=True frees storage still referenced on a
# CPU host) was measured on torch 2.13.0; torch 2.14.1 no longer crashes, so the patch is only a
# copy saved there.
UPSTREAM_OFFLOAD_CRASH = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) < (2, 14)


@pytest.mark.skipif(not UPSTREAM_OFFLOAD_CRASH, reason=f"torch {torch.__version__} fixed the FSDP1 "
                    "full-state-dict offload crash this test reproduces (crashes on 2.13, not on 2.14.1)")
def test_fsdp1_full_state_dict_crashes_without_the_offload_fix(workdir):
    """Applies to torch 2.13: without the CPU mode's offload fix, FSDP1's full state dict crashes."""
    config = accelerate_config(workdir, "fsdp1-full-nofix", fsdp=VARIANTS["fsdp1-full"][1])
    result = train(config, workdir / "fsdp1-full-nofix", "--save-at", 2, "--checkpoint", workdir / "nofix-ckpt",
                   env={"FSDP_PRESETS_CPU_PATCHES_OFF": "full-state-dict-offload"}, expect_success=False)
    assert result.returncode != 0


def test_fsdp1_sync_module_states_broadcasts_rank0_weights(workdir, fsdp_runs):
    """Ranks start from different weights; sync_module_states makes every rank train rank 0's,
    so the run equals the one where all ranks started equal (FSDP1's strategies and DDP train
    bit for bit alike: test_fsdp_shards_and_matches_ddp_bitwise)."""
    config, _, uninterrupted = fsdp_runs["fsdp1-sharded"]
    _, _, results = fsdp_runs[SEEDED_PER_RANK]
    assert results[0]["losses"] == uninterrupted[0]["losses"]
    assert results[0]["weights_sha256"] == uninterrupted[0]["weights_sha256"]

    refused = train(config, workdir / "sync-no-fix", "--seed-per-rank", expect_success=False,
                    env={"FSDP_PRESETS_CPU_PATCHES_OFF": "sync-module-states"})
    assert refused.returncode != 0
    assert "sync_module_states=True" in refused.stderr


def test_hsdp_2x2_trains_and_resumes(workdir, tmp_path_factory):
    """The HSDP run test_numerics also reads (its gradients are clipped: every step the same way,
    so the resumed steps still equal the uninterrupted ones bit for bit)."""
    config, checkpoint, full = tiny_train_runs.hsdp_2x2_clipped(tmp_path_factory)
    assert (tiny_train_runs.HSDP_STEPS, tiny_train_runs.HSDP_SAVE_AT) == (STEPS, SAVE_AT)
    assert sorted(full) == [0, 1, 2, 3]
    for result in full.values():
        assert result["distributed_type"] == "FSDP"
        # Sharded inside each replica of 2 ranks: half of every tensor per rank.
        assert result["sharded"]["local"] == result["sharded"]["total"] // 2
    losses = full[0]["losses"]
    assert losses[str(STEPS)] < losses["1"] - 0.5, "HSDP run did not learn"
    resumed = train(config, workdir / "hsdp-resumed", "--resume", checkpoint,
                    "--max-grad-norm", tiny_train_runs.HSDP_MAX_NORM)
    assert resumed[0]["losses"] == {step: loss for step, loss in losses.items() if int(step) > SAVE_AT}


def test_launch_without_enable_is_refused(workdir):
    config = accelerate_config(workdir, "refused", fsdp={"version": 2})
    result = train(config, workdir / "refused", "--no-enable", "--guard", expect_success=False)
    assert result.returncode != 0
    assert "each one trains alone" in result.stderr
    assert "enable_cpu_fsdp()" in result.stderr
    assert not list((workdir / "refused").glob("rank-*.json"))


def test_parameter_offload_fails_with_a_clear_message(workdir):
    config = accelerate_config(workdir, "offload", fsdp={"version": 2, "offload_params": True})
    result = train(config, workdir / "offload", expect_success=False)
    assert result.returncode != 0
    assert "fsdp_offload_params: true cannot run on a host without an accelerator" in result.stderr
