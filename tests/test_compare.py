"""`fsdp-presets compare` on synthetic runs: verdicts, first diverging step, hints, bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fsdp_presets.compare.records import checkpoint_step, load_run
from fsdp_presets.compare.report import render_report, short_label, write_plot
from fsdp_presets.compare.runs import Comparison, EARLY_STEPS, compare_runs
from fsdp_presets.compare.tolerance import BF16_RELATIVE_TOLERANCE, FP32_RELATIVE_TOLERANCE, auto_tolerance
from fsdp_presets.cli import main
from fsdp_presets.errors import UsageError

STEPS = 20
GLOBAL_BATCH = 8


def reference_losses(steps: int = STEPS) -> list[float]:
    """A plausible fp32 loss curve: decaying, with a little structure."""
    return [float(6.9 * math.exp(-0.05 * step) + 0.01 * math.sin(step)) for step in range(1, steps + 1)]


def write_run(folder: Path, *, losses=None, grad_norms=None, lrs=None, precision="no", run_json=True,
              resumed_from=None, eval_every=5, **info_overrides) -> Path:
    """A run folder as the recipes write it (RUN-CONTRACT.md)."""
    losses = reference_losses() if losses is None else losses
    grad_norms = [2.0 / step for step in range(1, len(losses) + 1)] if grad_norms is None else grad_norms
    lrs = [1e-3] * len(losses) if lrs is None else lrs
    folder.mkdir(parents=True, exist_ok=True)
    if run_json:
        info = {
            "format": 1, "recipe": "causal_lm", "model": "tiny-llama", "data": "data.jsonl",
            "data_sha256": "ab" * 32, "seed": 1234, "max_steps": len(losses), "seq_len": 64,
            "micro_batch_size": 2, "gradient_accumulation_steps": 2, "world_size": 2,
            "data_parallel_size": 2, "global_batch_samples": GLOBAL_BATCH, "learning_rate": 1e-3,
            "precision": precision, "distributed_type": "FSDP",
            "fsdp": {"version": 2, "reshard_after_forward": True, "state_dict_type": "SHARDED_STATE_DICT",
                     "activation_checkpointing": False},
            "accelerate_config": None, "resumed_from": resumed_from,
        }
        info.update(info_overrides)
        (folder / "run.json").write_text(json.dumps(info))
    # The recipes evaluate before training too (step 0).
    lines = [{"kind": "eval", "step": 0, "eval_loss": 7.0, "perplexity": math.exp(7.0)}] if eval_every else []
    for index, loss in enumerate(losses):
        step = index + 1
        lines.append({"kind": "train", "step": step, "loss": loss, "lr": lrs[index], "grad_norm": grad_norms[index],
                      "tokens_per_s": 1000.0 + step, "step_time_s": 0.02, "samples_seen": step * GLOBAL_BATCH})
        if eval_every and step % eval_every == 0:
            lines.append({"kind": "eval", "step": step, "eval_loss": loss + 0.1, "perplexity": math.exp(loss + 0.1)})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder


def perturbed(values: list[float], from_step: int, relative: float) -> list[float]:
    """values with a relative error of `relative` from `from_step` on (1-based)."""
    return [v * (1 + relative) if step >= from_step else v for step, v in enumerate(values, start=1)]


def run_cli(*argv) -> int:
    return main(["compare", *map(str, argv)])


# ---------------------------------------------------------------------------------------------
# Verdicts
# ---------------------------------------------------------------------------------------------


def test_identical_runs_are_identical(tmp_path, capsys):
    base, cand = write_run(tmp_path / "ddp"), write_run(tmp_path / "fsdp")
    comparison = compare_runs(load_run(base), load_run(cand))
    assert comparison.verdict == "identical"
    assert comparison.first_divergent_step is None and comparison.diagnosis is None
    assert {m.metric for m in comparison.metrics} == {"samples_seen", "loss", "grad_norm", "lr", "eval_loss"}
    assert all(m.identical_steps == len(m.steps) for m in comparison.metrics)
    assert main(["compare", str(base), str(cand)]) == 0
    assert "IDENTICAL" in capsys.readouterr().out


def test_round_off_within_fp32_tolerance_agrees(tmp_path):
    losses = reference_losses()
    # ~2 ulp of fp32 on every step, like one process against two (FIELD-NOTES.md: 9.5e-7 abs).
    noisy = [loss + 9.5e-7 * (-1) ** step for step, loss in enumerate(losses)]
    base, cand = write_run(tmp_path / "a"), write_run(tmp_path / "b", losses=noisy)
    comparison = compare_runs(load_run(base), load_run(cand))
    assert comparison.verdict == "within_tolerance"
    loss = comparison.metric("loss")
    assert 0 < loss.max_deviation < FP32_RELATIVE_TOLERANCE["loss"]
    assert main(["compare", str(base), str(cand)]) == 0


@pytest.mark.parametrize("first_bad_step", [1, 2, 7, 20])
def test_divergence_reports_the_first_step_over_tolerance(tmp_path, first_bad_step):
    losses = reference_losses()
    # Below-tolerance noise before the fault, so the first step must be found by the threshold,
    # not by the first difference.
    noisy = [loss * (1 + 2e-7) for loss in losses]
    cand_losses = perturbed(noisy, first_bad_step, 1e-4)
    base, cand = write_run(tmp_path / "a"), write_run(tmp_path / "b", losses=cand_losses)
    comparison = compare_runs(load_run(base), load_run(cand))
    assert comparison.verdict == "diverged"
    assert comparison.first_divergent_step == first_bad_step
    assert comparison.first_divergence.metric == "loss"
    assert comparison.metric("loss").max_deviation == pytest.approx(1e-4 + 2e-7, rel=1e-3)
    assert main(["compare", str(base), str(cand)]) == 1


def test_explicit_tolerance_overrides_auto(tmp_path):
    base = write_run(tmp_path / "a")
    cand = write_run(tmp_path / "b", losses=perturbed(reference_losses(), 3, 1e-4))
    assert run_cli(base, cand) == 1
    assert run_cli(base, cand, "--tolerance", "1e-3") == 0
    assert run_cli(base, cand, "--tolerance", "5e-5") == 1


def test_nan_loss_in_the_candidate_is_a_divergence(tmp_path):
    losses = reference_losses()
    losses[11] = float("nan")
    base, cand = write_run(tmp_path / "a"), write_run(tmp_path / "b", losses=losses)
    comparison = compare_runs(load_run(base), load_run(cand))
    assert comparison.first_divergent_step == 12
    assert comparison.metric("loss").max_deviation == math.inf
    assert json.loads(json.dumps(comparison.to_json()))["metrics"][1]["max_deviation"] == "inf"


# ---------------------------------------------------------------------------------------------
# Tolerance
# ---------------------------------------------------------------------------------------------


def test_auto_tolerance_follows_precision(tmp_path):
    fp32 = load_run(write_run(tmp_path / "fp32"))
    bf16 = load_run(write_run(tmp_path / "bf16", precision="bf16"))
    bare = load_run(write_run(tmp_path / "bare", run_json=False))
    assert auto_tolerance(fp32, fp32).loss == FP32_RELATIVE_TOLERANCE["loss"]
    assert auto_tolerance(fp32, fp32).grad_norm == FP32_RELATIVE_TOLERANCE["grad_norm"]
    # fp32 tolerance is "a few ulp": between 2 and 16 fp32 epsilons (2**-23).
    assert 2 <= FP32_RELATIVE_TOLERANCE["loss"] / 2.0**-23 <= 16
    assert auto_tolerance(bf16, bf16).loss == BF16_RELATIVE_TOLERANCE["loss"]
    assert auto_tolerance(fp32, bf16).loss == BF16_RELATIVE_TOLERANCE["loss"]
    assert auto_tolerance(fp32, bf16).grad_norm == BF16_RELATIVE_TOLERANCE["grad_norm"]
    unknown = auto_tolerance(bare, bare)
    assert unknown.loss == FP32_RELATIVE_TOLERANCE["loss"] and "unknown" in unknown.source


def test_bf16_noise_passes_auto_but_fails_fp32(tmp_path):
    noisy = perturbed(reference_losses(), 1, BF16_RELATIVE_TOLERANCE["loss"] / 4)
    base = write_run(tmp_path / "a", precision="bf16")
    cand = write_run(tmp_path / "b", precision="bf16", losses=noisy)
    assert run_cli(base, cand) == 0
    assert run_cli(base, cand, "--tolerance", str(FP32_RELATIVE_TOLERANCE["loss"])) == 1


@pytest.mark.parametrize("text", ["loose", "-1e-3", "1.5", "nan", "inf", ""])
def test_bad_tolerance_is_usage_error(tmp_path, text, capsys):
    base = write_run(tmp_path / "a")
    assert run_cli(base, base, f"--tolerance={text}") == 2
    assert "--tolerance" in capsys.readouterr().err


def test_lr_is_compared_exactly_whatever_the_tolerance(tmp_path):
    base = write_run(tmp_path / "a")
    cand = write_run(tmp_path / "b", lrs=[1e-3 * (1 + 1e-6)] * STEPS)
    comparison = compare_runs(load_run(base), load_run(cand), 0.5)
    assert comparison.verdict == "diverged"
    assert comparison.first_divergence.metric == "lr"


# ---------------------------------------------------------------------------------------------
# Diagnosis: where the divergence starts
# ---------------------------------------------------------------------------------------------


def compared(tmp_path, base_kwargs=None, **cand_kwargs) -> Comparison:
    base = write_run(tmp_path / "base", **(base_kwargs or {}))
    cand = write_run(tmp_path / "cand", **cand_kwargs)
    return compare_runs(load_run(base), load_run(cand))


def test_hint_step_one_loss_points_at_forward(tmp_path):
    comparison = compared(tmp_path, losses=perturbed(reference_losses(), 1, 1e-3))
    assert comparison.first_divergent_step == 1
    assert "initial weights" in comparison.diagnosis and "precision" in comparison.diagnosis


def test_hint_step_one_grad_norm_points_at_gradient_reduction(tmp_path):
    # A gradient reduced in bf16 or not synchronised: grad_norm differs at step 1, the loss at step 2.
    grad_norms = perturbed([2.0 / step for step in range(1, STEPS + 1)], 1, 3e-3)
    comparison = compared(tmp_path, grad_norms=grad_norms, losses=perturbed(reference_losses(), 2, 1e-5))
    assert comparison.first_divergent_step == 1
    assert comparison.first_divergence.metric == "grad_norm"
    assert comparison.metric("loss").first_divergent_step == 2
    assert "reduce dtype" in comparison.diagnosis and "ignored modules" in comparison.diagnosis


def test_hint_early_loss(tmp_path):
    comparison = compared(tmp_path, losses=perturbed(reference_losses(), 3, 1e-5))
    assert comparison.first_divergent_step == 3
    assert "first updates" in comparison.diagnosis


def test_hint_lr_not_rescaled_names_the_ratio(tmp_path):
    comparison = compared(tmp_path, lrs=[5e-4] * STEPS, losses=perturbed(reference_losses(), 2, 1e-4))
    assert comparison.first_divergent_step == 1
    assert comparison.first_divergence.metric == "lr"
    assert "0.5" in comparison.diagnosis and "rescaled" in comparison.diagnosis


def test_hint_after_resume_points_at_lost_state(tmp_path):
    checkpoint = tmp_path / "cand" / "checkpoints" / "step-00000010"
    checkpoint.mkdir(parents=True)
    comparison = compared(tmp_path, losses=perturbed(reference_losses(), 12, 1e-3), resumed_from=str(checkpoint))
    assert comparison.candidate.resume_step == 10
    assert comparison.first_divergent_step == 12
    assert "resume" in comparison.diagnosis and "Optimizer state" in comparison.diagnosis


def test_resume_step_prefers_the_manifest(tmp_path):
    checkpoint = tmp_path / "ckpt" / "latest"
    checkpoint.mkdir(parents=True)
    (checkpoint / "manifest.json").write_text(json.dumps({"step": 7}))
    assert checkpoint_step(str(checkpoint)) == 7
    assert checkpoint_step("/nowhere/checkpoints/step-00000012") == 12
    assert checkpoint_step("/nowhere/else") is None


def test_hint_late_gradual_drift_points_at_reduction_order(tmp_path):
    losses = reference_losses()
    drift = [loss * (1 + 1e-8 * 2.0 ** step) for step, loss in enumerate(losses, start=1)]
    comparison = compared(tmp_path, losses=drift)
    step = comparison.first_divergent_step
    assert step is not None and step > EARLY_STEPS
    assert 1e-8 * 2.0 ** (step - 1) <= 1e-6 < 1e-8 * 2.0 ** step
    assert "gradual" in comparison.diagnosis and "reduction order" in comparison.diagnosis


def test_hint_late_jump(tmp_path):
    comparison = compared(tmp_path, losses=perturbed(reference_losses(), 15, 1e-3))
    assert comparison.first_divergent_step == 15
    assert "jump at step 15" in comparison.diagnosis


def test_hint_data_position(tmp_path):
    base = write_run(tmp_path / "base")
    cand = write_run(tmp_path / "cand")
    lines = [json.loads(line) for line in (cand / "metrics.jsonl").read_text().splitlines()]
    for line in lines:
        if line["kind"] == "train" and line["step"] >= 9:
            line["samples_seen"] += GLOBAL_BATCH  # a batch skipped after step 8
    (cand / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    comparison = compare_runs(load_run(base), load_run(cand))
    assert comparison.first_divergent_step == 9 and comparison.first_divergence.metric == "samples_seen"
    assert "skipped or repeated" in comparison.diagnosis


def test_eval_only_divergence(tmp_path):
    base = write_run(tmp_path / "base")
    cand = write_run(tmp_path / "cand")
    lines = []
    for line in (cand / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "eval" and record["step"] >= 5:
            record["eval_loss"] += 0.5
        lines.append(json.dumps(record))
    assert any('"eval"' in line for line in lines)
    (cand / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    comparison = compare_runs(load_run(base), load_run(cand))
    assert comparison.first_divergence.metric == "eval_loss" and comparison.first_divergent_step == 5
    assert "evaluation" in comparison.diagnosis


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


def test_metrics_file_path_and_folder_are_both_accepted(tmp_path):
    base = write_run(tmp_path / "a")
    cand = write_run(tmp_path / "b")
    assert run_cli(base / "metrics.jsonl", cand) == 0
    assert load_run(base / "metrics.jsonl").info.seed == 1234


def test_steps_missing_from_one_run_are_noted_not_compared(tmp_path):
    base = write_run(tmp_path / "a")
    cand = write_run(tmp_path / "b", losses=reference_losses(12))
    comparison = compare_runs(load_run(base), load_run(cand))
    assert comparison.verdict == "identical"
    assert comparison.metric("loss").steps == list(range(1, 13))
    assert any("only in the baseline (steps 13-20)" in note for note in comparison.notes)


def test_incomplete_last_line_is_ignored_with_a_note(tmp_path):
    cand = write_run(tmp_path / "b")
    with open(cand / "metrics.jsonl", "a") as handle:
        handle.write('{"kind": "train", "step": 21, "lo')
    record = load_run(cand)
    assert max(record.series["loss"]) == 20
    assert any("incomplete" in note for note in record.notes)


def test_evaluation_before_training_is_step_0(tmp_path):
    record = load_run(write_run(tmp_path / "a"))
    assert min(record.series["eval_loss"]) == 0 and min(record.series["loss"]) == 1
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 0, "loss": 1.0}) + "\n")
    with pytest.raises(UsageError, match="integer 'step' >= 1"):
        load_run(bad)


def test_run_without_run_json_is_compared_with_a_note(tmp_path):
    base, cand = write_run(tmp_path / "a", run_json=False), write_run(tmp_path / "b")
    comparison = compare_runs(load_run(base), load_run(cand))
    assert comparison.verdict == "identical"
    assert any("could not be checked" in note for note in comparison.notes)


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("data_sha256", "cd" * 32, ["data", "ab" * 32, "cd" * 32]),
        ("global_batch_samples", 16, ["global batch", "8", "16"]),
        ("seed", 7, ["seed", "1234", "7"]),
        ("seq_len", 128, ["sequence length", "64", "128"]),
    ],
    ids=["data", "global-batch", "seed", "seq-len"],
)
def test_different_setup_is_usage_error_naming_both_values(tmp_path, capsys, field, value, words):
    base = write_run(tmp_path / "a")
    cand = write_run(tmp_path / "b", **{field: value})
    assert run_cli(base, cand) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1  # one line, no traceback
    for word in words:
        assert word in err


def test_all_setup_differences_are_reported_at_once(tmp_path):
    base = write_run(tmp_path / "a")
    cand = write_run(tmp_path / "b", seed=7, global_batch_samples=16)
    with pytest.raises(UsageError) as error:
        compare_runs(load_run(base), load_run(cand))
    assert "seed" in str(error.value) and "global batch" in str(error.value)


def test_bad_inputs_exit_2(tmp_path, capsys):
    good = write_run(tmp_path / "good")
    empty_folder = tmp_path / "empty"
    empty_folder.mkdir()
    no_train = tmp_path / "no-train"
    no_train.mkdir()
    (no_train / "metrics.jsonl").write_text(json.dumps({"kind": "eval", "step": 5, "eval_loss": 1.0}) + "\n")
    garbled = write_run(tmp_path / "garbled")
    text = (garbled / "metrics.jsonl").read_text().splitlines()
    text[3] = "not json"
    text[4] = json.dumps({"kind": "train", "step": "five", "loss": 1.0})
    (garbled / "metrics.jsonl").write_text("\n".join(text) + "\n")
    later = write_run(tmp_path / "later")
    shifted = [json.loads(line) for line in (later / "metrics.jsonl").read_text().splitlines()]
    for line in shifted:
        line["step"] += 100
    (later / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in shifted))

    cases = {
        tmp_path / "missing": "does not exist",
        empty_folder: "holds no metrics.jsonl",
        no_train: "no train lines",
        garbled: "metrics.jsonl:4: not a JSON object",
        later: "no train step in common",
    }
    for path, message in cases.items():
        capsys.readouterr()
        assert run_cli(good, path) == 2, path
        err = capsys.readouterr().err
        assert message in err, (path, err)
    capsys.readouterr()
    assert run_cli(good, garbled) == 2
    assert "metrics.jsonl:5" in capsys.readouterr().err  # every problem at once


def test_bad_output_names_are_refused_before_work(tmp_path, capsys):
    base = write_run(tmp_path / "a")
    assert run_cli(base, base, "--plot", tmp_path / "plot.svg") == 2
    assert run_cli(base, base, "--report", tmp_path / "report.txt") == 2
    assert not (tmp_path / "plot.svg").exists() and not (tmp_path / "report.txt").exists()


# ---------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------


def test_json_output(tmp_path, capsys):
    base = write_run(tmp_path / "a")
    cand = write_run(tmp_path / "b", losses=perturbed(reference_losses(), 4, 1e-3))
    assert run_cli(base, cand, "--json") == 1
    result = json.loads(capsys.readouterr().out)
    assert result["verdict"] == "diverged" and result["agrees"] is False
    assert result["first_divergent_step"] == 4 and result["first_divergent_metric"] == "loss"
    loss = next(m for m in result["metrics"] if m["metric"] == "loss")
    assert loss["first_divergent_step"] == 4 and loss["max_deviation"] == pytest.approx(1e-3, rel=2e-3)
    assert loss["at_first_divergence"]["deviation"] == pytest.approx(1e-3, rel=2e-3)
    assert result["tolerance"]["loss"] == FP32_RELATIVE_TOLERANCE["loss"]
    assert result["diagnosis"]


def test_plot_and_report(tmp_path, capsys):
    base = write_run(tmp_path / "a")
    cand = write_run(tmp_path / "b", losses=perturbed(reference_losses(), 6, 1e-3))
    plot, report = tmp_path / "out" / "overlay.png", tmp_path / "out" / "report.md"
    assert run_cli(base, cand, "--plot", plot, "--report", report) == 1
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000
    text = report.read_text()
    assert "**Verdict: DIVERGED at step 6 (loss)**" in text
    assert "| loss | diverged | 20 | 5 |" in text
    assert "![loss of both runs and their relative deviation](overlay.png)" in text
    assert "Diagnosis:" in text
    assert not [p for p in plot.parent.iterdir() if p.name.startswith(".")]  # no temporary files left


def test_describe_names_the_layout(tmp_path):
    mesh = {"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 1, "cp_size": 1}
    record = load_run(write_run(tmp_path / "a", world_size=4, fsdp={
        "version": 2, "reshard_after_forward": False, "state_dict_type": "SHARDED_STATE_DICT",
        "activation_checkpointing": True, "hsdp_mesh": mesh}))
    assert record.describe()["fsdp"] == ("FSDP2, reshard_after_forward=False, activation_checkpointing=True, "
                                         "HSDP 2 x 2 (replicate x shard)")
    assert short_label(record) == record.describe()["fsdp"] + ", fp32, 4 processes"


def test_plot_marks_the_resume_point(tmp_path):
    checkpoint = tmp_path / "cand" / "checkpoints" / "step-00000010"
    checkpoint.mkdir(parents=True)
    comparison = compared(tmp_path, losses=perturbed(reference_losses(), 12, 1e-3), resumed_from=str(checkpoint))
    write_plot(comparison, tmp_path / "resumed.png")
    assert (tmp_path / "resumed.png").stat().st_size > 10_000
    assert "| resumed_from | - | " + str(checkpoint) + " |" in render_report(comparison)


def test_plot_of_identical_runs(tmp_path):
    base = write_run(tmp_path / "a")
    plot = tmp_path / "identical.png"
    comparison = compare_runs(load_run(base), load_run(base))
    write_plot(comparison, plot)
    assert plot.stat().st_size > 10_000


def test_norm_round_off_is_tolerated_only_when_every_loss_is_bitwise_equal(tmp_path):
    # A sharded norm of a large model rounds 1.5e-5 away from DDP's while the training is identical.
    grad_norms = perturbed([2.0 / step for step in range(1, STEPS + 1)], 3, 3e-5)
    comparison = compared(tmp_path / "same", grad_norms=grad_norms)
    assert comparison.verdict != "diverged"
    assert any("bitwise equal" in note for note in comparison.notes)
    # Norms within the strict bound need no looser one: the table shows the bound the header states.
    comparison = compared(tmp_path / "exact")
    norm = next(metric for metric in comparison.metrics if metric.metric == "grad_norm")
    assert norm.tolerance == FP32_RELATIVE_TOLERANCE["grad_norm"] and not any("bitwise" in n for n in comparison.notes)
    # The same norm deviation with a loss that moved is a divergence at the norm's step.
    comparison = compared(tmp_path / "moved", grad_norms=grad_norms, losses=perturbed(reference_losses(), 4, 1e-5))
    assert comparison.verdict == "diverged"
    assert comparison.first_divergence.metric == "grad_norm" and comparison.first_divergent_step == 3


def test_compare_shows_each_runs_throughput_against_its_presets_prediction(tmp_path, capsys):
    import statistics

    from fsdp_presets.preset.emit import read_metadata

    config = tmp_path / "preset.yaml"
    assert main(["generate", "model_configs/llama-3.2-1b", "--gpus", "8", "-o", str(config)]) == 0
    predicted = read_metadata(config.read_text())["predicted"]
    assert predicted["gpu"] == "H100-SXM" and predicted["tokens_per_s_per_gpu"] > 0
    base, cand = write_run(tmp_path / "a", accelerate_config=str(config)), write_run(tmp_path / "b")
    capsys.readouterr()
    assert run_cli(base, cand) == 0
    out = capsys.readouterr().out
    # The median of tokens_per_s (1000 + step) after step 1, over the run's 2 processes.
    measured = statistics.median(1000.0 + step for step in range(2, STEPS + 1)) / 2
    expected = predicted["tokens_per_s_per_gpu"]
    assert (f"throughput: baseline {measured:,.0f} tokens/s per process measured (median after step 1); its preset "
            f"predicts {expected:,.0f} on H100-SXM ({measured / expected:.2f}x)") in out
    candidate = next(line for line in out.splitlines() if line.startswith("throughput: candidate"))
    assert "predicts" not in candidate  # launched with no generated preset: nothing to hold it to


def test_a_ddp_baseline_file_predicts_ddps_step_not_its_fsdp_presets(tmp_path, capsys):
    """The DDP baseline runs DDP at the preset's micro-batch and accumulation: its header and metadata
    give the planner's DDP row there (what compare holds a baseline run to), and nothing where DDP
    does not fit."""
    from fsdp_presets.preset.emit import read_metadata

    config = tmp_path / "preset.yaml"
    assert main(["generate", "model_configs/smollm2-135m", "--gpus", "8", "--baseline", "ddp", "-o", str(config)]) == 0
    fsdp = read_metadata(config.read_text())
    ddp = read_metadata(config.with_suffix(".ddp.yaml").read_text())["predicted"]
    summary = fsdp["summary"]
    capsys.readouterr()
    assert main(["plan", "model_configs/smollm2-135m", "--gpus", "8", "--seq-len", str(summary["seq_len"]),
                 "--micro-batch", str(summary["micro_batch"]), "--grad-accum", str(summary["gradient_accumulation"]),
                 "--activation-checkpointing", "on" if summary["activation_checkpointing"] else "off", "--json"]) == 0
    row = next(row for row in json.loads(capsys.readouterr().out)["strategies"] if row["name"] == "DDP")
    assert row["fits"] and ddp["tokens_per_s_per_gpu"] == pytest.approx(row["tokens_per_s_per_gpu"], abs=0.1)
    assert ddp["tokens_per_s_per_gpu"] != fsdp["predicted"]["tokens_per_s_per_gpu"]
    assert f"Predicted on H100-SXM: {ddp['step_time_s']:.3g} s" in config.with_suffix(".ddp.yaml").read_text()
    big = tmp_path / "big.yaml"  # at the micro-batch FSDP fits, DDP's replicas of 1B do not
    assert main(["generate", "model_configs/llama-3.2-1b", "--gpus", "8", "--baseline", "ddp", "-o", str(big)]) == 0
    assert "does not fit here" in big.with_suffix(".ddp.yaml").read_text().replace("\n# ", " ")
    assert read_metadata(big.with_suffix(".ddp.yaml").read_text())["predicted"] is None
