"""Rehearse several cases in one process and print, per case, the rehearsed peak beside the
planner's total (one JSON line each), for tests/test_rehearse.py::

    python tests/workers/rehearse_cases.py '{"model": "model_configs/llama-3.1-8b", "gpus": 8,
        "seq_len": 4096, "micro_batch": 1, "grad_accum": 1, "ac": false, "layers": 4}' ...

``layers`` (optional) truncates the model to its first N blocks: the per-family constants of
``fsdp_presets.plan.planner.BLOCK_ACTIVATIONS`` are checked at a fraction of a full model's cost.
``"torch_peaks": true`` rehearses with torch's own peak bookkeeping (which also keeps every
module's peak) instead of the rehearsal's (the rank's peak only), to show both find the same peak.
"""

import json
import sys
import warnings


def main() -> int:
    warnings.simplefilter("ignore")
    from transformers.utils import logging as hf_logging

    from fsdp_presets.fileio import GiB
    from fsdp_presets.plan.shapes import Hardware, TrainingShape
    from fsdp_presets.plan.planner import plan
    from fsdp_presets.model.model_loading import build_meta_model, load_config
    from fsdp_presets.model.profile import profile_module
    from fsdp_presets.rehearse import rehearsal

    hf_logging.set_verbosity_error()
    for text in sys.argv[1:]:
        case = json.loads(text)
        config = load_config(case["model"])
        if case.get("layers"):
            config.num_hidden_layers = case["layers"]
            if getattr(config, "layer_types", None):
                config.layer_types = config.layer_types[:case["layers"]]
        profile = profile_module(build_meta_model(config))
        env = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "true",
               "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
               "FSDP_TRANSFORMER_CLS_TO_WRAP": ",".join(profile.wrap_classes),
               "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT", "ACCELERATE_MIXED_PRECISION": "bf16",
               "FSDP_ACTIVATION_CHECKPOINTING": "true" if case.get("ac") else "false"}
        tracker_class = rehearsal._tracker_class
        if case.get("torch_peaks"):
            from torch.distributed._tools.mem_tracker import MemTracker

            rehearsal._tracker_class = lambda: type("TorchPeaks", (tracker_class(),),
                                                    {"_update_peak_stats": MemTracker._update_peak_stats})
        try:
            result = rehearsal.rehearse(config, env, world_size=case["gpus"], seq_len=case["seq_len"],
                                        micro_batch=case.get("micro_batch", 1), grad_accum=case.get("grad_accum", 1))
        finally:
            rehearsal._tracker_class = tracker_class
        shape = TrainingShape(seq_len=case["seq_len"], micro_batch=case.get("micro_batch", 1),
                              grad_accum=case.get("grad_accum", 1), activation_checkpointing=bool(case.get("ac")))
        row = plan(profile, Hardware(gpus=case["gpus"], gpu_memory_bytes=80 * GiB), shape).get("FULL_SHARD", 2)
        print(json.dumps({"case": case, "peak_bytes": result.peak_bytes, "planner_bytes": row.per_gpu.total,
                          "by_category": result.peak_by_category, "where": result.peak_where,
                          "seconds": result.seconds}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
