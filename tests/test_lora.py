"""LoRA and QLoRA through the causal LM recipe on 2 real gloo processes, tiny Qwen2 (not Llama).

Launched once per module and shared by the tests:

- LoRA (r 8, the block's attention and MLP projections) under DDP, FSDP2 and FSDP1, 16 steps
  each: per-step losses equal within 1e-6 relative. FSDP2 keeps TRANSFORMER_BASED_WRAP on the
  decoder layer; FSDP1 runs with use_orig_params and peft's wrap policy set by the recipe.
- An FSDP2 LoRA run SIGKILLed (rank 0) while saving step 12, then resumed with ``--resume auto``
  from step 8 on 1 process (another world size), which must reproduce the uninterrupted losses.
- The FSDP2 run's exports: the PEFT folder in final/ (``PeftModel.from_pretrained``) and the merged
  folder (plain transformers), checked against the trained adapter read back from the checkpoint.
- QLoRA (``--method qlora``, bitsandbytes nf4 stored as bf16) under DDP and under FSDP2, the FSDP2
  run killed while saving step 12 and resumed: loss falls, each rank holds half the 4-bit base,
  and the resumed run matches QLoRA under DDP.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from fsdp_harness.launch import run_launch

from conftest import GLOO_EXIT_ABORT, accelerate_config, real_launches
from recipe_helpers import CAUSAL_LM, REPO, SFT_TRAIN, causal_lm_args

# Looked up, not imported: importing peft at collection costs every test run (slow tests deselected
# or not) over a second of CPU.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None,
                                reason="peft (the lora extra) is not installed")

STEPS = 16
LOSS_TOLERANCE = 1e-6  # relative, fp32 round-off (compare's fp32 tolerance)
LORA = ("--lora-r", "8", "--lora-dropout", "0.0", "--lr-scheduler", "constant_with_warmup", "--save-every", "4",
        "--keep-last", "10", "--max-steps", STEPS)
KILL_WHILE_SAVING_STEP_12 = {"FSDP_PRESETS_FAULT": "kill-save:step=12"}


def _launch(config: Path, args: list, *, processes: int = 2, env: dict | None = None, ok: bool = True):
    result = run_launch(config, CAUSAL_LM, [str(arg) for arg in args], num_processes=processes, cwd=REPO, env=env)
    if ok:
        result.check()
        assert GLOO_EXIT_ABORT not in result.stderr
    return result


def _cli(capsys, *args) -> tuple[int, str, str]:
    """``fsdp-presets ARGS`` in this process (torch, transformers and peft are imported once per
    test run): (exit status, stdout, stderr)."""
    from fsdp_presets import cli

    capsys.readouterr()
    code = cli.main([str(arg) for arg in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _losses(run_dir: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {line["step"]: line["loss"] for line in lines if line["kind"] == "train"}


def _assert_close(expected: dict[int, float], got: dict[int, float], steps) -> None:
    for step in steps:
        assert abs(got[step] - expected[step]) <= LOSS_TOLERANCE * abs(expected[step]), (step, expected[step], got[step])


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    from fsdp_harness.tiny_model import write_tiny_model

    folder = tmp_path_factory.mktemp("lora")
    write_tiny_model(folder / "tiny-qwen2", kind="qwen2", text=SFT_TRAIN.read_text(), max_positions=128)
    return folder


def _configs(root: Path) -> dict[str, Path]:
    layer = {"transformer_layer_cls_to_wrap": "Qwen2DecoderLayer"}
    return {"ddp": accelerate_config(root, "ddp", distributed_type="MULTI_GPU"),
            "fsdp2": accelerate_config(root, "fsdp2", fsdp=layer),
            "fsdp1": accelerate_config(root, "fsdp1", fsdp={"version": 1, "use_orig_params": True, **layer})}


@pytest.fixture(scope="module")
def lora_runs(root) -> dict[str, Path]:
    model, configs = root / "tiny-qwen2", _configs(root)
    runs = {}
    for name in ("ddp", "fsdp2", "fsdp1"):
        runs[name] = root / f"lora-{name}"
        extra = ("--export-merged",) if name == "fsdp2" else ()
        # LoRA under FSDP2 == LoRA under DDP, launched as users launch them; FSDP1 and the DDP
        # baseline forked: their numbers do not depend on how they started (tests/test_forked_launch.py)
        with real_launches() if name == "fsdp2" else contextlib.nullcontext():
            _launch(configs[name], causal_lm_args(model, runs[name], *LORA, *extra))
    return runs


@pytest.mark.slow
def test_lora_fsdp2_and_fsdp1_equal_lora_ddp_step_by_step(lora_runs):
    ddp = _losses(lora_runs["ddp"])
    assert sorted(ddp) == list(range(1, STEPS + 1))
    assert ddp[STEPS] < ddp[1] - 0.2  # it learned
    for name in ("fsdp2", "fsdp1"):
        _assert_close(ddp, _losses(lora_runs[name]), range(1, STEPS + 1))


@pytest.mark.slow
def test_compare_reads_lora_runs_unchanged(lora_runs, tmp_path, capsys):
    for name in ("fsdp2", "fsdp1"):
        code, out, err = _cli(capsys, "compare", lora_runs["ddp"], lora_runs[name], "--report", tmp_path / f"{name}.md")
        assert code == 0, out + err
        assert out.startswith(("IDENTICAL", "AGREE within tolerance")), out


@pytest.mark.slow
def test_lora_run_records_method_and_saves_only_the_adapter(lora_runs):
    from fsdp_presets.checkpoint.manifest import Manifest
    from fsdp_presets.checkpoint.verify import verify_checkpoint
    from fsdp_presets.checkpoint.files import DcpReader

    for name, run_dir in lora_runs.items():
        record = json.loads((run_dir / "run.json").read_text())
        assert record["training"]["method"] == "lora" and record["training"]["r"] == 8
        assert record["training"]["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"]
        checkpoint = run_dir / "checkpoints" / f"step-{STEPS:08d}"
        manifest, problem = verify_checkpoint(checkpoint)
        assert problem is None and Manifest.read(checkpoint).training["method"] == "lora"
        assert (manifest.kind, manifest.format) == ("adapter", 2)  # a trainable-only checkpoint says so
        assert (checkpoint / "adapter_model_0").is_dir() and not (checkpoint / "pytorch_model_fsdp_0").exists()
        saved = DcpReader(checkpoint / "adapter_model_0").entries()  # the frozen base is not in it
        assert len(saved) == 2 * 7 * 2 and all(".lora_A." in name or ".lora_B." in name for name in saved), saved
        weights = sum(entry["bytes"] for path, entry in manifest.files.items() if path.startswith("adapter_model_0"))
        base = (run_dir.parent / "tiny-qwen2" / "model.safetensors").stat().st_size
        assert weights < base / 3, (weights, base)  # 64 KiB of adapter + DCP's per-tensor metadata (FSDP1: more)
    fsdp2 = json.loads((lora_runs["fsdp2"] / "run.json").read_text())
    # FSDP1 with peft's wrap policy: each rank holds half the adapter, not all of it on rank 0
    fsdp1 = json.loads((lora_runs["fsdp1"] / "run.json").read_text())
    for record in (fsdp2, fsdp1):
        trainable = record["trainable_bytes_per_rank"]
        assert len(trainable) == 2 and abs(trainable[0] - trainable[1]) <= 0.1 * max(trainable), trainable


@pytest.mark.slow
def test_lora_under_bf16_keeps_the_frozen_base_in_bf16(root, lora_runs):
    """The planner counts a frozen base at 2 bytes per parameter under bf16 mixed precision: the
    recipe must hold it so (accelerate's FSDP2 preparation upcasts only trained weights)."""
    config = accelerate_config(root, "fsdp2-bf16", fsdp={"transformer_layer_cls_to_wrap": "Qwen2DecoderLayer"},
                               mixed_precision="bf16")
    run_dir = root / "lora-fsdp2-bf16"
    _launch(config, causal_lm_args(root / "tiny-qwen2", run_dir, "--lora-r", "8", "--max-steps", "4",
                                   "--save-every", "4"))
    fp32 = json.loads((lora_runs["fsdp2"] / "run.json").read_text())
    bf16 = json.loads((run_dir / "run.json").read_text())
    assert bf16["frozen_bytes_per_rank"] == [held // 2 for held in fp32["frozen_bytes_per_rank"]]
    assert bf16["trainable_bytes_per_rank"] == fp32["trainable_bytes_per_rank"]  # adapters stay fp32
    losses = _losses(run_dir)
    assert sorted(losses) == [1, 2, 3, 4] and all(loss == loss and loss < 20 for loss in losses.values())


def _checkpoint_adapter(checkpoint: Path) -> dict:
    """The trained adapter read back from a checkpoint (safe DCP reader), under PEFT key names."""
    from fsdp_presets.checkpoint.files import DcpReader

    keys = json.loads((checkpoint / "model_config" / "adapter_keys.json").read_text())["keys"]
    reader = DcpReader(checkpoint / "adapter_model_0")
    return {keys[name]: tensor for name, tensor in reader.read(sorted(reader.entries())).items()}


def _batch():
    import torch

    generator = torch.Generator().manual_seed(0)
    return torch.randint(4, 300, (2, 24), generator=generator)


@pytest.mark.slow
def test_exported_adapter_and_merged_model_give_the_trained_logits(lora_runs, root):
    import torch
    from peft import PeftModel, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    run_dir, base_dir = lora_runs["fsdp2"], root / "tiny-qwen2"
    trained = _checkpoint_adapter(run_dir / "checkpoints" / f"step-{STEPS:08d}")
    assert any("lora_B" in key and tensor.abs().max() > 0 for key, tensor in trained.items())  # B starts at 0
    batch = _batch()
    with torch.no_grad():
        base_logits = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)(batch).logits
        exported = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                             run_dir / "final").eval()
        exported_logits = exported(batch).logits
        reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                              run_dir / "final").eval()
        set_peft_model_state_dict(reference, trained)  # the weights the run had at its last step
        reference_logits = reference(batch).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(run_dir / "merged", dtype=torch.float32)(batch).logits
    scale = reference_logits.abs().max()
    assert (exported_logits - reference_logits).abs().max() <= 1e-5 * scale
    assert (merged_logits - reference_logits).abs().max() <= 1e-5 * scale
    assert (base_logits - reference_logits).abs().max() > 1e-3 * scale  # the adapter changed the model
    config = json.loads((run_dir / "merged" / "config.json").read_text())
    assert "quantization_config" not in config


@pytest.mark.slow
def test_export_command_writes_a_peft_folder_from_a_lora_checkpoint(lora_runs, tmp_path, capsys):
    """The FSDP1 run's checkpoint: peft would have written zeros from the wrapped FSDP1 model."""
    import torch
    from safetensors.torch import load_file

    from test_untrusted_checkpoints import plant_code_references

    checkpoint = tmp_path / "step"  # with an attacker's tokenizer code and auto_map in model_config/
    shutil.copytree(lora_runs["fsdp1"] / "checkpoints" / f"step-{STEPS:08d}", checkpoint)
    plant_code_references(checkpoint)
    output = tmp_path / "adapter"
    code, out, err = _cli(capsys, "export", checkpoint, "--output", output)
    assert code == 0, err
    assert not list(output.glob("*.py")) and "dropped auto_map from tokenizer_config.json" in out
    assert "auto_map" not in json.loads((output / "tokenizer_config.json").read_text())
    written = load_file(output / "adapter_model.safetensors")
    final = load_file(lora_runs["fsdp1"] / "final" / "adapter_model.safetensors")
    assert sorted(written) == sorted(final) and written
    for key in final:
        assert torch.equal(written[key], final[key]), key
    assert any(tensor.abs().max() > 0 for key, tensor in final.items() if "lora_B" in key)
    assert json.loads((output / "adapter_config.json").read_text())["r"] == 8


@pytest.fixture(scope="module")
def lora_killed_and_resumed(root, lora_runs) -> Path:
    """FSDP2 on 2 processes, rank 0 SIGKILLed while saving step 12; resumed on 1 process."""
    model, configs = root / "tiny-qwen2", _configs(root)
    run_dir = root / "lora-killed"
    killed = _launch(configs["fsdp2"], causal_lm_args(model, run_dir, *LORA), env=KILL_WHILE_SAVING_STEP_12, ok=False)
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr, killed.stderr[-2000:]
    assert sorted(path.name for path in (run_dir / "checkpoints").glob("step-*")) == ["step-00000004", "step-00000008"]
    # One process: gradient accumulation doubles to keep the global batch (see fsdp_presets.checkpoint.resume).
    _launch(configs["fsdp2"], causal_lm_args(model, run_dir, *LORA, "--resume", "auto"), processes=1)
    return run_dir


@pytest.mark.slow
def test_lora_resumes_after_sigkill_at_another_world_size(lora_runs, lora_killed_and_resumed):
    reference = _losses(lora_runs["fsdp2"])
    resumed = _losses(lora_killed_and_resumed)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    _assert_close(reference, resumed, range(1, STEPS + 1))
    record = json.loads((lora_killed_and_resumed / "run.json").read_text())
    assert record["resumed_from"].endswith("step-00000008")


@pytest.mark.slow
def test_a_lora_checkpoint_is_refused_by_a_full_fine_tuning_run(lora_runs, root, tmp_path):
    checkpoint = lora_runs["fsdp2"] / "checkpoints" / "step-00000008"
    # One process: the refusal comes before any training (a second rank costs 5 s of CPU and shows nothing more).
    result = _launch(_configs(root)["fsdp2"], causal_lm_args(root / "tiny-qwen2", tmp_path / "full", "--max-steps", 16,
                                                             "--resume", checkpoint), processes=1, ok=False)
    assert result.returncode != 0 and "exitcode: 2" in result.stderr  # the recipe's usage error, one line:
    assert "causal_lm.py: error: --resume" in result.stderr and "it is a LoRA checkpoint" in result.stderr
    assert not (tmp_path / "full" / "checkpoints").exists()


# ---- QLoRA ----
QLORA = ("--method", "qlora", *LORA)


@pytest.fixture(scope="module")
def qlora_runs(root) -> dict[str, Path]:
    pytest.importorskip("bitsandbytes")
    model, configs = root / "tiny-qwen2", _configs(root)
    runs = {"ddp": root / "qlora-ddp", "fsdp2": root / "qlora-fsdp2"}
    _launch(configs["ddp"], causal_lm_args(model, runs["ddp"], *QLORA))
    killed = _launch(configs["fsdp2"], causal_lm_args(model, runs["fsdp2"], *QLORA, "--export-merged"),
                     env=KILL_WHILE_SAVING_STEP_12, ok=False)
    assert killed.returncode != 0
    assert sorted(path.name for path in (runs["fsdp2"] / "checkpoints").glob("step-*")) == ["step-00000004",
                                                                                         "step-00000008"]
    _launch(configs["fsdp2"], causal_lm_args(model, runs["fsdp2"], *QLORA, "--export-merged", "--resume", "auto"))
    return runs


@pytest.mark.slow
def test_qlora_fsdp2_trains_resumes_after_a_kill_and_matches_qlora_ddp(qlora_runs):
    ddp, fsdp2 = _losses(qlora_runs["ddp"]), _losses(qlora_runs["fsdp2"])
    assert sorted(fsdp2) == list(range(1, STEPS + 1))
    assert fsdp2[STEPS] < fsdp2[1] - 0.2  # loss falls
    _assert_close(ddp, fsdp2, range(1, STEPS + 1))
    record = json.loads((qlora_runs["fsdp2"] / "run.json").read_text())
    assert record["resumed_from"].endswith("step-00000008")
    assert record["training"]["method"] == "qlora"
    assert record["training"]["quantization"]["quant_storage"] == "bfloat16"


@pytest.mark.slow
def test_qlora_fsdp2_each_rank_holds_half_of_the_4bit_base(qlora_runs):
    ddp = json.loads((qlora_runs["ddp"] / "run.json").read_text())["quantized_bytes_per_rank"]
    fsdp2 = json.loads((qlora_runs["fsdp2"] / "run.json").read_text())["quantized_bytes_per_rank"]
    whole = ddp[0]
    assert whole > 0 and ddp[1] == whole  # DDP: every rank holds the whole 4-bit base
    for held in fsdp2:
        assert abs(held - whole / 2) <= 0.05 * whole, (fsdp2, whole)


@pytest.mark.slow
def test_qlora_exports_adapter_and_merges_into_the_dequantized_base(qlora_runs, root):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fsdp_presets.train.lora import keep_4bit_layout, quantization_config

    run_dir = qlora_runs["fsdp2"]
    batch = _batch()
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(root / "tiny-qwen2", dtype=torch.float32,
                                                    quantization_config=quantization_config())
        keep_4bit_layout(base)
        adapted = PeftModel.from_pretrained(base, run_dir / "final").eval()
        reference = adapted(batch).logits
        merged = AutoModelForCausalLM.from_pretrained(run_dir / "merged", dtype=torch.float32)(batch).logits
    assert "quantization_config" not in json.loads((run_dir / "merged" / "config.json").read_text())
    # the dequantized base computes what the 4-bit layers compute, up to their fp32 rounding
    assert (merged - reference).abs().max() <= 1e-4 * reference.abs().max()


# ---- the classification recipe ----
@pytest.mark.slow
def test_classification_recipe_trains_a_lora_adapter_and_its_head(tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    from recipe_helpers import CLASSIFICATION, GENRES_EVAL, GENRES_TRAIN, tiny_bert

    model = tiny_bert(tmp_path / "tiny-bert")
    config = accelerate_config(tmp_path, "fsdp2-bert", fsdp={"transformer_layer_cls_to_wrap": "BertLayer"})
    run_dir = tmp_path / "cls"
    args = ["--model", model, "--data", GENRES_TRAIN, "--eval-data", GENRES_EVAL, "--max-eval-samples", 16,
            "--output-dir", run_dir, "--seq-len", 32, "--max-steps", 6, "--learning-rate", 3e-3, "--lora-r", 4]
    result = run_launch(config, CLASSIFICATION, [str(arg) for arg in args], num_processes=2, cwd=REPO).check()
    assert GLOO_EXIT_ABORT not in result.stderr
    record = json.loads((run_dir / "run.json").read_text())
    assert record["training"]["target_modules"] == ["query", "key", "value", "dense"]
    adapter = json.loads((run_dir / "final" / "adapter_config.json").read_text())
    assert adapter["task_type"] == "SEQ_CLS" and adapter["r"] == 4
    with torch.no_grad():
        base = AutoModelForSequenceClassification.from_pretrained(model, num_labels=4)
        loaded = PeftModel.from_pretrained(base, run_dir / "final").eval()
        head = loaded.base_model.model.classifier.modules_to_save["default"].weight
        original = AutoModelForSequenceClassification.from_pretrained(model, num_labels=4).classifier.weight
    assert not torch.equal(head, original)  # the head trained and was exported with the adapter


@pytest.mark.slow
def test_qlora_under_fsdp1_is_refused_in_one_line(root, tmp_path):
    pytest.importorskip("bitsandbytes")
    result = _launch(_configs(root)["fsdp1"], causal_lm_args(root / "tiny-qwen2", tmp_path / "q1", "--max-steps", 2,
                                                             "--method", "qlora"), ok=False)
    assert result.returncode != 0 and "exitcode: 2" in result.stderr
    assert "causal_lm.py: error: --method qlora needs FSDP2" in result.stderr
    assert not (tmp_path / "q1" / "checkpoints").exists()


def test_lora_on_a_mixture_of_experts_says_the_experts_stay_frozen(tmp_path, capsys):
    """transformers 5 fuses a Mixtral's experts into 3-D tensors, which no Linear target name reaches:
    the default targets are the attention projections, and the run says what stays frozen."""
    from transformers import AutoModelForCausalLM

    from fsdp_harness.tiny_model import write_tiny_model
    from fsdp_presets.train.lora import default_targets, wrap

    folder = write_tiny_model(tmp_path / "moe", kind="mixtral", text=SFT_TRAIN.read_text())
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert default_targets(model) == ["q_proj", "k_proj", "v_proj", "o_proj"]
    lora = {"method": "lora", "r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": None}
    wrap(model, lora, task_type="CAUSAL_LM")
    said = capsys.readouterr().out
    assert "LoRA adapts the block's Linear layers (q_proj, k_proj, v_proj, o_proj); mlp.experts (MixtralExperts: " in said
    assert "mlp.gate (MixtralTopKRouter: " in said and "stay frozen" in said
    dense = AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path / "dense", kind="llama",
                                                                  text=SFT_TRAIN.read_text()))
    wrap(dense, {**lora, "target_modules": None}, task_type="CAUSAL_LM")
    assert "stay frozen" not in capsys.readouterr().out  # every weight of a dense block is in a Linear layer
