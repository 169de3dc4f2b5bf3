"""Resume on another number of processes through the causal LM recipe.

One uninterrupted FSDP2 run on 2 processes (steps 1-10) is the reference. For FSDP2 and FSDP1
(``SHARDED_STATE_DICT``, DCP), a chain of launches continues a 2-process checkpoint of step 2 on
1 process (to step 4), then 2 (to 6), 4 (to 8) and 2 again (to 10): every change 2 -> 1, 1 -> 2,
2 -> 4, 4 -> 2 resumes a checkpoint written at another world size. Each launch is given the same
``--grad-accum 2``; the recipe must adjust it to keep the global batch of 8.

The classification recipe does the same through the same code (fsdp_presets.train.recipe): its
2-process FSDP2 reference (tests/classification_runs.py, tiny BERT without dropout) resumed from
step 4 on 1 process, with the same command, must take the same samples at every step (global
batch kept at 8: accumulation 2 -> 4) and log the same losses.

What must hold (tolerance: docs/checkpoints.md): the chain's metrics equal the reference's within
fp32 round-off (``fsdp-presets compare``'s fp32 tolerance, 1e-6 relative), ``samples_seen`` exact
at every step, and every step takes the same set of samples whatever the split.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from pathlib import Path

import pytest

from fsdp_presets import cli
from fsdp_presets.compare.records import load_run
from fsdp_presets.compare.report import summary_lines
from fsdp_presets.compare.runs import compare_runs
from fsdp_presets.errors import UsageError
from fsdp_presets.checkpoint.resume import accumulation_for, keep_global_batch
from fsdp_presets.train.loop import SampleStream, rank_micro_batches

import checkpoint_runs as runs
from conftest import real_launches
import classification_runs
from recipe_helpers import causal_lm_args, checkpoint

LEGS = ((1, 4), (2, 6), (4, 8), (2, 10))  # (processes, last step of the leg)
LOSS_TOLERANCE = 1e-6  # fp32 round-off, relative (docs/checkpoints.md)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return runs.base(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(root) -> Path:
    return runs.reference_run(root)


@pytest.fixture(scope="module", params=[2, 1], ids=["fsdp2", "fsdp1"])
def chain(request, root, reference) -> dict:
    """The legs of one FSDP version: run.json and stdout of each launch, in one run folder."""
    version = request.param
    model = runs.tiny_model(root)
    config = runs.fsdp_config(root, version)
    if version == 2:
        start = checkpoint(reference, 2)
    else:  # an FSDP1 checkpoint of step 2, written by 2 processes
        first = root / "fsdp1-start"
        runs.launch(config, causal_lm_args(model, first, *runs.SCHEDULE, "--max-steps", 2), processes=2)
        start = checkpoint(first, 2)
    run_dir = root / f"chain-fsdp{version}"
    legs, resume = [], str(start)
    for leg, (processes, last_step) in enumerate(LEGS):
        # The FSDP2 chain is the world-size-change proof: its shrink (2 -> 1) and its growth (1 -> 2)
        # are launched for real, as users run them; the 4-process legs fork their ranks (every new
        # interpreter costs seconds of CPU; tests/test_forked_launch.py: a forked run is the same run).
        with real_launches() if version == 2 and leg < 2 else contextlib.nullcontext():
            result = runs.launch(config, causal_lm_args(model, run_dir, *runs.SCHEDULE, "--max-steps", last_step,
                                                        "--resume", resume), processes=processes)
        legs.append({"processes": processes, "run": json.loads((run_dir / "run.json").read_text()),
                     "stdout": result.stdout})
        resume = "auto"
    return {"version": version, "run_dir": run_dir, "legs": legs, "start": start}


@pytest.mark.slow
def test_every_world_size_change_continues_like_the_uninterrupted_run(reference, chain):
    comparison = compare_runs(load_run(reference), load_run(chain["run_dir"]))
    assert comparison.agrees, "\n".join(summary_lines(comparison))
    assert comparison.metric("loss").steps == list(range(3, runs.REFERENCE_STEPS + 1))
    assert comparison.metric("loss").max_deviation <= LOSS_TOLERANCE
    reference_metrics = _train_lines(reference)
    chain_metrics = _train_lines(chain["run_dir"])
    assert sorted(chain_metrics) == list(range(3, runs.REFERENCE_STEPS + 1))
    for step, line in chain_metrics.items():
        # the data position: exact at every step, whichever process count took the step
        assert line["samples_seen"] == reference_metrics[step]["samples_seen"] == step * runs.GLOBAL_BATCH
        expected = reference_metrics[step]["loss"]
        assert abs(line["loss"] - expected) <= LOSS_TOLERANCE * abs(expected)
    # the loss moved: a chain that trained nothing (or reloaded step 2 each time) would not match
    assert reference_metrics[10]["loss"] < reference_metrics[3]["loss"] - 0.05


@pytest.mark.slow
def test_the_recipe_adjusts_gradient_accumulation_to_keep_the_global_batch(chain):
    for leg in chain["legs"]:
        run = leg["run"]
        assert run["world_size"] == leg["processes"]
        assert run["global_batch_samples"] == runs.GLOBAL_BATCH
        assert run["gradient_accumulation_steps"] == runs.GLOBAL_BATCH // (2 * leg["processes"])
        assert run["distributed_type"] == "FSDP" and run["fsdp"]["version"] == chain["version"]
        if leg["processes"] != 2:
            assert f"global batch kept at {runs.GLOBAL_BATCH} samples" in leg["stdout"]
    first = chain["legs"][0]["stdout"]
    assert f"resumed from {chain['start']}: step 2, 16 samples consumed (saved by 2 processes, now 1)" in first


@pytest.mark.slow
def test_inspect_checkpoint_shows_the_ranks_of_a_4_process_checkpoint(chain, capsys):
    folder = checkpoint(chain["run_dir"], 8)  # written by the 4-process leg
    assert cli.main(["inspect-checkpoint", str(folder), "--json", "--gpus", "2", "--gpus", "1"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["step"], summary["samples_consumed"], summary["world_size"]) == (8, 64, 4)
    assert summary["layout"] == "dcp" and summary["fsdp"]["version"] == chain["version"]
    assert summary["integrity"]["ok"] is True
    model_files = [item for item in summary["files"] if item["path"].startswith("pytorch_model_fsdp_0/")]
    assert sorted(item["rank"] for item in model_files) == [0, 1, 2, 3]
    assert all(item["tensors"] > 0 and item["bytes"] > 0 for item in model_files)
    assert set(summary["per_rank"]) >= {"0", "1", "2", "3"}
    answers = {answer["gpus"]: answer for answer in summary["resume"]}
    assert answers[2]["possible"] and answers[2]["gradient_accumulation_steps"] == 2
    assert answers[1]["possible"] and answers[1]["gradient_accumulation_steps"] == 4
    # 3 processes cannot keep a global batch of 8: exit 1 and the reason
    assert cli.main(["inspect-checkpoint", str(folder), "--gpus", "3"]) == 1
    assert "does not split over 3 processes" in capsys.readouterr().out


# ---- the classification recipe ----
CLASSIFICATION_RESUME_AT = 4


@pytest.fixture(scope="module")
def classification_on_one_process(tmp_path_factory) -> dict:
    """The classification reference's step-4 checkpoint (2 processes) continued on 1 to the end."""
    root = classification_runs.base(tmp_path_factory)
    reference = classification_runs.reference_run(root)
    start = checkpoint(reference, CLASSIFICATION_RESUME_AT)
    run_dir = root / "resumed-on-1"
    result = classification_runs.launch(root, classification_runs.args(
        classification_runs.tiny_model(root), run_dir, "--max-steps", classification_runs.REFERENCE_STEPS,
        "--resume", start), processes=1)
    return {"reference": reference, "run_dir": run_dir, "start": start, "stdout": result.stdout}


@pytest.mark.slow
def test_classification_resumed_on_another_process_count_keeps_the_global_batch_and_the_losses(
        classification_on_one_process):
    reference, run_dir = classification_on_one_process["reference"], classification_on_one_process["run_dir"]
    stdout, batch = classification_on_one_process["stdout"], classification_runs.GLOBAL_BATCH
    assert f"global batch kept at {batch} samples: gradient accumulation 2 -> 4" in stdout
    assert (f"resumed from {classification_on_one_process['start']}: step {CLASSIFICATION_RESUME_AT}, "
            f"{CLASSIFICATION_RESUME_AT * batch} samples consumed (saved by 2 processes, now 1)") in stdout
    run = json.loads((run_dir / "run.json").read_text())
    assert (run["world_size"], run["gradient_accumulation_steps"], run["global_batch_samples"]) == (1, 4, batch)
    assert run["recipe"] == "sequence_classification" and run["labels"] == ["gospels", "law", "letters", "poetry"]
    expected, resumed = _train_lines(reference), _train_lines(run_dir)
    steps = list(range(CLASSIFICATION_RESUME_AT + 1, classification_runs.REFERENCE_STEPS + 1))
    assert sorted(resumed) == steps
    for step in steps:
        assert resumed[step]["samples_seen"] == expected[step]["samples_seen"] == step * batch
        assert abs(resumed[step]["loss"] - expected[step]["loss"]) <= LOSS_TOLERANCE * abs(expected[step]["loss"])
        assert resumed[step]["grad_norm"] == pytest.approx(expected[step]["grad_norm"], rel=1e-5)
    # compare's own verdict on the whole record (eval loss and accuracy included)
    comparison = compare_runs(load_run(reference), load_run(run_dir))
    assert comparison.agrees, "\n".join(summary_lines(comparison))


# ---- the data position, as arithmetic (fast) ----
@pytest.mark.parametrize("micro, accumulation, ranks", [(2, 2, 2), (2, 4, 1), (2, 1, 4), (1, 8, 1), (4, 1, 2),
                                                        (1, 1, 8)])
def test_every_step_takes_the_same_samples_whatever_the_split(micro, accumulation, ranks):
    """The samples of optimizer step ``k`` are global positions ``[k*G, (k+1)*G)`` of the seeded
    stream for any micro x accumulation x ranks = G: none skipped, none twice, across epochs."""
    stream = SampleStream(13, seed=7)  # 13 samples: steps of 8 cross epoch boundaries
    global_batch = micro * accumulation * ranks
    assert global_batch == runs.GLOBAL_BATCH
    seen: list[int] = []
    for step in range(6):
        taken = Counter()
        for rank in range(ranks):
            for batch in rank_micro_batches(stream, samples_consumed=step * global_batch, micro_batch_size=micro,
                                            accumulation_steps=accumulation, rank=rank, data_parallel_size=ranks):
                taken.update(batch)
        assert taken == Counter(stream.indices(step * global_batch, global_batch))
        seen.extend(taken.elements())
    # each epoch is a permutation: 48 positions = 3 full epochs + 9, every sample 3 or 4 times
    assert set(Counter(seen).values()) <= {3, 4} and len(seen) == 48


def test_keep_global_batch_adjusts_or_refuses(tmp_path):
    folder = tmp_path / "run" / "checkpoints" / "step-00000004"
    folder.mkdir(parents=True)
    (tmp_path / "run" / "run.json").write_text(json.dumps({"global_batch_samples": 8}))
    keep = dict(step=4, samples_consumed=32, micro_batch_size=2, gradient_accumulation_steps=2)
    assert keep_global_batch(folder, **keep, data_parallel_size=2) == (2, None)
    accumulation, note = keep_global_batch(folder, **keep, data_parallel_size=4)
    assert accumulation == 1 and "gradient accumulation 2 -> 1" in note
    assert keep_global_batch(folder, **keep, data_parallel_size=1)[0] == 4
    with pytest.raises(UsageError, match="global batch of 8 samples"):
        keep_global_batch(folder, **keep, data_parallel_size=3)
    # run.json disagreeing with the checkpoint (another run's file): samples / step decides
    (tmp_path / "run" / "run.json").write_text(json.dumps({"global_batch_samples": 6}))
    assert keep_global_batch(folder, **keep, data_parallel_size=4)[0] == 1
    assert accumulation_for(8, micro_batch_size=3, data_parallel_size=1) is None


def _train_lines(run_dir: Path) -> dict[int, dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {line["step"]: line for line in lines if line["kind"] == "train"}
