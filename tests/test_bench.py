"""The benchmark, the fault campaign and the GPU benchmark: their failure paths on fabricated
measurements (fast), and one quick end-to-end pass of each CPU script (real launches, slow)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsdp_harness import bench, doc_sections, gpu_report
from fsdp_harness import campaign as fault_campaign
from fsdp_harness.drill import DrillResult, KillPlan
from fsdp_harness.measure import ring_bytes, sent_bytes, state_deviations
from fsdp_harness.scripts import script_module
from fsdp_presets.plan.results import ModelStateBytes

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory):
    from fsdp_presets.model.profile import profile_model

    folder = tmp_path_factory.mktemp("bench_profile")
    (folder / "config.json").write_text(json.dumps(bench.QUICK_MODEL))
    return profile_model(str(folder / "config.json"))


def fabricated_results(case: bench.Case, profile, *, scale: float = 1.0) -> dict[int, dict]:
    """Worker results as a launch would write them, holding exactly the planned bytes x ``scale``."""
    from fsdp_presets.fileio import GiB
    from fsdp_presets.plan.shapes import Hardware
    from fsdp_presets.plan.planner import plan

    row = plan(profile, Hardware(gpus=case.processes, nodes=case.nodes, gpu_memory_bytes=80 * GiB),
               bench.QUICK_SETTINGS.shape).get(case.strategy, case.fsdp_version)
    held = {"params": int(row.model_state.params * scale), "grads": row.model_state.grads,
            "optimizer": row.model_state.optimizer + 84, "step_counters": 84}
    return {rank: {"held": held, "collectives": [{"op": "all_reduce", "payload_bytes": 4000, "group_size": 2}],
                   "comm_counts": {}, "losses": [6.2, 6.1], "step_times_s": [0.2, 0.1], "cpu_times_s": [0.2, 0.1], "rss_before_bytes": 100,
                   "rss_peak_bytes": 300, "rss_peak_reset": True, "rss_follows_live_memory": True, "checkpoints": {}}
            for rank in range(case.processes)}


# ---- the planner comparison ----
def test_state_within_one_percent_passes_and_beyond_fails():
    planned = ModelStateBytes(params=1000, grads=1000, optimizer=2000)
    exact = {"params": 1000, "grads": 1000, "optimizer": 2000 + 36, "step_counters": 36}
    assert state_deviations(exact, planned) == []
    assert state_deviations({**exact, "params": 1009}, planned) == []
    deviations = state_deviations({**exact, "params": 1011}, planned, label="x")
    assert [d.part for d in deviations] == ["params"]
    assert "+1.10%" in str(deviations[0])


def test_a_fabricated_planner_deviation_fails_the_benchmark(quick_profile, tmp_path):
    case = bench.QUICK_CASES[1]  # FSDP2 FULL_SHARD x2
    good = bench.analyse_case(case, fabricated_results(case, quick_profile), quick_profile, bench.QUICK_SETTINGS)
    assert good["deviations"] == [] and good["state_error"] == 0
    assert bench.verdict({"cases": [good]}) == []

    bad = bench.analyse_case(case, fabricated_results(case, quick_profile, scale=1.02), quick_profile,
                             bench.QUICK_SETTINGS)
    problems = bench.verdict({"cases": [bad]})
    assert len(problems) == 2  # both ranks
    assert all("deviates from the planner" in problem and "params" in problem for problem in problems)


def test_the_benchmark_exits_non_zero_on_a_deviation(quick_profile, tmp_path, monkeypatch):
    case = bench.QUICK_CASES[1]
    monkeypatch.setattr(bench, "QUICK_CASES", (case,))
    monkeypatch.setattr(bench, "run_case", lambda *args, **kwargs: fabricated_results(case, quick_profile, scale=0.9))
    output = tmp_path / "benchmarks.md"
    code = bench.main(["--quick", "--output", str(output), "--img-dir", str(tmp_path / "img"),
                       "--work-dir", str(tmp_path / "work")])
    assert code == 1
    text = output.read_text()
    assert text.splitlines()[4].startswith("**FAILED**: per-rank state deviates from the planner")
    assert (tmp_path / "img" / "bench_state.png").stat().st_size > 5000


def test_a_lost_checkpoint_fails_the_campaign_and_the_benchmark():
    plan = KillPlan(rank=1, mode="timer", after_step=7, delay_s=0.3)
    lost = DrillResult(plan=plan, killed=True, last_step_before_kill=8, committed_before_kill=6,
                       valid_after_crash=[3], resumed_step=3, recovery_s=12.0, kill_to_exit_s=1.0)
    assert lost.lost_checkpoint and lost.steps_lost == 5
    kept = DrillResult(plan=plan, killed=True, last_step_before_kill=8, committed_before_kill=6,
                       valid_after_crash=[3, 6], resumed_step=6, recovery_s=12.0, kill_to_exit_s=1.0)
    assert not kept.lost_checkpoint and kept.steps_lost == 2

    def trial(index, result):
        return {"trial": index, **result.to_json(), "identical_losses": True, "passed": not result.lost_checkpoint,
                "problems": ["lost a committed checkpoint"] if result.lost_checkpoint else []}

    campaign = {"settings": vars(fault_campaign.CampaignSettings(trials=2)), "save_cycle_s": 1.0,
                "trials": [trial(1, kept), trial(2, lost)]}
    assert fault_campaign.summary(campaign)["lost_checkpoints"] == 1
    assert fault_campaign.failures(campaign) == ["trial 2: lost a committed checkpoint"]
    assert bench.verdict({"cases": [], "campaign": campaign}) == ["fault campaign: trial 2: lost a committed checkpoint"]
    section = fault_campaign.to_markdown(campaign, command="python scripts/fault_campaign.py --seed 0", image=None)
    assert "**1/2 trials resumed" in section and "committed checkpoints lost: 1" in section


def test_kill_plans_are_seeded_and_land_after_a_commit_and_before_the_end():
    settings = fault_campaign.CampaignSettings(trials=40, max_steps=12, save_every=3, seed=7)
    plans = fault_campaign.kill_plans(settings, cycle_s=2.0)
    assert plans == fault_campaign.kill_plans(settings, cycle_s=2.0)
    assert plans != fault_campaign.kill_plans(fault_campaign.CampaignSettings(trials=40, seed=8), cycle_s=2.0)
    assert {plan.mode for plan in plans} == {"timer", "during-save"}
    assert {plan.rank for plan in plans} == {0, 1}
    for plan in plans:
        if plan.mode == "timer":
            assert 4 <= plan.after_step <= 9 and 0 <= plan.delay_s <= 2.0
        else:
            assert plan.after_step in (6, 9, 12)
    with pytest.raises(SystemExit):
        fault_campaign.CampaignSettings(trials=1, max_steps=5, save_every=3)


def test_ring_bytes_follow_the_planner_convention():
    assert ring_bytes({"op": "all_gather", "payload_bytes": 1000, "group_size": 4}) == 750
    assert ring_bytes({"op": "all_reduce", "payload_bytes": 1000, "group_size": 4}) == 1500
    assert ring_bytes({"op": "reduce_scatter", "payload_bytes": 1000, "group_size": 1}) == 0
    assert sent_bytes([{"op": "all_gather", "payload_bytes": 1000, "group_size": 2}])["total"] == 500


def test_the_collective_recorder_records_payloads_and_survives_a_transformers_forward():
    """One process, a gloo group of one: the recorder counts and sizes a real all-reduce, and a
    Hugging Face Llama's forward and backward run under it (torch's ``CommDebugMode`` fails in that
    forward on transformers 5.25; the recorder keeps no module tracker)."""
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from fsdp_harness.measure import CollectiveRecorder

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                             num_attention_heads=2, num_key_value_heads=1, vocab_size=64))
        tokens = torch.randint(0, 64, (2, 8))
        with CollectiveRecorder() as recorder:
            model(input_ids=tokens, labels=tokens).loss.backward()
            dist.all_reduce(torch.ones(10))
        assert recorder.records == [{"op": "all_reduce", "payload_bytes": 40, "group_size": 1}]
        assert {str(op): count for op, count in recorder.get_comm_counts().items()} == {"c10d.allreduce_": 1}
    finally:
        dist.destroy_process_group()


def test_doc_sections_are_replaced_in_place():
    document = "# Benchmarks\n\nintro\n\n" + doc_sections.wrap("a", "old a") + "\nmiddle\n\n" + doc_sections.wrap("b", "b")
    updated = doc_sections.replace(document, "a", doc_sections.wrap("a", "new a"))
    assert "new a" in updated and "old a" not in updated
    assert updated.startswith("# Benchmarks\n\nintro\n\n") and "middle" in updated and "\nb\n" in updated
    appended = doc_sections.replace(updated, "c", doc_sections.wrap("c", "c body"))
    assert appended.endswith(doc_sections.wrap("c", "c body")) and doc_sections.find(appended, "a") is not None
    # what a full benchmark run keeps of the file it rewrites: every section, in order
    assert doc_sections.names(appended + "<!-- d:start -->\nno end\n") == ["a", "b", "c"]


def test_the_shipped_benchmarks_page_keeps_its_measurements_in_sections():
    """A full benchmark run rewrites docs/benchmarks.md and keeps only its marked sections: every
    measurement written by another script or by hand is inside one."""
    text = (REPO / "docs" / "benchmarks.md").read_text()
    names = doc_sections.names(text)
    assert {"gpu-fsdp", "preemption-grace", "exit-campaign-notes", "planner-accuracy", "preemption-campaign",
            "async-save", "exit-campaign"} <= set(names), names


# ---- the GPU script: syntax and its Python part in dry mode ----
def test_gpu_bench_shell_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPTS / "gpu_bench.sh")], check=True)


def test_gpu_bench_dry_run_checks_and_plans_without_a_gpu(tmp_path):
    work_dir = tmp_path / "gpu"
    done = subprocess.run(["bash", str(SCRIPTS / "gpu_bench.sh"), "--dry-run", "--gpu-name", "NVIDIA H200"],
                          capture_output=True, text=True, env={**_env(), "GPU_BENCH_WORK_DIR": str(work_dir),
                                                               "PYTHON": sys.executable})
    assert done.returncode == 0, done.stderr
    assert "peak bf16 989.0 TFLOP/s" in done.stdout
    assert "1.10B parameters" in done.stdout and "(fits)" in done.stdout
    assert "recipes/causal_lm.py --model" in done.stdout
    assert not work_dir.exists()  # a dry run writes nothing

    refused = subprocess.run(["bash", str(SCRIPTS / "gpu_bench.sh"), "--dry-run", "--steps", "2", "--micro-batch", "0"],
                             capture_output=True, text=True, env={**_env(), "GPU_BENCH_WORK_DIR": str(work_dir),
                                                                  "PYTHON": sys.executable})
    assert refused.returncode == 2
    assert "--steps 2" in refused.stderr and "--micro-batch 0" in refused.stderr


def test_gpu_peak_table_and_report_arithmetic():
    assert gpu_report.peak_tflops_for("NVIDIA H100 80GB HBM3") == 989.0
    assert gpu_report.peak_tflops_for("NVIDIA H100 PCIe") == 756.0
    assert gpu_report.peak_tflops_for("NVIDIA H200 NVL") == 835.0
    assert gpu_report.peak_tflops_for("NVIDIA A100-SXM4-80GB") == 312.0
    assert gpu_report.peak_tflops_for("Some Other GPU") is None
    settings = {"warmup_steps": 1, "gpu": {"peak_bf16_tflops": 1000.0}}
    metrics = [{"kind": "train", "step": step, "tokens_per_s": 1e4 if step > 1 else 10.0, "step_time_s": 1.0}
               for step in range(1, 6)]
    figures = gpu_report.summarise(settings, {"params": 1e9, "single_process_total": 11 * 2**30}, {
        "max_memory_allocated": 10 * 2**30, "max_memory_reserved": 12 * 2**30}, metrics)
    assert figures["tokens_per_s"] == 1e4 and figures["mfu"] == pytest.approx(6e13 / 1e15)
    assert figures["planner_error"] == pytest.approx(0.1)


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


# ---- end to end: the quick modes, real launches ----
@pytest.mark.slow
def test_quick_campaign_then_quick_benchmark(tmp_path, capsys, monkeypatch):
    """One campaign trial (uninterrupted run, killed run, resumed run) and the benchmark's two
    quick cases (DDP and FSDP2 with checkpoints), reported together in one document. The scripts'
    mains run in this process (their launches are launches as anywhere in the suite)."""
    doc, img = tmp_path / "benchmarks.md", tmp_path / "img"
    monkeypatch.chdir(REPO)
    started = time.monotonic()
    campaign = script_module(SCRIPTS / "fault_campaign.py")
    assert campaign.main(["--quick", "--seed", "3", "--work-dir", str(tmp_path / "campaign"), "--doc", str(doc),
                          "--img-dir", str(img)]) == 0
    assert "fault campaign: seed 3" in capsys.readouterr().out
    record = json.loads((tmp_path / "campaign" / "campaign.json").read_text())
    (trial,) = record["trials"]
    assert trial["killed"] and trial["passed"] and trial["identical_losses"]
    assert trial["resumed_step"] == max(trial["valid_after_crash"]) >= 2
    assert trial["recovery_s"] > trial["kill_to_exit_s"] > 0
    campaign_s = time.monotonic() - started

    assert bench.main(["--quick", "--output", str(doc), "--img-dir", str(img), "--work-dir", str(tmp_path / "bench"),
                       "--campaign-json", str(tmp_path / "campaign" / "campaign.json")]) == 0
    report = json.loads(doc.with_suffix(".json").read_text())
    ddp, fsdp2 = report["cases"]
    assert fsdp2["state_vs_ddp"] == pytest.approx(0.5, abs=1e-3) and fsdp2["state_error"] == 0
    assert fsdp2["comm_error"] == pytest.approx(0, abs=1e-9) and ddp["comm_error"] == pytest.approx(0, abs=1e-9)
    assert fsdp2["loss_difference_vs_ddp"] < 1e-5  # the same training
    assert set(fsdp2["checkpoints"]) == {"SHARDED_STATE_DICT", "FULL_STATE_DICT"}
    sharded, full = fsdp2["checkpoints"]["SHARDED_STATE_DICT"], fsdp2["checkpoints"]["FULL_STATE_DICT"]
    assert sharded["bytes_per_rank"][1] > 0.4 * sum(sharded["bytes_per_rank"])  # each rank writes its half
    assert full["bytes_per_rank"][0] > 0.9 * sum(full["bytes_per_rank"])  # rank 0 writes it all
    text = doc.read_text()
    assert "| FULL_SHARD (FSDP2) per-rank model state / DDP, 2 processes (limit 1/2 = 0.500) | 0.5000 |" in text
    assert "**1/1 trials resumed from a committed checkpoint" in text and "gpu-bench:start" in text
    for name in ("bench_state.png", "bench_step_time.png", "bench_checkpoint.png", "fault_campaign.png"):
        assert (img / name).stat().st_size > 5000
    print(f"quick campaign {campaign_s:.0f} s, quick benchmark {time.monotonic() - started - campaign_s:.0f} s")


# --------------------------------------------------------------------------- side by side on a real model


@pytest.mark.slow
def test_side_by_side_dry_run_writes_the_four_configs_and_launch_commands(tmp_path, capsys, monkeypatch):
    import yaml

    from fsdp_harness import step_bench

    monkeypatch.chdir(REPO)
    bench_script = script_module(SCRIPTS / "bench.py")  # its main, in this process
    assert bench_script.main(["--side-by-side", "--dry-run", "--model", str(REPO / "model_configs" / "smollm2-135m"),
                              "--work-dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == [run.name for run in step_bench.RUNS]
    assert all("accelerate.commands.launch --config_file" in line and "step_bench.py worker" in line for line in lines)
    configs = {run.name: yaml.safe_load((tmp_path / f"{run.name}.yaml").read_text()) for run in step_bench.RUNS}
    assert configs["ddp"]["distributed_type"] == "MULTI_GPU" and "fsdp_config" not in configs["ddp"]
    default = configs["fsdp2-accelerate"]["fsdp_config"]  # what `accelerate config` writes with its defaults
    assert default["fsdp_reshard_after_forward"] is True and default["fsdp_cpu_ram_efficient_loading"] is True
    assert default["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"
    preset = configs["fsdp2-preset"]["fsdp_config"]  # the generator's CPU rule at 2 processes
    assert preset["fsdp_version"] == 2 and preset["fsdp_reshard_after_forward"] is False
    assert configs["fsdp1-preset"]["fsdp_config"]["fsdp_version"] == 1


def _round(ddp_wall: float, losses_by_run: dict[str, list[float]] | None = None) -> dict:
    from fsdp_harness import step_bench

    losses_by_run = losses_by_run or {}
    return {run.name: {"wall_s": ddp_wall * (1 + index * 0.1), "cpu_s": 1.0 + index * 0.1,
                       "losses": losses_by_run.get(run.name, [2.5, 2.25]), "distributed_type": ["FSDP"],
                       "peak_rss_bytes": 2**30} for index, run in enumerate(step_bench.RUNS)}


def test_side_by_side_ratios_are_per_round_and_unequal_losses_fail():
    from fsdp_harness import step_bench

    report = {"rounds": [_round(2.0), _round(4.0, {"fsdp1-preset": [2.5, 2.2500001]})],
              "settings": {"model": "m", "processes": 2, "micro_batch": 2, "seq_len": 64, "rounds": 2, "steps": 6,
                           "skip": 2},
              "configs": {}, "host": "x", "load_before": 0.1, "load_after": 0.2, "versions": "v"}
    analysis = step_bench.analyse(report)
    rows = analysis["rows"]
    assert rows["fsdp2-accelerate"]["wall_vs_ddp"] == pytest.approx(1.1)  # host noise cancels within a round
    assert rows["ddp"]["wall_range"] == (2.0, 4.0)
    assert rows["fsdp2-preset"]["losses_equal_ddp"] and not rows["fsdp1-preset"]["losses_equal_ddp"]
    text = step_bench.render(report, analysis, command="python scripts/bench.py --side-by-side")
    assert "**NO**" in text and "1.10x" in text


def test_side_by_side_refuses_a_folder_without_config(tmp_path, capsys):
    from fsdp_harness import step_bench

    with pytest.raises(SystemExit) as raised:
        step_bench.parse_args(["--model", str(tmp_path)])
    assert raised.value.code == 2 and "scripts/prepare_models.py" in capsys.readouterr().err
