"""Which implementation runs a model (``--model-impl``): kvfleet's native family module, or the
Hugging Face model class itself behind kvfleet's paged attention (:mod:`.fallback`).

``auto`` picks ``native`` when ``config.json``'s ``model_type`` (or, without one, its
architecture) is a registered family (:data:`~.model_families.FAMILIES`) and ``transformers``
otherwise; whether the Hugging Face class can then run behind the paged attention is checked
by :func:`kvfleet.worker.runner.fallback.check.check_fallback`, before anything starts.
Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvfleet.worker.runner.model_families import FAMILIES

MODEL_IMPLS = ("auto", "native", "transformers")
NATIVE, TRANSFORMERS = "native", "transformers"


def is_registered(raw: Mapping[str, Any]) -> bool:
    """Whether a registered native family claims ``raw`` (its ``model_type``, or without one
    its ``architectures``)."""
    model_type = raw.get("model_type")
    if model_type:
        return str(model_type) in FAMILIES
    archs = set(raw.get("architectures") or [])
    return any(archs & set(f.architectures) for f in FAMILIES.values())


def resolve_impl(raw: Mapping[str, Any], requested: str) -> str:
    """``native`` or ``transformers`` for ``raw`` under ``--model-impl requested``.

    Raises:
        ValueError: ``requested`` is not one of :data:`MODEL_IMPLS` (naming the field).
    """
    if requested not in MODEL_IMPLS:
        raise ValueError(f"model_impl must be one of {', '.join(MODEL_IMPLS)}, got {requested!r}")
    if requested != "auto":
        return requested
    return NATIVE if is_registered(raw) else TRANSFORMERS
