"""Accuracy of a candidate against the fp32 model (``python -m bench --suite zoo
--precision bf16``): 1 - cosine similarity of the outputs, and top-1 agreement for
classifiers.

bf16 products are not meant to match fp32 to a tolerance, so the zoo suite reports how
far they land instead: the cosine of the angle between all outputs (flattened together,
in float64) and the fp32 model's, printed as ``1 - cos`` (0: the same direction), and
for a classifier the share of the batch whose arg-max class is the fp32 model's. A
classifier is a model with one output of shape ``(batch, classes)``; unit axes after
the batch axis are dropped first (SqueezeNet's ``(1, 1000, 1, 1)`` is one).
"""

from __future__ import annotations

import numpy as np


def cosine_error(outputs: list[np.ndarray], reference: list[np.ndarray]) -> float:
    """``1 - cos`` of the angle between ``outputs`` and ``reference``, all flattened
    together (0 when they point the same way; NaN if either is all zero)."""
    if len(outputs) != len(reference):
        raise ValueError(f"{len(outputs)} outputs vs {len(reference)} in the reference")
    a = np.concatenate([np.ravel(np.asarray(o, "float64")) for o in outputs])
    b = np.concatenate([np.ravel(np.asarray(r, "float64")) for r in reference])
    norms = np.linalg.norm(a) * np.linalg.norm(b)
    return float(1.0 - a @ b / norms) if norms > 0 else float("nan")


def class_scores(outputs: list[np.ndarray]) -> np.ndarray | None:
    """The ``(batch, classes)`` scores of a classifier's outputs, or None if the model is
    not one (several outputs, or more than one non-unit axis after the batch axis)."""
    if len(outputs) != 1 or np.ndim(outputs[0]) < 2:
        return None
    scores = np.asarray(outputs[0])
    axes = [d for d in scores.shape[1:] if d != 1]
    if len(axes) != 1 or axes[0] < 2:
        return None
    return scores.reshape(scores.shape[0], axes[0])


def top1_agreement(outputs: list[np.ndarray], reference: list[np.ndarray]) -> float | None:
    """The share of the batch whose arg-max class is the reference's (None if not a
    classifier)."""
    got, ref = class_scores(outputs), class_scores(reference)
    if got is None or ref is None:
        return None
    return float(np.mean(np.argmax(got, axis=1) == np.argmax(ref, axis=1)))


def accuracy_fields(outputs: dict[str, list[np.ndarray]], reference: list[np.ndarray]) -> dict:
    """``<who>_cos_err`` and ``<who>_top1`` of every candidate in ``outputs``."""
    row = {}
    for who, out in outputs.items():
        row[f"{who}_cos_err"] = cosine_error(out, reference)
        row[f"{who}_top1"] = top1_agreement(out, reference)
    return row
