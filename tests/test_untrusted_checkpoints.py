"""Checkpoints, exports and imports as an attacker or a careless user makes them.

The attacker controls the whole folder, manifest included: every booby-trapped copy gets a
manifest recomputed to match it. A trapped pickle runs ``touch MARKER`` when loaded; the tests
first show that the payload really fires with torch's own readers, then that no command of the
project (``inspect-checkpoint``, ``export``, the recipes' ``--resume PATH`` and ``--resume auto``)
ever lets it run, and that each refuses with a message naming the file. Then: paths out of the
checkpoint, symbolic links, unlisted files, malformed manifests, a dropped random state, outputs
that exist, a finished run relaunched with other settings, an FSDP checkpoint under one process.
"""

from __future__ import annotations

import hashlib
import inspect
import io
import json
import os
import pickle
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import checkpoint_runs as runs
from conftest import accelerate_config
import recipe_helpers
from recipe_helpers import CAUSAL_LM, REPO, causal_lm_args, drive_recipe, file_size_limit, recipe_error, tree_digest
from test_checkpoint import manager
from fsdp_presets import cli
from fsdp_presets.checkpoint.layout import MANIFEST
from fsdp_presets.checkpoint.verify import checkpoint_verdict
from fsdp_presets.checkpoint.layout import DCP_METADATA, DCP_MODEL, DCP_OPTIMIZER
from fsdp_presets.errors import UsageError
from fsdp_presets.checkpoint.safe_unpickle import UnsafeCheckpointError, read_dcp_metadata, safe_dcp_loading
from fsdp_harness.launch import run_launch

STEPS = runs.REFERENCE_STEPS


class Payload:
    """Pickled, it is a call of ``os.system("touch MARKER")``: what an attacker puts in a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


# ---- how the attacker builds a folder ----
def recompute_manifest(folder: Path) -> None:
    """What an attacker does after changing files: list and hash every file again (a link is
    hashed as what it points to), so that every checksum matches."""
    manifest = json.loads((folder / MANIFEST).read_text())
    files = {}
    for directory, _, names in os.walk(folder):
        for name in names:
            path = Path(directory) / name
            relative = str(path.relative_to(folder))
            if relative != MANIFEST:
                data = path.read_bytes()
                files[relative] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    manifest["files"] = files
    (folder / MANIFEST).write_text(json.dumps(manifest))


def trap_metadata(checkpoint: Path, marker: Path) -> Path:
    """The model's DCP index replaced by the payload."""
    target = checkpoint / DCP_MODEL / DCP_METADATA
    target.write_bytes(pickle.dumps(Payload(marker)))
    return target


def trap_bytes_item(checkpoint: Path, marker: Path) -> Path:
    """One non-tensor optimizer item (a param-group value) pointed at a ``torch.save`` of the
    payload appended to its shard file, and the (otherwise genuine) index rewritten to say so."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    folder = checkpoint / DCP_OPTIMIZER
    metadata = read_dcp_metadata(folder)
    fqn = next(name for name, item in metadata.state_dict_metadata.items() if isinstance(item, BytesStorageMetadata))
    index = next(index for index in metadata.storage_data if index.fqn == fqn)
    shard = folder / metadata.storage_data[index].relative_path
    payload = io.BytesIO()
    torch.save(Payload(marker), payload)
    offset = shard.stat().st_size
    with open(shard, "ab") as handle:
        handle.write(payload.getvalue())
    metadata.storage_data[index] = _StorageInfo(relative_path=shard.name, offset=offset, length=len(payload.getvalue()))
    (folder / DCP_METADATA).write_bytes(pickle.dumps(metadata))
    return shard


def trap_random_state(checkpoint: Path, marker: Path) -> Path:
    target = checkpoint / "random_states_1.pkl"
    torch.save({"random_state": Payload(marker)}, target)
    return target


TRAPS = {"metadata": trap_metadata, "bytes-item": trap_bytes_item, "random-state": trap_random_state}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """FSDP2 x2, tiny Llama, 10 steps, a checkpoint every 2 (shared with the other checkpoint tests)."""
    return runs.reference_run(runs.base(tmp_path_factory))


@pytest.fixture
def checkpoint(reference, tmp_path) -> Path:
    """A private copy of the last checkpoint, ready to be tampered with."""
    copy = tmp_path / "given" / "step-00000010"
    shutil.copytree(recipe_helpers.checkpoint(reference, STEPS), copy)
    return copy


def trapped(checkpoint: Path, kind: str, manifest: str, marker: Path) -> Path:
    path = TRAPS[kind](checkpoint, marker)
    if manifest == "recomputed":
        recompute_manifest(checkpoint)
    else:
        (checkpoint / MANIFEST).unlink()
    return path


# ---- the payloads are real ----
def test_the_payloads_fire_with_torchs_own_readers(checkpoint, tmp_path):
    import torch.distributed.checkpoint as dcp

    markers = [tmp_path / f"fired-{kind}" for kind in TRAPS]
    trap_metadata(checkpoint, markers[0])
    with pytest.raises(Exception):
        dcp.FileSystemReader(str(checkpoint / DCP_MODEL)).read_metadata()  # runs it, then fails on the result
    shard = trap_bytes_item(checkpoint, markers[1])
    metadata = read_dcp_metadata(checkpoint / DCP_OPTIMIZER)
    info = max(metadata.storage_data.values(), key=lambda item: item.offset if item.relative_path == shard.name else -1)
    data = shard.read_bytes()[info.offset:info.offset + info.length]
    torch.load(io.BytesIO(data), weights_only=False)  # what torch's DefaultLoadPlanner.load_bytes does
    pickle.loads(pickle.dumps({"random_state": Payload(markers[2])}))
    assert all(marker.exists() for marker in markers)


# ---- inspect-checkpoint and export refuse, and nothing runs ----
@pytest.mark.parametrize("manifest", ["recomputed", "absent"])
@pytest.mark.parametrize("kind", list(TRAPS))
def test_inspect_and_export_refuse_a_trapped_checkpoint_and_run_nothing(checkpoint, tmp_path, capsys, kind, manifest):
    marker = tmp_path / "PWNED"
    trap = trapped(checkpoint, kind, manifest, marker)
    assert cli.main(["inspect-checkpoint", str(checkpoint), "--gpus", "2"]) == 1
    shown = capsys.readouterr().out
    assert "integrity   REFUSED" in shown and f"{trap}: " in shown and "nothing in it ran" in shown, shown
    assert "resume at 2 GPU(s): no" in shown
    output = tmp_path / "hf"
    assert cli.main(["export", str(checkpoint), "--output", str(output)]) == 2
    error = capsys.readouterr().err
    assert f"{trap}: " in error and ": refused: " in error and "Traceback" not in error, error
    assert not output.exists() and not marker.exists()


def test_the_safe_reader_and_planner_are_what_accelerate_gets(checkpoint, tmp_path):
    """accelerate's load_state builds torch's FileSystemReader and DefaultLoadPlanner itself; inside
    safe_dcp_loading those names are the safe classes, and they refuse the payloads."""
    import accelerate.utils.fsdp_utils as fsdp_utils
    import torch.distributed.checkpoint as dcp

    for function in (fsdp_utils.load_fsdp_model, fsdp_utils.load_fsdp_optimizer):
        source = inspect.getsource(function)  # looked up at call time: what the swap relies on
        assert "dist_cp.FileSystemReader(" in source and "import DefaultLoadPlanner" in source
    marker = tmp_path / "PWNED"
    trap_metadata(checkpoint, marker)
    with safe_dcp_loading():
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        with pytest.raises(UnsafeCheckpointError, match="posix.system|os.system"):
            dcp.FileSystemReader(str(checkpoint / DCP_MODEL)).read_metadata()
        from torch.distributed.checkpoint.metadata import MetadataIndex
        from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

        payload = io.BytesIO()
        torch.save(Payload(marker), payload)
        payload.seek(0)
        where = MetadataIndex("optimizer.param_groups.0.lr")
        item = ReadItem(type=LoadItemType.BYTE_IO, dest_index=where, dest_offsets=torch.Size([0]),
                        storage_index=where, storage_offsets=torch.Size([0]), lengths=torch.Size([0]))
        with pytest.raises(UnsafeCheckpointError, match="weights_only.*unsupported GLOBAL posix.system"):
            DefaultLoadPlanner().load_bytes(item, payload)
    assert dcp.FileSystemReader.__name__ == "FileSystemReader"  # restored
    assert not marker.exists()


# ---- closed folders ----
@pytest.mark.parametrize("entry", ["../../../../etc/passwd", "/etc/passwd", "model_config/../../run.json"])
def test_a_manifest_path_out_of_the_checkpoint_is_refused(checkpoint, capsys, entry):
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    outside = Path("/etc/passwd").read_bytes()
    manifest["files"][entry] = {"sha256": hashlib.sha256(outside).hexdigest(), "bytes": len(outside)}
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))
    assert "a path outside the checkpoint folder" in checkpoint_verdict(checkpoint).problem
    assert cli.main(["inspect-checkpoint", str(checkpoint), "--gpus", "1"]) == 1
    shown = capsys.readouterr().out
    assert "DAMAGED" in shown and "resume at 1 GPU(s): no" in shown


@pytest.mark.parametrize("manifest", ["recomputed", "absent"])
@pytest.mark.parametrize("link", ["file", "folder"])
def test_a_symlink_out_of_the_checkpoint_is_refused_and_never_exported(checkpoint, tmp_path, capsys, link, manifest):
    secret = tmp_path / "outside" / "tokenizer.json"
    secret.parent.mkdir()
    shutil.copy(checkpoint / "model_config" / "tokenizer.json", secret)  # valid: an export would take it
    if link == "file":
        (checkpoint / "model_config" / "tokenizer.json").unlink()
        (checkpoint / "model_config" / "tokenizer.json").symlink_to(secret)
    else:
        for name in os.listdir(checkpoint / "model_config"):
            if name != "tokenizer.json":
                shutil.copy(checkpoint / "model_config" / name, secret.parent / name)
        shutil.rmtree(checkpoint / "model_config")
        (checkpoint / "model_config").symlink_to(secret.parent, target_is_directory=True)
    if manifest == "recomputed":
        recompute_manifest(checkpoint)
    else:
        (checkpoint / MANIFEST).unlink()
    assert cli.main(["inspect-checkpoint", str(checkpoint)]) == 1
    assert "is a symbolic link" in capsys.readouterr().out
    output = tmp_path / "hf"
    assert cli.main(["export", str(checkpoint), "--output", str(output)]) == 2
    assert "is a symbolic link" in capsys.readouterr().err
    assert not output.exists()


def test_an_export_holds_only_files_it_wrote(checkpoint, tmp_path, capsys):
    output = tmp_path / "hf"
    assert cli.main(["export", str(checkpoint), "--output", str(output)]) == 0
    written = sorted(path.name for path in output.iterdir())
    assert all(not path.is_symlink() and path.is_file() for path in output.iterdir())
    assert written == ["config.json", "fsdp_presets_export.json", "generation_config.json", "model.safetensors",
                       "tokenizer.json", "tokenizer_config.json"], written


def plant_code_references(checkpoint: Path) -> None:
    """An attacker's tokenizer code in model_config/, and auto_map entries naming it."""
    config_dir = checkpoint / "model_config"
    (config_dir / "tokenization_evil.py").write_text("import os; os.system('touch pwned')\n")
    for name, entry in (("config.json", {"AutoModelForCausalLM": "tokenization_evil.Evil"}),
                        ("tokenizer_config.json", {"AutoTokenizer": ["tokenization_evil.Evil", None]})):
        document = json.loads((config_dir / name).read_text())
        (config_dir / name).write_text(json.dumps({**document, "auto_map": entry}))
    from transformers import AutoConfig

    from fsdp_presets.fileio import config_digest

    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest["config_digest"] = config_digest(AutoConfig.from_pretrained(config_dir))  # the attacker's too
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))
    recompute_manifest(checkpoint)


def test_an_export_drops_code_references_unless_asked_and_never_copies_code(checkpoint, tmp_path, capsys):
    plant_code_references(checkpoint)
    output, kept = tmp_path / "hf", tmp_path / "kept"
    assert cli.main(["export", str(checkpoint), "--output", str(output)]) == 0
    said = capsys.readouterr().out
    assert "dropped auto_map from config.json" in said and "--keep-code-references keeps it" in said
    assert not list(output.glob("*.py"))
    for name in ("config.json", "tokenizer_config.json"):
        assert "auto_map" not in json.loads((output / name).read_text()), name
    assert cli.main(["export", str(checkpoint), "--output", str(kept), "--keep-code-references"]) == 0
    assert "auto_map" in json.loads((kept / "config.json").read_text()) and not list(kept.glob("*.py"))


def test_code_references_are_dropped_from_a_file_of_any_size(checkpoint, tmp_path, capsys):
    """A tokenizer_config.json padded past the 16 MiB of a config still has its auto_map dropped."""
    from fsdp_presets.fileio import CONFIG_MAX_BYTES

    plant_code_references(checkpoint)
    padded = checkpoint / "model_config" / "tokenizer_config.json"
    padded.write_text(json.dumps({**json.loads(padded.read_text()), "note": "x" * (CONFIG_MAX_BYTES + 1)}))
    recompute_manifest(checkpoint)
    output = tmp_path / "hf"
    assert cli.main(["export", str(checkpoint), "--output", str(output)]) == 0
    assert "dropped auto_map from tokenizer_config.json" in capsys.readouterr().out
    assert (output / "tokenizer_config.json").stat().st_size > CONFIG_MAX_BYTES
    assert not [path.name for path in output.glob("*.json") if b"auto_map" in path.read_bytes()]


def test_a_model_text_file_past_its_limit_is_refused_before_transformers_reads_it(checkpoint, tmp_path, capsys):
    """A sparse tokenizer.json of 256 MiB + 1 (a few bytes on disk; at 20 GB, reading it took all of
    memory): import and export refuse it by its size, in one line, and write nothing."""
    from fsdp_presets.fileio import MODEL_FILE_MAX_BYTES, sha256_file

    exported = tmp_path / "hf"
    assert cli.main(["export", str(checkpoint), "--output", str(exported)]) == 0
    for folder in (exported, checkpoint / "model_config"):
        with open(folder / "tokenizer.json", "r+b") as handle:
            handle.truncate(MODEL_FILE_MAX_BYTES + 1)
    manifest = json.loads((checkpoint / MANIFEST).read_text())  # the attacker's manifest matches it
    sparse = checkpoint / "model_config" / "tokenizer.json"
    manifest["files"]["model_config/tokenizer.json"] = {"sha256": sha256_file(sparse), "bytes": MODEL_FILE_MAX_BYTES + 1}
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))
    capsys.readouterr()
    for argv, output in ((["import", str(exported)], tmp_path / "start"),
                         (["export", str(checkpoint)], tmp_path / "again")):
        assert cli.main([*argv, "--output", str(output)]) == 2
        error = capsys.readouterr().err.strip()
        assert "tokenizer.json holds 256.0 MiB, more than the 256.0 MiB a model folder's text files" in error
        assert len(error.splitlines()) == 1 and not output.exists(), error


def test_export_force_never_replaces_a_model_folder_that_looks_like_an_export(checkpoint, tmp_path, capsys):
    exported = tmp_path / "hf"
    assert cli.main(["export", str(checkpoint), "--output", str(exported)]) == 0
    users = tmp_path / "base-model"  # a user's model folder: config, weights, a README
    users.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(exported / name, users / name)
    (users / "README.md").write_text("my notes")
    before = tree_digest(users)
    capsys.readouterr()
    assert cli.main(["export", str(checkpoint), "--output", str(users), "--force"]) == 2
    error = capsys.readouterr().err
    assert "was not written by fsdp-presets export" in error and "holds an export" not in error, error
    assert tree_digest(users) == before
    (exported / "README.md").write_text("added by hand")  # an export the user added to is theirs now
    assert cli.main(["export", str(checkpoint), "--output", str(exported), "--force"]) == 2
    assert (exported / "README.md").read_text() == "added by hand"


def test_import_refuses_a_link_out_of_the_model_folder_and_follows_a_cache_layout(checkpoint, tmp_path, capsys):
    exported = tmp_path / "hf"
    assert cli.main(["export", str(checkpoint), "--output", str(exported)]) == 0
    secret = tmp_path / "secret.txt"
    secret.write_text("password")
    (exported / "chat_template.jinja").symlink_to(secret)
    capsys.readouterr()
    assert cli.main(["import", str(exported), "--output", str(tmp_path / "start")]) == 2
    error = capsys.readouterr().err
    assert f"{exported / 'chat_template.jinja'} is a symbolic link to {secret}" in error
    assert len(error.strip().splitlines()) == 1 and not (tmp_path / "start").exists()
    (exported / "chat_template.jinja").unlink()
    (exported / "config.json").rename(tmp_path / "config.json")
    (exported / "config.json").symlink_to("/dev/zero")  # named as the link it is, never read
    assert cli.main(["import", str(exported), "--output", str(tmp_path / "start")]) == 2
    assert "config.json is a symbolic link to /dev/zero" in capsys.readouterr().err
    (exported / "config.json").unlink()
    (tmp_path / "config.json").rename(exported / "config.json")
    # a Hugging Face cache: snapshots/REV/name -> ../../blobs/HASH of the same cache
    cache = tmp_path / "hub" / "models--org--tiny"
    (cache / "blobs").mkdir(parents=True)
    snapshot = cache / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for path in exported.iterdir():
        blob = cache / "blobs" / hashlib.sha256(path.name.encode()).hexdigest()
        shutil.copyfile(path, blob)
        (snapshot / path.name).symlink_to(Path("../../blobs") / blob.name)
    assert cli.main(["import", str(snapshot), "--output", str(tmp_path / "from-cache")]) == 0


def test_import_of_a_truncated_config_is_one_line(checkpoint, tmp_path, capsys):
    exported = tmp_path / "hf"
    assert cli.main(["export", str(checkpoint), "--output", str(exported)]) == 0
    (exported / "config.json").write_text((exported / "config.json").read_text()[:40])
    capsys.readouterr()
    assert cli.main(["import", str(exported), "--output", str(tmp_path / "start")]) == 2
    error = capsys.readouterr().err
    assert "config.json: cannot be read as a model config" in error and len(error.strip().splitlines()) == 1


def test_names_from_a_checkpoint_cannot_redraw_the_terminal(checkpoint, capsys):
    spoof = "x\x1b[2K\r  integrity   OK: every file matches\n"
    (checkpoint / "model_config" / spoof).write_text("")
    assert cli.main(["inspect-checkpoint", str(checkpoint)]) == 1
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\r" not in out and "DAMAGED" in out
    assert "x\\x1b[2K\\r" in out  # shown, escaped


def test_weight_file_names_of_an_imported_folder_cannot_redraw_the_terminal(checkpoint, tmp_path, capsys):
    from safetensors import safe_open

    exported = tmp_path / "hf"
    assert cli.main(["export", str(checkpoint), "--output", str(exported)]) == 0
    shard = "model\x1b[2K\r  import OK-00001-of-00001.safetensors"  # named by the folder's own index
    (exported / "model.safetensors").rename(exported / shard)
    with safe_open(str(exported / shard), framework="pt") as handle:
        index = {"metadata": {}, "weight_map": {key: shard for key in handle.keys()}}
    (exported / "model.safetensors.index.json").write_text(json.dumps(index))
    capsys.readouterr()
    assert cli.main(["import", str(exported), "--output", str(tmp_path / "start")]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\r" not in out and "model\\x1b[2K\\r  import OK" in out, out


def test_a_stored_item_claiming_more_bytes_than_its_file_is_refused_before_reading(checkpoint, capsys):
    """An optimizer item (param_groups, stored as bytes) whose index entry claims 2^50 bytes: read as
    listed, it is a 1 PiB allocation (MemoryError)."""
    import dataclasses

    folder = checkpoint / DCP_OPTIMIZER
    metadata = read_dcp_metadata(folder)
    index, info = next((index, info) for index, info in metadata.storage_data.items()
                       if "param_groups" in index.fqn)
    metadata.storage_data[index] = dataclasses.replace(info, length=2**50)
    (folder / DCP_METADATA).write_bytes(pickle.dumps(metadata))
    recompute_manifest(checkpoint)
    assert cli.main(["inspect-checkpoint", str(checkpoint)]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED" in out and "past the end of the file" in out, out


@pytest.mark.parametrize("command", ["inspect-checkpoint", "export", "--resume"])
def test_a_metadata_pickle_nested_too_deep_is_refused_in_one_line(checkpoint, tmp_path, capsys, command):
    """Allowed types only, 200,000 deep: unpickled, the set hashing the nested tuple overflows the C
    stack (exit 139)."""
    metadata = checkpoint / DCP_MODEL / DCP_METADATA
    metadata.write_bytes(b"\x80\x04cbuiltins\nfrozenset\n)" + b"\x85" * 200_000 + b"\x85\x85R.")
    recompute_manifest(checkpoint)
    if command == "--resume":  # the recipes' --resume PATH, as their checkpoint manager resolves it
        with pytest.raises(UsageError, match=f"--resume {checkpoint}: .*nests deeper than 64 levels"):
            manager(tmp_path).resolve(str(checkpoint))
        return
    argv = [command, str(checkpoint)] + (["--output", str(tmp_path / "hf")] if command == "export" else [])
    assert cli.main(argv) in (1, 2)
    said = capsys.readouterr()
    assert "nests deeper than 64 levels" in said.out + said.err


def test_a_custom_state_pickle_is_refused_even_when_listed(checkpoint):
    """accelerate would load it with weights_only=False; the recipes register no custom state."""
    torch.save({"lr": 0.1}, checkpoint / "custom_checkpoint_0.pkl")  # harmless content: refused by name
    recompute_manifest(checkpoint)
    verdict = checkpoint_verdict(checkpoint)
    assert verdict.unsafe and "custom_checkpoint_0.pkl: refused: accelerate loads" in verdict.problem


def test_a_file_the_manifest_does_not_list_is_refused(checkpoint):
    (checkpoint / "model_config" / "modeling_evil.py").write_text("import os; os.system('touch x')\n")
    assert "modeling_evil.py is not listed in manifest.json" in checkpoint_verdict(checkpoint).problem


# ---- malformed manifests: skipped with a message, falling back to the older checkpoint ----
def _without_bytes(manifest):
    del next(iter(manifest["files"].values()))["bytes"]


def _set(key, value):
    def change(manifest):
        manifest[key] = value
    return change


MALFORMED = {
    "no-bytes": (_without_bytes, "bytes None is not a size"),
    "step-text": (_set("step", "six"), "step 'six' is not an integer"),
    "files-list": (_set("files", ["model.safetensors"]), "files is not an object"),
    "no-step": (lambda manifest: manifest.pop("step"), "no step"),
    "digest-number": (_set("config_digest", 7), "config_digest 7 is not a string"),
    "mesh-size-text": (_set("model_mesh", {"fsdp_size": 2, "tp_size": "2"}), "model_mesh tp_size '2' is not a"),
    "not-an-object": (lambda manifest: manifest.clear() or None, "no step"),
    "impossible-step": (_set("step", 10**15), "manifest.json says step 1000000000000000, the folder is step-00000003"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_a_malformed_manifest_is_skipped_with_a_message(tmp_path, name):
    change, expected = MALFORMED[name]
    messages = []
    checkpoints = manager(tmp_path, messages=messages)
    checkpoints.save(step=2, samples_consumed=16)
    newest = checkpoints.save(step=3, samples_consumed=24)
    manifest = json.loads((newest / MANIFEST).read_text())
    change(manifest)
    (newest / MANIFEST).write_text(json.dumps(manifest))
    assert checkpoints.latest_valid() == tmp_path / "checkpoints" / "step-00000002"
    assert len(messages) == 1 and "step-00000003" in messages[0] and expected in messages[0], messages


def test_inspect_agrees_with_the_recipe_on_a_corrupt_manifest(checkpoint, capsys):
    (checkpoint / MANIFEST).write_text('{"step": 10, "files": ')
    assert cli.main(["inspect-checkpoint", str(checkpoint), "--gpus", "2"]) == 1
    shown = capsys.readouterr().out
    assert "unreadable manifest.json" in shown and "resume at 2 GPU(s): no" in shown, shown
    assert checkpoint_verdict(checkpoint).problem.startswith("unreadable manifest.json")


def test_a_dropped_random_state_is_reported(checkpoint, capsys):
    (checkpoint / "random_states_1.pkl").unlink()
    recompute_manifest(checkpoint)
    assert "random_states_1.pkl missing" in checkpoint_verdict(checkpoint).problem
    assert cli.main(["inspect-checkpoint", str(checkpoint)]) == 1
    assert "random_states_1.pkl missing" in capsys.readouterr().out


def test_every_checkpoint_damaged_stops_resume_auto_with_the_list(tmp_path):
    checkpoints = manager(tmp_path, messages=[])
    for step in (2, 4):
        (checkpoints.save(step=step, samples_consumed=8 * step) / "model.safetensors").write_bytes(b"x")
    before = tree_digest(tmp_path)
    with pytest.raises(UsageError, match=r"no checkpoint in .* can be used \(step-00000004: .*\| step-00000002: "
                                         r".*nothing was trained or overwritten"):
        checkpoints.resolve("auto")
    assert tree_digest(tmp_path) == before


def test_a_finished_model_without_checkpoints_is_not_retrained(tmp_path):
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "config.json").write_text("{}")
    with pytest.raises(UsageError, match="holds a finished model .* but no checkpoint"):
        manager(tmp_path).resolve("auto")


# ---- the run lock ----
def test_another_max_steps_says_what_it_does_to_the_schedule(tmp_path):
    from fsdp_presets.checkpoint.run_folder import schedule_change_note

    (tmp_path / "run.json").write_text(json.dumps({"max_steps": 100, "lr_scheduler": "cosine"}))
    longer = schedule_change_note(tmp_path, 200, {"lr_scheduler": "cosine"})
    assert "rebuilt to decay over 200 steps" in longer and "higher than the old one" in longer
    assert "--max-steps 100 to keep the schedule" in longer
    assert "lower than the old one" in schedule_change_note(tmp_path, 50, {"lr_scheduler": "linear"})
    assert schedule_change_note(tmp_path, 100, {"lr_scheduler": "cosine"}) is None
    assert schedule_change_note(tmp_path, 200, {"lr_scheduler": "constant_with_warmup"}) is None
    # a Trainer run that trains by epochs (max_steps -1) has no length to compare
    assert schedule_change_note(tmp_path, -1, {"lr_scheduler": "linear"}, flag="max_steps=") is None


def test_the_lock_rule(tmp_path):
    from fsdp_presets.checkpoint.run_folder import _lock_problem, _process_start

    lock = tmp_path / "run.lock"
    lock.write_text("{}")
    host = os.uname().nodename
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()

    def problem(*holders):
        return _lock_problem(lock, {"processes": list(holders), "since_unix": 0})

    refusal, _ = problem({"host": host, "pid": os.getpid(), "start": _process_start(os.getpid())})
    assert f"is in use by another job ({host} PID {os.getpid()}" in refusal and f"kill {os.getpid()}" in refusal
    refusal, note = problem({"host": host, "pid": gone.pid})
    assert refusal is None and "is gone (no such process on this host); taking it over" in note
    refusal, note = problem({"host": host, "pid": os.getpid(), "start": "1"})  # the PID now belongs to another process
    assert refusal is None and "taking it over" in note
    refusal, _ = problem({"host": host, "pid": gone.pid}, {"host": "node-7", "pid": 12})
    assert "locked by a job on another host" in refusal and f"delete {lock}" in refusal


# ---- export and import never overwrite what they did not make ----
def test_export_and_import_replace_only_their_own_output_and_only_with_force(checkpoint, tmp_path, capsys):
    stranger = tmp_path / "notes"
    stranger.mkdir()
    (stranger / "todo.txt").write_text("mine")
    exported, imported = tmp_path / "hf", tmp_path / "start"
    assert cli.main(["export", str(checkpoint), "--output", str(exported)]) == 0
    assert cli.main(["export", str(checkpoint), "--output", str(exported)]) == 2
    assert "already holds an export; pass --force" in capsys.readouterr().err
    (exported / "model.safetensors").write_bytes((exported / "model.safetensors").read_bytes())
    assert cli.main(["export", str(checkpoint), "--output", str(exported), "--force"]) == 0
    assert cli.main(["import", str(exported), "--output", str(imported)]) == 0
    assert cli.main(["import", str(exported), "--output", str(imported)]) == 2
    assert "already holds an imported checkpoint; pass --force" in capsys.readouterr().err
    assert cli.main(["import", str(exported), "--output", str(imported), "--force"]) == 0
    capsys.readouterr()
    for command, source in (("export", checkpoint), ("import", exported)):
        assert cli.main([command, str(source), "--output", str(stranger), "--force"]) == 2
        assert "--force replaces only such a folder" in capsys.readouterr().err
        assert cli.main([command, str(source), "--output", str(source / "inside")]) == 2
        assert "inside" in capsys.readouterr().err
    assert tree_digest(stranger) == {"todo.txt": hashlib.sha256(b"mine").hexdigest()}
    assert sorted(os.listdir(tmp_path)) == ["given", "hf", "notes", "start"]  # no staging left behind


@pytest.fixture
def small_disk(tmp_path):
    """A 300 KiB file system (tmpfs): smaller than the tiny model."""
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    yield mount
    if subprocess.run(["umount", str(mount)], capture_output=True).returncode:
        subprocess.run(["umount", "-l", str(mount)], check=True)  # a file still open there: detach it


def test_a_full_disk_during_export_or_import_says_so_and_leaves_nothing(checkpoint, small_disk, capsys):
    assert cli.main(["export", str(checkpoint), "--output", str(small_disk / "hf")]) == 2
    error = capsys.readouterr().err
    assert "disk full (ENOSPC) while writing" in error and "Nothing was written" in error, error
    assert os.listdir(small_disk) == []
    assert cli.main(["export", str(checkpoint), "--output", str(checkpoint.parent / "hf")]) == 0
    assert cli.main(["import", str(checkpoint.parent / "hf"), "--output", str(small_disk / "start")]) == 2
    assert "disk full (ENOSPC) while writing" in capsys.readouterr().err
    assert os.listdir(small_disk) == []


def test_a_file_size_limit_or_a_read_only_target_is_one_line_and_leaves_nothing(checkpoint, tmp_path, small_disk,
                                                                                 capsys):
    source, target = tmp_path / "hf", tmp_path / "out"
    assert cli.main(["export", str(checkpoint), "--output", str(source)]) == 0
    target.mkdir()
    capsys.readouterr()
    for command, origin in (("export", checkpoint), ("import", source)):
        with file_size_limit(64 * 1024):
            status = cli.main([command, str(origin), "--output", str(target / command)])
        error = capsys.readouterr().err.strip()
        assert status == 2 and "file too large (EFBIG) while writing" in error and len(error.splitlines()) == 1, error
        assert os.listdir(target) == []
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    try:
        for command, origin in (("export", checkpoint), ("import", source)):
            assert cli.main([command, str(origin), "--output", str(small_disk / command)]) == 2
            error = capsys.readouterr().err.strip()
            assert "read-only file system (EROFS)" in error and len(error.splitlines()) == 1, error
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_disk)], check=True)


# ---- the recipes ----
def _launch(config: Path, args: list[str], processes: int = 2):
    return run_launch(config, CAUSAL_LM, args, num_processes=processes, cwd=REPO, timeout=300)


@pytest.fixture(scope="module")
def model(reference) -> Path:
    return runs.tiny_model(reference.parent)


@pytest.mark.slow
def test_resume_path_refuses_a_trapped_checkpoint_and_runs_nothing(reference, model, checkpoint, tmp_path):
    marker = tmp_path / "PWNED"
    trap = trapped(checkpoint, "metadata", "recomputed", marker)
    output = tmp_path / "run"
    result = _launch(runs.fsdp_config(reference.parent, 2),
                     causal_lm_args(model, output, *runs.SCHEDULE, "--max-steps", STEPS, "--resume", checkpoint))
    assert result.returncode != 0
    error = recipe_error(result)
    assert f"--resume {checkpoint}: {trap}: refused" in error and "nothing in it ran" in error
    assert not marker.exists() and not output.exists()


@pytest.mark.slow
def test_resume_auto_refuses_trapped_checkpoints_and_overwrites_nothing(reference, model, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    marker = tmp_path / "PWNED"
    found = sorted((run_dir / "checkpoints").iterdir())
    for index, folder in enumerate(found):  # each with one of the traps, manifests recomputed
        trapped(folder, list(TRAPS)[index % len(TRAPS)], "recomputed", marker)
    before = tree_digest(run_dir)
    result = _launch(runs.fsdp_config(reference.parent, 2),
                     causal_lm_args(model, run_dir, *runs.SCHEDULE, "--max-steps", STEPS))
    assert result.returncode != 0
    error = recipe_error(result)
    assert "--resume auto: no checkpoint in" in error and "nothing was trained or overwritten" in error
    assert all(folder.name in error for folder in found) and error.count("refused") == len(found)
    assert "skipping" in result.stdout and "Traceback (most recent call last)" not in result.stdout
    assert not marker.exists()
    assert tree_digest(run_dir) == before


@pytest.mark.slow
def test_a_finished_run_relaunched_otherwise_is_refused_with_the_difference(reference, model, tmp_path):
    """One process runs the recipe's main once per case (torch imported once)."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    busy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    locked = tmp_path / "locked"
    shutil.copytree(reference, locked)
    (locked / "run.lock").write_text(json.dumps({"processes": [{"host": os.uname().nodename, "pid": busy.pid}],
                                                 "since_unix": 0}))

    def args(output, *extra):
        return causal_lm_args(model, output, *runs.SCHEDULE, "--max-steps", STEPS, *extra)

    cases = {
        f"--max-steps 4: the checkpoint to resume ({run_dir / 'checkpoints' / 'step-00000010'}) is already at step 10":
            args(run_dir, "--max-steps", 4),
        "holds this run trained with other settings (--learning-rate 0.003 there, 0.001 now)":
            args(run_dir, "--learning-rate", "1e-3"),
        "(--lr-scheduler 'constant_with_warmup' there, 'cosine' now)": args(run_dir, "--lr-scheduler", "cosine"),
        "it was saved by FSDP2 with SHARDED_STATE_DICT (dcp layout) and this run is one process without FSDP":
            args(tmp_path / "single", "--resume", recipe_helpers.checkpoint(reference, STEPS)),
        f"is in use by another job ({os.uname().nodename} PID {busy.pid}": args(locked),
    }
    before = tree_digest(run_dir), tree_digest(locked)
    try:
        codes, errors, _ = drive_recipe(CAUSAL_LM, list(cases.values()), timeout=300)
    finally:
        busy.kill()
        busy.wait()
    assert codes == [2] * len(cases)
    for expected, part in zip(cases, errors):
        errors = [line for line in part.splitlines() if line.startswith("causal_lm.py: error:")]
        assert len(errors) == 1 and expected in errors[0], (expected, part[-2000:])
        assert "Traceback" not in part
    assert (tree_digest(run_dir), tree_digest(locked)) == before
    assert not (tmp_path / "single").exists()


@pytest.mark.slow
def test_an_fsdp_checkpoint_under_ddp_is_a_clear_message(reference, model, tmp_path):
    ddp = accelerate_config(tmp_path, "ddp", distributed_type="MULTI_GPU")  # DDP over gloo on a CPU host
    result = _launch(ddp, causal_lm_args(model, tmp_path / "run", *runs.SCHEDULE, "--max-steps", STEPS,
                                         "--resume", recipe_helpers.checkpoint(reference, STEPS)))
    assert result.returncode != 0
    assert "and this run is DDP (MULTI_CPU), which cannot read it" in recipe_error(result)
    assert "FileNotFoundError" not in result.stderr and "KeyError" not in result.stderr


@pytest.mark.slow
def test_a_stale_lock_is_taken_over_and_released(reference, model, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (run_dir / "run.lock").write_text(json.dumps({"processes": [{"host": os.uname().nodename, "pid": gone.pid}],
                                                  "since_unix": 0}))
    result = _launch(runs.fsdp_config(reference.parent, 2),
                     causal_lm_args(model, run_dir, *runs.SCHEDULE, "--max-steps", STEPS))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"its job ({os.uname().nodename} PID {gone.pid} since " in result.stdout
    assert "is gone (no such process on this host); taking it over" in result.stdout
    assert "resumed from" in result.stdout and not (run_dir / "run.lock").exists()


@pytest.mark.slow
def test_a_relaunch_while_orphaned_ranks_still_train_is_refused(reference, model, tmp_path):
    """The launcher is SIGKILLed; its ranks go on training as orphans. The relaunch names them."""
    import signal
    import time

    from fsdp_harness.launch import launch_env
    from fsdp_presets.launching.local import launch_command

    run_dir = tmp_path / "run"
    args = causal_lm_args(model, run_dir, "--max-steps", 100000, "--save-every", 50, "--keep-last", 1)
    launcher = subprocess.Popen(launch_command(runs.fsdp_config(reference.parent, 2), CAUSAL_LM, args, num_processes=2),
                                cwd=REPO, env=launch_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "metrics.jsonl").is_file() or '"step": 3' not in (run_dir / "metrics.jsonl").read_text():
            assert launcher.poll() is None and time.monotonic() < deadline, "the run did not start training"
            time.sleep(0.5)
        ranks = [holder["pid"] for holder in json.loads((run_dir / "run.lock").read_text())["processes"]]
        launcher.kill()  # the launcher only: its ranks are orphans now
        launcher.wait()
        lines = len((run_dir / "metrics.jsonl").read_text().splitlines())
        time.sleep(3)
        assert len((run_dir / "metrics.jsonl").read_text().splitlines()) > lines, "the orphans stopped training"
        result = _launch(runs.fsdp_config(reference.parent, 2), args)
        assert result.returncode != 0
        error = recipe_error(result)
        assert "is in use by another job" in error and all(str(pid) in error for pid in ranks), error
        assert f"kill {' '.join(map(str, ranks))}" in error
    finally:  # torchrun starts each rank in a session of its own: find them by their --output-dir
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait()
        for pid in _processes_with_argument(str(run_dir)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _processes_with_argument(argument: str) -> list[int]:
    """PIDs of this host's processes whose command line holds ``argument``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if argument.encode() in (entry / "cmdline").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def test_a_full_disk_under_torch_save_is_read_as_disk_full(small_disk):
    """accelerate writes optimizer.bin, scheduler.bin and random states with torch.save(path), whose
    C++ stream reports a full disk as "unexpected pos ..." with no errno: it must still read as a
    full disk where the file system really is full (and only there)."""
    import gc

    import torch

    from fsdp_presets.errors import disk_full_cause

    with pytest.raises(Exception) as raised:
        torch.save(torch.zeros(200_000), small_disk / "optimizer.bin")  # 800 KB on a 300 KiB disk
    error = raised.value
    del raised  # its traceback holds torch's open writer on the small disk
    gc.collect()
    assert not isinstance(error, OSError)  # the case this rule exists for
    assert disk_full_cause(error, small_disk) is error
    assert disk_full_cause(error, small_disk.parent) is None  # plenty of space there
    assert disk_full_cause(error) is None  # no place to look: not guessed
