"""Accuracy: the share of predictions equal to their references, as an ``evaluate`` metric.

A local copy of what the Hub's ``accuracy`` metric computes (sklearn's ``accuracy_score``,
unweighted), without sklearn, so that ``evaluate.load`` works offline.
"""

import datasets
import evaluate

_DESCRIPTION = "Accuracy = (number of predictions equal to their reference) / (number of predictions)."
_KWARGS_DESCRIPTION = """
Args:
    predictions (list of int): predicted labels.
    references (list of int): true labels.
Returns:
    accuracy (float): in [0, 1].
Example:
    >>> metric = evaluate.load("fsdp_presets/train/eval_metrics/accuracy")
    >>> metric.compute(predictions=[0, 1, 1], references=[0, 1, 0])
    {'accuracy': 0.6666666666666666}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("int32"),
                                        "references": datasets.Value("int32")}),
        )

    def _compute(self, predictions, references):
        if not references:
            raise ValueError("accuracy of zero predictions is undefined")
        correct = sum(int(prediction == reference) for prediction, reference in zip(predictions, references))
        return {"accuracy": correct / len(references)}
