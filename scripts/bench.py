"""Benchmark FSDP against DDP on this host and against the planner, all ratios from one run.

    python scripts/bench.py                 # regenerates docs/benchmarks.md(+.json), docs/img/*.png
    python scripts/bench.py --quick         # a smoke test: tiny model, two launches, no campaign
    python scripts/bench.py --render docs/benchmarks.json   # rewrite the report only, no launches

About 15 minutes on 2 shared cores (each of the 8 cases is one launch; the campaign 21 more).

Every case is one ``accelerate launch`` of ``scripts/bench_worker.py`` under an accelerate config
written the way users write them (real FSDP/DDP over gloo on CPU: ``enable_cpu_fsdp``). The model
is a Llama built from a config (:data:`BENCH_MODEL`, 33.7M parameters, fp32, AdamW): large
enough that compute, not gloo latency, dominates a step. Cases: DDP, FSDP2 FULL_SHARD (with and
without activation checkpointing), FSDP1 FULL_SHARD and FSDP2 SHARD_GRAD_OP on 2 processes; DDP,
FSDP2 FULL_SHARD and HSDP 2x2 on 4. Measured per case (see the worker): per-rank parameters,
gradients and optimizer state after a step, every collective of a step, step time (wall and CPU),
the memory a step adds, and for FSDP2 on 2 processes checkpoint save/load, sharded vs full state
dict. Then
a kill-and-resume drill of ``recipes/causal_lm.py`` on the same model (resume cost) and the
fault campaign (``scripts/fault_campaign.py``).

Exit status 1 (after writing the report, with the failure at its top) when a rank's measured
parameters, gradients or optimizer state differ from the planner's prediction by more than 1%,
when a fault trial lost a committed checkpoint (or failed to resume, or diverged), or when the
resume drill failed. Absolute times move with the load of a shared host; CPU time per step and
ratios within one run much less.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing
sys.path.insert(0, str(REPO / "scripts"))

import fault_campaign  # noqa: E402
from fsdp_harness import doc_sections  # noqa: E402
from fsdp_harness.measure import DEFAULT_TOLERANCE, relative_error, sent_bytes, state_deviations  # noqa: E402
from fsdp_presets.plan.planner import GiB, Hardware, TrainingShape, human_bytes, plan  # noqa: E402

WORKER = REPO / "scripts" / "bench_worker.py"
DOC = REPO / "docs" / "benchmarks.md"
IMG_DIR = REPO / "docs" / "img"
GPU_SECTION = "gpu-bench"
"""Section of docs/benchmarks.md that scripts/gpu_bench.sh writes (kept when this script runs)."""

_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "tie_word_embeddings": False,
          "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
BENCH_MODEL = {**_LLAMA, "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 8,
               "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 8192,
               "max_position_embeddings": 256}
"""33.7M parameters: Llama proportions (MLP 2.7 x hidden, as Llama's 11008/4096). A 2-process
step computes ~52 GFLOP per rank (6 x params x 256 tokens), which takes seconds on one core,
while FSDP's gathers of 135 MB take a fraction of that over loopback. Every dimension divides by
4, so the shards are even and the planner's per-rank figures are exact."""
QUICK_MODEL = {**_LLAMA, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 512,
               "max_position_embeddings": 64}
"""A smoke-test model (166K parameters) for ``--quick``."""


@dataclass(frozen=True, kw_only=True)
class Case:
    """One benchmark launch."""

    name: str
    """Short id (``fsdp2-x2``): file and folder names."""
    label: str
    """What tables say (``FULL_SHARD (FSDP2)``)."""
    processes: int
    """Ranks of the launch."""
    strategy: str
    """The planner's row: ``DDP``, ``FULL_SHARD``, ``SHARD_GRAD_OP`` or ``HYBRID_SHARD``."""
    fsdp_version: int | None = None
    """1 or 2 (None for DDP)."""
    nodes: int = 1
    """Nodes the planner assumes (HSDP: replicas of the shard group)."""
    fsdp: dict = field(default_factory=dict)
    """accelerate ``fsdp_config`` entries (without ``fsdp_``) over the FSDP2 FULL_SHARD default."""
    parallelism: dict = field(default_factory=dict)
    """accelerate ``parallelism_config`` entries (HSDP mesh)."""
    checkpoints: bool = False
    """Also time checkpoint save/load, sharded and full."""
    short: str = ""
    """Chart label (defaults to ``label``)."""

    @property
    def activation_checkpointing(self) -> bool:
        return bool(self.fsdp.get("activation_checkpointing"))

    @property
    def distributed_type(self) -> str:
        return "MULTI_GPU" if self.strategy == "DDP" else "FSDP"  # MULTI_GPU: DDP over gloo on CPU


def _case(name, label, processes, strategy, version=None, **kwargs) -> Case:
    return Case(name=name, label=label, processes=processes, strategy=strategy, fsdp_version=version, **kwargs)


FULL_CASES = (
    _case("ddp-x2", "DDP", 2, "DDP", short="DDP"),
    _case("fsdp2-x2", "FULL_SHARD (FSDP2)", 2, "FULL_SHARD", 2, checkpoints=True, short="FSDP2"),
    _case("fsdp2-ac-x2", "FULL_SHARD (FSDP2) + act. ckpt", 2, "FULL_SHARD", 2,
          fsdp={"activation_checkpointing": True}, short="FSDP2\n+ act. ckpt"),
    _case("fsdp1-x2", "FULL_SHARD (FSDP1)", 2, "FULL_SHARD", 1, fsdp={"version": 1}, short="FSDP1"),
    _case("sgo-x2", "SHARD_GRAD_OP (FSDP2)", 2, "SHARD_GRAD_OP", 2, fsdp={"reshard_after_forward": False},
          short="FSDP2\nSHARD_GRAD_OP"),
    _case("ddp-x4", "DDP", 4, "DDP", short="DDP"),
    _case("fsdp2-x4", "FULL_SHARD (FSDP2)", 4, "FULL_SHARD", 2, short="FSDP2"),
    _case("hsdp-x4", "HSDP 2x2 (FSDP2)", 4, "HYBRID_SHARD", 2, nodes=2,
          parallelism={"dp_replicate_size": 2, "dp_shard_size": 2}, short="HSDP 2x2"),
)
QUICK_CASES = (FULL_CASES[0], FULL_CASES[1])


@dataclass(frozen=True, kw_only=True)
class BenchSettings:
    """What every case shares."""

    model: dict
    """The model's config.json."""
    seq_len: int
    """Tokens per sequence."""
    micro_batch: int = 1
    """Sequences per rank per step."""
    warmup_steps: int = 1
    """Untimed steps after the measured first one."""
    timed_steps: int = 4
    """Timed steps (the median of the slowest rank's times is reported)."""

    @property
    def shape(self) -> TrainingShape:
        return TrainingShape(seq_len=self.seq_len, micro_batch=self.micro_batch, precision="fp32", optimizer="adamw")


FULL_SETTINGS = BenchSettings(model=BENCH_MODEL, seq_len=256)
QUICK_SETTINGS = BenchSettings(model=QUICK_MODEL, seq_len=64, timed_steps=2)


# --------------------------------------------------------------------------- running


def run_case(case: Case, settings: BenchSettings, work_dir: Path, *, timeout_s: float = 1800) -> dict[int, dict]:
    """Launch one case; ``{rank: worker result}``. Raises with the launch's output when it fails."""
    from fsdp_harness.launch import read_rank_results, run_launch

    config = fault_campaign.write_accelerate_config(
        work_dir / f"{case.name}.yaml", num_processes=case.processes, distributed_type=case.distributed_type,
        fsdp=case.fsdp, parallelism=case.parallelism)
    out = work_dir / case.name
    arguments = ["--model-config", work_dir / "config.json", "--result-dir", out, "--seq-len", settings.seq_len,
                 "--micro-batch", settings.micro_batch, "--warmup-steps", settings.warmup_steps,
                 "--timed-steps", settings.timed_steps]
    if case.checkpoints:
        arguments += ["--checkpoint-dir", work_dir / f"{case.name}-checkpoints"]
    launch = run_launch(config, WORKER, arguments, num_processes=case.processes, timeout=timeout_s, cwd=REPO)
    launch.check()
    results = read_rank_results(out)
    if sorted(results) != list(range(case.processes)):
        raise AssertionError(f"{case.name}: results from ranks {sorted(results)}, expected {case.processes}")
    expected_type = "MULTI_CPU" if case.strategy == "DDP" else "FSDP"
    types = {result["distributed_type"] for result in results.values()}
    if types != {expected_type}:
        raise AssertionError(f"{case.name}: accelerate ran {types}, expected {expected_type}")
    if case.checkpoints:
        shutil.rmtree(work_dir / f"{case.name}-checkpoints", ignore_errors=True)
    return results


def write_model_folder(folder: Path, model_config: dict) -> Path:
    """A Hugging Face folder the recipe can load: random weights of ``model_config`` and a word
    tokenizer of the shipped data (``fsdp_harness.tiny_model``), vocabulary capped by the model's."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    from fsdp_harness.tiny_model import write_tiny_model

    logging.disable_progress_bar()  # no "Writing model shards" bars in the benchmark's output
    write_tiny_model(folder, kind="llama", text=fault_campaign.TRAIN_DATA.read_text(),
                     vocab_size=model_config["vocab_size"], max_positions=model_config["max_position_embeddings"])
    settings = {key: value for key, value in model_config.items() if key not in ("model_type", "architectures")}
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**settings)).save_pretrained(folder, safe_serialization=True)
    return folder


def resume_drill(settings: BenchSettings, work_dir: Path) -> dict:
    """Resume cost on the benchmark model: FSDP2 on 2 processes, a checkpoint every 2 steps, rank 1
    SIGKILLed right after step 3 (mid-step 4), the same command again; stopped after its first new
    step. The checkpoint it loads is the same size as the one the checkpoint rows time."""
    from fsdp_harness.drill import KillPlan, kill_and_resume
    from fsdp_harness.launch import launch_command

    model = write_model_folder(work_dir / "drill-model", settings.model)
    config = fault_campaign.write_accelerate_config(work_dir / "drill.yaml", num_processes=2)
    run_dir = work_dir / "drill-run"
    command = launch_command(config, fault_campaign.RECIPE, [
        "--model", model, "--data", fault_campaign.TRAIN_DATA, "--eval-data", fault_campaign.EVAL_DATA,
        "--max-eval-samples", 16, "--output-dir", run_dir, "--seq-len", settings.seq_len,
        "--micro-batch-size", settings.micro_batch, "--max-steps", 8, "--save-every", 2, "--resume", "auto"])
    result = kill_and_resume(command, run_dir=run_dir, plan=KillPlan(rank=1, mode="timer", after_step=3),
                             log_dir=work_dir, cwd=REPO, finish=False)
    record = result.to_json()
    loaded = run_dir / "checkpoints" / f"step-{result.resumed_step or 0:08d}"
    record["checkpoint_bytes"] = sum(path.stat().st_size for path in loaded.rglob("*") if path.is_file())
    return record


# --------------------------------------------------------------------------- analysis


def _slowest_rank_median(results: dict[int, dict], key: str = "step_times_s") -> float:
    """Median over the timed steps of the slowest rank's time (every rank waits for it)."""
    per_step = zip(*(result[key] for result in results.values()))
    return statistics.median(max(times) for times in per_step)


def _slowest_rank_range(results: dict[int, dict]) -> tuple[float, float]:
    """Fastest and slowest of the timed steps (slowest rank each), to show the noise."""
    slowest = [max(times) for times in zip(*(result["step_times_s"] for result in results.values()))]
    return min(slowest), max(slowest)


def analyse_case(case: Case, results: dict[int, dict], profile, settings: BenchSettings) -> dict:
    """Measured against planned for one case (see ``docs/benchmarks.md`` for the columns)."""
    hardware = Hardware(gpus=case.processes, nodes=case.nodes, gpu_memory_bytes=80 * GiB)
    shape = settings.shape.replace(activation_checkpointing=case.activation_checkpointing)
    row = plan(profile, hardware, shape).get(case.strategy, case.fsdp_version)
    deviations = []
    for rank, result in sorted(results.items()):
        deviations += state_deviations(result["held"], row.model_state, label=f"{case.label} x{case.processes}, rank {rank}")
    held = {part: max(result["held"][part] - (result["held"]["step_counters"] if part == "optimizer" else 0)
                      for result in results.values()) for part in ("params", "grads", "optimizer")}
    held["total"] = max(sum(result["held"][part] for part in ("params", "grads", "optimizer"))
                        - result["held"]["step_counters"] for result in results.values())
    sent = max((sent_bytes(result["collectives"]) for result in results.values()), key=lambda s: s["total"])
    rank0 = results[0]
    measured_rss = [result for result in results.values()
                    if result["rss_peak_bytes"] is not None and result["rss_before_bytes"] is not None]
    step_peak = max((result["rss_peak_bytes"] - result["rss_before_bytes"] for result in measured_rss), default=0)
    return {
        "case": case.name, "label": case.label, "short": case.short or case.label, "processes": case.processes, "strategy": case.strategy,
        "fsdp_version": case.fsdp_version, "activation_checkpointing": case.activation_checkpointing,
        "held": held, "held_per_rank": {rank: r["held"] for rank, r in results.items()},
        "planned": {"params": row.model_state.params, "grads": row.model_state.grads,
                    "optimizer": row.model_state.optimizer, "total": row.model_state.total},
        "state_error": relative_error(held["total"], row.model_state.total),
        "deviations": [str(deviation) for deviation in deviations],
        "sent": sent, "planned_comm": row.comm.to_json(),
        "comm_error": relative_error(sent["total"], row.comm.total),
        "collective_counts": rank0["comm_counts"],
        "step_time_s": _slowest_rank_median(results), "step_times_s": {r: x["step_times_s"] for r, x in results.items()},
        "step_time_range_s": _slowest_rank_range(results),
        "cpu_time_s": _slowest_rank_median(results, "cpu_times_s"),
        "planned_activations_bytes": row.per_gpu.activations,
        "step_peak_bytes": step_peak,
        "rss_between_steps_bytes": max((result["rss_before_bytes"] for result in measured_rss), default=0),
        "rss_peak_bytes": max((result["rss_peak_bytes"] for result in measured_rss), default=0),
        "rss_peak_reset": all(r["rss_peak_reset"] for r in results.values()),
        "rss_follows_live_memory": all(r.get("rss_follows_live_memory", False) for r in results.values()),
        "losses_rank0": rank0["losses"],
        "checkpoints": rank0["checkpoints"] and {
            kind: {**value, "save_s": max(r["checkpoints"][kind]["save_s"] for r in results.values()),
                   "load_s": max(r["checkpoints"][kind]["load_s"] for r in results.values())}
            for kind, value in rank0["checkpoints"].items()},
    }


def add_ratios(rows: list[dict]) -> None:
    """Each row's state, step time and loss against DDP with the same processes."""
    ddp = {row["processes"]: row for row in rows if row["strategy"] == "DDP"}
    for row in rows:
        base = ddp.get(row["processes"])
        if base is None:
            continue
        row["state_vs_ddp"] = row["held"]["total"] / base["held"]["total"]
        row["time_vs_ddp"] = row["step_time_s"] / base["step_time_s"]
        row["cpu_vs_ddp"] = row["cpu_time_s"] / base["cpu_time_s"]
        row["loss_difference_vs_ddp"] = max(abs(a - b) for a, b in zip(row["losses_rank0"], base["losses_rank0"]))
    plain = {(row["processes"], row["label"].replace(" + act. ckpt", "")): row for row in rows
             if not row["activation_checkpointing"]}
    for row in rows:
        if row["activation_checkpointing"] and (off := plain.get((row["processes"], row["label"].replace(" + act. ckpt", "")))):
            row["ac_time_cost"] = row["step_time_s"] / off["step_time_s"]
            row["ac_cpu_cost"] = row["cpu_time_s"] / off["cpu_time_s"]
            row["ac_peak_ratio"] = row["step_peak_bytes"] / off["step_peak_bytes"] if off["step_peak_bytes"] else None


def verdict(report: dict) -> list[str]:
    """Why the benchmark fails: planner deviations over 1% and fault trials that lost a
    committed checkpoint (or failed to resume or diverged). Empty when it passes."""
    problems = [deviation for row in report["cases"] for deviation in row["deviations"]]
    if problems:
        problems = [f"per-rank state deviates from the planner by more than {DEFAULT_TOLERANCE:.0%}: {p}"
                    for p in problems]
    if report.get("campaign"):
        problems += [f"fault campaign: {p}" for p in fault_campaign.failures(report["campaign"])]
    drill = report.get("resume_drill")
    if drill and drill["problems"]:
        problems.append("resume drill: " + "; ".join(drill["problems"]))
    return problems


# --------------------------------------------------------------------------- report


def _mib(count: float) -> str:
    return human_bytes(count)


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.2%}"


def _ratio(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _find(rows: list[dict], name: str) -> dict | None:
    return next((row for row in rows if row["case"] == name), None)


def headline(report: dict) -> list[tuple[str, str]]:
    """The figures the README and the issue ask for, as (what, value) pairs."""
    rows = report["cases"]
    pairs = []
    for processes in (2, 4):
        if row := _find(rows, f"fsdp2-x{processes}"):
            if "state_vs_ddp" in row:
                pairs.append((f"FULL_SHARD (FSDP2) per-rank model state / DDP, {processes} processes "
                              f"(limit 1/{processes} = {1 / processes:.3f})", f"{row['state_vs_ddp']:.4f}"))
    errors = [abs(row["state_error"]) for row in rows]
    pairs.append(("planner error, per-rank params + grads + optimizer, worst case",
                  f"{max(errors):.4%}" if errors else "n/a"))
    for processes in (2, 4):
        if (row := _find(rows, f"fsdp2-x{processes}")) and "time_vs_ddp" in row:
            pairs.append((f"FSDP2 / DDP step time, {processes} processes: CPU time (wall time)",
                          f"{row['cpu_vs_ddp']:.2f} ({row['time_vs_ddp']:.2f})"))
    if (row := _find(rows, "fsdp2-ac-x2")) and "ac_time_cost" in row:
        pairs.append(("activation checkpointing: step time on / off (FSDP2, 2 processes): CPU (wall)",
                      f"{row['ac_cpu_cost']:.2f} ({row['ac_time_cost']:.2f})"))
        pairs.append(("activation checkpointing: step memory peak on / off", _ratio(row["ac_peak_ratio"])))
    checkpoint_row = next((row for row in rows if row["checkpoints"]), None)
    if checkpoint_row:
        sharded, full = checkpoint_row["checkpoints"]["SHARDED_STATE_DICT"], checkpoint_row["checkpoints"]["FULL_STATE_DICT"]
        pairs.append(("checkpoint save time, sharded / full state dict", f"{sharded['save_s'] / full['save_s']:.2f}"))
        pairs.append(("checkpoint load time, sharded / full state dict", f"{sharded['load_s'] / full['load_s']:.2f}"))
    comm = [abs(row["comm_error"]) for row in rows]
    pairs.append(("communication per step, counted vs planned, worst case", f"{max(comm):.2%}" if comm else "n/a"))
    if drill := report.get("resume_drill"):
        pairs.append(("resume cost: kill to training again (33.7M model, 2 processes)",
                      "n/a" if drill["recovery_s"] is None else f"{drill['recovery_s']:.1f} s"))
    if campaign := report.get("campaign"):
        figures = fault_campaign.summary(campaign)
        pairs.append(("fault campaign: resumed from a committed checkpoint with identical losses",
                      f"{figures['passed']}/{figures['trials']}"))
    return pairs


def render(report: dict, *, images: dict[str, str], campaign_section: str | None, gpu_section: str | None) -> str:
    rows, host, settings = report["cases"], report["host"], report["settings"]
    load_before = (host["load_average"] or [0.0])[0]
    load_after = (report["host_after"]["load_average"] or [0.0])[0]
    problems = verdict(report)
    lines = ["# Benchmarks", ""]
    lines += [f"<!-- Generated by `{report['command']}`: regenerate, do not edit (the fault-campaign and "
              "GPU sections are rewritten by their own scripts too). -->", ""]
    if problems:
        lines += ["**FAILED**: " + "; ".join(problems), ""]
    lines += [
        "Measured side by side in one run on one host, so the ratios compare like with like even where "
        "absolute times move with the load. Regenerate with:",
        "", "```", report["command"], "```", "",
        f"- Host: {host['cpu']}, {host['cores']} cores, {human_bytes(host['memory_bytes'] or 0)} RAM, "
        f"{report['platform']}; load average {load_before:.1f} at the start and {load_after:.1f} at the end"
        + (" (**the host was shared with other processes during this run**: absolute times are "
           "inflated and noisy, ratios from the same run remain comparable)"
           if max(load_before, load_after) > (host["cores"] or 1) * 0.5 else "") + ".",
        f"- Versions: Python {report['versions']['python']}, torch {report['versions']['torch']}, "
        f"transformers {report['versions']['transformers']}, accelerate {report['versions']['accelerate']}.",
        f"- Model: Llama from a config, {report['model_params'] / 1e6:.1f}M parameters (hidden "
        f"{settings['model']['hidden_size']}, {settings['model']['num_hidden_layers']} layers, MLP "
        f"{settings['model']['intermediate_size']}, vocabulary {settings['model']['vocab_size']}, untied), fp32, "
        f"AdamW; sequence {settings['seq_len']}, micro-batch {settings['micro_batch']} per rank; real FSDP/DDP "
        "over gloo through `accelerate launch` (`fsdp_presets.enable_cpu_fsdp`), one thread per process.",
        "- Each case, one launch: a first step whose collectives are recorded and after which the "
        "state each rank holds is measured, a settling step, a step whose memory is measured, "
        f"{settings['warmup_steps']} warm-up step(s), then {settings['timed_steps']} timed steps. "
        f"The whole benchmark took {report['wall_s'] / 60:.1f} minutes.",
        "",
        "## Headline", "",
        "| figure | value |", "|---|---:|",
    ]
    lines += [f"| {what} | {value} |" for what, value in headline(report)]

    lines += ["", "## Per-rank model state: measured vs DDP vs planner", "",
              "Bytes one rank holds after an optimizer step (its shards): parameters, gradients, AdamW "
              "moments (`fsdp_harness.measure.held_state_bytes`; AdamW's per-parameter `step` scalars, "
              "a few hundred bytes, left out as the planner leaves them out). Planner: "
              "`fsdp_presets.plan.planner.plan(...)` row of the same strategy. The benchmark fails when any "
              f"rank's params, grads or optimizer state is more than {DEFAULT_TOLERANCE:.0%} off.", "",
              "| processes | strategy | params | grads | optimizer | total | / DDP | planned total | planner error |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        held = row["held"]
        lines.append(f"| {row['processes']} | {row['label']} | {_mib(held['params'])} | {_mib(held['grads'])} | "
                     f"{_mib(held['optimizer'])} | {_mib(held['total'])} | {_ratio(row.get('state_vs_ddp'), 4)} | "
                     f"{_mib(row['planned']['total'])} | {_pct(row['state_error'])} |")
    if "state" in images:
        lines += ["", f"![per-rank model state]({images['state']})"]

    lines += ["", "## Step time vs DDP", "",
              "Two clocks per timed step, the slowest rank's, median over steps: the CPU time a process "
              "used (all its threads, `time.process_time`: compute, copies, and the kernel's work "
              "moving gloo's bytes; waiting costs none), which other programs on a shared host barely "
              "change, and the wall time, which they do (its spread is shown). Compare the CPU-time "
              "ratios when the host was shared.", "",
              "| processes | strategy | CPU time | / DDP | wall time | fastest - slowest | / DDP | "
              "max loss difference vs DDP (same data) |",
              "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        fastest, slowest = row["step_time_range_s"]
        lines.append(f"| {row['processes']} | {row['label']} | {row['cpu_time_s']:.3f} s | "
                     f"{_ratio(row.get('cpu_vs_ddp'))} | {row['step_time_s']:.3f} s | "
                     f"{fastest:.2f} - {slowest:.2f} s | "
                     f"{_ratio(row.get('time_vs_ddp'))} | "
                     f"{'n/a' if 'loss_difference_vs_ddp' not in row else format(row['loss_difference_vs_ddp'], '.1e')} |")
    lines += ["", "Same initial weights and data in every case: the loss column shows the strategies train "
              "alike. On this host every process has one core and gloo moves tensors through the same "
              "cores over loopback TCP, so a collective cannot overlap with compute as NCCL on a GPU's "
              "own streams does: FSDP's extra traffic (FULL_SHARD gathers the parameters twice and "
              "reduce-scatters once: 1.4-1.5x the bytes of DDP's all-reduce here, see the communication table) and its "
              "per-unit copies show up in the step time. Read these ratios as a floor of FSDP's overhead "
              "on CPU, not as a GPU forecast; the GPU section below measures a GPU."]
    if "time" in images:
        lines += ["", f"![step time relative to DDP]({images['time']})"]

    lines += ["", "## Memory of a step, activation checkpointing on and off", "",
              "What was measured (torch keeps no allocator statistics for CPU tensors, unlike "
              "`torch.cuda.max_memory_allocated`): each process's resident set size (Linux `VmRSS`) "
              "between steps, and its peak during one training step (`VmHWM`, reset just before it). "
              "From its start until that step the process has glibc map every allocation of 64 KiB or "
              "more on its own and unmap it when freed (`mallopt(M_MMAP_THRESHOLD)`), so the resident "
              "set follows live tensors: the step peak above the between-steps size is the memory a "
              "step adds (gradients, activations, gathered parameters, communication buffers). Largest "
              "rank shown. The timed steps run afterwards with the allocator caching again. "
              "Between steps every process also holds the Python and torch runtime (a few hundred MiB) "
              "and DDP its gradient buckets.", "",
              "| processes | strategy | between steps | peak in a step | a step adds |",
              "|---:|---|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['processes']} | {row['label']} | {_mib(row['rss_between_steps_bytes'])} | "
                     f"{_mib(row['rss_peak_bytes'])} | {_mib(row['step_peak_bytes'])} |")
    if (row := _find(rows, "fsdp2-ac-x2")) and "ac_time_cost" in row:
        saved = "n/a" if row["ac_peak_ratio"] is None else f"{1 - row['ac_peak_ratio']:.0%}"
        off = _find(rows, "fsdp2-x2")
        lines += ["", f"Activation checkpointing (FSDP2, 2 processes): step CPU time x{row['ac_cpu_cost']:.2f} "
                  f"(wall x{row['ac_time_cost']:.2f}), "
                  f"memory a step adds x{_ratio(row['ac_peak_ratio'])} ({saved} saved). What it can save is the "
                  f"blocks' activations: the planner puts all saved activations and logits at "
                  f"{_mib(off['planned_activations_bytes'])} without and {_mib(row['planned_activations_bytes'])} "
                  "with it (Korthikanti et al. 2022, fp32); the rest of the step's peak (gradients, the "
                  "logits and their gradient over the vocabulary, gathered units) stays."]

    lines += ["", "## Communication per step: counted vs planned", "",
              "Every collective of the first step, recorded with its payload (a `CommDebugMode` for FSDP, "
              "a communication hook for DDP, whose all-reduces start in C++), converted to what one rank "
              "sends with ring algorithms ((n-1)/n of the buffer for all-gather and reduce-scatter, "
              "2(n-1)/n for all-reduce), the planner's convention.", "",
              "| processes | strategy | all-gather | reduce-scatter | all-reduce | total sent | planned | error |",
              "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        sent, planned = row["sent"], row["planned_comm"]
        lines.append(f"| {row['processes']} | {row['label']} | {_mib(sent['all_gather'])} | "
                     f"{_mib(sent['reduce_scatter'])} | {_mib(sent['all_reduce'])} | {_mib(sent['total'])} | "
                     f"{_mib(planned['total'])} | {_pct(row['comm_error'])} |")

    checkpoint_row = next((row for row in rows if row["checkpoints"]), None)
    if checkpoint_row:
        lines += ["", "## Checkpoints: sharded vs full state dict", "",
                  f"{checkpoint_row['label']}, {checkpoint_row['processes']} processes: a committed checkpoint "
                  "(`fsdp_presets.checkpoint.manager.CheckpointManager`: `accelerator.save_state` into a temporary "
                  "folder, SHA-256 of every file, manifest, rename) and its load, model + optimizer + RNG. "
                  "Times: the slowest rank. Bytes: what each rank wrote.", "",
                  "| state dict | save | load | bytes rank 0 | bytes rank 1 | files |", "|---|---:|---:|---:|---:|---:|"]
        for kind, value in checkpoint_row["checkpoints"].items():
            per_rank = value["bytes_per_rank"] + [0]
            lines.append(f"| {kind} | {value['save_s']:.2f} s | {value['load_s']:.2f} s | {_mib(per_rank[0])} | "
                         f"{_mib(per_rank[1])} | {value['files']} |")
        if "checkpoint" in images:
            lines += ["", f"![checkpoint save and load]({images['checkpoint']})"]

    if drill := report.get("resume_drill"):
        lines += ["", "## Resume cost: kill to training again", "",
                  "`recipes/causal_lm.py` on the benchmark model (FSDP2, 2 processes, sequence "
                  f"{settings['seq_len']}, a sharded checkpoint every 2 steps of {_mib(drill['checkpoint_bytes'])}): "
                  f"{_kill_text(drill)}, then the same command with `--resume auto`.", "",
                  "| kill to launcher exit | kill to checkpoint loaded | kill to first new step | steps lost | resumed from |",
                  "|---:|---:|---:|---:|---:|",
                  f"| {fault_campaign._seconds(drill['kill_to_exit_s'])} | {fault_campaign._seconds(drill['kill_to_loaded_s'])} | "
                  f"{fault_campaign._seconds(drill['recovery_s'])} | {drill['steps_lost']} | step {drill['resumed_step']} |"]
        if drill["problems"]:
            lines += ["", "Problems: " + "; ".join(drill["problems"])]

    lines += [""]
    lines += [(campaign_section or doc_sections.wrap(fault_campaign.SECTION, (
        "## Fault campaign\n\nNot run in this benchmark (`python scripts/fault_campaign.py` writes this "
        "section)."))).rstrip("\n")]
    lines += ["", (gpu_section or default_gpu_section()).rstrip("\n")]
    return "\n".join(lines) + "\n"


def _kill_text(drill: dict) -> str:
    from fsdp_harness.drill import KillPlan

    return KillPlan(**drill["plan"]).describe() + " (SIGKILL)"


def default_gpu_section() -> str:
    return doc_sections.wrap(GPU_SECTION, (
        "## GPU: throughput, MFU and peak memory\n\n"
        "Not measured yet: the host of this run has no GPU. On a CUDA machine, `bash scripts/gpu_bench.sh` "
        "runs the causal-LM recipe on a ~1B Llama config and rewrites this section with tokens/s, model "
        "FLOPs utilisation and peak memory against the planner."))


def existing_section(path: Path, name: str) -> str | None:
    """Section ``name`` of the document at ``path`` as it is now (None when absent)."""
    return doc_sections.find(path.read_text(), name) if path.is_file() else None


# --------------------------------------------------------------------------- charts


def _chart_label(row: dict) -> str:
    return f"{row.get('short') or row['label']}\n{row['processes']} processes"


def plot_charts(report: dict, img_dir: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    img_dir.mkdir(parents=True, exist_ok=True)
    rows = report["cases"]
    paths = {}
    labels = [_chart_label(row) for row in rows]

    figure, axes = pyplot.subplots(figsize=(9, 4.2))
    bottoms = [0.0] * len(rows)
    for part, color in (("params", "tab:blue"), ("grads", "tab:orange"), ("optimizer", "tab:green")):
        values = [row["held"][part] / 2**20 for row in rows]
        axes.bar(range(len(rows)), values, bottom=bottoms, color=color, label=part)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    axes.scatter(range(len(rows)), [row["planned"]["total"] / 2**20 for row in rows], marker="_", s=600,
                 color="black", label="planner", zorder=3)
    axes.set_xticks(range(len(rows)), labels, fontsize=7)
    axes.set_ylabel("MiB per rank")
    axes.set_title("Per-rank model state after a step (measured) and the planner's prediction", fontsize=9)
    axes.legend(fontsize=8)
    figure.tight_layout()
    paths["state"] = img_dir / "bench_state.png"
    figure.savefig(paths["state"], dpi=110)
    pyplot.close(figure)

    with_ratio = [row for row in rows if "time_vs_ddp" in row]
    if with_ratio:
        figure, axes = pyplot.subplots(figsize=(9, 3.8))
        width = 0.4
        axes.bar([index - width / 2 for index in range(len(with_ratio))], [row["cpu_vs_ddp"] for row in with_ratio],
                 width, color="tab:blue", label="CPU time")
        axes.bar([index + width / 2 for index in range(len(with_ratio))], [row["time_vs_ddp"] for row in with_ratio],
                 width, color="tab:gray", label="wall time")
        axes.axhline(1.0, color="black", linewidth=0.8)
        axes.legend(fontsize=8)
        axes.set_xticks(range(len(with_ratio)), [_chart_label(row) for row in with_ratio], fontsize=7)
        axes.set_ylabel("step time / DDP (same processes)")
        axes.set_title("Step time relative to DDP", fontsize=9)
        figure.tight_layout()
        paths["time"] = img_dir / "bench_step_time.png"
        figure.savefig(paths["time"], dpi=110)
        pyplot.close(figure)

    checkpoint_row = next((row for row in rows if row["checkpoints"]), None)
    if checkpoint_row:
        kinds = list(checkpoint_row["checkpoints"])
        figure, axes = pyplot.subplots(figsize=(6, 3.6))
        width = 0.38
        for offset, (what, color) in zip((-width / 2, width / 2), (("save_s", "tab:blue"), ("load_s", "tab:orange"))):
            axes.bar([index + offset for index in range(len(kinds))],
                     [checkpoint_row["checkpoints"][kind][what] for kind in kinds], width, color=color,
                     label=what.replace("_s", ""))
        axes.set_xticks(range(len(kinds)), kinds, fontsize=8)
        axes.set_ylabel("seconds (slowest rank)")
        axes.set_title(f"Checkpoint save and load, {checkpoint_row['label']} x{checkpoint_row['processes']}", fontsize=9)
        axes.legend(fontsize=8)
        figure.tight_layout()
        paths["checkpoint"] = img_dir / "bench_checkpoint.png"
        figure.savefig(paths["checkpoint"], dpi=110)
        pyplot.close(figure)
    return paths


# --------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: tiny model, DDP and FSDP2 on 2 processes, no drill, no campaign")
    parser.add_argument("--output", default=str(DOC), help="the markdown report (default docs/benchmarks.md)")
    parser.add_argument("--img-dir", default=str(IMG_DIR), help="where the PNG charts go (default docs/img)")
    parser.add_argument("--work-dir", help="launch folders and logs (default: a temporary folder, removed)")
    parser.add_argument("--campaign-trials", type=int, default=10, help="fault campaign trials (0: skip; default 10)")
    parser.add_argument("--campaign-seed", type=int, help="seed of the fault campaign (default: fresh, printed)")
    parser.add_argument("--campaign-json", help="use this fault_campaign.py result instead of running the campaign")
    parser.add_argument("--no-drill", action="store_true", help="skip the resume-cost drill")
    parser.add_argument("--timed-steps", type=int, help="timed steps per case (default 3; 2 with --quick)")
    parser.add_argument("--render", metavar="REPORT_JSON",
                        help="only rewrite the report and charts from a saved docs/benchmarks.json (no launches)")
    parser.add_argument("--cases", help=f"comma-separated cases to run (default: all; known: "
                        f"{', '.join(case.name for case in FULL_CASES)}; --quick: {', '.join(c.name for c in QUICK_CASES)})")
    return parser.parse_args(argv)


def command_line(argv: list[str] | None) -> str:
    """The command that regenerates the report (where launch folders went does not change it)."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    for index, argument in enumerate(arguments):
        if argument == "--work-dir":
            del arguments[index:index + 2]
            break
        if argument.startswith("--work-dir="):
            del arguments[index]
            break
    return shlex.join(["python", "scripts/bench.py", *arguments])


def _versions() -> dict[str, str]:
    import accelerate
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "accelerate": accelerate.__version__}


def main(argv=None) -> int:
    from fsdp_harness.measure import host_description
    from fsdp_presets.plan.profile import profile_model

    args = parse_args(argv)
    if args.render:
        return publish(json.loads(Path(args.render).read_text()), Path(args.output), Path(args.img_dir))
    settings = QUICK_SETTINGS if args.quick else FULL_SETTINGS
    if args.timed_steps:
        settings = BenchSettings(**{**vars(settings), "timed_steps": args.timed_steps})
    cases = QUICK_CASES if args.quick else FULL_CASES
    if args.cases:
        by_name = {case.name: case for case in FULL_CASES}
        unknown = [name for name in args.cases.split(",") if name not in by_name]
        if unknown:
            raise SystemExit(f"bench.py: error: unknown case(s) {', '.join(unknown)}; known: {', '.join(by_name)}")
        cases = tuple(by_name[name] for name in args.cases.split(","))
    temporary = None if args.work_dir else tempfile.mkdtemp(prefix="bench-")
    work_dir = Path(args.work_dir or temporary)
    work_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    report = {"command": command_line(argv), "date": datetime.date.today().isoformat(),
              "host": host_description(), "platform": platform.platform(terse=True), "versions": _versions(),
              "settings": vars(settings)}
    try:
        (work_dir / "config.json").write_text(json.dumps(settings.model, indent=1))
        profile = profile_model(str(work_dir / "config.json"))
        report["model_params"] = profile.total_params
        rows = []
        for case in cases:
            print(f"bench: {case.name} ({case.label}, {case.processes} processes) ...", flush=True)
            case_started = time.monotonic()
            rows.append(analyse_case(case, run_case(case, settings, work_dir), profile, settings))
            print(f"bench: {case.name}: step {rows[-1]['step_time_s']:.3f} s, per-rank state "
                  f"{_mib(rows[-1]['held']['total'])} (planner {_pct(rows[-1]['state_error'])}), "
                  f"{time.monotonic() - case_started:.0f} s", flush=True)
        add_ratios(rows)
        report["cases"] = rows
        if not args.quick and not args.no_drill:
            print("bench: resume drill ...", flush=True)
            report["resume_drill"] = resume_drill(settings, work_dir)
        campaign = None
        if args.campaign_json:
            campaign = json.loads(Path(args.campaign_json).read_text())
        elif args.campaign_trials and not args.quick:
            campaign_args = ["--trials", str(args.campaign_trials), "--work-dir", str(work_dir / "campaign")]
            if args.campaign_seed is not None:
                campaign_args += ["--seed", str(args.campaign_seed)]
            campaign_settings = fault_campaign.settings_from(fault_campaign.parse_args(campaign_args))
            print(f"bench: fault campaign, seed {campaign_settings.seed} ...", flush=True)
            campaign = fault_campaign.run_campaign(campaign_settings, work_dir / "campaign",
                                                   log=lambda message: print(f"  {message}", flush=True))
            campaign["command"] = fault_campaign.replay_command(campaign_settings, quick=False)
        report["campaign"] = campaign
    finally:
        if temporary:
            shutil.rmtree(temporary, ignore_errors=True)
    report["host_after"] = host_description()
    report["wall_s"] = time.monotonic() - started
    return publish(report, Path(args.output), Path(args.img_dir))


def publish(report: dict, output: Path, img_dir: Path) -> int:
    """Write the report, its JSON and the charts; print the headline; 1 when the run failed."""
    images = plot_charts(report, img_dir)
    relative = {key: Path(os.path.relpath(path, output.parent)).as_posix() for key, path in images.items()}
    campaign_section = None
    if report["campaign"]:
        image = fault_campaign.plot_campaign(report["campaign"], img_dir / "fault_campaign.png")
        campaign_section = fault_campaign.to_markdown(
            report["campaign"], command=report["campaign"].get("command", "python scripts/fault_campaign.py"),
            image=Path(os.path.relpath(image, output.parent)).as_posix())
    else:
        campaign_section = existing_section(output, fault_campaign.SECTION)
    gpu_section = existing_section(output, GPU_SECTION)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(render(report, images=relative, campaign_section=campaign_section, gpu_section=gpu_section))
    output.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str))
    for what, value in headline(report):
        print(f"  {what}: {value}")
    print(f"bench: report written to {output} ({report['wall_s'] / 60:.1f} minutes)", flush=True)
    problems = verdict(report)
    if problems:
        print("BENCHMARK FAILED:\n  " + "\n  ".join(problems), file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
