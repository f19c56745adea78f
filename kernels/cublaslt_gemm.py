"""out = x @ weight.T + c in one cuBLASLt call: the GEMM adds an addend in its epilogue.

GEMM-RS (kernels/gemm_rs_cuda.py) uses it to add the peer's partial sum of its
own rows while the own-rows GEMM writes them, instead of a separate pass that
reads two [m, N] tensors and writes a third. torch has no such call: ``torch.
addmm(c, a, b, out=o)`` first copies c into o, and ``torch._scaled_mm`` takes
no addend. cuBLASLt computes D = alpha * op(A) op(B) + beta * C with C and D
apart, for BF16 and for FP8 with DeepSeek block scales (1 x 128 activation
groups, 128 x 128 weight blocks: the layout ``torch._scaled_mm`` uses, see
kernels/fp8_gemm_cuda.py), so it is called here through ctypes on the
libcublasLt that torch has loaded.

    try_matmul_add(x, weight, c, out, x_scale=None, weight_scale=None) -> bool

returns False (and does nothing) where the call does not apply: CPU tensors,
shapes or dtypes outside what is set up here, or a cuBLASLt that offers no
algorithm for it (remembered per case, and said once in the log). The caller
then does the GEMM and the add itself. Everything it enqueues is one
``cublasLtMatmul`` on the current stream (capturable in a CUDA graph); the
descriptors and the 32 MiB workspace are made on first use per shape and kept.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch

log = logging.getLogger("minimax")

__all__ = ["try_matmul_add", "unavailable_reasons"]

# cuBLASLt / CUDA enum values (library_types.h, cublasLt.h; unchanged from CUDA 12.9 to 13.x)
_CUDA_TYPE = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 14, torch.float8_e4m3fn: 28}
_CUBLAS_COMPUTE_32F = 68
_CUDA_R_32F = 0
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER = 17, 18
_DESC_A_SCALE_MODE, _DESC_B_SCALE_MODE = 31, 32
_SCALE_VEC128_32F, _SCALE_BLK128X128_32F = 4, 5
_PREF_MAX_WORKSPACE_BYTES = 1
_WORKSPACE_BYTES = 32 << 20  # what cuBLAS asks for on Hopper
_BLOCK = 128


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class _LtError(RuntimeError):
    pass


_LIB = None
_HANDLE = None
_PLANS: dict[tuple, "_Plan"] = {}
_WORKSPACE: dict[int, torch.Tensor] = {}
_UNAVAILABLE: dict[tuple, str] = {}  # case -> why (said once)
_ONE = ctypes.c_float(1.0)


def unavailable_reasons() -> dict[tuple, str]:
    """The cases where try_matmul_add said no, and why (for reports and tests)."""
    return dict(_UNAVAILABLE)


def _find_library() -> ctypes.CDLL:
    # The copy torch loaded (its pip wheel's), so there is one cuBLAS in the process.
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if os.path.basename(path).startswith("libcublasLt.so"):
                    return ctypes.CDLL(path)
    except OSError:
        pass
    for name in ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise _LtError("libcublasLt not found in the process or on the library path")


def _check(status: int, what: str) -> None:
    if status != 0:
        raise _LtError(f"{what} returned cuBLAS status {status}")


def _lib():
    global _LIB, _HANDLE
    if _LIB is None:
        lib = _find_library()
        vp, sz, i64, u64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64, ctypes.c_uint64
        lib.cublasLtCreate.argtypes = [ctypes.POINTER(vp)]
        lib.cublasLtMatmulDescCreate.argtypes = [ctypes.POINTER(vp), ctypes.c_int, ctypes.c_int]
        lib.cublasLtMatmulDescSetAttribute.argtypes = [vp, ctypes.c_int, vp, sz]
        lib.cublasLtMatrixLayoutCreate.argtypes = [ctypes.POINTER(vp), ctypes.c_int, u64, u64, i64]
        lib.cublasLtMatmulPreferenceCreate.argtypes = [ctypes.POINTER(vp)]
        lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [vp, ctypes.c_int, vp, sz]
        lib.cublasLtMatmulPreferenceDestroy.argtypes = [vp]
        lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [vp, vp, vp, vp, vp, vp, vp, ctypes.c_int,
                                                       ctypes.POINTER(_Heuristic), ctypes.POINTER(ctypes.c_int)]
        lib.cublasLtMatmul.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp,
                                       ctypes.POINTER(_Algo), vp, sz, vp]
        handle = vp()
        _check(lib.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
        _LIB, _HANDLE = lib, handle
    return _LIB


def _set(lib, desc, attr: int, value: ctypes._SimpleCData) -> None:
    _check(lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
           f"cublasLtMatmulDescSetAttribute({attr})")


def _set_scales(lib, desc, weight_scales: torch.Tensor, x_scales: torch.Tensor) -> None:
    _set(lib, desc, _DESC_A_SCALE_POINTER, ctypes.c_void_p(weight_scales.data_ptr()))
    _set(lib, desc, _DESC_B_SCALE_POINTER, ctypes.c_void_p(x_scales.data_ptr()))


def _layout(lib, dtype: torch.dtype, rows: int, cols: int, ld: int):
    layout = ctypes.c_void_p()
    _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), _CUDA_TYPE[dtype], rows, cols, ld),
           "cublasLtMatrixLayoutCreate")
    return layout


@dataclass
class _Plan:
    """Descriptors + chosen algorithm for one (dtypes, M, N, K, leading dims) case.

    Column-major view of row-major tensors, as torch's own cuBLAS calls do:
    A = weight (K x N, ld K, transposed), B = x (K x M, ld K), C = D = out^T (N x M, ld N)."""

    desc: ctypes.c_void_p
    layouts: tuple
    algo: _Algo


def _plan(key: tuple, x: torch.Tensor, weight: torch.Tensor, c: torch.Tensor, out: torch.Tensor,
          scales: Optional[tuple]) -> _Plan:
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    lib = _lib()
    m, k = x.shape
    n = weight.shape[0]
    desc = ctypes.c_void_p()
    _check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _CUBLAS_COMPUTE_32F, _CUDA_R_32F), "cublasLtMatmulDescCreate")
    _set(lib, desc, _DESC_TRANSA, ctypes.c_int32(_OP_T))
    _set(lib, desc, _DESC_TRANSB, ctypes.c_int32(_OP_N))
    if scales is not None:  # the heuristic checks the scale pointers too (status 7 without them on the H200)
        _set_scales(lib, desc, *scales)
        _set(lib, desc, _DESC_A_SCALE_MODE, ctypes.c_int32(_SCALE_BLK128X128_32F))
        _set(lib, desc, _DESC_B_SCALE_MODE, ctypes.c_int32(_SCALE_VEC128_32F))
    layouts = (
        _layout(lib, weight.dtype, k, n, weight.stride(0)),
        _layout(lib, x.dtype, k, m, x.stride(0)),
        _layout(lib, c.dtype, n, m, c.stride(0)),
        _layout(lib, out.dtype, n, m, out.stride(0)),
    )
    pref = ctypes.c_void_p()
    _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
    ws = ctypes.c_uint64(_WORKSPACE_BYTES)
    _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), 8),
           "cublasLtMatmulPreferenceSetAttribute")
    result, found = _Heuristic(), ctypes.c_int(0)
    status = lib.cublasLtMatmulAlgoGetHeuristic(_HANDLE, desc, *layouts, pref, 1, ctypes.byref(result), ctypes.byref(found))
    lib.cublasLtMatmulPreferenceDestroy(pref)
    _check(status, "cublasLtMatmulAlgoGetHeuristic")
    if found.value < 1:
        raise _LtError("cuBLASLt offers no algorithm")
    plan = _Plan(desc=desc, layouts=layouts, algo=result.algo)
    _PLANS[key] = plan
    return plan


def _why_not(x, weight, c, out, x_scale, weight_scale) -> Optional[str]:
    if not (x.is_cuda and weight.is_cuda and c.is_cuda and out.is_cuda):
        return "not CUDA tensors"
    if x.dim() != 2 or weight.dim() != 2 or c.shape != out.shape or out.shape != (x.shape[0], weight.shape[0]):
        return "shapes"
    if x.stride(1) != 1 or weight.stride(1) != 1 or c.stride(1) != 1 or out.stride(1) != 1:
        return "a matrix whose rows are not contiguous"
    if out.dtype not in _CUDA_TYPE or c.dtype != out.dtype:
        return f"addend {c.dtype} / output {out.dtype}"
    if x_scale is None:
        return None if x.dtype == weight.dtype == out.dtype and x.dtype in (torch.bfloat16, torch.float16) else "dtypes"
    m, k = x.shape
    if x.dtype != torch.float8_e4m3fn or weight.dtype != torch.float8_e4m3fn:
        return "FP8 inputs must be float8_e4m3fn"
    if (k % (4 * _BLOCK) or x_scale.shape != (m, k // _BLOCK) or weight_scale.dim() != 2
            or weight_scale.shape[1] != k // _BLOCK):
        return "block scales other than 1 x 128 / 128 x 128 with K a multiple of 512"
    if m % 4:  # the M-major activation scales need 16-byte rows, as in torch._scaled_mm
        return "rows not a multiple of 4"
    return None


def try_matmul_add(x: torch.Tensor, weight: torch.Tensor, c: torch.Tensor, out: torch.Tensor,
                   x_scale: Optional[torch.Tensor] = None, weight_scale: Optional[torch.Tensor] = None) -> bool:
    """out = x @ weight.T (with block scales: (x * x_scale) @ (weight * weight_scale).T) + c.

    x [M, K], weight [N, K], c and out [M, N] with contiguous rows (c and out may be row
    slices of larger buffers). Returns False without touching `out` where it cannot."""
    why = _why_not(x, weight, c, out, x_scale, weight_scale)
    fp8 = x_scale is not None
    case = (x.dtype, out.dtype, fp8)
    if why is None and case in _UNAVAILABLE:
        why = _UNAVAILABLE[case]
    if why is not None:
        return False
    if x.shape[0] == 0:
        return True
    key = (x.device.index, case, *x.shape, weight.shape[0], x.stride(0), weight.stride(0), c.stride(0), out.stride(0))
    scales = None
    if fp8:
        # weight scales [N/128, K/128] row-major; activation scales M-major ([K/128, M] contiguous).
        # The copies are made and read on the current stream, so the allocator keeps them until then.
        scales = (weight_scale.float().contiguous(), x_scale.float().t().contiguous())
    try:
        plan = _plan(key, x, weight, c, out, scales)
    except _LtError as e:
        _give_up(case, str(e))
        return False
    workspace = _WORKSPACE.get(x.device.index)
    if workspace is None:
        if torch.cuda.is_current_stream_capturing():
            return False  # a workspace allocated now would live in the graph's private pool
        workspace = _WORKSPACE[x.device.index] = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=x.device)
    lib = _LIB
    if fp8:
        _set_scales(lib, plan.desc, *scales)
    A, B, C, D = plan.layouts
    status = lib.cublasLtMatmul(_HANDLE, plan.desc, ctypes.byref(_ONE), weight.data_ptr(), A, x.data_ptr(), B,
                                ctypes.byref(_ONE), c.data_ptr(), C, out.data_ptr(), D, ctypes.byref(plan.algo),
                                workspace.data_ptr(), _WORKSPACE_BYTES, torch.cuda.current_stream(x.device).cuda_stream)
    if status != 0:  # nothing was enqueued: the caller's separate add is still correct
        _give_up(case, f"cublasLtMatmul returned cuBLAS status {status}")
        return False
    return True


def _give_up(case: tuple, why: str) -> None:
    _UNAVAILABLE[case] = why
    x_dtype, out_dtype, fp8 = case
    log.warning("minimax: cuBLASLt GEMM with an addend unavailable for %s -> %s%s (%s); adding separately",
                x_dtype, out_dtype, " block-scaled" if fp8 else "", why)
