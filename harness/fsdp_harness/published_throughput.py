"""Published GPU training throughput (``tests/data/published_throughput.csv``, sources in
``tests/data/published_throughput.md``) held against the planner's step-time model.

Each row becomes the planner's own inputs (a model built on meta from the published architecture, the
GPU type, the GPU and node counts, sequence, micro-batch, accumulation, activation checkpointing, the
strategy) and is predicted by :func:`fsdp_presets.plan.planner.plan`, the function ``plan --json``
prints. The calibration sources (:data:`CALIBRATION_SOURCES`) fixed
:data:`fsdp_presets.plan.step_time.MATMUL_EFFICIENCY`; every other row is test data.

    python -m fsdp_harness.published_throughput        # the accuracy table, per source and GPU type
"""

from __future__ import annotations

import csv
import functools
import statistics
from dataclasses import dataclass
from pathlib import Path

TABLE = Path(__file__).resolve().parents[2] / "tests" / "data" / "published_throughput.csv"
CALIBRATION_SOURCES = ("torchtitan", "fms-fsdp")
"""The two sources the matmul efficiency per GPU type was fitted on (docs/sharding.md)."""
PLANNED_STRATEGIES = ("FULL_SHARD", "HYBRID_SHARD", "SHARD_GRAD_OP", "DDP")
REDUCES_EVERY_MICRO_BATCH = ("llm-foundry", "olmo-core")
"""Sources whose trainers reduce the gradients after every micro-batch under FSDP (no ``no_sync``),
as read in their code: Composer (llm-foundry) enters its sync context only for a DDP model, and
OLMo-core's FSDP train module only marks the last backward (it delays HSDP's all-reduce alone)."""
FSDP1_BACKWARD_PREFETCH = {
    # Sources whose trainers ran FSDP1 with a backward prefetch other than BACKWARD_PRE, as read in their
    # code; every other row is planned as FSDP2 (FSDP1 with BACKWARD_PRE is timed alike).
    # llm-foundry pinned Composer 0.16 (mosaicml/composer v0.16.4, composer/trainer/dist_strategy.py:
    # fsdp_config.setdefault('backward_prefetch', 'BACKWARD_POST')); the benchmark's yamls, sweep.sh and
    # submit_benchmarks.py set none.
    "llm-foundry": "BACKWARD_POST",
}
"""FSDP1's backward prefetch per source (:data:`fsdp_presets.plan.shapes.BACKWARD_PREFETCH`)."""
NETWORK_GBPS = {
    # One GPU's network where a source states its cluster's (Gb/s per GPU); else the GPU type's usual one.
    ("fms-fsdp", "A100-80GB"): 400 / 8,  # README: "128 GPUs with 400Gbps" (per node of 8)
    ("fms-fsdp", "H100-SXM"): 800 / 8,   # README: "96 GPUs with 800 Gbps"
    ("torchtitan", "H100-SXM"): 400,     # benchmark file: 400 Gb/s RDMA per GPU
}


@dataclass(frozen=True)
class Row:
    """One published measurement the planner can represent."""

    source: str
    model: str
    arch: str
    dims: tuple[int, int, int, int, int, int]
    """hidden, layers, heads, kv heads, intermediate, vocab."""
    gpu: str
    gpus: int
    nodes: int
    seq_len: int
    micro_batch: int
    grad_accum: int
    activation_checkpointing: bool
    sharding: str
    compiled: bool
    tokens_per_s_per_gpu: float
    ac: str
    """As published: ``full``, ``selective``, ``none`` or empty."""

    @property
    def label(self) -> str:
        return (f"{self.source} {self.model} {self.gpu} x{self.gpus} seq {self.seq_len} mb {self.micro_batch}"
                f" AC {self.ac or '?'} {self.sharding}{' compiled' if self.compiled else ''}")

    @property
    def settings(self) -> tuple:
        """Everything but the GPU count: rows equal here form a scaling curve."""
        return (self.source, self.model, self.gpu, self.seq_len, self.micro_batch, self.ac, self.sharding,
                self.compiled)


def _integer(text: str) -> int | None:
    try:
        return int(float(text))
    except ValueError:
        return None


def load_rows(path: Path = TABLE) -> list[Row]:
    """The rows the planner can represent: bf16 (fp8 is not planned), one dimension of data parallelism
    (no tensor, pipeline or context parallelism), a stated GPU count, a strategy it plans."""
    rows = []
    with open(path, newline="") as handle:
        for record in csv.DictReader(handle):
            gpus = _integer(record["gpus"])
            numbers = ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "seq_len", "micro_batch")
            if (record["precision"] not in ("bf16", "amp_bf16") or record["tp"] != "1" or record["pp"] != "1"
                    or record["sharding"] not in PLANNED_STRATEGIES or not gpus
                    or any(_integer(record[key]) is None for key in numbers)):
                continue
            nodes = _integer(record["nodes"]) or max(1, gpus // 8)
            micro = int(record["micro_batch"])
            global_batch = _integer(record["global_batch"] or "")
            accumulation = global_batch // (micro * gpus) if global_batch and global_batch % (micro * gpus) == 0 else 1
            dims = tuple(int(record[key]) for key in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab"))
            rows.append(Row(source=record["source"], model=record["model"], arch=record["arch"], dims=dims,
                            gpu=record["gpu"], gpus=gpus, nodes=nodes, seq_len=int(record["seq_len"]),
                            micro_batch=micro, grad_accum=max(1, accumulation),
                            # NOTE: selective checkpointing (torchtitan's per-op policy, fms-fsdp's share of
                            # blocks) recomputes little of the matmul work: planned as no checkpointing.
                            activation_checkpointing=record["ac"] == "full", sharding=record["sharding"],
                            compiled=record["compile"] == "yes",
                            tokens_per_s_per_gpu=float(record["tokens_per_s_per_gpu"]), ac=record["ac"]))
    return rows


@functools.lru_cache(maxsize=None)
def profile_for(arch: str, dims: tuple[int, ...], seq_len: int):
    """The meta-device profile of the published architecture (the planner's own profiler)."""
    from fsdp_presets.model.profile import profile_model

    hidden, layers, heads, kv_heads, intermediate, vocab = dims
    if arch == "mpt":
        from transformers import MptConfig

        config = MptConfig(d_model=hidden, n_layers=layers, n_heads=heads, expansion_ratio=intermediate // hidden,
                           max_seq_len=max(seq_len, 2048), vocab_size=vocab)
    else:
        from transformers import AutoConfig

        config = AutoConfig.for_model(arch, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, intermediate_size=intermediate, vocab_size=vocab,
                                      max_position_embeddings=max(seq_len, 4096), tie_word_embeddings=False)
    return profile_model(f"{arch}-{hidden}x{layers}", config=config)


def predict(row: Row, *, matmul_efficiency: float | None = None) -> float:
    """Tokens/s per GPU the planner predicts for ``row`` (its ``plan --json`` row's
    ``tokens_per_s_per_gpu``); ``matmul_efficiency`` replaces the calibrated one (fitting)."""
    from fsdp_presets.fileio import GiB
    from fsdp_presets.plan import step_time
    from fsdp_presets.plan.gpus import gpu_type
    from fsdp_presets.plan.planner import plan
    from fsdp_presets.plan.shapes import Hardware, TrainingShape

    gpu = gpu_type(row.gpu)
    hardware = Hardware(gpus=row.gpus, nodes=row.nodes, gpu_memory_bytes=int(gpu.memory_gib * GiB), gpu=gpu,
                        inter_node_gbps=NETWORK_GBPS.get((row.source, row.gpu)))
    shape = TrainingShape(seq_len=row.seq_len, micro_batch=row.micro_batch, grad_accum=row.grad_accum,
                          activation_checkpointing=row.activation_checkpointing,
                          reduce_every_micro_batch=(row.grad_accum > 1 and row.sharding != "DDP"
                                                    and row.source in REDUCES_EVERY_MICRO_BATCH),
                          backward_prefetch=FSDP1_BACKWARD_PREFETCH.get(row.source, "BACKWARD_PRE"))
    profile = profile_for(row.arch, row.dims, row.seq_len)
    version = 1 if row.source in FSDP1_BACKWARD_PREFETCH and row.sharding != "DDP" else 2
    if matmul_efficiency is None:
        return plan(profile, hardware, shape).get(row.sharding, version).time.tokens_per_s_per_gpu
    saved = step_time.MATMUL_EFFICIENCY
    step_time.MATMUL_EFFICIENCY = {gpu.name.lower(): matmul_efficiency}
    try:
        return plan(profile, hardware, shape).get(row.sharding, version).time.tokens_per_s_per_gpu
    finally:
        step_time.MATMUL_EFFICIENCY = saved


def model_flops(row: Row) -> float:
    """``6 N + 12 L H Q T`` per token, the MFU numerator, for the constant-MFU baseline."""
    from fsdp_presets.plan.step_time import model_flops_per_token

    return model_flops_per_token(profile_for(row.arch, row.dims, row.seq_len), row.seq_len)


def error(predicted: float, published: float) -> float:
    """Relative error of a prediction."""
    return abs(predicted - published) / published


def share_within(errors: list[float], tolerance: float) -> float:
    return sum(e <= tolerance for e in errors) / len(errors) if errors else 0.0


def fitted_errors(rows: list[Row], predictions: list[float]) -> list[float]:
    """Errors after one factor per (source, GPU type): the median ratio of published to predicted in
    each group (what differs between codebases' kernels)."""
    groups: dict[tuple[str, str], list[int]] = {}
    for index, row in enumerate(rows):
        groups.setdefault((row.source, row.gpu), []).append(index)
    errors = [0.0] * len(rows)
    for indices in groups.values():
        factor = statistics.median(rows[i].tokens_per_s_per_gpu / predictions[i] for i in indices)
        for i in indices:
            errors[i] = error(predictions[i] * factor, rows[i].tokens_per_s_per_gpu)
    return errors


def constant_mfu_errors(rows: list[Row]) -> list[float]:
    """The baseline to beat: one MFU per (source, GPU type) (the median of the group), tokens/s =
    MFU x peak / model FLOPs per token."""
    from fsdp_presets.plan.gpus import gpu_type

    flops = [model_flops(row) for row in rows]
    predictions = [gpu_type(row.gpu).peak_bf16_flops / f for row, f in zip(rows, flops)]  # at MFU 1
    return fitted_errors(rows, predictions)


def scaling_errors(rows: list[Row], predictions: list[float]) -> list[tuple[str, float]]:
    """For every curve (the same settings at several GPU counts): the error of the predicted change of
    tokens/s per GPU from its smallest count to each larger one, against the published change."""
    curves: dict[tuple, list[int]] = {}
    for index, row in enumerate(rows):
        curves.setdefault(row.settings, []).append(index)
    out = []
    for indices in curves.values():
        if len({rows[i].gpus for i in indices}) < 2:
            continue
        base = min(indices, key=lambda i: rows[i].gpus)
        for i in indices:
            if rows[i].gpus == rows[base].gpus:
                continue
            published = rows[i].tokens_per_s_per_gpu / rows[base].tokens_per_s_per_gpu
            predicted = predictions[i] / predictions[base]
            out.append((f"{rows[i].label} vs x{rows[base].gpus}", error(predicted, published)))
    return out


def one_setting_pairs(rows: list[Row], predictions: list[float]) -> list[tuple[str, bool]]:
    """Every pair of rows of one source, model, GPU type and count that differ in exactly one of
    activation checkpointing, micro-batch or strategy as planned: whether the faster published is
    predicted faster (pairs within 2% of each other published are left out: a tie; so are pairs that
    differ only as published, e.g. selective against no checkpointing, which are planned alike)."""
    keys = ("activation_checkpointing", "micro_batch", "sharding")
    out = []
    for a in range(len(rows)):
        for b in range(a + 1, len(rows)):
            first, second = rows[a], rows[b]
            same = (first.source, first.model, first.gpu, first.gpus, first.seq_len, first.compiled) == \
                   (second.source, second.model, second.gpu, second.gpus, second.seq_len, second.compiled)
            differing = [key for key in keys if getattr(first, key) != getattr(second, key)]
            if not same or len(differing) != 1:
                continue
            published = first.tokens_per_s_per_gpu / second.tokens_per_s_per_gpu
            if abs(published - 1) < 0.02:
                continue
            agrees = (predictions[a] > predictions[b]) == (published > 1)
            out.append((f"{first.label} | {second.label}", agrees))
    return out


def main() -> None:
    rows = load_rows()
    predictions = [predict(row) for row in rows]
    test = [i for i, row in enumerate(rows) if row.source not in CALIBRATION_SOURCES]
    for name, indices in (("calibration", [i for i in range(len(rows)) if i not in test]), ("test", test)):
        errors = [error(predictions[i], rows[i].tokens_per_s_per_gpu) for i in indices]
        subset = [rows[i] for i in indices]
        fitted = fitted_errors(subset, [predictions[i] for i in indices])
        baseline = constant_mfu_errors(subset)
        print(f"{name}: {len(indices)} rows; within 25% as it stands {share_within(errors, 0.25):.0%}; "
              f"one factor per source and GPU type, within 10%: model {share_within(fitted, 0.10):.0%}, "
              f"constant MFU {share_within(baseline, 0.10):.0%}")
    for i in range(len(rows)):
        print(f"{error(predictions[i], rows[i].tokens_per_s_per_gpu):6.1%} {predictions[i]:10.0f} "
              f"{rows[i].tokens_per_s_per_gpu:10.0f}  {rows[i].label}")


if __name__ == "__main__":
    main()
