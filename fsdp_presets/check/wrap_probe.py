"""Prove the FSDP wrapping of a model before a launch, in seconds, without weights or GPUs.

``fsdp-presets check CONFIG.yaml --model MODEL`` runs accelerate's own FSDP preparation of the
model as rank 0 of a fake process group of the config's size, with the environment ``accelerate
launch`` would give the training processes. The harness is the rehearsal's
(:func:`fsdp_presets.rehearse.rehearsal.fake_accelerate`: ``FakeStore``/backend ``fake``, the device mesh
built outside fake mode, an ``Accelerator`` from the launch environment, fake tensors)::

    probe = probe_wrapping("path/to/model", env, num_processes=8)
    probe.error      # what accelerate's preparation raised, or None
    probe.units      # [(module path, classes, parameters), ...]: the FSDP units it built
    probe.left_out   # parameters that no unit shards

FSDP2: ``Accelerator.prepare(model)`` (``fsdp2_prepare_model``: ``fully_shard`` on every unit,
the embedding and tail units, the root) on fake tensors, free at any model size. FSDP1:
accelerate's ``set_auto_wrap_policy`` on the model and torch's own recursive wrap walk with a
recording wrapper (building real FSDP1 units would materialise every parameter). What differs from
a launch, and why it does not change the units: RAM-efficient loading and module-state sync are
off (they move weights, not unit boundaries), and offload is off (the CPU host refuses it).

It runs in a subprocess (``python -m fsdp_presets.check.wrap_probe``): a process group and accelerate's
shared state are process-global, and ``check`` must leave its own process as it found it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field

from fsdp_presets.schema import ACCELERATE_ENV_PREFIXES

PROBE_TIMEOUT_S = 180
"""A 70B-parameter model on the meta device builds and wraps in well under a minute here."""

# Errors that come from the fake tensors, not from the configuration: accelerate moves ignored modules
# with Module.to(), which cannot swap a fake parameter that has a bias (measured, accelerate 1.16).
_FAKE_TENSOR_LIMITS = ("Couldn't swap", "meta tensor")


@dataclass(frozen=True, kw_only=True)
class WrapProbe:
    """What accelerate's FSDP preparation made of the model."""

    units: list[tuple[str, str, int]] = field(default_factory=list)
    """FSDP units, outermost last: (module path, ``''`` for the root; class name; parameters it shards)."""
    left_out: list[str] = field(default_factory=list)
    """Parameter names that no FSDP unit shards."""
    error: str | None = None
    """``TypeError: ...``: what accelerate's preparation raised (None: it went through)."""
    where: str | None = None
    """The innermost frame of that error (``_fsdp_param.py:501 in _init_sharding_spec_tp``)."""
    skipped: str | None = None
    """Why the probe did not run (it then proves nothing), else None."""

    def to_json(self) -> dict:
        return {"units": [list(unit) for unit in self.units], "left_out": list(self.left_out),
                "error": self.error, "where": self.where, "skipped": self.skipped}

    def unit_summary(self) -> str:
        """``7 units: LlamaDecoderLayer x 4, Embedding, tail (LlamaRMSNorm, Linear), root``"""
        counts: dict[str, int] = {}
        for path, cls, _ in self.units:
            label = "root" if path == "" else cls
            counts[label] = counts.get(label, 0) + 1
        parts = [f"{label} x {count}" if count > 1 else label for label, count in counts.items()]
        return f"{len(self.units)} unit{'s' if len(self.units) != 1 else ''}: {', '.join(parts)}"


def probe_wrapping(model_source: str, env: dict[str, str], num_processes: int, *,
                   trust_remote_code: bool = False, timeout_s: float = PROBE_TIMEOUT_S) -> WrapProbe:
    """Run accelerate's FSDP preparation of ``model_source`` in a subprocess (see module docstring).

    ``env``: the variables ``accelerate launch`` sets for the training processes (``FSDP_*``,
    ``ACCELERATE_*``, ``PARALLELISM_CONFIG_*``), e.g.
    :attr:`fsdp_presets.preset.accelerate_view.AccelerateView.env`.
    """
    request = {"model": model_source, "env": env, "world_size": int(num_processes),
               "trust_remote_code": trust_remote_code}
    child_env = {key: value for key, value in os.environ.items()
                 if not key.startswith(ACCELERATE_ENV_PREFIXES)}
    child_env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
                      "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    try:
        done = subprocess.run([sys.executable, "-m", "fsdp_presets.check.wrap_probe"], input=json.dumps(request),
                              capture_output=True, text=True, timeout=timeout_s, env=child_env)
    except subprocess.TimeoutExpired:
        return WrapProbe(skipped=f"the probe took more than {timeout_s:.0f} s")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = " ".join((done.stderr or done.stdout).strip().splitlines()[-1:])
        return WrapProbe(skipped=f"the probe process failed (exit {done.returncode}): {tail}")
    answer = json.loads(lines[-1])
    return WrapProbe(units=[tuple(unit) for unit in answer["units"]], left_out=answer["left_out"],
                     error=answer["error"], where=answer["where"], skipped=answer["skipped"])


# --------------------------------------------------------------------------- the child process


def _where(error: BaseException) -> str:
    """``accelerate fsdp_utils.py:885 -> torch _fsdp_param.py:501 in _init_sharding_spec_tp``: the last
    frame in accelerate and the innermost torch frame that is not a helper."""
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    ours = [frame for frame in frames if f"{os.sep}accelerate{os.sep}" in frame.filename]
    torch_frames = [frame for frame in frames if f"{os.sep}torch{os.sep}" in frame.filename
                    and not frame.filename.endswith(("_typing_utils.py", "_contextlib.py", "contract.py"))]
    torch_frames = [frame for frame in torch_frames if f"{os.sep}fsdp{os.sep}" in frame.filename] or torch_frames
    parts = [f"accelerate {os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}" for frame in ours[-1:]]
    parts += [f"torch {os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}" for frame in torch_frames[-1:]]
    return " -> ".join(parts)


def _fsdp1_units(model, plugin) -> list[tuple[str, str, int]]:
    """FSDP1: accelerate's wrap policy for ``model`` and torch's recursive wrap walk, recorded."""
    from torch.distributed.fsdp.wrap import _recursive_wrap

    plugin.set_auto_wrap_policy(model)  # accelerate's own: raises on a wrap class the model lacks
    names = {module: name for name, module in model.named_modules()}
    wrapped: list = []

    def record(module, **kwargs):
        wrapped.append(module)
        return module

    if plugin.auto_wrap_policy is not None:
        _recursive_wrap(model, plugin.auto_wrap_policy, record, ignored_modules=set(), ignored_params=set(),
                        only_wrap_children=True)
    units, claimed = [], set()
    for module in wrapped + [model]:  # inner units first; the root takes what is left
        params = [p for p in module.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in params)
        units.append((names[module], type(module).__name__, sum(p.numel() for p in params)))
    return units


def _fsdp2_units(model) -> tuple[list[tuple[str, str, int]], list[str]]:
    """One entry per FSDP unit (parameter group): modules sharded together, as accelerate's tail
    ``fully_shard([norm, embedding, head])`` does, are one unit labelled ``LlamaRMSNorm+Embedding+Linear``."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    groups: dict[int, list] = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            inner = getattr(module, "_checkpoint_wrapped_module", None)  # activation checkpointing's wrapper
            label = type(inner if inner is not None else module).__name__.removeprefix("FSDP")
            groups.setdefault(id(state), [state, name, []])[2].append(label + (" (checkpointed)" if inner is not None
                                                                                else ""))
    units = []
    for state, name, labels in groups.values():
        group = state._fsdp_param_group
        count = sum(p._orig_size.numel() for p in group.fsdp_params) if group else 0
        units.append((name, "+".join(labels), count))
    units.sort(key=lambda unit: unit[0] == "")  # the root last
    left_out = [name for name, param in model.named_parameters() if not isinstance(param, DTensor)]
    return units, left_out


def _child(request: dict) -> dict:
    import logging
    import warnings

    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    import torch

    from fsdp_presets.model.model_loading import build_meta_model, load_config
    from fsdp_presets.rehearse.rehearsal import fake_accelerate

    trust = request["trust_remote_code"]
    try:
        config = load_config(request["model"], trust_remote_code=trust)
        # rank 0 of a fake process group of the config's size, accelerate built from the launch
        # environment (the rehearsal's own harness: one way to fake a launch)
        setup = fake_accelerate(request["env"], world_size=request["world_size"])
        fake = setup.__enter__()
    except Exception as error:  # noqa: BLE001 - the harness, not the config: say so, prove nothing
        return {"units": [], "left_out": [], "error": None, "where": None,
                "skipped": f"could not set up the probe: {type(error).__name__}: {' '.join(str(error).split())}"}
    try:
        plugin = fake.accelerator.state.fsdp_plugin
        if plugin.fsdp_version == 2:
            model = fake.build_model(config, trust_remote_code=trust)
            with fake.fake_mode, torch.no_grad():
                model = fake.accelerator.prepare(model)
            units, left_out = _fsdp2_units(model)
        else:
            units, left_out = _fsdp1_units(build_meta_model(config, trust_remote_code=trust), plugin), []
    except Exception as error:  # noqa: BLE001 - accelerate's or torch's own failure: the finding
        text = f"{type(error).__name__}: {' '.join(str(error).split())}"
        if any(marker in text for marker in _FAKE_TENSOR_LIMITS):  # the harness's limit, not the config's
            return {"units": [], "left_out": [], "error": None, "where": None,
                    "skipped": f"this preparation moves tensors in a way fake tensors cannot ({text[:160]})"}
        return {"units": [], "left_out": [], "error": text, "where": _where(error), "skipped": None}
    finally:
        setup.__exit__(None, None, None)
    return {"units": units, "left_out": left_out, "error": None, "where": None, "skipped": None}


def main() -> int:
    request = json.loads(sys.stdin.read())
    print(json.dumps(_child(request)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["PROBE_TIMEOUT_S", "WrapProbe", "probe_wrapping"]
