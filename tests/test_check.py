"""fsdp-presets check: each planted error in a table of bad configs is caught (one test per row),
every shipped preset passes, and the command's exit codes and JSON."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from fsdp_presets import cli
from fsdp_presets.preset.emit import read_metadata
from fsdp_presets.check.findings import RULES, CheckContext
from fsdp_presets.check.lint import check_file

from check_configs import BAD_CONFIGS, FSDP1, GOOD, LLAMA_70B, facts, mutate

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "accelerate_configs"


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
    assert report.ok == (RULES[rule][0] in ("warning", "note", "info") and not report.errors)
    assert all(item.fix for item in report.findings)


def test_a_backward_prefetch_key_under_its_old_name_is_reported_once(tmp_path):
    """fsdp_backward_prefetch_policy (accelerate's name before 1.0) alone: FSDP1 runs without prefetch,
    and with a model one finding says so, with the rename (not a second one with the time)."""
    from check_configs import FSDP1, LLAMA_8B

    config = copy.deepcopy(GOOD)
    config["fsdp_config"].update({**FSDP1, "fsdp_backward_prefetch_policy": "BACKWARD_PRE"})
    for key in ("fsdp_reshard_after_forward", "fsdp_backward_prefetch"):
        config["fsdp_config"].pop(key, None)
    rules = check_file(_write(tmp_path, config), context=CheckContext(model=facts(LLAMA_8B)))[0].rules()
    assert "prefetch-key-not-applied" in rules and "backward-prefetch-off" not in rules
    del config["fsdp_config"]["fsdp_backward_prefetch_policy"]
    rules = check_file(_write(tmp_path, config), context=CheckContext(model=facts(LLAMA_8B)))[0].rules()
    assert "backward-prefetch-off" in rules  # the key missing: accelerate's NO_PREFETCH, timed


def test_every_rule_has_a_planted_error():
    # prepare-crashes, params-outside-units and wrap-probe-skipped are planted in tests/test_check_probe.py
    planted = {rule for _, rule, _, _, _ in BAD_CONFIGS.values()} | {"yaml-invalid", "prepare-crashes",
                                                                       "params-outside-units", "wrap-probe-skipped"}
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
        "lora-fsdp1-flat-params", "qlora-fsdp1", "qlora-full-state-dict", "yaml-read-as-boolean",
        "stale-key-beside-new", "debug-mode", "lora-fsdp1-orig-params", "fits-only-if", "wrap-probe-skipped",
        "trainer-save-model-sharded", "double-activation-checkpointing", "model-moved-before-prepare",
        "trust-remote-code", "prefetch-key-not-applied", "async-save-host-memory", "tp-pair-cannot-run",
        "tp-size-vs-model", "tp-no-plan", "tp-loss-reduction", "cp-masks", "distributed-config-under-fsdp",
        "ep-ram-efficient-loading", "ep-no-plan", "ep-size-vs-model", "distributed-config-mesh",
        "distributed-config-invalid", "distributed-config-vs-processes", "backward-prefetch-off",
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


def test_header_model_is_found_from_another_working_folder(tmp_path, monkeypatch, capsys):
    # the shipped presets name model_configs/... from the repository's root; checked from elsewhere,
    # the model is found above the config and its memory rules run
    monkeypatch.chdir(tmp_path)
    assert cli.main(["check", str(CONFIGS / "cpu_fsdp2_demo.yaml"), "--no-probe"]) == 0
    out = capsys.readouterr().out
    assert f"model: {CONFIGS.parent / 'model_configs' / 'smollm2-135m'} (named in the file's header as " \
           "model_configs/smollm2-135m" in out and "could not be loaded" not in out


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
    # the real key is in the file too, with the same value: delete the misspelt one (a rename duplicates a key)
    assert by_key["fsdp_config.fsdp_offload_parms"].rule == "stale-key-beside-new"
    assert by_key["fsdp_config.fsdp_offload_parms"].fix.startswith("delete fsdp_offload_parms")
    assert by_key["fsdp_config.fsdp_wrap_everything"].fix == "remove it"  # nothing close enough to guess


def test_fsdp1_strategy_fix_is_one_accelerate_accepts(tmp_path):
    from fsdp_presets.preset.accelerate_view import accelerate_view

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


def test_an_absurd_process_count_is_refused_as_launcher_refuses_it(tmp_path):
    from fsdp_presets.plan.limits import MAX_GPUS

    path = tmp_path / "absurd.yaml"
    path.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nnum_processes: 1000000000000\n"
                    "num_machines: 1\nfsdp_config:\n  fsdp_version: 2\n")
    report, _ = check_file(path)
    assert any(item.rule == "invalid-value" and f"num_processes 1000000000000 is more than {MAX_GPUS}" in item.message
               for item in report.errors), report.errors


def test_a_method_other_than_the_presets_is_refused_in_one_line(capsys):
    preset = Path(__file__).parents[1] / "accelerate_configs" / "llama-3.1-70b_1x8.yaml"
    assert cli.main(["check", str(preset), "--method", "qlora", "--no-probe"]) == 2
    error = capsys.readouterr().err.strip()
    assert "--method qlora disagrees with" in error and "a preset generated for full" in error
    assert len(error.splitlines()) == 1


# ---- a second dimension: tensor and context parallelism ----


def _nd_config(tmp_path, *, tp=1, cp=1, replicate=1, shard=8, processes=8):
    import yaml

    config = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "mixed_precision": "bf16",
              "num_machines": 1, "num_processes": processes,
              "fsdp_config": {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                              "fsdp_reshard_after_forward": True, "fsdp_state_dict_type": "SHARDED_STATE_DICT"},
              "parallelism_config": {"parallelism_config_dp_replicate_size": replicate,
                                     "parallelism_config_dp_shard_size": shard, "parallelism_config_tp_size": tp,
                                     "parallelism_config_cp_size": cp}}
    path = tmp_path / f"nd-tp{tp}-cp{cp}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _rules(capsys, *argv) -> set[str]:
    import json as json_module

    cli.main(["check", *map(str, argv), "--json"])
    document = json_module.loads(capsys.readouterr().out)
    files = document["files"] if "files" in document else [document]
    return {item["rule"] for report in files for item in report["findings"]}


def test_a_tp_size_the_key_value_heads_do_not_allow_is_an_error(tmp_path, capsys):
    # Llama-3.1-8B: 32 heads, 8 key/value heads; TP 16 x FSDP 1 on 16 processes (transformers issue 48307).
    rules = _rules(capsys, _nd_config(tmp_path, tp=16, shard=1, processes=16), "--model", "model_configs/llama-3.1-8b")
    assert "tp-size-vs-model" in rules
    assert "tp-size-vs-model" not in _rules(capsys, _nd_config(tmp_path, tp=4, shard=2),
                                            "--model", "model_configs/llama-3.1-8b")


def test_tensor_parallelism_through_accelerate_is_refused_where_the_installed_pair_cannot_run_it(tmp_path, capsys):
    from fsdp_presets.rehearse.mesh import accelerate_tp_import_problem

    rules = _rules(capsys, _nd_config(tmp_path, tp=4, shard=2), "--model", "model_configs/llama-3.1-8b")
    # Found by trying accelerate's own import, so the finding follows the installed transformers.
    assert ("tp-pair-cannot-run" in rules) == (accelerate_tp_import_problem() is not None)
    assert "tp-loss-reduction" in rules


def test_a_model_without_a_tp_plan_and_context_parallel_masks(tmp_path, capsys):
    assert "tp-no-plan" in _rules(capsys, _nd_config(tmp_path, tp=2, shard=4), "--model", "gpt2")
    assert "cp-masks" in _rules(capsys, _nd_config(tmp_path, cp=2, shard=4), "--model", "mistral")


def test_an_hsdp_mesh_without_a_second_dimension_gets_none_of_these(tmp_path, capsys):
    rules = _rules(capsys, _nd_config(tmp_path, replicate=2, shard=4), "--model", "model_configs/llama-3.1-8b")
    assert not rules & {"tp-pair-cannot-run", "tp-size-vs-model", "tp-no-plan", "tp-loss-reduction", "cp-masks"}


def test_a_trainer_script_with_an_expert_parallel_mesh_under_an_fsdp_config(tmp_path, capsys):
    """Mixtral (8 experts) as FSDP 4 x EP 2 through transformers' DistributedConfig, handed to Trainer
    under an FSDP config: the Trainer prepares its optimizer alone, which accelerate refuses under FSDP
    (measured), so the launch is told to use the DDP-type NAME.trainer.yaml; the mesh's sizes are right
    (no other error), and RAM-efficient loading left on (accelerate's FSDP2 default) adds exactly that one."""
    script = tmp_path / "train.py"
    script.write_text("from transformers import AutoModelForCausalLM, Trainer, TrainingArguments\n"
                      "from transformers.distributed import DistributedConfig\n"
                      "model = AutoModelForCausalLM.from_pretrained('m', distributed_config=DistributedConfig("
                      "fsdp_size=4, ep_size=2))\n"
                      "Trainer(model=model, args=TrainingArguments('out', bf16=True), train_dataset=data).train()\n")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(mutate(top={"num_processes": 4}, fsdp={"fsdp_cpu_ram_efficient_loading": False,
                                                                           "fsdp_sync_module_states": False})(
        copy.deepcopy(GOOD)), sort_keys=False))
    mesh_rules = {"distributed-config-under-fsdp", "ep-ram-efficient-loading", "ep-no-plan", "ep-size-vs-model",
                  "tp-size-vs-model", "tp-no-plan"}
    assert _rules(capsys, config, "--model", "model_configs/mixtral-8x7b", "--script", script) & mesh_rules == {
        "distributed-config-under-fsdp"}
    cli.main(["check", str(config), "--model", "model_configs/mixtral-8x7b", "--script", str(script)])
    assert "NAME.trainer.yaml" in capsys.readouterr().out
    config.write_text(yaml.safe_dump(mutate(top={"num_processes": 4})(copy.deepcopy(GOOD)), sort_keys=False))
    found = _rules(capsys, config, "--model", "model_configs/mixtral-8x7b", "--script", script) & mesh_rules
    assert found == {"distributed-config-under-fsdp", "ep-ram-efficient-loading"}
