"""In-process checks of the CPU mode switch (no launches)."""

import os
import subprocess
import sys


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_does_nothing_when_an_accelerator_exists():
    result = run_python(
        "import os, accelerate.utils as u, fsdp_presets.cpu_fsdp as c\n"
        "c.accelerator_available = lambda: True\n"
        "print(c.enable_cpu_fsdp(), os.environ.get('ACCELERATE_USE_CPU'))\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "None"]


def test_enables_once_on_a_cpu_host_and_single_process_stays_plain():
    result = run_python(
        "import fsdp_presets\n"
        "from accelerate import Accelerator\n"
        "print(fsdp_presets.enable_cpu_fsdp(), fsdp_presets.enable_cpu_fsdp())\n"
        "a = Accelerator()\n"
        "fsdp_presets.check_launch(a)\n"
        "print(a.distributed_type.value, a.num_processes, a.device)\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True", "NO", "1", "cpu"]


def test_refuses_an_accelerate_version_it_was_not_written_for():
    for version in ("1.10.0", "1.17.0", "2.0.0"):
        result = run_python(
            "import accelerate\n"
            f"accelerate.__version__ = {version!r}\n"
            "import fsdp_presets\n"
            "fsdp_presets.enable_cpu_fsdp()\n"
        )
        assert result.returncode != 0
        message = result.stderr.strip().splitlines()[-1]
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
