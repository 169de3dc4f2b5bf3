"""fsdp-presets check on real accelerate FSDP configs from popular repositories (tests/data/real_configs,
sources in its README): judged against accelerate 1.16's own loading of each file.

For every file: every finding has a rule id and a fix; an error is reported only where accelerate
does not apply what the file says (shown here on the plugin accelerate builds from the file); the
wrong advice once given on such files is gone; the genuine problems are still found."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from fsdp_presets.check.lint import RULES, CheckContext, accelerate_view, check_file, model_facts

REPO = Path(__file__).resolve().parent.parent
REAL = REPO / "tests" / "data" / "real_configs"
FILES = sorted(path.name for path in REAL.glob("*.yaml"))

# The model each file's recipe trains, where model_configs/ has it (or its architecture's sibling).
MODELS = {
    "alignment_handbook_fsdp.yaml": "model_configs/mistral-7b-v0.3",  # zephyr-7b-beta: Mistral-7B full SFT
    "llamafactory_fsdp_config.yaml": "model_configs/llama-3.1-8b",  # fsdp_qlora example: Llama-3-8B, QLoRA
    "peft_sft_fsdp_config.yaml": "model_configs/llama-3.1-70b",  # run_peft_fsdp.sh: Llama-2-70b, LoRA
    "peft_sft_fsdp_config_qlora.yaml": "model_configs/llama-3.1-70b",  # run_peft_qlora_fsdp.sh: QLoRA
}

# Genuine problems: the rules that must fire on a file (errors only where accelerate does not apply it).
EXPECTED = {
    # a stale key: accelerate 1.16 reads fsdp_backward_prefetch, so BACKWARD_PRE is not applied
    "accelerate_docs_usage_guide_fsdp.yaml": {"unknown-fsdp-key"},
    # FSDP2 ignores fsdp_sharding_strategy FULL_SHARD; fsdp_reshard_after_forward false makes it SHARD_GRAD_OP
    "llamafactory_fsdp_v2_config.yaml": {"fsdp1-key-under-fsdp2", "no-wrap-policy"},
    "llamafactory_fsdp_v2_offload_config.yaml": {"no-wrap-policy"},
    "accelerate_tp_fsdp2_preparation.yaml": {"no-wrap-policy"},
    "accelerate_test_latest_fsdp.yaml": {"fsdp-single-process"},
    "llamafactory_fsdp_config_multiple_nodes.yaml": {"fixed-main-process-ip", "full-shard-across-nodes"},
    # LoRA / QLoRA on a 70B model: the full-fine-tuning memory verdicts only as "if full fine-tuning"
    "peft_sft_fsdp_config.yaml": {"memory-assumes-full-finetune"},
    "peft_sft_fsdp_config_qlora.yaml": {"memory-assumes-full-finetune"},
}

_VIEWS: dict = {}
_REPORTS: dict = {}


def _facts(name: str):
    source = MODELS.get(name)
    return model_facts(str(REPO / source)) if source else None


def report_of(name: str):
    if name not in _REPORTS:
        _REPORTS[name] = check_file(REAL / name, context=CheckContext(model=_facts(name)))
    return _REPORTS[name]


def plugin_of(path: Path):
    """The FullyShardedDataParallelPlugin accelerate builds from the file (as on a GPU node)."""
    config = yaml.safe_load(path.read_text())
    return accelerate_view(path, num_processes=None if "num_processes" in config else 8).fsdp_plugin


@pytest.mark.parametrize("name", FILES)
def test_real_config(name):
    report, view = report_of(name)
    assert view is not None, "accelerate itself loads every one of these files"
    for item in report.findings:
        assert item.rule in RULES and item.fix, item.to_json()
    expected = EXPECTED.get(name, set())
    assert expected <= report.rules(), (expected - report.rules(), [i.to_json() for i in report.findings])
    # No error beyond the genuine problems (what accelerate accepts and applies is not an error).
    unexpected_errors = [item.to_json() for item in report.errors if item.rule not in expected]
    assert not unexpected_errors
    unexpected_warnings = [item.to_json() for item in report.warnings if item.rule not in expected]
    assert not unexpected_warnings
    # memory errors built on an assumed full fine-tune never appear when the method is unknown
    assert not report.rules() & {"does-not-fit", "fp32-does-not-fit", "offload-host-memory",
                                 "full-state-dict-host-memory"}
    config = yaml.safe_load((REAL / name).read_text())
    texts = " ".join(item.message + " " + item.fix for item in report.findings)
    if "num_processes" not in config:
        # no GPU count or memory verdict; say what to pass
        assert "num-processes-unset" in report.rules() and not re.search(r"on \d+ GPUs", texts)
        assert not report.rules() & {"does-not-fit", "fp32-does-not-fit", "offload-host-memory"}
    fsdp = config.get("fsdp_config") or {}
    if fsdp.get("fsdp_version") == 1 or "fsdp_version" not in fsdp:
        # never advise a switch to FSDP2 that makes accelerate raise on a strategy-name value
        assert "fsdp_version: 2" not in texts or isinstance(fsdp.get("fsdp_reshard_after_forward"), bool)


def test_the_errors_are_settings_accelerate_does_not_apply():
    docs = plugin_of(REAL / "accelerate_docs_usage_guide_fsdp.yaml")
    assert docs.backward_prefetch is None  # the file asks for BACKWARD_PRE under a stale key
    v2 = plugin_of(REAL / "llamafactory_fsdp_v2_config.yaml")
    assert v2.fsdp_version == 2 and v2.reshard_after_forward is False  # the file says FULL_SHARD


def test_the_fix_for_the_stale_key_is_applied_by_accelerate(tmp_path):
    report, _ = report_of("accelerate_docs_usage_guide_fsdp.yaml")
    [stale] = [item for item in report.findings if item.rule == "unknown-fsdp-key"]
    assert stale.fix == "rename it to 'fsdp_backward_prefetch'"
    fixed = tmp_path / "fixed.yaml"
    fixed.write_text((REAL / "accelerate_docs_usage_guide_fsdp.yaml").read_text().replace(
        "fsdp_backward_prefetch_policy", "fsdp_backward_prefetch"))
    assert plugin_of(fixed).backward_prefetch.name == "BACKWARD_PRE"
    assert check_file(fixed)[0].ok


def test_fsdp1_as_accelerate_config_writes_it_is_not_an_error():
    # `accelerate config` writes the FSDP1 strategy as fsdp_reshard_after_forward: FULL_SHARD
    report, view = report_of("trl_fsdp1.yaml")
    assert report.ok and not report.warnings
    assert view.fsdp_settings()["sharding_strategy"] == "FULL_SHARD"
    assert "ignored-default" in report.rules()


def test_defaults_accelerate_writes_are_info_not_printed_by_default():
    for name in ("alignment_handbook_fsdp.yaml", "peft_shadow_finetuning_fsdp_config.yaml", "trl_fsdp2.yaml"):
        report, _ = report_of(name)
        assert report.findings and all(item.severity == "info" for item in report.findings), name


@pytest.mark.parametrize("name, label", [
    ("accelerate_nd_cp.yaml", "context parallel 8"),
    ("trl_context_parallel_2gpu.yaml", "context parallel 2"),
    ("accelerate_nd_tp_hsdp.yaml", "TP 2 x HSDP 2x2 (replicate 2 x shard 2) (2x2x2 = 8)"),
    ("accelerate_nd_nd.yaml", "context parallel 4 x FSDP over 2"),
    ("trl_fsdp2_sharding_2gpus.yaml", "FSDP over 2"),
    ("trl_fsdp2.yaml", ""),
])
def test_layout_labels(name, label):
    _, view = report_of(name)
    assert view.layout_label() == label
    assert "HSDP 1x1" not in view.layout_label()


def test_hybrid_zero2_is_named_in_words(tmp_path):
    config = yaml.safe_load((REAL / "alignment_handbook_fsdp.yaml").read_text())
    config = copy.deepcopy(config)
    config.update(num_processes=16, num_machines=2)
    config["fsdp_config"]["fsdp_sharding_strategy"] = "_HYBRID_SHARD_ZERO2"
    path = tmp_path / "zero2.yaml"
    path.write_text(yaml.safe_dump(config))
    report, view = check_file(path)
    assert "hybrid ZeRO-2" in view.layout_label() and "full-shard-across-nodes" not in report.rules()


def test_fp8_is_a_launch_requirement_not_a_verdict_on_this_machine(tmp_path):
    config = yaml.safe_load((REAL / "trl_fsdp2.yaml").read_text())
    config["mixed_precision"] = "fp8"
    path = tmp_path / "fp8.yaml"
    path.write_text(yaml.safe_dump(config))
    report, view = check_file(path)
    assert report.ok and view.mixed_precision == "fp8"
    assert [item.rule for item in report.findings if item.rule.startswith("fp8")] == ["fp8-needs-backend"]
    assert "torchao" in report.findings[0].message or any("torchao" in i.message for i in report.findings)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_real_config_wrapping_is_proved(name):
    # accelerate's own preparation of the recipe's model under the file's settings: no crash, the
    # decoder layers are units, every parameter is in one.
    report, view = check_file(REAL / name, context=CheckContext(model=_facts(name)), prove_wrapping=True)
    probe = view.probe
    assert probe is not None and probe.skipped is None and probe.error is None, probe
    assert not report.rules() & {"prepare-crashes", "params-outside-units"}
    assert probe.left_out == []
    blocks = _facts(name).profile.wrap_classes
    assert sum(1 for _, classes, _ in probe.units if classes in blocks) == _facts(name).profile.dims.num_layers


def test_every_real_config_has_its_source_in_the_readme():
    readme = (REAL / "README.md").read_text()
    rows = {line.split("|")[1].strip() for line in readme.splitlines() if line.startswith("| ") and ".yaml" in line}
    assert rows == set(FILES)
    assert "Apache License 2.0" in readme


# QLoRA configs as their repositories ship them, with the models their recipes name.
QLORA = {
    "trl_fsdp_qlora.yaml": "model_configs/llama-3.1-70b",  # trl's QLoRA FSDP docs: Llama-70B class
    "peft_sft_fsdp_config_qlora.yaml": "model_configs/llama-3.1-70b",  # run_peft_qlora_fsdp.sh: Llama-2-70b
    "llamafactory_fsdp_config.yaml": "model_configs/llama-3.1-8b",  # fsdp_qlora example: Llama-3-8B
}


@pytest.mark.parametrize("name", sorted(QLORA))
def test_real_qlora_config_passes_with_method_qlora(name):
    report, _ = check_file(REAL / name, context=CheckContext(model=model_facts(str(REPO / QLORA[name])),
                                                             method="qlora"))
    assert report.ok, [item.to_json() for item in report.errors]
    assert "memory-assumes-full-finetune" not in report.rules()
    # genuine problems still reported: every one of these is FSDP1 with a 4-bit base
    assert "qlora-fsdp1" in report.rules()
    config = yaml.safe_load((REAL / name).read_text())
    if config["fsdp_config"].get("fsdp_use_orig_params") is False:
        assert "lora-fsdp1-flat-params" in report.rules()
    if config["fsdp_config"].get("fsdp_state_dict_type") == "FULL_STATE_DICT":
        assert "qlora-full-state-dict" in report.rules()
