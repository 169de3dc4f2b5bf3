"""The registry of environment variables (fsdp_presets/environment.py): every ``FSDP_PRESETS_*`` name the
package, its recipes and scripts spell is in it, and docs/configuration.md shows it as it is."""

from __future__ import annotations

import re
from pathlib import Path

from fsdp_presets import environment

REPO = Path(__file__).resolve().parent.parent
READ_FROM = ("fsdp_presets", "recipes", "scripts", "harness/fsdp_harness")


def _spelled() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for top in READ_FROM:
        for path in sorted((REPO / top).rglob("*")):
            if path.suffix not in (".py", ".sh", ".sbatch") or "__pycache__" in path.parts:
                continue
            for name in re.findall(r"FSDP_PRESETS_[A-Z0-9_]*[A-Z0-9]", path.read_text()):
                found.setdefault(name, set()).add(str(path.relative_to(REPO)))
    return found


def test_every_variable_the_code_names_is_registered_and_every_registered_one_is_read():
    registered = {variable.name for variable in environment.VARIABLES}
    spelled = _spelled()
    unknown = {name: sorted(where) for name, where in spelled.items() if name not in registered}
    assert not unknown, f"add these to fsdp_presets/environment.py: {unknown}"
    assert not registered - set(spelled), f"registered but read nowhere: {sorted(registered - set(spelled))}"
    assert len(registered) == len(environment.VARIABLES), "a name is registered twice"


def test_the_configuration_reference_shows_the_registry():
    text = (REPO / "docs" / "configuration.md").read_text()
    shown = text.split("<!-- environment:start -->\n", 1)[1].split("<!-- environment:end -->", 1)[0]
    assert shown == environment.markdown_table(), "docs/configuration.md's table differs from the registry"


def test_prepared_models_and_the_planner_cache_are_two_variables(monkeypatch, tmp_path):
    from fsdp_presets.checkpoint.pretrained import default_cache
    from fsdp_presets.preset.model_cache import cache_dir

    monkeypatch.setenv(environment.CACHE.name, "off")
    monkeypatch.delenv(environment.MODELS.name, raising=False)
    assert cache_dir() is None and default_cache(tmp_path) == tmp_path / "runs" / "models"
    monkeypatch.setenv(environment.MODELS.name, str(tmp_path / "models"))
    assert default_cache(tmp_path) == tmp_path / "models" and cache_dir() is None
