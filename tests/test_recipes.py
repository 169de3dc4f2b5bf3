"""The recipes end to end, with real processes: FSDP2 over gloo on 2 CPU processes.

The causal LM runs continue the session's shared FSDP2 reference (tests/checkpoint_runs.py: tiny
Llama, 10 steps, a checkpoint every 2), the classification ones tests/classification_runs.py's
(tiny BERT, 12 steps); both recipes resume through the same code (fsdp_presets.train.recipe).

- a rank SIGKILLed mid-run, then the same command: the losses equal the uninterrupted run (fp32,
  bitwise), for both recipes; then a kill during a save: the half-written checkpoint is ignored,
  with a message, and the run still ends equal to the reference;
- the exported final/ reloads with plain transformers, tied, with the trained model's logits;
- the classification recipe starts from an `fsdp-presets import`ed Hugging Face folder with that
  folder's weights, and lifts accuracy on the shipped task far above chance (real MiniLM);
- bad input: one clear line, exit 2, nothing overwritten.

(DDP against FSDP2 and FSDP1 through the recipe, bitwise: tests/test_numerics.py.)
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsdp_presets.train.metrics import read_metrics
from fsdp_harness.drill import rank_pid
from fsdp_harness.launch import launch_env, run_launch
from fsdp_presets.launching.local import launch_command
import checkpoint_runs as runs
import classification_runs
from recipe_helpers import (BERT_FSDP2, CAUSAL_LM, CLASSIFICATION, GENRES_EVAL, GENRES_TRAIN, REPO, SFT_EVAL,
                            SFT_TRAIN, causal_lm_args, checkpoint, drive_recipe, offline_env, tree_digest)

STEPS = runs.REFERENCE_STEPS
TIMING = ("tokens_per_s", "step_time_s")  # the only fields allowed to differ between runs


def comparable(run_dir: Path) -> list[dict]:
    return [{key: value for key, value in record.items() if key not in TIMING}
            for record in read_metrics(run_dir / "metrics.jsonl")
            if record["kind"] != "save"]  # a save's line is timings and sizes (a kill moves it): not training


def train_steps(run_dir: Path) -> list[int]:
    return [record["step"] for record in read_metrics(run_dir / "metrics.jsonl") if record["kind"] == "train"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return runs.base(tmp_path_factory)


@pytest.fixture(scope="module")
def model(root) -> Path:
    return runs.tiny_model(root)


@pytest.fixture(scope="module")
def reference(root) -> Path:
    """The shared uninterrupted FSDP2 run: the losses every other run must reproduce."""
    return runs.reference_run(root)


def args_of(model: Path, run_dir: Path, *extra) -> list[str]:
    """The reference's command line (another run folder)."""
    return causal_lm_args(model, run_dir, *runs.SCHEDULE, "--max-steps", STEPS, *extra)


@pytest.mark.slow
def test_reference_run_writes_the_run_folder_contract(root, reference):
    run = json.loads((reference / "run.json").read_text())
    assert run["distributed_type"] == "FSDP" and run["world_size"] == 2 and run["fsdp"]["version"] == 2
    assert run["global_batch_samples"] == runs.GLOBAL_BATCH and run["recipe"] == "causal_lm"
    assert run["accelerate_config"] == str(runs.fsdp_config(root, 2))
    assert datetime.date.fromisoformat(run["started_on"]) <= datetime.date.today()  # the run's first day
    records = read_metrics(reference / "metrics.jsonl")
    train = [record for record in records if record["kind"] == "train"]
    evals = [record for record in records if record["kind"] == "eval"]
    assert [record["step"] for record in train] == list(range(1, STEPS + 1))
    assert [record["samples_seen"] for record in train] == [8 * step for step in range(1, STEPS + 1)]
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"} <= set(train[0])
    assert [record["step"] for record in evals] == [0, STEPS]
    assert {"eval_loss", "perplexity", "token_accuracy"} <= set(evals[0])
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] - 1.0  # it learns
    assert sorted(path.name for path in (reference / "checkpoints").iterdir()) == [
        f"step-{step:08d}" for step in range(2, STEPS + 1, 2)]
    manifest = json.loads((checkpoint(reference, STEPS) / "manifest.json").read_text())
    assert manifest["samples_consumed"] == 8 * STEPS and manifest["world_size"] == 2
    assert any(name.startswith("pytorch_model_fsdp_0/") and name.endswith(".distcp") for name in manifest["files"])
    assert (reference / "plots" / "loss.png").stat().st_size > 10_000
    assert (reference / "plots" / "throughput.png").is_file()


def kill_one_rank(config: Path, script: Path, args: list[str], *, after_step: int, run_dir: Path) -> None:
    """Launch, SIGKILL rank 1 once ``after_step`` steps are logged, and wait for the launch to fail."""
    command = launch_command(config, script, args)
    launcher = subprocess.Popen(command, cwd=REPO, env=launch_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    killed_at = None
    deadline = time.monotonic() + 240
    while launcher.poll() is None and time.monotonic() < deadline:
        steps = train_steps(run_dir)
        if steps and steps[-1] >= after_step:
            victim = rank_pid(launcher.pid, 1)
            if victim is not None:
                os.kill(victim, signal.SIGKILL)
                killed_at = steps[-1]
                break
        time.sleep(0.02)
    output = launcher.communicate(timeout=120)[0]
    assert killed_at is not None, f"the run ended before it could be killed:\n{output[-3000:]}"
    assert launcher.returncode != 0


KILLED_IN_SAVE = 8  # the second launch dies inside the save of this step


@pytest.mark.slow
def test_sigkill_then_a_kill_during_a_save_and_the_same_command_still_equals_the_uninterrupted_run(
        root, model, reference, tmp_path):
    run_dir = tmp_path / "killed"
    config = runs.fsdp_config(root, 2)
    kill_one_rank(config, CAUSAL_LM, args_of(model, run_dir), after_step=3, run_dir=run_dir)
    assert max(train_steps(run_dir)) < KILLED_IN_SAVE, "the kill did not stop the run in time"

    # The same command again: it resumes, and this time a rank dies inside the save of step 8,
    # after the shards are written and before the manifest commits them.
    crashed = run_launch(config, CAUSAL_LM, args_of(model, run_dir), cwd=REPO,
                         env={"FSDP_PRESETS_FAULT": f"kill-during-save:step={KILLED_IN_SAVE}"})
    assert crashed.returncode != 0
    assert "resumed from" in crashed.stdout, crashed.stdout
    partial = run_dir / "checkpoints" / f".tmp-step-{KILLED_IN_SAVE:08d}"
    assert partial.is_dir() and not (partial / "manifest.json").exists()
    assert any(partial.rglob("*.distcp"))  # shards were written: half a checkpoint
    assert (checkpoint(run_dir, KILLED_IN_SAVE - 2) / "manifest.json").is_file()

    # As if the run had started on another day: a resume keeps that day (a dated chat template renders it).
    record = json.loads((run_dir / "run.json").read_text())
    (run_dir / "run.json").write_text(json.dumps({**record, "started_on": "2024-07-26"}))
    resumed = run_launch(config, CAUSAL_LM, args_of(model, run_dir), cwd=REPO).check()
    assert f".tmp-step-{KILLED_IN_SAVE:08d}: a save that did not finish" in resumed.stdout, resumed.stdout
    assert f"resumed from {checkpoint(run_dir, KILLED_IN_SAVE - 2)}" in resumed.stdout
    assert comparable(run_dir) == comparable(reference)  # bitwise: every loss, grad norm, lr, eval
    run = json.loads((run_dir / "run.json").read_text())
    assert run["resumed_from"] and Path(run["resumed_from"]).name.startswith("step-")
    assert run["started_on"] == "2024-07-26"


@pytest.mark.slow
def test_export_reloads_with_plain_transformers_tied_with_the_trained_logits(reference):
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    exported = AutoModelForCausalLM.from_pretrained(reference / "final")
    assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()
    with safe_open(str(reference / "final" / "model.safetensors"), "pt") as handle:
        assert "lm_head.weight" not in set(handle.keys())  # the tied weight is written once

    # The trained weights, straight from the last sharded checkpoint (DCP), into a plain model.
    trained = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(reference / "final"))
    state = {"model": trained.state_dict()}
    dcp.load(state, checkpoint_id=str(checkpoint(reference, STEPS) / "pytorch_model_fsdp_0"))
    trained.load_state_dict(state["model"])
    tokenizer = AutoTokenizer.from_pretrained(reference / "final")
    batch = tokenizer(["and god said , let there be light", "blessed are the poor in spirit"],
                      return_tensors="pt", padding=True)
    with torch.no_grad():
        expected = trained(**batch).logits
        got = exported(**batch).logits
    assert torch.equal(got, expected)
    untrained = AutoModelForCausalLM.from_pretrained(Path(json.loads((reference / "run.json").read_text())["model"]))
    with torch.no_grad():
        assert not torch.allclose(untrained(**batch).logits, got)  # the export is the trained model


@pytest.mark.slow
def test_classification_recipe_lifts_accuracy_far_above_chance(tmp_path):
    from fsdp_presets.checkpoint.pretrained import prepare_minilm

    minilm = prepare_minilm(tmp_path / "models")
    config = tmp_path / "minilm_fsdp2.yaml"
    config.write_text(BERT_FSDP2)
    run_dir = tmp_path / "genres"
    # One process (a global batch of 16, as 2 x 8): what is held here is that the recipe learns; that it
    # trains alike on 2 processes is held by the classification resume tests below (their gloo traffic
    # would be a third of this run's CPU time with MiniLM's 22M parameters).
    run_launch(config, CLASSIFICATION, [
        "--model", minilm, "--data", GENRES_TRAIN, "--eval-data", GENRES_EVAL, "--max-eval-samples", 160,
        "--output-dir", run_dir, "--max-steps", 30, "--micro-batch", 16, "--seq-len", 40,
        "--learning-rate", 6e-4, "--warmup-steps", 5, "--weight-decay", 0.01], num_processes=1, cwd=REPO).check()
    evals = [record for record in read_metrics(run_dir / "metrics.jsonl") if record["kind"] == "eval"]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 30
    # Four balanced classes: chance is 0.25. Measured with these settings: 0.29 before, 0.61 after (on 2
    # processes x 8: 0.65; 60 steps at 3e-4: 0.67; a bag-of-words naive Bayes on all 1800 training verses
    # reaches 0.80).
    chance = 0.25
    assert evals[-1]["accuracy"] >= 0.55, evals
    assert evals[-1]["accuracy"] > evals[0]["accuracy"] + 0.25 and evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    from transformers import AutoModelForSequenceClassification

    exported = AutoModelForSequenceClassification.from_pretrained(run_dir / "final")
    assert exported.config.id2label == {0: "gospels", 1: "law", 2: "letters", 3: "poetry"}
    assert chance < evals[-1]["accuracy"]


# ---- the classification recipe: the same resume machinery (tests/classification_runs.py) ----
@pytest.fixture(scope="module")
def classification(tmp_path_factory) -> dict[str, Path]:
    root = classification_runs.base(tmp_path_factory)
    return {"root": root, "model": classification_runs.tiny_model(root),
            "reference": classification_runs.reference_run(root)}


@pytest.mark.slow
def test_classification_sigkill_of_one_rank_then_the_same_command_equals_the_uninterrupted_run(classification,
                                                                                                tmp_path):
    root, reference = classification["root"], classification["reference"]
    run = json.loads((reference / "run.json").read_text())
    assert run["recipe"] == "sequence_classification" and run["labels"] == ["gospels", "law", "letters", "poetry"]
    evals = [record for record in read_metrics(reference / "metrics.jsonl") if record["kind"] == "eval"]
    assert [record["step"] for record in evals] == [0, 4, 8, 12] and {"eval_loss", "accuracy"} <= set(evals[0])
    run_dir = tmp_path / "killed"
    args = classification_runs.args(classification["model"], run_dir, "--max-steps", classification_runs.REFERENCE_STEPS)
    kill_one_rank(classification_runs.fsdp_config(root), CLASSIFICATION, args, after_step=3, run_dir=run_dir)
    done = [record["step"] for record in read_metrics(run_dir / "metrics.jsonl") if record["kind"] == "train"]
    assert max(done) < classification_runs.REFERENCE_STEPS, "the kill did not stop the run"

    resumed = classification_runs.launch(root, args)  # the same command
    assert "resumed from" in resumed.stdout, resumed.stdout
    assert comparable(run_dir) == comparable(reference)  # bitwise: every loss, grad norm, lr, eval, accuracy
    assert json.loads((run_dir / "run.json").read_text())["resumed_from"]


@pytest.mark.slow
def test_classification_starts_from_an_imported_hugging_face_checkpoint(classification, tmp_path):
    from fsdp_presets.checkpoint.import_hf import import_hf

    root, reference = classification["root"], classification["reference"]
    imported = tmp_path / "imported" / "step-00000000"
    import_hf(reference / "final", imported, verify=True, log=lambda message: None)  # `fsdp-presets import`
    run_dir = tmp_path / "from-import"
    result = classification_runs.launch(root, classification_runs.args(  # 1 process: DCP reads any layout
        classification["model"], run_dir, "--max-steps", 2, "--resume", imported), processes=1)
    assert f"started from imported weights {imported}: step 0, fresh optimizer and schedule" in result.stdout
    assert json.loads((run_dir / "run.json").read_text())["resumed_from"] == str(imported)
    ours = {(record["kind"], record["step"]): record for record in read_metrics(run_dir / "metrics.jsonl")}
    theirs = {(record["kind"], record["step"]): record for record in read_metrics(reference / "metrics.jsonl")}
    # Before training, the imported model is the reference's trained one: the same evaluation.
    trained = theirs[("eval", classification_runs.REFERENCE_STEPS)]
    assert ours[("eval", 0)]["eval_loss"] == pytest.approx(trained["eval_loss"], rel=1e-6)
    assert ours[("eval", 0)]["accuracy"] == trained["accuracy"]
    assert ours[("eval", 0)]["eval_loss"] != pytest.approx(theirs[("eval", 0)]["eval_loss"], rel=1e-3)  # not --model's
    assert ours[("train", 1)]["samples_seen"] == classification_runs.GLOBAL_BATCH // 2  # step 0, 1 process x 2 x 2


@pytest.mark.slow
def test_bad_input_is_one_clear_line_exit_2_and_nothing_overwritten(model, reference, tmp_path):
    wrong_columns = tmp_path / "qa.jsonl"
    wrong_columns.write_text('{"question": "who?", "answer": "moses"}\n' * 4)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    stranger = tmp_path / "notes"
    stranger.mkdir()
    (stranger / "todo.txt").write_text("mine")

    def args(output, *extra, data=SFT_TRAIN, model_dir=model):
        return ["--model", str(model_dir), "--data", str(data), "--eval-data", str(SFT_EVAL),
                "--output-dir", str(output), "--seq-len", "32", "--max-steps", "2", *extra]

    cases = {
        "no such folder": args(tmp_path / "out1", model_dir=tmp_path / "missing-model"),
        "missing ['response']|missing ['text']": args(tmp_path / "out2", data=wrong_columns),
        "is empty": args(tmp_path / "out3", data=empty),
        "beyond the model's 128 positions": args(tmp_path / "out4", "--seq-len", "256"),
        "holds another run (seed 42 there, 7 now)": args(reference, "--seed", "7"),
        "already holds this run; pass --resume auto": args(reference, "--resume", "none"),
        "not empty and holds no run": args(stranger),
    }
    before = tree_digest(reference), tree_digest(stranger)

    # One real process first: the exit status itself.
    direct = subprocess.run([sys.executable, str(CAUSAL_LM), *cases["no such folder"]], capture_output=True,
                            text=True, env=offline_env(), cwd=REPO, timeout=300)
    assert direct.returncode == 2, direct.stderr
    assert direct.stderr.strip().splitlines()[-1].startswith("causal_lm.py: error: --model")
    assert "Traceback" not in direct.stderr

    # The rest in one process (importing torch once): the code run_recipe turns into the exit status.
    codes, errors, _ = drive_recipe(CAUSAL_LM, list(cases.values()), timeout=300)
    assert codes == [2] * len(cases)
    messages = [part.strip().splitlines() for part in errors]
    for expected, lines in zip(cases, messages):
        errors = [line for line in lines if line.startswith("causal_lm.py: error:")]
        assert len(errors) == 1 and any(option in errors[0] for option in expected.split("|")), (expected, lines)
        assert not any("Traceback" in line for line in lines)
    assert (tree_digest(reference), tree_digest(stranger)) == before
    assert not any((tmp_path / f"out{index}").exists() for index in range(1, 5))
