"""The planner's checkpoint save cost and the Young/Daly save interval (fsdp_presets.plan.save_cost)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from fsdp_presets.fileio import GiB
from fsdp_presets.plan.shapes import Hardware
from fsdp_presets.plan.results import ModelStateBytes
from fsdp_presets.cli import main
from fsdp_presets.plan.save_cost import STAGING_BYTES_PER_S, save_cost, young_daly_interval


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
