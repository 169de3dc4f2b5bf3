"""What this CPU host does per second, measured once and cached: the "GPU type" ``plan --device cpu``
times the recipes' CPU runs with (:class:`~fsdp_presets.plan.gpus.HostRates`).

    rates, note = host_rates(processes=2)      # measured the first time (about 10 s), then read back

Measured as the recipes run on a CPU host: ``processes`` processes (this module run as a script,
one per rank), one thread each (what torchrun
and :func:`fsdp_presets.launching.local.launch_env` give every rank), all at once:

- fp32 matmul FLOP/s over a grid of (tokens, width) shapes, a Linear's forward and backward, each
  process multiplying at the same time;
- memory bandwidth (a large in-place add);
- the recipes' optimizer step per parameter at several sizes: the float64 sum of squares of every
  gradient (:func:`fsdp_presets.numerics.local_square_sums`) and torch's AdamW, a pass over memory
  per operation, not one;
- gloo's all-gather, reduce-scatter and all-reduce between the processes at several sizes, fitted as
  a latency plus bytes over a bandwidth (bytes each rank sends, the planner's ring convention; on 2
  ranks FSDP2's gathers and reductions are send/receive pairs, as :mod:`fsdp_presets.cpu_fsdp` runs them);
- what a training step and each decoder block cost beyond their arithmetic and their bytes, under
  DDP, FSDP2 FULL_SHARD and SHARD_GRAD_OP: a Hugging Face Llama too small for either to count.

Cached as ``host/KEY.json`` beside the planner's other cache entries
(:mod:`fsdp_presets.preset.model_cache`), keyed by the host's name, its CPU, the process count and
the torch version; ``FSDP_PRESETS_CACHE=off`` measures every time.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path

from fsdp_presets.plan.gpus import HostRates

HOST_FORMAT = 6
"""Bumped when what is measured changes (older entries are then measured again)."""
MATMUL_TOKENS = (16, 64, 256, 1024)
MATMUL_WIDTHS = (64, 256, 576, 1024)
OPTIMIZER_PARAMS = (2**20, 8 * 2**20, 32 * 2**20)
"""Parameters per measured optimizer step (a 32M model's states, 512 MB, leave the caches)."""
COLLECTIVE_BYTES = (4 * 1024, 256 * 1024, 4 * 2**20, 32 * 2**20)
REPEATS = 9
"""Timed calls per measurement (the median counts)."""
FRAMEWORK_EXTRA_BLOCKS = 8
"""Blocks the framework-overhead model has beyond its one (more blocks: a steadier difference)."""
FRAMEWORK_REPEATS = 11
"""Steps timed per framework-overhead model (the median counts)."""


def _cache_file(processes: int) -> Path | None:
    from fsdp_presets.preset.model_cache import cache_dir

    folder = cache_dir()
    if folder is None:
        return None
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    key = hashlib.sha256(json.dumps([HOST_FORMAT, platform.node(), cpu, processes, torch.__version__,
                                     os.cpu_count()]).encode()).hexdigest()[:16]
    return folder / "host" / f"{key}.json"


def host_rates(*, processes: int = 2) -> tuple[HostRates, str]:
    """``(rates, note)``: this host's rates for ``processes`` ranks, from the cache or measured now."""
    from fsdp_presets.fileio import write_json_atomic

    path = _cache_file(processes)
    if path is not None and path.is_file():
        try:
            return HostRates.from_json(json.loads(path.read_text())), f"host measured earlier ({path})"
        except (ValueError, KeyError, TypeError):
            pass  # another format: measure again
    rates = measure_host(processes=processes)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, rates.to_json())
        return rates, f"host measured now (cached in {path})"
    return rates, "host measured now (FSDP_PRESETS_CACHE=off: not cached)"


# --------------------------------------------------------------------------- measuring


def _typical(run, repeats: int = 5) -> float:
    """The median of ``repeats`` timed calls after a warm-up: what the host does while the other
    processes work too (the fastest call would be a moment when they did not)."""
    import statistics

    run()  # warm up (allocations, lazy initialisation)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _local_rates(together) -> dict:
    """Matmul rates and memory bandwidth, every rank measuring the same thing at the same moment
    (``together()`` is a barrier), as the ranks of a training step compute at once."""
    import torch

    matmul = []
    for tokens in MATMUL_TOKENS:
        for width in MATMUL_WIDTHS:
            together()
            # A Linear's forward and backward: the forward matmul and both of the backward's (input
            # and weight gradients), as a training step runs them.
            layer = torch.nn.Linear(width, 4 * width, bias=False)
            data = torch.randn(tokens, width, requires_grad=True)
            seconds = _typical(lambda: layer(data).sum().backward(), repeats=REPEATS)
            matmul.append([tokens, width, 6 * tokens * width * 4 * width / seconds])
    big = torch.ones(8 * 2**20)  # 32 MiB
    other = torch.ones_like(big)
    together()
    bandwidth = 3 * big.numel() * 4 / _typical(lambda: big.add_(other), repeats=REPEATS)
    from fsdp_presets.numerics import local_square_sums

    optimizer = []
    for count in OPTIMIZER_PARAMS:
        params = torch.nn.ParameterList(torch.randn(count // 8) for _ in range(8))
        for param in params:
            param.grad = torch.randn_like(param)
        adamw = torch.optim.AdamW(params.parameters(), lr=1e-5, weight_decay=0.0)  # the recipes' defaults

        def step():
            # NOTE: as the recipes step: numerics.clip_grad_norm's float64 squares, then torch's
            # foreach AdamW (zero_grad(set_to_none) frees, it moves nothing).
            sum(float(squares) for squares, _ in local_square_sums(params)[0])
            adamw.step()

        together()
        optimizer.append([count, _typical(step, repeats=5) / count])
        del params, adamw
    return {"matmul": matmul, "memory_bytes_per_s": bandwidth, "optimizer": optimizer}


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Latency and bytes/s of ``time = latency + sent / bandwidth``, least squares over every size."""
    count = len(points)
    mean_x = sum(x for x, _ in points) / count
    mean_y = sum(y for _, y in points) / count
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in points)
             / max(sum((x - mean_x) ** 2 for x, _ in points), 1e-30))
    slope = max(slope, 1e-15)
    return max(mean_y - slope * mean_x, 0.0), 1 / slope


def _rank(rank: int, processes: int, port: int, out: Path) -> None:
    import torch
    import torch.distributed as dist

    from fsdp_presets import cpu_fsdp

    torch.set_num_threads(1)
    cpu_fsdp.enable_cpu_fsdp()  # FSDP2's gathers and reductions as the recipes run them
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=processes)
    try:
        local = _local_rates(dist.barrier)
        collectives = {}
        group = dist.group.WORLD
        pair = cpu_fsdp.is_gloo_pair(group)
        for name in ("all_gather", "reduce_scatter", "all_reduce"):
            points = []
            for size in COLLECTIVE_BYTES:
                full = torch.ones(size // 4)
                shard = torch.ones(size // 4 // processes)

                def run():
                    # NOTE: on 2 ranks FSDP2 gathers and reduces as one send/receive pair
                    # (fsdp_presets.cpu_fsdp); DDP all-reduces with gloo's own.
                    if name == "all_gather":
                        (cpu_fsdp.pair_all_gather if pair else dist.all_gather_into_tensor)(full, shard, group)
                    elif name == "reduce_scatter" and pair:
                        cpu_fsdp.pair_reduce_scatter(shard, full, group, dist.ReduceOp.AVG)
                    elif name == "reduce_scatter":
                        dist.reduce_scatter_tensor(shard, full)
                    else:
                        dist.all_reduce(full)
                    dist.barrier()

                barrier = _typical(dist.barrier, repeats=REPEATS)
                sent = (2 if name == "all_reduce" else 1) * size * (processes - 1) // processes
                points.append((sent, max(_typical(run, repeats=REPEATS) - barrier, 1e-7)))
            collectives[name] = _fit(points)
        overheads = _framework_overheads(processes)
        if rank == 0:
            out.write_text(json.dumps({**local, "collectives": collectives, "overheads": overheads}))
    finally:
        dist.destroy_process_group()


def _framework_overheads(processes: int) -> dict:
    """Seconds a training step costs beyond its arithmetic and its bytes, per strategy: a Hugging Face
    Llama so small that neither counts, trained one step (forward, loss, backward, AdamW, zero_grad)
    with 1 and with 9 blocks under DDP, FSDP2 FULL_SHARD and SHARD_GRAD_OP (each block a unit, the
    root a unit, as accelerate wraps them): what the 8 extra blocks add is the cost of a block (Python,
    module calls, autograd, dispatch, its collectives' latency and FSDP2's hooks and copies), the rest
    the step's own. ``{strategy: (step_s, block_s)}``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    mesh = dist.device_mesh.init_device_mesh("cpu", (processes,))

    def seconds(layers: int, strategy: str) -> float:
        torch.manual_seed(0)
        config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                             num_key_value_heads=4, vocab_size=128, max_position_embeddings=64)
        model = LlamaForCausalLM(config)
        if strategy == "DDP":
            model = torch.nn.parallel.DistributedDataParallel(model)
        else:
            reshard = strategy == "FULL_SHARD"
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
            # accelerate's units besides the blocks: the embedding, the [norm, head] tail, the root
            fully_shard(model.model.embed_tokens, mesh=mesh, reshard_after_forward=reshard)
            fully_shard([model.model.norm, model.lm_head], mesh=mesh, reshard_after_forward=False)
            fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, 128, (1, 16))

        def step():
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            dist.barrier()

        barrier = _typical(dist.barrier, repeats=5)
        return max(_typical(step, repeats=FRAMEWORK_REPEATS) - barrier, 0.0)

    overheads = {}
    for strategy in ("DDP", "FULL_SHARD", "SHARD_GRAD_OP"):
        few, many = seconds(1, strategy), seconds(1 + FRAMEWORK_EXTRA_BLOCKS, strategy)
        block = max((many - few) / FRAMEWORK_EXTRA_BLOCKS, 0.0)
        overheads[strategy] = (max(few - block, 0.0), block)
    return overheads


def measure_host(*, processes: int = 2) -> HostRates:
    """Measure this host now: ``processes`` ranks (``python -m fsdp_presets.preset.host_rates``) over
    gloo on loopback, one thread each."""
    import socket
    import subprocess
    import sys
    import tempfile

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="fsdp-presets-host-") as folder:
        out = Path(folder) / "rates.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        workers = [subprocess.Popen([sys.executable, "-m", __name__, str(rank), str(processes), str(port), str(out)],
                                    env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                   for rank in range(processes)]
        errors = []
        for worker in workers:
            try:
                _, stderr = worker.communicate(timeout=300)
            except subprocess.TimeoutExpired:
                worker.kill()
                _, stderr = worker.communicate()
            if worker.returncode:
                errors.append(stderr.strip().splitlines()[-1:] or [f"exit {worker.returncode}"])
        if errors or not out.is_file():
            raise RuntimeError(f"measuring this host failed ({errors}): run it again, or plan for GPUs "
                               "(--gpu NAME)")
        found = json.loads(out.read_text())
    return HostRates.from_json({**found, "processes": processes, "cores": len(os.sched_getaffinity(0))})


if __name__ == "__main__":
    import sys

    _rank(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
