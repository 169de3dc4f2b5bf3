"""fsdp-presets check --script TRAIN.py: a static read of the training script (never imported or run)
names the traps a config alone cannot show and gives the memory rules their inputs; and every
spelling accelerate 1.16 parses is understood as accelerate parses it."""

from __future__ import annotations

import copy
import os

import pytest
import yaml

from fsdp_presets import cli
from fsdp_presets.errors import UsageError
from fsdp_presets.check.findings import CheckContext
from fsdp_presets.preset.accelerate_view import accelerate_view
from fsdp_presets.check.lint import check_file
from fsdp_presets.check.script import MAX_SCRIPT_BYTES, read_script, read_source

from check_configs import FSDP1, GOOD, LLAMA_8B, TRAINER_SCRIPT, facts, mutate

# TRL's SFT example as users copy it (PEFT's examples/sft/train.py shape): SFTConfig flags, a 4-bit
# base with bf16 storage, the PEFT FSDP fix-ups, and save_model after FULL_STATE_DICT.
SFT_SCRIPT = """
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM, BitsAndBytesConfig
from trl import SFTConfig, SFTTrainer

bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
                         bnb_4bit_quant_storage=torch.bfloat16)
model = AutoModelForCausalLM.from_pretrained("meta-llama/Llama-2-70b-hf", quantization_config=bnb,
                                             dtype=torch.bfloat16)
args = SFTConfig(output_dir="out", bf16=True, per_device_train_batch_size=2, max_length=2048,
                 gradient_checkpointing=True)
trainer = SFTTrainer(model=model, args=args, train_dataset=data, peft_config=LoraConfig(r=8))
trainer.train()
if trainer.is_fsdp_enabled:
    trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
trainer.save_model()
"""


def _write(tmp_path, config) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return str(path)


def test_a_trl_script_is_read_without_running_it(tmp_path):
    facts_of = read_source(SFT_SCRIPT + "\nraise SystemExit('the script ran')\n")
    assert facts_of.trainer_line == 13 and facts_of.save_model_line == 17
    assert facts_of.precision == "bf16" and facts_of.micro_batch == 2 and facts_of.seq_len == 2048
    assert facts_of.gradient_checkpointing_line == 11 and facts_of.method == "qlora"
    assert facts_of.quant_storage == "bfloat16" and facts_of.full_state_dict_for_save
    assert not facts_of.has_callback and facts_of.moved_before_prepare == []


def test_save_model_under_sharded_is_an_error_and_the_callback_clears_it(tmp_path):
    config = _write(tmp_path, GOOD)  # SHARDED_STATE_DICT
    report, _ = check_file(config, context=CheckContext(script=TRAINER_SCRIPT))
    assert "trainer-save-model-sharded" in {item.rule for item in report.errors}
    fixed = read_source("from fsdp_presets import FSDPPresetsCallback\n" + "\n".join(
        line.replace("train_dataset=data)", "train_dataset=data, callbacks=[FSDPPresetsCallback()])")
        for line in _TRAINER_TEXT.splitlines()))
    assert fixed.has_callback
    assert "trainer-save-model-sharded" not in check_file(config, context=CheckContext(script=fixed))[0].rules()
    # PEFT's way: FULL_STATE_DICT set on the plugin before save_model
    assert "trainer-save-model-sharded" not in check_file(
        config, context=CheckContext(script=read_source(SFT_SCRIPT)))[0].rules()
    # FULL_STATE_DICT in the file: save_model writes the weights
    full = _write(tmp_path, mutate(fsdp={"fsdp_state_dict_type": "FULL_STATE_DICT"})(copy.deepcopy(GOOD)))
    assert "trainer-save-model-sharded" not in check_file(full, context=CheckContext(script=TRAINER_SCRIPT))[0].rules()


_TRAINER_TEXT = """
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
model = AutoModelForCausalLM.from_pretrained("m")
args = TrainingArguments("out", bf16=True, gradient_checkpointing=True, per_device_train_batch_size=4)
trainer = Trainer(model=model, args=args, train_dataset=data)
trainer.train()
trainer.save_model("out/final")
"""


def test_a_trainer_script_clears_the_fsdp1_lora_warnings_it_does_not_have(tmp_path):
    # transformers' Trainer applies peft's wrap policy itself and saves the adapter with FULL_STATE_DICT
    config = _write(tmp_path, mutate(fsdp={**FSDP1, "fsdp_state_dict_type": "FULL_STATE_DICT"},
                                     drop_fsdp=("fsdp_reshard_after_forward",))(copy.deepcopy(GOOD)))
    alone = check_file(config, context=CheckContext(method="qlora"))[0].rules()
    assert {"lora-fsdp1-orig-params", "qlora-full-state-dict"} <= alone
    with_script = check_file(config, context=CheckContext(script=read_source(SFT_SCRIPT)))[0].rules()
    assert not {"lora-fsdp1-orig-params", "qlora-full-state-dict"} & with_script
    # PEFT's documented FSDP1 QLoRA path (a Trainer, bf16 quant storage): nothing to warn about
    assert "qlora-fsdp1" not in with_script and "qlora-fsdp1" in alone
    uint8 = read_source(SFT_SCRIPT.replace("bnb_4bit_quant_storage=torch.bfloat16", "bnb_4bit_quant_storage=torch.uint8"))
    assert "qlora-fsdp1" in check_file(config, context=CheckContext(script=uint8))[0].rules()


def test_the_script_decides_the_memory_verdict(tmp_path):
    # 8B full fine-tuning on 8 x 40 GiB at 4096 tokens, mixed_precision 'no' in the file
    config = _write(tmp_path, mutate(top={"num_processes": 8, "mixed_precision": "no"})(copy.deepcopy(GOOD)))
    model = facts(LLAMA_8B)
    base = dict(model=model, gpu_memory_gib=40, seq_len=4096, method="full")
    alone = check_file(config, context=CheckContext(**base))[0]
    [verdict] = [item for item in alone.findings if item.rule == "fits-only-if"]
    assert "gradient checkpointing" in verdict.message and "GiB" in verdict.message
    assert "does-not-fit" not in alone.rules()
    trainer = read_source(_TRAINER_TEXT.replace("per_device_train_batch_size=4", "per_device_train_batch_size=1"))
    told = check_file(config, context=CheckContext(**base, script=trainer))[0]  # bf16, gradient checkpointing
    assert not told.rules() & {"fits-only-if", "does-not-fit", "fp32-does-not-fit"}, told.to_json()
    four = check_file(config, context=CheckContext(**base, script=read_source(_TRAINER_TEXT)))[0]  # batch 4
    [verdict] = [item for item in four.findings if item.rule == "does-not-fit"]
    assert "micro-batch 4" in verdict.message and "bf16" in verdict.message
    plain = read_source("from accelerate import Accelerator\nmodel = build()\nmodel = Accelerator().prepare(model)\n")
    fp32 = check_file(config, context=CheckContext(**base, script=plain))[0]
    [flat] = [item for item in fp32.findings if item.rule == "does-not-fit"]  # known inputs: a flat verdict
    assert "fp32" in flat.message and "no activation checkpointing" in flat.message
    # a script that takes its settings from the command line (PEFT's train.py: --bf16 True
    # --gradient_checkpointing True in the shell script) leaves them open: "fits only if" again
    parsed = read_source("from transformers import HfArgumentParser, TrainingArguments\n"
                         "args, = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()\n")
    assert parsed.parses_arguments
    assert "fits-only-if" in check_file(config, context=CheckContext(**base, script=parsed))[0].rules()


def test_model_moved_before_prepare_and_after(tmp_path):
    before = read_source("model = load()\nmodel.cuda()\nmodel = accelerator.prepare(model)\n")
    after = read_source("model = accelerator.prepare(load())\nbatch = batch.to(device)\nmodel.to(torch.bfloat16)\n")
    assert before.moved_before_prepare == [2] and after.moved_before_prepare == []


@pytest.mark.parametrize("make, words", [
    (lambda path: os.mkfifo(path), "not a regular file"),
    (lambda path: path.mkdir(), "not a regular file"),
    (lambda path: path.write_bytes(b"x = 1\n" * (MAX_SCRIPT_BYTES // 6 + 1)), "more than"),
    (lambda path: path.write_bytes(b"\xff\xfe not utf-8"), "UTF-8"),
    (lambda path: path.write_text("def broken(:\n"), "not Python that parses"),
    (lambda path: path.write_text("x = " + "(" * 5000 + ")" * 5000 + "\n"), "not Python that parses"),
], ids=["fifo", "directory", "too-large", "not-utf8", "syntax-error", "too-deep"])
def test_the_script_reader_is_bounded(tmp_path, make, words):
    path = tmp_path / "train.py"
    make(path)
    with pytest.raises(UsageError, match=words):
        read_script(path)


def test_check_script_flag_exits_2_on_a_bad_script(tmp_path, capsys):
    config = _write(tmp_path, GOOD)
    assert cli.main(["check", config, "--script", str(tmp_path / "missing.py")]) == 2
    script = tmp_path / "train.py"
    script.write_text(_TRAINER_TEXT)
    assert cli.main(["check", config, "--script", str(script)]) == 1
    assert "trainer-save-model-sharded" in capsys.readouterr().out


# --------------------------------------------------------------------------- spellings accelerate parses

_SWEEP = [
    # (fsdp_config change, plugin attribute, what accelerate makes of it)
    ({"fsdp_sharding_strategy": 1}, "sharding_strategy", "FULL_SHARD"),
    ({"fsdp_sharding_strategy": "2"}, "sharding_strategy", "SHARD_GRAD_OP"),
    ({"fsdp_sharding_strategy": 4}, "sharding_strategy", "HYBRID_SHARD"),
    ({"fsdp_sharding_strategy": "full_shard"}, "sharding_strategy", "FULL_SHARD"),
    ({"fsdp_sharding_strategy": "HYBRID_SHARD_ZERO2"}, "sharding_strategy", "_HYBRID_SHARD_ZERO2"),
    ({"fsdp_backward_prefetch": 1}, "backward_prefetch", "BACKWARD_PRE"),
    ({"fsdp_backward_prefetch": "2"}, "backward_prefetch", "BACKWARD_POST"),
    ({"fsdp_backward_prefetch": "backward_pre"}, "backward_prefetch", "BACKWARD_PRE"),
    ({"fsdp_backward_prefetch": "NO_PREFETCH"}, "backward_prefetch", None),
    ({"fsdp_state_dict_type": 3}, "state_dict_type", "SHARDED_STATE_DICT"),
    ({"fsdp_state_dict_type": "full_state_dict"}, "state_dict_type", "FULL_STATE_DICT"),
    ({"fsdp_offload_params": "true"}, "offload_params", True),
    ({"fsdp_use_orig_params": "False"}, "use_orig_params", False),
    ({"fsdp_sync_module_states": "yes"}, "sync_module_states", True),
    ({"fsdp_forward_prefetch": "off"}, "forward_prefetch", False),
    ({"fsdp_cpu_ram_efficient_loading": "on"}, "cpu_ram_efficient_loading", True),
    ({"fsdp_activation_checkpointing": "1"}, "activation_checkpointing", True),
]


@pytest.mark.parametrize("change, attribute, applied", _SWEEP,
                         ids=[f"{next(iter(c))}={next(iter(c.values()))!r}" for c, _, _ in _SWEEP])
def test_every_spelling_accelerate_parses_is_understood(tmp_path, change, attribute, applied):
    config = mutate(fsdp={**FSDP1, "fsdp_sync_module_states": True, **change},
                    drop_fsdp=("fsdp_reshard_after_forward",))(copy.deepcopy(GOOD))
    path = _write(tmp_path, config)
    settings = accelerate_view(path).fsdp_settings()
    assert settings[attribute] == applied  # accelerate's own reading of the file
    report, _ = check_file(path, context=CheckContext(model=facts(LLAMA_8B), method="full"))
    assert not report.rules() & {"invalid-value", "accelerate-rejects", "yaml-read-as-boolean"}, report.to_json()
    if attribute == "sharding_strategy":
        # the memory rules plan the strategy accelerate applies: no silent skip for an integer
        from fsdp_presets.check.rules_memory import _planner_strategy
        from fsdp_presets.preset.accelerate_view import canonical_fsdp

        strategy, _ = _planner_strategy(canonical_fsdp(config["fsdp_config"]), {}, 1, 2, 1, CheckContext(
            model=facts(LLAMA_8B)))
        # (a hybrid strategy on one node shards like FULL_SHARD)
        assert strategy is not None and strategy[0] == {"HYBRID_SHARD": "FULL_SHARD",
                                                        "_HYBRID_SHARD_ZERO2": "FULL_SHARD"}.get(applied, applied)


@pytest.mark.parametrize("top, fsdp, rule", [
    ({"mixed_precision": False}, {}, "yaml-read-as-boolean"),
    ({"distributed_type": False}, {}, "yaml-read-as-boolean"),
    ({}, {"fsdp_sharding_strategy": 6}, "invalid-value"),
    ({}, {"fsdp_backward_prefetch": 3}, "invalid-value"),
    ({}, {"fsdp_offload_params": "maybe"}, "invalid-value"),
], ids=["mixed-precision-no", "distributed-type-no", "strategy-6", "prefetch-3", "boolean-maybe"])
def test_spellings_accelerate_refuses_are_errors(tmp_path, top, fsdp, rule):
    config = mutate(top=top, fsdp={**FSDP1, **fsdp}, drop_fsdp=("fsdp_reshard_after_forward",))(copy.deepcopy(GOOD))
    report, _ = check_file(_write(tmp_path, config))
    assert rule in {item.rule for item in report.errors}, report.to_json()
    if rule == "yaml-read-as-boolean":
        [item] = [i for i in report.findings if i.rule == rule]
        assert "YAML" in item.message and "quote it" in item.fix
        assert "accelerate-rejects" not in report.rules()  # one problem, one finding


def test_accelerate_defaults_are_one_line_unless_verbose(tmp_path, capsys):
    config = mutate(drop_fsdp=("fsdp_version", "fsdp_transformer_layer_cls_to_wrap", "fsdp_reshard_after_forward"))(
        copy.deepcopy(GOOD))
    path = _write(tmp_path, config)
    assert cli.main(["check", path, "--no-probe"]) == 0  # info never fails the check
    quiet = capsys.readouterr().out
    assert "fsdp-version-missing" in quiet and "--verbose shows them" in quiet and "info " not in quiet
    assert cli.main(["check", path, "--no-probe", "--verbose"]) == 0
    verbose = capsys.readouterr().out
    assert "info    fsdp-version-missing" in verbose and "info    wrap-classes-unset" in verbose
