"""Bad input and interruptions at training time, built the way a careless user (or a full disk)
makes them, through the real recipes and real launches (FSDP2, 2 gloo processes, tiny models).

- flags and data: NaN/inf learning rate, a negative seed, non-UTF-8 data, fewer or more labels than
  the classification head, --no-packing with prompts longer than --seq-len: one line, exit 2,
  nothing written;
- ranks started differently: other --seq-len on one rank, a data file missing on one rank: named
  (on that rank), no hang;
- a diverging run stops with the step and the last good checkpoint (exit 1);
- Ctrl-C (SIGINT to the whole launch, as a terminal sends it) saves the step, exits 130 with one
  line, and --resume auto continues;
- a full disk (the kernel's ENOSPC from /dev/full, see fsdp_presets.faults) during a save and
  during the final export says "disk full" and keeps the last checkpoint and the last model.
"""

from __future__ import annotations

import errno
import io
import json
import math
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from fsdp_presets.checkpoint.layout import DCP_METADATA
from fsdp_presets.checkpoint.manager import committed_checkpoints
from fsdp_presets.checkpoint.verify import checkpoint_verdict
from fsdp_presets.train.data import fit_head
from fsdp_presets.errors import UsageError, disk_full_cause
from fsdp_presets.train.metrics import read_metrics
from fsdp_harness.launch import launch_env, run_launch
from fsdp_presets.launching.local import launch_command
from recipe_helpers import (CAUSAL_LM, CLASSIFICATION, FSDP2_CONFIG, GENRES_TRAIN, REPO, SFT_EVAL, SFT_TRAIN, SFT_TRAINER,
                            causal_lm_args, drive_recipes, file_size_limit, tiny_bert, tiny_llama, tree_digest)

TRACEBACK = "Traceback (most recent call last)"


def error_lines(text: str, script: str = "causal_lm.py") -> list[str]:
    return [line[line.index(f"{script}: error:"):] for line in text.splitlines() if f"{script}: error:" in line]


# ---- fast: the rules themselves ----
def test_a_head_fits_named_labels_it_knows_and_placeholders_of_its_size_only():
    named = ["law", "poetry", "gospels", "letters"]
    assert fit_head(["gospels", "law"], named, "d") == named  # the head's numbering, fewer labels kept
    assert fit_head(["a", "b"], ["LABEL_0", "LABEL_1"], "d") == ["a", "b"]
    with pytest.raises(UsageError, match="fewer labels than the model's classification head: 2 .* --new-head"):
        fit_head(["a", "b"], ["LABEL_0", "LABEL_1", "LABEL_2"], "d")
    with pytest.raises(UsageError, match="more labels than the model's classification head: 3"):
        fit_head(["a", "b", "c"], ["LABEL_0", "LABEL_1"], "d")
    with pytest.raises(UsageError, match=r"more labels .*fish"):
        fit_head(["fish", "law"], ["law"], "d")


def test_malformed_environment_variables_are_found_at_start(monkeypatch):
    from fsdp_presets.train.startup import environment_problem

    for name in ("FSDP_PRESETS_FAULT", "FSDP_PRESETS_STARTUP_TIMEOUT_S", "FSDP_PRESETS_UNTESTED_ACCELERATE",
                 "FSDP_PRESETS_CPU_PATCHES_OFF"):
        monkeypatch.delenv(name, raising=False)
    assert environment_problem() is None
    monkeypatch.setenv("FSDP_PRESETS_CPU_PATCHES_OFF", "clean-exit, sync-module-states")
    assert environment_problem() is None
    monkeypatch.setenv("FSDP_PRESETS_CPU_PATCHES_OFF", "full-state-dict-ofload")  # misspelt: the patch stays on
    assert "FSDP_PRESETS_CPU_PATCHES_OFF='full-state-dict-ofload': full-state-dict-ofload names no patch" in \
        environment_problem()
    monkeypatch.delenv("FSDP_PRESETS_CPU_PATCHES_OFF")
    monkeypatch.setenv("FSDP_PRESETS_FAULT", "kill-during-save:step=six")
    monkeypatch.setenv("FSDP_PRESETS_STARTUP_TIMEOUT_S", "ten")
    problem = environment_problem()
    assert "FSDP_PRESETS_FAULT='kill-during-save:step=six': unknown field 'step=six'" in problem
    assert "FSDP_PRESETS_STARTUP_TIMEOUT_S='ten': give a number of seconds" in problem
    assert problem.endswith("fix or unset the variable") and "\n" not in problem
    monkeypatch.setenv("FSDP_PRESETS_FAULT", ":")
    assert "expected ACTION-POINT" in environment_problem()


def test_a_model_config_that_is_truncated_linked_out_hostile_or_endless_is_one_line(tmp_path):
    from fsdp_presets.train.loop import load_model_config

    cases = {"truncated": '{"model_type": "llama", "hidden', "hostile": '{"model_type": "$(touch pwned)"}'}
    for name, text in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(text)
    for name, target in (("linked-out", "/etc/passwd"), ("endless", "/dev/zero")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").symlink_to(target)
    expected = {"truncated": "is not a valid JSON file", "hostile": "an architecture this transformers does not know",
                "linked-out": "is not a valid JSON file", "endless": "is a device, not a regular file"}
    for name, message in expected.items():
        with pytest.raises(UsageError, match=message):
            load_model_config(str(tmp_path / name))
    assert not (tmp_path / "pwned").exists()


def test_a_model_without_the_configs_wrap_class_is_named_with_its_own():
    from types import SimpleNamespace

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from fsdp_presets.train.model_setup import check_wrap_classes

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2, vocab_size=64))
    gpt2_preset = SimpleNamespace(transformer_cls_names_to_wrap=["GPT2Block"], auto_wrap_policy="transformer_based_wrap")
    with pytest.raises(UsageError, match="wraps GPT2Block, which LlamaForCausalLM does not have \\(its block class: "
                                         "LlamaDecoderLayer\\).*regenerate it"):
        check_wrap_classes(gpt2_preset, model)
    check_wrap_classes(SimpleNamespace(transformer_cls_names_to_wrap=["LlamaDecoderLayer"], auto_wrap_policy=None), model)
    check_wrap_classes(None, model)  # DDP


@pytest.mark.parametrize("labels, message", [
    ([None, "law", "poetry"], "3 of 9 records have no label"),
    (["", "law", " "], "6 of 9 records have no label"),
    ([0.25, 0.5, 1], "label 0.25 is not a whole number"),  # regression scores: every value would be a class
    ([["law"], ["poetry"], ["law"]], "column 'label' holds List"),
    ([{"name": "law"}, {"name": "poetry"}, {"name": "law"}], "column 'label' holds {'name'"),
    ([1, "law", 2], "column 'label' holds Json"),
    (["law", "poetry", "letters"], None), ([0, 1, 2], None), ([True, False, True], None)])
def test_null_labels_are_refused_not_made_a_class(tmp_path, labels, message):
    from fsdp_presets.train.data import _check_classification_columns, load_records

    data = tmp_path / "labels.jsonl"
    data.write_text("".join(json.dumps({"text": f"verse {index}", "label": labels[index % 3]}) + "\n"
                            for index in range(9)))
    if message is None:
        _check_classification_columns(load_records(data), "--data", data)
        return
    with pytest.raises(UsageError, match=re.escape(message)):
        _check_classification_columns(load_records(data), "--data", data)


@pytest.mark.parametrize("rows, message", [
    ([{"prompt": "a", "response": "b"}, {"prompt": "c"}], "3 of 6 records have no 'response' (absent or null; the "
                                                          "first is record 2)"),
    ([{"prompt": "a", "response": "b"}, {"prompt": None, "response": "d"}], "3 of 6 records have no 'prompt'"),
    ([{"text": "a"}, {"text": None}], "3 of 6 records have no 'text'"),
])
def test_a_record_without_one_of_the_columns_is_named_not_a_tokenizer_crash(tmp_path, rows, message):
    from fsdp_presets.train.data import causal_lm_splits

    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows * 3))
    with pytest.raises(UsageError, match=re.escape(message)):  # was: TypeError from the tokenizer
        causal_lm_splits(data=str(data), eval_data=str(data), eval_fraction=0.1,
                         tokenizer=None, seq_len=8, packing=True, seed=0)  # refused before any tokenizing


def test_the_full_fault_makes_the_kernel_say_enospc_only_under_its_folder(tmp_path, monkeypatch):
    import builtins

    from fsdp_presets import faults

    monkeypatch.setattr(io, "open", io.open)  # restored after the test
    monkeypatch.setattr(builtins, "open", builtins.open)
    monkeypatch.setenv(faults.FAULT_ENV, "full-save:step=3")
    faults.fault_point("save", step=2, rank=0, folder=tmp_path / "full")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "fine").write_bytes(b"x" * 100_000)  # step 2: not this fault's
    faults.fault_point("save", step=3, rank=0, folder=tmp_path / "full")
    with pytest.raises(OSError) as caught:
        with open(tmp_path / "full" / "shard.bin", "wb") as handle:
            handle.write(b"x" * 100_000)
    assert caught.value.errno == errno.ENOSPC and disk_full_cause(RuntimeError("wrapped")) is None
    try:
        raise RuntimeError("while saving") from caught.value
    except RuntimeError as wrapped:
        assert disk_full_cause(wrapped) is caught.value
    (tmp_path / "elsewhere.bin").write_bytes(b"x" * 100_000)  # outside the folder: a normal file
    assert (tmp_path / "elsewhere.bin").stat().st_size == 100_000


def test_a_rank_that_never_reaches_the_start_up_check_is_named_after_the_timeout(monkeypatch):
    import torch.distributed as dist

    from fsdp_presets.errors import Finding
    from fsdp_presets.train.startup import exchange
    from fsdp_presets.launching.local import free_port

    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, wait_for_workers=False)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store)
    started = time.monotonic()
    with pytest.raises(Finding, match=r"rank 0: ranks \[1, 2\] did not reach the start-up check within 1 s "
                                      r"\(of 3 processes\).*FSDP_PRESETS_STARTUP_TIMEOUT_S"):
        exchange({"rank": 0}, rank=0, world_size=3, timeout_s=1)
    assert time.monotonic() - started < 30


# ---- one process: bad flags and data, each a call of the recipe's main ----
@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {"llama": tiny_llama(root / "tiny-llama"), "bert": tiny_bert(root / "tiny-bert")}


@pytest.fixture(scope="module")
def driven(models, tmp_path_factory) -> dict:
    """Every case below, a call of its recipe's main, all in one process (torch imported once):
    ``{"folder": their output folders, "causal" | "head" | "lora": {expected message: (exit status,
    stderr, stdout)}}``; the case whose message is None must train."""
    tmp_path = tmp_path_factory.mktemp("driven")
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(SFT_TRAIN.read_text().replace("Moses", "Mos\u00e9s").encode("latin-1", "replace"))
    latin1_text = tmp_path / "latin1.txt"
    latin1_text.write_bytes("Caf\u00e9 au lait\n".encode("latin-1") * 50)
    records = [json.loads(line) for line in SFT_TRAIN.read_text().splitlines()]
    long_prompts = tmp_path / "long.jsonl"  # every prompt 100+ tokens, --seq-len 32
    long_prompts.write_text("".join(json.dumps({"prompt": record["prompt"] * 3, "response": record["response"]}) + "\n"
                                    for record in records[:64]))
    mixed = tmp_path / "mixed.jsonl"  # half of them too long for --seq-len 64, half fine
    mixed.write_text("".join(long_prompts.read_text().splitlines(True)[:32])
                     + "".join(json.dumps(record) + "\n" for record in records[:64]))

    def args(name, *extra, data=SFT_TRAIN):
        return ["--model", str(models["llama"]), "--data", str(data), "--eval-data", str(SFT_EVAL),
                "--max-eval-samples", "8", "--output-dir", str(tmp_path / name), "--seq-len", "32",
                "--max-steps", "2", *extra]

    causal = {
        "--learning-rate nan is not a finite number; give a number such as 5e-5": args("nan", "--learning-rate", "nan"),
        "--learning-rate inf is not a finite number": args("inf", "--learning-rate", "inf"),
        "--seed -5 is out of range; give a whole number from 0 to 4294967295": args("seed", "--seed", "-5"),
        f"--data {latin1} is not UTF-8 text: byte 0xe9 at offset": args("latin1", data=latin1),
        f"--data {latin1_text} is not UTF-8 text: byte 0xe9 at offset 3 (line 1)": args("text", data=latin1_text),
        "--data: with --no-packing every sample is cut to --seq-len 32 tokens and the prompt of every sample fills":
            args("long", "--no-packing", data=long_prompts),
        None: args("mixed", "--no-packing", "--seq-len", "64", data=mixed),
    }

    # The classification head: the tiny BERT's has 4 outputs (LABEL_0..3); the data has 3 or 5 labels.
    rows = [json.loads(line) for line in GENRES_TRAIN.read_text().splitlines()]
    three = tmp_path / "three.jsonl"
    three.write_text("".join(json.dumps(row) + "\n" for row in rows if row["label"] != "poetry"))
    five = tmp_path / "five.jsonl"
    five.write_text(GENRES_TRAIN.read_text() + json.dumps({"text": "and the fish swam", "label": "fish"}) + "\n")

    def classify(name, data, *extra):
        return ["--model", str(models["bert"]), "--data", str(data), "--max-eval-samples", "8",
                "--output-dir", str(tmp_path / name), "--seq-len", "32", "--max-steps", "2", *extra]

    head = {"has fewer labels than the model's classification head: 3 (gospels, law, letters) against 4 outputs "
            "(LABEL_0, LABEL_1, LABEL_2, LABEL_3); give data with the head's labels, or pass --new-head":
            classify("three", three),
            "has more labels than the model's classification head: 5": classify("five", five),
            None: classify("new-head", three, "--new-head")}

    def lora(name, *extra):
        return ["--model", str(models["llama"]), "--data", str(SFT_TRAIN), "--output-dir", str(tmp_path / name),
                "--seq-len", "32", "--max-steps", "1", "--lora-r", "4", *extra]

    lora_cases = {"--lora-target-modules: q_prj match no module of the model (its linear layers: q_proj":
                  lora("typo", "--lora-target-modules", "q_proj,q_prj"),
                  None: lora("applied", "--lora-target-modules", "q_proj")}

    # TRL's SFTTrainer reads the data as the causal LM recipe does (it crashed in datasets or TRL before).
    no_response = tmp_path / "no-response.jsonl"
    no_response.write_text(SFT_TRAIN.read_text() + json.dumps({"prompt": "and god said"}) + "\n")
    sft = {f"--data {no_response}: 1 of {len(records) + 1} records have no 'response'": args("sft-null", data=no_response),
           f"--data {latin1} is not UTF-8 text: byte 0xe9 at offset": args("sft-latin1", data=latin1)}

    groups = {"causal": (CAUSAL_LM, causal), "head": (CLASSIFICATION, head), "lora": (CAUSAL_LM, lora_cases),
              "sft": (SFT_TRAINER, sft)}
    codes, errors, outputs = drive_recipes([(recipe, argv) for recipe, cases in groups.values()
                                            for argv in cases.values()])
    results, index = {"folder": tmp_path}, 0
    for group, (_, cases) in groups.items():
        results[group] = {}
        for expected in cases:
            results[group][expected] = (codes[index], errors[index], outputs[index])
            index += 1
    return results


def assert_refused_in_one_line(cases: dict, script: str = "causal_lm.py") -> None:
    """Every case but the one that trains: exit 2, one error line that says ``expected``, no traceback."""
    for expected, (code, part, _) in cases.items():
        if expected is None:
            assert code == 0, part[-3000:]
            continue
        lines = error_lines(part, script)
        assert code == 2 and len(lines) == 1 and expected in lines[0], (expected, code, part[-3000:])
        assert TRACEBACK not in part


@pytest.mark.slow
def test_bad_flags_and_data_are_one_line_exit_2_and_nothing_is_written(driven):
    folder = driven["folder"]
    assert_refused_in_one_line(driven["causal"])
    assert_refused_in_one_line(driven["sft"], "sft_trainer.py")
    assert not any((folder / name).exists() for name in ("nan", "inf", "seed", "latin1", "text", "long", "sft-null",
                                                         "sft-latin1"))
    # Too long for --seq-len: cut and said so (and the ones with nothing left dropped), never a loss of 0.
    trained = driven["causal"][None][2]
    assert "note: --data: --no-packing cuts samples to --seq-len 64 tokens: " in trained
    assert "of them dropped" in trained
    losses = [record["loss"] for record in read_metrics(folder / "mixed" / "metrics.jsonl")
              if record["kind"] == "train"]
    assert len(losses) == 2 and all(loss > 1.0 for loss in losses)

    assert_refused_in_one_line(driven["head"], "sequence_classification.py")
    assert not (folder / "three").exists() and not (folder / "five").exists()
    exported = json.loads((folder / "new-head" / "final" / "config.json").read_text())
    assert exported["id2label"] == {"0": "gospels", "1": "law", "2": "letters"}


def test_lora_flags_need_peft_and_the_plan_bound_on_the_rank(monkeypatch):
    import argparse
    import importlib.util

    from fsdp_presets.plan.limits import MAX_LORA_R
    from fsdp_presets.train import lora

    def flags(**given):
        values = {"lora_r": 8, "lora_alpha": None, "lora_target_modules": None, "export_merged": False,
                  "lora_dropout": 0.0, "method": None}
        return argparse.Namespace(**{**values, **given})

    with pytest.raises(UsageError, match=f"--lora-r must be at most {MAX_LORA_R}, got {MAX_LORA_R + 1}"):
        lora.settings(flags(lora_r=MAX_LORA_R + 1))
    assert lora.settings(flags(lora_r=MAX_LORA_R))["r"] == MAX_LORA_R
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None if name == "peft" else real(name, *rest))
    with pytest.raises(UsageError, match="--method lora needs peft: pip install"):
        lora.settings(flags())


@pytest.mark.slow
def test_lora_target_modules_that_match_nothing_are_refused_in_one_line(driven):
    assert_refused_in_one_line(driven["lora"])
    assert not (driven["folder"] / "typo").exists()
    recorded = json.loads((driven["folder"] / "applied" / "run.json").read_text())
    assert recorded["lora"]["target_modules"] == ["q_proj"], recorded.get("lora")


# ---- launches ----
@pytest.mark.slow
def test_bad_data_rank_0_finds_first_leaves_the_other_ranks_without_a_traceback(models, tmp_path):
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(SFT_TRAIN.read_text().replace("Moses", "Mos\u00e9s").encode("latin-1", "replace"))
    result = run_launch(FSDP2_CONFIG, CAUSAL_LM, ["--model", str(models["llama"]), "--data", str(latin1),
                                                  "--output-dir", str(tmp_path / "out"), "--max-steps", "1",
                                                  "--seq-len", "32"], num_processes=2, cwd=REPO, timeout=300)
    assert result.returncode != 0
    assert f"--data {latin1} is not UTF-8 text" in result.stderr
    assert "Connection closed by peer" not in result.stderr and "[rank1]: Traceback" not in result.stderr, \
        result.stderr[-3000:]
    assert not (tmp_path / "out").exists()


PER_RANK = """
import json, os, runpy, sys
argv = sys.argv[1:]
for flag, value in json.loads(os.environ["PER_RANK_ARGS"]).get(os.environ["RANK"], {}).items():
    argv[argv.index(flag) + 1] = value
sys.argv = argv
runpy.run_path(argv[0], run_name="__main__")
"""


def launch_per_rank(tmp_path: Path, args: list[str], changes: dict[str, dict[str, str]]):
    """One launch whose rank R runs the recipe with ``changes[R]`` (as per-node command lines would)."""
    wrapper = tmp_path / "per_rank.py"
    wrapper.write_text(PER_RANK)
    started = time.monotonic()
    result = run_launch(FSDP2_CONFIG, wrapper, [CAUSAL_LM, *args], cwd=REPO, timeout=300,
                        env={"PER_RANK_ARGS": json.dumps(changes)})
    return result, time.monotonic() - started


@pytest.mark.slow
def test_ranks_started_with_another_seq_len_are_named_instead_of_hanging(models, tmp_path):
    output = tmp_path / "run"
    result, seconds = launch_per_rank(tmp_path, causal_lm_args(models["llama"], output, "--max-steps", 4),
                                      {"1": {"--seq-len": "64"}})
    assert result.returncode != 0 and seconds < 200
    lines = error_lines(result.stderr)
    assert lines == ["causal_lm.py: error: the ranks were started with different settings that must match: "
                     "--seq-len (rank 0: 32, rank 1: 64); launch every rank with the same flags, data and model "
                     "(nothing was written)"], result.stderr[-3000:]
    assert not output.exists()


@pytest.mark.slow
def test_a_data_file_missing_on_one_rank_is_said_by_that_rank(models, tmp_path):
    output = tmp_path / "run"
    missing = tmp_path / "node-b" / "train.jsonl"
    result, seconds = launch_per_rank(tmp_path, causal_lm_args(models["llama"], output, "--max-steps", 4),
                                      {"1": {"--data": str(missing)}})
    assert result.returncode != 0 and seconds < 200
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("causal_lm.py: error: rank 1 (") and \
        lines[0].endswith(f"): --data {missing}: no such file"), result.stderr[-3000:]
    assert not output.exists()


@pytest.mark.slow
def test_a_diverging_run_stops_with_the_step_and_the_last_good_checkpoint(models, tmp_path):
    output = tmp_path / "run"
    # Learning rate 0 for step 1 (warm-up), then 2.5e29: the weights explode within a few steps.
    result = run_launch(FSDP2_CONFIG, CAUSAL_LM, causal_lm_args(
        models["llama"], output, "--max-steps", 8, "--save-every", 1, "--keep-last", 10, "--learning-rate", "1e30",
        "--warmup-steps", 4, "--lr-scheduler", "linear"), cwd=REPO, timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    saved = committed_checkpoints(output / "checkpoints")
    good, last = saved[-1]
    stopped = good + 1  # the step it stopped at: its loss or its updated weights were not finite
    assert [step for step, _ in saved] == list(range(1, stopped)) and checkpoint_verdict(last).ok
    train = [record for record in read_metrics(output / "metrics.jsonl") if record["kind"] == "train"]
    assert all(math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"]) for record in train[:good])
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"causal_lm.py: error: step {stopped}: the "), result.stderr[-3000:]
    assert "the loss is" in lines[0] or "the model's weights hold NaN or infinite values" in lines[0]
    assert f"the last good checkpoint is {last} (step {good}): resume from it with --resume {last}" in lines[0]
    assert not (output / "final").exists() and TRACEBACK not in result.stdout


@pytest.mark.slow
def test_ctrl_c_saves_the_step_exits_130_in_one_line_and_resume_auto_continues(models, tmp_path):
    output = tmp_path / "run"
    args = causal_lm_args(models["llama"], output, "--max-steps", 20, "--save-every", 10)
    launcher = subprocess.Popen(launch_command(FSDP2_CONFIG, CAUSAL_LM, args), cwd=REPO, env=launch_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if sum(record["kind"] == "train" for record in read_metrics(output / "metrics.jsonl")) >= 3:
            break
        time.sleep(0.1)
    os.killpg(launcher.pid, signal.SIGINT)  # what Ctrl-C at a terminal does: the launcher and every rank
    stdout, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == 130, stderr[-3000:]
    lines = error_lines(stderr)
    assert len(lines) == 1 and lines[0].startswith("causal_lm.py: error: interrupted (Ctrl-C) after step "), stderr
    step = int(lines[0].split("after step ")[1].split(":")[0])
    checkpoint = output / "checkpoints" / f"step-{step:08d}"
    assert f"saved {checkpoint}; --resume auto continues from it" in lines[0]
    assert "KeyboardInterrupt" not in stderr + stdout and TRACEBACK not in stderr + stdout
    assert 3 <= step < 20 and checkpoint_verdict(checkpoint).ok
    assert sorted(path.name for path in (output / "checkpoints").iterdir()) == \
        [f"step-{saved:08d}" for saved in sorted({10 * (step // 10), step} - {0})]  # nothing half-written
    assert not (output / "run.lock").exists()
    resumed = run_launch(FSDP2_CONFIG, CAUSAL_LM, args, cwd=REPO, timeout=300).check()
    assert f"resumed from {checkpoint}: step {step}" in resumed.stdout
    train = [record["step"] for record in read_metrics(output / "metrics.jsonl") if record["kind"] == "train"]
    assert train == list(range(1, 21)) and (output / "final" / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_file_size_limit_during_a_save_is_one_line_exit_2_and_leaves_nothing(models, tmp_path):
    """A checkpoint shard past ``ulimit -f`` (torch's writer says only "unexpected pos"): every rank
    stops with one line naming EFBIG and the fix, exit 2 (a limit to raise, as a bad flag is), and no
    half-written folder stays for --resume auto to trip on. Launched for real: the ranks inherit the
    limit from this process."""
    output = tmp_path / "run"
    with file_size_limit(256 * 1024):  # the tiny model's shards are larger; run.json and metrics are not
        result = run_launch(FSDP2_CONFIG, CAUSAL_LM, causal_lm_args(models["llama"], output, "--max-steps", 4,
                                                                    "--save-every", 2),
                            cwd=REPO, timeout=300, forked=False)
    assert result.returncode != 0 and "exitcode  : 2" in result.stderr, result.stderr[-3000:]
    lines = error_lines(result.stderr)
    assert lines and all(line == lines[0] for line in lines), lines
    assert lines[0].startswith(f"causal_lm.py: error: file too large (EFBIG) while saving the checkpoint of step 2 "
                               f"in {output / 'checkpoints'}"), lines
    assert not [line for line in result.stderr.splitlines() if line.startswith("[rank") and "Traceback" in line]
    assert os.listdir(output / "checkpoints") == []


@pytest.mark.slow
def test_a_full_disk_during_save_and_export_says_so_and_keeps_the_last_checkpoint_and_model(models, tmp_path):
    output = tmp_path / "run"

    def launch(max_steps, fault=None):
        env = {"FSDP_PRESETS_FAULT": fault} if fault else {}
        return run_launch(FSDP2_CONFIG, CAUSAL_LM, causal_lm_args(models["llama"], output, "--max-steps", max_steps,
                                                                  "--save-every", 2, "--keep-last", 1),
                          cwd=REPO, timeout=300, env=env)

    # 1. Rank 1's part of the step-4 save hits a full disk (DCP reports it on every rank).
    full_save = launch(4, "full-save:step=4:rank=1")
    assert full_save.returncode == 1, full_save.stderr[-3000:]
    step_2 = output / "checkpoints" / "step-00000002"
    assert error_lines(full_save.stderr) == [
        f"causal_lm.py: error: disk full (ENOSPC) while saving the checkpoint of step 4 in {output / 'checkpoints'}: "
        f"no space left on that file system. The last committed checkpoint, {step_2}, is intact and --resume auto "
        "continues from it. Free space there (delete old runs or checkpoints, lower --keep-last) or give an "
        "--output-dir on a larger disk, then run the same command again"]
    assert os.listdir(output / "checkpoints") == ["step-00000002"] and checkpoint_verdict(step_2).ok
    # 2. Space again: the same command continues from step 2 and finishes.
    assert "resumed from" in launch(4).check().stdout
    final_before = tree_digest(output / "final")
    assert "model.safetensors" in final_before
    # 3. Training on to step 6, the export hits a full disk: the step-4 model stays in final/.
    full_export = launch(6, "full-export")
    assert full_export.returncode == 1, full_export.stderr[-3000:]
    lines = error_lines(full_export.stderr)
    assert len(lines) == 1 and lines[0].startswith(
        f"causal_lm.py: error: disk full (ENOSPC) while exporting the trained model in {output}: ")
    assert f"{output / 'final'} keeps the model it held" in lines[0]
    assert tree_digest(output / "final") == final_before
    assert os.listdir(output / "checkpoints") == ["step-00000006"]
    assert not [name for name in os.listdir(output) if name.startswith(".")]  # no staging left


@pytest.mark.slow
def test_ctrl_c_before_training_starts_is_one_line_and_leaves_nothing_half_written(models, tmp_path):
    output = tmp_path / "run"
    launcher = subprocess.Popen(launch_command(FSDP2_CONFIG, CAUSAL_LM, causal_lm_args(models["llama"], output)),
                                cwd=REPO, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not (output / "run.json").exists():  # written before the first evaluation
        time.sleep(0.02)
    os.killpg(launcher.pid, signal.SIGINT)
    stdout, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == 130, stderr[-3000:]
    lines = error_lines(stderr)
    assert len(lines) == 1 and lines[0].startswith("causal_lm.py: error: interrupted (Ctrl-C) "), stderr[-3000:]
    assert "KeyboardInterrupt" not in stderr + stdout and TRACEBACK not in stderr + stdout
    assert not (output / "run.lock").exists()
    # No temporary file or folder. (A signal that lands after the first step instead saves that
    # step, a committed checkpoint whose DCP folders hold their own ``.metadata``.)
    assert not [path for path in output.rglob("*") if path.name.startswith(".") and path.name != DCP_METADATA]
