"""fsdp-presets check: each planted error in a table of bad configs is caught (one test per row),
every shipped preset passes, and the command's exit codes and JSON."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from fsdp_presets import cli
from fsdp_presets.plan.emit import read_metadata
from fsdp_presets.plan.check import RULES, CheckContext, check_file

from check_configs import GOOD, facts

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "accelerate_configs"

FSDP1 = {"fsdp_version": 1, "fsdp_sharding_strategy": "FULL_SHARD", "fsdp_backward_prefetch": "BACKWARD_PRE",
         "fsdp_forward_prefetch": False, "fsdp_use_orig_params": True, "fsdp_sync_module_states": True}


def mutate(top: dict | None = None, fsdp: dict | None = None, drop: tuple = (), drop_fsdp: tuple = (),
           parallelism: dict | None = None):
    def apply(config: dict) -> dict:
        config.update(top or {})
        config["fsdp_config"].update(fsdp or {})
        for key in drop:
            config.pop(key, None)
        for key in drop_fsdp:
            config["fsdp_config"].pop(key, None)
        if parallelism is not None:
            config["parallelism_config"] = parallelism
        return config
    return apply


LLAMA_70B, LLAMA_8B = "model_configs/llama-3.1-70b", "model_configs/llama-3.1-8b"

# id: (mutation, rule expected, model, context settings, text the message or fix must hold)
BAD_CONFIGS = {
    "misspelled-top-level-key": (mutate(top={"mixed_precison": "bf16"}), "unknown-key", None, {},
                                 "'mixed_precision'"),
    "misspelled-fsdp-key": (mutate(fsdp={"fsdp_reshard_after_foward": False}), "unknown-fsdp-key", None, {},
                            "'fsdp_reshard_after_forward'"),
    "misspelled-parallelism-key": (mutate(top={"num_processes": 4}, parallelism={
        "parallelism_config_dp_replicat_size": 2, "parallelism_config_dp_shard_size": 2}),
        "unknown-parallelism-key", None, {}, "'parallelism_config_dp_replicate_size'"),
    "invalid-state-dict-type": (mutate(fsdp={"fsdp_state_dict_type": "SHARDED"}), "invalid-value", None, {},
                                "SHARDED_STATE_DICT"),
    "invalid-mixed-precision": (mutate(top={"mixed_precision": "bfloat16"}), "invalid-value", None, {}, "bf16"),
    "invalid-boolean": (mutate(fsdp={"fsdp_offload_params": "maybe"}), "invalid-value", None, {}, "true or false"),
    "fsdp-version-missing": (mutate(drop_fsdp=("fsdp_version",)), "fsdp-version-missing", None, {}, "FSDP1"),
    "sharding-strategy-under-fsdp2": (mutate(fsdp={"fsdp_sharding_strategy": "SHARD_GRAD_OP"}),
                                      "fsdp1-key-under-fsdp2", None, {}, "fsdp_reshard_after_forward"),
    "backward-prefetch-under-fsdp2": (mutate(fsdp={"fsdp_backward_prefetch": "BACKWARD_POST"}),
                                      "fsdp1-key-under-fsdp2", None, {}, "FSDP2 ignores it"),
    "reshard-after-forward-under-fsdp1": (mutate(fsdp={**FSDP1, "fsdp_reshard_after_forward": False}),
                                          "fsdp2-key-under-fsdp1", None, {}, "fsdp_sharding_strategy"),
    "hsdp-with-fsdp1": (mutate(top={"num_processes": 4, "num_machines": 2}, fsdp={**FSDP1}, drop_fsdp=(
        "fsdp_reshard_after_forward",), parallelism={"parallelism_config_dp_replicate_size": 2,
                                                     "parallelism_config_dp_shard_size": 2}),
                        "hsdp-needs-fsdp2", None, {}, "fsdp_version: 2"),
    "hsdp-sizes-do-not-multiply": (mutate(top={"num_processes": 4, "num_machines": 2}, parallelism={
        "parallelism_config_dp_replicate_size": 2, "parallelism_config_dp_shard_size": 4}),
        "hsdp-size-mismatch", None, {}, "num_processes is 4"),
    "hsdp-shard-spans-nodes": (mutate(top={"num_processes": 8, "num_machines": 2}, parallelism={
        "parallelism_config_dp_replicate_size": 1, "parallelism_config_dp_shard_size": 8}),
        "hsdp-shard-spans-nodes", None, {}, "parallelism_config_dp_shard_size: 4"),
    "processes-not-divisible-by-machines": (mutate(top={"num_processes": 6, "num_machines": 4}),
                                            "machines-do-not-divide", None, {}, "multiple of 4"),
    "lora-fsdp1-orig-params-false": (mutate(fsdp={**FSDP1, "fsdp_use_orig_params": False}, drop_fsdp=(
        "fsdp_reshard_after_forward",)), "lora-fsdp1-flat-params", None, {"method": "lora"}, "uniform requires_grad"),
    "qlora-fsdp1": (mutate(fsdp={**FSDP1}, drop_fsdp=("fsdp_reshard_after_forward",)), "qlora-fsdp1", None,
                    {"method": "qlora"}, "bnb_4bit_quant_storage=bfloat16"),
    "qlora-full-state-dict": (mutate(fsdp={"fsdp_state_dict_type": "FULL_STATE_DICT"}), "qlora-full-state-dict",
                              None, {"method": "qlora"}, "quantization-state keys"),
    "no-wrap-policy": (mutate(fsdp={"fsdp_auto_wrap_policy": "NO_WRAP"}), "no-wrap-policy", None, {},
                       "TRANSFORMER_BASED_WRAP"),
    "wrap-classes-left-to-the-model": (mutate(drop_fsdp=("fsdp_transformer_layer_cls_to_wrap",)),
                                       "wrap-classes-unset", "llama", {}, "LlamaDecoderLayer"),
    "no-split-modules-names-missing-classes": (mutate(drop_fsdp=("fsdp_transformer_layer_cls_to_wrap",)),
                                               "no-split-modules-missing", "gemma3", {},
                                               "SiglipMultiheadAttentionPoolingHead"),
    "wrap-classes-as-a-list": (mutate(fsdp={"fsdp_transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}),
                               "wrap-class-format", None, {}, "comma"),
    "wrap-classes-with-spaces": (mutate(fsdp={"fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer, LlamaMLP"}),
                                 "wrap-class-format", None, {}, "LlamaDecoderLayer,LlamaMLP"),
    "wrap-class-misspelled": (mutate(fsdp={"fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayr"}),
                              "wrap-class-not-in-model", "llama", {}, "did you mean 'LlamaDecoderLayer'"),
    "wrap-class-of-another-model": (mutate(fsdp={"fsdp_transformer_layer_cls_to_wrap": "GPT2Block"}),
                                    "wrap-class-not-in-model", "llama", {}, "LlamaDecoderLayer"),
    "wrap-class-not-a-block": (mutate(fsdp={"fsdp_transformer_layer_cls_to_wrap": "LlamaMLP"}),
                               "wrap-class-not-a-block", "llama", {}, "LlamaDecoderLayer"),
    "ignored-modules": (mutate(fsdp={"fsdp_ignored_modules": "lm_head"}), "ignored-modules", None, {},
                        "gradient-synchronises"),
    "ram-efficient-loading-without-sync": (mutate(fsdp={"fsdp_sync_module_states": False}),
                                           "ram-efficient-loading-needs-sync", None, {}, "fsdp_sync_module_states"),
    "ram-efficient-loading-off-70b": (mutate(top={"num_processes": 8}, fsdp={"fsdp_cpu_ram_efficient_loading": False}),
                                      "ram-efficient-loading-off", LLAMA_70B, {}, "1051 GiB"),
    "full-state-dict-70b": (mutate(fsdp={"fsdp_state_dict_type": "FULL_STATE_DICT"}),
                            "full-state-dict-host-memory", LLAMA_70B, {"host_memory_gib": 512, "method": "full"},
                            "SHARDED_STATE_DICT"),
    "offload-70b-on-one-node": (mutate(top={"num_processes": 8}, fsdp={"fsdp_offload_params": True,
                                                                        "fsdp_activation_checkpointing": True}),
                                "offload-host-memory", LLAMA_70B, {"method": "full"}, "1051 GiB"),
    "offload-on-cpu-host": (mutate(fsdp={"fsdp_offload_params": True}), "offload-on-cpu", None, {"device": "cpu"},
                            "fsdp_offload_params: false"),
    "fp32-that-does-not-fit": (mutate(top={"num_processes": 8, "mixed_precision": "no"}), "fp32-does-not-fit",
                               LLAMA_8B, {"gpu_memory_gib": 56, "seq_len": 4096, "method": "full"},
                               "mixed_precision: bf16"),
    "70b-on-two-gpus": (mutate(), "does-not-fit", LLAMA_70B, {"method": "full"}, "FULL_SHARD (FSDP2) on 2 GPUs"),
    "70b-on-two-gpus-method-unknown": (mutate(), "memory-assumes-full-finetune", LLAMA_70B, {}, "--method full"),
    "fp16-on-a-bf16-model": (mutate(top={"num_processes": 8, "mixed_precision": "fp16"}), "fp16-on-bf16-model",
                             LLAMA_8B, {}, "bf16"),
    "fsdp-config-under-ddp": (mutate(top={"distributed_type": "MULTI_GPU"}), "fsdp-config-ignored", None, {},
                              "FSDP"),
    "accelerate-refuses-checkpointing-offload": (mutate(fsdp={"fsdp_activation_checkpointing_offload": True}),
                                                 "accelerate-rejects", None, {}, "activation_checkpointing"),
    # FSDP1 as `accelerate config` writes it: the key is not applied, but what applies is the same.
    "fsdp1-reshard-as-accelerate-writes-it": (mutate(fsdp={**FSDP1, "fsdp_reshard_after_forward": "FULL_SHARD"},
                                                     drop_fsdp=("fsdp_sharding_strategy",)),
                                              "ignored-default", None, {}, "FULL_SHARD"),
    "fsdp1-reshard-asks-for-another-strategy": (mutate(fsdp={**FSDP1, "fsdp_reshard_after_forward": "SHARD_GRAD_OP"},
                                                       drop_fsdp=("fsdp_sharding_strategy",)),
                                                "fsdp2-key-under-fsdp1", None, {},
                                                "fsdp_sharding_strategy: SHARD_GRAD_OP"),
    "limit-all-gathers-off": (mutate(fsdp={**FSDP1, "fsdp_limit_all_gathers": False}), "key-not-applied", None, {},
                              "FullyShardedDataParallelPlugin(limit_all_gathers"),
    "no-num-processes": (mutate(drop=("num_processes",)), "num-processes-unset", LLAMA_70B, {}, "--num_processes"),
    "fp8-config": (mutate(top={"mixed_precision": "fp8"}), "fp8-needs-backend", None, {}, "torchao"),
    "num-processes-edited-away-from-header": (lambda config: {**config, "num_processes": 16}, "num-processes-vs-header",
                                              None, {"metadata": {"kind": "fsdp", "summary": {
                                                  "processes": 8, "machines": 1, "data_parallel_size": 8,
                                                  "micro_batch": 2, "gradient_accumulation": 16,
                                                  "global_batch": 256}}}, "512 sequences"),
    "fsdp-on-one-process": (mutate(top={"num_processes": 1}), "fsdp-single-process", None, {}, "distributed_type"),
    "fixed-private-main-process-ip": (mutate(top={"num_processes": 16, "num_machines": 2,
                                                  "main_process_ip": "10.1.2.3"},
                                             parallelism={"parallelism_config_dp_replicate_size": 2,
                                                          "parallelism_config_dp_shard_size": 8}),
                                      "fixed-main-process-ip", None, {}, "--main_process_ip $MASTER_ADDR"),
    "full-shard-across-nodes": (mutate(top={"num_processes": 16, "num_machines": 2}), "full-shard-across-nodes",
                                None, {}, "parallelism_config_dp_replicate_size: 2"),
}


def _write(tmp_path: Path, config) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False) if not isinstance(config, str) else config)
    return path


def test_the_good_config_is_clean(tmp_path):
    report, view = check_file(_write(tmp_path, GOOD), context=CheckContext(model=facts("llama")))
    assert report.findings == [] and view.fsdp_settings()["transformer_cls_names_to_wrap"] == ["LlamaDecoderLayer"]


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_check_catches_planted_error(case, tmp_path):
    change, rule, model, settings, text = BAD_CONFIGS[case]
    config = change(copy.deepcopy(GOOD))
    report, _ = check_file(_write(tmp_path, config), context=CheckContext(model=facts(model), **settings))
    hits = [item for item in report.findings if item.rule == rule]
    assert hits, f"{rule} not reported; got {[item.rule for item in report.findings]}"
    assert hits[0].severity == RULES[rule][0]
    assert any(text in item.message + " " + item.fix for item in hits), [item.message for item in hits]
    assert report.ok == (RULES[rule][0] in ("warning", "note") and not report.errors)
    assert all(item.fix for item in report.findings)


def test_every_rule_has_a_planted_error():
    # prepare-crashes and params-outside-units are planted in tests/test_check_probe.py
    planted = {rule for _, rule, _, _, _ in BAD_CONFIGS.values()} | {"yaml-invalid", "prepare-crashes",
                                                                       "params-outside-units"}
    assert planted == set(RULES)


def test_rule_ids_are_stable():
    # Docs cite these ids: renaming one is a breaking change, adding one extends this list.
    assert tuple(RULES) == (
        "yaml-invalid", "accelerate-rejects", "unknown-key", "unknown-fsdp-key", "unknown-parallelism-key",
        "invalid-value", "fsdp-version-missing", "fsdp1-key-under-fsdp2", "fsdp2-key-under-fsdp1", "hsdp-needs-fsdp2",
        "hsdp-size-mismatch", "hsdp-shard-spans-nodes", "machines-do-not-divide", "no-wrap-policy",
        "wrap-classes-unset", "no-split-modules-missing", "wrap-class-format", "wrap-class-not-in-model",
        "wrap-class-not-a-block", "ignored-modules", "ram-efficient-loading-needs-sync", "ram-efficient-loading-off",
        "full-state-dict-host-memory", "offload-host-memory", "offload-on-cpu", "fp32-does-not-fit", "does-not-fit",
        "fp16-on-bf16-model", "fsdp-config-ignored", "ignored-default", "key-not-applied", "num-processes-unset",
        "fp8-needs-backend", "memory-assumes-full-finetune", "prepare-crashes", "params-outside-units",
        "num-processes-vs-header", "fsdp-single-process", "fixed-main-process-ip", "full-shard-across-nodes",
        "lora-fsdp1-flat-params", "qlora-fsdp1", "qlora-full-state-dict",
    )


@pytest.mark.parametrize("text", ["fsdp_config: [unclosed\n", "- just\n- a list\n"], ids=["broken-yaml", "a-list"])
def test_yaml_that_is_not_a_config(text, tmp_path):
    report, view = check_file(_write(tmp_path, text))
    assert [item.rule for item in report.findings] == ["yaml-invalid"] and view is None


@pytest.mark.parametrize("value", ["two", "99999999999999999999999x", "2.5"])
def test_process_count_that_is_not_a_number_is_one_finding(value, tmp_path):
    """No traceback from accelerate's int() of the count: one invalid-value finding, no duplicate."""
    report, _ = check_file(_write(tmp_path, mutate(top={"num_processes": value})(copy.deepcopy(GOOD))),
                           context=CheckContext(model=facts("llama")), prove_wrapping=False)
    assert [item.rule for item in report.errors] == ["invalid-value"], [item.message for item in report.findings]


def test_all_problems_are_reported_at_once(tmp_path):
    config = mutate(top={"num_processes": 6, "num_machines": 4},
                    fsdp={"fsdp_reshard_after_foward": False, "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayr",
                          "fsdp_sharding_strategy": "SHARD_GRAD_OP", "fsdp_ignored_modules": "lm_head"})(copy.deepcopy(GOOD))
    report, _ = check_file(_write(tmp_path, config), context=CheckContext(model=facts("llama")))
    assert {"machines-do-not-divide", "unknown-fsdp-key", "wrap-class-not-in-model", "fsdp1-key-under-fsdp2",
            "ignored-modules"} <= report.rules()


# --------------------------------------------------------------------------- every shipped preset


@pytest.mark.parametrize("name", sorted(path.name for path in CONFIGS.glob("*.yaml")))
def test_shipped_preset_passes_check(name):
    path = CONFIGS / name
    metadata = read_metadata(path.read_text())
    report, view = check_file(path, context=CheckContext(model=facts(metadata["request"]["model"])))
    assert report.findings == [], [item.to_json() for item in report.findings]
    assert view is not None


# --------------------------------------------------------------------------- the command


def test_command_exit_codes_and_json(tmp_path, capsys):
    bad = _write(tmp_path, mutate(fsdp={"fsdp_sharding_strategy": "SHARD_GRAD_OP"})(copy.deepcopy(GOOD)))
    assert cli.main(["check", str(bad), "--model", "llama", "--json"]) == 1
    document = json.loads(capsys.readouterr().out)
    assert document["ok"] is False
    finding = document["files"][0]["findings"][0]
    assert finding["rule"] == "fsdp1-key-under-fsdp2" and finding["severity"] == "error" and finding["fix"]
    assert document["files"][0]["accelerate"]["fsdp"]["reshard_after_forward"] is True

    warning_only = tmp_path / "warn.yaml"
    warning_only.write_text(yaml.safe_dump(mutate(fsdp={"fsdp_auto_wrap_policy": "NO_WRAP"})(copy.deepcopy(GOOD))))
    assert cli.main(["check", str(warning_only)]) == 0, "warnings do not fail"
    out = capsys.readouterr().out
    assert "ok (0 errors, 1 warning)" in out and "no-wrap-policy" in out and "fix:" in out

    assert cli.main(["check", str(CONFIGS / "cpu_fsdp2_demo.yaml")]) == 0
    assert "named in the file's header" in capsys.readouterr().out


def test_command_bad_input_exits_2(tmp_path, capsys):
    assert cli.main(["check", str(tmp_path / "missing.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert cli.main(["check", str(CONFIGS / "cpu_ddp_demo.yaml"), "--model", "lama"]) == 2
    assert "did you mean 'llama'" in capsys.readouterr().err


def test_list_rules(capsys):
    assert cli.main(["check", "--list-rules"]) == 0
    out = capsys.readouterr().out
    assert all(rule in out for rule in RULES)


# --------------------------------------------------------------------------- advice accelerate accepts


def test_did_you_mean_only_for_unknown_keys_and_near_misses(tmp_path):
    # fsdp_limit_all_gathers is a real FSDP1 option (default true): never "rename it to fsdp_min_num_params"
    config = mutate(fsdp={**FSDP1, "fsdp_limit_all_gathers": True, "fsdp_offload_parms": False,
                          "fsdp_wrap_everything": True}, drop_fsdp=("fsdp_reshard_after_forward",))(copy.deepcopy(GOOD))
    report, _ = check_file(_write(tmp_path, config))
    by_key = {item.key: item for item in report.findings}
    assert by_key["fsdp_config.fsdp_limit_all_gathers"].rule == "ignored-default"
    assert "fsdp_min_num_params" not in " ".join(item.message + item.fix for item in report.findings)
    assert by_key["fsdp_config.fsdp_offload_parms"].fix == "rename it to 'fsdp_offload_params'"
    assert by_key["fsdp_config.fsdp_wrap_everything"].fix == "remove it"  # nothing close enough to guess


def test_fsdp1_strategy_fix_is_one_accelerate_accepts(tmp_path):
    from fsdp_presets.plan.check import accelerate_view

    config = mutate(fsdp={**FSDP1, "fsdp_reshard_after_forward": "SHARD_GRAD_OP"},
                    drop_fsdp=("fsdp_sharding_strategy",))(copy.deepcopy(GOOD))
    path = _write(tmp_path, config)
    report, view = check_file(path)
    [item] = [item for item in report.findings if item.rule == "fsdp2-key-under-fsdp1"]
    assert view.fsdp_settings()["sharding_strategy"] == "FULL_SHARD"  # what accelerate really runs
    assert item.fix == "set fsdp_sharding_strategy: SHARD_GRAD_OP" and "fsdp_version: 2" not in item.fix
    config["fsdp_config"]["fsdp_sharding_strategy"] = "SHARD_GRAD_OP"
    fixed = tmp_path / "fixed.yaml"
    fixed.write_text(yaml.safe_dump(config))
    assert accelerate_view(fixed).fsdp_settings()["sharding_strategy"] == "SHARD_GRAD_OP"


def test_no_gpu_count_verdict_without_num_processes(tmp_path):
    config = mutate(drop=("num_processes",))(copy.deepcopy(GOOD))
    report, view = check_file(_write(tmp_path, config), context=CheckContext(model=facts(LLAMA_70B), method="full"))
    assert report.ok and report.rules() == {"num-processes-unset"} and not view.processes_in_file
    # with --gpus the memory rules run for that count
    report, _ = check_file(_write(tmp_path, config), context=CheckContext(model=facts(LLAMA_70B), method="full",
                                                                       gpus=2))
    assert "does-not-fit" in report.rules()
