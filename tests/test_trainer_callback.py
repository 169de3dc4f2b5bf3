"""FSDPPresetsCallback on users' own Trainer and TRL scripts (tests/workers/trainer_user.py,
tests/workers/sft_lora_user.py), launched with ``accelerate launch`` (real or forked, below) under
presets made by ``fsdp-presets generate --device cpu --gpus 2 --baseline ddp``: FSDP2, FSDP1 and the
DDP baseline train alike, ``save_model`` writes a loadable folder (a PEFT adapter for SFT + LoRA, under
FSDP1 too) whose logits equal DDP's, ``compare`` reads the runs with and without the callback and
catches a planted learning-rate change, every ``checkpoint-N`` verifies, ``export`` needs only a
config, a resume on another process count keeps the global batch, SIGTERM at the launcher commits the
step reached (exit 75 on the ranks) and Trainer's own resume continues from it, a rank SIGKILLed in the
middle of a save (Trainer) or of a run (SFT + LoRA) resumes exactly from the newest committed
checkpoint, a checkpoint saved in the background (``async_save=True``) equals the synchronous one of
its step and resumes exactly, Ctrl-C during a background save (with ``save_total_limit``) commits it
and exits 130, Ctrl-C at the terminal commits the step reached, exits 130 and Trainer's resume
continues from it, QLoRA (bitsandbytes 4-bit on the CPU) trains like its DDP baseline, bit for bit, and
saves its adapter under FSDP2, and a launch that is not what the preset's header planned, for another
model, is refused.

The launches are shared by the tests (module-scoped fixtures), 6 real and 14 forked. Real launches
for each proof a user makes once: the FSDP2 Trainer run (== DDP, the saved model), the FSDP2 SFT +
LoRA run (== DDP, the adapter), the signals a real torchrun agent forwards (SIGTERM at the launcher
during a background save, Ctrl-C at the launcher during a background save, Ctrl-C at the whole
launch), and the last launch of the resume chain (Trainer's resume on two processes, saving in the
background, bit for bit the uninterrupted FSDP2 run). The chain's other launch (Trainer's resume on
one process, which keeps the global batch, SIGKILLed by a planted fault in the save of step 6), the
FSDP1 Trainer run, FSDP1 + LoRA and QLoRA, SFT + LoRA killed at step 5 and resumed, the DDP
baselines, the refused resume, the refused launches, a signal to one rank, the resume after Ctrl-C,
a run saving in the background at every step and recipes/sft_trainer.py are forked
(tests/conftest.py): the same scripts, accelerate and torchrun, a few times cheaper.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from fsdp_harness.launch import launch_command, launch_env, run_launch
from fsdp_presets.checkpoint.layout import (MANIFEST, METRICS, RUN_JSON, TRAINER_ARGS_JSON, TRAINER_ARGS_PICKLE,
                                            trainer_checkpoint_name)
from fsdp_presets.checkpoint.verify import checkpoint_verdict
from fsdp_presets.cli import main as cli_main
from fsdp_presets.faults import FAULT_ENV
from fsdp_presets.train.metrics import read_metrics
from fsdp_presets.train.signals import PREEMPTED_EXIT
from recipe_helpers import REPO, SFT_TRAIN, SFT_TRAINER, causal_lm_args, tiny_llama, tree_digest

from conftest import GLOO_EXIT_ABORT

TRAINER_SCRIPT = REPO / "tests" / "workers" / "trainer_user.py"
SFT_SCRIPT = REPO / "tests" / "workers" / "sft_lora_user.py"
HAS_TRL = importlib.util.find_spec("trl") is not None
HAS_BITSANDBYTES = importlib.util.find_spec("bitsandbytes") is not None

pytestmark = pytest.mark.slow


def _args(model: Path, output: Path, *extra) -> list[str]:
    return ["--model", str(model), "--data", str(SFT_TRAIN), "--output-dir", str(output), *map(str, extra)]


def _launch(config: Path, script: Path, model: Path, output: Path, *extra, processes: int | None = None,
            check: bool = True, forked: bool | None = False, env: dict[str, str] | None = None):
    """A launch of ``script``; real unless ``forked`` is None (the suite's default: forked)."""
    result = run_launch(config, script, _args(model, output, *extra), num_processes=processes, cwd=REPO,
                        forked=forked, env=env)
    if check:
        result.check()
        assert GLOO_EXIT_ABORT not in result.stderr
    return result


@pytest.fixture(scope="module")
def presets(tmp_path_factory) -> dict[str, Path]:
    """The tiny model and the three presets, as a user makes them."""
    root = tmp_path_factory.mktemp("trainer_presets")
    model = tiny_llama(root / "model")
    assert cli_main(["generate", str(model), "--device", "cpu", "--gpus", "2", "--baseline", "ddp", "--precision",
                     "fp32", "-o", str(root / "fsdp2.yaml")]) == 0
    assert cli_main(["generate", str(model), "--device", "cpu", "--gpus", "2", "--fsdp-version", "1", "--precision",
                     "fp32", "-o", str(root / "fsdp1.yaml")]) == 0
    assert cli_main(["generate", str(model), "--device", "cpu", "--gpus", "2", "--fsdp-version", "1", "--method", "lora",
                     "--precision", "fp32", "-o", str(root / "fsdp1-lora.yaml")]) == 0
    assert cli_main(["generate", str(model), "--device", "cpu", "--gpus", "2", "--method", "qlora", "--precision", "fp32",
                     "--baseline", "ddp", "-o", str(root / "fsdp2-qlora.yaml")]) == 0
    # A preset for one process of another model (Qwen2: it wraps Qwen2DecoderLayer), for the refused launch.
    assert cli_main(["generate", "qwen2", "--device", "cpu", "--gpus", "1", "--precision", "fp32", "-o",
                     str(root / "qwen2-1.yaml")]) == 0
    return {"model": model, "fsdp2": root / "fsdp2.yaml", "ddp": root / "fsdp2.ddp.yaml", "fsdp1": root / "fsdp1.yaml",
            "fsdp1-lora": root / "fsdp1-lora.yaml", "qlora": root / "fsdp2-qlora.yaml",
            "qlora-ddp": root / "fsdp2-qlora.ddp.yaml", "qwen2-1": root / "qwen2-1.yaml"}


@pytest.fixture(scope="module")
def trainer_runs(presets, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("trainer_runs")
    runs = {}
    for name in ("ddp", "fsdp2", "fsdp1"):
        runs[name] = root / name  # FSDP2 launched for real: the proof a user makes; FSDP1 and DDP forked
        result = _launch(presets[name], TRAINER_SCRIPT, presets["model"], runs[name],
                         forked=False if name == "fsdp2" else None)
        if name != "ddp":
            assert "gathering the full state dict to rank 0 with CPU offload" in result.stdout
        # the recipes' last line: tokens/s per process (a CPU preset predicts none: measured only)
        assert re.search(r"^fsdp-presets: throughput: [\d,]+ tokens/s per process measured \(median after step 1\)$",
                         result.stdout, re.MULTILINE), result.stdout[-2000:]
    return runs


def _cli(capsys, *args: str) -> tuple[int, str]:
    """``fsdp-presets ARGS`` in this process: (exit status, what it printed)."""
    capsys.readouterr()
    code = cli_main(list(args))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _logits(folder: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.arange(1, 17).reshape(2, 8)).logits


def _adapter_logits(base: Path, folder: Path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), folder).eval()
    with torch.no_grad():
        return model(torch.arange(1, 17).reshape(2, 8)).logits


def _train_losses(records: list[dict]) -> dict[int, float]:
    return {record["step"]: record["loss"] for record in records if record["kind"] == "train"}


def _losses(run: Path) -> dict[int, float]:
    return _train_losses(read_metrics(run / METRICS))


def _grad_norms(run: Path) -> dict[int, float]:
    return {record["step"]: record["grad_norm"] for record in read_metrics(run / METRICS) if record["kind"] == "train"}


@pytest.mark.parametrize("name", ["fsdp2", "fsdp1"])
def test_trainer_losses_and_saved_model_equal_ddp(trainer_runs, name):
    import torch

    ddp, run = _losses(trainer_runs["ddp"]), _losses(trainer_runs[name])
    assert sorted(run) == list(range(1, 7)) and sorted(ddp) == sorted(run)
    assert run == ddp and _grad_norms(trainer_runs[name]) == _grad_norms(trainer_runs["ddp"])  # bit for bit
    assert ddp[6] < ddp[1]  # it learned
    record = json.loads((trainer_runs[name] / RUN_JSON).read_text())
    assert record["distributed_type"] == "FSDP" and record["global_batch_samples"] == 8
    assert record["fsdp"]["state_dict_type"] == "SHARDED_STATE_DICT"
    torch.testing.assert_close(_logits(trainer_runs[name] / "final"), _logits(trainer_runs["ddp"] / "final"),
                               rtol=0, atol=0)
    for run_name in (name, "ddp"):  # data only in save_model's folder too: the settings as JSON, no pickle
        assert not (trainer_runs[run_name] / "final" / TRAINER_ARGS_PICKLE).exists()
        assert (trainer_runs[run_name] / "final" / TRAINER_ARGS_JSON).is_file()


def test_compare_with_and_without_the_callback_and_a_planted_lr_change(trainer_runs, tmp_path, capsys):
    assert _cli(capsys, "compare", str(trainer_runs["ddp"]), str(trainer_runs["fsdp2"]))[0] == 0
    # A folder written without the callback: Trainer's checkpoint only (no metrics.jsonl, no run.json).
    without = tmp_path / "without_callback"
    shutil.copytree(trainer_runs["fsdp2"] / trainer_checkpoint_name(6), without / trainer_checkpoint_name(6))
    code, printed = _cli(capsys, "compare", str(trainer_runs["ddp"]), str(without))
    assert code == 0, printed
    assert "Trainer's log" in printed and "logging_steps=2" in printed
    # The learning rate of one step changed: caught from both kinds of record.
    planted = tmp_path / "planted"
    shutil.copytree(trainer_runs["fsdp2"], planted)
    lines = [json.loads(line) for line in (planted / METRICS).read_text().splitlines()]
    next(line for line in lines if line["kind"] == "train" and line["step"] == 4)["lr"] *= 1.5
    (planted / METRICS).write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert _cli(capsys, "compare", str(trainer_runs["ddp"]), str(planted))[0] == 1
    state = without / trainer_checkpoint_name(6) / "trainer_state.json"
    payload = json.loads(state.read_text())
    payload["log_history"][1]["learning_rate"] *= 1.5
    state.write_text(json.dumps(payload))
    assert _cli(capsys, "compare", str(trainer_runs["ddp"]), str(without))[0] == 1


@pytest.mark.parametrize("name", ["ddp", "fsdp2", "fsdp1"])
def test_every_checkpoint_verifies_and_holds_no_pickled_arguments(trainer_runs, name, capsys):
    for step in (3, 6):
        checkpoint = trainer_runs[name] / trainer_checkpoint_name(step)
        assert (checkpoint / MANIFEST).is_file() and not (checkpoint / TRAINER_ARGS_PICKLE).exists()
        code, printed = _cli(capsys, "inspect-checkpoint", str(checkpoint))
        assert code == 0 and "integrity   OK" in printed, printed
    # A changed byte is caught.
    damaged = trainer_runs[name].parent / f"{name}-damaged"
    shutil.copytree(trainer_runs[name] / trainer_checkpoint_name(6), damaged)
    state = damaged / "trainer_state.json"
    state.write_text(state.read_text().replace('"global_step": 6', '"global_step": 7'))
    assert "DAMAGED" in _cli(capsys, "inspect-checkpoint", str(damaged))[1]


def test_export_from_a_config_only_folder(trainer_runs, presets, tmp_path, capsys):
    import torch

    config_only = tmp_path / "config_only"
    config_only.mkdir()
    shutil.copy(presets["model"] / "config.json", config_only)
    output = tmp_path / "exported"
    code, printed = _cli(capsys, "export", str(trainer_runs["fsdp2"] / trainer_checkpoint_name(6)), "--output",
                         str(output), "--model", str(config_only))
    assert code == 0, printed
    assert "no tokenizer there" in printed
    torch.testing.assert_close(_logits(output), _logits(trainer_runs["ddp"] / "final"), rtol=1e-5, atol=1e-5)


def test_resume_on_one_process_keeps_the_global_batch(killed_and_resumed, trainer_runs, presets, tmp_path):
    # The preempted FSDP2 run (2 processes x 2 x accumulation 2) resumed on one process.
    killed = killed_and_resumed["killed"]
    assert "global batch kept at 8 samples: gradient_accumulation_steps 2 -> 4" in killed["result"].stdout
    record = killed["run"]
    assert record["world_size"] == 1 and record["gradient_accumulation_steps"] == 4
    assert record["global_batch_samples"] == 8
    trained, reference = _train_losses(killed["metrics"]), _losses(trainer_runs["fsdp2"])
    assert sorted(trained) == list(range(1, 7))
    for step in (4, 5, 6):  # the same samples per step: the same losses, up to the order of the sums
        assert trained[step] == pytest.approx(reference[step], rel=1e-5, abs=0), step
    # A batch size that cannot keep it is refused in one line, before training.
    run = tmp_path / "refused"
    shutil.copytree(trainer_runs["fsdp2"] / trainer_checkpoint_name(3), run / trainer_checkpoint_name(3))
    refused = _launch(presets["fsdp2"], TRAINER_SCRIPT, presets["model"], run, "--resume", "--batch-size", "3", processes=1,
                      check=False, forked=None)
    assert refused.returncode != 0
    said = [line for line in refused.stderr.splitlines() if line.startswith("fsdp-presets: error:")]
    assert len(said) == 1 and "cannot split" in said[0], refused.stderr[-2000:]
    assert sorted(path.name for path in run.iterdir()) == [trainer_checkpoint_name(3)]  # nothing written


@pytest.fixture(scope="module")
def sft_runs(presets, tmp_path_factory) -> dict[str, Path]:
    """TRL SFT + LoRA under the DDP baseline (forked), an FSDP2 preset and an FSDP1 LoRA preset
    (``generate --fsdp-version 1 --method lora``), and QLoRA (``--load-in-4bit``) under a QLoRA
    preset (``generate --method qlora``)."""
    if not HAS_TRL:
        pytest.skip("trl is not installed (pip install --no-deps trl==1.16.0)")
    root = tmp_path_factory.mktemp("sft_runs")
    runs = {name: root / name for name in ("ddp", "fsdp2", "fsdp1", "qlora", "qlora-ddp")}
    for name, preset, forked, extra in (("ddp", "ddp", None, ()), ("fsdp2", "fsdp2", False, ()),
                                        ("fsdp1", "fsdp1-lora", None, ()), ("qlora", "qlora", None, ("--load-in-4bit",)),
                                        ("qlora-ddp", "qlora-ddp", None, ("--load-in-4bit",))):
        if name.startswith("qlora") and not HAS_BITSANDBYTES:
            continue
        result = _launch(presets[preset], SFT_SCRIPT, presets["model"], runs[name], *extra, forked=forked)
        if name not in ("ddp", "qlora-ddp"):
            assert "the PEFT adapter under FSDP: its trainable weights gathered from the shards" in result.stdout
    return runs


@pytest.mark.parametrize("name", ["fsdp2", "fsdp1"])
def test_sft_lora_adapter_and_losses_equal_ddp(sft_runs, presets, name, capsys):
    import torch

    ddp, run = _losses(sft_runs["ddp"]), _losses(sft_runs[name])
    assert sorted(run) == sorted(ddp) == list(range(1, 7))
    assert run == ddp and _grad_norms(sft_runs[name]) == _grad_norms(sft_runs["ddp"])  # bit for bit
    for folder in (sft_runs["ddp"], sft_runs[name]):  # save_model(output_dir): beside the checkpoints and metrics
        assert (folder / "adapter_model.safetensors").is_file()
        assert json.loads((folder / RUN_JSON).read_text())["training"]["method"] == "lora"
    # peft's own save of an FSDP1-wrapped model writes an adapter with no tensors: the callback's is complete.
    logits = _adapter_logits(presets["model"], sft_runs[name])
    torch.testing.assert_close(logits, _adapter_logits(presets["model"], sft_runs["ddp"]), rtol=0, atol=0)
    assert not torch.equal(logits, _logits(presets["model"]))  # the adapter is not zero
    # The FSDP checkpoints hold accelerate's DCP folders (DDP's: Trainer's adapter files, which
    # inspect-checkpoint does not read yet).
    for step in (3, 6):
        code, printed = _cli(capsys, "inspect-checkpoint", str(sft_runs[name] / trainer_checkpoint_name(step)))
        assert code == 0 and "integrity   OK" in printed, printed
    assert _cli(capsys, "compare", str(sft_runs["ddp"]), str(sft_runs[name]))[0] == 0


@pytest.mark.skipif(not HAS_BITSANDBYTES, reason="bitsandbytes is not installed (the lora extra)")
def test_sft_qlora_trains_saves_the_adapter_and_verifies_its_checkpoints(sft_runs, presets, capsys):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fsdp_presets.train.lora import keep_4bit_layout, quantization_config

    run = sft_runs["qlora"]
    losses, ddp = _losses(run), _losses(sft_runs["qlora-ddp"])
    assert sorted(losses) == sorted(ddp) == list(range(1, 7)) and losses[6] < losses[1] - 0.1  # it learned
    # The same training as the QLoRA preset's DDP baseline, bit for bit. TRL trains QLoRA adapters in
    # bfloat16; accelerate's clipping norm, summed in bfloat16 per shard under FSDP2 and per whole
    # tensor under DDP, differed by a bfloat16 step (1.1953125 vs 1.203125 at step 1), and so did
    # the clipped gradients and the losses (1e-5 relative by step 4). The callback clips with the
    # recipes' float64 norm (fsdp_presets.numerics.clip_grad_norm): the same norm, bit for bit.
    assert losses == ddp
    assert _grad_norms(run) == _grad_norms(sft_runs["qlora-ddp"])
    record = json.loads((run / RUN_JSON).read_text())
    assert record["training"]["method"] == "qlora" and record["fsdp"]["version"] == 2
    for step in (3, 6):
        code, printed = _cli(capsys, "inspect-checkpoint", str(run / trainer_checkpoint_name(step)))
        assert code == 0 and "integrity   OK" in printed, printed
    with torch.no_grad():  # the adapter loads onto the 4-bit base and changes what it computes
        base = AutoModelForCausalLM.from_pretrained(presets["model"], dtype=torch.float32,
                                                    quantization_config=quantization_config())
        keep_4bit_layout(base)
        batch = torch.arange(1, 17).reshape(2, 8)
        plain = base(batch).logits
        adapted = PeftModel.from_pretrained(base, run).eval()(batch).logits
        base = AutoModelForCausalLM.from_pretrained(presets["model"], dtype=torch.float32,
                                                    quantization_config=quantization_config())
        keep_4bit_layout(base)
        adapted_ddp = PeftModel.from_pretrained(base, sft_runs["qlora-ddp"]).eval()(batch).logits
    assert torch.isfinite(adapted).all() and (adapted - plain).abs().max() > 1e-3
    torch.testing.assert_close(adapted, adapted_ddp, rtol=0, atol=0)  # the DDP baseline's adapter, bit for bit


@pytest.fixture(scope="module")
def sft_killed_and_resumed(sft_runs, presets, tmp_path_factory) -> dict:
    """The FSDP2 SFT + LoRA run of ``sft_runs`` (same flags), rank 1 SIGKILLed at the end of step 5
    (checkpoint-3 committed), then the same script with Trainer's own resume, to the end."""
    output = tmp_path_factory.mktemp("sft_killed") / "run"
    killed = _launch(presets["fsdp2"], SFT_SCRIPT, presets["model"], output, "--kill-rank-at-step", 1, 5, check=False,
                     forked=None)
    left = {"result": killed, "metrics": read_metrics(output / METRICS),
            "checkpoints": sorted(path.name for path in output.glob("checkpoint-*")),
            "committed": (output / trainer_checkpoint_name(3) / MANIFEST).is_file()}
    resumed = _launch(presets["fsdp2"], SFT_SCRIPT, presets["model"], output, "--resume", forked=None)
    return {"killed": left, "resumed": resumed, "output": output}


def test_sft_lora_killed_mid_run_resumes_exactly_with_trainers_own_resume(sft_killed_and_resumed, sft_runs, presets,
                                                                         capsys):
    import torch

    killed, output = sft_killed_and_resumed["killed"], sft_killed_and_resumed["output"]
    # torchrun's failure summary lists rank 1 SIGKILLed (rank 0 may fail first, its peer gone)
    assert killed["result"].returncode != 0 and re.search(r"rank\s*: 1 \(local_rank: 1\)\s+exitcode\s*: -9",
                                                          killed["result"].stderr), killed["result"].stderr[-3000:]
    assert killed["checkpoints"] == [trainer_checkpoint_name(3)] and killed["committed"]
    uninterrupted = _losses(sft_runs["fsdp2"])
    before_kill = _train_losses(killed["metrics"])
    assert sorted(before_kill) == [1, 2, 3, 4]  # step 5 never reached the step boundary on both ranks
    assert before_kill == {step: uninterrupted[step] for step in before_kill}
    record = json.loads((output / RUN_JSON).read_text())
    assert record["resumed_from"] == str(output / trainer_checkpoint_name(3)) and record["training"]["method"] == "lora"
    assert _losses(output) == uninterrupted  # steps 4-6 again after the resume, bit for bit
    torch.testing.assert_close(_adapter_logits(presets["model"], output), _adapter_logits(presets["model"],
                                                                                         sft_runs["fsdp2"]),
                               rtol=0, atol=0)
    code, printed = _cli(capsys, "inspect-checkpoint", str(output / trainer_checkpoint_name(6)))
    assert code == 0 and "integrity   OK" in printed, printed


def test_a_launch_that_is_not_what_the_preset_planned_is_refused_on_every_rank(presets, tmp_path):
    # A fresh run under a preset made for one process of another model, launched on two (`accelerate
    # launch --num_processes 2`) with this model: both problems in one line, before anything is written.
    output, preset = tmp_path / "run", presets["qwen2-1"]
    result = _launch(preset, TRAINER_SCRIPT, presets["model"], output, processes=2, check=False, forked=None)
    said = [line for line in result.stderr.splitlines() if line.startswith("fsdp-presets: error:")]
    assert len(said) == 1, result.stderr[-3000:]
    assert f"{preset} was generated for 1 process, launched 2" in said[0]
    assert f"fsdp-presets generate --from {preset} --gpus 2 -o NEW.yaml" in said[0]
    assert "the accelerate config wraps Qwen2DecoderLayer, which LlamaForCausalLM does not have (its block class: " \
           "LlamaDecoderLayer)" in said[0]
    # The main process leaves with status 2 at once; the other rank, which would too, leaves 2 s later
    # (so the line is printed before torchrun stops the launch), and torchrun stops it first.
    assert result.returncode != 0 and "failed (exitcode: 2) local_rank: 0" in result.stderr, result.stderr[-3000:]
    assert list(output.glob("*")) == []  # nothing written (Trainer itself makes the empty output folder)


@pytest.mark.skipif(not HAS_TRL, reason="trl is not installed (pip install --no-deps trl==1.16.0)")
def test_the_sft_trainer_recipe_with_lora_writes_its_run_folder(presets, tmp_path):
    import torch

    output = tmp_path / "sft_recipe"
    run_launch(presets["fsdp2"], SFT_TRAINER,
               causal_lm_args(presets["model"], output, "--max-steps", 2, "--lora-r", 4), cwd=REPO).check()
    assert sorted(_losses(output)) == [1, 2]
    run = json.loads((output / RUN_JSON).read_text())
    assert run["training"]["method"] == "lora"
    assert datetime.date.fromisoformat(run["started_on"]) <= datetime.date.today()  # the run's first day
    assert (output / trainer_checkpoint_name(2) / MANIFEST).is_file()
    adapter = _adapter_logits(presets["model"], output / "final")
    assert not torch.equal(adapter, _logits(presets["model"]))  # it loads, and it trained


# ---- signals and kills (real launches: a real torchrun agent forwards the signal to real ranks) ----
@pytest.fixture(scope="module")
def preempted_run(presets, tmp_path_factory) -> dict:
    """The FSDP2 run of ``trainer_runs`` (same flags) saving in the background (``async_save=True``),
    sent SIGTERM at its launcher while rank 0 is inside the save of step 3 (held there by a stall
    fault, the shards' write in flight): the signal is answered once that save is committed."""
    output = tmp_path_factory.mktemp("preempted") / "run"
    # SIGTERM: what scancel / a time limit / Kubernetes send the job's launcher
    run = _signal_during_save(presets, output, signal.SIGTERM)
    return {**run, "checkpoint_3": _copy(output / trainer_checkpoint_name(3)),
            "went_on": [name for name in (trainer_checkpoint_name(4), "final") if (output / name).exists()]}


def _signal_during_save(presets, output: Path, signum: int, *extra) -> dict:
    """The FSDP2 Trainer run saving in the background, ``signum`` sent to its launcher while rank 0
    is inside the save of step 3 (held there by a stall fault, the shards' write in flight)."""
    log = output.parent / "launch.log"
    with open(log, "w") as handle:
        launcher = subprocess.Popen(launch_command(presets["fsdp2"], TRAINER_SCRIPT,
                                                   _args(presets["model"], output, "--async-save", *extra)),
                                    cwd=REPO, env=launch_env({FAULT_ENV: "stall-during-save:step=3"}), stdout=handle,
                                    stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            deadline = time.monotonic() + 300
            while "[fault] stall at during-save, step 3" not in log.read_text():
                assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.05)
            os.kill(launcher.pid, signum)
            signalled = time.monotonic()
            status = launcher.wait(timeout=120)
        finally:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
    return {"output": output, "status": status, "within_s": time.monotonic() - signalled, "log": log.read_text(),
            "metrics": read_metrics(output / METRICS)}


def test_ctrl_c_during_a_background_save_commits_it_and_exits_130(presets, tmp_path):
    # Saving in the background at every step, at most one checkpoint kept (save_total_limit=1), Ctrl-C
    # (SIGINT) at the launcher while the save of step 3 is in flight.
    from fsdp_presets.checkpoint.manager import trainer_resume_choice

    output = tmp_path / "run"
    run = _signal_during_save(presets, output, signal.SIGINT, "--save-steps", 1, "--save-total-limit", 1)
    assert run["status"] == 128 + signal.SIGINT and run["within_s"] < 30, run["log"][-3000:]
    saves = [(record["step"], record["async"]) for record in run["metrics"] if record["kind"] == "save"]
    # The save in flight was committed before the run stopped, and the rotation ran after each commit,
    # never before: checkpoint-1 and checkpoint-2 went as the next one was committed (Trainer's rotation,
    # newest first by modification time, would have kept an unfinished checkpoint-3 and removed
    # checkpoint-2).
    assert saves == [(1, True), (2, True), (3, True)], run["log"][-3000:]
    interrupted = output / trainer_checkpoint_name(3)
    assert [path.name for path in sorted(output.glob("checkpoint-*"))] == [interrupted.name]
    assert checkpoint_verdict(interrupted).ok and trainer_resume_choice(output) == (interrupted, None)
    assert (f"fsdp-presets: error: interrupted (Ctrl-C) after step 3: saved {interrupted}; "
            "trainer.train(resume_from_checkpoint=True) continues from it") in run["log"], run["log"][-3000:]


def test_ctrl_c_at_the_terminal_commits_the_step_reached_exits_130_and_trainer_resume_continues(presets, tmp_path):
    output = tmp_path / "run"
    log = tmp_path / "launch.log"
    args = _args(presets["model"], output, "--max-steps", 60, "--save-steps", 50)
    with open(log, "w") as handle:
        launcher = subprocess.Popen(launch_command(presets["fsdp2"], TRAINER_SCRIPT, args), cwd=REPO,
                                    env=launch_env(), stdout=handle, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)
        try:
            deadline = time.monotonic() + 300
            while sum(record["kind"] == "train" for record in read_metrics(output / METRICS)) < 2:
                assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.05)
            os.killpg(launcher.pid, signal.SIGINT)  # what Ctrl-C at a terminal does: the launcher and every rank
            status = launcher.wait(timeout=120)
        finally:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
    text = log.read_text()
    assert status == 128 + signal.SIGINT, text[-3000:]
    said = [line for line in text.splitlines() if line.startswith("fsdp-presets: error:")]
    assert len(said) == 1 and said[0].startswith("fsdp-presets: error: interrupted (Ctrl-C) after step "), text[-3000:]
    step = int(said[0].split("after step ")[1].split(":")[0])
    checkpoint = output / trainer_checkpoint_name(step)
    assert said[0].endswith(f"saved {checkpoint}; trainer.train(resume_from_checkpoint=True) continues from it")
    assert "KeyboardInterrupt" not in text and "Traceback" not in text, text[-3000:]
    records = read_metrics(output / METRICS)
    assert 2 <= step < 60 and max(_train_losses(records)) == step and checkpoint_verdict(checkpoint).ok
    assert not [record for record in records if record["kind"] == "preempted"]
    assert not (output / "final").exists()  # the script's lines after train() did not run
    # resumed two steps longer: Trainer rebuilds its linear decay over 62 steps, and the run says so
    resumed = _launch(presets["fsdp2"], TRAINER_SCRIPT, presets["model"], output, "--max-steps", 62, "--save-steps",
                      50, "--resume", forked=None)
    assert "note: max_steps=62, the run was launched with 60: its linear learning-rate schedule is rebuilt" \
        in resumed.stdout, resumed.stdout[-3000:]
    assert json.loads((output / RUN_JSON).read_text())["resumed_from"] == str(checkpoint)
    assert sorted(_train_losses(read_metrics(output / METRICS))) == list(range(1, 63))


def _copy(folder: Path) -> Path:
    """A copy of ``folder`` beside it, as it is now (the launches after it write into its run folder)."""
    copy = folder.parent.parent / f"{folder.name}-as-saved"
    shutil.copytree(folder, copy)
    return copy


@pytest.fixture(scope="module")
def killed_and_resumed(preempted_run, presets) -> dict:
    """The preempted run resumed with Trainer's own resume on one process (the global batch kept);
    SIGKILLed inside the save of step 6 (its files written, its manifest not); resumed again on two
    processes to the end, from the newest committed checkpoint: the preemption's, saving
    checkpoint-6 in the background."""
    output = preempted_run["output"]
    killed = _launch(presets["fsdp2"], TRAINER_SCRIPT, presets["model"], output, "--resume", check=False,
                     env={FAULT_ENV: "kill-during-save:step=6"}, processes=1, forked=None)
    after_kill = {"result": killed, "metrics": read_metrics(output / METRICS),
                  "run": json.loads((output / RUN_JSON).read_text()),
                  "checkpoint_6_manifest": (output / trainer_checkpoint_name(6) / MANIFEST).exists()}
    resumed = _launch(presets["fsdp2"], TRAINER_SCRIPT, presets["model"], output, "--resume", "--async-save",
                      forked=None)
    return {"killed": after_kill, "resumed": resumed, "output": output}


def test_sigterm_commits_the_step_reached_and_trainer_resume_continues_exactly(preempted_run, killed_and_resumed,
                                                                               trainer_runs, capsys):
    log, output = preempted_run["log"], preempted_run["output"]
    assert preempted_run["status"] == 128 + signal.SIGTERM, log[-3000:]  # the launcher, as for the recipes
    assert preempted_run["within_s"] < 30, log[-3000:]  # torchrun kills the ranks 30 s after forwarding
    checkpoint = output / trainer_checkpoint_name(3)
    preempted = [record for record in preempted_run["metrics"] if record["kind"] == "preempted"]
    assert preempted == [{"kind": "preempted", "step": 3, "signal": "SIGTERM", "checkpoint": str(checkpoint)}], \
        log[-3000:]
    assert max(record["step"] for record in preempted_run["metrics"] if record["kind"] == "train") == 3
    assert (f"fsdp-presets: error: preempted (SIGTERM) at step 3: saved {checkpoint}; "
            f"trainer.train(resume_from_checkpoint=True) continues from it; exit status {PREEMPTED_EXIT}") in log
    assert preempted_run["went_on"] == []  # it stopped there: no later step, no save_model
    code, printed = _cli(capsys, "inspect-checkpoint", str(checkpoint))
    assert code == 0 and "integrity   OK" in printed, printed
    # Trainer's own resume went on from it (the last launch of the chain, on two processes as it was
    # saved) with the losses of the uninterrupted run, bit for bit.
    assert killed_and_resumed["killed"]["run"]["resumed_from"] == str(checkpoint)
    assert json.loads((output / RUN_JSON).read_text())["resumed_from"] == str(checkpoint)
    assert _losses(output) == _losses(trainer_runs["fsdp2"])


def test_a_checkpoint_saved_in_the_background_equals_the_synchronous_one_and_resumes_exactly(
        preempted_run, killed_and_resumed, trainer_runs):
    # The preempted run saved step 3 with async_save=True, the uninterrupted run synchronously: the
    # same files, byte for byte (Trainer's scheduler, RNG states and trainer_state.json, and the DCP
    # shards the background writer wrote), but DCP's .metadata and the manifest (other bookkeeping).
    _assert_same_files(preempted_run["checkpoint_3"], trainer_runs["fsdp2"] / trainer_checkpoint_name(3))
    # One save line per save: in the background here, synchronous in the uninterrupted run.
    saves = [record for record in preempted_run["metrics"] if record["kind"] == "save"]
    assert [(record["step"], record["async"]) for record in saves] == [(3, True)], preempted_run["log"][-3000:]
    assert 0 < saves[0]["blocked_s"] <= saves[0]["total_s"]
    manifest = json.loads((killed_and_resumed["output"] / trainer_checkpoint_name(3) / MANIFEST).read_text())
    assert saves[0]["bytes"] == sum(entry["bytes"] for entry in manifest["files"].values())
    records = read_metrics(trainer_runs["fsdp2"] / METRICS)
    assert [(record["step"], record["async"]) for record in records if record["kind"] == "save"] == \
        [(3, False), (6, False)]
    # Trainer's resume from it, on one process and on two: the uninterrupted run's losses, bit for bit
    # (steps 4-6 of the last launch of the chain resumed from this checkpoint).
    output = killed_and_resumed["output"]
    assert _losses(output) == _losses(trainer_runs["fsdp2"])
    # That last launch saved step 6 in the background too: the synchronous checkpoint-6's files (but
    # trainer_state.json: Trainer's logged loss of step 4 after a resume averages step 4 alone).
    lines = read_metrics(output / METRICS)
    assert [(line["step"], line["async"]) for line in lines if line["kind"] == "save"] == [(3, True), (6, True)]
    _assert_same_files(output / trainer_checkpoint_name(6), trainer_runs["fsdp2"] / trainer_checkpoint_name(6),
                       also_differ=("trainer_state.json",))


def _assert_same_files(saved: Path, synchronous: Path, *, also_differ: tuple[str, ...] = ()) -> None:
    """The files of a checkpoint saved in the background are byte for byte those of the synchronous
    one of the same step, but DCP's .metadata and the manifest (other bookkeeping) and ``also_differ``."""
    ours, theirs = tree_digest(saved), tree_digest(synchronous)
    assert sorted(ours) == sorted(theirs)
    same = {relative for relative in theirs
            if relative not in (MANIFEST, *also_differ) and not relative.endswith(".metadata")}
    assert {relative: ours[relative] for relative in same} == {relative: theirs[relative] for relative in same}
    assert sum(relative.endswith(".distcp") for relative in same) == 4  # model and optimizer, two ranks


def test_saves_in_the_background_are_committed_while_training_goes_on(trainer_runs, presets, tmp_path):
    # A save every step: each one in flight while the next step trains (committed at the end of that
    # step, when every rank's write has finished, or by the next save), at most one at a time.
    output = tmp_path / "run"
    _launch(presets["fsdp2"], TRAINER_SCRIPT, presets["model"], output, "--async-save", "--save-steps", 1, forked=None)
    assert _losses(output) == _losses(trainer_runs["fsdp2"])
    lines = read_metrics(output / METRICS)
    position = {(line["kind"], line["step"]): index for index, line in enumerate(lines)}
    assert [(line["step"], line["async"]) for line in lines if line["kind"] == "save"] == [
        (step, True) for step in range(1, 7)]
    for step in range(1, 6):
        assert position[("save", step)] > position[("train", step + 1)], step
    for step in range(1, 7):
        assert checkpoint_verdict(output / trainer_checkpoint_name(step)).ok, step
    for step in (3, 6):  # trainer_state.json records save_steps
        _assert_same_files(output / trainer_checkpoint_name(step), trainer_runs["fsdp2"] / trainer_checkpoint_name(step),
                           also_differ=("trainer_state.json",))


def test_async_save_is_refused_where_the_background_writer_cannot_save(presets, tmp_path):
    # Under the DDP baseline (no sharded DCP checkpoints): one line, exit 2, before anything is written.
    output = tmp_path / "run"
    result = _launch(presets["ddp"], TRAINER_SCRIPT, presets["model"], output, "--async-save", check=False,
                     forked=None)
    said = [line for line in result.stderr.splitlines() if line.startswith("fsdp-presets: error:")]
    assert said == ["fsdp-presets: error: FSDPPresetsCallback(async_save=True): --async-save needs an FSDP accelerate "
                    "config (sharded DCP checkpoints); this run is MULTI_CPU: drop --async-save or launch with an "
                    "FSDP2 config"], result.stderr[-3000:]
    assert result.returncode != 0 and list(output.glob("*")) == []


def test_a_rank_killed_mid_save_resumes_exactly_from_the_newest_committed_checkpoint(killed_and_resumed,
                                                                                     trainer_runs):
    import torch

    killed, resumed, output = killed_and_resumed["killed"], killed_and_resumed["resumed"], killed_and_resumed["output"]
    assert killed["result"].returncode != 0 and "[fault] kill at during-save, step 6" in killed["result"].stdout
    assert max(_train_losses(killed["metrics"])) == 6  # killed after step 6, before its checkpoint was committed
    assert not killed["checkpoint_6_manifest"]  # checkpoint-6 written, never committed
    assert f"{output / trainer_checkpoint_name(6)} has no {MANIFEST}: it was cut short" in resumed.stdout
    assert json.loads((output / RUN_JSON).read_text())["resumed_from"] == str(output / trainer_checkpoint_name(3))
    assert _losses(output) == _losses(trainer_runs["fsdp2"])  # steps 4-6 again, bit for bit
    assert (output / trainer_checkpoint_name(6) / MANIFEST).is_file()
    torch.testing.assert_close(_logits(output / "final"), _logits(trainer_runs["fsdp2"] / "final"), rtol=0, atol=0)


def test_a_signal_on_one_rank_stops_every_rank_after_saving_that_step(presets, tmp_path):
    output = tmp_path / "run"  # rank 1 alone gets SIGUSR1 after step 2, outside any save
    result = _launch(presets["fsdp2"], TRAINER_SCRIPT, presets["model"], output, "--signal-rank-at-step", 1, 2,
                     check=False, forked=None)
    checkpoint = output / trainer_checkpoint_name(2)
    records = read_metrics(output / METRICS)
    assert [record for record in records if record["kind"] == "preempted"] == [
        {"kind": "preempted", "step": 2, "signal": None, "checkpoint": str(checkpoint)}], result.stderr[-3000:]
    assert max(_train_losses(records)) == 2 and (checkpoint / MANIFEST).is_file()
    assert "fsdp-presets: error: preempted (signal on another rank) at step 2" in result.stderr
    assert result.returncode != 0 and f"exitcode  : {PREEMPTED_EXIT}" in result.stderr, result.stderr[-3000:]


def test_a_failed_background_write_names_the_committed_checkpoint_trainer_resumes_from(tmp_path):
    """The stop message of a failed background write, for Trainer's own folders: the newest
    ``checkpoint-N`` with a manifest, and Trainer's resume (not the recipes' ``--resume auto``)."""
    from fsdp_presets.checkpoint.manager import TRAINER_NAMING, CheckpointManager

    checkpoints = CheckpointManager(accelerator=None, directory=tmp_path, keep_last=1, config_digest="",
                                    distributed={}, naming=TRAINER_NAMING)
    assert "No earlier committed checkpoint" in checkpoints.kept_note()
    for step, committed in ((3, True), (6, True), (9, False)):  # checkpoint-9: written, never committed
        (tmp_path / trainer_checkpoint_name(step)).mkdir()
        if committed:
            (tmp_path / trainer_checkpoint_name(step) / MANIFEST).write_text("{}")
    note = checkpoints.kept_note()
    assert str(tmp_path / trainer_checkpoint_name(6)) in note and "resume_from_checkpoint=True" in note, note


def test_the_resume_takes_only_committed_checkpoints_of_a_run_the_callback_wrote(tmp_path):
    from fsdp_presets.checkpoint.manager import trainer_resume_choice as resume_choice

    assert resume_choice(tmp_path) == (None, None)  # nothing there: Trainer's own error
    (tmp_path / trainer_checkpoint_name(3)).mkdir()
    # Written without the callback (no run.json, no manifest anywhere): the newest, as Trainer takes it.
    assert resume_choice(tmp_path) == (tmp_path / trainer_checkpoint_name(3), None)
    (tmp_path / RUN_JSON).write_text("{}")  # written with the callback: a folder without a manifest is never taken
    chosen, note = resume_choice(tmp_path)
    assert chosen is None and "training starts from step 0" in note
    (tmp_path / trainer_checkpoint_name(3) / MANIFEST).write_text("{}")
    (tmp_path / trainer_checkpoint_name(6)).mkdir()
    chosen, note = resume_choice(tmp_path)
    assert chosen == tmp_path / trainer_checkpoint_name(3) and f"{trainer_checkpoint_name(6)} has no {MANIFEST}" in note
