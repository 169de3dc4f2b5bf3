"""compare on Trainer/TRL output folders that hold only Trainer's own log (trainer_state.json)."""

import json

import pytest

from fsdp_presets.compare.records import load_pair, load_run
from fsdp_presets.compare.runs import compare_runs
from fsdp_presets.checkpoint.layout import METRICS, TRAINER_STATE, trainer_checkpoint_name
from fsdp_presets.errors import UsageError


def trainer_folder(root, losses, *, logging_steps=2, lr=1e-3, in_checkpoint=True):
    """A Trainer output folder whose log averages ``losses`` (one per step) over ``logging_steps``."""
    history = []
    for end in range(logging_steps, len(losses) + 1, logging_steps):
        window = losses[end - logging_steps:end]
        history.append({"step": end, "loss": sum(window) / len(window), "grad_norm": 1.0 / end, "learning_rate": lr})
    history.append({"step": len(losses), "train_loss": 1.0, "train_runtime": 1.0})  # the summary line
    folder = root / trainer_checkpoint_name(len(losses)) if in_checkpoint else root
    folder.mkdir(parents=True)
    (folder / TRAINER_STATE).write_text(json.dumps({"log_history": history, "logging_steps": logging_steps}))
    return root


def test_trainer_log_is_read_averaged_and_said(tmp_path):
    losses = [5.0, 4.5, 4.2, 4.0, 3.9, 3.8]
    base = load_run(trainer_folder(tmp_path / "a", losses))
    assert base.averaged_steps == 2 and base.series["loss"] == pytest.approx({2: 4.75, 4: 4.1, 6: 3.85})
    cand = load_run(trainer_folder(tmp_path / "b", losses, in_checkpoint=False))
    comparison = compare_runs(base, cand)
    assert comparison.verdict == "identical"
    assert "logging_steps=2" in comparison.tolerance.source
    assert comparison.tolerance.loss == pytest.approx(1e-6 + 2 * 2.0 ** -23)
    assert any("Trainer's log" in note for note in comparison.notes)


def test_a_changed_learning_rate_in_trainer_log_diverges(tmp_path):
    losses = [5.0, 4.5, 4.2, 4.0]
    base = load_run(trainer_folder(tmp_path / "a", losses))
    cand = load_run(trainer_folder(tmp_path / "b", losses, lr=2e-3))
    assert compare_runs(base, cand).verdict == "diverged"


def test_a_run_with_metrics_is_read_from_its_trainer_log_against_one_without(tmp_path):
    losses = [5.0, 4.5, 4.2, 4.0]
    with_callback = trainer_folder(tmp_path / "a", losses)
    (with_callback / METRICS).write_text("".join(
        json.dumps({"kind": "train", "step": step, "loss": loss, "lr": 1e-3, "grad_norm": 1.0})
        + "\n" for step, loss in enumerate(losses, 1)))
    assert load_run(with_callback).averaged_steps is None  # its exact lines, alone
    base, cand = load_pair(with_callback, trainer_folder(tmp_path / "b", losses))
    assert base.averaged_steps == cand.averaged_steps == 2
    assert compare_runs(base, cand).verdict == "identical"


def test_a_folder_with_neither_is_refused(tmp_path):
    with pytest.raises(UsageError, match="no metrics.jsonl"):
        load_run(tmp_path)
