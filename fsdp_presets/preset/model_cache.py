"""The on-disk cache of what planning a model learns about it, so that planning the same model
again imports neither torch nor transformers::

    profile = load_profile("model_configs/llama-3.1-70b")   # fsdp_presets.preset.generate: reads profiles/ first

Where: ``$FSDP_PRESETS_CACHE`` when set, else ``$XDG_CACHE_HOME/fsdp-presets``, else
``~/.cache/fsdp-presets``; ``FSDP_PRESETS_CACHE=off`` turns it off. What:

- ``profiles/KEY.json``: a model folder's or config.json's :class:`ModelProfile` (building the
  model on the meta device takes seconds; reading it back milliseconds) and the digest of its
  config as transformers reads it (:func:`block_config_digest`, which keys the activation terms), keyed
  by the bytes of the config.json, the torch, transformers and fsdp-presets versions and
  :data:`PROFILE_FORMAT`. Family names (tiny debug configs) and ``--trust-remote-code`` models
  (their code may change beside an unchanged config) are not cached.
- ``activations/KEY.json``: the model's own activation terms
  (:mod:`fsdp_presets.preset.measured_activations`).

Every file is small JSON, written atomically; a file that cannot be read or is of another format
is ignored (the entry is made again). Deleting the folder clears the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from fsdp_presets import environment

CACHE_ENV = environment.CACHE.name
"""Where the cache lives (a folder), or ``off``."""
PROFILE_FORMAT = 3
"""Bumped when what :func:`fsdp_presets.model.profile.profile_module` reads off a model changes
(older profile entries are then ignored)."""
_VERSIONED = ("torch", "transformers", "fsdp-presets")


def cache_dir() -> Path | None:
    """The cache folder, or None when ``FSDP_PRESETS_CACHE=off``."""
    chosen = os.environ.get(CACHE_ENV, "").strip()
    if chosen.lower() == "off":
        return None
    if chosen:
        return Path(chosen).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or str(Path.home() / ".cache")
    return Path(base) / "fsdp-presets"


def cache_problem(folder: Path) -> str | None:
    """Why nothing can be cached in ``folder`` (not a folder, cannot be made or written), or None.
    Planning still works without a cache; it only rehearses again each time."""
    where = folder
    while not where.exists() and where != where.parent:
        where = where.parent  # the nearest existing ancestor is where the folder would be made
    if where == folder and not folder.is_dir():
        return f"{folder} is not a folder"
    if where != folder and not where.is_dir():
        return f"{folder} cannot be made: {where} is not a folder"
    if not os.access(where, os.W_OK | os.X_OK):
        return f"{where} is not writable"
    return None


def describe_cache() -> str:
    """``cache: FOLDER`` for a plan's note, with why nothing is cached when the folder cannot hold it."""
    folder = cache_dir()
    if folder is None:
        return f"cache: off ({CACHE_ENV}=off)"
    problem = cache_problem(folder)
    if problem is None:
        return f"cache: {folder}"
    return f"cache: none, {problem}, so every plan rehearses again: set {CACHE_ENV} to a writable folder, or off"


def library_versions() -> dict[str, str]:
    """The installed versions an entry depends on, read from package metadata (no import)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in _VERSIONED:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "unknown"
    return found


def block_config_digest(config) -> str:
    """Digest of a transformers config as it builds the model, its layer count aside (terms are
    per block): what the activation terms are keyed by."""
    described = {key: value for key, value in config.to_dict().items()
                 if key not in ("num_hidden_layers", "_name_or_path", "transformers_version", "layer_types")}
    text = json.dumps(described, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def read_entry(path: Path, *, format_: int) -> dict | None:
    """The JSON object at ``path`` when it is of ``format_``, else None (unreadable, another format)."""
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return entry if isinstance(entry, dict) and entry.get("format") == format_ else None


def write_entry(path: Path, entry: dict) -> None:
    """Write ``entry`` atomically; a read-only cache is not an error (the next plan measures again)."""
    from fsdp_presets.fileio import write_json_atomic

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, entry)
    except OSError:
        pass


def _profile_path(source: str, *, trust_remote_code: bool) -> Path | None:
    """Where ``source``'s profile is cached, or None when it is not cached (cache off, a family
    name, remote code, no readable config.json)."""
    from fsdp_presets.fileio import CONFIG_MAX_BYTES, read_regular_bytes

    folder = cache_dir()
    if folder is None or trust_remote_code:
        return None
    path = Path(source).expanduser()
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        return None
    try:
        data = read_regular_bytes(config_file, limit=CONFIG_MAX_BYTES)
    except OSError:
        return None
    text = json.dumps({"config": hashlib.sha256(data).hexdigest(), "format": PROFILE_FORMAT,
                       **library_versions()}, sort_keys=True)
    return folder / "profiles" / f"{hashlib.sha256(text.encode('utf-8')).hexdigest()[:32]}.json"


def cached_profile(source: str, *, trust_remote_code: bool = False):
    """``(profile, config digest)`` of ``source`` from the cache, or ``(None, None)``."""
    from fsdp_presets.model.model_profile import profile_from_json

    path = _profile_path(source, trust_remote_code=trust_remote_code)
    entry = read_entry(path, format_=PROFILE_FORMAT) if path is not None else None
    if entry is None:
        return None, None
    try:
        return profile_from_json(entry["profile"]), str(entry["config_digest"])
    except (KeyError, TypeError, ValueError):
        return None, None


def store_profile(source: str, profile, config, *, trust_remote_code: bool = False) -> None:
    """Cache ``source``'s profile and its config's digest (where :func:`cached_profile` reads them)."""
    path = _profile_path(source, trust_remote_code=trust_remote_code)
    if path is not None:
        write_entry(path, {"format": PROFILE_FORMAT, "profile": profile.to_json(),
                           "config_digest": block_config_digest(config)})


__all__ = ["CACHE_ENV", "PROFILE_FORMAT", "cache_dir", "cached_profile", "block_config_digest", "library_versions",
           "read_entry", "store_profile", "write_entry"]
