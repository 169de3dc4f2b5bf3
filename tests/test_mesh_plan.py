"""A second dimension beside FSDP: tensor parallelism (TP) and, for mixture-of-experts models,
expert parallelism (EP), planned (fsdp_presets/plan/mesh_plan.py) and rehearsed through
transformers' own ``DistributedConfig`` sharding on a fake 2-D mesh (fsdp_presets/rehearse).

The agreement tests rehearse shipped configs cut to 4 blocks at 1,024 tokens, as
tests/test_planner_rehearsed.py does for FSDP alone (the planner composes per-block terms, so a
4-block model tests the composition as an 80-block one does); docs/parallelism.md records the
same comparison at full size (``python -m fsdp_harness.mesh_agreement``)."""

from __future__ import annotations

import json
import shutil

import pytest

from fsdp_presets.cli import main
from fsdp_presets.fileio import GiB
from fsdp_presets.model.profile import profile_model
from fsdp_presets.plan.gpus import gpu_type
from fsdp_presets.plan.mesh_plan import sliced_profile
from fsdp_presets.plan.planner import meshes_for, plan
from fsdp_presets.plan.shapes import Hardware, TrainingShape
from fsdp_presets.rehearse.mesh import Mesh

from conftest import REPO

LAYERS, SEQ = 4, 1024


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([*map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def profiles():
    return {name: profile_model(str(REPO / "model_configs" / name))
            for name in ("llama-3.1-8b", "llama-3.1-70b", "mixtral-8x7b")}


def test_mesh_problems_name_what_refuses_it(profiles):
    llama = profiles["llama-3.1-8b"].structure["parallel"]
    mixtral = profiles["mixtral-8x7b"].structure["parallel"]
    assert Mesh(tp=8).problems(llama, gpus=64, gpus_per_node=8) == []
    assert "does not divide the model's attention heads 32" in " ".join(Mesh(tp=3).problems(llama, gpus=6, gpus_per_node=6))
    assert "spans nodes" in " ".join(Mesh(tp=16).problems(llama, gpus=64, gpus_per_node=8))
    assert "no expert-parallel plan" in " ".join(Mesh(ep=2).problems(llama, gpus=8, gpus_per_node=8))
    assert "does not divide the model's 8 experts" in " ".join(Mesh(ep=3).problems(mixtral, gpus=6, gpus_per_node=6))
    assert "does not divide the 12 GPUs" in " ".join(Mesh(tp=8).problems(llama, gpus=12, gpus_per_node=12))
    assert Mesh(tp=8).sizes(gpus=64) == {"dp_replicate_size": 1, "fsdp_size": 8, "tp_size": 8, "ep_size": 1}
    assert Mesh(tp=2).sizes(gpus=64, nodes=8, hybrid=True)["fsdp_size"] == 4
    assert Mesh(tp=2).label(gpus=64, nodes=8, hybrid=True) == "HSDP 8 x FSDP 4 x TP 2"


def test_a_tp_rank_holds_a_tp_share_and_an_ep_rank_its_experts(profiles):
    llama = profiles["llama-3.1-8b"]
    sliced = sliced_profile(llama, Mesh(tp=8))
    assert abs(sliced.total_params * 8 / llama.total_params - 1) < 1e-3
    assert (sliced.dims.num_attention_heads, sliced.dims.num_key_value_heads) == (4, 1)
    mixtral = profiles["mixtral-8x7b"]
    experts = mixtral.structure["moe"]["routed_expert_params"] // mixtral.structure["moe"]["moe_layers"]
    block = mixtral.units[0].params_each
    assert sliced_profile(mixtral, Mesh(ep=8)).units[0].params_each == block - experts + experts // 8


def test_plan_json_rows_name_their_mesh(capsys):
    code, out, _ = run_cli(capsys, "plan", REPO / "model_configs" / "mixtral-8x7b", "--gpus", 16, "--nodes", 2,
                           "--activation-checkpointing", "on", "--json")
    assert code == 0
    document = json.loads(out)
    meshes = {(row["tp_size"], row["ep_size"]) for row in document["strategies"]}
    assert {(1, 1), (2, 1), (8, 1), (1, 8)} <= meshes  # Mixtral allows TP up to 8 (8 key/value heads), EP up to 8
    labels = [row["label"] for row in document["strategies"]]
    assert len(labels) == len(set(labels)) and "HSDP 2 x FSDP 8 x EP 8" in labels
    recommended = document["recommended"]
    assert recommended["label"] in labels
    row = next(row for row in document["strategies"] if row["label"] == recommended["label"])
    assert row["fits"] and (row["tp_size"], row["ep_size"]) == (recommended["tp_size"], recommended["ep_size"])


def test_plan_refuses_a_tp_size_the_model_does_not_allow(capsys):
    code, _, err = run_cli(capsys, "plan", REPO / "model_configs" / "llama-3.1-8b", "--gpus", 8, "--tp", 3)
    assert code == 2
    assert "TP 3 does not divide the model's attention heads 32" in err and "fsdp-presets inspect" in err


def test_70b_on_64_gpus_without_checkpointing_needs_a_second_dimension(profiles):
    """FSDP alone cannot hold 70B's activations at 2,048 tokens on 64 x 80 GB; a TP mesh inside the
    node can, and the plan says what it costs."""
    hardware = Hardware(gpus=64, nodes=8, gpu_memory_bytes=80 * GiB, gpu=gpu_type("H100-SXM"))
    profile = profiles["llama-3.1-70b"]
    memory_plan = plan(profile, hardware, TrainingShape(seq_len=2048), meshes_for(profile, hardware))
    assert not any(row.fits for row in memory_plan.strategies if not row.is_nd)
    best = memory_plan.recommended
    assert best is not None and best.tp_size > 1 and best.fits
    assert best.mesh_comm.total > 0 and best.mesh_comm.inter_node == 0  # TP traffic stays inside the node
    assert best.label in memory_plan.reason


@pytest.fixture(scope="module")
def rehearsal_cache(tmp_path_factory):
    """Rehearsals on, the cache in a temporary folder (never the user's)."""
    folder = tmp_path_factory.mktemp("fsdp-presets-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FSDP_PRESETS_CACHE", str(folder))
        patch.setenv("FSDP_PRESETS_PLAN_REHEARSAL", "on")
        yield folder


def _cut(tmp_path, name: str) -> str:
    config = json.loads((REPO / "model_configs" / name / "config.json").read_text())
    config["num_hidden_layers"] = LAYERS
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


AGREEMENT = [  # (model, GPUs, --tp or --ep, size)
    ("llama-3.1-8b", 8, "--tp", 2), ("llama-3.1-8b", 64, "--tp", 8),
    ("qwen2.5-7b", 8, "--tp", 4), ("qwen2.5-7b", 64, "--tp", 4),
    ("mixtral-8x7b", 8, "--ep", 8), ("mixtral-8x7b", 64, "--ep", 4),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,gpus,flag,size", AGREEMENT)
def test_planned_mesh_matches_its_rehearsal(rehearsal_cache, tmp_path, capsys, name, gpus, flag, size):
    """The planner's per-GPU total on an FSDP x TP (x EP) mesh, composed from a short rehearsal on
    that mesh, within 10% of a rehearsed step of the whole (cut) model on it."""
    code, out, err = run_cli(capsys, "rehearse", _cut(tmp_path, name), "--gpus", gpus, "--nodes", max(1, gpus // 8),
                             "--strategy", "full", flag, size, "--seq-len", SEQ, "--json")
    assert code in (0, 1), err
    document = json.loads(out)
    assert (document["tp_size"], document["ep_size"]) == ((size, 1) if flag == "--tp" else (1, size))
    assert abs(document["planner_difference"]) <= 0.10, document


@pytest.mark.slow
def test_the_recommended_70b_mesh_fits_when_rehearsed(capsys):
    """``plan``'s recommendation for 70B on 64 x 80 GB without checkpointing, rehearsed at full size
    on its mesh: it fits."""
    code, out, _ = run_cli(capsys, "plan", REPO / "model_configs" / "llama-3.1-70b", "--gpus", 64, "--nodes", 8,
                           "--seq-len", 2048, "--activation-checkpointing", "off", "--json")
    assert code == 0
    recommended = json.loads(out)["recommended"]
    assert recommended["tp_size"] > 1
    code, out, err = run_cli(capsys, "rehearse", REPO / "model_configs" / "llama-3.1-70b", "--gpus", 64, "--nodes", 8,
                             "--strategy", "full", "--tp", recommended["tp_size"], "--seq-len", 2048, "--json")
    assert code == 0, err
    document = json.loads(out)
    assert document["fits"] and document["strategy"] == recommended["label"]


def test_rehearse_refuses_a_mesh_on_a_preset(capsys, tmp_path):
    preset = tmp_path / "p.yaml"
    shutil.copy(REPO / "accelerate_configs" / "llama-3.1-8b_1x8.yaml", preset)
    code, _, err = run_cli(capsys, "rehearse", preset, "--tp", 2)
    assert code == 2 and "a preset file fixes its mesh" in err


def test_a_mesh_on_a_cpu_host_is_refused(capsys):
    code, _, err = run_cli(capsys, "plan", "llama", "--device", "cpu", "--gpus", 4, "--tp", 2)
    assert code == 2 and "--tp/--ep with --device cpu" in err
