"""A decoder layer with int8 / int4 projections as one C call on decode-only steps
(``qlayer.c``).

On a decode step of a small quantized model the products are short, and the Python around
them (a dozen calls with their argument checks and allocations per layer) is a large share
of the step. Where a layer's shape allows (no qk-norm or sandwich norms, a SiLU-gated dense
MLP, every projection a plain :class:`~.linear.QuantLinear` on the C kernel) and every row of
the step is a decode through the C decode kernel, the model calls :class:`QuantDecodeLayer`
instead of its fused-ops path: the same kernels in the same order, so the same results bit
for bit. Layer arguments are resolved once at binding; the step's rows once a step
(:class:`~kvfleet.worker.runner.decode_rows.DecodeRows`); a layer's caches once per cache.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from kvfleet.worker.runner import layer_ops
from kvfleet.worker.runner.decode_rows import DecodeRows
from kvfleet.worker.runner.quant import kernels
from kvfleet.worker.runner.quant.linear import QuantLinear

_i64, _i32, _ptr, _f32 = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p, ctypes.c_float


class _Proj(ctypes.Structure):
    """``qproj_t``: one packed projection's kernel arguments."""

    _fields_ = [("bits", _i32), ("half", _i32), ("in_features", _i64), ("out_features", _i64),
                ("group", _i64), ("codes", _ptr), ("scale", _ptr), ("offset", _ptr), ("bias", _ptr)]


class _Layer(ctypes.Structure):
    """``qlayer_t``: a layer's fixed arguments."""

    _fields_ = [("qkv", _Proj), ("o", _Proj), ("gate_up", _Proj), ("down", _Proj),
                ("input_norm", _ptr), ("mlp_norm", _ptr), ("eps", _f32), ("attn_scale", _f32),
                ("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64),
                ("block_size", _i64), ("sinks", _ptr)]


def load() -> ctypes.CDLL | None:
    """The kernel library with the layer call's signature set, or None (no C compiler)."""
    lib = kernels.load()
    layer_ops.load()  # the layer's own small ops are in the same library
    if lib is not None and lib.quant_decode_layer.argtypes is None:  # not yet bound
        lib.quant_decode_layer.argtypes = [_ptr] * 7 + [_i64] + [_ptr] * 3
        lib.quant_decode_layer.restype = ctypes.c_int
    return lib


def _proj(p: Any) -> _Proj | None:
    """``p``'s kernel arguments, or None where ``p`` is not a plain C-run :class:`QuantLinear`."""
    if type(p) is not QuantLinear or p._product is None:
        return None
    w = p.weight
    return _Proj(w.bits, int(w.half_scales), w.in_features, w.out_features, w.group,
                 w.codes.data_ptr(), w.scale.data_ptr(),
                 None if w.offset is None else w.offset.data_ptr(),
                 None if p.bias is None else p.bias.data_ptr())


def _vector(t: torch.Tensor, n: int) -> bool:
    return t.dtype == torch.float32 and t.is_cpu and t.is_contiguous() and t.shape == (n,)


class QuantDecodeLayer:
    """One layer's decode as a C call (see the module docstring), bound to its projections.

    Build with :meth:`bind`; :attr:`runs` is False where the layer cannot take the C call
    (it then keeps its Python path). :meth:`current` tells whether the projections are still
    the ones bound (tensor parallelism and LoRA wrap them after the model is built).
    """

    __slots__ = ("runs", "qkv", "o", "mlp", "gate_up", "down", "struct", "address", "_fn",
                 "_caches", "_held")
    struct: _Layer
    address: int
    _fn: Any
    _held: tuple[Any, ...]

    def __init__(self, qkv: Any, o: Any, mlp: Any) -> None:
        self.qkv, self.o, self.mlp = qkv, o, mlp
        self.gate_up, self.down = mlp.gate_up, mlp.down
        self.runs = False
        self._caches: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def bind(cls, qkv: Any, o: Any, mlp: Any, input_norm: torch.Tensor, mlp_norm: torch.Tensor,
             eps: float, attn_scale: float, heads: int, kv_heads: int, head_dim: int,
             sinks: torch.Tensor | None) -> QuantDecodeLayer:
        """Bind a layer: ``qkv`` ``[hidden → (heads + 2 · kv_heads) · head_dim]``, ``o``,
        ``mlp`` (a SiLU-gated MLP with ``gate_up`` / ``down`` projections), its two norm
        weights ``(hidden,)``, ``eps``, the softmax scale, the head counts and ``sinks``
        ``(heads,)`` or None. Not :attr:`runs` unless every projection is a C-run
        :class:`QuantLinear` with matching widths and the norms are fp32 CPU vectors."""
        self = cls(qkv, o, mlp)
        lib = load()
        projs = [_proj(p) for p in (qkv, o, self.gate_up, self.down)]
        if lib is None or any(p is None for p in projs):
            return self
        hidden, q = input_norm.shape[0], heads * head_dim
        widths = [(p.in_features, p.out_features) for p in projs if p is not None]
        inter = widths[2][1] // 2
        if (widths != [(hidden, q + 2 * kv_heads * head_dim), (q, hidden), (hidden, 2 * inter),
                       (inter, hidden)]
                or not (_vector(input_norm, hidden) and _vector(mlp_norm, hidden))):
            return self
        if sinks is not None:
            sinks = sinks.to(torch.float32).contiguous()
        self.struct = _Layer(*projs, input_norm.data_ptr(), mlp_norm.data_ptr(), eps, attn_scale,
                             hidden, heads, kv_heads, head_dim, 0,
                             None if sinks is None else sinks.data_ptr())
        self.address = ctypes.addressof(self.struct)
        self._held = (input_norm, mlp_norm, sinks)
        self._fn = lib.quant_decode_layer
        self.runs = True
        return self

    def current(self, qkv: Any, o: Any) -> bool:
        """Whether the layer's projections are still the bound ones."""
        return (qkv is self.qkv and o is self.o and self.mlp.gate_up is self.gate_up
                and self.mlp.down is self.down)

    def check_caches(self, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
        s = self.struct
        shape = (s.kv_heads, s.head_dim)
        for c in (key_cache, value_cache):
            if (c.dtype != torch.float32 or not c.is_cpu or not c.is_contiguous() or c.dim() != 4
                    or tuple(c.shape[2:]) != shape or c.shape[:2] != key_cache.shape[:2]):
                raise ValueError(f"decode layer: caches must be contiguous fp32 (blocks, block_size, "
                                 f"{shape[0]}, {shape[1]}), got {c.dtype} {tuple(c.shape)}")
        s.block_size = key_cache.shape[1]
        self._caches = (key_cache, value_cache)

    def __call__(self, hidden: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor,
                 sin: torch.Tensor, rows: DecodeRows, window: int | None,
                 key_cache: torch.Tensor, value_cache: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer over the residual stream ``hidden + delta`` (``delta`` None: ``hidden``)
        of a decode-only step, as :meth:`LlamaDecoderLayer.forward
        <kvfleet.worker.runner.models.llama.LlamaDecoderLayer.forward>` (same contract: with a
        ``delta``, ``hidden`` is a layer's own and is written over).

        Args:
            hidden, delta: ``(T, hidden_size)`` fp32 CPU contiguous, ``T`` = ``rows``' rows.
            cos, sin: ``(T, 1, rotary_dim)`` contiguous, this layer's rope rows.
            rows: the step's :class:`DecodeRows`.
            window: this layer's sliding window (a key of ``rows.first``).
            key_cache, value_cache: this layer's ``(blocks, block_size, kv_heads, head_dim)``.

        Returns:
            ``(hidden, out)``: the stream after the layer is their sum.

        Raises:
            ValueError: caches of another layout, or ``hidden`` / ``delta`` not contiguous
                ``T`` rows.
            MemoryError: a kernel could not allocate its scratch.
        """
        caches = self._caches
        if caches is None or caches[0] is not key_cache or caches[1] is not value_cache:
            self.check_caches(key_cache, value_cache)
        shape = hidden.shape
        if (shape[0] != rows.struct.rows or shape[1] != self.struct.hidden
                or not hidden.is_contiguous()
                or (delta is not None and (delta.shape != shape or not delta.is_contiguous()))):
            raise ValueError(f"decode layer: hidden {tuple(shape)} for {rows.struct.rows} rows")
        if delta is None:  # the input is not ours to write over
            hidden = hidden.clone(memory_format=torch.contiguous_format)
        out = torch.empty_like(hidden)
        if self._fn(self.address, rows.address, hidden.data_ptr(),
                    None if delta is None else delta.data_ptr(), out.data_ptr(), cos.data_ptr(),
                    sin.data_ptr(), cos.shape[-1], rows.first[window], key_cache.data_ptr(),
                    value_cache.data_ptr()):
            raise MemoryError("decode layer: a kernel could not allocate its scratch")
        return hidden, out
