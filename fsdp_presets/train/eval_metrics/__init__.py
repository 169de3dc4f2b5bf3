"""Local ``evaluate`` metric modules (the Hugging Face Hub ones cannot be loaded offline).

    import evaluate
    from fsdp_presets.train.eval_metrics import metric_path
    accuracy = evaluate.load(metric_path("accuracy"))
"""

from pathlib import Path


def metric_path(name: str) -> str:
    """Folder of a metric shipped with this package, for ``evaluate.load``."""
    return str(Path(__file__).resolve().parent / name)
