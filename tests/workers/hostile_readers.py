"""Feed a family of generated hostile files to the project's bounded readers; print one JSON line.

    python tests/workers/hostile_readers.py pickle|yaml FOLDER

``pickle``: DCP ``.metadata`` files (allowed types only, nothing that runs code) swept in depth
(nested tuples a ``frozenset`` hashes, nested lists inside a real ``Metadata``, lists filled after
use) and in declared size (``bytearray(n)``, byte strings, text and integers claiming more bytes
than the file holds), each read with ``read_dcp_metadata``. ``yaml``: accelerate configs swept in
alias expansion ("billion laughs", 10^3 to 10^9 values), nesting depth and size, plus a FIFO and
``/dev/zero``, each read with ``check_file``. The line holds, per case, what the reader said, and
``baseline_kib``: the process's peak RSS after imports and one real read, before any case.
"""

import json
import os
import pickle
import resource
import struct
import sys
from pathlib import Path


SENTINEL = "PLANNER-VALUE"
GLOBAL_PREFIX = b"\x80\x04"


def real_metadata(planner_value=SENTINEL) -> bytes:
    """A DCP index as torch writes one (protocol 2), its planner data holding ``planner_value``."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    metadata = Metadata(
        state_dict_metadata={"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4, 4]),
                                                        [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 4]))])},
        planner_data={"w": planner_value},
        storage_data={MetadataIndex("w", torch.Size([0, 0])): _StorageInfo("__0_0.distcp", 0, 64)})
    return pickle.dumps(metadata, protocol=2)


def with_planner_opcodes(opcodes: bytes) -> bytes:
    """A real index whose planner value is the object the raw ``opcodes`` build."""
    data = real_metadata()
    encoded = SENTINEL.encode()
    unicode_item = b"X" + struct.pack("<I", len(encoded)) + encoded
    assert data.count(unicode_item) == 1
    return data.replace(unicode_item, opcodes)


def global_ref(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def pickle_cases() -> dict[str, bytes]:
    cases = {}
    for depth in (100, 10_000, 200_000):
        # frozenset(((((),),),),)): hashing the nested tuple recurses in C (200,000 deep: exit 139)
        cases[f"hashed-tuples-{depth}"] = (GLOBAL_PREFIX + global_ref("builtins", "frozenset") + b")" + b"\x85" * depth
                                           + b"\x85\x85R.")
    for depth in (100, 10_000):
        cases[f"nested-lists-{depth}"] = with_planner_opcodes(b"]" * depth + b"a" * (depth - 1))
    for count in (100, 10_000):  # empty lists, then each appended into the previous one
        build = b"".join(b"]r" + struct.pack("<I", index) + b"0" for index in range(count))
        chain = b"".join(b"j" + struct.pack("<I", index) + b"j" + struct.pack("<I", index + 1) + b"a0"
                         for index in range(count - 1))
        cases[f"lists-filled-after-use-{count}"] = with_planner_opcodes(build + chain + b"N")
    for size in (10**6, 1_500_000_000):
        cases[f"bytearray-of-{size}"] = with_planner_opcodes(
            global_ref("builtins", "bytearray") + b"J" + struct.pack("<i", size) + b"\x85R")
    for exponent in (20, 31, 50):
        claimed = struct.pack("<Q", 2**exponent)
        cases[f"bytes8-claiming-2^{exponent}"] = with_planner_opcodes(b"\x8e" + claimed + b"abc")
        cases[f"bytearray8-claiming-2^{exponent}"] = with_planner_opcodes(b"\x96" + claimed + b"abc")
        cases[f"unicode8-claiming-2^{exponent}"] = with_planner_opcodes(b"\x8d" + claimed + b"abc")
    cases["long4-claiming-2^31"] = with_planner_opcodes(b"\x8b" + struct.pack("<i", 2**31 - 1) + b"\x01")
    return cases


def yaml_cases(folder: Path) -> dict[str, Path]:
    paths = {}

    def write(name: str, text: str) -> None:
        paths[name] = folder / f"{name}.yaml"
        paths[name].write_text(text)

    for levels in (3, 6, 9):
        lines = ["compute_environment: LOCAL_MACHINE", 'a0: &a0 "lol"']
        lines += [f"a{level}: &a{level} [{', '.join([f'*a{level - 1}'] * 10)}]" for level in range(1, levels + 1)]
        write(f"laughs-10^{levels}", "\n".join(lines) + f"\nfsdp_config: *a{levels}\n")
    for depth in (100, 10_000, 100_000):
        write(f"nested-{depth}", "fsdp_config: " + "[" * depth + "]" * depth + "\n")
    write("larger-than-limit", "distributed_type: FSDP\n" + "# padding\n" * 200_000)
    fifo = folder / "fifo.yaml"
    os.mkfifo(fifo)
    paths["fifo"] = fifo
    paths["dev-zero"] = Path("/dev/zero")
    return paths


def main() -> None:
    kind, folder = sys.argv[1], Path(sys.argv[2])
    results = {}
    if kind == "pickle":
        from fsdp_presets.checkpoint.safe_unpickle import loads_metadata, read_dcp_metadata

        loads_metadata(real_metadata(), folder / "real")  # the real thing reads
        baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for name, data in pickle_cases().items():
            case = folder / name
            case.mkdir()
            (case / ".metadata").write_bytes(data)
            try:
                read_dcp_metadata(case)
                results[name] = "accepted"
            except Exception as error:
                results[name] = f"{type(error).__name__}: {error}"
    else:
        from fsdp_presets.fileio import YAML_MAX_BYTES, load_yaml_data, read_regular_text
        from fsdp_presets.check.lint import check_file

        # a real config read the same way (a refused file never gets as far as accelerate's own reading)
        load_yaml_data(read_regular_text(Path(__file__).resolve().parents[2] / "accelerate_configs" /
                                         "cpu_fsdp2_demo.yaml", limit=YAML_MAX_BYTES))
        baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for name, path in yaml_cases(folder).items():
            try:
                report, _ = check_file(path)
                results[name] = " | ".join(f"{item.rule}: {item.message}" for item in report.errors) or "accepted"
            except Exception as error:
                results[name] = f"{type(error).__name__}: {error}"
    print(json.dumps({"baseline_kib": baseline, "results": results}))


if __name__ == "__main__":
    main()
