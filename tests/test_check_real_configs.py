"""fsdp-presets check on real accelerate FSDP configs from public repositories (tests/data/real_configs,
sources in its README): judged against accelerate 1.16's own loading of each file, and against an
expert verdict for each file (the model, method and GPUs its repository trains with, and what is
really wrong with it).

For every file: every finding has a rule id and a fix; an error is reported only where the launch
fails or silently trains something else; every finding printed by default (not ``info``) is one the
verdict names (no wrong finding), every problem the verdict names is found (none missed), and the
files print on average at most one note each. :func:`test_the_counts_over_every_real_config` states
the counts: 45 files (29 from 5 repositories seen before, 16 from 16 repositories new to the
checker), 0 wrong findings, 0 missed problems, 4 notes.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from fsdp_presets.check.findings import RULES, CheckContext
from fsdp_presets.preset.accelerate_view import accelerate_view
from fsdp_presets.check.lint import check_file, model_facts

REPO = Path(__file__).resolve().parent.parent
from fsdp_presets.rehearse.mesh import accelerate_tp_import_problem

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
    "accelerate_docs_usage_guide_fsdp.yaml": {"prefetch-key-not-applied"},
    # FSDP2 ignores fsdp_sharding_strategy FULL_SHARD; fsdp_reshard_after_forward false makes it SHARD_GRAD_OP
    "llamafactory_fsdp_v2_config.yaml": {"fsdp1-key-under-fsdp2", "no-wrap-policy"},
    "llamafactory_fsdp_v2_offload_config.yaml": {"no-wrap-policy"},
    "accelerate_tp_fsdp2_preparation.yaml": {"no-wrap-policy"},
    "accelerate_test_latest_fsdp.yaml": {"fsdp-single-process"},
    "llamafactory_fsdp_config_multiple_nodes.yaml": {"fixed-main-process-ip", "full-shard-across-nodes"},
    # LoRA / QLoRA on a 70B model: the full-fine-tuning memory verdicts only as "if full fine-tuning"
    "peft_sft_fsdp_config.yaml": {"memory-assumes-full-finetune"},
    "peft_sft_fsdp_config_qlora.yaml": {"memory-assumes-full-finetune"},
    # Context parallelism drops attention masks (accelerate issue 4177, TRL issue 6843).
    "accelerate_nd_cp.yaml": {"cp-masks"},
    "accelerate_nd_nd.yaml": {"cp-masks"},
    "trl_context_parallel_2gpu.yaml": {"cp-masks"},
    "trl_context_parallel_8gpu.yaml": {"cp-masks"},
    # TP 2 x HSDP 2x2: accelerate's prepare cannot import what it needs from the installed transformers
    # (tried, as the rule does), and a loss counted twice would train silently.
    "accelerate_nd_tp_hsdp.yaml": {"tp-loss-reduction"} | ({"tp-pair-cannot-run"} if accelerate_tp_import_problem()
                                                           else set()),
}

# Files from repositories new to the checker: (repository, intended model, method, GPUs, verdict,
# problems the check must report). The model and method are those of the repository's own training
# scripts or README; "?" where the repository does not say. Each verdict was made by reading the file
# against accelerate 1.16's launcher and FSDP plugin, before looking at what `check` prints.
NEW = {
    "halos_fsdp_config.yaml": ("ContextualAI/HALOs", "Llama-3-8B", "full (DPO/KTO)", "1 x 4",
                               "fsdp_backward_prefetch_policy is the pre-1.0 name: BACKWARD_PRE is not applied (slower); "
                               "no mixed_precision: the HALOs trainer loads the policy in bf16 itself", {
                                   "prefetch-key-not-applied"}),
    "sparseml_fsdp_config.yaml": ("neuralmagic/sparseml", "Llama-2-7B", "full (sparse fine-tuning)", "1 x 2",
                                  "NO_WRAP: the whole model is one FSDP unit, nothing saved at the peak; stale "
                                  "prefetch key", {"no-wrap-policy", "prefetch-key-not-applied"}),
    "trlx_fsdp_config.yaml": ("CarperAI/trlx", "GPT-J/NeoX class", "full (RLHF)", "2 x 8",
                              "NO_WRAP; a fixed private main_process_ip for 2 machines; full sharding over 2 nodes "
                              "under CPU offload (not flagged: it halves each node's PCIe traffic); the stale "
                              "prefetch key asks for NO_PREFETCH, which applies anyway; unprefixed "
                              "offload_params/sharding_strategy are read (accelerate adds the prefix)", {
                                  "no-wrap-policy", "fixed-main-process-ip"}),
    "llammas_fsdp_config.yaml": ("TartuNLP/llammas", "Llama-2-7B", "full (continued pre-training)", "1 x 8",
                                 "stale prefetch key; fsdp_sharding_strategy 1 is FULL_SHARD; mixed_precision 'no' "
                                 "with the Trainer's bf16 flag", {"prefetch-key-not-applied"}),
    "home_llm_fsdp_config.yaml": ("acon96/home-llm", "Phi/StableLM/Gemma 2-3B", "full", "1 x 2", "clean", set()),
    "cde_fsdp_config.yaml": ("jxmorris12/cde", "BERT-base embedders", "full (contrastive)", "1 x 8",
                             "clean: HYBRID_SHARD_ZERO2 on one node shards gradients and optimizer over its 8 GPUs",
                             set()),
    "llama70b_training_test_fsdp_config.yaml": ("byunggilljoe/llama70b_training_test", "Llama-70B", "?", "1 x 8",
                                                "clean as a file; full fine-tuning of 70B would not fit 8 x 80 GB, "
                                                "LoRA would: the method decides", {"memory-assumes-full-finetune"}),
    "xmainframe_fsdp_qlora.yaml": ("FSoft-AI4Code/XMainframe", "DeepSeek-Coder-7B", "qlora (alignment-handbook "
                                   "SFT, Trainer)", "1 x 2 (the script passes 4)", "clean: PEFT's QLoRA+FSDP1 layout "
                                   "(offload, use_orig_params false, bf16 quant storage from the command line)", set()),
    "kubeflow_training_fsdp_config.yaml": ("kubeslice-ent/kubeflow-training", "Llama", "full", "2 x 2",
                                           "full sharding across 2 nodes (HYBRID_SHARD keeps gathers in a node)",
                                           {"full-shard-across-nodes"}),
    "codeact_fsdp_config.yaml": ("Kyle-Lyu/CodeACT", "CodeLlama-7B", "full", "1 x 8", "clean", set()),
    "scalebio_fsdp_config.yaml": ("2003pro/ScaleBiO", "Llama-3-8B", "full (bilevel)", "1 x 8",
                                  "clean: CPU offload on 8 GPUs is a choice (slower), not a fault", set()),
    "open_r1_fsdp_commented.yaml": ("fabianlim/open-r1", "Qwen2.5 (open-r1 SFT)", "full", "1 x 1 (--num_processes "
                                    "on the command line)", "num_processes 1 unless the launch overrides it; the "
                                    "stale prefetch key sits beside the new one with the same value (delete it)", {
                                        "fsdp-single-process", "stale-key-beside-new"}),
    "meteora_fsdp_config.yaml": ("NJUDeepEngine/meteora", "Llama-3-8B", "lora (MoE of adapters)", "1 x 8",
                                 "clean as a file (fsdp_sharding_strategy 1 is FULL_SHARD)", set()),
    "accelerate_llm_finetune_fsdp_config.yaml": ("shivam13juna/Accelerate-LLM-FineTune", "Llama", "full", "1 x 2",
                                                 "stale prefetch key", {"prefetch-key-not-applied"}),
    "adaptive_temperature_scaling_fsdp_config.yaml": ("Johnathan-Xie/adaptive-temperature-scaling", "Llama-2-7B",
                                                      "full", "1 x 4", "debug: true left on (extra collectives every "
                                                      "step); stale prefetch key", {"debug-mode",
                                                                                    "prefetch-key-not-applied"}),
    "m3rlin_fsdp_config.yaml": ("huu4ontocord/M3rlin", "?", "full", "1 x 8", "stale prefetch key",
                                {"prefetch-key-not-applied"}),
}
MODELS["llama70b_training_test_fsdp_config.yaml"] = "model_configs/llama-3.1-70b"
EXPECTED.update({name: problems for name, (*_, problems) in NEW.items()})

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
    [stale] = [item for item in report.findings if item.rule == "prefetch-key-not-applied"]
    assert stale.fix == "rename it to 'fsdp_backward_prefetch'" and stale.severity == "warning"
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
@pytest.mark.parametrize("name", sorted(set(MODELS) - {"llama70b_training_test_fsdp_config.yaml"}))  # peft's 70B is proved
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


def test_the_counts_over_every_real_config():
    """No wrong finding, no missed problem, at most one note per file on average (default output)."""
    wrong, missed, notes = [], [], 0
    for name in FILES:
        report, _ = report_of(name)
        printed = [item for item in report.findings if item.severity != "info"]
        expected = EXPECTED.get(name, set())
        wrong += [(name, item.rule) for item in printed if item.rule not in expected]
        missed += [(name, rule) for rule in expected - {item.rule for item in printed}]
        notes += sum(1 for item in printed if item.severity == "note")
    assert (len(FILES), len(NEW), len(wrong), len(missed), notes) == (45, 16, 0, 0, 5), (wrong, missed, notes)
    assert notes / len(FILES) <= 1
    assert len({repository for repository, *_ in NEW.values()}) == len(NEW) == 16  # 16 new repositories
