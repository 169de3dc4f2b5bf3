"""The documentation cannot rot: every command in a ```bash block of docs/*.md and README.md is
run or checked, printed output shown in the docs is what the tools print, and every
troubleshooting entry that `fsdp-presets check` detects is planted and seen.

How a block is checked is said in the Markdown, by a comment just before it::

    <!-- docs-test: run -->                      executed here, in a scratch copy of the repository
    <!-- docs-test: run output -->               ... and the next fenced block is its exact stdout
    <!-- docs-test: run exit=1 -->               ... and every command exits 1 (a divergence, a finding)
    <!-- docs-test: run output stderr exit=2 --> ... the next block is what it prints on stderr
    <!-- docs-test: run fixture=KIND:PATH -->    ... after placing a stand-in or a recorded run at
                                                 PATH (see FIXTURES)
    <!-- docs-test: static -->                   needs a cluster, a GPU or a long run: checked to be
                                                 well-formed without running it (see PROGRAMS)
    <!-- docs-test: plant rules=ID[,ID] [model=M] [drop=KEY] -->
                                                 (yaml blocks) merged into a clean config,
                                                 `fsdp-presets check` must report those rule ids

README.md is not annotated; README_BLOCKS below says how its blocks are checked. A ```bash block
without a mode, a command whose program is not in PROGRAMS, or a static-only program in a run
block fails the test: nothing is skipped silently.

Commands run in-process (``fsdp_presets.cli.main``) so that torch and transformers are imported
once; no test here launches processes (the recipes' launches are tested elsewhere).

    python tests/test_docs.py --update      # rewrite the output blocks from what the tools print now
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fsdp_harness.scripts import script_module

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"

# Folders a scratch copy holds (the commands read and write only these; runs/ starts empty).
COPIED = ("README.md", "docs", "accelerate_configs", "model_configs", "data", "recipes", "scripts")
# Where the documented commands may write: never over the shipped files.
OUTPUT_ROOTS = ("runs/", "docs/img/")
OUTPUT_OPTIONS = ("-o", "--output", "--output-dir", "--diagram", "--plot", "--report", "--launch-output",
                  "--baseline-output", "--cache")
# Repository paths a command names must exist (runs/ is what earlier steps or launches produce).
REPO_PREFIXES = ("model_configs/", "accelerate_configs/", "data/", "recipes/", "scripts/", "docs/", "tests/")
SHELL_UTILITIES = ("cat", "head", "tail", "ls", "wc", "grep")

README_BLOCKS = {
    # first command of the block: how it is checked
    "scripts/demo.sh": "static",
    "accelerate launch --config_file accelerate_configs/cpu_fsdp2_demo.yaml recipes/causal_lm.py --help": "static",
    "fsdp-presets plan model_configs/llama-3.1-70b --gpus 16,32,64,128 --gpu H100-SXM --activation-checkpointing on "
    "--seq-len 8192 --micro-batch 2 --tokens 10e9": "run",
}
"""README.md's ```bash blocks, by their first command (README carries no annotations)."""

ANNOTATION = re.compile(r"^<!--\s*docs-test:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^```(\S*)\s*$")


# --------------------------------------------------------------------------- reading the Markdown


@dataclasses.dataclass(kw_only=True)
class Block:
    """One fenced block and what its annotation asks."""

    doc: Path
    """The Markdown file."""
    line: int
    """1-based line of the opening fence."""
    language: str
    """``bash``, ``yaml``, ``text``, ``python``..."""
    text: str
    """The block's content."""
    annotation: str | None = None
    """The docs-test comment's text, when the block has one."""
    output: str | None = None
    """The content of the next fenced block (for ``output``)."""

    @property
    def where(self) -> str:
        name = self.doc.relative_to(REPO) if self.doc.is_relative_to(REPO) else self.doc
        return f"{name}:{self.line}"

    @property
    def words(self) -> list[str]:
        return (self.annotation or "").split()

    @property
    def mode(self) -> str | None:
        return self.words[0] if self.words else None

    @property
    def flags(self) -> set[str]:
        return {word for word in self.words[1:] if "=" not in word}

    def options(self, key: str) -> list[str]:
        return [word.split("=", 1)[1] for word in self.words[1:] if word.startswith(f"{key}=")]

    def commands(self) -> list[str]:
        """Shell commands: continuation lines joined, comments and blank lines dropped."""
        return shell_commands(self.text)


def read_blocks(doc: Path) -> list[Block]:
    """Every fenced block of ``doc`` with the annotation just before it (blank lines allowed)."""
    lines = doc.read_text().splitlines()
    blocks: list[Block] = []
    index = 0
    pending: str | None = None
    while index < len(lines):
        line = lines[index]
        if match := ANNOTATION.match(line.strip()):
            pending = match.group(1)
        elif match := FENCE.match(line):
            start, body = index, []
            index += 1
            while index < len(lines) and not lines[index].startswith("```"):
                body.append(lines[index])
                index += 1
            blocks.append(Block(doc=doc, line=start + 1, language=match.group(1), text="\n".join(body) + "\n",
                                annotation=pending))
            pending = None
        elif line.strip():
            pending = None  # an annotation belongs to the block right after it
        index += 1
    for block, following in zip(blocks, blocks[1:]):
        block.output = following.text
    return blocks


def shell_commands(text: str) -> list[str]:
    commands, current = [], ""
    for raw in text.splitlines():
        line = raw.rstrip()
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        words = shlex.split(current, comments=True)
        if words:
            commands.append(shlex.join(words))
        current = ""
    return commands


def documents() -> list[Path]:
    return [REPO / "README.md", *sorted(DOCS.glob("*.md"))]


def bash_blocks() -> list[Block]:
    return [block for doc in documents() for block in read_blocks(doc) if block.language in ("bash", "sh", "shell")]


def block_mode(block: Block) -> str:
    if block.doc.name == "README.md" and block.doc.parent == REPO:
        first = block.commands()[0]
        assert first in README_BLOCKS, f"{block.where}: README command {first!r} is not in README_BLOCKS"
        return README_BLOCKS[first]
    assert block.mode in ("run", "static"), (
        f"{block.where}: a ```bash block needs <!-- docs-test: run --> or <!-- docs-test: static --> before it")
    return block.mode


# --------------------------------------------------------------------------- a scratch repository


def scratch_copy(tmp_path: Path) -> Path:
    work = tmp_path / "repo"
    work.mkdir()
    for name in COPIED:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, work / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, work / name)
    (work / "runs").mkdir()
    return work


def _tiny_llama(work: Path, destination: str) -> None:
    from fsdp_harness.tiny_model import write_tiny_model

    write_tiny_model(work / destination, kind="llama-tied", text=(REPO / "data/kjv_sft/train.jsonl").read_text())


def _tiny_checkpoint(work: Path, destination: str) -> None:
    """A real DCP checkpoint with manifest (``fsdp-presets import`` of a tiny Llama)."""
    from fsdp_presets.checkpoint.import_hf import import_or_report

    model = f"runs/.fixtures/{destination.replace('/', '_')}"
    _tiny_llama(work, model)
    import_or_report(str(work / model), str(work / destination), verify=False, log=lambda message: None)


FIXTURES = {
    # kind: what is placed at PATH before the block runs
    "tiny-llama": _tiny_llama,  # a Llama folder (2 layers, hidden 64, tied) standing in for a real model
    "tiny-checkpoint": _tiny_checkpoint,  # a DCP checkpoint of it, standing in for a trained run's
    # examples/NAME: docs/examples/NAME, a recorded run (run.json, metrics.jsonl) of the doc's launch
}


def place_fixture(kind: str, work: Path, destination: str, where: str) -> None:
    if kind.startswith("examples/"):
        source = DOCS / kind
        assert source.is_dir() and ".." not in kind, f"{where}: no recorded run {source}"
        shutil.copytree(source, work / destination)
        return
    assert kind in FIXTURES, f"{where}: unknown fixture {kind!r}; known: {sorted(FIXTURES)} or examples/NAME"
    FIXTURES[kind](work, destination)


# --------------------------------------------------------------------------- the programs


def _check_paths(words: list[str], work: Path, where: str) -> None:
    """Outputs go under OUTPUT_ROOTS; repository files named as inputs exist."""
    writes = words[0] not in SHELL_UTILITIES  # grep -o, head -n: not output options
    for index, word in enumerate(words):
        if writes and index and words[index - 1] in OUTPUT_OPTIONS:
            assert word.startswith(OUTPUT_ROOTS) and ".." not in word, (
                f"{where}: {words[index - 1]} {word}: documented commands write under {' or '.join(OUTPUT_ROOTS)}")
            continue
        value = word.split("=", 1)[1] if word.startswith("--") and "=" in word else word
        if value.startswith(REPO_PREFIXES):
            assert (work / value).exists(), f"{where}: {value} does not exist"


def _parse_fsdp_presets(words: list[str], where: str):
    from fsdp_presets import cli

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as errors:
        try:
            return cli.build_parser().parse_args(words[1:])
        except SystemExit as exit_:
            assert exit_.code == 0, f"{where}: fsdp-presets refuses the arguments: {errors.getvalue().strip()}"
            return None


def run_fsdp_presets(words: list[str], work: Path, where: str) -> tuple[int, str, str]:
    from fsdp_presets import cli

    _parse_fsdp_presets(words, where)
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = cli.main(words[1:])
    return code, stdout.getvalue(), stderr.getvalue()


def static_fsdp_presets(words: list[str], work: Path, where: str) -> None:
    _parse_fsdp_presets(words, where)


def run_shell_utility(words: list[str], work: Path, where: str) -> tuple[int, str, str]:
    completed = subprocess.run(words, cwd=work, capture_output=True, text=True, timeout=30)
    return completed.returncode, completed.stdout, completed.stderr


def _parse_script_args(script: Path, args: list[str], where: str) -> None:
    """The script's own argument parser accepts ``args`` (its --help, if that is what they ask)."""
    module = script_module(script)
    saved = sys.argv
    has_parser = hasattr(module, "parse_args")
    # Without a separate parser main() parses: only its --help is safe to run (it exits before
    # doing anything), and it must name every flag the doc uses.
    sys.argv = [str(script), *args] if has_parser else [str(script), "--help"]
    printed, errors = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
            if has_parser:
                parameters = inspect.signature(module.parse_args).parameters
                module.parse_args(args) if parameters else module.parse_args()
            else:
                module.main()
                raise AssertionError(f"{where}: {script.name} --help did not exit: cannot check it without running")
    except SystemExit as exit_:
        assert exit_.code in (0, None), f"{where}: {script.name} refuses {args}: {errors.getvalue().strip()}"
    finally:
        sys.argv = saved
    if not has_parser:
        flags = {word.split("=", 1)[0] for word in args if word.startswith("--")}
        missing = sorted(flag for flag in flags if flag not in printed.getvalue())
        assert not missing, f"{where}: {script.name} has no {missing}"


def run_accelerate(words: list[str], work: Path, where: str) -> tuple[int, str, str]:
    """``accelerate merge-weights`` (one process, CPU); launches are never run here."""
    from accelerate.commands.merge import merge_command, merge_command_parser

    assert words[1:2] == ["merge-weights"], f"{where}: `accelerate {words[1]}` cannot run in a test; mark it static"
    from accelerate.state import PartialState

    stdout, stderr = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            merge_command(merge_command_parser().parse_args(words[2:]))
    finally:
        PartialState._reset_state()  # it made a (non-distributed) state: leave none behind
    return 0, stdout.getvalue(), stderr.getvalue()


def static_accelerate(words: list[str], work: Path, where: str) -> None:
    from accelerate.commands.launch import launch_command_parser

    from fsdp_presets.check.findings import CheckContext
    from fsdp_presets.check.lint import check_file

    assert words[1:2] == ["launch"], f"{where}: only `accelerate launch` is known here, not {words[:2]}"
    with contextlib.redirect_stderr(io.StringIO()) as errors:
        try:
            args = launch_command_parser().parse_args(words[2:])
        except SystemExit:
            raise AssertionError(f"{where}: accelerate launch refuses the arguments: {errors.getvalue()}") from None
    assert args.config_file, f"{where}: launch without --config_file"
    config = work / args.config_file
    assert config.is_file(), f"{where}: {args.config_file} does not exist at this point of the doc"
    report, _ = check_file(config, context=CheckContext())
    assert report.ok, f"{where}: fsdp-presets check finds errors in {args.config_file}: {report.to_json()}"
    script = work / args.training_script
    assert script.is_file(), f"{where}: {args.training_script} does not exist"
    _parse_script_args(REPO / args.training_script, args.training_script_args, where)


def static_python(words: list[str], work: Path, where: str) -> None:
    assert len(words) > 1 and words[1].startswith("scripts/") and words[1].endswith(".py"), (
        f"{where}: only `python scripts/NAME.py ...` is known here")
    assert (work / words[1]).is_file(), f"{where}: {words[1]} does not exist"
    _parse_script_args(REPO / words[1], words[2:], where)


def static_shell_script(words: list[str], work: Path, where: str) -> None:
    """``bash FILE``, ``sbatch FILE``, ``scripts/x.sh``: the file exists (at this point of the doc)
    and is valid bash."""
    script = words[1] if words[0] in ("bash", "sbatch") else words[0]
    path = work / script
    assert path.is_file(), f"{where}: {script} does not exist at this point of the doc"
    if words[0] not in ("bash", "sbatch"):
        assert os.access(REPO / script, os.X_OK), f"{where}: {script} is not executable"
    completed = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert completed.returncode == 0, f"{where}: bash -n {script}: {completed.stderr}"


PROGRAMS = {
    # program: (run in-process or here, check without running)
    "fsdp-presets": (run_fsdp_presets, static_fsdp_presets),
    # launch: parsed, config checked, script arguments parsed; merge-weights: run
    "accelerate": (run_accelerate, static_accelerate),
    "python": (None, static_python),  # long runs (demo, convergence check, rehearsal, model preparation)
    "bash": (None, static_shell_script),  # per-node launch scripts
    "sbatch": (None, static_shell_script),  # SLURM
    "script": (None, static_shell_script),  # scripts/*.sh: set up and run everything
    **{name: (run_shell_utility, None) for name in SHELL_UTILITIES},
}
"""How each program is run (``run`` blocks) or checked (``static`` blocks); None: not allowed."""


def split_command(command: str) -> tuple[dict[str, str], list[str], str]:
    """(environment assignments, words, PROGRAMS key)."""
    words = shlex.split(command)
    env = {}
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    program = words[0] if words else ""
    if program.startswith("scripts/") and program.endswith(".sh"):
        program = "script"
    return env, words, program


def execute_block(block: Block, work: Path, mode: str) -> tuple[list[int], str]:
    """Run or check every command of ``block`` in ``work`` (the cwd); (exit codes, what they
    printed: stdout, or stderr for blocks marked ``stderr``). Every command must exit as the
    block's ``exit=N`` says (default 0)."""
    expected = int((block.options("exit") or ["0"])[0])
    for fixture in block.options("fixture"):
        kind, _, destination = fixture.partition(":")
        assert destination.startswith("runs/"), f"{block.where}: fixtures go under runs/"
        if not (work / destination).exists():
            place_fixture(kind, work, destination, block.where)
    codes, printed = [], []
    commands = block.commands()
    assert commands, f"{block.where}: empty ```bash block"
    for command in commands:
        where = f"{block.where}: `{command}`"
        env, words, program = split_command(command)
        assert program in PROGRAMS, f"{where}: no check known for {program!r}: add it to PROGRAMS in tests/test_docs.py"
        runner, checker = PROGRAMS[program]
        _check_paths(words, work, where)
        if mode == "run":
            assert runner is not None, f"{where}: {program} cannot run in a test; mark the block static"
            code, stdout, stderr = runner(words, work, where)
            assert code == expected, f"{where}: exited {code}, expected {expected}: {stderr[-3000:]}"
            codes.append(code)
            printed.append(stderr if "stderr" in block.flags else stdout)
        else:
            assert checker is not None, f"{where}: {program} is only shown run; mark the block run"
            checker(words, work, where)
    return codes, "".join(printed)


def normalized(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


def run_document(doc: Path, tmp_path: Path, monkeypatch) -> dict[int, str]:
    """Every ```bash block of ``doc`` in order in one scratch copy; {line: stdout} of run blocks."""
    work = scratch_copy(tmp_path)
    monkeypatch.chdir(work)
    outputs = {}
    for block in read_blocks(doc):
        if block.language not in ("bash", "sh", "shell"):
            continue
        mode = block_mode(block)
        codes, stdout = execute_block(block, work, mode)
        if mode != "run":
            continue
        outputs[block.line] = stdout
        if "output" in block.flags:
            assert block.output is not None, f"{block.where}: `output` but no block follows"
            assert normalized(stdout) == normalized(block.output), (
                f"{block.where}: the output shown differs from what the commands print now "
                f"(python tests/test_docs.py --update):\n{stdout}")
    return outputs


# --------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("doc", [path.relative_to(REPO).as_posix() for path in documents()])
def test_every_command_runs_or_is_well_formed(doc, tmp_path, monkeypatch):
    run_document(REPO / doc, tmp_path, monkeypatch)


def test_every_bash_block_says_how_it_is_checked():
    blocks = bash_blocks()
    assert len(blocks) > 20, "the docs' commands were not found"
    for block in blocks:
        mode = block_mode(block)
        for command in block.commands():
            _, _, program = split_command(command)
            assert program in PROGRAMS, f"{block.where}: no check known for {program!r}"
            runner, checker = PROGRAMS[program]
            assert (runner if mode == "run" else checker) is not None, f"{block.where}: {program} cannot be {mode}"
        if "output" in block.flags:
            assert block.mode == "run", f"{block.where}: only run blocks can show output"


def test_the_harness_fails_on_what_it_does_not_know(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("<!-- docs-test: run -->\n```bash\nrm -rf runs\n```\n\n```bash\nfsdp-presets --help\n```\n")
    unknown, unannotated = read_blocks(doc)
    with pytest.raises(AssertionError, match="no check known for 'rm'"):
        execute_block(unknown, tmp_path, "run")
    with pytest.raises(AssertionError, match="needs <!-- docs-test"):
        block_mode(unannotated)
    with pytest.raises(AssertionError, match="cannot run in a test"):
        execute_block(Block(doc=doc, line=1, language="bash", text="accelerate launch x.py\n"), tmp_path, "run")
    with pytest.raises(AssertionError, match="cannot run in a test"):
        execute_block(Block(doc=doc, line=1, language="bash", text="python --version\n"), tmp_path, "run")
    with pytest.raises(AssertionError, match="write under"):
        execute_block(Block(doc=doc, line=1, language="bash",
                            text="fsdp-presets plan llama --gpus 2 --gpu-memory 80 --diagram x.png\n"), tmp_path, "run")
    with pytest.raises(AssertionError, match="refuses"):
        execute_block(Block(doc=doc, line=1, language="bash", text="fsdp-presets plan llama --gpu 2\n"), tmp_path,
                      "static")


def test_links_resolve():
    link = re.compile(r"\]\(([^)\s]+)\)")
    for doc in documents():
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for target in link.findall(text):
            if target.startswith(("http://", "https://", "mailto:", "#")):
                continue
            path = (doc.parent / target.split("#", 1)[0]).resolve()
            assert path.exists(), f"{doc.relative_to(REPO)}: link to {target} does not resolve"


DOCS_FROM_README = ("quickstart.md", "configuration.md", "sharding.md", "adapting.md", "runbook.md",
                    "troubleshooting.md", "observability.md", "recipes.md", "checkpoints.md", "convergence.md",
                    "multinode.md")


def test_readme_links_every_doc_and_keeps_its_two_commands():
    readme = (REPO / "README.md").read_text()
    for name in DOCS_FROM_README:
        assert f"(docs/{name})" in readme, f"README.md does not link docs/{name}"
    assert "scripts/demo.sh " in readme and "scripts/test.sh " in readme


def test_python_snippets_compile():
    for doc in documents():
        for block in read_blocks(doc):
            if block.language == "python":
                compile(block.text, block.where, "exec")


def _project_names(tree) -> list[tuple[str, str, int]]:
    """``(module, attribute, line)`` for every ``from fsdp_presets... import name`` and every
    ``alias.name`` where ``alias`` is a project module the block imported."""
    import ast

    modules, found = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fsdp_presets"):
            for alias in node.names:
                found.append((node.module, alias.name, node.lineno))
                modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("fsdp_presets"):
                    modules[alias.asname or alias.name] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            found.append((modules[node.value.id], node.attr, node.lineno))
    return found


def test_python_snippets_name_what_the_package_has():
    """Every project name a doc's Python block imports or calls through a module resolves: a doc
    that calls ``loop.param_groups`` where the package has ``numerics.param_groups`` fails here."""
    import importlib

    missing = []
    for doc in documents():
        for block in read_blocks(doc):
            if block.language != "python":
                continue
            for module_name, attribute, line in _project_names(compile(block.text, block.where, "exec", 0x400)):
                try:
                    module = importlib.import_module(module_name)
                except ImportError:
                    try:
                        module = importlib.import_module(module_name.rpartition(".")[0])
                        module = getattr(module, module_name.rpartition(".")[2])
                    except (ImportError, AttributeError):
                        missing.append(f"{block.where} (+{line}): no module {module_name}")
                        continue
                if not hasattr(module, attribute):
                    try:
                        importlib.import_module(f"{module_name}.{attribute}")
                    except ImportError:
                        missing.append(f"{block.where} (+{line}): {module_name} has no {attribute}")
    assert not missing, "\n".join(missing)


def _resolves(dotted: str) -> bool:
    """Whether ``fsdp_presets.a.b.c`` names a module or an attribute of one."""
    import importlib

    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            if attribute in getattr(found, "__dataclass_fields__", {}):
                return True  # a field without a default is no class attribute
            if not hasattr(found, attribute):
                return False
            found = getattr(found, attribute)
        return True
    return False


def test_package_names_in_docs_presets_and_docstrings_resolve():
    """Every ``fsdp_presets.x.y`` a doc, a shipped preset's header or the package's and the recipes'
    own text names exists: a header that says ``fsdp_presets.train.loop.param_groups`` where the
    package has ``fsdp_presets.numerics.param_groups`` fails here."""
    texts = [*documents(), REPO / "README.md", *sorted((REPO / "accelerate_configs").glob("*.yaml")),
             *sorted((REPO / "fsdp_presets").rglob("*.py")), *sorted((REPO / "recipes").glob("*.py"))]
    missing = set()
    for path in texts:
        text = re.sub(r"#\s*\n#\s*", "", path.read_text())  # a name a header wraps onto its next line
        for dotted in re.findall(r"\bfsdp_presets(?:\.[A-Za-z_]\w*)+", text):
            if not _resolves(dotted.rstrip(".")):
                missing.add(f"{path.relative_to(REPO)}: {dotted}")
    assert not missing, "\n".join(sorted(missing))


PROSE_FROM_OUTPUT = ("quickstart.md", "sharding.md")
"""Docs whose prose discusses the outputs they show: every measurement it quotes must be in them."""


def test_measurements_quoted_in_the_prose_are_in_the_outputs_shown():
    quoted_anywhere = 0
    for name in PROSE_FROM_OUTPUT:
        text = (DOCS / name).read_text()
        shown = "\n".join(block.output or "" for block in read_blocks(DOCS / name) if "output" in block.flags)
        prose = re.sub(r"```.*?```|<!--.*?-->|`[^`]*`", "", text, flags=re.S)
        quoted = re.findall(r"\b(\d+(?:\.\d+)?) ?(?:GiB|GB|MiB|MB|%)", prose)
        quoted_anywhere += len(quoted)
        missing = sorted({number for number in quoted if number not in shown})
        assert not missing, f"{name}: {missing} are quoted in the prose but not in any output block"
    assert quoted_anywhere, "no quoted measurement found: is the pattern still right?"


# --------------------------------------------------------------------------- configuration.md


def generated_keys() -> set[str]:
    """Every key `fsdp-presets generate` writes, over the layouts it decides between."""
    from fsdp_presets.preset.emit import accelerate_config, ddp_config
    from fsdp_presets.preset.request import PresetRequest
    from fsdp_presets.preset.presets import decide
    from fsdp_presets.model.profile import profile_model

    profile = profile_model("llama")
    keys: set[str] = set()
    for request in (dict(gpus=8), dict(gpus=8, fsdp_version=1), dict(gpus=16, nodes=2),
                    dict(gpus=16, nodes=2, fsdp_version=1), dict(gpus=2, device="cpu")):
        preset = decide(profile, PresetRequest(model="llama", **request))
        for config in (accelerate_config(preset), ddp_config(preset)):
            for key, value in config.items():
                keys.add(key)
                if isinstance(value, dict):
                    keys.update(value)
    return keys


def test_configuration_reference_documents_every_generated_key():
    text = (DOCS / "configuration.md").read_text()
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", text, flags=re.M))
    written = generated_keys()
    assert written - documented == set(), f"keys the generator writes but configuration.md lacks: {written - documented}"
    assert documented - written == set(), f"configuration.md documents keys the generator no longer writes: " \
                                          f"{documented - written}"


# --------------------------------------------------------------------------- observability.md


def test_observability_documents_every_metrics_field():
    text = (DOCS / "observability.md").read_text()
    recorded = REPO / "docs" / "examples" / "quickstart"
    fields = set()
    for run in ("fsdp2", "ddp"):
        for line in (recorded / run / "metrics.jsonl").read_text().splitlines():
            fields.update(json.loads(line))
    missing = [name for name in sorted(fields) if f"`{name}`" not in text]
    assert not missing, f"metrics.jsonl fields not explained in observability.md: {missing}"


# --------------------------------------------------------------------------- troubleshooting.md

TROUBLESHOOTING = DOCS / "troubleshooting.md"
TOPICS = (
    # the failures users report that the guide must cover: words its headings must contain
    "wrap class", "_no_split_modules", "SHARDED_STATE_DICT", "merge-weights", "tied embeddings",
    "use_orig_params", "dtype", "RAM", "gradient checkpointing", "HSDP", "stale",
)


def troubleshooting_entries() -> dict[str, str]:
    """``{heading: body}`` of each ``###`` entry."""
    entries: dict[str, str] = {}
    heading = None
    for line in TROUBLESHOOTING.read_text().splitlines():
        if line.startswith("### "):
            heading = line[4:].strip()
            entries[heading] = ""
        elif line.startswith("## "):
            heading = None
        elif heading:
            entries[heading] += line + "\n"
    return entries


def cited_rules(body: str) -> set[str]:
    """The rule ids in the entry's **Caught by:** paragraph (backquoted, with a hyphen)."""
    match = re.search(r"^\*\*Caught by:\*\*(.*?)(\n\n|\Z)", body, flags=re.M | re.S)
    assert match, "no **Caught by:** paragraph"
    return {name for name in re.findall(r"`([a-z0-9-]+)`", match.group(1))
            if "-" in name and not name.startswith("-") and name != "fsdp-presets"}


def test_troubleshooting_covers_the_reported_failures():
    headings = " | ".join(troubleshooting_entries()).lower()
    missing = [topic for topic in TOPICS if topic.lower() not in headings]
    assert not missing, f"troubleshooting.md has no entry for {missing}"


def test_troubleshooting_cites_real_rules_each_planted_in_test_check():
    from check_configs import BAD_CONFIGS

    from fsdp_presets.check.findings import RULES

    from test_check_probe import PLANTED_BY_THE_PROBE

    # test_check plants yaml-invalid in its own test (test_yaml_that_is_not_a_config), and
    # test_check_probe the rules of the wrapping probe.
    planted_there = {rule for _, rule, _, _, _ in BAD_CONFIGS.values()} | {"yaml-invalid"} | PLANTED_BY_THE_PROBE
    planted_here = {rule for block in read_blocks(TROUBLESHOOTING) if block.mode == "plant"
                    for rule in block.options("rules")[0].split(",")}
    for heading, body in troubleshooting_entries().items():
        rules = cited_rules(body)
        unknown = rules - set(RULES)
        assert not unknown, f"{heading}: {unknown} are not rule ids (fsdp-presets check --list-rules)"
        for rule in rules & set(RULES):
            assert rule in planted_there, f"{heading}: {rule} has no planted error in tests/test_check.py"
            assert rule in planted_here, f"{heading}: {rule} has no plant block in troubleshooting.md"


def plant_blocks() -> list[Block]:
    if not TROUBLESHOOTING.is_file():
        return []
    return [block for block in read_blocks(TROUBLESHOOTING) if block.mode == "plant"]


@pytest.mark.parametrize("line", [block.line for block in plant_blocks()])
def test_troubleshooting_example_is_caught_by_its_rule(line, tmp_path):
    """The bad config the guide shows, merged into the clean preset of tests/check_configs.py,
    makes `fsdp-presets check` report the rule the guide names (and the clean one does not)."""
    from check_configs import GOOD, facts

    from fsdp_presets.check.findings import CheckContext
    from fsdp_presets.check.lint import check_file

    block = next(block for block in plant_blocks() if block.line == line)
    assert block.language == "yaml", f"{block.where}: plant blocks are yaml"
    rules = block.options("rules")[0].split(",")
    model = (block.options("model") or [None])[0]
    settings = {key: (value if not re.fullmatch(r"[0-9.]+", value) else int(value) if value.isdigit() else float(value))
                for option in block.options("context") for key, value in [option.split(":", 1)]}
    settings = {key: {"true": True, "false": False}.get(value, value) if isinstance(value, str) else value
                for key, value in settings.items()}
    if "script" in settings:  # a training script of tests/check_configs.py (check --script reads it statically)
        import check_configs

        settings["script"] = getattr(check_configs, settings["script"])
    try:
        fragment = yaml.safe_load(block.text)
    except yaml.YAMLError:
        fragment = None
    planted = tmp_path / "planted.yaml"
    if isinstance(fragment, dict):
        config = copy.deepcopy(GOOD)
        for key, value in fragment.items():
            if isinstance(value, dict) and isinstance(config.get(key), dict):
                config[key].update(value)
            else:
                config[key] = value
        for key in block.options("drop"):
            config.get("fsdp_config", {}).pop(key, None)
            config.pop(key, None)
        # a generated preset's header line (``# fsdp-presets: {...}``) stays with the planted file
        header = "".join(line + "\n" for line in block.text.splitlines() if line.startswith("# fsdp-presets:"))
        planted.write_text(header + yaml.safe_dump(config, sort_keys=False))
    else:
        planted.write_text(block.text)  # not a mapping (or not YAML): the file as shown
    context = CheckContext(model=facts(model), **settings)
    clean = tmp_path / "clean.yaml"
    clean.write_text(yaml.safe_dump(GOOD, sort_keys=False))
    probe = bool(block.options("probe"))  # rules that need accelerate's preparation of the model
    assert not set(rules) & check_file(clean, context=context, prove_wrapping=probe)[0].rules(), \
        "the clean config already has it"
    found = check_file(planted, context=context, prove_wrapping=probe)[0].rules()
    assert set(rules) <= found, f"{block.where}: planted {rules}, check reports {sorted(found)}"


# --------------------------------------------------------------------------- updating the docs


def update_outputs() -> None:
    """Rewrite the block after every ``run output`` block with what its commands print now."""
    import tempfile

    for doc in documents()[1:]:
        blocks = read_blocks(doc)
        if not any("output" in block.flags for block in blocks):
            continue
        with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as monkeypatch:
            printed = {}
            work = scratch_copy(Path(tmp))
            monkeypatch.chdir(work)
            for block in blocks:
                if block.language in ("bash", "sh", "shell"):
                    mode = block_mode(block)
                    _, stdout = execute_block(block, work, mode)
                    if "output" in block.flags:
                        printed[block.line] = stdout
            for block in blocks:  # the images a doc draws (plan --diagram) go to the real docs/img
                for command in block.commands() if block.language == "bash" else []:
                    words = shlex.split(command)
                    if "--diagram" in words:
                        target = words[words.index("--diagram") + 1]
                        (REPO / target).parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(work / target, REPO / target)
        lines = doc.read_text().splitlines()
        for block in sorted((b for b in blocks if b.line in printed), key=lambda b: -b.line):
            start = next(i for i in range(block.line, len(lines)) if lines[i].startswith("```") and i > block.line - 1)
            output_start = next(i for i in range(start + 1, len(lines)) if FENCE.match(lines[i]))
            output_end = next(i for i in range(output_start + 1, len(lines)) if lines[i].startswith("```"))
            lines[output_start + 1:output_end] = normalized(printed[block.line]).splitlines()
        doc.write_text("\n".join(lines) + "\n")
        print(f"updated {doc.relative_to(REPO)}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        raise SystemExit(__doc__)
    update_outputs()
