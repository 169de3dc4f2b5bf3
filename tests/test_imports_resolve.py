"""Every import in the package, the harness, the recipes and the scripts resolves, read off the
source with ``ast`` (nothing is executed, imports inside functions count): the module is found
(``importlib.util.find_spec`` for a top-level name, the import system's path finder for a
submodule, so no parent package is imported) and every name ``from M import NAME`` takes is a
submodule of M or defined at the top level of M's source (a definition, an assignment, an import,
``from X import *`` of a module that defines it, or ``__all__`` of a module that builds its names
in ``__getattr__``). A script most tests never run (``scripts/bench_async_save.py``) cannot keep
importing a name that moved.

Modules without Python source (built-in, frozen or compiled: ``sys``, ``os``, ``math``) are
imported to read their names: they are cheap and run no project code.
"""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.util
import sys
import types
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCANNED = ("fsdp_presets", "harness/fsdp_harness", "recipes", "scripts")
"""Where the imports are read: the package, the harness, the recipes, the scripts."""
SCRIPT_FOLDERS = ("recipes", "scripts")
"""Files run as scripts: Python puts their own folder first on ``sys.path``."""


class Unresolved(Exception):
    """The module cannot be found, or a name is not in it."""


def _source_module_name(path: Path, root: Path) -> str | None:
    """The dotted name of a file inside an importable package (None for a script)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[0] == "harness":
        parts = parts[1:]
    if parts[0] not in ("fsdp_presets", "fsdp_harness"):
        return None
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, root: Path = REPO) -> list[tuple[int, str, str | None]]:
    """``(line, module, name)`` for every import in ``path``, at any depth: ``import a.b`` gives
    ``("a.b", None)``, ``from a import b, c`` gives ``("a", "b")`` and ``("a", "c")``, ``from a
    import *`` gives ``("a", None)``; relative imports are resolved against the file's package."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    own = _source_module_name(path, root)
    package = None if own is None else own if path.name == "__init__.py" else own.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                if package is None:
                    raise Unresolved(f"{path}:{node.lineno}: a relative import outside a package")
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([module] if module else []))
            found += [(node.lineno, module, None if alias.name == "*" else alias.name) for alias in node.names]
    return found


@lru_cache(maxsize=None)
def find_module(name: str, script_folder: str | None = None):
    """The spec of module ``name``, or None: a top-level name through ``importlib.util.find_spec``
    (or, for a script, its own folder first), each further part through the path finder in the
    parent's folders, which imports nothing. A part that is no file but a name the parent binds
    (``os.path``) is found as that name's module."""
    head, *rest = name.split(".")
    spec = None
    if script_folder is not None:
        spec = importlib.machinery.PathFinder.find_spec(head, [script_folder])
    if spec is None:  # from sys.path, as if not imported yet: an imported lazy module (transformers)
        # would answer with a spec that has no source to read
        spec = importlib.machinery.PathFinder.find_spec(head) or importlib.util.find_spec(head)
    prefix = head
    for part in rest:
        if spec is None:
            return None
        prefix = f"{prefix}.{part}"
        locations = spec.submodule_search_locations
        child = importlib.machinery.PathFinder.find_spec(prefix, list(locations)) if locations else None
        if child is None:
            bound = top_level_names(spec).get(part)
            child = find_module(bound) if isinstance(bound, str) else None
        spec = child
    return spec


def top_level_names(spec) -> dict:
    """``{name: module it imports, or None}`` for every name the module of ``spec`` binds at its
    top level (inside top-level ``if``/``try``/``with`` blocks too); ``"*"`` holds the modules
    of its ``from M import *`` lines. A module without Python source is imported to read its names."""
    return _names(spec.name, spec.origin, bool(spec.submodule_search_locations))


@lru_cache(maxsize=None)
def _text(origin: str) -> str:
    return Path(origin).read_text(encoding="utf-8")


@lru_cache(maxsize=None)
def _names(module_name: str, origin: str | None, is_package: bool) -> dict:
    if not origin or not origin.endswith(".py"):
        module = importlib.import_module(module_name)
        return {name: value.__name__ if isinstance(value, types.ModuleType) else None
                for name, value in vars(module).items()}
    tree = ast.parse(_text(origin), filename=origin)
    package = module_name if is_package else module_name.rpartition(".")[0]
    names: dict = {}
    stars: list[str] = []

    def targets(node) -> list[str]:
        if isinstance(node, ast.Name):
            return [node.id]
        if isinstance(node, (ast.Tuple, ast.List)):
            return [name for element in node.elts for name in targets(element)]
        if isinstance(node, ast.Starred):
            return targets(node.value)
        return []

    def visit(body) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names[node.name] = None
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    names.update(dict.fromkeys(targets(target)))
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                names.update(dict.fromkeys(targets(node.target)))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        names[alias.asname] = alias.name
                    else:
                        head = alias.name.partition(".")[0]
                        names[head] = head
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    module = ".".join(base + ([module] if module else []))
                for alias in node.names:
                    if alias.name == "*":
                        stars.append(module)
                    else:
                        names[alias.asname or alias.name] = f"{module}.{alias.name}"
            elif isinstance(node, (ast.If, ast.Try, getattr(ast, "TryStar", ast.Try))):
                visit(node.body)
                visit(node.orelse)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
                visit(getattr(node, "finalbody", []))
            elif isinstance(node, (ast.With, ast.For, ast.While)):
                visit(node.body)
                visit(getattr(node, "orelse", []))

    visit(tree.body)
    if stars:
        names["*"] = tuple(stars)
    if "__getattr__" in names:  # PEP 562: names made on first use are the ones __all__ lists
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                if isinstance(node.value, (ast.List, ast.Tuple)):
                    names.update((element.value, None) for element in node.value.elts
                                 if isinstance(element, ast.Constant) and isinstance(element.value, str))
    return names


def resolve(module: str, name: str | None, *, script_folder: str | None = None) -> None:
    """Raise :class:`Unresolved` unless ``module`` is found and ``name`` (if any) is a submodule
    of it or a name it binds."""
    spec = find_module(module, script_folder)
    if spec is None:
        raise Unresolved(f"no module {module}")
    if name is None:
        return
    if spec.submodule_search_locations and \
            importlib.machinery.PathFinder.find_spec(f"{spec.name}.{name}", list(spec.submodule_search_locations)):
        return
    if not binds(spec, name):
        raise Unresolved(f"{module} has no {name}")


def binds(spec, name: str, seen: frozenset = frozenset()) -> bool:
    """Whether the module of ``spec`` binds ``name`` at its top level, itself or through one of its
    ``from M import *`` lines (read only when the name is not bound directly)."""
    if spec.origin and spec.origin.endswith(".py"):
        text = _text(spec.origin)
        if name not in text and "import *" not in text:
            return False  # bound nowhere in it: no need to parse it (a big package's modules)
    names = top_level_names(spec)
    if name in names and name != "*":
        return True
    if name.startswith("_"):
        return False
    for module in names.get("*", ()):
        target = find_module(module)
        if target is not None and target.name not in seen and binds(target, name, seen | {spec.name}):
            return True
    return False


def unresolved_imports(paths, root: Path = REPO) -> list[str]:
    """``file:line: problem`` for each import under ``paths`` that does not resolve."""
    found = []
    for path in paths:
        in_script_folder = path.parent.name in SCRIPT_FOLDERS and path.parent.parent == root
        for line, module, name in imports_of(path, root):
            try:
                resolve(module, name, script_folder=str(path.parent) if in_script_folder else None)
            except Unresolved as problem:
                found.append(f"{path.relative_to(root)}:{line}: {problem}")
    return found


def scanned_files(root: Path = REPO) -> list[Path]:
    return [path for folder in SCANNED for path in sorted((root / folder).rglob("*.py"))]


HEAVY = ("torch", "transformers", "accelerate", "datasets", "peft", "trl")


def test_every_import_resolves():
    """Every import of the scanned files resolves; reading them imports none of the heavy
    libraries (checked when this worker has not imported them already)."""
    files = scanned_files()
    assert len(files) > 100 and {path.parent.name for path in files} >= {"commands", "fsdp_harness", "scripts", "recipes"}
    not_yet = {name for name in HEAVY if name not in sys.modules}
    assert unresolved_imports(files) == []
    assert not_yet & set(sys.modules) == set()


def test_a_moved_name_a_missing_module_and_a_lazy_import_are_found(tmp_path):
    """The check can fail: a script importing a name its module does not define (at module level
    and inside a function), a module that does not exist, a submodule that does not exist."""
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "helper.py").write_text("from fsdp_presets.fileio import GiB\nVALUE = 1\n")
    (scripts / "lazy").mkdir()
    (scripts / "lazy" / "__init__.py").write_text(
        "def __getattr__(name):\n    raise AttributeError(name)\n__all__ = ['Made']\n")
    (scripts / "x.py").write_text(
        "import helper\n"
        "from helper import GiB, VALUE\n"  # both bound at helper's top level
        "from fsdp_presets.fileio import write_json_atomic\n"  # real
        "from lazy import Made\n"  # made by __getattr__, listed in __all__
        "from fsdp_presets.plan.report import no_such_name\n"
        "def later():\n"
        "    from fsdp_presets.preset.generate import generate_problems, moved_away\n"
        "    import fsdp_presets.no_such_module\n"
        "    from fsdp_presets.plan import no_such_submodule\n"
        "    import os.path, torch.distributed.checkpoint\n")
    found = unresolved_imports([scripts / "x.py"], root=tmp_path)
    assert found == ["scripts/x.py:5: fsdp_presets.plan.report has no no_such_name",
                     "scripts/x.py:7: fsdp_presets.preset.generate has no moved_away",
                     "scripts/x.py:8: no module fsdp_presets.no_such_module",
                     "scripts/x.py:9: fsdp_presets.plan has no no_such_submodule"]
