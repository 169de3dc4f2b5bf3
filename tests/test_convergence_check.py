"""The convergence check (``fsdp-presets converge``, :mod:`fsdp_presets.compare.converge`,
``scripts/convergence_check.py``): FSDP trains like its DDP baseline, and planted faults are caught
at the right step.

The fast tests check the check's own logic (baseline derivation, bad input, the script calling the
command). The slow ones run the causal LM recipe: 2 (or 4) gloo processes per launch, a tiny Llama,
the shipped KJV data. Launches are the cost (~8-10 s each on an idle 2-core host), so baseline runs
are shared (module fixtures), every candidate is one launch (two for the resume cases), and the
library runs them through the harness's runner (forked launches, see tests/conftest.py); the
planted-fault proof marked ``real_launches`` launches for real.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fsdp_presets.compare.records import load_run
from fsdp_presets.compare.report import summary_lines
from fsdp_presets.compare.runs import compare_runs
from fsdp_presets.compare.tolerance import BF16_RELATIVE_TOLERANCE
from fsdp_presets.cli import build_parser, main
from fsdp_presets.commands import converge as converge_command
from fsdp_presets.compare import converge as check
from fsdp_presets.cpu_fsdp import FSDP1_OPTIMIZER_RESUME
from fsdp_presets.errors import UsageError
from fsdp_harness.launch import run_launch_logged
from fsdp_harness.tiny_model import write_tiny_model

from conftest import GLOO_EXIT_ABORT, REPO, accelerate_config, real_launches

SCRIPT = REPO / "scripts" / "convergence_check.py"
DATA = REPO / "data" / "kjv_sft" / "train.jsonl"
MAX_STEPS = 12
RESUME_AT = 6  # killed in the save of step 12, resumed from step 6
LEARNING_RATE = 1e-3


def request_of(argv: list[str]) -> check.ConvergeRequest:
    """The request ``fsdp-presets converge ARGV`` makes (the command's own parser and fields)."""
    return converge_command.request_from(build_parser().parse_args(["converge", *argv]))


def run_converge(argv: list[str]) -> int:
    """``fsdp-presets converge ARGV`` in this process, each launch through the harness's runner
    (forked unless inside ``real_launches()``): its exit status."""
    request = request_of(argv)
    comparison = check.converge(request, runner=run_launch_logged)
    print("\n".join(check.result_lines(comparison, request.output_dir)))
    return 0 if comparison.agrees else 1


# ---------------------------------------------------------------------------------------------
# Fast: the check's own logic
# ---------------------------------------------------------------------------------------------


def test_ddp_baseline_keeps_processes_and_precision_and_drops_sharding(tmp_path):
    config_path = accelerate_config(tmp_path, "hsdp", num_processes=4, mixed_precision="bf16",
                                    parallelism={"dp_replicate_size": 2, "dp_shard_size": 2})
    baseline, header = check.ddp_baseline_config(check.load_config(config_path), str(config_path))
    assert baseline["distributed_type"] == "MULTI_GPU"
    assert baseline["num_processes"] == 4 and baseline["mixed_precision"] == "bf16"
    assert "fsdp_config" not in baseline and "parallelism_config" not in baseline
    written = check.write_config(baseline, header, tmp_path / "out" / "ddp.yaml")
    assert written.read_text().startswith("# DDP baseline of")
    assert yaml.safe_load(written.read_text()) == baseline
    # accelerate's own loader reads it.
    from accelerate.commands.config.config_args import load_config_from_file

    assert load_config_from_file(str(written)).num_processes == 4


@pytest.mark.parametrize("change, words", [
    ({"parallelism_config": {"parallelism_config_tp_size": 2}}, "model parallelism"),
    ({"num_machines": 2}, "spans 2 machines"),
], ids=["tensor-parallel", "multi-node"])
def test_no_derived_baseline_when_ddp_cannot_match(tmp_path, change, words):
    config = check.load_config(accelerate_config(tmp_path, "fsdp"))
    config.update(change)
    with pytest.raises(UsageError, match=words):
        check.ddp_baseline_config(config, "x.yaml")


@pytest.mark.parametrize("processes", [1, 3])
def test_a_mesh_config_whose_processes_are_not_whole_tp_groups_is_refused(tmp_path, processes):
    # A generated FSDP x TP 2 config with num_processes edited: no DDP baseline of one process per TP group.
    config = check.load_config(accelerate_config(tmp_path, "tp", num_processes=processes))
    with pytest.raises(UsageError, match=f"num_processes {processes} is not a whole number of TP groups of 2"):
        check.ddp_baseline_config(config, "x.yaml", tp_size=2)


def test_bad_input_exits_2_before_any_launch(tmp_path, capsys):
    config = accelerate_config(tmp_path, "fsdp")
    common = ["--model", str(tmp_path), "--data", str(DATA), "--output-dir", str(tmp_path / "out")]
    not_accelerate = tmp_path / "other.yaml"
    not_accelerate.write_text("model: llama\n")
    cases = [
        (["--config", str(tmp_path / "missing.yaml")], "does not exist"),
        (["--config", str(DATA)], "not valid YAML (line 2)"),
        (["--config", str(not_accelerate)], "not an accelerate config"),
        (["--config", str(config), "--resume-at", str(MAX_STEPS)], "--resume-at must be between"),
        (["--config", str(config), "--baseline", str(config), "--baseline-run", str(tmp_path)], "not both"),
        (["--config", str(config), "--tolerance", "wide"], "--tolerance"),
        (["--config", str(config), "--recipe", str(tmp_path / "nope.py")], "recipe"),
    ]
    for argv, message in cases:
        assert main(["converge", *common, "--max-steps", str(MAX_STEPS), *argv]) == 2, argv
        error = capsys.readouterr().err
        assert message in error and error.startswith("fsdp-presets converge: error:"), argv
    (tmp_path / "out" / "candidate").mkdir(parents=True)
    # The script is the command: same flags, same one-line error, same exit status.
    completed = subprocess.run([sys.executable, str(SCRIPT), *common, "--config", str(config)],
                               capture_output=True, text=True, timeout=120)
    assert completed.returncode == 2, completed.stdout + completed.stderr
    assert "already exist" in completed.stderr and len(completed.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["candidate"]  # nothing launched


def test_recipe_arguments_are_the_same_for_both_runs_and_start_fresh(tmp_path):
    request = request_of(["--model", "m", "--data", "d", "--config", "c", "--seq-len", "64", "--max-steps", "12",
                          "--learning-rate", "0.001", "--", "--warmup-steps", "2"])
    flags = check.recipe_arguments(request.training, tmp_path / "run", ["--extra"])
    assert flags[:2] == ["--model", "m"]
    assert flags[flags.index("--max-steps") + 1] == "12" and flags[flags.index("--seed") + 1] == "1234"
    assert flags[flags.index("--resume") + 1] == "none"
    assert "--micro-batch" not in flags  # unset: the recipe default applies to both alike
    assert flags[-3:] == ["--warmup-steps", "2", "--extra"]


# ---------------------------------------------------------------------------------------------
# Slow: real runs of the recipe
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("convergence")


@pytest.fixture(scope="module")
def tiny_model(workdir) -> Path:
    return write_tiny_model(workdir / "tiny-llama", kind="llama", text=DATA.read_text())


def common_args(tiny_model: Path, output: Path) -> list[str]:
    return ["--model", str(tiny_model), "--data", str(DATA), "--output-dir", str(output),
            "--max-steps", str(MAX_STEPS), "--seq-len", "64", "--learning-rate", str(LEARNING_RATE),
            "--timeout", "600"]


def result_of(output: Path) -> dict:
    return json.loads((output / "comparison.json").read_text())


def assert_clean_logs(output: Path) -> None:
    for log in output.glob("*.log"):
        assert GLOO_EXIT_ABORT not in log.read_text(), log


@pytest.fixture(scope="module")
def fsdp2_check(workdir, tiny_model) -> Path:
    """The one-command check: FSDP2 full shard against the DDP baseline it derives. Its baseline
    run is shared by the fp32 cases below."""
    output = workdir / "fsdp2-full-shard"
    config = accelerate_config(workdir, "fsdp2-full-shard")
    assert run_converge(["--config", str(config), *common_args(tiny_model, output)]) in (0, 1)
    return output


def run_check(workdir, tiny_model, name, *argv, baseline: Path | None = None, **config_options) -> tuple[int, dict]:
    """Run the check in-process for a candidate config; returns (exit status, comparison JSON)."""
    output = workdir / name
    config = accelerate_config(workdir, name, **config_options)
    extra = ["--baseline-run", str(baseline / "baseline")] if baseline is not None else []
    status = run_converge(["--config", str(config), *common_args(tiny_model, output), *extra, *argv])
    assert_clean_logs(output)
    return status, result_of(output)


@pytest.mark.slow
def test_fsdp2_full_shard_agrees_with_generated_ddp_baseline(fsdp2_check):
    result = result_of(fsdp2_check)
    assert result["verdict"] in ("identical", "within_tolerance"), result["diagnosis"]
    assert result["baseline"]["distributed_type"] == "MULTI_CPU"  # real DDP over gloo
    assert result["candidate"]["distributed_type"] == "FSDP"
    assert (fsdp2_check / "baseline-ddp.yaml").is_file()
    assert "**Verdict: " in (fsdp2_check / "report.md").read_text()
    assert (fsdp2_check / "overlay.png").stat().st_size > 10_000
    loss = next(m for m in result["metrics"] if m["metric"] == "loss")
    assert loss["steps_compared"] == MAX_STEPS
    assert_clean_logs(fsdp2_check)


# One FSDP1 layout: FSDP1 FULL_SHARD equals DDP bit for bit through the recipe (tests/test_numerics.py),
# and the check finds it agreeing up to the resume in the optimizer-state fault below.
AGREEING_FP32 = {
    "fsdp2-no-reshard": {"fsdp": {"reshard_after_forward": False}},
    "fsdp1-shard-grad-op": {"fsdp": {"version": 1, "sharding_strategy": "SHARD_GRAD_OP"}},
    "fsdp2-activation-checkpointing": {"fsdp": {"activation_checkpointing": True}},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(AGREEING_FP32))
def test_fsdp_layout_agrees_with_ddp(workdir, tiny_model, fsdp2_check, name):
    status, result = run_check(workdir, tiny_model, name, baseline=fsdp2_check, **AGREEING_FP32[name])
    assert status == 0, result["diagnosis"]
    assert result["candidate"]["distributed_type"] == "FSDP"


@pytest.fixture(scope="module")
def hsdp_check(workdir, tiny_model) -> tuple[int, dict, Path]:
    """HSDP 2 x 2 (shard in pairs, replicate across them) against DDP on 4 processes. The global
    batch is twice the 2-process one, so the learning rate is rescaled (linear rule): the DDP run
    is also the reference of the not-rescaled learning-rate fault below."""
    status, result = run_check(workdir, tiny_model, "hsdp-2x2", "--learning-rate", str(2 * LEARNING_RATE),
                               num_processes=4, parallelism={"dp_replicate_size": 2, "dp_shard_size": 2})
    return status, result, workdir / "hsdp-2x2"


@pytest.mark.slow
def test_hsdp_2x2_agrees_with_ddp_on_4_processes(hsdp_check):
    status, result, _ = hsdp_check
    assert status == 0, result["diagnosis"]
    assert result["candidate"]["world_size"] == 4 and result["baseline"]["world_size"] == 4
    assert "HSDP 2 x 2 (replicate x shard)" in result["candidate"]["fsdp"]


@pytest.mark.slow
def test_bf16_fsdp_agrees_with_bf16_ddp(workdir, tiny_model):
    status, result = run_check(workdir, tiny_model, "fsdp2-bf16", mixed_precision="bf16")
    assert status == 0, result["diagnosis"]
    assert result["verdict"] == "within_tolerance"  # bf16 round-off differs, within the calibrated tolerance
    assert result["baseline"]["precision"] == result["candidate"]["precision"] == "bf16"
    assert result["tolerance"]["loss"] == BF16_RELATIVE_TOLERANCE["loss"]


@pytest.mark.slow
def test_resumed_run_agrees_with_uninterrupted_baseline(workdir, tiny_model, fsdp2_check):
    status, result = run_check(workdir, tiny_model, "fsdp2-resumed", "--resume-at", str(RESUME_AT),
                               baseline=fsdp2_check)
    assert status == 0, result["diagnosis"]
    assert result["candidate"]["resumed_from"].endswith(f"step-{RESUME_AT:08d}")
    resumed = workdir / "fsdp2-resumed" / "candidate"
    assert json.loads((resumed / "run.json").read_text())["fsdp"]["state_dict_type"] == "SHARDED_STATE_DICT"
    # Exact resume: the resumed FSDP2 run equals the uninterrupted FSDP2 run, bit for bit.
    uninterrupted = compare_runs(load_run(fsdp2_check / "candidate"), load_run(resumed))
    assert uninterrupted.verdict == "identical", summary_lines(uninterrupted)
    part1 = (workdir / "fsdp2-resumed" / "candidate-part1.log").read_text()
    assert f"[fault] kill at during-save, step {2 * RESUME_AT}" in part1


# ---- planted faults: each must be caught (exit 1) at the step where it first shows ----


def assert_diverged(status: int, result: dict, step: int, metric: str, words: str) -> None:
    assert status == 1, result
    assert result["first_divergent_step"] == step, result["metrics"]
    assert result["first_divergent_metric"] == metric, result["metrics"]
    assert words in result["diagnosis"], result["diagnosis"]


@pytest.mark.slow
def test_fault_norms_left_out_of_gradient_sync_is_caught_at_step_1(workdir, tiny_model, fsdp2_check):
    # FSDP's ignored modules are neither sharded nor gradient-reduced: each rank keeps its own
    # local norm gradient. The forward of step 1 is unchanged; its gradients are not. The candidate
    # is launched for real: the check catching a planted fault is a user-facing proof.
    with real_launches():
        status, result = run_check(workdir, tiny_model, "fault-ignored-norms", baseline=fsdp2_check,
                                   fsdp={"ignored_modules": ".*norm"})
    assert_diverged(status, result, 1, "grad_norm", "ignored modules")


@pytest.mark.slow
def test_fault_gradients_reduced_in_bf16_is_caught_at_step_1(workdir, tiny_model, fsdp2_check):
    # An fp32 run whose FSDP reduce-scatter runs in bf16 (a "bandwidth saving"): the gradients of
    # step 1 are rounded to 8 significant bits before the optimizer sees them.
    status, result = run_check(workdir, tiny_model, "fault-reduce-bf16", "--candidate-args=--fsdp-reduce-dtype bf16",
                               baseline=fsdp2_check)
    assert_diverged(status, result, 1, "grad_norm", "reduce dtype")


@pytest.mark.slow
def test_fault_learning_rate_not_rescaled_is_caught_at_step_1(workdir, tiny_model, hsdp_check):
    # The global batch doubled (micro-batch 2 -> 4 on 2 processes: 8 samples per step, as the
    # 4-process reference) but the learning rate stayed at the old value instead of doubling.
    _, _, reference = hsdp_check
    status, result = run_check(workdir, tiny_model, "fault-lr-not-rescaled", "--micro-batch", "4",
                               baseline=reference)
    assert result["baseline"]["global_batch_samples"] == result["candidate"]["global_batch_samples"] == 8
    assert_diverged(status, result, 1, "lr", "rescaled")
    assert "0.5" in result["diagnosis"]  # candidate / baseline learning rate
    loss = next(m for m in result["metrics"] if m["metric"] == "loss")
    assert loss["first_divergent_step"] == 2  # same weights at step 1, different update after it


@pytest.mark.slow
def test_fault_optimizer_state_lost_on_resume_is_caught_after_the_resume(workdir, tiny_model, fsdp2_check, monkeypatch):
    # FSDP1 with sharded checkpoints loads no optimizer state into a fresh optimizer (FIELD-NOTES);
    # fsdp_presets.enable_cpu_fsdp() fixes it, and switching that fix off plants the fault. The
    # first resumed step (7) still matches: same weights, same gradient. Its update restarts Adam,
    # so the loss of step 8 is the first to differ.
    monkeypatch.setenv("FSDP_PRESETS_CPU_PATCHES_OFF", FSDP1_OPTIMIZER_RESUME)
    status, result = run_check(workdir, tiny_model, "fault-optimizer-lost", "--resume-at", str(RESUME_AT),
                               baseline=fsdp2_check, fsdp={"version": 1, "state_dict_type": "SHARDED_STATE_DICT"})
    assert_diverged(status, result, RESUME_AT + 2, "loss", "resume")
    assert "Optimizer state lost" in result["diagnosis"]
