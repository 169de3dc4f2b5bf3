"""Fault campaign: kill a random rank of a short training run at a random moment, resume, check.

    python scripts/fault_campaign.py [--trials 10] [--seed N] [--processes 2]

Trains ``recipes/causal_lm.py`` (a tiny Llama built from the words of ``data/kjv_sft``, FSDP2
FULL_SHARD over gloo, sharded checkpoints every ``--save-every`` steps, ``--resume auto``) once
without interruption, then ``--trials`` times with one random rank SIGKILLed at a random moment
(:mod:`fsdp_harness.drill`): either from outside, a random delay after a random step (it lands
mid-step or mid-save), or from inside the save of a random checkpoint step, after the shards are
written and before the manifest commits them (:mod:`fsdp_presets.faults`). Each killed run is
then launched again with the same command.

A trial passes when the run resumed from the newest checkpoint committed before the kill and
its losses equal the uninterrupted run's, step for step and bitwise. The campaign reports k/N,
the steps each kill cost and the recovery time (kill to the first new step). Exit status 1 when
any trial lost a committed checkpoint, failed to resume, or diverged; the seed is printed and
recorded, so ``--seed N`` replays the same kill plans.

Results: the ``fault campaign`` section of ``docs/benchmarks.md`` (rewritten in place; the rest
of the file is left alone), ``docs/img/fault_campaign.png`` and ``WORK_DIR/campaign.json``.
``scripts/bench.py`` runs this campaign as part of the benchmark; the campaign itself is
:mod:`fsdp_harness.campaign`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from fsdp_harness import doc_sections
from fsdp_harness.campaign import (SECTION, failures, parse_args, plot_campaign, replay_command, run_campaign,
                                   settings_from, summary, to_markdown)


def main(argv=None) -> int:
    args = parse_args(argv)
    settings = settings_from(args)
    print(f"fault campaign: seed {settings.seed} ({settings.trials} trial(s), {settings.processes} processes)",
          flush=True)
    temporary = None if args.work_dir else tempfile.mkdtemp(prefix="fault-campaign-")
    work_dir = Path(args.work_dir or temporary)
    try:
        campaign = run_campaign(settings, work_dir, log=lambda message: print(message, flush=True))
        campaign["command"] = replay_command(settings, args.quick)
        (work_dir / "campaign.json").write_text(json.dumps(campaign, indent=1))
        image = plot_campaign(campaign, Path(args.img_dir) / "fault_campaign.png")
        relative = Path(os.path.relpath(image, Path(args.doc).parent)).as_posix()
        doc_sections.replace_in_file(args.doc, SECTION, to_markdown(campaign, command=campaign["command"], image=relative))
    finally:
        if temporary:
            shutil.rmtree(temporary, ignore_errors=True)
    figures = summary(campaign)
    print(f"fault campaign: {figures['passed']}/{figures['trials']} trials resumed from a committed checkpoint "
          f"with identical losses; section written to {args.doc}", flush=True)
    problems = failures(campaign)
    if problems:
        print("FAULT CAMPAIGN FAILED:\n  " + "\n  ".join(problems), file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
