"""The package's import direction, read off the source with ``ast`` (imports inside functions
count too, so a lazy import cannot slip past):

- nothing under ``fsdp_presets`` imports the test and benchmark harness (``fsdp_harness``), nor
  do the user-facing scripts, and the harness is not installed with the package;
- the config stages (model, rehearse, plan, launching, preset, check) import only the stages before them,
  never the run side (train, checkpoint, compare) or the commands;
- ``fsdp_presets.checkpoint`` imports none of the config stages (nor train or compare);
- the small top-level modules (errors, fileio, schema, ...) import no subpackage, and the command
  line's shared flags (arguments) are imported by the command line only;
- tests and scripts import the installed package: no ``sys.path`` edits.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "fsdp_presets"


def module_name(path: Path, root: Path = REPO) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, root: Path = REPO) -> list[tuple[int, str]]:
    """``(line, module)`` for every import in the file, relative imports resolved; ``from X import
    Y`` yields ``X`` and ``X.Y`` (Y may be a submodule: ``from fsdp_presets import train``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def violations(folder: Path, forbidden: tuple[str, ...], root: Path = REPO) -> list[str]:
    """``file:line imports module`` for each import under ``folder`` of a forbidden module or its children."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for line, module in imported_modules(path, root):
            if any(module == name or module.startswith(name + ".") for name in forbidden):
                found.append(f"{path.relative_to(root)}:{line} imports {module}")
    return found


def test_the_scan_sees_lazy_and_relative_imports(tmp_path):
    """The checker itself can fail: a lazy import inside a function and a relative one are found."""
    folder = tmp_path / "fsdp_presets" / "plan"
    folder.mkdir(parents=True)
    (folder / "x.py").write_text("def f():\n    from ..train import loop\n    import fsdp_harness.launch\n"
                                 "    from fsdp_presets import checkpoint\n")
    imports = {module for _, module in imported_modules(folder / "x.py", root=tmp_path)}
    assert {"fsdp_presets.train.loop", "fsdp_harness.launch", "fsdp_presets.checkpoint"} <= imports


def test_runtime_package_never_imports_the_harness():
    assert violations(PACKAGE, ("fsdp_harness",)) == []


USER_SCRIPTS = ("demo.py", "convergence_check.py", "prepare_models.py")
"""The scripts README and docs send users to: they run with fsdp-presets alone."""


def test_user_facing_scripts_never_import_the_harness():
    found = [f"scripts/{name}:{line} imports {module}" for name in USER_SCRIPTS
             for line, module in imported_modules(REPO / "scripts" / name)
             if module == "fsdp_harness" or module.startswith("fsdp_harness.")]
    assert found == []


def test_the_harness_is_a_package_of_its_own():
    """fsdp-presets installs ``fsdp_presets*`` only; the harness has its own project file."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["tool"]["setuptools"]["packages"]["find"]["include"] == ["fsdp_presets*"]
    harness = tomllib.loads((REPO / "harness" / "pyproject.toml").read_text())
    assert harness["tool"]["setuptools"]["packages"]["find"]["include"] == ["fsdp_harness*"]
    assert (REPO / "harness" / "fsdp_harness" / "__init__.py").is_file() and not (REPO / "fsdp_harness").exists()


CONFIG_FLOW = ("model", "rehearse", "plan", "launching", "preset", "check")
"""From a model to a checked config, in the order the data flows: each stage imports only the
stages before it (and the base modules), never the ones after it, the run side or the commands."""
RUN_SIDE = ("train", "checkpoint", "compare", "commands", "cli", "arguments")


@pytest.mark.parametrize("stage", CONFIG_FLOW)
def test_config_stages_import_only_earlier_stages(stage):
    later = CONFIG_FLOW[CONFIG_FLOW.index(stage) + 1:]
    forbidden = tuple(f"fsdp_presets.{name}" for name in (*later, *RUN_SIDE))
    assert violations(PACKAGE / stage, forbidden) == []


def test_checkpoint_never_imports_the_config_stages():
    """Checkpoints are read and written without knowing how their config was chosen."""
    forbidden = tuple(f"fsdp_presets.{name}" for name in (*CONFIG_FLOW, "train", "compare", "commands", "cli"))
    assert violations(PACKAGE / "checkpoint", forbidden) == []


def sys_path_edits(path: Path, root: Path = REPO) -> list[str]:
    """Lines of ``path`` that change ``sys.path`` (insert, append, assignment, ``+=``, ...)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        target = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = node.func.value  # sys.path.insert(...), sys.path.append(...)
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            target = next((t.value if isinstance(t, ast.Subscript) else t for t in targets
                           if isinstance(t.value if isinstance(t, ast.Subscript) else t, ast.Attribute)), None)
        if (isinstance(target, ast.Attribute) and target.attr == "path" and isinstance(target.value, ast.Name)
                and target.value.id == "sys"):
            found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


@pytest.mark.parametrize("folder", ["tests", "scripts"])
def test_no_sys_path_edits(folder):
    """Tests and scripts import the package as installed (``pip install -e .``: scripts/setup.sh)."""
    edits = [edit for path in sorted((REPO / folder).rglob("*.py")) for edit in sys_path_edits(path)]
    assert edits == []


def test_the_sys_path_scan_finds_an_edit(tmp_path):
    script = tmp_path / "x.py"
    script.write_text("import sys\nsys.path.insert(0, 'a')\nsys.path += ['b']\nsys.path[:0] = ['c']\nsys.path.append('d')\n")
    assert sorted(sys_path_edits(script, root=tmp_path)) == ["x.py:2", "x.py:3", "x.py:4", "x.py:5"]


BASE_MODULES = ("errors", "fileio", "numerics", "cpu_fsdp", "clean_exit", "faults", "schema", "environment", "flags", "throughput")
"""The small top-level modules every subpackage may use: they sit under the flow, so they import
none of its stages (nor the commands)."""
SUBPACKAGES = tuple(f"fsdp_presets.{name}" for name in (*CONFIG_FLOW, *RUN_SIDE))


@pytest.mark.parametrize("name", BASE_MODULES)
def test_top_level_modules_import_no_subpackage(name):
    path = PACKAGE / f"{name}.py"
    found = [f"{name}.py:{line} imports {module}" for line, module in imported_modules(path)
             if any(module == package or module.startswith(package + ".") for package in SUBPACKAGES)]
    assert found == []


def test_the_base_modules_are_every_plain_top_level_module():
    """A new top-level module is placed on purpose: in the base layer above, or in a subpackage."""
    plain = {path.stem for path in PACKAGE.glob("*.py")} - {"__init__", "cli", "arguments"}
    assert plain == set(BASE_MODULES)


def test_only_the_command_line_imports_the_shared_flags():
    """``arguments`` builds flags from the domain's checks and defaults (``plan.limits``); the
    domain, the run side and the scripts import those from their owner, never from it."""
    found = [f"{path.relative_to(REPO)}:{line}" for folder in ("fsdp_presets", "scripts", "harness")
             for path in sorted((REPO / folder).rglob("*.py"))
             if path.parent.name != "commands" and path.name not in ("cli.py", "arguments.py")
             for line, module in imported_modules(path) if module == "fsdp_presets.arguments"]
    assert found == []


def test_importing_the_package_installs_no_import_hook():
    """Modules live at one path each: importing the package adds nothing to ``sys.meta_path``, and
    the old flat paths (``fsdp_presets.training``) are gone rather than aliased."""
    import subprocess
    import sys

    probe = ("import sys; before = list(sys.meta_path); import fsdp_presets; "
             "assert sys.meta_path == before, sys.meta_path\n"
             "try:\n import fsdp_presets.training\nexcept ModuleNotFoundError: pass\n"
             "else: raise SystemExit('fsdp_presets.training still imports')")
    subprocess.run([sys.executable, "-c", probe], check=True)


def import_cycles(package: Path, root: Path = REPO) -> list[list[str]]:
    """Every import cycle between the modules under ``package`` (an import of a package's name
    counts as an import of its ``__init__``; a module importing its own parent package does not
    count), each as the list of modules around it."""
    modules = {module_name(path, root): path for path in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for _, imported in imported_modules(path, root):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name and not name.startswith(imported + "."):
                targets.add(imported)
        graph[name] = targets
    # Tarjan's strongly connected components: a component of more than one module is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_the_cycle_finder_can_fail(tmp_path):
    """A lazy import inside a function closes a cycle as surely as a module-level one."""
    folder = tmp_path / "fsdp_presets"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    (folder / "a.py").write_text("from fsdp_presets import b\n")
    (folder / "b.py").write_text("def later():\n    from fsdp_presets.a import thing\n")
    (folder / "c.py").write_text("import fsdp_presets.a\n")
    assert import_cycles(folder, tmp_path) == [["fsdp_presets.a", "fsdp_presets.b"]]


def test_no_import_cycle_inside_the_package():
    """Imports go one way: no module reaches itself through others (module-level and
    function-level imports both count)."""
    assert import_cycles(PACKAGE) == []


INSPECT_CHECKPOINT_ROUTE = {
    "fsdp_presets.commands.inspect_checkpoint",  # parse, call, print
    "fsdp_presets.checkpoint.inspect",  # the summary and its lines
    "fsdp_presets.checkpoint.verify",  # the read-only verdict
    "fsdp_presets.checkpoint.safe_unpickle", "fsdp_presets.checkpoint.pickle_bounds",  # pickles read as data
}
"""The modules ``inspect-checkpoint`` walks through; besides them it reads only the owners of the
on-disk names and formats (``layout``, ``manifest``, ``files``, ``run_folder``: run.json) and the base modules."""
FORMAT_OWNERS = {"fsdp_presets.checkpoint.layout", "fsdp_presets.checkpoint.manifest", "fsdp_presets.checkpoint.files",
                 "fsdp_presets.checkpoint.run_folder"}


def test_inspect_checkpoint_walks_through_few_modules():
    """A fresh interpreter that runs ``inspect-checkpoint`` on a checkpoint folder (after parsing
    its flags) imports the route above and the format owners, never the collective save and load
    (``manager``), fault injection or another stage."""
    import json
    import subprocess
    import sys

    checkpoint = REPO / "tests" / "data" / "checkpoint_format1" / "training-step-00000004"
    probe = ("import argparse, contextlib, io, json, sys\n"
             "from fsdp_presets.commands import inspect_checkpoint\n"
             "parser = argparse.ArgumentParser()\n"
             "inspect_checkpoint.add_arguments(parser)\n"
             "args = parser.parse_args([sys.argv[1], '--gpus', '2'])\n"
             "parsed = set(sys.modules)\n"
             "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
             "    status = inspect_checkpoint.run(args)\n"
             "print(json.dumps({'status': status, 'text': out.getvalue(), 'modules': sorted(\n"
             "    name for name in set(sys.modules) - parsed if name.startswith('fsdp_presets'))}))\n")
    found = json.loads(subprocess.run([sys.executable, "-c", probe, str(checkpoint)], check=True,
                                      capture_output=True, text=True).stdout)
    assert found["status"] == 0 and "resume at 2 GPU(s): yes" in found["text"]
    base = {"fsdp_presets.checkpoint", *(f"fsdp_presets.{name}" for name in BASE_MODULES)}
    walked = {"fsdp_presets.commands.inspect_checkpoint", *found["modules"]} - base - FORMAT_OWNERS
    assert walked == INSPECT_CHECKPOINT_ROUTE and len(walked) <= 5, sorted(walked)


def private_imports(folder: Path, root: Path = REPO) -> list[str]:
    """``file:line module._name`` for each private name (one leading underscore) imported from a
    module of the package: a helper two modules share is public in the one that owns it."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fsdp_presets"):
                found += [f"{path.relative_to(root)}:{node.lineno} {node.module}.{alias.name}" for alias in node.names
                          if alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


def test_no_private_name_crosses_a_module_boundary():
    assert private_imports(PACKAGE) == [] and private_imports(REPO / "recipes") == []


def test_the_private_name_scan_finds_one(tmp_path):
    (tmp_path / "x.py").write_text("from fsdp_presets.check.findings import _sorted, finding\n")
    assert private_imports(tmp_path, root=tmp_path) == ["x.py:1 fsdp_presets.check.findings._sorted"]
