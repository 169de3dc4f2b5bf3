"""``plan --device cpu`` predicts the recipes' own CPU step: the host measured and the training steps
launched in one run (:mod:`fsdp_harness.cpu_step_time`). A wall-time measurement needs the host to
itself (other work moves the host's measurement and the runs differently), so it is not in the default
run: ``FSDP_PRESETS_TEST_WORKERS=0 scripts/test.sh -m wall_time`` runs it alone (about 2 minutes)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.wall_time]


def test_plan_device_cpu_predicts_the_recipes_step_within_a_quarter(tmp_path, monkeypatch):
    """SmolLM2-135M's config, a 33M and a 10M Llama under DDP and FSDP2 FULL_SHARD and SHARD_GRAD_OP
    on 2 gloo processes: each predicted step time within 25% of the measured median."""
    from fsdp_harness import cpu_step_time

    monkeypatch.setenv("FSDP_PRESETS_CACHE", str(tmp_path / "cache"))  # run() measures this host now
    rows = cpu_step_time.run(tmp_path)
    assert len(rows) == len(cpu_step_time.MODELS) * len(cpu_step_time.CASES)
    outside = [row for row in rows if not cpu_step_time.within(*row[2:])]
    assert not outside, [f"{name} {case}: measured {measured:.3f} s, predicted {predicted:.3f} s"
                         for name, case, measured, predicted in outside]
