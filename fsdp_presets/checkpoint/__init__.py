"""Checkpoints and run folders on disk: ``layout`` names every file and folder, ``manager`` saves,
rotates and resumes, ``inspect`` reports, ``convert`` moves between DCP and a Hugging Face folder,
``safe_unpickle`` reads what a checkpoint from elsewhere holds without running its code.

This package never imports :mod:`fsdp_presets.plan`.
"""

from fsdp_presets.checkpoint.manager import CheckpointManager, checkpoint_verdict

__all__ = ["CheckpointManager", "checkpoint_verdict"]
