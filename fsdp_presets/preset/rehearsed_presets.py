"""Rehearsed peaks of the shipped presets (``accelerate_configs/``): data, one entry per file,
each the result of ``fsdp-presets rehearse accelerate_configs/NAME.yaml --json`` on the settings it
names. ``generate`` writes the entry into a preset's header when the preset's settings are the
recorded ones (and only then: a changed preset is rehearsed again before it claims a number).
``tests/test_rehearse.py`` checks that every shipped GPU preset has a current entry, that it fits
the GPU, that the planner agrees with it within 10%, and rehearses one again to check the record.

Presets sharded over the same group size with the same micro-batch, checkpointing and gradient
reduction hold the same bytes per GPU (the accumulation count beyond two and the HSDP replicas
change the traffic, not the peak: see :data:`fsdp_presets.rehearse.rehearsal.REHEARSED_MICRO_BATCHES`);
their entries (:data:`SAME_AS`) name the rehearsal they share and keep only what is their own
(the change note); :data:`REHEARSED`, every file's full record, is derived from the two tables.
"""

from __future__ import annotations

import re

SETTING_KEYS = ("processes", "sharding", "precision", "activation_checkpointing", "offload", "seq_len",
                "micro_batch", "reduce_every_micro_batch")
"""The preset summary fields a record depends on (``Preset.summary()``)."""

REHEARSED_RUNS = {'gemma-2-9b_1x8.yaml': {'settings': {'processes': 8,
                                      'sharding': 'FULL_SHARD 8',
                                      'precision': 'bf16',
                                      'activation_checkpointing': True,
                                      'offload': False,
                                      'seq_len': 4096,
                                      'micro_batch': 2,
                                      'reduce_every_micro_batch': False},
                         'peak_bytes': 66433448018,
                         'planner_bytes': 66308977265,
                         'where': 'at the start of backward',
                         'command': 'fsdp-presets rehearse accelerate_configs/gemma-2-9b_1x8.yaml',
                         'change': 'activation_checkpointing False -> True: the earlier settings need 316.1 '
                                   'GiB per GPU (planner checked against rehearsals; the earlier planner '
                                   'left out the unsharded gradients no_sync accumulation holds and '
                                   'under-counted activations)'},
 'llama-3.1-70b_1x8.yaml': {'settings': {'processes': 8,
                                         'sharding': 'FULL_SHARD 8',
                                         'precision': 'bf16',
                                         'activation_checkpointing': True,
                                         'offload': True,
                                         'seq_len': 4096,
                                         'micro_batch': 4,
                                         'reduce_every_micro_batch': True},
                            'peak_bytes': 49929507340,
                            'planner_bytes': 49883544945,
                            'where': 'at the start of backward',
                            'command': 'fsdp-presets rehearse accelerate_configs/llama-3.1-70b_1x8.yaml',
                            'change': 'gradients reduced every micro-batch: the earlier settings need 177.9 '
                                      'GiB per GPU (planner checked against rehearsals; the earlier planner '
                                      'left out the unsharded gradients no_sync accumulation holds and '
                                      'under-counted activations)'},
 'llama-3.1-70b_4x8.yaml': {'settings': {'processes': 32,
                                         'sharding': 'FULL_SHARD 32',
                                         'precision': 'bf16',
                                         'activation_checkpointing': True,
                                         'offload': False,
                                         'seq_len': 4096,
                                         'micro_batch': 2,
                                         'reduce_every_micro_batch': True},
                            'peak_bytes': 61293356376,
                            'planner_bytes': 61269307065,
                            'where': 'at the start of backward',
                            'command': 'fsdp-presets rehearse accelerate_configs/llama-3.1-70b_4x8.yaml',
                            'change': 'gradients reduced every micro-batch: the earlier settings need 180.3 '
                                      'GiB per GPU (planner checked against rehearsals; the earlier planner '
                                      'left out the unsharded gradients no_sync accumulation holds and '
                                      'under-counted activations)'},
 'llama-3.1-8b_1x8.yaml': {'settings': {'processes': 8,
                                        'sharding': 'FULL_SHARD 8',
                                        'precision': 'bf16',
                                        'activation_checkpointing': False,
                                        'offload': False,
                                        'seq_len': 4096,
                                        'micro_batch': 1,
                                        'reduce_every_micro_batch': False},
                           'peak_bytes': 64604349080,
                           'planner_bytes': 64604168783,
                           'where': 'at the start of backward',
                           'command': 'fsdp-presets rehearse accelerate_configs/llama-3.1-8b_1x8.yaml',
                           'change': 'micro_batch 2 -> 1, gradient_accumulation 16 -> 32: micro-batch 2 x 16 '
                                     'under no_sync rehearses at 93.2 GiB per GPU (15.0 GiB of them '
                                     'unsharded gradients held between micro-batches); the earlier planner '
                                     'said 63.1 GiB'},
 'mistral-7b-v0.3_1x8.yaml': {'settings': {'processes': 8,
                                           'sharding': 'FULL_SHARD 8',
                                           'precision': 'bf16',
                                           'activation_checkpointing': False,
                                           'offload': False,
                                           'seq_len': 4096,
                                           'micro_batch': 1,
                                           'reduce_every_micro_batch': False},
                              'peak_bytes': 56391999128,
                              'planner_bytes': 56499780175,
                              'where': 'at the start of backward',
                              'command': 'fsdp-presets rehearse accelerate_configs/mistral-7b-v0.3_1x8.yaml',
                              'change': 'micro_batch 2 -> 1, gradient_accumulation 16 -> 32: the earlier '
                                        'settings need 81.2 GiB per GPU (planner checked against rehearsals; '
                                        'the earlier planner left out the unsharded gradients no_sync '
                                        'accumulation holds and under-counted activations)'},
 'mixtral-8x7b_1x8.yaml': {'settings': {'processes': 8,
                                        'sharding': 'FULL_SHARD 8',
                                        'precision': 'bf16',
                                        'activation_checkpointing': False,
                                        'offload': True,
                                        'seq_len': 4096,
                                        'micro_batch': 1,
                                        'reduce_every_micro_batch': True},
                           'peak_bytes': 57932514796,
                           'planner_bytes': 57894315951,
                           'where': "in a block's backward",
                           'command': 'fsdp-presets rehearse accelerate_configs/mixtral-8x7b_1x8.yaml',
                           'change': 'micro_batch 2 -> 1, gradient_accumulation 16 -> 32, gradients reduced '
                                     'every micro-batch: the earlier settings need 186.5 GiB per GPU '
                                     '(planner checked against rehearsals; the earlier planner left out the '
                                     'unsharded gradients no_sync accumulation holds, under-counted '
                                     'activations and split fused experts evenly over the ranks)'},
 'phi-3-mini-4k_1x8.yaml': {'settings': {'processes': 8,
                                         'sharding': 'FULL_SHARD 8',
                                         'precision': 'bf16',
                                         'activation_checkpointing': False,
                                         'offload': False,
                                         'seq_len': 4096,
                                         'micro_batch': 2,
                                         'reduce_every_micro_batch': False},
                            'peak_bytes': 60447295640,
                            'planner_bytes': 60446159526,
                            'where': 'at the start of backward',
                            'command': 'fsdp-presets rehearse accelerate_configs/phi-3-mini-4k_1x8.yaml',
                            'change': 'micro_batch 4 -> 2, gradient_accumulation 8 -> 16: the earlier '
                                      'settings need 100.0 GiB per GPU (planner checked against rehearsals; '
                                      'the earlier planner left out the unsharded gradients no_sync '
                                      'accumulation holds and under-counted activations)'},
 'qwen2.5-7b_1x8.yaml': {'settings': {'processes': 8,
                                      'sharding': 'FULL_SHARD 8',
                                      'precision': 'bf16',
                                      'activation_checkpointing': False,
                                      'offload': False,
                                      'seq_len': 4096,
                                      'micro_batch': 1,
                                      'reduce_every_micro_batch': False},
                         'peak_bytes': 63536191576,
                         'planner_bytes': 63535872109,
                         'where': 'at the start of backward',
                         'command': 'fsdp-presets rehearse accelerate_configs/qwen2.5-7b_1x8.yaml',
                         'change': 'micro_batch 2 -> 1, gradient_accumulation 16 -> 32: the earlier settings '
                                   'need 92.5 GiB per GPU (planner checked against rehearsals; the earlier '
                                   'planner left out the unsharded gradients no_sync accumulation holds and '
                                   'under-counted activations)'}}
"""``file name -> {"settings", "peak_bytes", "planner_bytes", "where", "command", ["change"]}``: the
presets rehearsed themselves."""

SAME_AS = {'gemma-2-9b_2x8.yaml': {'same_as': 'gemma-2-9b_1x8.yaml',
                         'change': 'activation_checkpointing False -> True: the earlier settings need 316.1 '
                                   'GiB per GPU (planner checked against rehearsals; the earlier planner '
                                   'left out the unsharded gradients no_sync accumulation holds and '
                                   'under-counted activations)'},
 'gemma-2-9b_4x8.yaml': {'same_as': 'gemma-2-9b_1x8.yaml',
                         'change': 'activation_checkpointing False -> True: the earlier settings need 316.1 '
                                   'GiB per GPU (planner checked against rehearsals; the earlier planner '
                                   'left out the unsharded gradients no_sync accumulation holds and '
                                   'under-counted activations)'},
 'llama-3.1-70b_2x8.yaml': {'same_as': 'llama-3.1-70b_1x8.yaml',
                            'change': 'gradients reduced every micro-batch: the earlier settings need 177.9 '
                                      'GiB per GPU (planner checked against rehearsals; the earlier planner '
                                      'left out the unsharded gradients no_sync accumulation holds and '
                                      'under-counted activations)'},
 'llama-3.1-8b_2x8.yaml': {'same_as': 'llama-3.1-8b_1x8.yaml',
                           'change': 'micro_batch 2 -> 1, gradient_accumulation 8 -> 16: the earlier '
                                     'settings need 93.2 GiB per GPU (planner checked against rehearsals; '
                                     'the earlier planner left out the unsharded gradients no_sync '
                                     'accumulation holds and under-counted activations)'},
 'llama-3.1-8b_4x8.yaml': {'same_as': 'llama-3.1-8b_1x8.yaml',
                           'change': 'micro_batch 2 -> 1, gradient_accumulation 4 -> 8: the earlier settings '
                                     'need 93.2 GiB per GPU (planner checked against rehearsals; the earlier '
                                     'planner left out the unsharded gradients no_sync accumulation holds '
                                     'and under-counted activations)'},
 'mistral-7b-v0.3_2x8.yaml': {'same_as': 'mistral-7b-v0.3_1x8.yaml',
                              'change': 'micro_batch 2 -> 1, gradient_accumulation 8 -> 16: the earlier '
                                        'settings need 81.2 GiB per GPU (planner checked against rehearsals; '
                                        'the earlier planner left out the unsharded gradients no_sync '
                                        'accumulation holds and under-counted activations)'},
 'mistral-7b-v0.3_4x8.yaml': {'same_as': 'mistral-7b-v0.3_1x8.yaml',
                              'change': 'micro_batch 2 -> 1, gradient_accumulation 4 -> 8: the earlier '
                                        'settings need 81.2 GiB per GPU (planner checked against rehearsals; '
                                        'the earlier planner left out the unsharded gradients no_sync '
                                        'accumulation holds and under-counted activations)'},
 'mixtral-8x7b_2x8.yaml': {'same_as': 'mixtral-8x7b_1x8.yaml',
                           'change': 'sharding FULL_SHARD 16 -> HSDP 2x8, offload False -> True, gradients '
                                     'reduced every micro-batch: the earlier settings need 205.8 GiB per GPU '
                                     '(planner checked against rehearsals; the earlier planner left out the '
                                     'unsharded gradients no_sync accumulation holds, under-counted '
                                     'activations and split fused experts evenly over the ranks)'},
 'mixtral-8x7b_4x8.yaml': {'same_as': 'mixtral-8x7b_1x8.yaml',
                           'change': 'sharding FULL_SHARD 32 -> HSDP 4x8, offload False -> True, micro_batch '
                                     '2 -> 1, gradient_accumulation 4 -> 8, gradients reduced every '
                                     'micro-batch: the earlier settings need 250.8 GiB per GPU (planner '
                                     'checked against rehearsals; the earlier planner left out the unsharded '
                                     'gradients no_sync accumulation holds, under-counted activations and '
                                     'split fused experts evenly over the ranks)'},
 'phi-3-mini-4k_2x8.yaml': {'same_as': 'phi-3-mini-4k_1x8.yaml',
                            'change': 'micro_batch 4 -> 2, gradient_accumulation 4 -> 8: the earlier '
                                      'settings need 100.0 GiB per GPU (planner checked against rehearsals; '
                                      'the earlier planner left out the unsharded gradients no_sync '
                                      'accumulation holds and under-counted activations)'},
 'phi-3-mini-4k_4x8.yaml': {'same_as': 'phi-3-mini-4k_1x8.yaml',
                            'change': 'micro_batch 4 -> 2, gradient_accumulation 2 -> 4: the earlier '
                                      'settings need 100.0 GiB per GPU (planner checked against rehearsals; '
                                      'the earlier planner left out the unsharded gradients no_sync '
                                      'accumulation holds and under-counted activations)'},
 'qwen2.5-7b_2x8.yaml': {'same_as': 'qwen2.5-7b_1x8.yaml',
                         'change': 'micro_batch 2 -> 1, gradient_accumulation 8 -> 16: the earlier settings '
                                   'need 92.5 GiB per GPU (planner checked against rehearsals; the earlier '
                                   'planner left out the unsharded gradients no_sync accumulation holds and '
                                   'under-counted activations)'},
 'qwen2.5-7b_4x8.yaml': {'same_as': 'qwen2.5-7b_1x8.yaml',
                         'change': 'micro_batch 2 -> 1, gradient_accumulation 4 -> 8: the earlier settings '
                                   'need 92.5 GiB per GPU (planner checked against rehearsals; the earlier '
                                   'planner left out the unsharded gradients no_sync accumulation holds and '
                                   'under-counted activations)'}}
"""``file name -> {"same_as": file name in REHEARSED_RUNS, "change"}``: HSDP presets (``NAME_NxG``)
whose shard group is the rehearsed preset's G GPUs with the same micro-batch, so the same per-GPU step."""


def _shared_record(name: str, entry: dict) -> dict:
    """The full record of an HSDP preset that shares ``entry["same_as"]``'s rehearsal: its numbers and
    command, with this preset's processes, mesh and change note."""
    match = re.fullmatch(r".+_(\d+)x(\d+)\.ya?ml", name)
    if match is None:
        raise ValueError(f"{name}: a SAME_AS entry needs a NAME_NxG.yaml file name (N nodes of G GPUs)")
    nodes, per_node = int(match[1]), int(match[2])
    base = REHEARSED_RUNS[entry["same_as"]]
    return {**base, "settings": {**base["settings"], "processes": nodes * per_node, "sharding": f"HSDP {nodes}x{per_node}"},
            "same_as": f"{entry['same_as']} (HSDP shards over the same {per_node} GPUs with the same micro-batch)",
            **{key: value for key, value in entry.items() if key != "same_as"}}


REHEARSED = {**REHEARSED_RUNS, **{name: _shared_record(name, entry) for name, entry in SAME_AS.items()}}
"""``file name -> {"settings", "peak_bytes", "planner_bytes", "where", "command", ["same_as"], ["change"]}``."""


def recorded_rehearsal(output: str, summary: dict) -> dict | None:
    """The record of the shipped preset written to ``output`` when ``summary`` has its settings."""
    from pathlib import PurePosixPath

    record = REHEARSED.get(PurePosixPath(output).name)
    if record is None or record["settings"] != {key: summary.get(key) for key in SETTING_KEYS}:
        return None
    return record


NOT_REHEARSED: dict[str, str] = {}
"""Shipped presets whose own settings are not rehearsed yet, each with why."""


def missing_rehearsal(output: str) -> str | None:
    """Why the shipped preset written to ``output`` has no rehearsal of its own, or None."""
    from pathlib import PurePosixPath

    return NOT_REHEARSED.get(PurePosixPath(output).name)
