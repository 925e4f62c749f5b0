"""A decode-only step's row layout as C kernel arguments, built once a step.

When every chunk of a step is a single-token decode run by the C decode kernel, each row is
one decode and the layers all read the same slots, block tables and key counts. A fused
layer kernel (:mod:`kvfleet.worker.runner.quant.qlayer`) takes them as one struct made here,
checked once, rather than re-reading and re-checking the tensors at every layer.
"""

from __future__ import annotations

import ctypes

import torch


class StepStruct(ctypes.Structure):
    """``qstep_t`` of ``quant/qlayer.c``: row ``d`` of the step is decode ``d``."""

    _fields_ = [("rows", ctypes.c_int64), ("slots", ctypes.c_void_p), ("token", ctypes.c_void_p),
                ("tables", ctypes.c_void_p), ("table_start", ctypes.c_void_p),
                ("ctx", ctypes.c_void_p), ("num_threads", ctypes.c_int32)]


class DecodeRows:
    """The decode kernel's arguments of one step whose rows are all decodes.

    Args:
        slot_mapping, token, tables, table_start, context: ``(T,)``, ``(T,)``, ``(n,)``,
            ``(T + 1,)``, ``(T,)`` int64 CPU tensors (see
            :class:`~kvfleet.worker.runner.attention.DecodeKernelArgs`); held, so that the
            addresses in :attr:`struct` stay valid.
        first_key: window → ``(T,)`` int64, each decode's first visible key.

    Attributes:
        struct: the :class:`StepStruct`; ``address`` its address for a ``void *`` argument.
        first: window → address of that window's first-key tensor.

    Raises:
        ValueError: a tensor that is not contiguous int64 on CPU, or of the wrong length.
    """

    __slots__ = ("struct", "address", "first", "_held")

    def __init__(self, slot_mapping: torch.Tensor, token: torch.Tensor, tables: torch.Tensor,
                 table_start: torch.Tensor, context: torch.Tensor,
                 first_key: dict[int | None, torch.Tensor]) -> None:
        rows = slot_mapping.shape[0]
        held = (slot_mapping, token, tables, table_start, context, *first_key.values())
        lengths = (rows, rows, None, rows + 1, rows, *[rows] * len(first_key))
        for t, n in zip(held, lengths, strict=True):
            if (t.dtype != torch.int64 or not t.is_cpu or not t.is_contiguous() or t.dim() != 1
                    or (n is not None and t.shape[0] != n)):
                raise ValueError(f"decode rows: want ({n},) contiguous int64 CPU tensors, got "
                                 f"{t.dtype} {tuple(t.shape)}")
        self._held = held
        self.struct = StepStruct(rows, slot_mapping.data_ptr(), token.data_ptr(), tables.data_ptr(),
                                 table_start.data_ptr(), context.data_ptr(), torch.get_num_threads())
        self.address = ctypes.addressof(self.struct)
        self.first = {w: t.data_ptr() for w, t in first_key.items()}
