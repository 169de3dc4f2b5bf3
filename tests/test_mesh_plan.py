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
import yaml

from fsdp_presets.cli import main
from fsdp_presets.fileio import GiB
from fsdp_presets.model.profile import profile_model
from fsdp_presets.plan.gpus import gpu_type
from fsdp_presets.plan.mesh_plan import meshes_for, sliced_profile
from fsdp_presets.plan.planner import plan
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


def test_plan_has_no_mesh_for_lora_or_fp16_as_generate_has_none(capsys):
    """A mesh is planned for full fine-tuning in bf16/fp32 (what generate and the recipes run): plan
    refuses --tp/--ep with LoRA or fp16 in one line, and plans no mesh row of its own for them (a
    row with LoRA's gradients and full fine-tuning's optimizer state is neither run)."""
    model = REPO / "model_configs" / "llama-3.1-8b"
    for flags, message in ((("--method", "lora"), "--method lora with --tp/--ep: a mesh is planned for full"),
                           (("--precision", "fp16"), "--precision fp16 with --tp/--ep")):
        code, out, err = run_cli(capsys, "plan", model, "--gpus", 16, "--tp", 2, *flags)
        assert code == 2 and message in err and not out
    for flags in (("--method", "qlora"), ("--precision", "fp16")):
        code, out, _ = run_cli(capsys, "plan", model, "--gpus", 16, *flags, "--json")
        assert code == 0
        document = json.loads(out)
        assert {(row["tp_size"], row["ep_size"]) for row in document["strategies"]} == {(1, 1)}
    code, out, _ = run_cli(capsys, "plan", model, "--gpus", 16, "--json")
    assert {row["tp_size"] for row in json.loads(out)["strategies"]} > {1}  # full fine-tuning in bf16 has them


def test_70b_on_64_gpus_without_checkpointing_needs_a_second_dimension(profiles):
    """FSDP alone cannot hold 70B's activations at 2,048 tokens on 64 x 80 GB; a TP mesh inside the
    node can, and the plan says what it costs."""
    hardware = Hardware(gpus=64, nodes=8, gpu_memory_bytes=80 * GiB, gpu=gpu_type("H100-SXM"))
    profile = profiles["llama-3.1-70b"]
    memory_plan = plan(profile, hardware, TrainingShape(seq_len=2048), meshes_for(profile, hardware, TrainingShape(seq_len=2048)))
    assert not any(row.fits for row in memory_plan.strategies if not row.is_nd)
    best = memory_plan.recommended
    assert best is not None and best.tp_size > 1 and best.fits
    assert best.mesh_comm.total > 0 and best.mesh_comm.inter_node == 0  # TP traffic stays inside the node
    assert best.label in memory_plan.reason


def _cut(tmp_path, name: str) -> str:
    config = json.loads((REPO / "model_configs" / name / "config.json").read_text())
    config["num_hidden_layers"] = LAYERS
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


AGREEMENT = [  # (model, GPUs, --tp or --ep, size): TP across nodes, EP; the other families and meshes are
    # held at full size by the benchmark (docs/parallelism.md, python -m fsdp_harness.mesh_agreement)
    ("llama-3.1-8b", 64, "--tp", 8), ("mixtral-8x7b", 8, "--ep", 8),
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
def test_the_optimizer_step_on_local_shards_is_dtensors_own_step(capsys, tmp_path, monkeypatch):
    """The rehearsal runs AdamW on each parameter's local shard (fsdp_presets/rehearse/rehearsal.py,
    a shortcut past DTensor's sharding propagation): the rehearsal is the one DTensor's own step
    gives, byte for byte, for FSDP2 through accelerate and for FSDP x TP and FSDP x EP meshes."""
    import contextlib

    from torch.distributed.tensor import DTensor

    from fsdp_presets.rehearse import rehearsal

    shortcut, engaged = rehearsal._on_local_shards, []

    @contextlib.contextmanager
    def watched(optimizer):
        with shortcut(optimizer):
            inner = getattr(optimizer, "optimizer", optimizer)
            engaged.append(not any(isinstance(parameter, DTensor) for group in inner.param_groups
                                   for parameter in group["params"]))
            yield

    cases = [("llama", "--gpus", 2, "--seq-len", 64, "--grad-accum", 2),
             (_cut(tmp_path, "llama-3.1-8b"), "--gpus", 8, "--tp", 2, "--seq-len", 256, "--strategy", "full"),
             (_cut(tmp_path, "mixtral-8x7b"), "--gpus", 8, "--ep", 8, "--seq-len", 256, "--strategy", "full")]

    def rehearsed(case) -> dict:
        code, out, err = run_cli(capsys, "rehearse", *case, "--json")
        assert code in (0, 1), err
        document = json.loads(out)
        document["rehearsal"].pop("seconds")
        return document

    monkeypatch.setattr(rehearsal, "_on_local_shards", watched)
    on_local_shards = [rehearsed(case) for case in cases]
    assert engaged == [True] * 2 * len(cases)  # the state-creating step and the rehearsed one, each case
    monkeypatch.setattr(rehearsal, "_on_local_shards", lambda optimizer: contextlib.nullcontext())
    assert [rehearsed(case) for case in cases] == on_local_shards


@pytest.mark.slow
def test_the_recommended_70b_mesh_fits_when_rehearsed(capsys):
    """``plan``'s recommendation for 70B on 64 x 80 GB without checkpointing (planned as the suite
    plans, from the family constants), rehearsed at full size on its mesh: it fits."""
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


# --------------------------------------------------------------------------- generate --tp / --ep


def test_generate_writes_the_mesh_in_both_forms_each_loaded_by_its_own_library(capsys, tmp_path):
    """``generate --tp 8``: the accelerate YAML (read back by accelerate's own loader) and beside it
    ``NAME.distributed.json``, whose keys are DistributedConfig's arguments (read by transformers'
    own loader), both carrying where they came from; regenerating rewrites both."""
    from transformers.distributed.configuration_utils import DistributedConfig

    from fsdp_presets.preset.accelerate_view import accelerate_view
    from fsdp_presets.preset.emit import read_metadata
    from fsdp_presets.preset.emit_distributed import HEADER_KEY

    output = tmp_path / "l70.yaml"
    argv = ("generate", REPO / "model_configs" / "llama-3.1-70b", "--gpus", 64, "--nodes", 8, "--tp", 8,
            "--seq-len", 2048, "--activation-checkpointing", "off", "-o", output)
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    json_path = tmp_path / "l70.distributed.json"
    assert f"wrote {json_path}" in out and "launch: accelerate launch --config_file" in out
    document = json.loads(json_path.read_text())
    config = DistributedConfig.from_dict(document)
    assert (config.fsdp_size, config.tp_size, config.ep_size, config.dp_replicate_size) == (8, 8, 1, 1)
    assert config.fsdp_mixed_precision and not config.fsdp_cpu_offload
    assert document[HEADER_KEY]["metadata"]["request"]["tp"] == 8
    text = output.read_text()
    assert read_metadata(text)["summary"]["sharding"] == "FSDP 8 x TP 8"
    assert "--tp 8" in text and "FSDP 8 x TP 8" in text and "distributed_config=config" in text
    view = accelerate_view(output)
    assert view.env["ACCELERATE_USE_FSDP"] == "true"
    # 8 data-parallel ranks (a TP group shares its batch): 256 sequences of 2,048 tokens = 0.5M
    assert read_metadata(text)["summary"]["data_parallel_size"] == 8
    # and the config a Trainer script launches with: DDP type, every rank of the mesh, named by the header
    trainer_path = tmp_path / "l70.trainer.yaml"
    trainer_text = trainer_path.read_text()
    assert f"wrote {trainer_path}" in out and str(trainer_path) in " ".join(text.replace("#", " ").split())
    trainer = yaml.safe_load(trainer_text)
    assert (trainer["distributed_type"], trainer["num_processes"], trainer["num_machines"]) == ("MULTI_GPU", 64, 8)
    assert "fsdp_config" not in trainer and "ACCELERATE_USE_FSDP" not in accelerate_view(trainer_path).env
    assert read_metadata(trainer_text)["kind"] == "trainer" and "recipes/sft_trainer.py" in trainer_text
    assert run_cli(capsys, *argv)[0] == 0  # its own files: rewritten
    json_path.write_text('{"tp_size": 2}\n')  # a hand-written one is not replaced
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and "was not written by fsdp-presets generate" in err and json_path.read_text() == '{"tp_size": 2}\n'


def test_a_pair_that_runs_accelerates_tp_gets_the_mesh_in_the_yaml_too(capsys, tmp_path, monkeypatch):
    from fsdp_presets.preset.accelerate_view import accelerate_view
    from fsdp_presets.rehearse import mesh

    monkeypatch.setattr(mesh, "accelerate_tp_import_problem", lambda: None)
    output = tmp_path / "l8.yaml"
    code, _, err = run_cli(capsys, "generate", REPO / "model_configs" / "llama-3.1-8b", "--gpus", 8, "--tp", 2,
                           "-o", output)
    assert code == 0, err
    env = accelerate_view(output).env
    assert (env["PARALLELISM_CONFIG_TP_SIZE"], env["PARALLELISM_CONFIG_DP_SHARD_SIZE"]) == ("2", "4")


def test_an_expert_parallel_preset_loads_on_every_rank(capsys, tmp_path):
    """transformers issue 45662: EP under RAM-efficient loading gives every rank rank 0's experts."""
    import yaml

    output = tmp_path / "mx.yaml"
    code, _, err = run_cli(capsys, "generate", REPO / "model_configs" / "mixtral-8x7b", "--gpus", 64, "--nodes", 8,
                           "--ep", 8, "--seq-len", 1024, "-o", output)
    assert code == 0, err
    assert yaml.safe_load(output.read_text())["fsdp_config"]["fsdp_cpu_ram_efficient_loading"] is False
    assert json.loads((tmp_path / "mx.distributed.json").read_text())["ep_size"] == 8
    assert yaml.safe_load((tmp_path / "mx.trainer.yaml").read_text())["num_processes"] == 64


def test_a_preset_without_a_mesh_writes_no_trainer_config(capsys, tmp_path):
    code, out, err = run_cli(capsys, "generate", "llama", "--device", "cpu", "--gpus", 2, "--seq-len", 32,
                             "--baseline", "ddp", "-o", tmp_path / "plain.yaml")
    assert code == 0, err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["plain.ddp.yaml", "plain.yaml"]
    assert "trainer" not in out


@pytest.mark.parametrize("flags,message", [
    (("--tp", 3), "TP 3 does not divide"),
    (("--tp", 2, "--fsdp-version", 1), "drop --fsdp-version 1"),
    (("--tp", 2, "--method", "lora"), "planned for full fine-tuning"),
    (("--ep", 2), "no expert-parallel plan"),
    (("--tp", 16), "TP 16 does not divide the 8 GPUs that shard one copy"),  # more TP ranks than GPUs
    (("--tp", 8, "--device", "cpu", "--gpus", 4), "TP 8 does not divide the 4 GPUs"),
])
def test_generate_refuses_a_mesh_it_cannot_plan(capsys, tmp_path, flags, message):
    code, _, err = run_cli(capsys, "generate", REPO / "model_configs" / "llama-3.1-8b", "--gpus", 8, *flags,
                           "-o", tmp_path / "x.yaml")
    assert code == 2 and message in err and not list(tmp_path.iterdir())


def test_a_mesh_preset_rescaled_keeps_its_batch_over_its_data_parallel_ranks(capsys, tmp_path):
    # TP 8 on 16 GPUs: 2 data-parallel ranks share a global batch of 6 sequences. On 24 GPUs there are 3
    # (6 divides over them, not over 24 GPUs); on 32 there are 4, which 6 does not divide.
    preset = tmp_path / "tp8.yaml"
    assert run_cli(capsys, "generate", REPO / "model_configs" / "llama-3.1-8b", "--gpus", 16, "--nodes", 2, "--tp", 8,
                   "--global-batch", 6, "-o", preset)[0] == 0
    code, out, err = run_cli(capsys, "generate", "--from", preset, "--gpus", 24, "-o", tmp_path / "tp8_24.yaml")
    assert code == 0 and "global batch 6 sequences kept" in out, err
    assert json.loads((tmp_path / "tp8_24.distributed.json").read_text())["tp_size"] == 8
    code, _, err = run_cli(capsys, "generate", "--from", preset, "--gpus", 32, "-o", tmp_path / "tp8_32.yaml")
    assert code == 2 and "does not divide over 4 data-parallel ranks (one per TP group of 8 GPUs)" in err
    assert not (tmp_path / "tp8_32.yaml").exists()


def test_check_plans_a_mesh_preset_on_the_mesh_beside_it(capsys, tmp_path):
    # 70B at 64 GPUs without checkpointing fits as FSDP 8 x TP 8 only: the accelerate config alone
    # (FULL_SHARD over 64) does not, so a check that left out NAME.distributed.json warned does-not-fit.
    preset = tmp_path / "tp8.yaml"
    assert run_cli(capsys, "generate", REPO / "model_configs" / "llama-3.1-70b", "--gpus", 64, "--nodes", 8,
                   "--tp", 8, "--activation-checkpointing", "off", "-o", preset)[0] == 0
    check = ("check", preset, "--model", REPO / "model_configs" / "llama-3.1-70b", "--json", "--no-probe")
    code, out, _ = run_cli(capsys, *check)
    findings = {item["rule"]: item for item in json.loads(out)["files"][0]["findings"]}
    assert code == 0 and set(findings) == {"distributed-config-mesh"}, findings
    assert "FSDP 8 x TP 8" in findings["distributed-config-mesh"]["message"]
    sidecar = tmp_path / "tp8.distributed.json"
    edited = {**json.loads(sidecar.read_text()), "tp_size": 4}  # 8 x 4 = 32 ranks for 64 processes
    sidecar.write_text(json.dumps(edited))
    code, out, _ = run_cli(capsys, *check)
    assert code == 1 and "distributed-config-vs-processes" in rules(out)
    sidecar.write_text("{")
    code, out, _ = run_cli(capsys, *check)
    assert code == 1 and "distributed-config-invalid" in rules(out)
    sidecar.unlink()  # without it: the config alone, FULL_SHARD over 64 GPUs
    code, out, _ = run_cli(capsys, *check)
    assert "does-not-fit" in rules(out)


def rules(check_json: str) -> set[str]:
    return {item["rule"] for item in json.loads(check_json)["files"][0]["findings"]}


def test_a_generated_mesh_preset_is_rehearsed_on_its_mesh(capsys, tmp_path):
    output = tmp_path / "tiny.yaml"
    assert run_cli(capsys, "generate", "llama", "--gpus", 4, "--tp", 2, "--seq-len", 64, "-o", output)[0] == 0
    code, out, err = run_cli(capsys, "rehearse", output, "--json")
    assert code in (0, 1), err
    document = json.loads(out)
    assert (document["strategy"], document["tp_size"]) == ("FSDP 2 x TP 2", 2)
    assert abs(document["planner_difference"]) < 0.5  # a 2-block toy: the planner's reserve terms dominate
