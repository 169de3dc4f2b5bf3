"""In-process checks of the CPU mode switch (no launches)."""

import os
import subprocess
import sys

import pytest


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def switched() -> list[list[str]]:
    """One process (accelerate imported once), one output line per step: the switch on a host that
    reports an accelerator (it changes nothing there, so the next steps start as a fresh process
    would), then on this CPU host, twice, then an Accelerator of a single process."""
    result = run_python(
        "import os, fsdp_presets, fsdp_presets.cpu_fsdp as c\n"
        "available = c.accelerator_available\n"
        "c.accelerator_available = lambda: True\n"
        "print(c.enable_cpu_fsdp(), os.environ.get('ACCELERATE_USE_CPU'), c.cpu_fsdp_enabled())\n"
        "c.accelerator_available = available\n"
        "from accelerate import Accelerator\n"
        "print(fsdp_presets.enable_cpu_fsdp(), fsdp_presets.enable_cpu_fsdp())\n"
        "a = Accelerator()\n"
        "fsdp_presets.check_launch(a)\n"
        "print(a.distributed_type.value, a.num_processes, a.device)\n"
    )
    assert result.returncode == 0, result.stderr
    return [line.split() for line in result.stdout.splitlines()]


def test_does_nothing_when_an_accelerator_exists(switched):
    assert switched[0] == ["False", "None", "False"]


def test_enables_once_on_a_cpu_host_and_single_process_stays_plain(switched):
    assert switched[1:] == [["True", "True"], ["NO", "1", "cpu"]]


def test_refuses_an_accelerate_version_it_was_not_written_for():
    """One process (accelerate imported once): each refusal raises; the last, uncaught, ends it."""
    result = run_python(
        "import accelerate\n"
        "accelerate.__version__ = '1.10.0'\n"
        "import fsdp_presets\n"
        "from fsdp_presets.cpu_fsdp import CpuFsdpError\n"
        "for version in ('1.10.0', '1.17.0', '2.0.0'):\n"
        "    accelerate.__version__ = version\n"
        "    try:\n"
        "        fsdp_presets.enable_cpu_fsdp()\n"
        "    except CpuFsdpError as error:\n"
        "        print(f'{type(error).__module__}.{type(error).__name__}: {error}', flush=True)\n"
        "        if version == '2.0.0':\n"
        "            raise\n"
    )
    assert result.returncode != 0
    messages = result.stdout.strip().splitlines()
    assert len(messages) == 3 and messages[-1] == result.stderr.strip().splitlines()[-1], result.stderr[-3000:]
    for version, message in zip(("1.10.0", "1.17.0", "2.0.0"), messages):
        assert message.startswith("fsdp_presets.cpu_fsdp.CpuFsdpError: fsdp_presets.enable_cpu_fsdp() was "
                                  f"written for accelerate 1.16.x and this is accelerate {version}")
        assert 'pip install "accelerate>=1.16,<1.17"' in message


def test_untested_accelerate_needs_the_opt_in_and_the_patched_internals():
    opted_in = subprocess.run(
        [sys.executable, "-c", "import accelerate\naccelerate.__version__ = '1.17.0'\n"
         "import fsdp_presets\nprint(fsdp_presets.enable_cpu_fsdp())\n"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "FSDP_PRESETS_UNTESTED_ACCELERATE": "1"})
    assert opted_in.returncode == 0, opted_in.stderr
    assert opted_in.stdout.split() == ["True"]

    internals_gone = run_python(
        "import accelerate.accelerator as a\n"
        "del a.load_fsdp_optimizer\n"
        "import fsdp_presets\n"
        "fsdp_presets.enable_cpu_fsdp()\n"
    )
    assert internals_gone.returncode != 0
    assert "lack internals the CPU mode patches (accelerate.accelerator.load_fsdp_optimizer)" in internals_gone.stderr


PAIR_COLLECTIVES = r'''
import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
from fsdp_presets.cpu_fsdp import pair_all_gather, pair_reduce_scatter

def check(rank, port):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    group = dist.group.WORLD
    torch.manual_seed(rank)
    full = torch.randn(1000) * torch.logspace(-30, 30, 1000)  # tiny and huge magnitudes
    expected = torch.empty(500)
    dist.reduce_scatter_tensor(expected, full, op=dist.ReduceOp.SUM)
    mine = torch.empty(500)
    pair_reduce_scatter(mine, full, group, dist.ReduceOp.SUM)
    assert torch.equal(mine, expected), "sum"
    ddp = full / 2  # DDP: divide by the world size, then all-reduce a sum
    dist.all_reduce(ddp)
    pair_reduce_scatter(mine, full, group, dist.ReduceOp.AVG)
    assert torch.equal(mine, ddp[rank * 500:(rank + 1) * 500]), "mean"
    gathered, expected = torch.empty(1000), torch.empty(1000)
    dist.all_gather_into_tensor(expected, full[:500].clone())
    pair_all_gather(gathered, full[:500].clone(), group, async_op=True).wait()
    assert torch.equal(gathered, expected), "all-gather"
    in_place = torch.zeros(1000)
    in_place[rank * 500:(rank + 1) * 500] = full[:500]
    pair_all_gather(in_place, in_place[rank * 500:(rank + 1) * 500], group)
    assert torch.equal(in_place, expected), "in-place all-gather"
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(check, args=(int(sys.argv[1]),), nprocs=2)
    print("ok")
'''


def test_pair_collectives_equal_gloo_and_ddp_bitwise(tmp_path):
    """FSDP2's 2-rank all-gather and reduce-scatter replacements give gloo's results bit for bit,
    and a mean gives what DDP's divide-then-sum all-reduce gives."""
    from fsdp_presets.launching.local import free_port

    script = tmp_path / "pair.py"
    script.write_text(PAIR_COLLECTIVES)
    result = subprocess.run([sys.executable, str(script), str(free_port())], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stdout.split()[-1:] == ["ok"], result.stderr[-3000:]
