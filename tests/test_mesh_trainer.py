"""A Trainer script on a TP/EP preset: recipes/sft_trainer.py (TRL's SFTTrainer with
FSDPPresetsCallback) ``--distributed-config NAME.distributed.json``, launched with the
``NAME.trainer.yaml`` that ``fsdp-presets generate --tp/--ep`` writes (DDP type, every rank of the
mesh), trains a tiny Llama as FSDP 2 x TP 2 on 4 processes and a tiny Mixtral as FSDP 2 x EP 2 on 2,
each within the fp32 tolerance of its Trainer DDP baseline (the same recipe without the mesh, one
process per TP group, the same micro-batch and global batch) over 20 steps; run.json records the
mesh and the logged loss and tokens count a TP group's samples once. The callback checkpoints these
runs whole (transformers alone refuses): each mesh run SIGKILLed in a save and resumed is the
uninterrupted run bit for bit, the TP run's checkpoint resumes as plain FSDP2 on 2 processes within
tolerance, and its last checkpoint exported is the weights ``final/`` gathered; a user's Trainer script
on the EP mesh with ``load_best_model_at_end`` ends with the best checkpoint's weights. Without the
``parallelism-config-multi-cpu`` patch of ``enable_cpu_fsdp()`` accelerate refuses the TP run on
CPU, and a launch under the FSDP config is refused before anything is written.

Launches (forked, tests/conftest.py): the two mesh runs (saving every 10 steps) and their two
baselines, shared by the tests; per mesh a run killed in the save of step 10 and its resume; the TP
checkpoint resumed under FSDP2; the user's script on the EP mesh, 6 steps; the TP run without the
patch and the EP run under its FSDP config, 1 step each.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from fsdp_harness.launch import run_launch
from fsdp_harness.tiny_model import write_tiny_model
from safetensors.torch import load_file

from fsdp_presets.checkpoint.layout import DCP_MODEL, DCP_OPTIMIZER, MANIFEST, RUN_JSON
from fsdp_presets.checkpoint.manifest import Manifest
from fsdp_presets.cli import main as cli_main
from fsdp_presets.compare.records import load_run
from fsdp_presets.compare.report import summary_lines
from fsdp_presets.compare.runs import compare_runs
from fsdp_presets.cpu_fsdp import PARALLELISM_MULTI_CPU, PATCHES_OFF_ENV
from fsdp_presets.faults import FAULT_ENV
from fsdp_presets.train.metrics import read_metrics
from recipe_helpers import REPO, SFT_TRAIN, SFT_TRAINER

from conftest import GLOO_EXIT_ABORT, accelerate_config

TRAINER_USER = REPO / "tests" / "workers" / "trainer_user.py"
STEPS = 20
SAVE_EVERY = 10

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                                 reason="trl is not installed (pip install --no-deps trl==1.16.0)")]


@pytest.fixture(scope="module")
def mesh_presets(tmp_path_factory) -> dict[str, Path]:
    """Tiny Llama and Mixtral folders and their mesh presets, as a user makes them."""
    root = tmp_path_factory.mktemp("mesh_presets")
    text = SFT_TRAIN.read_text()
    llama = write_tiny_model(root / "tiny-llama", kind="llama", text=text)
    moe = write_tiny_model(root / "tiny-moe", kind="mixtral", text=text)
    for name, model, flags in (("tp2", llama, ("--gpus", "4", "--tp", "2")), ("ep2", moe, ("--gpus", "2", "--ep", "2"))):
        assert cli_main(["generate", str(model), "--device", "cpu", *flags, "--seq-len", "32", "--global-batch", "4",
                         "--baseline", "ddp", "-o", str(root / f"{name}.yaml")]) == 0
    return {"llama": llama, "moe": moe, "root": root}


def _sft(config: Path, model: Path, output: Path, *extra, steps: int = STEPS, env: dict | None = None,
         resume: str = "none"):
    args = ["--model", str(model), "--data", str(SFT_TRAIN), "--output-dir", str(output), "--max-steps", str(steps),
            "--seq-len", "32", "--micro-batch", "2", "--learning-rate", "1e-3", "--resume", resume, *map(str, extra)]
    return run_launch(config, SFT_TRAINER, args, cwd=REPO, env=env)


@pytest.fixture(scope="module")
def mesh_runs(mesh_presets, tmp_path_factory) -> dict[str, Path]:
    """Each mesh under its NAME.trainer.yaml, and its DDP baseline (NAME.ddp.yaml, no mesh)."""
    root, runs = tmp_path_factory.mktemp("mesh_runs"), {}
    for name, model in (("tp2", mesh_presets["llama"]), ("ep2", mesh_presets["moe"])):
        presets = mesh_presets["root"]
        for run, config, extra in ((name, presets / f"{name}.trainer.yaml",
                                    ("--distributed-config", presets / f"{name}.distributed.json", "--save-every",
                                     SAVE_EVERY)),
                                   (f"{name}-ddp", presets / f"{name}.ddp.yaml", ())):
            runs[run] = root / run
            result = _sft(config, model, runs[run], *extra)
            result.check()
            assert GLOO_EXIT_ABORT not in result.stderr
    return runs


def _agrees(capsys, baseline: Path, candidate: Path) -> str:
    capsys.readouterr()
    code = cli_main(["compare", str(baseline), str(candidate)])
    out = capsys.readouterr().out
    assert code == 0 and "AGREE within tolerance" in out, out
    return out


def _tokens(run: Path) -> list[float]:
    """Tokens of every step, summed over the ranks (tokens/s x step time)."""
    return [round(line["tokens_per_s"] * line["step_time_s"], 3) for line in read_metrics(run / "metrics.jsonl")
            if line["kind"] == "train"]


@pytest.mark.parametrize("name,world,mesh", [
    ("tp2", 4, {"dp_replicate_size": 1, "fsdp_size": 2, "tp_size": 2, "ep_size": 1}),
    ("ep2", 2, {"dp_replicate_size": 1, "fsdp_size": 2, "tp_size": 1, "ep_size": 2}),
], ids=["fsdp2-x-tp2", "fsdp2-x-ep2"])
def test_a_trainer_on_a_mesh_trains_like_its_ddp_baseline(mesh_runs, capsys, name, world, mesh):
    run, baseline = mesh_runs[name], mesh_runs[f"{name}-ddp"]
    report = _agrees(capsys, baseline, run)  # loss 1e-6, grad_norm 1e-5 relative (fp32)
    assert re.search(rf"loss +(within_tolerance|identical) +{STEPS} steps", report), report
    # each sample counted once: a TP group's 2 ranks computed the same tokens, logged once
    assert _tokens(run) == _tokens(baseline) and len(_tokens(run)) == STEPS
    settings = json.loads((run / RUN_JSON).read_text())
    assert settings["model_mesh"] == {"file": None, **mesh}
    assert (settings["world_size"], settings["data_parallel_size"], settings["global_batch_samples"]) == (world, 2, 4)
    assert json.loads((baseline / RUN_JSON).read_text()).get("model_mesh") is None
    assert (run / "final" / "model.safetensors").is_file()
    for step in (SAVE_EVERY, STEPS):  # whole checkpoints, committed (transformers alone refuses to write them)
        folder = run / f"checkpoint-{step}"
        assert (folder / MANIFEST).is_file() and (folder / DCP_MODEL).is_dir() and (folder / DCP_OPTIMIZER).is_dir()
        assert len(list(folder.glob("rng_state_*.pth"))) == world and (folder / "scheduler.pt").is_file()
        assert Manifest.read(folder).model_mesh == settings["model_mesh"]
    capsys.readouterr()
    assert cli_main(["inspect-checkpoint", str(run / f"checkpoint-{STEPS}"), "--gpus", "2"]) == 0
    out = capsys.readouterr().out
    label = {"tp2": "FSDP 2 x TP 2", "ep2": "FSDP 2 x EP 2"}[name]  # not "DDP": the launch type alone misleads
    assert f"saved by    {world} process(es), {label}, sharded by transformers at load time" in out
    # 2 processes: too few for TP 2 with data-parallel ranks, one EP group of 2; FSDP2 alone keeps the
    # global batch of 4 either way
    on_mesh = {"tp2": "on FSDP 1 x TP 2: 2 processes do not make 2 or more data-parallel ranks",
               "ep2": "on FSDP 2 x EP 2: the global batch of 4 samples stays"}[name]
    assert "resume at 2 GPU(s): yes" in out and on_mesh in out and "as FSDP2 alone: the global batch of 4 samples" in out


@pytest.mark.parametrize("name,model", [("tp2", "llama"), ("ep2", "moe")], ids=["fsdp2-x-tp2", "fsdp2-x-ep2"])
def test_a_trainer_on_a_mesh_killed_in_a_save_and_resumed_is_the_uninterrupted_run_bit_for_bit(
        mesh_presets, mesh_runs, tmp_path, name, model):
    presets, output = mesh_presets["root"], tmp_path / name
    mesh = ("--distributed-config", presets / f"{name}.distributed.json", "--save-every", 5)
    killed = _sft(presets / f"{name}.trainer.yaml", mesh_presets[model], output, *mesh, steps=STEPS,
                  env={FAULT_ENV: "kill-during-save:step=10"})
    assert killed.returncode != 0 and "[fault] kill at during-save, step 10" in killed.stdout
    assert (output / "checkpoint-10").is_dir() and not (output / "checkpoint-10" / MANIFEST).exists()
    resumed = _sft(presets / f"{name}.trainer.yaml", mesh_presets[model], output, *mesh, resume="auto")
    resumed.check()
    assert json.loads((output / RUN_JSON).read_text())["resumed_from"] == str(output / "checkpoint-5")
    uninterrupted = compare_runs(load_run(mesh_runs[name]), load_run(output))
    assert uninterrupted.verdict == "identical", summary_lines(uninterrupted)


def test_a_trainer_mesh_checkpoint_resumes_under_fsdp2_and_exports_the_gathered_weights(
        mesh_presets, mesh_runs, capsys, tmp_path):
    """FSDP 2 x TP 2 -> FSDP2 on 2 processes (no TP, the same data-parallel ranks and global batch):
    DCP reshards the 2-D DTensors; accelerate's own FSDP2 load reads the callback's folders."""
    run, output = mesh_runs["tp2"], tmp_path / "fsdp2-from-tp"
    _sft(accelerate_config(tmp_path, "fsdp2"), mesh_presets["llama"], output,
         resume=str(run / f"checkpoint-{SAVE_EVERY}")).check()
    assert json.loads((output / RUN_JSON).read_text())["fsdp"]["version"] == 2
    report = _agrees(capsys, mesh_runs["tp2-ddp"], output)
    assert re.search(rf"loss +(within_tolerance|identical) +{STEPS - SAVE_EVERY} steps", report), report
    exported = tmp_path / "exported"
    assert cli_main(["export", str(run / f"checkpoint-{STEPS}"), "--output", str(exported)]) == 0
    final, written = load_file(run / "final" / "model.safetensors"), load_file(exported / "model.safetensors")
    assert sorted(final) == sorted(written) and all(final[key].equal(written[key]) for key in final)


def test_load_best_model_at_end_on_a_mesh_loads_the_best_checkpoints_weights(mesh_presets, tmp_path):
    """A user's Trainer script on the EP mesh with ``load_best_model_at_end``: Trainer alone finds no
    weights file in a DCP checkpoint, warns and keeps the last weights; with the callback ``final/``
    holds the best checkpoint's. The best is made the first (the highest evaluation loss), so the
    last weights cannot pass for it."""
    presets, output = mesh_presets["root"], tmp_path / "best"
    result = run_launch(presets / "ep2.trainer.yaml", TRAINER_USER, [
        "--model", mesh_presets["moe"], "--data", SFT_TRAIN, "--output-dir", output, "--max-steps", 6,
        "--save-steps", 3, "--distributed-config", presets / "ep2.distributed.json", "--best-is-first"], cwd=REPO)
    result.check()
    assert "Could not locate the best model" not in result.stdout + result.stderr
    state = json.loads((output / "checkpoint-6" / "trainer_state.json").read_text())
    assert Path(state["best_model_checkpoint"]).name == "checkpoint-3"
    final = load_file(output / "final" / "model.safetensors")
    for step, same in ((3, True), (6, False)):
        exported = tmp_path / f"exported-{step}"
        assert cli_main(["export", str(output / f"checkpoint-{step}"), "--output", str(exported)]) == 0
        written = load_file(exported / "model.safetensors")
        assert all(written[key].equal(final[key]) for key in final) == same, step


def test_the_tp_run_needs_the_parallelism_config_patch(mesh_presets, tmp_path):
    """accelerate refuses transformers' ParallelismConfig(tp_size, dp_shard_size) under MULTI_CPU."""
    presets = mesh_presets["root"]
    result = _sft(presets / "tp2.trainer.yaml", mesh_presets["llama"], tmp_path / "off", "--distributed-config",
                  presets / "tp2.distributed.json", steps=1, env={PATCHES_OFF_ENV: PARALLELISM_MULTI_CPU})
    assert result.returncode != 0
    assert "ParallelismConfig is only compatible" in result.stderr and "MULTI_CPU" in result.stderr


@pytest.mark.slow
def test_a_trainer_config_of_a_mesh_with_a_model_loaded_whole_is_refused(mesh_presets, tmp_path):
    """NAME.trainer.yaml is DDP-type: with a model loaded without the mesh every process would hold it
    whole (the plan was the mesh). One line naming the file to load, exit 2, before a step."""
    presets = mesh_presets["root"]
    output = tmp_path / "whole"
    result = _sft(presets / "ep2.trainer.yaml", mesh_presets["moe"], output, steps=1)
    assert result.returncode != 0 and "exitcode: 2" in result.stderr, result.stderr[-3000:]
    text = " ".join((result.stdout + result.stderr).split())
    assert "the model was loaded without that mesh" in text and str(presets / "ep2.distributed.json") in text
    assert not (output / "metrics.jsonl").exists()


def test_a_mesh_trainer_under_the_fsdp_config_is_refused(mesh_presets, tmp_path):
    """The Trainer would prepare its optimizer alone, which accelerate refuses under FSDP: one line,
    naming the config to launch with, exit 2, before a step is taken."""
    presets = mesh_presets["root"]
    output = tmp_path / "under-fsdp"
    result = _sft(presets / "ep2.yaml", mesh_presets["moe"], output, "--distributed-config",
                  presets / "ep2.distributed.json", steps=1)
    assert result.returncode != 0 and "exitcode: 2" in result.stderr, result.stderr[-3000:]
    assert str(presets / "ep2.trainer.yaml") in " ".join((result.stdout + result.stderr).split())
    assert "an optimizer must be passed together" not in result.stderr
    assert not (output / "metrics.jsonl").exists()
