"""A model's own activation terms for the planner, read off a short rehearsal of that exact config
and cached on disk::

    terms, problem = rehearsed_block_activations(config, seq_len=4096, precision="bf16")
    shape = shape.replace(measured=terms)      # the planner composes them (plan/activations.py)

It lives with the presets because the rehearsal runs the accelerate config a preset decision
writes for the model (the planner itself only composes the terms it is given). The rehearsal
(:func:`fsdp_presets.rehearse.rehearsal.rehearse`, FSDP2 FULL_SHARD on 8 fake ranks, one step)
runs the config six times (:data:`RUNS`): 2 and 3 blocks at micro-batch 1, 2 blocks at
micro-batch 2, and the same three under activation checkpointing, each at full width and the real
sequence length, with the embedding and head. Each run records what it held at
four moments of backward (:data:`fsdp_presets.rehearse.rehearsal.MOMENTS`): the loss's backward, the
tail's (final norm, output head), a block's and the end (the input embedding's). Besides model
state and gathered parameters that is activations and temporaries: the difference between the 2-
and 3-block runs is one block's saved activations (``saved``), the difference between
micro-batches parts what grows with the tokens from what does not, the rest at the loss is the
logits' loss tensors and what lives outside the blocks (``logits``, ``outside``), and the
checkpointed runs give the same apart (``checkpointed``, ``outside_checkpointed``: a model whose
first blocks differ from the rest, DeepSeek's dense first layer, saves another amount in them
without checkpointing but not with it) and a block's backward with its recomputation. These are the quantities
:data:`~fsdp_presets.plan.activations.BLOCK_ACTIVATIONS` holds for the families measured by hand,
now measured for every model. The planner scales them to any micro-batch, layer count, GPU count,
strategy, accumulation and checkpointing setting.

The cache: one JSON file per config, sequence length and precision (and torch/transformers
versions) in ``activations/`` of the cache folder (:mod:`fsdp_presets.preset.model_cache`: where
it is, how to turn it off). Where that cache also holds the model's profile, the terms are found
without loading the config (no torch, no transformers). ``FSDP_PRESETS_PLAN_REHEARSAL=off`` turns
the rehearsal off: the planner then uses the family constants and says so ("estimated").
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

from fsdp_presets import environment
from fsdp_presets.errors import UsageError
from fsdp_presets.rehearse.mesh import Mesh
from fsdp_presets.preset.model_cache import (block_config_digest, cache_dir, cached_profile, describe_cache,
                                             library_versions, read_entry, write_entry)

REHEARSAL_ENV = environment.PLAN_REHEARSAL.name
"""``off``: never rehearse for a plan (family constants only)."""
CACHE_FORMAT = 7
"""Bumped when what a cache entry holds changes (older entries are then ignored)."""
REHEARSED_WORLD_SIZE = 8
"""Fake ranks of the rehearsal (activations do not depend on it; the shards stay small)."""
RUNS = ((2, 1, False), (3, 1, False), (2, 2, False), (2, 1, True), (2, 2, True), (3, 1, True))
"""The rehearsals, as (blocks, micro-batch, activation checkpointing): 2 blocks, not 1, so that a
model whose first block differs (DeepSeek's dense first layers) keeps it in every run and the
difference is a repeated block; 3 blocks checkpointed too, so that a checkpointed block is
measured by itself, not as what is left of the checkpointed run once the other runs' outside of
the blocks (which holds that first block's difference) is taken off."""
OUTSIDE_ESTIMATE = 8.13
"""Bytes per token and hidden unit outside the blocks where no run measured them (the families'
measured value, :data:`fsdp_presets.plan.activations.BLOCK_ACTIVATIONS`)."""
_EXCLUDED_CATEGORIES = ("params", "grads", "optimizer", "unsharded params", "unsharded grads")


def config_key(digest: str, *, seq_len: int, precision: str, mesh: Mesh = Mesh()) -> str:
    """Name of a cache entry: the config's digest
    (:func:`~fsdp_presets.preset.model_cache.block_config_digest`, without its layer count: the terms are
    per block), the sequence length, the precision, the TP/EP mesh (when there is one) and the
    library versions."""
    fields = {"config": digest, "seq_len": seq_len, "precision": precision, "format": CACHE_FORMAT,
              **library_versions()}
    if mesh.is_nd:
        fields["mesh"] = [mesh.tp, mesh.ep]
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode("utf-8")).hexdigest()[:32]


def _cached_entry(digest: str, *, seq_len: int, precision: str,
                  mesh: Mesh = Mesh()) -> tuple[Path | None, dict | None]:
    """``(path, entry)`` of the terms of the config of ``digest`` (path None: the cache is off)."""
    folder = cache_dir()
    if folder is None:
        return None, None
    path = folder / "activations" / f"{config_key(digest, seq_len=seq_len, precision=precision, mesh=mesh)}.json"
    return path, read_entry(path, format_=CACHE_FORMAT)


def mesh_world_size(mesh: Mesh) -> int:
    """Fake ranks of a rehearsal on ``mesh``: two data-parallel ranks per TP or EP group, so that
    the experts too have two FSDP ranks (``efsdp``) to shard over, as on a real cluster."""
    return 2 * max(mesh.tp, mesh.ep)


def _layers(config, count: int):
    """A copy of ``config`` with ``count`` blocks (``layer_types`` cut to match)."""
    import copy

    truncated = copy.deepcopy(config)
    truncated.num_hidden_layers = count
    layer_types = getattr(truncated, "layer_types", None)
    if isinstance(layer_types, list) and len(layer_types) >= 2:
        # Keep one block of each attention kind the model has in the 2-block run (hybrid
        # attention: Gemma-2/3's sliding and full layers differ only in their mask).
        truncated.layer_types = layer_types[:count]
    return truncated


def _held(moment: dict[str, int]) -> int:
    """Activations and temporaries of one moment of a rehearsal (:attr:`Rehearsal.moments`)."""
    return sum(count for name, count in moment.items() if name not in _EXCLUDED_CATEGORIES)


def _besides_state(moment: dict[str, int]) -> int:
    """What one moment holds besides the sharded state (gathered parameters and unsharded gradients too)."""
    return sum(count for name, count in moment.items() if name not in ("params", "grads", "optimizer"))


def _unsharded(moment: dict[str, int], name: str) -> int:
    return int(moment.get(f"unsharded {name}", 0))


def measure(config, *, seq_len: int, precision: str, trust_remote_code: bool = False, mesh: Mesh = Mesh()) -> dict:
    """Rehearse ``config`` as :data:`RUNS` says (see the module notes) and return the cache entry:
    what each run held at each moment of backward (:data:`fsdp_presets.rehearse.rehearsal.MOMENTS`).
    ``mesh``: sharded by transformers' ``DistributedConfig`` on that TP/EP mesh instead
    (:func:`mesh_world_size` ranks)."""
    from fsdp_presets.rehearse.rehearsal import rehearse
    from fsdp_presets.preset.rehearse_request import config_env, decide_unchecked, request_from_flags
    from fsdp_presets.model.model_loading import build_meta_model
    from fsdp_presets.model.profile import profile_module

    profile = profile_module(build_meta_model(_layers(config, 2), trust_remote_code=trust_remote_code))
    runs, seconds = [], 0.0
    for count, micro_batch, checkpointing in RUNS:
        request = request_from_flags("rehearsed-config", gpus=REHEARSED_WORLD_SIZE, seq_len=seq_len,
                                     precision=precision, strategy="full",
                                     activation_checkpointing="on" if checkpointing else "off")
        preset, _ = decide_unchecked(profile, request)
        with warnings.catch_warnings():  # accelerate's thread-count and torch's module-tracker advice: noise here
            warnings.simplefilter("ignore", UserWarning)
            world = mesh_world_size(mesh) if mesh.is_nd else REHEARSED_WORLD_SIZE
            result = rehearse(_layers(config, count), config_env(preset), world_size=world,
                              seq_len=seq_len, micro_batch=micro_batch, iterations=1,
                              trust_remote_code=trust_remote_code,
                              mesh_sizes=mesh.sizes(gpus=world) if mesh.is_nd else None)
        missing = [moment for moment in ("loss", "tail", "block", "embedding") if moment not in result.moments]
        if missing:
            raise ValueError(f"the rehearsal saw no {', '.join(missing)} moment in backward")
        runs.append({"blocks": count, "micro_batch": micro_batch, "checkpointing": checkpointing,
                     "moments": result.moments,
                     "where": result.peak_where})
        seconds += result.seconds
    return {"format": CACHE_FORMAT, "seq_len": seq_len, "precision": precision,
            "hidden_size": int(config.hidden_size), "vocab_size": int(config.vocab_size),
            "runs": runs, "seconds": round(seconds, 1),
            "measured": f"rehearsed with {', '.join(_run_text(*run) for run in RUNS)} ("
                        f"{mesh.label(gpus=mesh_world_size(mesh)) if mesh.is_nd else 'FSDP2 FULL_SHARD'}, "
                        f"{precision}, seq {seq_len}): activations and temporaries at the loss's backward "
                        f"{', '.join(str(_held(run['moments']['loss'])) for run in runs)} bytes"}


def _run_text(blocks: int, micro_batch: int, checkpointing: bool) -> str:
    return f"{blocks} blocks at micro-batch {micro_batch}" + (" checkpointed" if checkpointing else "")


def terms_from_entry(entry: dict):
    """The :class:`~fsdp_presets.plan.activations.BlockActivations` of a cache entry (runs as
    :data:`RUNS`). Each moment of backward holds bytes that grow with the tokens and bytes that do
    not (an output head's gradient held through backward, where it is tied to the embedding): the
    runs at micro-batch 1 and 2 part them. At the loss's backward: ``saved`` from the difference
    per block, ``outside``/``logits`` from the rest, and the same of the checkpointed runs
    (``checkpointed``, ``outside_checkpointed``); in a block's backward (``in_block``, ``in_block_checkpointed``) and the tail's
    (``tail``) what is held besides the blocks' activations."""
    from fsdp_presets.plan.activations import LOGITS_BYTES_AT_PEAK, BlockActivations

    seq_len, hidden, vocab = entry["seq_len"], entry["hidden_size"], entry["vocab_size"]
    tokens_hidden = seq_len * hidden * (4 if entry["precision"] == "fp32" else 2) / 2
    first, second, doubled, checkpointed, checkpointed_doubled, checkpointed_third = entry["runs"]
    blocks = first["blocks"]

    def held(run, moment):
        return _held(run["moments"][moment]) if moment != "embedding" else _besides_state(run["moments"][moment])

    per_block = max(0, held(second, "loss") - held(first, "loss")) / (second["blocks"] - blocks)
    per_token = {moment: held(doubled, moment) - held(first, moment)
                 for moment in ("loss", "tail", "block", "embedding")}
    fixed = {moment: held(first, moment) - per_token[moment] for moment in per_token}
    rest = max(0.0, per_token["loss"] - blocks * per_block)
    logits_bytes = seq_len * vocab * LOGITS_BYTES_AT_PEAK
    logits, outside = float(LOGITS_BYTES_AT_PEAK), (rest - logits_bytes) / tokens_hidden
    if rest < logits_bytes:  # a head that keeps less than the usual loss tensors: all of the rest scales with the logits
        logits, outside = (rest / (seq_len * vocab) if vocab else 0.0), 0.0
    checkpointed_per_token = {moment: held(checkpointed_doubled, moment) - held(checkpointed, moment)
                              for moment in ("loss", "tail", "block")}
    per_checkpointed = max(0.0, (held(checkpointed_third, "loss") - held(checkpointed, "loss"))
                           / (checkpointed_third["blocks"] - blocks))
    checkpointed_rest = checkpointed_per_token["loss"] - blocks * per_checkpointed
    in_block_checkpointed = checkpointed_per_token["block"] - (blocks - 1) * per_checkpointed
    tail = second["moments"]["tail"]
    return BlockActivations(saved=per_block / tokens_hidden, checkpointed=per_checkpointed / tokens_hidden,
                            outside=outside, logits=logits,
                            in_block=max(0.0, per_token["block"] - (blocks - 1) * per_block) / tokens_hidden,
                            in_block_checkpointed=max(0.0, in_block_checkpointed) / tokens_hidden,
                            tail=max(0.0, per_token["tail"] - blocks * per_block) / tokens_hidden,
                            end=max(0.0, per_token["embedding"]) / tokens_hidden, fixed_at_end=fixed["embedding"],
                            fixed_at_loss=fixed["loss"], fixed_in_block=fixed["block"], fixed_in_tail=fixed["tail"],
                            outside_checkpointed=(checkpointed_rest - seq_len * vocab * logits) / tokens_hidden,
                            fixed_at_loss_checkpointed=held(checkpointed, "loss") - checkpointed_per_token["loss"],
                            tail_checkpointed=(checkpointed_per_token["tail"] - blocks * per_checkpointed) / tokens_hidden,
                            fixed_in_tail_checkpointed=held(checkpointed, "tail") - checkpointed_per_token["tail"],
                            fixed_in_block_checkpointed=held(checkpointed, "block") - checkpointed_per_token["block"],
                            tail_unsharded_params=_unsharded(tail, "params"),
                            tail_unsharded_grads=_unsharded(tail, "grads"),
                            measured=entry["measured"], rehearsed_seq_len=seq_len,
                            rehearsed_precision=entry["precision"])


def rehearsal_enabled() -> bool:
    """``FSDP_PRESETS_PLAN_REHEARSAL``: unset or ``on`` rehearses, ``off`` does not; any other
    value is refused rather than read as one of them."""
    value = os.environ.get(REHEARSAL_ENV, "").strip().lower()
    if value not in ("", "on", "off"):
        raise UsageError(f"{REHEARSAL_ENV}={value!r}: set it to off (family constants only) or on (the default), "
                         "or unset it")
    return value != "off"


def rehearsed_block_activations(config, *, seq_len: int, precision: str, trust_remote_code: bool = False):
    """``(BlockActivations or None, problem or None)``: the model's own terms, from the cache or a
    new rehearsal (then cached); None and why where a rehearsal cannot run (the planner then
    estimates from the family constants)."""
    if not rehearsal_enabled():
        return None, f"{REHEARSAL_ENV}=off"
    if not getattr(config, "vocab_size", None) or not getattr(config, "hidden_size", None) or \
            not getattr(config, "num_hidden_layers", None):
        return None, "not a decoder with hidden_size, num_hidden_layers and vocab_size in its config"
    path, entry = _cached_entry(block_config_digest(config), seq_len=seq_len, precision=precision)
    if entry is not None:
        return terms_from_entry(entry), None
    try:
        entry = measure(config, seq_len=seq_len, precision=precision, trust_remote_code=trust_remote_code)
    except Exception as error:  # any model the rehearsal cannot run: the planner falls back, and says why
        return None, f"the rehearsal could not run ({type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''})"
    if path is not None:
        write_entry(path, entry)  # a read-only cache: the terms are still used, the next plan rehearses again
    return terms_from_entry(entry), None


def with_rehearsed_terms(source: str, shape, *, trust_remote_code: bool = False):
    """``(shape, note)``: ``shape`` with this model's own activation terms from a short, cached
    rehearsal (:func:`rehearsed_block_activations`) where one applies and can run, and
    ``note`` (``source``: ``composed from a rehearsal`` or ``estimated``; ``how``) saying which."""
    if shape.lora is not None:
        return shape, {"source": "estimated", "how": "LoRA/QLoRA terms from the family constants (rehearsals run "
                       "full fine-tuning only)"}
    if shape.attention != "fused":
        return shape, {"source": "estimated", "how": "eager attention from the family constants (the rehearsal "
                       "runs the model's own attention)"}
    if not rehearsal_enabled():  # before loading the config: no transformers
        return shape, {"source": "estimated", "how": f"family constants ({REHEARSAL_ENV}=off)"}
    _, digest = cached_profile(source, trust_remote_code=trust_remote_code)  # no transformers when cached
    _, entry = _cached_entry(digest, seq_len=shape.seq_len, precision=shape.precision) if digest else (None, None)
    if entry is not None:
        terms = terms_from_entry(entry)
        return shape.replace(measured=terms), _composed_note(terms)
    from transformers.utils import logging as hf_logging

    from fsdp_presets.model.model_loading import load_config

    hf_logging.set_verbosity_error()  # advisory warnings (token ids, deprecated keys): noise for a plan

    try:
        config = load_config(source, trust_remote_code=trust_remote_code)
    except Exception as error:  # noqa: BLE001 - any config the rehearsal cannot load: estimate, and say why
        return shape, {"source": "estimated", "how": f"family constants: no config to rehearse ({error})"}
    terms, problem = rehearsed_block_activations(config, seq_len=shape.seq_len, precision=shape.precision,
                                                 trust_remote_code=trust_remote_code)
    if terms is None:
        return shape, {"source": "estimated", "how": f"family constants ({problem})"}
    return shape.replace(measured=terms), _composed_note(terms)


def rehearsed_mesh_terms(source: str, shape, meshes, *, trust_remote_code: bool = False,
                         rehearse_missing: bool = True) -> tuple[tuple, list[str]]:
    """``(pairs, problems)``: for each TP/EP mesh of ``meshes``, this model's activation terms
    rehearsed on it (from the cache, or a new rehearsal, then cached) as ``((tp, ep), terms)``
    pairs for :attr:`~fsdp_presets.plan.shapes.TrainingShape.measured_on_mesh`; a mesh that cannot be
    rehearsed is left out (the planner estimates it) with why in ``problems``.
    ``rehearse_missing=False``: the cache only (a plan that considers every size the model allows
    does not rehearse each; ``--tp``/``--ep`` does)."""
    meshes = [mesh for mesh in meshes if mesh.is_nd]
    if not meshes or shape.lora is not None or shape.attention != "fused" or not rehearsal_enabled():
        return (), []
    _, digest = cached_profile(source, trust_remote_code=trust_remote_code)
    pairs, problems, config = [], [], None
    for mesh in meshes:
        entry = _cached_entry(digest, seq_len=shape.seq_len, precision=shape.precision, mesh=mesh)[1] if digest else None
        if entry is None and not rehearse_missing:
            continue
        if entry is None:
            if config is None:
                from transformers.utils import logging as hf_logging

                from fsdp_presets.model.model_loading import load_config

                hf_logging.set_verbosity_error()
                config = load_config(source, trust_remote_code=trust_remote_code)
            path, entry = _cached_entry(block_config_digest(config), seq_len=shape.seq_len, precision=shape.precision,
                                        mesh=mesh)
            if entry is None:
                try:
                    entry = measure(config, seq_len=shape.seq_len, precision=shape.precision,
                                    trust_remote_code=trust_remote_code, mesh=mesh)
                except Exception as error:  # noqa: BLE001 - a mesh the rehearsal cannot run: estimated, and why
                    problems.append(f"{mesh.label(gpus=mesh_world_size(mesh))}: the rehearsal could not run "
                                    f"({type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''})")
                    continue
                if path is not None:
                    write_entry(path, entry)
        pairs.append(((mesh.tp, mesh.ep), terms_from_entry(entry)))
    return tuple(pairs), problems


def _composed_note(terms) -> dict:
    return {"source": "composed from a rehearsal",
            "how": f"this config {terms.measured.split(':')[0]}; FSDP2 rows composed from it, FSDP1/DDP rows "
                   f"estimated", "cache": describe_cache()}  # for the console: a header leaves the folder out


__all__ = ["REHEARSAL_ENV", "config_key", "measure", "rehearsal_enabled", "rehearsed_block_activations",
           "terms_from_entry", "with_rehearsed_terms"]
