"""fsdp-presets: configure, check and prove PyTorch FSDP training of Hugging Face models.

A training script launched with ``accelerate launch`` calls :func:`enable_cpu_fsdp` before it
builds its ``Accelerator`` so that the same FSDP config also runs, for real, on a CPU-only host.
"""

__version__ = "0.1.0"


def enable_cpu_fsdp() -> bool:
    """Make accelerate run real FSDP (or DDP) over gloo on a host without an accelerator.

    Returns True when the CPU mode was switched on, False on a host with an accelerator
    (where it does nothing). See :mod:`fsdp_presets.cpu_fsdp`.
    """
    from fsdp_presets.cpu_fsdp import enable_cpu_fsdp as _enable

    return _enable()


def check_launch(accelerator) -> None:
    """Raise when a multi-process launch ended up as independent single-process trainings
    (see :func:`fsdp_presets.cpu_fsdp.check_launch`)."""
    from fsdp_presets.cpu_fsdp import check_launch as _check

    _check(accelerator)


def __getattr__(name: str):
    """``FSDPPresetsCallback`` (a ``transformers.TrainerCallback``) is imported on first use, so that
    ``import fsdp_presets`` stays light (see :mod:`fsdp_presets.train.trainer_callback`)."""
    if name == "FSDPPresetsCallback":
        from fsdp_presets.train.trainer_callback import FSDPPresetsCallback

        return FSDPPresetsCallback
    raise AttributeError(f"module 'fsdp_presets' has no attribute {name!r}")


__all__ = ["FSDPPresetsCallback", "__version__", "check_launch", "enable_cpu_fsdp"]
