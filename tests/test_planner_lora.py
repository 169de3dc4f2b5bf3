"""The planner under LoRA and QLoRA: the headline cases, and a hand calculation of the 70B QLoRA
state per GPU (docs/sharding.md, "LoRA and QLoRA") that the planner must agree with within 10%."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdp_presets.errors import UsageError
from fsdp_presets.fileio import GiB
from fsdp_presets.plan.shapes import Hardware, LoraShape, TrainingShape
from fsdp_presets.plan.lora_memory import adapter_params, base_storage_bytes
from fsdp_presets.plan.planner import plan
from fsdp_presets.model.profile import profile_model

REPO = Path(__file__).resolve().parent.parent


def _cli(*words, cwd=REPO):
    """``fsdp-presets WORDS`` in this process (torch and transformers are loaded once for the module),
    from ``cwd``; exit status, stdout and stderr as a finished subprocess would give them."""
    import contextlib
    import io
    import os
    from types import SimpleNamespace

    from fsdp_presets import cli

    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(list(words))
            except SystemExit as stop:  # argparse's own errors
                code = stop.code
    finally:
        os.chdir(here)
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


@pytest.fixture(scope="module")
def llama70b():
    return profile_model(str(REPO / "model_configs/llama-3.1-70b"))


@pytest.fixture(scope="module")
def llama8b():
    return profile_model(str(REPO / "model_configs/llama-3.1-8b"))


def _plan_json(*words):
    done = _cli("plan", *words, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_70b_qlora_fits_two_24gb_gpus_and_full_does_not():
    qlora = _plan_json("model_configs/llama-3.1-70b", "--method", "qlora", "--gpus", "2", "--gpu-memory", "24")
    fitting = [s for s in qlora["strategies"] if s["fits"]]
    assert fitting and qlora["recommended"]["label"] == "FULL_SHARD (FSDP2)"
    # the settings that make it fit are named
    assert qlora["settings_chosen"] == ["activation checkpointing", "offload"]
    assert qlora["shape"]["activation_checkpointing"] and qlora["shape"]["offload"] and qlora["method"] == "qlora"
    full = _plan_json("model_configs/llama-3.1-70b", "--method", "full", "--gpus", "2", "--gpu-memory", "24")
    assert not [s for s in full["strategies"] if s["fits"]] and full["recommended"] is None


def test_8b_lora_fits_one_24gb_gpu():
    lora = _plan_json("model_configs/llama-3.1-8b", "--method", "lora", "--gpus", "1", "--gpu-memory", "24")
    assert lora["recommended"] is not None


def test_hand_calculation_70b_qlora(llama70b):
    """Hand calculation (docs/sharding.md): Llama-3.1-70B, 80 blocks of q,k,v,o (8192 wide, 1024 for
    k,v) and gate,up,down (28672); r 16 on all seven."""
    h, kv, i, layers, r = 8192, 1024, 28672, 80, 16
    linears = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]
    adapters = layers * sum(r * (a + b) for a, b in linears)
    quantized = layers * sum(a * b for a, b in linears)
    other = llama70b.total_params - quantized  # embeddings, head, norms: bf16
    base = quantized * (0.5 + 0.5 / 8) + other * 2  # nf4 + fp32 absmax per 64 weights
    per_gpu_state = base / 2 + adapters * 16 / 2  # fp32 adapter + grads + AdamW, sharded over 2
    shape = TrainingShape(seq_len=2048, lora=LoraShape(method="qlora"), activation_checkpointing=True)
    assert adapter_params(llama70b, shape) == adapters
    assert abs(base_storage_bytes(llama70b, shape) - base) / base < 0.01
    row = plan(llama70b, Hardware(gpus=2, gpu_memory_bytes=24 * GiB), shape).get("FULL_SHARD", 2)
    assert abs(row.model_state.total - per_gpu_state) / per_gpu_state < 0.10
    # frozen weights carry no gradients or optimizer state
    assert row.model_state.grads == -(-adapters // 2) * 4
    # activations with checkpointing: 2 bytes x s x h per block + logits 12 x s x vocab + outside
    activations = layers * 2 * 2048 * h + 12 * 2048 * 128256 + 8.13 * 2048 * h
    from fsdp_presets.plan.lora_memory import lora_activation_bytes

    assert abs(lora_activation_bytes(llama70b, shape, 1) - activations) / activations < 0.10


def test_lora_is_far_below_full(llama70b):
    hardware = Hardware(gpus=8, gpu_memory_bytes=80 * GiB)
    full = plan(llama70b, hardware, TrainingShape(seq_len=2048)).get("FULL_SHARD", 2)
    lora = plan(llama70b, hardware, TrainingShape(seq_len=2048, lora=LoraShape())).get("FULL_SHARD", 2)
    qlora = plan(llama70b, hardware, TrainingShape(seq_len=2048, lora=LoraShape(method="qlora"))).get("FULL_SHARD", 2)
    assert qlora.model_state.params < lora.model_state.params < full.model_state.params / 1.9
    assert lora.model_state.optimizer < full.model_state.optimizer / 100
    assert lora.comm.reduce_scatter < full.comm.reduce_scatter / 100  # only the adapters' gradients


def test_target_modules_and_bad_values(llama70b):
    shape = TrainingShape(lora=LoraShape(target_modules=("q_proj", "v_proj")))
    assert adapter_params(llama70b, shape) == 80 * 16 * ((8192 + 8192) + (8192 + 1024))
    everything = TrainingShape(lora=LoraShape(target_modules=("all-linear",)))
    assert adapter_params(llama70b, everything) == adapter_params(llama70b, TrainingShape(lora=LoraShape()))
    with pytest.raises(UsageError, match="--lora-r"):
        LoraShape(r=0)
    with pytest.raises(UsageError, match="--lora-dropout"):
        LoraShape(dropout=1.5)


def test_plan_refuses_unknown_target_and_lora_flags_without_method():
    bad = _cli("plan", "model_configs/llama-3.1-8b", "--gpus", "1", "--gpu-memory", "24", "--method", "lora",
               "--lora-target-modules", "qproj")
    assert bad.returncode == 2 and "qproj" in bad.stderr and "q_proj" in bad.stderr
    bad = _cli("plan", "model_configs/llama-3.1-8b", "--gpus", "1", "--gpu-memory", "24", "--lora-r", "8")
    assert bad.returncode == 2 and "--method lora" in bad.stderr


def _generate(tmp_path, *words):
    return _cli("generate", str(REPO / "model_configs/llama-3.1-8b"), *words, cwd=tmp_path)


def test_generate_qlora_records_what_accelerate_yaml_cannot(tmp_path):
    import yaml

    from fsdp_presets.preset.emit import read_metadata
    from fsdp_presets.check.findings import CheckContext
    from fsdp_presets.check.lint import check_file

    done = _generate(tmp_path, "--gpus", "2", "--gpu-memory", "24", "--method", "qlora", "--lora-r", "8",
                     "--lora-target-modules", "q_proj,v_proj", "--baseline", "ddp", "-o", "q.yaml")
    assert done.returncode == 0, done.stderr
    launch = "--method qlora --lora-r 8 --lora-alpha 16 --lora-target-modules q_proj,v_proj"
    assert launch in done.stdout
    for name in ("q.yaml", "q.ddp.yaml"):
        text = (tmp_path / name).read_text()
        # the header's launch line, its words joined again wherever it was wrapped (" \" ends a wrapped line)
        words = " ".join(word for word in text.replace("#", " ").split() if word != "\\")
        assert "--method qlora" in words and "bnb_4bit_quant_storage bfloat16" in text and "method: qlora" in text
        request = read_metadata(text)["request"]
        assert (request["method"], request["lora_r"], request["lora_target_modules"]) == ("qlora", 8, "q_proj,v_proj")
    config = yaml.safe_load((tmp_path / "q.yaml").read_text())
    assert config["fsdp_config"]["fsdp_version"] == 2
    assert config["fsdp_config"]["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert config["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"
    # check reads the method from the header and plans the adapter (no full-fine-tuning warning)
    report, _ = check_file(tmp_path / "q.yaml", context=CheckContext(), prove_wrapping=False)
    assert report.ok and "memory-assumes-full-finetune" not in report.rules()


def test_generate_lora_fsdp1_keeps_original_parameters(tmp_path):
    import yaml

    done = _generate(tmp_path, "--gpus", "2", "--method", "lora", "--fsdp-version", "1", "-o", "l.yaml")
    assert done.returncode == 0, done.stderr
    config = yaml.safe_load((tmp_path / "l.yaml").read_text())
    assert config["fsdp_config"]["fsdp_use_orig_params"] is True
    assert "fsdp_auto_wrap_policy on the plugin" in (tmp_path / "l.yaml").read_text()


def test_generate_full_header_has_no_method_fields(tmp_path):
    from fsdp_presets.preset.emit import read_metadata

    assert _generate(tmp_path, "--gpus", "2", "-o", "f.yaml").returncode == 0
    request = read_metadata((tmp_path / "f.yaml").read_text())["request"]
    assert not {"method", "lora_r"} & set(request)


@pytest.mark.parametrize("value", ["q_proj;touch x", "q_proj\nnum_processes: 9", "$(id)", ""])
def test_generate_refuses_hostile_target_names(tmp_path, value):
    done = _generate(tmp_path, "--gpus", "2", "--method", "lora", "--lora-target-modules", value, "-o", "x.yaml")
    assert done.returncode == 2 and "--lora-target-modules" in done.stderr
    assert not (tmp_path / "x.yaml").exists()


def test_rehearse_refuses_lora_with_one_message(tmp_path):
    done = _cli("rehearse", "model_configs/llama-3.1-8b", "--gpus", "2", "--method", "lora")
    assert done.returncode == 2 and "only full fine-tuning is rehearsed" in done.stderr


def test_the_sharding_guide_table_is_the_planners(llama8b, llama70b):
    import re

    from fsdp_presets.plan.planner import plan_with_auto_savers

    text = (REPO / "docs" / "sharding.md").read_text()
    rows = re.findall(r"^\| (llama-[\w.-]+) \| (q?lora) \| (\d+) x (\d+) \| ([^|]+) \| ([^|]+) \| ([^|]+) \|$", text,
                      flags=re.M)
    assert len(rows) == 24
    profiles = {"llama-3.1-8b": llama8b, "llama-3.1-70b": llama70b}
    for model, method, gpus, memory, label, total, savers in rows:
        profile = profiles.setdefault(model, profile_model(str(REPO / "model_configs" / model)))
        memory_plan, chosen = plan_with_auto_savers(
            profile, Hardware(gpus=int(gpus), gpu_memory_bytes=int(memory) * GiB),
            TrainingShape(seq_len=2048, lora=LoraShape(method=method)), checkpointing="auto", offload="auto")
        best = memory_plan.recommended
        assert best is not None and best.label == label.strip(), (model, method, gpus, memory)
        assert f"{best.per_gpu.total / GiB:.1f}" == total.strip()
        assert (", ".join(chosen) or "-") == savers.strip()


def test_generate_refuses_qlora_under_fsdp1(tmp_path):
    done = _generate(tmp_path, "--gpus", "2", "--method", "qlora", "--fsdp-version", "1", "-o", "q1.yaml")
    assert done.returncode == 2 and "--method qlora needs FSDP2" in done.stderr
    assert not (tmp_path / "q1.yaml").exists()


def test_quantization_constants_are_in_the_peak_at_the_loss_too(llama8b):
    """Llama-3.1-8B's 128k-token logits put the peak at the loss, not inside a block; the replicated
    quantization constants are on the GPU then as well: the peak moves by exactly what double
    quantization saves on them (0.5 against 0.127 bits per quantized parameter)."""
    from fsdp_presets.plan.lora_memory import quant_constant_bytes

    profile = llama8b
    peaks = {}
    for double in (False, True):
        lora = LoraShape(method="qlora", r=8, target_modules=("all-linear",), double_quant=double)
        shape = TrainingShape(seq_len=4096, micro_batch=2, precision="bf16", activation_checkpointing=True, lora=lora)
        row = plan(profile, Hardware(gpus=2, gpu_memory_bytes=24 * GiB), shape).get("FULL_SHARD", 2)
        peaks[double] = (row.per_gpu.total, quant_constant_bytes(profile, lora))
    assert peaks[False][0] - peaks[True][0] == peaks[False][1] - peaks[True][1] > 0.3 * GiB, peaks
