"""The planner against real FSDP2 runs: what ranks hold after an optimizer step, and what a step
sends, through ``accelerate launch`` and an accelerate config, as users run it.

One launch per case (tests/workers/plan_measure.py): fp32, AdamW, a tiny Llama whose vocabulary
(131) divides by neither 2 nor 4, so the embedding and head shard unevenly:

- FSDP2 gives rank r ``torch.chunk`` rows of each parameter: ranks 0..N-2 hold ``ceil(131/N)``
  rows, the last rank the rest (65 of 131 at N=2, 32 at N=4). Local shards add up to the model
  exactly; the padding lives only in storage and in the collectives' buffers, where every rank's
  piece is padded to ``ceil(dim0/N)`` rows.
- The planner reports the largest rank (what decides whether a GPU fits). From unit totals it
  computes ``ceil(P/N)`` per unit, which is short of rank 0 by under one row per unevenly split
  parameter (here 32 of rank 0's 13 520 elements at N=2, 16 of 6 760 at N=4: 0.24%); from
  parameter shapes (``fsdp2_shard_numel``) it is exact.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdp_presets.fileio import GiB
from fsdp_presets.plan.shapes import Hardware, TrainingShape
from fsdp_presets.plan.model_state import fsdp2_shard_numel
from fsdp_presets.plan.planner import plan
from fsdp_presets.model.profile import profile_model
from fsdp_harness.launch import read_rank_results, run_launch
from fsdp_harness.measure import sent_bytes

from conftest import GLOO_EXIT_ABORT, WORKERS, accelerate_config

WORKER = WORKERS / "plan_measure.py"
MODEL_CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 131,  # uneven for 2 and 4 shards on purpose
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
FP32_ADAMW = TrainingShape(seq_len=16, micro_batch=2, precision="fp32", optimizer="adamw")

# case -> (processes, nodes for the planner, strategy name, accelerate fsdp settings, parallelism)
CASES = {
    "full-shard-2": (2, 1, "FULL_SHARD", {}, None),
    "full-shard-4": (4, 1, "FULL_SHARD", {}, None),
    "shard-grad-op-2": (2, 1, "SHARD_GRAD_OP", {"reshard_after_forward": False}, None),
    "hsdp-2x2": (4, 2, "HYBRID_SHARD", {}, {"dp_replicate_size": 2, "dp_shard_size": 2}),
}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("plan_measured")
    (directory / "config.json").write_text(json.dumps(MODEL_CONFIG))
    return directory


@pytest.fixture(scope="module")
def profile(workdir):
    return profile_model(str(workdir / "config.json"))


def measure(workdir: Path, case: str) -> dict[int, dict]:
    processes, _, _, fsdp, parallelism = CASES[case]
    config = accelerate_config(workdir, case, num_processes=processes, fsdp=fsdp, parallelism=parallelism)
    out = workdir / case
    result = run_launch(config, WORKER, ["--model-config", workdir / "config.json", "--result-dir", out,
                                         "--seq-len", FP32_ADAMW.seq_len, "--micro-batch", FP32_ADAMW.micro_batch])
    result.check()
    assert GLOO_EXIT_ABORT not in result.stderr
    results = read_rank_results(out)
    assert sorted(results) == list(range(processes))
    assert {r["distributed_type"] for r in results.values()} == {"DistributedType.FSDP"}
    return results


@pytest.mark.parametrize("case", list(CASES))
def test_planner_matches_a_real_fsdp2_step(workdir, profile, case):
    processes, nodes, name, _, _ = CASES[case]
    results = measure(workdir, case)
    hardware = Hardware(gpus=processes, nodes=nodes, gpu_memory_bytes=80 * GiB)
    strategy = plan(profile, hardware, FP32_ADAMW).get(name, 2)
    shard = strategy.shard_world_size
    assert shard == (2 if case == "hsdp-2x2" else processes)

    # ---- what each rank holds after the optimizer step ----
    rank0 = results[0]
    shapes = [tuple(p["shape"]) for p in rank0["params"]]
    assert sum(r["held"]["params"] for r in results.values()) == profile.total_params * 4 * (processes // shard)
    for rank, result in results.items():
        held = result["held"]
        step_counters = 4 * len(result["params"])  # AdamW's per-parameter fp32 `step` tensors
        assert held["grads"] == held["params"]
        assert held["optimizer"] - step_counters == 2 * held["params"]  # exp_avg + exp_avg_sq
        # The first rank of each shard group holds ceil(dim0 / N) rows of every parameter: exact.
        if rank % shard == 0:
            assert held["params"] == 4 * fsdp2_shard_numel(shapes, shard)
        # The planner's per-rank figures, within 1% (the padding note in the module docstring).
        assert held["params"] == pytest.approx(strategy.model_state.params, rel=0.01)
        assert held["grads"] == pytest.approx(strategy.model_state.grads, rel=0.01)
        assert held["optimizer"] == pytest.approx(strategy.model_state.optimizer, rel=0.01)
    # Uneven vocabulary: the last rank of a shard group holds fewer rows than the first.
    assert results[shard - 1]["held"]["params"] < rank0["held"]["params"]

    # ---- what one step sends ----
    for rank, result in results.items():
        sent = sent_bytes(result["collectives"])  # ring algorithms, the planner's convention
        predicted = strategy.comm
        assert sent["all_gather"] == pytest.approx(predicted.all_gather, rel=0.05)
        assert sent["reduce_scatter"] == pytest.approx(predicted.reduce_scatter, rel=0.05)
        assert sent["all_reduce"] == pytest.approx(predicted.all_reduce, rel=0.05)
        assert sent["total"] == pytest.approx(predicted.total, rel=0.05)
    # The collectives themselves, as torch's comm debug mode counted them: 2 blocks + the
    # embedding + the [norm, head] tail; FULL_SHARD re-gathers all but the tail in backward.
    counts = rank0["comm_counts"]
    gathers = 4 if name == "SHARD_GRAD_OP" else 7
    assert counts.get("c10d._allgather_base_") == gathers
    assert counts.get("c10d._reduce_scatter_base_") == 4
    assert counts.get("c10d.allreduce_", 0) == (4 if name == "HYBRID_SHARD" else 0)
