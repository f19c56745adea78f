"""The plan of a MoE layer's grouped GEMMs: which tiles, program order and kernels (Triton, or
the warp-specialized Gluon ones of kernels/moe_gluon.py, over 64- or 192-row blocks) run at each
size, on this GPU, under the kernel options. kernels/moe_triton.py launches what this decides;
the table's figures are in docs/kernel-notes.md#moe-tiles."""

from __future__ import annotations

import torch

from . import moe_gluon
from .options import kernel_options

try:  # named in the errors below
    from triton import __version__ as TRITON_VERSION
except ImportError:  # pragma: no cover
    TRITON_VERSION = "(not installed)"


def tile_config(tokens: int, top_k: int, num_experts: int, fp8: bool, float32: bool = False) -> dict:
    """BLOCK_M / N / K, the gate/up kernel's warps and stages, its product per K step
    (ONE_DOT), the down kernel's BLOCK_N, warps and stages, and the programs' order
    (GROUP_M, and EXPERT_GROUPS where GROUP_M is -1; both kernels), from the average rows
    per expert (measured on the H200 by
    tools/tune_moe.py at 4096 and 16384 tokens, by tools/profile_moe.py at decode sizes:
    docs/kernel-notes.md#moe-tiles). BLOCK_M is one for both kernels: it is the padding
    of the experts' sorted runs, which the two share. The kernel options moe_tiles,
    moe_gate_up and moe_group_m replace the table's choices."""
    # two products, row blocks fastest: unless the table's entry says otherwise
    cfg = {"ONE_DOT": False, "GROUP_M": 0, **_tile_table(tokens, top_k, num_experts, fp8, float32)}
    opts = kernel_options()
    if opts.moe_gate_up != "auto":
        cfg["ONE_DOT"] = opts.moe_gate_up == "one_dot"
    if opts.moe_group_m is not None:
        cfg["GROUP_M"] = opts.moe_group_m
        cfg.pop("EXPERT_GROUPS", None)
    if opts.moe_expert_groups is not None:  # groups that follow the experts (kernels/moe_expert_groups.py)
        cfg["GROUP_M"], cfg["EXPERT_GROUPS"] = -1, opts.moe_expert_groups
    return cfg


def rows_per_expert(tokens: int, top_k: int, num_experts: int) -> float:
    """The routed rows an expert takes on average: what the tile table and the half-block rule key on."""
    return tokens * top_k / max(num_experts, 1)


def _tile_table(tokens: int, top_k: int, num_experts: int, fp8: bool, float32: bool) -> dict:
    vals = kernel_options().moe_tiles  # BM, BN, BK, warps, stages[, BN_DOWN[, down warps, down stages]]
    if vals is not None:
        bm, bn, bk, warps, stages = vals[:5]
        down_warps, down_stages = vals[6:8] if len(vals) == 8 else (warps, stages)
        return {"BM": bm, "BN": bn, "BK": bk, "num_warps": warps, "num_stages": stages,
                "BN_DOWN": vals[5] if len(vals) >= 6 else bn, "down_warps": down_warps, "down_stages": down_stages}
    avg = rows_per_expert(tokens, top_k, num_experts)
    if float32:  # 4-byte tiles: halve K and the pipeline depth to fit the 227 KB of shared memory
        bm = 16 if avg <= 16 else 32 if avg <= 48 else 64 if avg <= 192 else 128
        warps = 4 if bm <= 64 else 8
        return {"BM": bm, "BN": 128, "BK": 32, "num_warps": warps, "num_stages": 2, "BN_DOWN": 128,
                "down_warps": warps, "down_stages": 2}
    if avg <= 48:  # decode and small prefill: tuned for reading the weights
        bm = 16 if avg <= 16 else 32
        # FP8 decode (BM 16): the down GEMM in 64-column tiles, twice the programs to pull the weights.
        # BF16 at BM 16: K steps of 128 (4-8% faster at 16-512 tokens than 64); at BM 32, 64.
        return {"BM": bm, "BN": 128, "BK": 128 if fp8 or bm == 16 else 64, "num_warps": 4, "num_stages": 3,
                "BN_DOWN": 64 if fp8 and bm == 16 else 128, "down_warps": 4, "down_stages": 3}
    # Prefill sizes. The gate/up kernel holds the gate and up accumulators: 8 warps keep
    # them, and in FP8 the per-K-step scaled product, in registers (4 warps at BLOCK_M 128
    # spill: 3-5x slower). FP8 is fastest at BLOCK_M 64, BF16 at 128. Gate and up from one
    # product per K step and programs in groups of row blocks: 8-16% faster at 4096 and
    # 16384 tokens than two products in row-block order. The groups follow the experts
    # (at most 8 row blocks; kernels/moe_expert_groups.py), so each expert's weight tiles
    # are read from HBM once per layer: FP8 2-4% faster than groups of 4 at 8192-16384
    # tokens, BF16 (bound by its weight reads at 4096) 4-5% faster than groups of 8 there.
    if fp8:
        return {"BM": 64, "BN": 128, "BK": 128, "num_warps": 8, "num_stages": 4, "BN_DOWN": 128,
                "down_warps": 4, "down_stages": 4, "ONE_DOT": True, "GROUP_M": -1, "EXPERT_GROUPS": 8}
    return {"BM": 128, "BN": 128, "BK": 64, "num_warps": 8, "num_stages": 4, "BN_DOWN": 128,
            "down_warps": 4, "down_stages": 3, "ONE_DOT": True, "GROUP_M": -1, "EXPERT_GROUPS": 8}


def down_stages(stages: int, two_loops: bool, bm: int, bn: int, bk: int, elem_bytes: int) -> int:
    """The down kernel's pipeline depth: with a narrower shared expert it has two copies of
    its K loop (see _down_kernel), each with its own buffers, and both must fit in the
    227 KB of shared memory (4 stages at BLOCK_M 128 needed 256 KB: OutOfResources on
    the H200; tests/test_triton_sm90_codegen.py compiles both for sm_90)."""
    if not two_loops:
        return stages
    per_stage = (bm * bk + bn * bk) * elem_bytes
    return max(2, min(stages, (220 * 1024) // (2 * per_stage)))


def gluon_fits(device: torch.device, dtype: torch.dtype, hidden: int, cfg: dict, n: int, n_shared: int) -> bool:
    """Whether the FP8 gate/up GEMM runs as the warp-specialized Gluon kernel (kernels/moe_gluon.py).

    Kernel option moe_gemm: auto = where it can (an sm_90 GPU with triton's Gluon); gluon and gluon192
    (its 192-row form, trio_fits) = an error where it cannot; triton = never. Either way only at its tiles (BLOCK_M 64, the FP8 prefill
    tiles), routed and shared experts of one width, whole 128-column tiles, a bf16 model; elsewhere
    (decode tiles, a narrower shared TP slice) the Triton kernel runs."""
    mode = kernel_options().moe_gemm
    if mode == "triton" or device.type != "cuda":
        return False
    if not moe_gluon.gluon_available(device):
        if mode == "auto":
            return False
        raise RuntimeError(f"kernel option moe_gemm={mode} needs triton's Gluon and an sm_90 (Hopper) GPU; "
                           f"this is {device} with triton {TRITON_VERSION} "
                           f"(Gluon {'present' if moe_gluon.HAVE_GLUON else 'missing'}): use auto or triton")
    return (cfg["BM"] == moe_gluon.BLOCK_M and n == n_shared and n % 128 == 0 and hidden % 128 == 0
            and dtype == torch.bfloat16)


# From this many rows per expert on average (the shared slot counted) the Gluon gate/up runs in
# 192-row blocks under moe_gemm=auto. One H200 on 2026-12-03/04 put it at 256 (4096 tokens, 160
# rows: 1.2-2.3% slower from the padding to 192); since the quantize-scatter skips the groups of
# padding and the Gluon down covers three column tiles (2026-12-06), one H100 measured the layer at
# 3072 tokens (119 rows) even, 4096 (159) 5.6% faster in one call and 3.1% back to back, 6144 (238)
# 12% / 8.5% faster, 2048 (79) 6% slower (docs/kernel-notes.md#three-warp-groups-over-192-row-blocks).
TRIO_MIN_ROWS_PER_EXPERT = 128


# From this many rows per expert on average (the shared slot counted) a BF16 layer's expert GEMMs run
# as the Gluon kernels over 192-row blocks under moe_gemm=auto. One H100 on 2026-12-08 (one pass,
# moe_bf16_passes=1) against the Triton loops, M3's layer: 4096 tokens (159 rows) even (1.5% slower
# in the tile sweep, the same in a CUDA graph), 8192 (317) 8-9% faster, 16384 (635) 12-15% faster
# (docs/kernel-notes.md#the-bf16-gateup-in-one-pass).
BF16_TRIO_MIN_ROWS_PER_EXPERT = 256


def gluon_bf16_fits(device: torch.device, dtype: torch.dtype, hidden: int, n: int, n_shared: int, pairs: int,
                    experts: int) -> bool:
    """Whether a BF16 layer's expert GEMMs run as the Gluon kernels over 192-row blocks
    (moe_gluon.gate_up_act_trio / down_trio in BF16) instead of the Triton loops. Kernel option
    moe_gemm: auto = on an sm_90 GPU with Gluon from BF16_TRIO_MIN_ROWS_PER_EXPERT rows per expert on
    average (pairs over experts, the shared slot counted); gluon192 = always (an error where the GPU
    cannot); triton and gluon (the 64-row FP8 kernel) = never. moe_down=triton keeps the whole BF16
    layer on Triton (its down cannot read the 192-row blocks at BF16's tiles). Only a bf16 model with
    routed and shared experts of one width and whole 128-wide tiles."""
    opts = kernel_options()
    if opts.moe_gemm not in ("auto", "gluon192") or opts.moe_down == "triton" or device.type != "cuda" \
            or dtype != torch.bfloat16:
        return False
    if not moe_gluon.gluon_available(device):
        if opts.moe_gemm == "auto":
            return False
        raise RuntimeError(f"kernel option moe_gemm=gluon192 needs triton's Gluon and an sm_90 (Hopper) GPU; "
                           f"this is {device} with triton {TRITON_VERSION}: use auto or triton")
    if not (n == n_shared and n % 128 == 0 and hidden % 128 == 0):
        return False
    return opts.moe_gemm == "gluon192" or pairs >= BF16_TRIO_MIN_ROWS_PER_EXPERT * experts


def bf16_gluon_order(cfg: dict) -> dict:
    """The BF16 Gluon GEMMs' tiles: 64-row groups (BLOCK_M 64 for the block arithmetic) and, unless the
    kernel options set an order, the FP8 Gluon GEMMs' programs in groups that follow the experts."""
    opts = kernel_options()
    order = {} if opts.moe_group_m is not None or opts.moe_expert_groups is not None else \
        {"GROUP_M": -1, "EXPERT_GROUPS": 8}
    return {**cfg, "BM": moe_gluon.BLOCK_M, **order}


def trio_fits(pairs: int, experts: int) -> bool:
    """Whether the Gluon gate/up (already chosen: gluon_fits) runs over 192-row blocks: always under
    kernel option moe_gemm=gluon192, never under gluon, with auto from TRIO_MIN_ROWS_PER_EXPERT."""
    mode = kernel_options().moe_gemm
    if mode == "auto":
        return pairs >= TRIO_MIN_ROWS_PER_EXPERT * experts
    return mode == "gluon192"


def gluon_down_fits(trio: bool) -> bool:
    """Whether the FP8 down GEMM runs as the Gluon kernel over the gate/up's 192-row blocks
    (moe_gluon.down_trio; kernel option moe_down): auto = wherever the gate/up runs in that form
    (trio: trio_fits), triton = never."""
    return trio and kernel_options().moe_down == "auto"


def half_blocks_fit(block_m: int, bf16: bool, rows_per_expert: float) -> bool:
    """Whether the Triton gate/up and down kernels take their half-block copy: a block whose second
    half is padding multiplies only its first half, which needs halves of 16 rows at least (the
    smallest tl.dot). Kernel option moe_half_blocks: on / off everywhere; auto where it was measured
    faster: BF16 at BLOCK_M 128 with at most a block of rows per expert on average, so that most
    experts end in a part-empty block (one H100, 2026-12-07: M3 at 4096 tokens 2.8-4.4% faster per
    call, 8192 mixed, 16384 slower; FP8 at BLOCK_M 64 slower; docs/kernel-notes.md#half-blocks-measured)."""
    mode = kernel_options().moe_half_blocks
    if mode == "off" or block_m < 32:
        return False
    return mode == "on" or (bf16 and block_m >= 128 and rows_per_expert <= block_m)


def shared_in_grouped_launch(tokens: int, top_k: int, num_experts: int, fp8: bool, float32: bool,
                             width: int, shared_width: int) -> bool:
    """Whether the shared expert runs inside the routed launches (kernel option moe_shared=merged,
    the default) or in its own (=separate, to compare; or where merging measured slower).

    Merged where the shared expert is as wide as a routed one (EP 1). A narrower TP slice
    (EP 2) needs the down kernel's second K loop, whose buffers may cut its pipeline
    (down_stages); where they do it was slower than separate launches (measured at
    BLOCK_M 128: docs/kernel-notes.md#moe-shared-expert), so it is merged only where the
    pipeline keeps its depth."""
    if kernel_options().moe_shared == "separate":
        return False
    if shared_width == width:
        return True
    cfg = tile_config(tokens, top_k, num_experts, fp8, float32)
    elem = 4 if float32 else 1 if fp8 else 2
    depth = cfg["down_stages"]
    return down_stages(depth, True, cfg["BM"], cfg["BN_DOWN"], cfg["BK"], elem) == depth
