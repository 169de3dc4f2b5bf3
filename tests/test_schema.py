"""The accelerate config schema table (fsdp_presets.schema): it is the one place that spells
an accelerate FSDP key, and its defaults are accelerate's own."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

from fsdp_presets import schema
from fsdp_presets.preset.accelerate_view import accelerate_view
from fsdp_presets.preset.emit import written_config

REPO = Path(__file__).resolve().parent.parent
SCANNED = ("fsdp_presets", "scripts", "recipes", "harness/fsdp_harness")
OWNER = REPO / "fsdp_presets" / "schema.py"
KEY_NAMES = frozenset(key.name for key in schema.FSDP_KEYS) | {schema.FSDP_CONFIG}
TOP_NAMES = frozenset(key.name for key in schema.TOP_LEVEL_KEYS) - KEY_NAMES
WORD = re.compile(r"\bfsdp_[a-z0-9_]+\b(:?)")
TOP_WORD = re.compile(r"(?<![\w.-])(" + "|".join(sorted(TOP_NAMES, key=len, reverse=True)) + r")\b(:?)")
# Python names that share a key's spelling: `Parallelism.fsdp_version`, the plugin's `fsdp_version`, the
# planner's JSON field and argument. Spelled as such they are those names; spelled as a YAML key
# (`fsdp_version: 2`) they are the key.
SHARED_NAMES = frozenset({"fsdp_version"})
# A top-level module imports no subpackage (tests/test_layout_imports.py), so the one error of
# fsdp_presets.cpu_fsdp that names the key the user must set spells it itself.
ALLOWED = {("fsdp_presets/cpu_fsdp.py", "fsdp_offload_params")}
# Names that share a top-level key's spelling without being one: `distributed_type` is also a field of
# run.json and of the benchmarks' per-rank results (the accelerator's attribute, recorded), and
# accelerate's AcceleratorState and Accelerator hold `mixed_precision`, `distributed_type` and
# `parallelism_config` as attributes.
NOT_KEYS = {
    ("fsdp_presets/cpu_fsdp.py", "mixed_precision"), ("fsdp_presets/cpu_fsdp.py", "distributed_type"),
    ("fsdp_presets/checkpoint/run_folder.py", "distributed_type"),
    ("fsdp_presets/checkpoint/run_folder.py", "parallelism_config"),
    ("fsdp_presets/checkpoint/manager.py", "distributed_type"),
    ("fsdp_presets/compare/records.py", "distributed_type"), ("fsdp_presets/compare/report.py", "distributed_type"),
    ("scripts/bench_worker.py", "distributed_type"), ("harness/fsdp_harness/step_bench.py", "distributed_type"),
    ("harness/fsdp_harness/bench.py", "distributed_type"), ("fsdp_presets/train/trainer_callback.py", "distributed_type"),
}


def _docstrings(tree: ast.AST) -> set[int]:
    """Strings that stand alone as statements: module, class, function and attribute docstrings."""
    return {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}


def key_spellings(source: str) -> list[tuple[int, str]]:
    """(line, key) for every accelerate FSDP key spelled in a string of ``source`` (docstrings and
    comments are documentation and do not count)."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            found += [(node.lineno, match.group(0).rstrip(":")) for match in WORD.finditer(node.value)
                      if match.group(0).rstrip(":") in KEY_NAMES
                      and (match.group(0).rstrip(":") not in SHARED_NAMES or match.group(1))]
    return sorted(found)


def top_level_spellings(source: str) -> list[tuple[int, str]]:
    """(line, key) for every top-level accelerate key spelled in a string of ``source``: a string that is
    the key (``config.get("num_processes")``), or a key written as in YAML in a message
    (``"add debug: false"``). A launch flag (``--num_processes``) and an attribute are not keys."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if node.value in TOP_NAMES:
                found.append((node.lineno, node.value))
                continue
            found += [(node.lineno, match.group(1)) for match in TOP_WORD.finditer(node.value)
                      if match.group(2)]
    return sorted(found)


def test_the_scanner_sees_a_key_in_a_string_an_f_string_and_a_dict_but_not_in_a_docstring():
    source = ('"""fsdp_sync_module_states in a docstring"""\n'
              'x = {"fsdp_offload_params": True}\n'
              'y = f"set fsdp_sync_module_states: {x}"\n'
              'z = getattr(plugin, "fsdp_version")  # fsdp_state_dict_type in a comment\n'
              'v = f"fsdp_version must be 1 or 2, got {z}"\n'
              'w = "set fsdp_version: 2"\n')
    assert key_spellings(source) == [(2, "fsdp_offload_params"), (3, "fsdp_sync_module_states"),
                                     (6, "fsdp_version")]


def test_the_scanner_sees_a_top_level_key_as_a_string_or_yaml_but_not_a_flag_or_an_attribute():
    source = ('"""num_processes in a docstring"""\n'
              'a = config.get("num_processes")\n'
              'b = f"set mixed_precision: bf16, got {a}"\n'
              'c = "add debug: false"\n'
              'd = "turn debug off"  # num_machines in a comment\n'
              'e = "debug"\n'
              'f = "config.num_machines is the view, --num_machines the flag"\n'
              'g = "set num_processes to 2"\n')
    assert top_level_spellings(source) == [(2, "num_processes"), (3, "mixed_precision"), (4, "debug"),
                                           (6, "debug")]


def test_each_top_level_accelerate_key_is_spelled_only_in_the_schema_table():
    spelled = {}
    for folder in SCANNED:
        for path in sorted((REPO / folder).rglob("*.py")):
            name = str(path.relative_to(REPO))
            if path == OWNER:
                continue
            for line, key in top_level_spellings(path.read_text(encoding="utf-8")):
                if (name, key) not in NOT_KEYS:
                    spelled.setdefault(key, []).append(f"{name}:{line}")
    assert not spelled, ("top-level accelerate keys spelled outside fsdp_presets/schema.py (use schema.T, "
                         f"or the emitter's writer): {spelled}")
    owner = OWNER.read_text(encoding="utf-8")
    assert [name for name in sorted(TOP_NAMES) if f'"{name}"' not in owner] == []


def test_each_accelerate_fsdp_key_is_spelled_only_in_the_schema_table():
    spelled = {}
    for folder in SCANNED:
        for path in sorted((REPO / folder).rglob("*.py")):
            if path == OWNER:
                continue
            for line, key in key_spellings(path.read_text(encoding="utf-8")):
                if (str(path.relative_to(REPO)), key) in ALLOWED:
                    continue
                spelled.setdefault(key, []).append(f"{path.relative_to(REPO)}:{line}")
    assert not spelled, ("accelerate keys spelled outside fsdp_presets/schema.py (use schema.K / "
                         f"schema.FSDP_CONFIG or the emitter's writer): {spelled}")
    # ... and the table spells every one of them in full (so that grep finds it there)
    owner = OWNER.read_text(encoding="utf-8")
    assert [name for name in sorted(KEY_NAMES) if f'"{name}"' not in owner] == []


def _plugin_from(tmp_path: Path, fsdp: dict):
    path = tmp_path / "empty.yaml"
    path.write_text(yaml.safe_dump(written_config(num_processes=2, fsdp=fsdp)))
    return accelerate_view(path)


def _plugin_value(plugin, key: schema.ConfigKey):
    value = getattr(plugin, key.plugin_field)
    if key.name == schema.K.offload_params:  # FSDP1: CPUOffload(offload_params=...); FSDP2: CPUOffloadPolicy or not
        flag = getattr(value, "offload_params", None)
        return flag if flag is not None else type(value).__name__ == "CPUOffloadPolicy"
    if key.name == schema.K.transformer_layer_cls_to_wrap:
        return ",".join(value) if value else None
    return getattr(value, "name", value)  # torch enums -> their names


@pytest.mark.parametrize("version", [1, 2])
def test_table_defaults_are_what_accelerate_builds_from_an_empty_fsdp_config(tmp_path, version):
    """accelerate 1.16's launcher and FullyShardedDataParallelPlugin, from a file whose fsdp_config holds
    nothing (FSDP1) or only the version (FSDP2): every key the table says applies has the table's default."""
    view = _plugin_from(tmp_path, {} if version == 1 else {"version": 2})
    plugin, checked = view.fsdp_plugin, []
    for key in schema.FSDP_KEYS:
        if key.name == schema.K.min_num_params:
            # read only under SIZE_BASED_WRAP: the launcher's default travels in the environment
            assert int(view.env["FSDP_MIN_NUM_PARAMS"]) == key.default(version)
            continue
        expected = key.default(version) if key.valid_for(version) else None
        if key.name == schema.K.version:
            expected = version
        if key.valid_for(version) or version == 2:  # FSDP2's plugin clears the FSDP1-only fields
            assert _plugin_value(plugin, key) == expected, key.name
            checked.append(key.name)
    assert len(checked) >= 10


def test_size_based_wrap_applies_the_table_min_num_params(tmp_path):
    key = schema.fsdp_key("min_num_params")
    plugin = _plugin_from(tmp_path, {"auto_wrap_policy": "SIZE_BASED_WRAP"}).fsdp_plugin
    assert plugin.min_num_params == key.default(1)


def test_version_names_and_counterparts_are_consistent():
    for key in schema.FSDP_KEYS:
        assert key.fsdp1 or key.fsdp2, key.name
        if key.counterpart:
            other = schema.BY_NAME[key.counterpart]
            assert other.counterpart == key.name and (key.fsdp1, key.fsdp2) == (other.fsdp2, other.fsdp1)
        if key.fsdp2_ignores:
            assert not key.fsdp2
    assert schema.fsdp_key("version") is schema.fsdp_key("fsdp_version")
    with pytest.raises(ValueError, match="did you mean sync_module_states"):
        schema.fsdp_key("sync_module_state")


def test_the_writer_refuses_an_unknown_key():
    with pytest.raises(ValueError, match="unknown fsdp_config key"):
        written_config(num_processes=2, fsdp={"reshard_after_foward": True})
