"""Readers of untrusted files are bounded in memory, depth and kind of file.

A family of generated hostile files (``tests/workers/hostile_readers.py``: DCP ``.metadata``
pickles of allowed types only, swept in nesting depth and declared size; accelerate configs swept
in alias expansion, depth and size; a FIFO and ``/dev/zero``) goes through the readers in a child
process. The child must not crash (a deep enough pickle segfaulted it), must refuse every case with
a message saying why, and its peak RSS (read with ``os.wait4``) must stay within a few MiB of what
it held after reading a real file (an allowed ``bytearray(1.5e9)`` took 1.7 GB; a billion-laughs
config grew past 2 GB).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_presets.fileio import (CONFIG_MAX_BYTES, UnreadableFile, load_yaml_data, read_regular_bytes,
                                 read_regular_text)

WORKER = Path(__file__).parent / "workers" / "hostile_readers.py"
GROWTH_LIMIT_KIB = 64 * 1024  # what refusing a whole family may add to the reader's peak RSS


def run_family(kind: str, folder: Path) -> tuple[dict, int, int]:
    """``(results, peak RSS in KiB, exit status)`` of the worker reading the ``kind`` family."""
    process = subprocess.Popen([sys.executable, str(WORKER), kind, str(folder)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    # wait4 gives this child's own rusage (RUSAGE_CHILDREN would mix in every earlier child)
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    out, err = process.stdout.read().decode(), process.stderr.read().decode()
    assert process.returncode == 0, f"the reader crashed (exit {process.returncode}): {err[-2000:]}"
    return json.loads(out.splitlines()[-1]), usage.ru_maxrss, process.returncode


@pytest.mark.parametrize("kind, reason", [
    ("pickle", ("nests deeper", "fills a value after using it", "bytearray with something other",
                "not a well-formed pickle")),
    ("yaml", ("anchors or aliases", "nests deeper", "more than the 1.0 MiB", "is a FIFO", "is a device")),
])
def test_a_family_of_hostile_files_is_refused_without_crash_or_memory(tmp_path, kind, reason):
    report, peak_kib, _ = run_family(kind, tmp_path)
    results = report["results"]
    assert len(results) >= 9
    unrefused = {name: said for name, said in results.items() if not any(why in said for why in reason)}
    assert not unrefused, unrefused
    assert peak_kib - report["baseline_kib"] < GROWTH_LIMIT_KIB, (peak_kib, report["baseline_kib"])


def test_special_files_are_refused_before_reading(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "a FIFO"), (Path("/dev/zero"), "a device"), (tmp_path, "a directory")):
        with pytest.raises(OSError, match=kind if kind != "a directory" else "directory"):
            read_regular_bytes(path, limit=10)
    big = tmp_path / "big.json"
    big.write_bytes(b" " * 11)
    with pytest.raises(UnreadableFile, match="more than the 10 B"):
        read_regular_text(big, limit=10)
    assert read_regular_text(big, limit=11) == " " * 11
    assert stat.S_ISREG(os.stat(big).st_mode) and CONFIG_MAX_BYTES >= 1024**2


def test_yaml_without_anchors_loads_as_before():
    import yaml

    text = "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_transformer_layer_cls_to_wrap: [A, B]\n"
    assert load_yaml_data(text) == yaml.safe_load(text)
    with pytest.raises(yaml.YAMLError, match="anchors"):
        load_yaml_data("a: &x 1\nb: 2\n")  # an anchor alone is refused too: no config needs one


@pytest.mark.parametrize("command", [["check"], ["generate", "-o", "out.yaml", "--from"], ["launcher", "--launcher", "slurm", "--command", "train.py"],
                                     ["converge", "--model", "m", "--data", "d.jsonl", "--output-dir", "o", "--recipe",
                                      str(Path(__file__).resolve().parent.parent / "recipes" / "causal_lm.py"), "--config"]],
                         ids=["check", "generate-from", "launcher", "converge"])
def test_commands_refuse_a_fifo_config_in_one_line(tmp_path, capsys, monkeypatch, command):
    from fsdp_presets import cli

    monkeypatch.chdir(tmp_path)
    fifo = tmp_path / "preset.yaml"
    os.mkfifo(fifo)
    status = cli.main([*command, str(fifo)])
    output = capsys.readouterr()
    assert status == 2 and not output.out
    assert output.err.strip().endswith("is a FIFO, not a regular file; pass a file)" if "--from" in command else
                                       "is a FIFO, not a regular file; pass a file"), output.err
    assert len(output.err.strip().splitlines()) == 1
    if command == ["check"]:  # a device and a folder are no config file either
        for path, kind in (("/dev/zero", "a device"), (str(tmp_path), "a directory")):
            assert cli.main(["check", path]) == 2
            assert capsys.readouterr().err.strip().endswith(f"{path} is {kind}, not a regular file; pass a file")


def test_a_manifest_nested_too_deep_or_too_large_is_unreadable_not_a_crash(tmp_path):
    from fsdp_presets.checkpoint.verify import checkpoint_verdict

    folder = tmp_path / "step-00000001"
    folder.mkdir()
    (folder / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    assert "unreadable manifest.json (invalid manifest: nested too deep)" in checkpoint_verdict(folder).problem
    (folder / "manifest.json").write_text(" " * (CONFIG_MAX_BYTES + 1))
    assert "more than the 16.0 MiB this reader accepts" in checkpoint_verdict(folder).problem


def test_a_distributed_config_that_is_a_fifo_is_refused_not_waited_on(tmp_path):
    # --distributed-config of a recipe, and the NAME.distributed.json `check` reads beside a config
    from fsdp_presets.check.rules_parallel import read_distributed_config
    from fsdp_presets.errors import UsageError
    from fsdp_presets.train.model_mesh import load_model_mesh

    fifo = tmp_path / "tp.distributed.json"
    os.mkfifo(fifo)
    with pytest.raises(UsageError, match="is a FIFO, not a regular file"):
        load_model_mesh(str(fifo), rank=0, world_size=2)
    assert "is a FIFO, not a regular file" in read_distributed_config(tmp_path / "tp.yaml")["problem"]
