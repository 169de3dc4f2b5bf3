"""Every on-disk name of a run folder and of a checkpoint is spelled in one module,
:mod:`fsdp_presets.checkpoint.layout`: a scan of the package, the recipes and the scripts fails on
a copy of one of them, so the names cannot drift apart again. Also the path rules themselves."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from fsdp_presets.checkpoint import layout

REPO = Path(__file__).resolve().parent.parent
SCANNED = [REPO / "fsdp_presets", REPO / "recipes", REPO / "scripts"]
LAYOUT_FILE = Path(layout.__file__).resolve()

# Names too generic to look for in any string: looked for only where a path is built from them
# (`folder / "final"`, `Path("final")`, `joinpath("final")`).
GENERIC = {layout.CHECKPOINTS, layout.FINAL, layout.MERGED, layout.PLOTS}
# transformers' and huggingface_hub's own names (a Hugging Face folder's files): layout names them
# for the run folder's final/ and exports, but the model profile and loaders read them too.
NOT_OURS = {layout.HF_CONFIG, layout.GENERATION_CONFIG, layout.SAFETENSORS_SHARDS, layout.WEIGHTS_SUFFIX,
            layout.HF_LEGACY_WEIGHTS}


def _owned_names() -> set[str]:
    names = {value for name, value in vars(layout).items()
             if name.isupper() and isinstance(value, str) and value not in NOT_OURS}
    names |= {pattern.pattern for pattern in (layout.STEP_PATTERN, layout.DCP_RANK_FILE, layout.RNG_STATE_PATTERN)}
    names |= {layout.RNG_STATE_PREFIX, layout.STEP_PREFIX, layout.step_folder_name(0)[:len(layout.STEP_PREFIX)]}
    return names


OWNED = _owned_names()


def _spelling(name: str) -> re.Pattern:
    """``name`` as a whole word: ``model_config`` is not in ``model_configs``, ``.metadata`` is not
    in ``checkpoint.metadata``; a prefix (``step-``, ``random_states_``) may be followed by anything."""
    right = r"(?![\w.])" if re.match(r".*\w$", name) else ""
    return re.compile(rf"(?<![\w]){re.escape(name)}{right}")


DISTINCT = [(name, _spelling(name)) for name in sorted(OWNED - GENERIC, key=len, reverse=True)]


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    for node in ast.walk(tree):  # attribute docstrings: a string statement right after an assignment
        for field in ("body", "orelse"):
            statements = getattr(node, field, None)
            if not isinstance(statements, list):
                continue
            for before, statement in zip(statements, statements[1:]):
                if (isinstance(before, (ast.Assign, ast.AnnAssign)) and isinstance(statement, ast.Expr)
                        and isinstance(statement.value, ast.Constant)):
                    ids.add(id(statement.value))
    return ids


def _path_operands(tree: ast.AST) -> set[int]:
    """Constants a path is built from: operands of ``/``, arguments of ``Path(...)``/``joinpath``."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            ids.update(id(side) for side in (node.left, node.right) if isinstance(side, ast.Constant))
        if isinstance(node, ast.Call):
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if name in ("Path", "PurePath", "joinpath", "with_name"):
                ids.update(id(argument) for argument in node.args if isinstance(argument, ast.Constant))
    return ids


def spelled_names(path: Path) -> list[str]:
    """``line: name`` for each string of ``path`` (docstrings and prose excepted) that spells an
    on-disk name of layout."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip, path_parts = _docstrings(tree), _path_operands(tree)
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in skip:
            continue
        text = node.value
        if id(node) in path_parts and text.strip("/") in GENERIC:
            found.append(f"{node.lineno}: {text!r}")
            continue
        if re.search(r"\s", text):  # prose: a message or help text that mentions a name
            continue
        for name, spelling in DISTINCT:
            if spelling.search(text):
                found.append(f"{node.lineno}: {name!r} in {text!r}")
                break
    return found


def scanned_files() -> list[Path]:
    files = []
    for root in SCANNED:
        files.extend(path for path in sorted(root.rglob("*.py")) if path.resolve() != LAYOUT_FILE)
    return files


def test_the_scan_finds_a_copied_name(tmp_path):
    """The scan can fail: a module that spells names of layout is caught, prose is not."""
    sample = tmp_path / "drift.py"
    sample.write_text('import os\n\nRUN = "run.json"\n\n\ndef f(root):\n    """Reads run.json and final/."""\n'
                      '    print(f"no manifest.json in {root}")\n    os.listdir(root / "final")\n'
                      '    return root / f"step-{3:08d}" / "pytorch_model_fsdp_0"\n')
    found = spelled_names(sample)
    assert sorted(line.split(":")[0] for line in found) == ["10", "10", "3", "9"], found


def test_every_on_disk_name_is_spelled_only_in_layout():
    offenders = {str(path.relative_to(REPO)): found for path in scanned_files() if (found := spelled_names(path))}
    assert not offenders, ("on-disk names of a run folder or checkpoint spelled outside "
                           f"fsdp_presets/checkpoint/layout.py (import them from there): {offenders}")


def test_step_folder_names_and_path_rules(tmp_path):
    assert layout.step_folder_name(12) == "step-00000012"
    assert layout.step_of("step-00000012") == 12 and layout.step_of("step-12") is None
    assert layout.step_of(layout.temporary_step_folder(tmp_path, 12)) is None  # a save in progress is no step
    assert layout.step_in_path(tmp_path / "step-00000012" / "manifest.json") == 12
    assert layout.step_in_path(tmp_path / "run") is None
    run = layout.RunFolder(root=tmp_path / "run")
    checkpoint = run.step(4)
    checkpoint.mkdir(parents=True)
    assert checkpoint == tmp_path / "run" / "checkpoints" / "step-00000004"
    assert layout.run_folder_of(checkpoint) == (tmp_path / "run").resolve()
    link = tmp_path / "elsewhere"
    link.symlink_to(checkpoint)  # a link to a checkpoint: its run folder is the one it was written in
    assert layout.run_json_of(link) == (tmp_path / "run" / "run.json").resolve()
    assert layout.rng_state_file(3) == "random_states_3.pkl" and layout.rng_state_rank("random_states_3.pkl") == 3
    assert layout.rng_state_rank("random_states_x.pkl") is None


@pytest.mark.parametrize("make", [layout.staging_sibling, layout.retired_sibling, layout.deleting_name])
def test_temporary_siblings_are_hidden_and_unique(tmp_path, make):
    first, second = make(tmp_path / "final"), make(tmp_path / "final")
    assert first.parent == tmp_path and first.name.startswith(".") and first != second
    assert layout.step_of(first) is None
