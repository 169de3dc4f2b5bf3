"""Where the planner's cache lives, and a cache path that cannot hold it said plainly: planning still
works, but every plan rehearses again, so the note names the path and the fix."""

from __future__ import annotations

import pytest

from fsdp_presets.preset.model_cache import cache_dir, describe_cache


def test_a_writable_folder_is_the_cache_and_off_turns_it_off(tmp_path, monkeypatch):
    monkeypatch.setenv("FSDP_PRESETS_CACHE", str(tmp_path / "not-yet-made"))
    assert cache_dir() == tmp_path / "not-yet-made"
    assert describe_cache() == f"cache: {tmp_path / 'not-yet-made'}"  # made at the first write
    monkeypatch.setenv("FSDP_PRESETS_CACHE", "off")
    assert cache_dir() is None and describe_cache() == "cache: off (FSDP_PRESETS_CACHE=off)"


@pytest.mark.parametrize("where, problem", [
    ("/dev/null", "/dev/null is not a folder"),
    ("FILE", "is not a folder"),
    ("FILE/below", "cannot be made"),
])
def test_a_path_that_cannot_hold_the_cache_is_named_with_the_fix(tmp_path, monkeypatch, where, problem):
    (tmp_path / "FILE").write_text("a file, not a folder")
    path = where if where.startswith("/") else str(tmp_path / where)
    monkeypatch.setenv("FSDP_PRESETS_CACHE", path)
    note = describe_cache()
    assert problem in note and "every plan rehearses again" in note
    assert "set FSDP_PRESETS_CACHE to a writable folder, or off" in note

