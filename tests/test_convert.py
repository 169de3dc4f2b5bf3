"""``fsdp-presets export`` / ``import`` / ``inspect-checkpoint`` on real recipe checkpoints.

The FSDP2 reference run (tests/checkpoint_runs.py, tied tiny Llama, 2 processes) gives DCP
checkpoints; its step-10 checkpoint is the trained model, whose ``final/`` the recipe exported
from the live model. The round trip: export step 10 -> import -> a recipe run from the imported
checkpoint (FSDP1, FULL_STATE_DICT, 2 processes) must train exactly like a run started from the
trained weights themselves (DDP, 2 processes, ``--model final/``). An import carries no optimizer
state, so both start at step 0 with a fresh optimizer. The two runs' checkpoints are the ``full``
and ``ddp`` layouts that export must also read.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from fsdp_presets import cli
from fsdp_presets.compare.records import load_run
from fsdp_presets.compare.report import summary_lines
from fsdp_presets.compare.runs import compare_runs

from fsdp_presets.checkpoint.export import ExportReport, export_checkpoint, plan_export, verify_export
from fsdp_presets.checkpoint.hf_model import VERIFY_TOLERANCE
from fsdp_presets.checkpoint.import_hf import import_hf
from fsdp_presets.checkpoint.files import DcpReader
from fsdp_presets.errors import UsageError
from fsdp_presets.checkpoint.resume import load_imported

import checkpoint_runs as runs
from conftest import accelerate_config
from recipe_helpers import causal_lm_args, checkpoint

ROUND_TRIP_STEPS = 4
LOSS_TOLERANCE = 1e-6  # fp32 round-off, relative (docs/checkpoints.md)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return runs.base(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(root) -> Path:
    return runs.reference_run(root)


@pytest.fixture(scope="module")
def trained(reference) -> Path:
    """The reference run's last checkpoint: the same weights as its final/."""
    return checkpoint(reference, runs.REFERENCE_STEPS)


@pytest.fixture(scope="module")
def exported(root, trained) -> tuple[Path, ExportReport]:
    output = root / "exported-fp32"
    report = export_checkpoint(trained, output, verify=True, log=lambda message: None)
    return output, report


@pytest.fixture(scope="module")
def round_trip(root, exported) -> dict[str, Path]:
    imported = root / "imported" / "step-00000000"
    import_hf(exported[0], imported, verify=True, log=lambda message: None)
    model, reference = runs.tiny_model(root), runs.reference_run(root)
    steps = ("--max-steps", ROUND_TRIP_STEPS)
    from_final = root / "from-final-ddp"
    runs.launch(accelerate_config(root, "ddp", distributed_type="MULTI_GPU"),
                causal_lm_args(reference / "final", from_final, *runs.SCHEDULE, *steps), processes=2)
    from_import = root / "from-import-fsdp1-full"
    result = runs.launch(runs.fsdp_config(root, 1, "FULL_STATE_DICT"),
                         causal_lm_args(model, from_import, *runs.SCHEDULE, *steps, "--resume", imported), processes=2)
    return {"imported": imported, "from_final": from_final, "from_import": from_import, "stdout": result.stdout}


def _safetensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _logits(folder: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    batch = torch.arange(24).reshape(2, 12) % model.config.vocab_size
    with torch.no_grad():
        return model(input_ids=batch).logits


# ---- export ----
@pytest.mark.slow
def test_export_of_a_tied_model_reloads_tied_with_the_trained_logits(reference, exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, report = exported
    names = {path.name for path in folder.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "model.safetensors"} <= names
    written = _safetensors(folder)
    assert "lm_head.weight" not in written and "model.embed_tokens.weight" in written  # tied: written once
    assert report.tied == ["lm_head.weight"] and report.layout == "dcp" and report.streamed
    trained = _safetensors(reference / "final")  # the recipe's own export of the live model
    assert all(torch.equal(tensor, trained[name]) for name, tensor in written.items())
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(_logits(folder), _logits(reference / "final"))
    assert report.verification.passed and report.verification.max_abs_difference == 0.0
    assert report.verification.tied is True
    text = "In the beginning God created the heaven and the earth."
    assert AutoTokenizer.from_pretrained(folder)(text)["input_ids"] == \
        AutoTokenizer.from_pretrained(reference / "final")(text)["input_ids"]


@pytest.mark.slow
def test_bf16_export_in_shards_reads_one_output_shard_at_a_time(trained, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    reads: list[list[str]] = []
    original = DcpReader.read
    monkeypatch.setattr(DcpReader, "read", lambda self, names: reads.append(list(names)) or original(self, names))
    output = tmp_path / "bf16"
    report = export_checkpoint(trained, output, dtype="bf16", max_shard_size="100KB", log=lambda m: None)
    index = json.loads((output / "model.safetensors.index.json").read_text())
    shards: dict[str, list[str]] = {}
    for name, file in index["weight_map"].items():
        shards.setdefault(file, []).append(name)
    assert len(shards) >= 3 and sorted(shards) == sorted(report.shards)
    # each read asked for exactly one output shard's tensors: never the whole model at once
    assert sorted(map(sorted, reads)) == sorted(map(sorted, shards.values()))
    assert report.largest_shard_bytes <= 100_000 + 512 * 64 * 2  # the shard limit, or one tensor beyond it
    with safe_open(str(output / report.shards[0]), framework="pt") as handle:
        assert handle.get_tensor(handle.keys()[0]).dtype == torch.bfloat16
    assert json.loads((output / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(output)
    assert model.dtype == torch.bfloat16 and model.lm_head.weight is model.model.embed_tokens.weight
    verification = verify_export(plan_export(trained), output, "bf16")
    assert verification.passed and 0 < verification.relative <= VERIFY_TOLERANCE["bf16"]


@pytest.mark.slow
def test_verify_beyond_tolerance_exits_1_and_writes_nothing(trained, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(VERIFY_TOLERANCE, "bf16", 1e-9)  # bf16 rounding alone now exceeds it
    output = tmp_path / "strict"
    assert cli.main(["export", str(trained), "--output", str(output), "--dtype", "bf16", "--verify"]) == 1
    printed = capsys.readouterr().out
    assert "verify FAILED: largest logit difference" in printed and "nothing written" in printed
    assert not output.exists() and [path.name for path in tmp_path.iterdir()] == []


# ---- import and the round trip ----
@pytest.mark.slow
def test_round_trip_export_import_resume_trains_like_the_trained_weights(reference, round_trip):
    from_final, from_import = round_trip["from_final"], round_trip["from_import"]
    assert f"started from imported weights {round_trip['imported']}: step 0, fresh optimizer" in round_trip["stdout"]
    run = json.loads((from_import / "run.json").read_text())
    assert run["fsdp"]["version"] == 1 and run["fsdp"]["state_dict_type"] == "FULL_STATE_DICT"
    comparison = compare_runs(load_run(from_final), load_run(from_import))
    assert comparison.agrees, "\n".join(summary_lines(comparison))
    assert comparison.metric("loss").steps == list(range(1, ROUND_TRIP_STEPS + 1))
    assert comparison.metric("loss").max_deviation <= LOSS_TOLERANCE
    # the imported weights were used: the untrained model (the reference's step 1) had another loss
    first = {line["step"]: line["loss"] for line in map(json.loads, (from_import / "metrics.jsonl").open())
             if line["kind"] == "train"}
    untrained = {line["step"]: line["loss"] for line in map(json.loads, (reference / "metrics.jsonl").open())
                 if line["kind"] == "train"}
    assert abs(first[1] - untrained[1]) > 0.1


@pytest.mark.slow
@pytest.mark.parametrize("run_name, layout", [("from_import", "full"), ("from_final", "ddp")])
def test_export_of_full_and_ddp_checkpoints(round_trip, run_name, layout, tmp_path):
    run_dir = round_trip[run_name]
    output = tmp_path / layout
    report = export_checkpoint(checkpoint(run_dir, ROUND_TRIP_STEPS), output, verify=True,
                                       log=lambda message: None)
    assert report.layout == layout and report.verification.passed and report.verification.tied is True
    written, trained = _safetensors(output), _safetensors(run_dir / "final")
    assert "lm_head.weight" not in written
    assert all(torch.equal(tensor, trained[name]) for name, tensor in written.items())


@pytest.mark.slow
def test_legacy_pytorch_model_bin_imports_like_safetensors(exported, round_trip, tmp_path, capsys):
    legacy = tmp_path / "legacy"
    shutil.copytree(exported[0], legacy)
    torch.save(load_file(legacy / "model.safetensors"), legacy / "pytorch_model.bin")
    (legacy / "model.safetensors").unlink()
    output = tmp_path / "imported-bin"
    assert cli.main(["import", str(legacy), "--output", str(output), "--verify"]) == 0
    printed = capsys.readouterr().out
    assert "verify OK: largest logit difference 0" in printed and "fresh optimizer" in printed
    from_bin, from_safetensors = DcpReader(output / "pytorch_model_fsdp_0"), DcpReader(
        round_trip["imported"] / "pytorch_model_fsdp_0")
    names = sorted(from_safetensors.entries())
    assert sorted(from_bin.entries()) == names and "lm_head.weight" in names  # as the recipes save: both names
    left, right = from_bin.read(names), from_safetensors.read(names)
    assert all(torch.equal(left[name], right[name]) for name in names)
    manifest = json.loads((output / "manifest.json").read_text())
    assert (manifest["kind"], manifest["format"]) == ("imported", 2)
    assert (manifest["step"], manifest["samples_consumed"]) == (0, 0)
    assert "no optimizer" in manifest["contents"]


class _RunsCode:
    """Unpickling this would create a folder (what weights_only=True must prevent)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (str(self.marker),))


@pytest.mark.slow
def test_import_refuses_a_pickle_that_would_run_code(exported, tmp_path, capsys):
    folder = tmp_path / "hostile"
    folder.mkdir()
    shutil.copy(exported[0] / "config.json", folder)
    marker = tmp_path / "code-ran"
    torch.save({"model.embed_tokens.weight": torch.zeros(2), "x": _RunsCode(marker)}, folder / "pytorch_model.bin")
    assert cli.main(["import", str(folder), "--output", str(tmp_path / "out")]) == 2
    assert "pytorch_model.bin: refused by torch.load(weights_only=True)" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_loading_an_imported_checkpoint_into_another_model_is_refused(round_trip):
    with pytest.raises(UsageError, match="another model"):
        load_imported(None, round_trip["imported"], config_digest="0" * 64)


# ---- damaged input: one clear line naming the file, exit 2, nothing written ----
def _truncate(folder: Path) -> str:
    shard = folder / "pytorch_model_fsdp_0" / "__1_0.distcp"
    with open(shard, "r+b") as handle:
        handle.truncate(shard.stat().st_size // 2)
    return "pytorch_model_fsdp_0/__1_0.distcp"


def _drop_metadata(folder: Path) -> str:
    (folder / "pytorch_model_fsdp_0" / ".metadata").unlink()
    return "pytorch_model_fsdp_0/.metadata"


def _tamper(folder: Path) -> str:
    shard = folder / "pytorch_model_fsdp_0" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of one weight: same size, other checksum
    shard.write_bytes(bytes(data))
    return "__0_0.distcp does not match its SHA-256"


DAMAGE = {"truncated shard": _truncate, "missing .metadata": _drop_metadata, "tampered file": _tamper}


# Without a manifest there is no checksum: a flipped bit is then only caught by --verify, if at all.
DAMAGE_CASES = [(damage, True) for damage in sorted(DAMAGE)] + [(damage, False) for damage in
                                                                 ("truncated shard", "missing .metadata")]


@pytest.mark.slow
@pytest.mark.parametrize("damage, with_manifest", DAMAGE_CASES,
                         ids=[f"{damage}-{'manifest' if kept else 'no-manifest'}" for damage, kept in DAMAGE_CASES])
def test_damaged_checkpoint_is_refused_naming_the_file(trained, tmp_path, capsys, damage, with_manifest):
    folder = tmp_path / "step-00000010"
    shutil.copytree(trained, folder)
    named = DAMAGE[damage](folder)
    if not with_manifest:
        (folder / "manifest.json").unlink()
    output = tmp_path / "hf"
    assert cli.main(["export", str(folder), "--output", str(output)]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and named.split("/")[-1] in error, error
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step-00000010"]  # no output, no staging
    if with_manifest:
        assert cli.main(["inspect-checkpoint", str(folder)]) == 1
        assert "DAMAGED" in capsys.readouterr().out


@pytest.mark.slow
def test_checkpoint_of_another_model_is_refused(root, trained, tmp_path, capsys):
    other = runs.tiny_model(root, tied=False)  # same sizes, untied: another config digest
    output = tmp_path / "hf"
    assert cli.main(["export", str(trained), "--output", str(output), "--model", str(other)]) == 2
    error = capsys.readouterr().err
    assert "is a checkpoint of another model" in error and "config digest" in error and str(other) in error
    assert not output.exists()


@pytest.mark.slow
def test_import_of_a_truncated_safetensors_file_is_refused(exported, tmp_path, capsys):
    folder = tmp_path / "hf"
    shutil.copytree(exported[0], folder)
    with open(folder / "model.safetensors", "r+b") as handle:
        handle.truncate(5000)
    assert cli.main(["import", str(folder), "--output", str(tmp_path / "ckpt")]) == 2
    assert "model.safetensors: cannot be read as safetensors" in capsys.readouterr().err
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.slow
def test_export_never_writes_into_a_folder_that_holds_files(trained, tmp_path, capsys):
    output = tmp_path / "busy"
    output.mkdir()
    (output / "keep.txt").write_text("mine")
    assert cli.main(["export", str(trained), "--output", str(output)]) == 2
    assert "not empty" in capsys.readouterr().err and [p.name for p in output.iterdir()] == ["keep.txt"]


# ---- inspect-checkpoint ----
@pytest.mark.slow
def test_inspect_checkpoint_reports_position_sharding_files_and_resumability(trained, capsys):
    assert cli.main(["inspect-checkpoint", str(trained), "--gpus", "4"]) == 0
    text = capsys.readouterr().out
    assert "step 10, 80 samples consumed; global batch 8" in text
    assert "2 process(es), FSDP2 (reshard_after_forward=True), SHARDED_STATE_DICT; layout dcp" in text
    assert "integrity   OK" in text and "pytorch_model_fsdp_0/__1_0.distcp  rank 1" in text
    assert "resume at 4 GPU(s): yes" in text and "--grad-accum 1" in text
    assert cli.main(["inspect-checkpoint", str(trained), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    ranks = {item["rank"] for item in summary["files"] if item["path"].startswith("optimizer_0/")}
    assert ranks == {0, 1} and summary["per_rank"]["0"]["tensors"] > 0
    assert summary["integrity"]["checked_files"] == len(json.loads((trained / "manifest.json").read_text())["files"])


def test_not_a_checkpoint_is_bad_input(tmp_path, capsys):
    assert cli.main(["inspect-checkpoint", str(tmp_path)]) == 2
    assert "holds no model weights" in capsys.readouterr().err


def test_a_model_whose_weights_transformers_converts_is_exported_whole(root, tmp_path):
    """transformers 5 fuses Mixtral's experts on load (a weight conversion): the checkpoint holds
    the fused tensors, and export lets save_pretrained write the original per-expert names."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=64, num_local_experts=2, num_experts_per_tok=1,
                           max_position_embeddings=64)
    torch.manual_seed(0)
    source = tmp_path / "mixtral"
    MixtralForCausalLM(config).save_pretrained(source)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(runs.tiny_model(root) / name, source)
    imported = tmp_path / "imported"
    import_hf(source, imported, log=lambda message: None)
    fused = DcpReader(imported / "pytorch_model_fsdp_0").entries()
    assert any(name.endswith("experts.gate_up_proj") for name in fused)
    report = export_checkpoint(imported, tmp_path / "hf", verify=True, log=lambda message: None)
    assert not report.streamed and report.verification.passed and report.verification.max_abs_difference == 0.0
    assert sorted(_safetensors(tmp_path / "hf")) == sorted(_safetensors(source))
    assert report.tensors == len(_safetensors(source)) > len(fused)  # what the folder holds, said as such
