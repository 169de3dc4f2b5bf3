"""Checkpoint manager, metrics log and fault seam, in one process with a stand-in for the
accelerator (the real accelerate/DCP paths run in tests/test_recipes.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fsdp_presets.checkpoint.layout import MANIFEST, step_folder
from fsdp_presets.checkpoint.manager import CheckpointManager, committed_checkpoints
from fsdp_presets.checkpoint.verify import checkpoint_verdict, verify_checkpoint
from fsdp_presets.checkpoint.manifest import Manifest
from fsdp_presets.checkpoint.manifest import MANIFEST_FORMAT
from fsdp_presets.fileio import sha256_file
from fsdp_presets.errors import UsageError
from fsdp_presets.faults import FAULT_ENV
from fsdp_presets.train.metrics import MetricsLog, read_metrics, train_losses

# Checkpoints committed by the manager before manifests recorded their kind (format 1), kept as
# written: a training checkpoint, a LoRA (trainable-only) one, and the manifest of an import.
FORMAT1 = Path(__file__).resolve().parent / "data" / "checkpoint_format1"
DISTRIBUTED = {"world_size": 1, "data_parallel_size": 1, "precision": "no", "distributed_type": "NO", "fsdp": None}


class OneProcess:
    """What CheckpointManager uses of an ``accelerate.Accelerator``, for one process. Its
    ``save_state`` writes two files whose bytes depend on the step, like a model and optimizer."""

    is_main_process = True
    num_processes = 1
    process_index = 0

    def __init__(self):
        self.saved = 0
        self.loaded = []

    def wait_for_everyone(self):
        pass

    def save_state(self, folder):
        self.saved += 1
        Path(folder).mkdir(parents=True)
        (Path(folder) / "model.safetensors").write_bytes(b"weights %d" % self.saved * 100)
        (Path(folder) / "optimizer_0").mkdir()
        (Path(folder) / "optimizer_0" / "__0_0.distcp").write_bytes(b"moments %d" % self.saved * 300)
        import torch  # accelerate writes each rank's random state; a checkpoint without it is incomplete

        torch.save({"step": self.saved}, Path(folder) / "random_states_0.pkl")

    def load_state(self, folder):
        self.loaded.append(str(folder))


def manager(tmp_path, keep_last=3, messages=None, digest="abc"):
    return CheckpointManager(accelerator=OneProcess(), directory=tmp_path / "checkpoints", keep_last=keep_last,
                             config_digest=digest, distributed=DISTRIBUTED,
                             log=(messages.append if messages is not None else print))


def test_save_commits_a_verified_checkpoint_with_its_manifest(tmp_path):
    checkpoints = manager(tmp_path)
    folder = checkpoints.save(step=4, samples_consumed=32, write_extra=lambda f: (f / "extra.json").write_text("{}"))
    assert folder.name == "step-00000004"
    assert [entry.name for entry in (tmp_path / "checkpoints").iterdir()] == ["step-00000004"]  # no temporary left
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["step"] == 4 and manifest["samples_consumed"] == 32 and manifest["config_digest"] == "abc"
    assert manifest["world_size"] == 1 and manifest["distributed_type"] == "NO"
    assert set(manifest["files"]) == {"model.safetensors", "optimizer_0/__0_0.distcp", "extra.json",
                                      "random_states_0.pkl"}
    assert manifest["files"]["model.safetensors"]["sha256"] == sha256_file(folder / "model.safetensors")
    assert verify_checkpoint(folder) == (Manifest.read(folder), None)
    assert (manifest["kind"], manifest["format"]) == ("training", MANIFEST_FORMAT)


def test_keep_last_prunes_the_oldest(tmp_path):
    checkpoints = manager(tmp_path, keep_last=2)
    for step in (2, 4, 6):
        checkpoints.save(step=step, samples_consumed=step * 8)
    assert [step for step, _ in committed_checkpoints(tmp_path / "checkpoints")] == [4, 6]
    assert sorted(entry.name for entry in (tmp_path / "checkpoints").iterdir()) == ["step-00000004", "step-00000006"]


def test_a_pruned_checkpoint_is_renamed_out_of_the_way_then_handed_to_the_deleter(tmp_path):
    """Background saves delete pruned checkpoints on their writer thread (delete_pruned): the commit
    only renames the old folder to a hidden name that nothing resumes from."""
    handed = []
    checkpoints = manager(tmp_path, keep_last=1)
    checkpoints.delete_pruned = handed.append
    for step in (2, 4):
        checkpoints.save(step=step, samples_consumed=step * 8)
    [doomed] = handed
    assert doomed.parent == tmp_path / "checkpoints" and doomed.name.startswith(".")
    assert (doomed / MANIFEST).is_file()  # not deleted yet: the deleter's job
    assert [step for step, _ in committed_checkpoints(tmp_path / "checkpoints")] == [4]
    assert checkpoints.latest_valid() == tmp_path / "checkpoints" / "step-00000004"
    shutil.rmtree(doomed)


@pytest.mark.parametrize("damage, expected", [
    (lambda folder: (folder / "model.safetensors").write_bytes(b"weights 3" * 50), "model.safetensors has 450 bytes"),
    (lambda folder: (folder / "model.safetensors").write_bytes(b"weights 9" * 100), "does not match its SHA-256"),
    (lambda folder: (folder / "optimizer_0" / "__0_0.distcp").unlink(), "missing file optimizer_0/__0_0.distcp"),
    (lambda folder: (folder / MANIFEST).unlink(), "no manifest.json"),
    (lambda folder: (folder / MANIFEST).write_text("{not json"), "unreadable manifest.json"),
], ids=["truncated", "tampered", "missing-file", "no-manifest", "bad-manifest"])
def test_latest_valid_skips_a_damaged_checkpoint_and_says_why(tmp_path, damage, expected):
    messages = []
    checkpoints = manager(tmp_path, messages=messages)
    checkpoints.save(step=2, samples_consumed=16)
    newest = checkpoints.save(step=3, samples_consumed=24)
    damage(newest)
    assert checkpoints.latest_valid() == tmp_path / "checkpoints" / "step-00000002"
    assert len(messages) == 1 and "step-00000003" in messages[0] and expected in messages[0], messages


def test_interrupted_save_is_ignored_with_a_message(tmp_path, monkeypatch):
    messages = []
    checkpoints = manager(tmp_path, messages=messages)
    checkpoints.save(step=2, samples_consumed=16)
    monkeypatch.setenv(FAULT_ENV, "raise-during-save:step=4")
    with pytest.raises(RuntimeError, match="injected fault at during-save, step 4"):
        checkpoints.save(step=4, samples_consumed=32)
    partial = tmp_path / "checkpoints" / ".tmp-step-00000004"
    assert (partial / "model.safetensors").is_file() and not (partial / MANIFEST).exists()
    monkeypatch.delenv(FAULT_ENV)
    assert checkpoints.latest_valid() == tmp_path / "checkpoints" / "step-00000002"
    assert any(".tmp-step-00000004" in message and "did not finish" in message for message in messages)
    assert not partial.exists()  # removed after the message
    assert checkpoints.save(step=4, samples_consumed=32).is_dir()  # and the step can be saved again


def test_resolve_and_load(tmp_path):
    checkpoints = manager(tmp_path)
    assert checkpoints.resolve("auto") is None  # nothing saved yet: start fresh
    folder = checkpoints.save(step=5, samples_consumed=40)
    assert checkpoints.resolve("none") is None
    assert checkpoints.resolve("auto") == folder
    assert checkpoints.resolve(str(folder)) == folder
    with pytest.raises(UsageError, match="no such folder"):
        checkpoints.resolve(str(tmp_path / "nowhere"))
    (folder / "model.safetensors").write_bytes(b"x")
    with pytest.raises(UsageError, match="model.safetensors has 1 bytes"):
        checkpoints.resolve(str(folder))
    other = manager(tmp_path / "other", digest="another model")
    folder = other.save(step=1, samples_consumed=8)
    assert other.load(folder).samples_consumed == 8 and other.accelerator.loaded == [str(folder)]
    with pytest.raises(UsageError, match="checkpoint is of another model"):
        manager(tmp_path / "other").load(folder)


@pytest.mark.parametrize("spec", ["explode-during-save", "kill-during-save:stp=3", "kill-during-save:step=x"])
def test_fault_spec_errors_are_clear(monkeypatch, spec):
    from fsdp_presets.faults import fault_point

    monkeypatch.setenv(FAULT_ENV, spec)
    with pytest.raises(ValueError, match=FAULT_ENV):
        fault_point("during-save", step=3, rank=0)


def test_fault_point_only_fires_at_its_point_step_and_rank(monkeypatch):
    from fsdp_presets.faults import fault_point

    monkeypatch.setenv(FAULT_ENV, "raise-during-save:step=3:rank=1")
    fault_point("during-save", step=3, rank=0)
    fault_point("during-save", step=2, rank=1)
    fault_point("before-step", step=3, rank=1)
    with pytest.raises(RuntimeError):
        fault_point("during-save", step=3, rank=1)


def test_metrics_log_drops_lines_after_the_resumed_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path, enabled=True, keep_through_step=0)
    log.log_eval(step=0, eval_loss=3.0, perplexity=20.1)
    for step in range(1, 7):
        log.log_train(step=step, loss=1.0 / step, lr=1e-3, grad_norm=0.5, tokens_per_s=10.0, step_time_s=0.1,
                      samples_seen=8 * step)
        if step == 4:
            log.log_eval(step=4, eval_loss=2.0, perplexity=7.4)
    with open(path, "a") as handle:
        handle.write('{"kind": "train", "step": 7, "lo')  # the line a kill cut short
    assert max(train_losses(path)) == 6
    MetricsLog(path, enabled=True, keep_through_step=4)
    records = read_metrics(path)
    assert [(record["kind"], record["step"]) for record in records] == [
        ("eval", 0), ("train", 1), ("train", 2), ("train", 3), ("train", 4), ("eval", 4)]
    assert path.read_text().endswith("}\n")
    MetricsLog(path, enabled=True, keep_through_step=0)  # a fresh start in the folder
    assert read_metrics(path) == []


def test_metrics_log_on_other_ranks_writes_nothing(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl", enabled=False, keep_through_step=0)
    log.log_eval(step=0, eval_loss=1.0)
    assert not (tmp_path / "metrics.jsonl").exists()


class RecordingState:
    """A LoRA run's ``state`` for CheckpointManager: records the folders it is asked to load."""

    def __init__(self):
        self.loaded = []

    def load(self, folder):
        self.loaded.append(str(folder))


@pytest.mark.parametrize("name, kind, step, samples", [("training-step-00000004", "training", 4, 32),
                                                       ("adapter-step-00000002", "adapter", 2, 8)],
                         ids=["training", "adapter"])
def test_a_format1_checkpoint_loads_verifies_and_resumes(tmp_path, name, kind, step, samples):
    folder = step_folder(tmp_path / "checkpoints", step)
    shutil.copytree(FORMAT1 / name, folder)
    raw = json.loads((folder / MANIFEST).read_text())
    assert raw["format"] == 1 and "kind" not in raw  # the copy is of the old format, untouched
    manifest = Manifest.read(folder)
    assert (manifest.kind, manifest.format, manifest.step, manifest.samples_consumed) == (kind, 1, step, samples)
    assert checkpoint_verdict(folder).ok, checkpoint_verdict(folder).problem
    checkpoints = manager(tmp_path)
    if kind == "adapter":
        checkpoints.state, checkpoints.training = RecordingState(), raw["training"]
    assert checkpoints.resolve("auto") == folder
    assert checkpoints.load(folder) == manifest
    assert (checkpoints.state or checkpoints.accelerator).loaded == [str(folder)]
    assert (folder / MANIFEST).read_text() == (FORMAT1 / name / MANIFEST).read_text()  # reading changed nothing


def test_a_format1_import_manifest_reads_as_imported():
    payload = json.loads((FORMAT1 / "imported-manifest.json").read_text())
    assert payload["format"] == 1 and payload["kind"] == "imported"  # format 1 wrote it beside the fields
    manifest = Manifest.from_json(payload)
    assert (manifest.kind, manifest.step, manifest.world_size) == ("imported", 0, 1)
    assert manifest.source and "weights only" in manifest.contents


@pytest.mark.parametrize("change, expected", [
    ({"format": 2}, "no kind"),
    ({"format": MANIFEST_FORMAT + 1, "kind": "training"}, f"format {MANIFEST_FORMAT + 1} is newer"),
    ({"format": 2, "kind": "optimizer"}, "kind 'optimizer' is not one of training, adapter, imported"),
], ids=["format2-without-kind", "newer-format", "unknown-kind"])
def test_a_manifest_of_another_format_is_refused_by_name(change, expected):
    payload = {**json.loads((FORMAT1 / "training-step-00000004" / MANIFEST).read_text()), **change}
    with pytest.raises(ValueError, match=expected):
        Manifest.from_json(payload)


# ---- inspect-checkpoint --gpus N on a TP or EP mesh ----
def _mesh_checkpoint(*, fsdp_size: int, tp_size: int = 1, ep_size: int = 1):
    """A 4-process checkpoint of a mesh at step 10 (global batch 8, micro-batch 2), as its manifest reads."""
    from fsdp_presets.checkpoint.inspect import CheckpointSummary
    from fsdp_presets.schema import mesh_label

    mesh = {"dp_replicate_size": 1, "fsdp_size": fsdp_size, "tp_size": tp_size, "ep_size": ep_size}
    return CheckpointSummary(checkpoint="run/step-10", kind="training", layout="dcp", step=10, samples_consumed=80,
                             global_batch_samples=8, micro_batch_size=2, world_size=4, strategy=mesh_label(mesh),
                             fsdp=None, config_digest=None, integrity={"ok": True}, files=[], model_mesh=mesh)


@pytest.mark.parametrize("gpus,possible,says", [
    (4, True, ["on FSDP 2 x TP 2: the global batch of 8 samples stays with --micro-batch 2 --grad-accum 2 over 2 "
               "data-parallel ranks", "as FSDP2 alone: the global batch of 8 samples stays with --micro-batch 2 "
               "--grad-accum 1 over 4 data-parallel ranks"]),
    (2, True, ["on FSDP 1 x TP 2: 2 processes do not make 2 or more data-parallel ranks of 2-process TP groups",
               "as FSDP2 alone: the global batch of 8 samples stays with --micro-batch 2 --grad-accum 2 over 2"]),
    (6, False, ["on FSDP 3 x TP 2: the global batch of 8 samples does not split over 3 data-parallel ranks",
                "as FSDP2 alone: the global batch of 8 samples does not split over 6 data-parallel ranks"]),
])
def test_a_tp_checkpoint_resumes_on_the_same_tp_size_or_as_fsdp2_alone(gpus, possible, says):
    """A TP group shares its samples: on N processes the same TP size has N / tp data-parallel ranks
    to split the global batch over, FSDP2 alone N; the answer gives both, and the accumulation of the
    first that keeps the batch."""
    from fsdp_presets.checkpoint.inspect import CheckpointSummary, resume_answer

    summary = _mesh_checkpoint(fsdp_size=2, tp_size=2)
    answer = resume_answer(summary, gpus)
    assert answer.possible is possible and all(text in answer.reason for text in says), answer.reason
    assert answer.gradient_accumulation_steps == {4: 2, 2: 2, 6: None}[gpus]
    plain = resume_answer(CheckpointSummary(**{**vars(summary), "model_mesh": None}), gpus)  # FSDP alone: N ranks
    assert "TP" not in plain.reason and plain.gradient_accumulation_steps == {4: 1, 2: 2, 6: None}[gpus]


@pytest.mark.parametrize("gpus,says", [
    (4, "on FSDP 4 x EP 4: the global batch of 8 samples stays with --micro-batch 2 --grad-accum 1 over 4"),
    (8, "on FSDP 8 x EP 4: the global batch of 8 samples stays with --micro-batch 1 --grad-accum 1 over 8"),
    (2, "on FSDP 2 x EP 4: 2 processes are not whole EP groups of 4"),
    (6, "on FSDP 6 x EP 4: 6 processes are not whole EP groups of 4"),
])
def test_an_ep_checkpoint_says_where_its_ep_mesh_resumes(gpus, says):
    """EP ranks each train on their own samples (N data-parallel ranks), and the mesh needs whole EP
    groups; as FSDP2 alone it resumes wherever the batch splits."""
    from fsdp_presets.checkpoint.inspect import resume_answer

    answer = resume_answer(_mesh_checkpoint(fsdp_size=4, ep_size=4), gpus)
    assert says in answer.reason and "as FSDP2 alone: the global batch of 8 samples" in answer.reason, answer.reason
    assert answer.possible is (gpus != 6)
