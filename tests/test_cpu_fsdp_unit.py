"""In-process checks of the CPU mode switch (no launches)."""

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
