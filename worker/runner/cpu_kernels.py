"""Builds and calls kvfleet's C kernels (fp32 activations, CPU):

* ``paged_decode.c`` — decode attention read in place from the paged cache. The torch
  formulation costs two gather copies and an SDPA call per decode per layer, a large share of
  a decode step on CPU; the kernel reads each key and value once, where it lies,
  for every decode of a step in one call.
* ``gemv.c`` — projections of steps with a few query rows (a small decode batch, a verify
  chunk), streaming each weight once for all rows (oneDNN's packed path falls well short of
  the read bandwidth with so few rows).
* ``layer_ops.c`` — a decoder layer's small ops (norm with residual add, RoPE with the K/V
  write, SiLU · up) fused, bound and called by :mod:`kvfleet.worker.runner.layer_ops`.
* ``quant/qgemm.c`` — products with int8 / int4 packed weights (bound and called by
  :mod:`kvfleet.worker.runner.quant.kernels`).
* ``quant/qlayer.c`` — a decoder layer with such products as one call on decode-only steps
  (:mod:`kvfleet.worker.runner.quant.qlayer`), running the kernels above in sequence; and
  ``quant/qrows.c``, dequantized rows of a packed table (an embedding lookup).

All use OpenMP, sharing torch's own runtime (its bundled ``libgomp.so.1`` is already loaded
under that soname) and its thread count.

The library is compiled once per machine with the system C compiler (``$CC``, default ``cc``)
into ``$KVFLEET_CACHE_DIR/kernels/`` (default ``~/.cache/kvfleet``), keyed by a hash of sources,
flags and CPU; no torch headers, so a build takes about a second. Where there is no compiler,
the build fails, the tensors are not fp32 on CPU, or ``KVFLEET_C_KERNELS=torch`` is set,
the torch paths run instead (logged once): both are tested against the same references.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = (*(Path(__file__).with_name(name) for name in ("paged_decode.c", "gemv.c", "layer_ops.c")),
           *(Path(__file__).parent / "quant" / name for name in ("qgemm.c", "qlayer.c", "qrows.c")))
# The sources' shared declarations (each .c includes them by relative path): hashed with them.
HEADERS = (Path(__file__).with_name("kernels.h"), Path(__file__).parent / "quant" / "qkernels.h")
# The relaxed-math flags let GCC vectorise the dot products and sums; never
# -ffast-math or -funsafe-math-optimizations: with them GCC links crtfastmath.o, whose load
# switches the whole process (torch included) to flush-denormals-to-zero.
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
         "-fno-signed-zeros", "-freciprocal-math", "-fopenmp", "-shared", "-fPIC", "-std=c11")
ENV_SWITCH = "KVFLEET_C_KERNELS"  # "torch": both kernels off, the torch paths run


def _cache_dir() -> Path:
    root = os.environ.get("KVFLEET_CACHE_DIR") or Path.home() / ".cache" / "kvfleet"
    return Path(root) / "kernels"


def _cpu_signature() -> str:
    """The CPU's feature flags: ``-march=native`` code must not run on another CPU model
    (a cache directory shared between unlike nodes)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build(compiler: str) -> Path:
    """Compile (or reuse) the shared library; returns its path. Raises OSError / CalledProcessError."""
    source = b"".join(src.read_bytes() for src in (*SOURCES, *HEADERS))
    key = hashlib.sha256(source + " ".join((compiler, *FLAGS, _cpu_signature())).encode()).hexdigest()[:16]
    lib = _cache_dir() / f"kvfleet-kernels-{key}.so"
    if lib.is_file():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target, then rename: concurrent workers never load a half-written file.
    with tempfile.NamedTemporaryFile(dir=lib.parent, suffix=".so", delete=False) as tmp:
        pass
    try:
        subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", tmp.name, "-lm"], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(tmp.name, lib)
    finally:
        Path(tmp.name).unlink(missing_ok=True)
    return lib


@functools.cache
def load() -> ctypes.CDLL | None:
    """The loaded kernel library, or None where it is disabled or cannot be built (logged)."""
    if os.environ.get(ENV_SWITCH, "").lower() == "torch":
        return None
    compiler = os.environ.get("CC", "cc")
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except subprocess.CalledProcessError as exc:
        log.warning("C kernels (decode attention, few-row GEMV): %s failed (%s); using the "
                    "torch path", compiler, (exc.stderr or "").strip()[:500])
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("C kernels (decode attention, few-row GEMV) unavailable (%s); using the "
                    "torch path", exc)
        return None
    fn = lib.paged_decode_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64,
                   ctypes.c_float, ptr, ctypes.c_int]
    fn.restype = ctypes.c_int
    lib.gemm_few_rows.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, ctypes.c_int]
    lib.gemm_few_rows.restype = None
    lib.few_rows_panel_width.restype = ctypes.c_int
    return lib


def pack_panels(weight_in_out: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``weight_in_out`` ``[in, out]`` as :func:`gemv`'s panels: ``(ceil(out / w), in, w)``
    contiguous, ``w`` the kernel's panel width, zero past column ``out``."""
    width = _loaded(lib).few_rows_panel_width()
    in_features, out_features = weight_in_out.shape
    count = -(-out_features // width)
    padded = weight_in_out.new_zeros(in_features, count * width)
    padded[:, :out_features] = weight_in_out
    return padded.view(in_features, count, width).permute(1, 0, 2).contiguous()


def gemv(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int,
         lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``x`` ``(m, in)`` · W (+ ``bias`` ``(out,)``) → ``(m, out_features)``, W held as
    :func:`pack_panels`' ``panels``; reads W once for all ``m`` rows, so it is meant for a
    few rows (see :data:`kvfleet.worker.runner.models.linear.FEW_ROWS`).

    ``lib``: the library a caller loaded when it chose this path (default :func:`load`, which
    callers check first); all tensors fp32 on CPU.

    Raises:
        ValueError: shapes that do not match, no rows, or non-contiguous panels or bias.
    """
    count, in_features, width = panels.shape
    if (x.dim() != 2 or x.shape[0] < 1 or x.shape[1] != in_features
            or not count * width - width < out_features <= count * width
            or (bias is not None and bias.shape != (out_features,))):
        raise ValueError(f"gemv: x {tuple(x.shape)}, panels {tuple(panels.shape)}, "
                         f"{out_features} outputs")
    if not panels.is_contiguous() or (bias is not None and not bias.is_contiguous()):
        raise ValueError("gemv: panels and bias must be contiguous")
    x = x.contiguous()
    y = x.new_empty(x.shape[0], out_features)
    _loaded(lib).gemm_few_rows(x.data_ptr(), x.shape[0], panels.data_ptr(),
                               None if bias is None else bias.data_ptr(), y.data_ptr(),
                               in_features, out_features, torch.get_num_threads())
    return y


def _loaded(lib: ctypes.CDLL | None) -> ctypes.CDLL:
    """``lib``, else the loaded library; callers check :func:`load` succeeded first."""
    lib = lib or load()
    if lib is None:
        raise RuntimeError("the C kernels are not loaded (see cpu_kernels.load)")
    return lib


def decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     out: torch.Tensor, token: torch.Tensor, tables: torch.Tensor,
                     table_start: torch.Tensor, first: torch.Tensor, ctx: torch.Tensor,
                     scale: float, sinks: torch.Tensor | None = None) -> None:
    """Write ``out[token[d]]`` = attention of ``query[token[d]]`` over keys ``first[d] ..
    ctx[d] - 1`` of decode ``d`` (all int64 CPU tensors; see ``paged_decode.c`` for layouts);
    ``sinks`` ``(num_heads,)`` fp32: per-head sink logits in each softmax's denominator.

    ``query``/``out`` ``(T, num_heads, head_dim)`` with the last two dims contiguous; caches
    ``(num_blocks, block_size, num_kv_heads, head_dim)`` contiguous. Indices are trusted: the
    model runner has checked every block table against the pool before the forward.

    Raises:
        ValueError: a layout the kernel cannot read.
        MemoryError: the kernel's scratch allocation failed.
    """
    _, block_size, kv_heads, head_dim = key_cache.shape
    num_heads = query.shape[1]
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()
            and query.stride()[1:] == (head_dim, 1) and out.stride()[1:] == (head_dim, 1)):
        raise ValueError("decode kernel: caches must be contiguous and rows (heads, head_dim) dense")
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
        if sinks.shape != (num_heads,):
            raise ValueError(f"decode kernel: sinks {tuple(sinks.shape)}, want ({num_heads},)")
    status = _loaded(None).paged_decode_attention(
        query.data_ptr(), query.stride(0), out.data_ptr(), out.stride(0),
        key_cache.data_ptr(), value_cache.data_ptr(), token.data_ptr(), tables.data_ptr(),
        table_start.data_ptr(), first.data_ptr(), ctx.data_ptr(), token.numel(), num_heads,
        kv_heads, head_dim, block_size, scale, None if sinks is None else sinks.data_ptr(),
        min(torch.get_num_threads(), token.numel() * kv_heads))  # tasks per (decodes, KV head)
    if status != 0:
        raise MemoryError("decode kernel: could not allocate its scratch buffers")
