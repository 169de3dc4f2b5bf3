"""The planner's checkpoint save cost and the Young/Daly save interval (fsdp_presets.plan.save_cost)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from fsdp_presets.fileio import GiB
from fsdp_presets.plan.shapes import Hardware, TrainingShape
from fsdp_presets.plan.results import ModelStateBytes
from fsdp_presets.cli import main
from fsdp_presets.plan.save_cost import STAGING_BYTES_PER_S, save_cost, staging_fit, young_daly_interval

REPO = Path(__file__).resolve().parent.parent


def test_the_interval_is_young_daly_and_a_failure_loses_half_of_it_plus_the_write():
    # 48 s save, 24 h MTBF: sqrt(2 x 48 x 86400) = 2880 s, i.e. 288 steps of 10 s.
    interval = young_daly_interval(cost_s=48.0, mtbf_s=24 * 3600.0, durable_s=48.0, step_time_s=10.0)
    assert interval.interval_s == pytest.approx(math.sqrt(2 * 48.0 * 86400.0)) == pytest.approx(2880.0)
    assert interval.interval_steps == 288
    assert interval.loss_per_failure_s == pytest.approx(2880.0 / 2 + 48.0)
    assert interval.overhead == pytest.approx(48.0 / 2880.0)
    # The interval minimizes the expected waste per unit time, cost/T + T/(2 M), to first order.
    def waste(period):
        return 48.0 / period + period / (2 * 86400.0)
    assert waste(interval.interval_s) < min(waste(interval.interval_s * 0.9), waste(interval.interval_s * 1.1))
    # Without a step time: seconds only; a cheaper (asynchronous) save is saved more often.
    cheap = young_daly_interval(cost_s=0.48, mtbf_s=86400.0, durable_s=48.5)
    assert cheap.interval_steps is None and cheap.interval_s == pytest.approx(interval.interval_s / 10)
    with pytest.raises(ValueError):
        young_daly_interval(cost_s=1.0, mtbf_s=0.0, durable_s=1.0)


def strategy(label, *, fsdp_version, shard_world_size, params, optimizer):
    """What save_cost reads of a StrategyPlan."""
    return SimpleNamespace(label=label, fsdp_version=fsdp_version, shard_world_size=shard_world_size,
                           model_state=ModelStateBytes(params=params, grads=params, optimizer=optimizer))


def test_the_save_cost_follows_the_per_rank_model_state_of_each_strategy():
    hardware = Hardware(gpus=8, nodes=2, gpu_memory_bytes=80 * GiB)
    per_rank = 3 * 1000
    full = strategy("FULL_SHARD (FSDP2)", fsdp_version=2, shard_world_size=8, params=1000, optimizer=2000)
    cost = save_cost(full, hardware, storage_bytes_per_s=1e3)
    assert cost.staging_per_process_bytes == per_rank and cost.staging_per_node_bytes == 4 * per_rank
    assert cost.checkpoint_bytes == 8 * per_rank and cost.per_gpu_bytes == per_rank
    assert cost.save_s == pytest.approx(4 * per_rank / 1e3) and cost.async_blocked_s == per_rank / STAGING_BYTES_PER_S
    # DDP: the main process writes it all, and the recipes save it synchronously.
    ddp = save_cost(strategy("DDP", fsdp_version=None, shard_world_size=1, params=8000, optimizer=16000), hardware,
                    storage_bytes_per_s=1e3)
    assert ddp.per_gpu_bytes == ddp.checkpoint_bytes == cost.checkpoint_bytes and not ddp.async_supported
    assert ddp.save_s == pytest.approx(8 * per_rank / 1e3)
    # HSDP over 2 nodes: one copy written (DCP spreads the replicas' pieces), but every node stages its copy.
    hybrid = save_cost(strategy("HYBRID_SHARD (FSDP2)", fsdp_version=2, shard_world_size=4, params=2000,
                                optimizer=4000), hardware, storage_bytes_per_s=1e3)
    assert hybrid.checkpoint_bytes == cost.checkpoint_bytes and hybrid.per_gpu_bytes == per_rank
    assert hybrid.staging_per_node_bytes == cost.checkpoint_bytes


@pytest.mark.parametrize("model,gpus,nodes", [("llama-3.1-8b", 8, 1), ("llama-3.1-70b", 64, 8)])
def test_plan_prints_the_save_interval_with_mtbf(capsys, model, gpus, nodes):
    assert main(["plan", f"model_configs/{model}", "--gpus", str(gpus), "--nodes", str(nodes), "--mtbf", "24",
                 "--seconds-per-step", "10"]) == 0
    printed = capsys.readouterr().out
    assert "save interval (Young/Daly, sqrt(2 x save cost x MTBF), MTBF 24 h" in printed
    assert "  sync: save every " in printed and "--async-save: save every " in printed
    assert "a failure loses " in printed and "blocked async" in printed


def test_plan_refuses_a_bad_mtbf(capsys):
    assert main(["plan", "llama", "--gpus", "2", "--mtbf", "0"]) == 2
    assert "--mtbf 0.0: give a positive number" in capsys.readouterr().err


# --------------------------------------------------------------------------- --async-save's staging copy in host memory


def test_the_staging_copy_is_counted_beside_the_offloaded_states():
    hardware = Hardware(gpus=8, nodes=2, gpu_memory_bytes=80 * GiB)
    full = SimpleNamespace(**vars(strategy("FULL_SHARD (FSDP2)", fsdp_version=2, shard_world_size=8, params=1000,
                                           optimizer=2000)), name="FULL_SHARD")
    on_gpu = staging_fit(full, hardware, TrainingShape(), host_bytes=12_000)
    assert (on_gpu.per_process_bytes, on_gpu.per_node_bytes, on_gpu.in_use_bytes) == (3000, 12_000, 0)
    assert on_gpu.fits and on_gpu.need_bytes == 12_000
    assert not staging_fit(full, hardware, TrainingShape(), host_bytes=11_999).fits
    # offloaded: the node's 4 processes keep parameters, gradients and optimizer state in host memory already
    offloaded = staging_fit(full, hardware, TrainingShape(offload=True), host_bytes=12_000)
    assert offloaded.in_use_bytes == 4 * 4000 and not offloaded.fits
    assert offloaded.to_json() == {"per_process_bytes": 3000, "per_node_bytes": 12_000, "in_use_bytes": 16_000,
                                   "host_bytes": 12_000, "fits": False}
    assert "training keeps in host memory" in offloaded.describe()
    # DDP is never offloaded (the planner's rule), so nothing is in use beside the copy
    ddp = SimpleNamespace(**vars(strategy("DDP", fsdp_version=None, shard_world_size=1, params=1, optimizer=2)),
                          name="DDP")
    assert staging_fit(ddp, hardware, TrainingShape(offload=True), host_bytes=1e9).in_use_bytes == 0


def test_plan_reports_the_staging_copy_against_host_memory(capsys):
    words = ["plan", "model_configs/llama-3.1-8b", "--gpus", "8", "--seq-len", "4096"]
    assert main([*words, "--json", "--host-memory", "64"]) == 0
    saves = json.loads(capsys.readouterr().out)["saves"]
    assert saves["host_bytes"] == 64 * GiB
    by_label = {row["label"]: row for row in saves["strategies"]}
    assert by_label["DDP"]["async_staging"] is None  # the recipes save DDP synchronously
    full = by_label["FULL_SHARD (FSDP2)"]
    assert full["async_staging"]["per_process_bytes"] == full["staging_per_process_bytes"]
    assert full["async_staging"]["per_node_bytes"] == 8 * full["staging_per_process_bytes"]
    assert full["async_staging"]["fits"] is False and full["async_staging"]["in_use_bytes"] == 0
    assert main([*words, "--host-memory", "1024"]) == 0
    printed = capsys.readouterr().out
    assert "staging/proc" in printed and "fits host" in printed
    assert re.search(r"--async-save with \S+ \(FSDP2\) fits host memory: 11\.2 GiB per process, 89\.7 GiB per node",
                     printed), printed
    assert main([*words, "--host-memory", "64"]) == 0
    assert "does not fit host memory" in capsys.readouterr().out


def _preset(**request):
    from fsdp_presets.model.profile import profile_model
    from fsdp_presets.preset.presets import decide
    from fsdp_presets.preset.request import PresetRequest

    source = "model_configs/llama-3.1-8b"
    return decide(profile_model(str(REPO / source)), PresetRequest(model=source, gpus=8, seq_len=4096, **request))


def test_generate_turns_async_save_on_when_the_staging_copy_fits():
    from fsdp_presets.model.profile import profile_model
    from fsdp_presets.preset.emit_commands import LaunchHints, launch_words
    from fsdp_presets.preset.presets import decide
    from fsdp_presets.preset.request import PresetRequest

    preset = _preset()
    assert preset.state_dict.async_save and preset.summary()["async_save"] is True
    assert "--async-save in the launch line" in preset.state_dict.reason
    assert launch_words(preset, config_file="x.yaml", launch=LaunchHints())[-1] == "--async-save"
    assert "--async-save" not in launch_words(preset, config_file="x.ddp.yaml", launch=LaunchHints(), baseline=True)
    # 64 GiB of host RAM cannot hold 8 x 11.2 GiB of staged shards: off, and the header says why
    short = _preset(host_memory_gib=64)
    assert not short.state_dict.async_save
    assert "--async-save" not in launch_words(short, config_file="x.yaml", launch=LaunchHints())
    assert "--async-save off: its staging copy does not fit --host-memory 64 GiB" in short.state_dict.reason
    assert any(note.startswith("--async-save left out of the launch line") for note in short.notes)
    # the recipes take --async-save with FSDP2 only
    assert "FSDP2 only" in _preset(fsdp_version=1).state_dict.reason
    # on a CPU-only host the background write would share the cores that train: off, and says so
    cpu = decide(profile_model(str(REPO / "model_configs/smollm2-135m")),
                 PresetRequest(model="model_configs/smollm2-135m", gpus=2, device="cpu", seq_len=128))
    assert not cpu.state_dict.async_save and "on a CPU-only host" in cpu.state_dict.reason


def test_check_reports_an_async_save_launch_beyond_host_memory(tmp_path):
    import yaml

    from check_configs import GOOD, facts
    from fsdp_presets.check.findings import CheckContext
    from fsdp_presets.check.lint import check_file

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({**GOOD, "num_processes": 8}))
    header = {"kind": "fsdp", "summary": {"async_save": True}}

    def rules(host_gib, metadata):
        report, _ = check_file(path, context=CheckContext(model=facts("model_configs/llama-3.1-8b"), method="full",
                                                          host_memory_gib=host_gib, metadata=metadata))
        return report.rules()

    assert "async-save-host-memory" in rules(64, header)
    assert "async-save-host-memory" not in rules(1024, header)  # 89.7 GiB per node fits
    assert "async-save-host-memory" not in rules(64, {"kind": "fsdp", "summary": {"async_save": False}})
