"""The fault campaign behind ``scripts/fault_campaign.py`` (and the benchmark's campaign part):
kill a random rank of a short ``recipes/causal_lm.py`` run at a random moment, resume, compare.

Kill plans are seeded (:func:`kill_plans`), each trial is one :func:`fsdp_harness.drill.kill_and_resume`,
and a trial passes when the run resumed from the newest checkpoint committed before the kill with
losses bitwise equal to the uninterrupted run's. The record :func:`run_campaign` returns is what
:func:`to_markdown` and :func:`plot_campaign` turn into the ``fault-campaign`` section of
``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from fsdp_harness import doc_sections
from fsdp_harness.drill import DrillResult, KillPlan, kill_and_resume, run_watched
from fsdp_harness.launch import write_accelerate_config
from fsdp_presets.launching.local import launch_command
from fsdp_presets.checkpoint.layout import METRICS
from fsdp_presets.train.metrics import train_losses

REPO = Path(__file__).resolve().parents[2]  # harness/fsdp_harness/x.py -> the checkout
DESCRIPTION = "Fault campaign: kill a random rank of a short training run at a random moment, resume, check."
RECIPE = REPO / "recipes" / "causal_lm.py"
TRAIN_DATA = REPO / "data" / "kjv_sft" / "train.jsonl"
EVAL_DATA = REPO / "data" / "kjv_sft" / "eval.jsonl"
DOC = REPO / "docs" / "benchmarks.md"
IMG_DIR = REPO / "docs" / "img"
SECTION = "fault-campaign"
"""Name of this script's section in docs/benchmarks.md (:mod:`fsdp_harness.doc_sections`)."""


@dataclass(frozen=True, kw_only=True)
class CampaignSettings:
    """The run every trial repeats."""

    trials: int = 10
    """Killed-and-resumed runs."""
    processes: int = 2
    """Ranks of each run (one of them is killed)."""
    max_steps: int = 12
    """Optimizer steps of each run."""
    save_every: int = 3
    """Steps between committed checkpoints."""
    seed: int = 0
    """Seed of the kill plans (the training seed is fixed)."""

    def __post_init__(self) -> None:
        problems = []
        if self.trials < 1:
            problems.append(f"--trials {self.trials} < 1")
        if self.processes < 2:
            problems.append(f"--processes {self.processes} < 2: a rank must die while another lives")
        if self.save_every < 1:
            problems.append(f"--save-every {self.save_every} < 1")
        if self.max_steps < 3 * self.save_every:
            problems.append(f"--max-steps {self.max_steps} < 3 x --save-every: a kill needs a committed "
                            "checkpoint before it and steps after it")
        if problems:
            raise SystemExit("fault_campaign.py: error: " + "; ".join(problems))


def recipe_command(config: Path, model: Path, run_dir: Path, settings: CampaignSettings) -> list[str]:
    """The recipe run every trial repeats (packed 32-token blocks, a checkpoint every few steps)."""
    return launch_command(config, RECIPE, [
        "--model", model, "--data", TRAIN_DATA, "--eval-data", EVAL_DATA, "--max-eval-samples", 16,
        "--output-dir", run_dir, "--seq-len", 32, "--micro-batch", 2, "--learning-rate", 3e-3,
        "--max-steps", settings.max_steps, "--save-every", settings.save_every, "--keep-last", 2,
        "--seed", 1234, "--resume", "auto"])


def kill_plans(settings: CampaignSettings, cycle_s: float) -> list[KillPlan]:
    """Random kill plans. Timer kills follow a step after the first commit by up to one save
    cycle (``cycle_s``: ``save_every`` steps and a save), so they land mid-step or mid-save, and
    always before the run ends; save kills interrupt a checkpoint after the first one."""
    rng = random.Random(settings.seed)
    timer_steps = range(settings.save_every + 1, settings.max_steps - settings.save_every + 1)
    save_steps = range(2 * settings.save_every, settings.max_steps + 1, settings.save_every)
    plans = []
    for _ in range(settings.trials):
        rank = rng.randrange(settings.processes)
        if rng.random() < 0.5:
            plans.append(KillPlan(rank=rank, mode="timer", after_step=rng.choice(timer_steps),
                                  delay_s=round(rng.uniform(0, cycle_s), 3)))
        else:
            plans.append(KillPlan(rank=rank, mode="during-save", after_step=rng.choice(save_steps)))
    return plans


def save_cycle_s(seen: dict[int, float], save_every: int) -> float:
    """Median time of ``save_every`` steps and one save in the uninterrupted run."""
    spans = [seen[step + save_every] - seen[step] for step in seen if step + save_every in seen]
    return statistics.median(spans) if spans else 1.0


def run_campaign(settings: CampaignSettings, work_dir: Path, *, log=print) -> dict:
    """Baseline, then every trial; returns the campaign record (see ``to_markdown``)."""
    from transformers.utils import logging

    from fsdp_harness.tiny_model import write_tiny_model

    logging.disable_progress_bar()  # no "Writing model shards" bar in the campaign's output
    work_dir.mkdir(parents=True, exist_ok=True)
    model = write_tiny_model(work_dir / "model", kind="llama", text=TRAIN_DATA.read_text(), max_positions=128)
    config = write_accelerate_config(work_dir / "fsdp2.yaml", num_processes=settings.processes)
    started = time.monotonic()

    baseline_dir = work_dir / "uninterrupted"
    code, seen = run_watched(recipe_command(config, model, baseline_dir, settings), run_dir=baseline_dir,
                             log_path=work_dir / "uninterrupted.log", cwd=REPO)
    if code != 0:
        raise SystemExit(f"fault_campaign.py: the uninterrupted run failed (exit status {code}); "
                         f"see {work_dir / 'uninterrupted.log'}")
    reference = train_losses(baseline_dir / METRICS)
    cycle = save_cycle_s(seen, settings.save_every)
    log(f"uninterrupted run: {len(reference)} steps, a save cycle takes {cycle:.2f} s")

    trials = []
    for index, plan in enumerate(kill_plans(settings, cycle), start=1):
        run_dir = work_dir / f"trial-{index:02d}"
        result: DrillResult = kill_and_resume(recipe_command(config, model, run_dir, settings), run_dir=run_dir,
                                              plan=plan, log_dir=work_dir, cwd=REPO)
        losses = train_losses(run_dir / METRICS)
        identical = result.killed and losses == reference
        differences = [abs(losses[step] - reference[step]) for step in reference if step in losses]
        trial = {"trial": index, **result.to_json(), "landed": landed(result, settings.save_every),
                 "identical_losses": identical,
                 "max_loss_difference": max(differences) if differences else None,
                 "steps_logged": sorted(losses)}
        if result.killed and not identical and not result.problems:
            trial["problems"] = [f"losses differ from the uninterrupted run (max |difference| "
                                 f"{trial['max_loss_difference']})" if differences else "no losses logged"]
        trial["passed"] = bool(result.killed and identical and not result.lost_checkpoint and not trial["problems"])
        trials.append(trial)
        log(f"trial {index}/{settings.trials}: {plan.describe()}: "
            + (f"resumed from step {result.resumed_step} (newest committed before the kill: "
               f"{result.committed_before_kill}), {result.steps_lost} step(s) lost, recovery "
               f"{result.recovery_s:.1f} s, losses {'identical' if identical else 'DIFFER'}"
               if result.killed and result.recovery_s is not None else "; ".join(trial["problems"])))
    return {"settings": vars(settings), "reference_steps": len(reference), "save_cycle_s": cycle,
            "trials": trials, "wall_s": time.monotonic() - started}


def landed(result: DrillResult, save_every: int) -> str:
    """Where the kill struck: ``mid-save`` when the last finished step was a checkpoint step whose
    checkpoint never committed, else ``mid-step``."""
    last = result.last_step_before_kill
    if result.plan.mode == "during-save" or (last and last % save_every == 0 and last not in result.valid_after_crash):
        return "mid-save"
    return "mid-step"


def summary(campaign: dict) -> dict:
    """Headline figures of a campaign record."""
    trials = campaign["trials"]
    interrupted = [t for t in trials if t["killed"]]
    recovered = [t["recovery_s"] for t in interrupted if t["recovery_s"] is not None]
    lost = [t["steps_lost"] for t in interrupted if t["steps_lost"] is not None]
    return {
        "trials": len(trials),
        "passed": sum(t["passed"] for t in trials),
        "interrupted": len(interrupted),
        "lost_checkpoints": sum(t["lost_checkpoint"] for t in trials),
        "failed": [t["trial"] for t in trials if not t["passed"]],
        "steps_lost_mean": statistics.mean(lost) if lost else None,
        "steps_lost_max": max(lost) if lost else None,
        "recovery_median_s": statistics.median(recovered) if recovered else None,
        "recovery_max_s": max(recovered) if recovered else None,
        "kill_to_exit_median_s": statistics.median([t["kill_to_exit_s"] for t in interrupted])
        if interrupted else None,
        "mid_save": sum(t.get("landed") == "mid-save" for t in interrupted),
        "mid_step": sum(t.get("landed") == "mid-step" for t in interrupted),
    }


def failures(campaign: dict) -> list[str]:
    """Why the campaign fails (empty when every trial passed)."""
    return [f"trial {t['trial']}: " + "; ".join(t["problems"] or ["did not pass"])
            for t in campaign["trials"] if not t["passed"]]


def seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} s"


def to_markdown(campaign: dict, *, command: str, image: str | None) -> str:
    """The campaign section of docs/benchmarks.md (markers included)."""
    settings, figures = campaign["settings"], summary(campaign)
    lines = [
        "## Fault campaign: kill a rank, resume, compare",
        "",
        f"Command: `{command}` (seed {settings['seed']}; the same seed replays the same kill plans).",
        "",
        f"Each trial trains `recipes/causal_lm.py` (tiny Llama from `data/kjv_sft`, FSDP2 FULL_SHARD, "
        f"{settings['processes']} processes, {settings['max_steps']} steps, a sharded checkpoint every "
        f"{settings['save_every']} steps, `--resume auto`) and SIGKILLs one random rank: either a random "
        f"delay (up to one save cycle, {campaign['save_cycle_s']:.2f} s here) after a random step, which "
        "lands mid-step or mid-save, or inside a save after the shards are written and before the "
        "manifest commits them (`FSDP_PRESETS_FAULT=kill-during-save`). The same command is then run "
        "again. A trial passes when it resumed from the newest checkpoint committed before the kill "
        "and every logged loss equals the uninterrupted run's, bitwise.",
        "",
        f"Kills this run: {figures['mid_save']} mid-save, {figures['mid_step']} mid-step.",
        "",
        f"**{figures['passed']}/{figures['trials']} trials resumed from a committed checkpoint with losses "
        f"identical to the uninterrupted run**; committed checkpoints lost: {figures['lost_checkpoints']}; "
        f"steps lost per kill: mean {figures['steps_lost_mean'] if figures['steps_lost_mean'] is None else round(figures['steps_lost_mean'], 1)}, "
        f"max {figures['steps_lost_max']}; recovery (kill to the first new step): median "
        f"{seconds(figures['recovery_median_s'])}, max {seconds(figures['recovery_max_s'])}, of which the "
        f"launcher needed a median {seconds(figures['kill_to_exit_median_s'])} to stop the other ranks "
        "(the rest is start-up, checkpoint load and one step).",
        "",
        "| trial | kill | last step done | newest committed | resumed from | steps lost | recovery | losses |",
        "|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for t in campaign["trials"]:
        plan = KillPlan(**t["plan"])
        verdict = "identical" if t["identical_losses"] else ("DIFFER" if t["killed"] else "not interrupted")
        if t["problems"]:
            verdict += " (" + "; ".join(t["problems"]) + ")"
        where = f" ({t['landed']})" if t.get("landed") and t["killed"] and plan.mode == "timer" else ""
        lines.append(f"| {t['trial']} | {plan.describe()}{where} | {t['last_step_before_kill']} | "
                     f"{t['committed_before_kill'] if t['committed_before_kill'] is not None else 'none'} | "
                     f"{t['resumed_step'] if t['resumed_step'] is not None else 'n/a'} | "
                     f"{t['steps_lost'] if t['steps_lost'] is not None else 'n/a'} | "
                     f"{seconds(t['recovery_s'])} | {verdict} |")
    if image:
        lines += ["", f"![recovery time and steps lost per trial]({image})"]
    return doc_sections.wrap(SECTION, "\n".join(lines))


def plot_campaign(campaign: dict, path: Path) -> Path:
    """Recovery per trial, stacked: launcher tear-down, start-up and checkpoint load, first step;
    the optimizer steps each kill cost above the bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    trials = campaign["trials"]
    labels = [f"{t['trial']}\n{'timer' if t['plan']['mode'] == 'timer' else 'save'}" for t in trials]
    teardown = [t["kill_to_exit_s"] or 0.0 for t in trials]
    loaded = [max(0.0, (t.get("kill_to_loaded_s") or 0.0) - down) if t.get("kill_to_loaded_s") else 0.0
              for t, down in zip(trials, teardown)]
    first_step = [max(0.0, (t["recovery_s"] or 0.0) - down - load) for t, down, load in zip(trials, teardown, loaded)]
    figure, axes = pyplot.subplots(figsize=(7.5, 3.8))
    bottom = [0.0] * len(trials)
    for values, name, color in ((teardown, "launcher stops the other ranks", "tab:red"),
                                (loaded, "start-up and checkpoint load", "tab:blue"),
                                (first_step, "first new step", "tab:green")):
        axes.bar(labels, values, bottom=bottom, color=color, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    for index, trial in enumerate(trials):
        text = f"{trial['steps_lost']} lost" if trial["steps_lost"] is not None else "not resumed"
        axes.annotate(text, (index, bottom[index]), ha="center", va="bottom", fontsize=7)
    axes.set_xlabel("trial and kill (timer: from outside at a random moment; save: inside a save)")
    axes.set_ylabel("seconds from the kill")
    axes.set_title("Fault campaign: recovery per trial (label: optimizer steps lost)", fontsize=9)
    axes.set_ylim(0, max(bottom, default=1.0) * 1.3 or 1.0)
    axes.legend(fontsize=7, loc="upper center", ncol=3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
    return path


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fault_campaign.py", description=DESCRIPTION)
    parser.add_argument("--trials", type=int, default=10, help="killed-and-resumed runs (default 10)")
    parser.add_argument("--seed", type=int, help="seed of the kill plans (default: a fresh one, printed)")
    parser.add_argument("--processes", type=int, default=2, help="ranks per run (default 2)")
    parser.add_argument("--max-steps", type=int, default=12, help="optimizer steps per run (default 12)")
    parser.add_argument("--save-every", type=int, default=3, help="steps between checkpoints (default 3)")
    parser.add_argument("--quick", action="store_true", help="one trial of a 6-step run (a smoke test)")
    parser.add_argument("--work-dir", help="where runs and logs go (default: a temporary folder, removed)")
    parser.add_argument("--doc", default=str(DOC), help="markdown file whose campaign section is rewritten")
    parser.add_argument("--img-dir", default=str(IMG_DIR), help="where fault_campaign.png goes")
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace) -> CampaignSettings:
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    if args.quick:
        return CampaignSettings(trials=1, processes=args.processes, max_steps=6, save_every=2, seed=seed)
    return CampaignSettings(trials=args.trials, processes=args.processes, max_steps=args.max_steps,
                            save_every=args.save_every, seed=seed)


def replay_command(settings: CampaignSettings, quick: bool) -> str:
    words = ["python scripts/fault_campaign.py"]
    if quick:
        words.append("--quick")
    else:
        words += [f"--trials {settings.trials}", f"--processes {settings.processes}",
                  f"--max-steps {settings.max_steps}", f"--save-every {settings.save_every}"]
    return " ".join(words + [f"--seed {settings.seed}"])
