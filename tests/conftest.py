"""Shared test helpers: accelerate configs written the way users write them, and the launcher."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
WORKERS = REPO / "tests" / "workers"

# NOTE: gloo prints this when a process exits while the process group still references live
# tensors. Clean teardown (free model/optimizer, destroy the group) removes it; tests assert it
# never appears instead of retrying launches that hit it.
GLOO_EXIT_ABORT = "terminate called without an active exception"


def accelerate_config(directory: Path, name: str, *, distributed_type: str = "FSDP", num_processes: int = 2,
                      fsdp: dict | None = None, parallelism: dict | None = None,
                      mixed_precision: str = "no") -> Path:
    """Write an accelerate config YAML (the schema `accelerate config` writes) and return its path.

    ``fsdp`` entries are given without the ``fsdp_`` prefix and override an FSDP2 full-shard,
    sharded-state-dict default for a tiny Llama.
    """
    config = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": distributed_type,
        "num_processes": num_processes,
        "num_machines": 1,
        "machine_rank": 0,
        "mixed_precision": mixed_precision,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    }
    if distributed_type == "FSDP":
        settings = {
            "version": 2,
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
            "reshard_after_forward": True,
            "state_dict_type": "SHARDED_STATE_DICT",
            "cpu_ram_efficient_loading": False,
            "offload_params": False,
            "activation_checkpointing": False,
        }
        settings.update(fsdp or {})
        if settings["version"] == 1:
            settings.pop("reshard_after_forward", None)
            settings.setdefault("sharding_strategy", "FULL_SHARD")
            settings.setdefault("sync_module_states", True)
            settings.setdefault("use_orig_params", True)
            settings.setdefault("backward_prefetch", "BACKWARD_PRE")
        config["fsdp_config"] = {f"fsdp_{key}": value for key, value in settings.items()}
    if parallelism:
        config["parallelism_config"] = {f"parallelism_config_{key}": value for key, value in parallelism.items()}
    path = Path(directory) / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.fixture
def python() -> str:
    return sys.executable
