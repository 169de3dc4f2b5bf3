"""Checkpoints and run folders on disk: ``layout`` names every file and folder and the path rules,
``manifest`` says what a checkpoint holds (kind, format, digests), ``manager`` saves, rotates and
finds checkpoints, ``resume`` continues one at another process count or from an import,
``inspect`` reports, ``convert`` (``export``, ``import_hf``, ``hf_model``, ``outputs``, ``adapter``)
moves between DCP and a Hugging Face or PEFT folder, ``safe_unpickle`` reads what a checkpoint
from elsewhere holds without running its code.

This package never imports :mod:`fsdp_presets.plan`.
"""

from fsdp_presets.checkpoint.manager import CheckpointManager, checkpoint_verdict

__all__ = ["CheckpointManager", "checkpoint_verdict"]
