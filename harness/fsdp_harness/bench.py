"""Benchmark FSDP against DDP on this host and against the planner, all ratios from one run.

The cases, launches and analysis behind ``scripts/bench.py`` (its docstring gives the usage, the
cost and the exit status); :mod:`fsdp_harness.bench_report` writes the report and the charts.
Every case is one ``accelerate launch`` of ``scripts/bench_worker.py`` under an accelerate config
written the way users write them; :data:`FULL_CASES` lists them and :data:`BENCH_MODEL` is the
model. After the cases come a kill-and-resume drill of ``recipes/causal_lm.py`` on the same
model (:func:`resume_drill`) and the fault campaign (:mod:`fsdp_harness.campaign`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from fsdp_harness import campaign as fault_campaign
from fsdp_harness.launch import write_accelerate_config
from fsdp_harness.measure import DEFAULT_TOLERANCE, relative_error, sent_bytes, state_deviations
from fsdp_presets.checkpoint.layout import CHECKPOINTS, step_folder
from fsdp_presets.fileio import GiB
from fsdp_presets.plan.shapes import Hardware, TrainingShape
from fsdp_presets.plan.planner import human_bytes, plan

REPO = Path(__file__).resolve().parents[2]  # harness/fsdp_harness/x.py -> the checkout
WORKER = REPO / "scripts" / "bench_worker.py"
DOC = REPO / "docs" / "benchmarks.md"
IMG_DIR = REPO / "docs" / "img"

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

    config = write_accelerate_config(
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
    from fsdp_presets.launching.local import launch_command

    model = write_model_folder(work_dir / "drill-model", settings.model)
    config = write_accelerate_config(work_dir / "drill.yaml", num_processes=2)
    run_dir = work_dir / "drill-run"
    command = launch_command(config, fault_campaign.RECIPE, [
        "--model", model, "--data", fault_campaign.TRAIN_DATA, "--eval-data", fault_campaign.EVAL_DATA,
        "--max-eval-samples", 16, "--output-dir", run_dir, "--seq-len", settings.seq_len,
        "--micro-batch", settings.micro_batch, "--max-steps", 8, "--save-every", 2, "--resume", "auto"])
    result = kill_and_resume(command, run_dir=run_dir, plan=KillPlan(rank=1, mode="timer", after_step=3),
                             log_dir=work_dir, cwd=REPO, finish=False)
    record = result.to_json()
    loaded = step_folder(run_dir / CHECKPOINTS, result.resumed_step or 0)
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


# --------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench.py", description=__doc__.split("\n\n")[0],
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
    from fsdp_harness.bench_report import publish
    from fsdp_harness.measure import host_description
    from fsdp_presets.model.profile import profile_model

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
                  f"{human_bytes(rows[-1]['held']['total'])} (planner {rows[-1]['state_error']:+.2%}), "
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
