"""The serving choice ``--quantization none|int8|int4`` and ``--quant-group-size``."""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet.allocator.fingerprint import QUANT_METHODS as METHODS

DEFAULT_GROUP_SIZE = 32  # llama.cpp's Q8_0 / Q4_0 / Q4_1 block: GGUF weights map as they are


@dataclass(frozen=True)
class QuantConfig:
    """Weight-only quantization of a replica's projections, embedding and LM head.

    ``method``: ``none`` (the checkpoint's float weights), ``int8`` or ``int4``.
    ``group_size``: consecutive inputs sharing one scale when weights are quantized at load
    (a quantized source keeps its own groups).

    Raises:
        ValueError: an unknown method or a group size below 2 (the message names the field).
    """

    method: str = "none"
    group_size: int = DEFAULT_GROUP_SIZE

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"quantization must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.group_size < 2 or self.group_size % 2:
            raise ValueError(f"quant_group_size must be an even integer >= 2, got {self.group_size}")

    @property
    def bits(self) -> int | None:
        """8, 4, or None for ``none``."""
        return None if self.method == "none" else int(self.method[3:])



FLOAT_WEIGHTS = QuantConfig()  # the checkpoint's float weights, unquantized
