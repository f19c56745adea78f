"""Our Triton kernels compiled for the H200 (sm_90) on a CPU machine: code generation and
ptxas run without a GPU, so what the interpreter cannot see is checked in CI.

The interpreter runs the kernels' Python, not Triton's compiler. Two GPU-only failures
of 2026-11-30 are of the kind checked here: a runtime row stride that made the MoE down
GEMM load its FP8 weights byte by byte (20x slower, found by the benchmark), and two
K loops that needed 256 KB of shared memory (OutOfResources at BLOCK_M 128). Each test
compiles one kernel configuration the GPU path launches, with the launch's
specialization (16-byte aligned pointers and strides), and reads the PTX: weight tiles
must arrive as 16-byte async copies, no global load may be a single byte, and shared
memory must fit the H200's 227 KB.
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch

triton = pytest.importorskip("triton", reason="needs triton (pip install triton)")

from minimax_backend.kernels import moe_plan as plan  # noqa: E402
from minimax_backend.kernels.interpreter import triton_interpreting  # noqa: E402

if triton_interpreting():
    pytest.skip("compiles for the GPU; the interpreter replaces the compiler", allow_module_level=True)

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - very old triton
    pytest.skip("this triton has no ASTSource / GPUTarget to compile ahead of time", allow_module_level=True)

H200 = GPUTarget("cuda", 90, 32)
H200_SHARED_BYTES = 232448  # what the H200 reported in the OutOfResources error


def compile_sm90(fn, signature: dict, constants: dict, aligned: list, **options):
    """(ptx, shared bytes) of fn for sm_90; `aligned` args are specialized as 16-divisible,
    as Triton does at launch for 16-byte aligned pointers and multiples of 16."""
    kernel = compiled_sm90(fn, signature, constants, aligned, **options)
    return kernel.asm["ptx"], kernel.metadata.shared


def compiled_sm90(fn, signature: dict, constants: dict, aligned: list, **options):
    """Triton's compiled kernel of fn for sm_90 (PTX and cubin), as compile_sm90 specializes it."""
    names = fn.arg_names
    # constexpr parameters with a default (a kernel variant's switch) take it unless given
    constants = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.name not in constants
                    and p.name not in signature and p.default is not inspect.Parameter.empty}, **constants}
    full = {**signature, **{k: "constexpr" for k in constants}}
    try:
        src = ASTSource(fn=fn, signature={n: full[n] for n in names},
                        constexprs={(names.index(k),): v for k, v in constants.items()},
                        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    except TypeError as e:  # pragma: no cover - the ahead-of-time API differs in this triton
        pytest.skip(f"triton {triton.__version__}: ASTSource API differs ({e})")
    return triton.compile(src, target=H200, options=options)


def local_memory_bytes(kernel, tmp_path) -> int:
    """Bytes of per-thread local memory (stack: register spills) of a compiled kernel, from the
    cuobjdump that Triton ships (the ptxas report needs no GPU either)."""
    import os
    import subprocess

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        pytest.skip("this triton ships no cuobjdump")
    cubin = tmp_path / "kernel.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    out = subprocess.run([tool, "--dump-resource-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    found = re.search(r"STACK:(\d+)", out)
    assert found, out
    return int(found.group(1))


def async_copies(ptx: str) -> dict:
    """Bytes per cp.async -> count."""
    out: dict = {}
    for size in re.findall(r"cp\.async\.c[ag]\.shared\.global \[[^]]*\], \[[^]]*\], (0x[0-9a-f]+|\d+)", ptx):
        n = int(size, 0)
        out[n] = out.get(n, 0) + 1
    return out


def byte_loads(ptx: str) -> int:
    return len(re.findall(r"ld\.global[^;\n]*\.(?:u8|b8|s8)\b", ptx))


# ------------------------------------------------------------------ MoE
DOWN_SIG = {"h_ptr": "*fp8e4nv", "hs_ptr": "*fp32", "w_table": "*i64", "ws_table": "*i64", "sorted_pair": "*i32",
            "block_expert": "*i32", "topk_w": "*fp32", "y_ptr": "*bf16", "N": "i32", "n_local": "i32",
            "num_m_blocks": "i32", "num_n_tiles": "i32", "stride_h": "i32", "stride_hs": "i32", "stride_y": "i32"}
DOWN_ALIGNED = ["h_ptr", "hs_ptr", "w_table", "ws_table", "sorted_pair", "block_expert", "topk_w", "y_ptr", "N",
                "stride_h", "stride_y"]
GATE_UP_SIG = {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_table": "*i64", "ws_table": "*i64",
               "sorted_pair": "*i32", "block_expert": "*i32", "h_ptr": "*fp8e4nv", "hs_ptr": "*fp32",
               "N": "i32", "N_SHARED": "i32", "top_k": "i32", "n_local": "i32", "num_m_blocks": "i32",
               "num_n_tiles": "i32", "stride_x": "i32",
               "stride_xs": "i32", "stride_h": "i32", "stride_hs": "i32", "alpha": "fp32", "limit": "fp32",
               "beta": "fp32"}
GATE_UP_ALIGNED = ["x_ptr", "xs_ptr", "w_table", "ws_table", "sorted_pair", "block_expert", "h_ptr", "hs_ptr",
                   "N", "N_SHARED", "stride_x", "stride_h"]
FP8 = dict(FP8=True, OUT_KIND=1, INTERP=False, UPCAST=False, IEEE=False, BK=128)


@pytest.fixture(scope="module")
def moe():
    import minimax_backend.kernels.moe_triton as kt

    return kt


@pytest.mark.parametrize("bm, bn, shared_width", [(16, 64, 0), (16, 64, 1536), (64, 128, 1536), (128, 128, 1536)])
def test_moe_down_kernel_loads_weights_in_16_byte_copies(moe, bm, bn, shared_width):
    """M3 at EP 1 (no narrower shared expert) and EP 2 (a 1536-wide shared slice: two K loops)."""
    cfg = plan.tile_config({16: 1, 64: 4000, 128: 8192}[bm], 4, 128, True)
    stages = plan.down_stages(cfg["down_stages"], shared_width > 0, bm, bn, 128, 1)
    consts = dict(FP8, K=3072, K_SHARED=shared_width, SHARED=shared_width > 0, BM=bm, BN=bn)
    ptx, shared = compile_sm90(moe._down_kernel, DOWN_SIG, consts, DOWN_ALIGNED, num_warps=cfg["down_warps"],
                               num_stages=stages)
    copies = async_copies(ptx)
    assert copies.get(16, 0) > 0 and set(copies) == {16}, copies
    assert byte_loads(ptx) == 0
    assert shared <= H200_SHARED_BYTES


def test_down_stages_keep_two_k_loops_in_shared_memory(moe):
    """The uncapped pipeline needs more than the H200 has (what failed on the GPU); the cap fits."""
    consts = dict(FP8, K=3072, K_SHARED=1536, SHARED=True, BM=128, BN=128)
    _, uncapped = compile_sm90(moe._down_kernel, DOWN_SIG, consts, DOWN_ALIGNED, num_warps=8, num_stages=4)
    assert uncapped > H200_SHARED_BYTES
    stages = plan.down_stages(4, True, 128, 128, 128, 1)
    _, capped = compile_sm90(moe._down_kernel, DOWN_SIG, consts, DOWN_ALIGNED, num_warps=8, num_stages=stages)
    assert stages < 4 and capped <= H200_SHARED_BYTES


@pytest.mark.parametrize("bm, shared", [(16, False), (16, True), (128, True)])
def test_moe_gate_up_kernel_loads_weights_in_16_byte_copies(moe, bm, shared):
    cfg = plan.tile_config({16: 1, 128: 8192}[bm], 4, 128, True)
    consts = dict(FP8, K=6144, ACT=0, BM=bm, BN=128, SHARED=shared)
    ptx, shared = compile_sm90(moe._gate_up_act_kernel, GATE_UP_SIG, consts, GATE_UP_ALIGNED,
                               num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    copies = async_copies(ptx)
    assert copies.get(16, 0) > 0 and set(copies) == {16}, copies
    assert byte_loads(ptx) == 0
    assert shared <= H200_SHARED_BYTES


def test_decode_kernels_wait_then_release_under_pdl(moe):
    """PDL=True (kernels/launch_overlap.py): the gate/up and down kernels open with
    griddepcontrol.wait, then launch_dependents; PDL=False has neither."""
    gate_up = dict(FP8, K=6144, ACT=0, BM=16, BN=128, SHARED=True)
    down = dict(FP8, K=3072, K_SHARED=3072, SHARED=True, BM=16, BN=64)
    for fn, sig, consts, aligned in ((moe._gate_up_act_kernel, GATE_UP_SIG, gate_up, GATE_UP_ALIGNED),
                                     (moe._down_kernel, DOWN_SIG, down, DOWN_ALIGNED)):
        with_pdl, _ = compile_sm90(fn, sig, {**consts, "PDL": True}, aligned, num_warps=4, num_stages=3,
                                   launch_pdl=True)
        wait, release = with_pdl.find("griddepcontrol.wait"), with_pdl.find("griddepcontrol.launch_dependents")
        assert 0 <= wait < release, fn.__name__
        assert wait < with_pdl.find("ld.global"), fn.__name__  # nothing read before the wait
        plain, _ = compile_sm90(fn, sig, consts, aligned, num_warps=4, num_stages=3)
        assert "griddepcontrol" not in plain, fn.__name__


BF16 = dict(FP8=False, OUT_KIND=1, INTERP=False, UPCAST=False, IEEE=False, BK=64)


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
@pytest.mark.parametrize("tokens", [1, 300, 1000, 4096, 16384])
def test_moe_tile_table_compiles_without_register_spills(moe, fp8, tokens, tmp_path):
    """Every tile config tile_config picks for M3 (128 experts, top-4) keeps both kernels in
    registers. Spilling configs measured 3-5x slower on the H200 (BLOCK_M 128 with 4 warps
    holds the gate and up accumulators and, in FP8, their per-K-step products:
    docs/kernel-notes.md#moe-tiles)."""
    cfg = plan.tile_config(tokens, 4, 128, fp8)
    base = dict(FP8 if fp8 else BF16, BK=cfg["BK"], BM=cfg["BM"])
    sig_gate_up = GATE_UP_SIG if fp8 else {**GATE_UP_SIG, "x_ptr": "*bf16", "h_ptr": "*bf16"}
    sig_down = DOWN_SIG if fp8 else {**DOWN_SIG, "h_ptr": "*bf16"}
    gate_up = compiled_sm90(moe._gate_up_act_kernel, sig_gate_up,
                            dict(base, K=6144, ACT=0, BN=cfg["BN"], SHARED=False, ONE_DOT=cfg["ONE_DOT"],
                                 GROUP_M=cfg["GROUP_M"]),
                            GATE_UP_ALIGNED, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    down = compiled_sm90(moe._down_kernel, sig_down, dict(base, K=3072, K_SHARED=0, SHARED=False, BN=cfg["BN_DOWN"],
                                                          GROUP_M=cfg["GROUP_M"]),
                         DOWN_ALIGNED, num_warps=cfg["down_warps"], num_stages=cfg["down_stages"])
    assert max(gate_up.metadata.shared, down.metadata.shared) <= H200_SHARED_BYTES
    spilled = (local_memory_bytes(gate_up, tmp_path), local_memory_bytes(down, tmp_path))
    if fp8 and cfg["BM"] == 32 and spilled != (0, 0):
        # found 2026-12-07: the FP8 tiles at BLOCK_M 32 (400-1536 tokens) spill a little, 8 B a
        # thread in the down kernel under the GPU box's Triton 3.6, 16 B in the gate/up under 3.9;
        # 8 warps spill nothing but ran 14% slower on an H100 (docs/kernel-notes.md#half-blocks-measured)
        pytest.xfail(f"triton {triton.__version__}: (gate/up, down) spill {spilled} B a thread at BLOCK_M 32")
    assert spilled == (0, 0), cfg


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
@pytest.mark.parametrize("tokens", [1000, 4096, 16384])
def test_moe_half_blocks_compile_without_register_spills(moe, fp8, tokens, tmp_path):
    """The kernel option moe_half_blocks (HALVES: a second copy of each kernel's loop at half the
    block's rows) at the table's tiles from BLOCK_M 32 on: nothing spills from BLOCK_M 64; at FP8's
    BLOCK_M 32, which spills 8-16 B a thread without it, the two kernels together spill no more
    (under Triton 3.6 the 8 B move from the down kernel to the gate/up); within the H200's shared
    memory."""
    cfg = plan.tile_config(tokens, 4, 128, fp8)
    assert cfg["BM"] >= 32
    base = dict(FP8 if fp8 else BF16, BK=cfg["BK"], BM=cfg["BM"])
    sig_gate_up = GATE_UP_SIG if fp8 else {**GATE_UP_SIG, "x_ptr": "*bf16", "h_ptr": "*bf16"}
    sig_down = DOWN_SIG if fp8 else {**DOWN_SIG, "h_ptr": "*bf16"}
    spills, shared = {}, 0
    for halves in (False, True):
        gate_up = compiled_sm90(moe._gate_up_act_kernel, sig_gate_up,
                                dict(base, K=6144, ACT=0, BN=cfg["BN"], SHARED=False, ONE_DOT=cfg["ONE_DOT"],
                                     GROUP_M=cfg["GROUP_M"], HALVES=halves),
                                GATE_UP_ALIGNED, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        down = compiled_sm90(moe._down_kernel, sig_down, dict(base, K=3072, K_SHARED=0, SHARED=False,
                                                              BN=cfg["BN_DOWN"], GROUP_M=cfg["GROUP_M"],
                                                              HALVES=halves),
                             DOWN_ALIGNED, num_warps=cfg["down_warps"], num_stages=cfg["down_stages"])
        spills[halves] = (local_memory_bytes(gate_up, tmp_path), local_memory_bytes(down, tmp_path))
        shared = max(shared, gate_up.metadata.shared, down.metadata.shared)
    assert sum(spills[True]) <= sum(spills[False]), (cfg, spills)
    if cfg["BM"] >= 64:
        assert spills[True] == spills[False] == (0, 0), (cfg, spills)
    assert shared <= H200_SHARED_BYTES


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_moe_programs_grouped_by_expert_compile_without_register_spills(moe, fp8, tmp_path):
    """The kernel option moe_expert_groups (GROUP_M -1: each program's group read from a table) at
    the prefill tiles: both kernels still compile for sm_90 and keep everything in registers."""
    from minimax_backend.kernels.options import override_kernel_options

    with override_kernel_options(moe_expert_groups=8):
        cfg = plan.tile_config(8192, 4, 128, fp8)
    assert cfg["GROUP_M"] == -1 and cfg["EXPERT_GROUPS"] == 8
    base = dict(FP8 if fp8 else BF16, BK=cfg["BK"], BM=cfg["BM"])
    sig_gate_up = GATE_UP_SIG if fp8 else {**GATE_UP_SIG, "x_ptr": "*bf16", "h_ptr": "*bf16"}
    sig_down = DOWN_SIG if fp8 else {**DOWN_SIG, "h_ptr": "*bf16"}
    gate_up = compiled_sm90(moe._gate_up_act_kernel, sig_gate_up,
                            dict(base, K=6144, ACT=0, BN=cfg["BN"], SHARED=False, ONE_DOT=cfg["ONE_DOT"], GROUP_M=-1),
                            GATE_UP_ALIGNED, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    down = compiled_sm90(moe._down_kernel, sig_down, dict(base, K=3072, K_SHARED=0, SHARED=False, BN=cfg["BN_DOWN"],
                                                          GROUP_M=-1),
                         DOWN_ALIGNED, num_warps=cfg["down_warps"], num_stages=cfg["down_stages"])
    assert local_memory_bytes(gate_up, tmp_path) == 0 and local_memory_bytes(down, tmp_path) == 0


def mma_shapes(ptx: str) -> set:
    """The wgmma instruction shapes in the PTX, e.g. {"m64n128k32"}."""
    return set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))


def mma_waits(ptx: str) -> int:
    return len(re.findall(r"wgmma\.wait_group\.sync\.aligned", ptx))


@pytest.mark.parametrize("fp8, bm", [(True, 64), (False, 128)])
def test_gate_up_as_one_product_compiles_to_wider_mmas(moe, fp8, bm, tmp_path):
    """moe_gate_up=one_dot at the prefill tiles (8 warps): each K step is one product [BM, 2 x 128]
    instead of two [BM, 128], so the MMAs are twice as wide; in FP8, which waits for every
    product to apply the block scales in float32, with half the waits. No register spills,
    the same shared memory and 16-byte weight copies."""
    base = dict(FP8, BM=bm) if fp8 else dict(BF16, BM=bm)
    sig = GATE_UP_SIG if fp8 else {**GATE_UP_SIG, "x_ptr": "*bf16", "h_ptr": "*bf16"}
    got = {}
    for one_dot in (False, True):
        got[one_dot] = compiled_sm90(moe._gate_up_act_kernel, sig, dict(base, K=6144, ACT=0, BN=128, SHARED=False,
                                                                        ONE_DOT=one_dot),
                                     GATE_UP_ALIGNED, num_warps=8, num_stages=4)
    two, one = got[False], got[True]
    width = lambda ptx: {int(re.search(r"n(\d+)", s).group(1)) for s in mma_shapes(ptx)}  # noqa: E731
    assert width(one.asm["ptx"]) == {2 * w for w in width(two.asm["ptx"])}
    if fp8:
        assert mma_waits(one.asm["ptx"]) < mma_waits(two.asm["ptx"])
    assert local_memory_bytes(one, tmp_path) == 0
    assert one.metadata.shared == two.metadata.shared <= H200_SHARED_BYTES
    copies = async_copies(one.asm["ptx"])
    assert copies.get(16, 0) > 0 and set(copies) == {16}, copies


def test_grouped_tile_order_compiles_like_the_default(moe, tmp_path):
    """moe_group_m (the programs' order) at the FP8 prefill tiles: the same loops, so no spills,
    16-byte weight copies and the default's shared memory."""
    cfg = plan.tile_config(8192, 4, 128, True)
    for kernel, sig, aligned, consts, warps, stages in (
            (moe._gate_up_act_kernel, GATE_UP_SIG, GATE_UP_ALIGNED,
             dict(FP8, K=6144, ACT=0, BM=cfg["BM"], BN=128, SHARED=True), cfg["num_warps"], cfg["num_stages"]),
            (moe._down_kernel, DOWN_SIG, DOWN_ALIGNED,
             dict(FP8, K=3072, K_SHARED=3072, SHARED=True, BM=cfg["BM"], BN=cfg["BN_DOWN"]), cfg["down_warps"],
             cfg["down_stages"])):
        default, grouped = (compiled_sm90(kernel, sig, dict(consts, GROUP_M=g), aligned, num_warps=warps,
                                          num_stages=stages) for g in (0, 4))
        assert local_memory_bytes(grouped, tmp_path) == 0
        assert grouped.metadata.shared == default.metadata.shared
        copies = async_copies(grouped.asm["ptx"])
        assert copies.get(16, 0) > 0 and set(copies) == {16}, copies


def test_spill_check_sees_a_spilling_config(moe, tmp_path):
    """The check above can fail: FP8 gate/up at BLOCK_M 128 with 4 warps spills."""
    kernel = compiled_sm90(moe._gate_up_act_kernel, GATE_UP_SIG, dict(FP8, K=6144, ACT=0, BM=128, BN=128, SHARED=False),
                           GATE_UP_ALIGNED, num_warps=4, num_stages=3)
    assert local_memory_bytes(kernel, tmp_path) > 0


GLUON_GATE_UP_SIG = {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_table": "*i64", "ws_table": "*i64",
                     "block_expert": "*i32", "h_ptr": "*fp8e4nv", "hs_ptr": "*fp32", "rows_total": "i32",
                     "n_local": "i32", "num_m_blocks": "i32", "num_n_tiles": "i32", "alpha": "fp32", "limit": "fp32",
                     "beta": "fp32"}


def compiled_gluon_sm90(fn, signature: dict, constants: dict, num_warps: int):
    """A Gluon kernel compiled for sm_90 (pointers specialized as 16-byte aligned)."""
    try:
        from triton.experimental.gluon._runtime import GluonASTSource
    except ImportError:
        pytest.skip(f"triton {triton.__version__} has no Gluon")
    names = fn.arg_names
    # constexpr parameters with a default (a kernel variant's switch) take it unless given
    constants = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.name not in constants
                    and p.name not in signature and p.default is not inspect.Parameter.empty}, **constants}
    full = {**signature, **{k: "constexpr" for k in constants}}
    src = GluonASTSource(fn=fn, signature={n: full[n] for n in names},
                         constexprs={(names.index(k),): v for k, v in constants.items()},
                         attrs={(names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items()
                                if t.startswith("*")})
    return triton.compile(src, target=H200, options=dict(num_warps=num_warps))


@pytest.mark.parametrize("width", [3072, 256], ids=["m3", "short_k"])
def test_moe_gluon_gate_up_compiles_warp_specialized_without_spills(width, tmp_path):
    """The warp-specialized Gluon gate/up kernel (kernels/moe_gluon.py, kernel option moe_gemm) at
    M3's widths and at 256 (fewer K steps than pipeline stages): wgmma on the tensor cores, the
    consumer warp groups' registers raised with setmaxnreg, no register spills, shared memory within
    the H200's."""
    from minimax_backend.kernels import moe_gluon as mg

    if not mg.HAVE_GLUON:
        pytest.skip(f"triton {triton.__version__} has no Gluon")
    for group_m in (4, -1):  # -1: the groups by expert (kernel option moe_expert_groups)
        kernel = compiled_gluon_sm90(mg._gate_up_ws_kernel, GLUON_GATE_UP_SIG,
                                     dict(N=width, K=2 * width, ACT=0, GROUP_M=group_m, num_warps=4, **mg.CONFIG), 4)
        ptx = kernel.asm["ptx"]
        assert "wgmma.mma_async" in ptx and "setmaxnreg" in ptx
        assert kernel.metadata.shared <= H200_SHARED_BYTES
        assert local_memory_bytes(kernel, tmp_path) == 0, group_m


def row_tiles_sig(dtype: str, cols: int) -> str:
    """The signature type of moe_gluon._row_tiles's host TMA descriptor: [64, cols] blocks of 128 swizzled bytes."""
    from triton.experimental.gluon import language as gl

    bits = 8 if dtype.startswith("fp8") else 16
    return f"tensordesc<{dtype}[64, {cols}],{gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=bits, rank=2)!r}>"


def gluon_trio_sig() -> dict:
    """The 192-row FP8 gate/up's arguments: x and h as the host's descriptors, the trace pointer as
    the untraced launch passes it (hs, unread)."""
    sig = {k: v for k, v in GLUON_GATE_UP_SIG.items() if k not in ("x_ptr", "h_ptr", "rows_total")}
    return {**sig, "a_desc": row_tiles_sig("fp8e4nv", 128), "out_desc": row_tiles_sig("fp8e4nv", 128),
            "sorted_pair": "*i32", "trace_ptr": "*fp32"}


def test_moe_gluon_192_row_gate_up_compiles_warp_specialized_without_spills(tmp_path):
    """The Gluon gate/up over 192-row tiles (moe_gluon.gate_up_act_trio) at M3's widths: wgmma,
    setmaxnreg, shared memory within the H200's, and no register spills with three consumer warp
    groups at TRIO_CONFIG's registers (each holds a [64, 128] accumulator and one product)."""
    from minimax_backend.kernels import moe_gluon as mg

    if not mg.HAVE_GLUON:
        pytest.skip(f"triton {triton.__version__} has no Gluon")
    kernel = compiled_gluon_sm90(mg._gate_up_trio_kernel, gluon_trio_sig(),
                                 dict(N=3072, K=6144, ACT=0, GROUP_M=-1, num_warps=4, **mg.TRIO_CONFIG), 4)
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "setmaxnreg" in ptx
    assert kernel.metadata.shared <= H200_SHARED_BYTES
    # Triton 3.9 spilled 24 B a thread while gate and up met in shared memory; split in registers,
    # neither 3.6 (the GPU box's) nor 3.9 spills
    assert local_memory_bytes(kernel, tmp_path) == 0


def test_moe_gluon_192_row_kernels_traced_read_the_timers_and_otherwise_compile_the_same(tmp_path):
    """The FP8 192-row gate/up's and down's TRACE builds (kernels/gluon_trace.py,
    tools/trace_moe_gemms.py): they read the cycle counter around each wait and at a program's edges
    and %globaltimer / %smid, in the same stages (shared memory within 64 B) and without spills (the
    timers must not change what they time); with TRACE off the PTX is that of a kernel without the timers: no timer reads and
    the same instructions as a build whose trace pointer is typed differently (the pointer is unread)."""
    from minimax_backend.kernels import moe_gluon as mg

    if not mg.HAVE_GLUON:
        pytest.skip(f"triton {triton.__version__} has no Gluon")
    cases = [(mg._gate_up_trio_kernel, gluon_trio_sig(),
              dict(N=3072, K=6144, ACT=0, GROUP_M=-1, num_warps=4, LIVE_ROWS=True, **mg.TRIO_CONFIG)),
             (mg._down_trio_kernel, gluon_down_trio_sig(),
              dict(N_OUT=6144, K=3072, GROUP_M=-1, num_warps=4, COL_TILES=3, LIVE_ROWS=True, **mg.DOWN_TRIO_CONFIG))]

    def instructions(kernel):
        lines = [ln.split("//")[0].strip() for ln in kernel.asm["ptx"].splitlines()]
        return [re.sub(r"%\w+\d+|_param_\d+", "_", ln) for ln in lines if ln and not ln.startswith((".", "$", "{", "}"))]

    spills = {}
    for fn, sig, constants in cases:
        plain = compiled_gluon_sm90(fn, sig, constants, 4)
        retyped = compiled_gluon_sm90(fn, {**sig, "trace_ptr": "*i64"}, constants, 4)
        traced = compiled_gluon_sm90(fn, {**sig, "trace_ptr": "*i64"}, {**constants, "TRACE": True}, 4)
        for kernel in (plain, retyped):
            assert "%clock" not in kernel.asm["ptx"] and "%globaltimer" not in kernel.asm["ptx"], fn.__name__
        assert instructions(plain) == instructions(retyped), fn.__name__
        ptx = traced.asm["ptx"]
        # 32-bit reads around the producer's and each consumer's waits (in the K loops), 64-bit at a
        # program's edges
        assert len(re.findall(r"%clock;", ptx)) >= 8 and ptx.count("%clock64") >= 5, fn.__name__
        assert ptx.count("%globaltimer") == 2 and "%smid" in ptx, fn.__name__
        # the same stages and tiles: at most a few values more for warp_specialize to hand its partitions
        assert plain.metadata.shared <= traced.metadata.shared <= min(plain.metadata.shared + 64, H200_SHARED_BYTES)
        spills[fn.__name__] = local_memory_bytes(traced, tmp_path)
    if any(spills.values()) and not triton.__version__.startswith("3.6"):
        # found 2026-12-07: Triton 3.9 spills 32 B a thread of the traced gate/up (values kept once a
        # program, stored in its prologue); the GPU box's 3.6, where the trace runs, spills none
        pytest.xfail(f"triton {triton.__version__}: the traced kernels spill {spills} B a thread")
    assert not any(spills.values()), spills


def gluon_down_trio_sig(fp8: bool = True) -> dict:
    """The 192-row down's arguments: h and y as the host's descriptors (h in [64, 128] FP8 or [64, 64]
    bf16 blocks), the trace pointer as the untraced launch passes it (hs, unread)."""
    return {"h_desc": row_tiles_sig("fp8e4nv", 128) if fp8 else row_tiles_sig("bf16", 64), "hs_ptr": "*fp32",
            "w_table": "*i64", "ws_table": "*i64", "block_expert": "*i32", "sorted_pair": "*i32", "topk_w": "*fp32",
            "y_desc": row_tiles_sig("bf16", 128), "n_local": "i32", "num_m_blocks": "i32", "num_n_tiles": "i32",
            "trace_ptr": "*fp32"}


def test_moe_gluon_192_row_down_compiles_warp_specialized_without_spills(tmp_path):
    """The Gluon down GEMM over 192-row tiles (moe_gluon.down_trio) at M3's widths: wgmma,
    setmaxnreg, shared memory within the H200's, no register spills at DOWN_TRIO_CONFIG."""
    from minimax_backend.kernels import moe_gluon as mg

    if not mg.HAVE_GLUON:
        pytest.skip(f"triton {triton.__version__} has no Gluon")
    for group_m, col_tiles in ((4, 1), (-1, 1), (-1, mg.col_tiles_per_program(48, mg.DOWN_TRIO_COL_TILES)), (4, 8)):
        kernel = compiled_gluon_sm90(mg._down_trio_kernel, gluon_down_trio_sig(),
                                     dict(N_OUT=6144, K=3072, GROUP_M=group_m, num_warps=4, COL_TILES=col_tiles,
                                          **mg.DOWN_TRIO_CONFIG), 4)
        ptx = kernel.asm["ptx"]
        assert "wgmma.mma_async" in ptx and "setmaxnreg" in ptx
        assert kernel.metadata.shared <= H200_SHARED_BYTES
        assert local_memory_bytes(kernel, tmp_path) == 0, (group_m, col_tiles)


GLUON_TRIO_BF16_SIG = {"x_ptr": "*bf16", "w_table": "*i64", "block_expert": "*i32", "sorted_pair": "*i32",
                       "h_ptr": "*bf16", "rows_total": "i32", "n_local": "i32", "num_m_blocks": "i32",
                       "num_n_tiles": "i32", "alpha": "fp32", "limit": "fp32", "beta": "fp32"}


@pytest.mark.parametrize("width", [3072, 256], ids=["m3", "tiny"])
def test_moe_gluon_bf16_gemms_compile_warp_specialized_without_spills(width, tmp_path):
    """The BF16 Gluon gate/up and down over 192-row tiles (moe_gluon.gate_up_act_trio / down_trio with
    bf16 input) at M3's widths and the tiny model's (4 K steps, the ring's depth): wgmma, setmaxnreg,
    shared memory within the H200's, no register spills at their configs."""
    from minimax_backend.kernels import moe_gluon as mg

    if not mg.HAVE_GLUON:
        pytest.skip(f"triton {triton.__version__} has no Gluon")
    gate_up = compiled_gluon_sm90(mg._gate_up_trio_bf16_kernel, GLUON_TRIO_BF16_SIG,
                                  dict(N=width, K=2 * width, ACT=0, GROUP_M=-1, num_warps=4, **mg.TRIO_BF16_CONFIG), 4)
    down_sig = gluon_down_trio_sig(fp8=False)
    downs = [compiled_gluon_sm90(mg._down_trio_kernel, down_sig,
                                 dict(N_OUT=2 * width, K=width, GROUP_M=group_m, num_warps=4, COL_TILES=col_tiles,
                                      FP8=False, **mg.DOWN_TRIO_CONFIG), 4)
             for group_m, col_tiles in ((-1, mg.col_tiles_per_program(2 * width // 128, mg.DOWN_TRIO_COL_TILES)),
                                        (4, 1))]
    for kernel in (gate_up, *downs):
        ptx = kernel.asm["ptx"]
        assert "wgmma.mma_async" in ptx and ".bf16.bf16" in ptx and "setmaxnreg" in ptx
        assert kernel.metadata.shared <= H200_SHARED_BYTES
        assert local_memory_bytes(kernel, tmp_path) == 0


def sass_of(kernel, tmp_path, cubin: bytes | None = None, name: str = "kernel_sass") -> str:
    """The SASS of a compiled kernel (or of the given cubin bytes), from the cuobjdump that Triton ships."""
    import os
    import subprocess

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        pytest.skip("this triton ships no cuobjdump")
    path = tmp_path / f"{name}.cubin"
    path.write_bytes(kernel.asm["cubin"] if cubin is None else cubin)
    return subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("width", [3072, 256], ids=["m3", "tiny"])
def test_moe_gluon_bf16_in_one_pass_keeps_its_products_in_flight(width, tmp_path):
    """moe_bf16_passes=1: the BF16 192-row gate/up takes all 128 columns of h in one pass (a gate and an
    up product side by side from a 256-row weight tile) and the down two column tiles a pass, within
    the H200's shared memory and without spills at their configs; each consumer group keeps a step's
    two products in flight (ptxas waits for all but two, three groups) rather than waiting after each
    (which it does when a group has too few registers: at 168 for the workers the first group keeps
    152)."""
    from minimax_backend.kernels import moe_gluon as mg

    if not mg.HAVE_GLUON:
        pytest.skip(f"triton {triton.__version__} has no Gluon")
    gate_up = compiled_gluon_sm90(mg._gate_up_trio_bf16_kernel, GLUON_TRIO_BF16_SIG,
                                  dict(N=width, K=2 * width, ACT=0, GROUP_M=-1, num_warps=4, LIVE_ROWS=True, PASSES=1,
                                       **mg.TRIO_BF16_ONE_PASS_CONFIG), 4)
    down = compiled_gluon_sm90(mg._down_trio_kernel, gluon_down_trio_sig(fp8=False),
                               dict(N_OUT=2 * width, K=width, GROUP_M=-1, num_warps=4, COL_TILES=4, FP8=False,
                                    LIVE_ROWS=True, PAIRS=True, **mg.DOWN_TRIO_PAIRS_CONFIG), 4)
    spilled = {}
    for name, kernel in (("gate/up", gate_up), ("down", down)):
        ptx = kernel.asm["ptx"]
        assert "wgmma.mma_async" in ptx and ".bf16.bf16" in ptx and "setmaxnreg" in ptx
        assert kernel.metadata.shared <= H200_SHARED_BYTES
        sass = sass_of(kernel, tmp_path)
        assert sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x2") == 3, f"{name}: a group waits for each product"
        spilled[name] = local_memory_bytes(kernel, tmp_path)
    if any(spilled.values()) and not triton.__version__.startswith("3.6"):
        # found 2026-12-07: Triton 3.9 spills 8 B a thread of the gate/up; the GPU box's 3.6 none
        pytest.xfail(f"triton {triton.__version__}: the one-pass BF16 kernels spill {spilled} B a thread")
    assert not any(spilled.values()), spilled


def test_moe_gluon_192_row_kernels_with_live_rows_only(tmp_path):
    """moe_trio_rows=live: the 192-row Gluon kernels' producer loads the second and third 64-row tiles
    under a branch and expects one of three byte counts (the number of tiles it loads), where the
    plain form expects one count and always loads three; the kernels stay within the H200's shared
    memory, and none of the three spills registers."""
    from minimax_backend.kernels import moe_gluon as mg

    if not mg.HAVE_GLUON:
        pytest.skip(f"triton {triton.__version__} has no Gluon")
    cases = [(mg._gate_up_trio_kernel, gluon_trio_sig(),
              dict(N=3072, K=6144, ACT=0, GROUP_M=-1, num_warps=4, **mg.TRIO_CONFIG)),
             (mg._down_trio_kernel, gluon_down_trio_sig(),
              dict(N_OUT=6144, K=3072, GROUP_M=-1, num_warps=4, COL_TILES=3, **mg.DOWN_TRIO_CONFIG)),
             (mg._gate_up_trio_bf16_kernel, GLUON_TRIO_BF16_SIG,
              dict(N=3072, K=6144, ACT=0, GROUP_M=-1, num_warps=4, **mg.TRIO_BF16_CONFIG))]
    for fn, sig, constants in cases:
        plain = compiled_gluon_sm90(fn, sig, {**constants, "LIVE_ROWS": False}, 4)
        live = compiled_gluon_sm90(fn, sig, {**constants, "LIVE_ROWS": True}, 4)
        expects = [k.asm["ptx"].count("expect_tx") for k in (plain, live)]
        assert expects[1] == 3 * expects[0] > 0, (fn.__name__, expects)
        assert live.metadata.shared <= H200_SHARED_BYTES
        assert local_memory_bytes(live, tmp_path) == 0, fn.__name__


def sass_lines(cubin: bytes, tmp_path, name: str) -> list[tuple[str, int, int]]:
    """(instruction text, low word, high word) of each instruction of a one-kernel cubin, from cuobjdump."""
    lines = sass_of(None, tmp_path, cubin, name).splitlines()
    out = []
    for i, line in enumerate(lines):
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;\s*/\* (0x[0-9a-f]{16}) \*/", line)
        if m:
            high = re.search(r"0x[0-9a-f]{16}", lines[i + 1]).group(0)
            out.append((m.group(1), int(m.group(2), 16), int(high, 16)))
    return out


def test_ffma_yield_edits_only_the_fp8_promotion_ffmas_control_bits(tmp_path):
    """kernel option moe_fp8_yield (kernels/ffma_yield.py) on the FP8 192-row gate/up and down as
    compiled for sm_90: the encoding it relies on holds in ptxas's output (a register FFMA, in any
    rounding mode, has opcode 0x223; the reuse flags are exactly the disassembly's `.reuse`; no instruction with one is marked
    to yield), its runs hold each consumer group's promotion (64 FFMA a K step: 3 groups x 2 passes in
    the gate/up, 3 groups in the down, where ptxas moves a few elsewhere), and after the edit the
    disassembly is the same instruction for instruction but for the `.reuse` of the FFMAs it made
    yield, with nothing else in the cubin changed."""
    from minimax_backend.kernels import ffma_yield as fy
    from minimax_backend.kernels import moe_gluon as mg

    if not mg.HAVE_GLUON:
        pytest.skip(f"triton {triton.__version__} has no Gluon")
    cases = [(mg._gate_up_trio_kernel, gluon_trio_sig(),
              dict(N=3072, K=6144, ACT=0, GROUP_M=-1, num_warps=4, LIVE_ROWS=True, **mg.TRIO_CONFIG), 384, 384),
             (mg._down_trio_kernel, gluon_down_trio_sig(),
              dict(N_OUT=6144, K=3072, GROUP_M=-1, num_warps=4, COL_TILES=3, LIVE_ROWS=True, **mg.DOWN_TRIO_CONFIG),
              168, 192)]  # ptxas interleaves 6 (Triton 3.6) or 14 (3.9) of the down's 192 with other work
    for fn, sig, constants, least, most in cases:
        kernel = compiled_gluon_sm90(fn, sig, constants, 4)
        cubin = kernel.asm["cubin"]
        before = sass_lines(cubin, tmp_path, "plain")
        for text, low, high in before:
            assert (low & fy.OPCODE_MASK == fy.FFMA_REGISTERS) == (text.split()[0].split(".")[0] == "FFMA" and text.count(", R") == 3
                                                                   and "c[" not in text), text
            assert bool(high & fy.REUSE_BITS) == (".reuse" in text), text
            if high & fy.REUSE_BITS:
                assert high & fy.NO_YIELD_BIT, text
        for every in (1, 2, 4):
            patched, changed = fy.with_ffma_yields(cubin, every)
            if every == 1:
                assert least <= changed <= most, (fn.__name__, changed)
            after = sass_lines(patched, tmp_path, f"yield{every}")
            assert len(after) == len(before)
            offset, size = fy.text_sections(cubin)[f".text.{fn.__name__}"]
            targets = {i for run in fy.ffma_runs(cubin[offset:offset + size]) for i in run[every - 1::every]}
            assert len(targets) == changed
            for i, ((t0, lo0, hi0), (t1, lo1, hi1)) in enumerate(zip(before, after)):
                assert lo1 == lo0, t0
                if i in targets:
                    assert t0.startswith("FFMA") and hi1 == hi0 & ~(fy.NO_YIELD_BIT | fy.REUSE_BITS), t0
                    assert t1 == t0.replace(".reuse", ""), t0
                else:
                    assert (t1, hi1) == (t0, hi0)
            assert patched[:offset] == cubin[:offset] and patched[offset + size:] == cubin[offset + size:]


def test_moe_route_and_alignment_kernels_compile(moe):
    from minimax_backend.kernels import moe_align_triton as al
    from minimax_backend.kernels import moe_route_triton as rt

    compile_sm90(rt._select_kernel, {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "ids_ptr": "*i64", "w_ptr": "*fp32",
                                     "E": "i32", "stride_l": "i32", "scaling": "fp32"},
                 dict(HAS_BIAS=True, NORM=True, K=4, BE=128), ["logits_ptr", "bias_ptr", "ids_ptr", "w_ptr"],
                 num_warps=1)
    # the decode logits, with x's FP8 quantization in the same launch (QUANT) and without
    for quant in (False, True):
        compile_sm90(rt._logits_kernel, {"x_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*fp32", "q_ptr": "*fp8e4nv",
                                         "s_ptr": "*fp32", "T": "i32", "E": "i32", "H": "i32", "stride_x": "i32",
                                         "stride_w": "i32", "stride_o": "i32", "stride_q": "i32", "stride_s": "i32"},
                     dict(BT=16, BE=1, BH=512, QUANT=quant, G=128), ["x_ptr", "w_ptr", "out_ptr", "q_ptr"],
                     num_warps=4)
    # the prefill logits: three bf16 wgmma products per K step, the weight split in registers
    for bm, bn, bk, warps, stages in (rt.THREE_BF16_TILES, rt.THREE_BF16_NARROW_TILES):
        ptx, shared = compile_sm90(rt._logits_three_bf16_kernel,
                                   {"x_ptr": "*bf16", "p_ptr": "*bf16", "out_ptr": "*fp32", "T": "i32", "E": "i32",
                                    "H": "i32", "stride_x": "i32", "stride_o": "i32", "steps_per_split": "i32"},
                                   dict(BM=bm, BN=bn, BK=bk, UPCAST=False),
                                   ["x_ptr", "p_ptr", "out_ptr", "H", "stride_x", "stride_o"],
                                   num_warps=warps, num_stages=stages)
        assert "wgmma.mma_async.sync.aligned" in ptx and ".bf16.bf16" in ptx and shared <= H200_SHARED_BYTES
    compile_sm90(rt._split_bf16_kernel, {"w_ptr": "*fp32", "parts_ptr": "*bf16", "N": "i32"},
                 dict(BLOCK=rt.SPLIT_BLOCK), ["w_ptr", "parts_ptr", "N"], num_warps=4)
    # the chunked alignment at the chunk sizes chunk_pairs picks, M3's 128 experts + the shared one:
    # 1024 pairs per program at an 8k prefill, 256 at 1024 tokens
    for pairs, max_rows, max_blocks, bm in ((40960, 65664, 342, 192), (5120, 13248, 207, 64)):
        chunk = al.chunk_pairs(pairs)
        warps = 4 if chunk <= 256 else 8
        compile_sm90(al._chunk_counts_kernel, {"ids_ptr": "*i64", "counts_ptr": "*i32", "sorted_pair_ptr": "*i32",
                                               "expert_offset": "i32", "shared_id": "i32", "share": "i32"},
                     dict(PAIRS=pairs, N_LOCAL=129, ROUTED=128, NB=256, C=chunk, MAX_ROWS=max_rows, FILL=1024),
                     ["ids_ptr", "counts_ptr", "sorted_pair_ptr"], num_warps=warps)
        compile_sm90(al._chunk_place_kernel, {"ids_ptr": "*i64", "counts_ptr": "*i32", "sorted_pair_ptr": "*i32",
                                              "block_expert_ptr": "*i32", "pair_row_ptr": "*i32",
                                              "expert_offset": "i32", "shared_id": "i32"},
                     dict(PAIRS=pairs, N_LOCAL=129, ROUTED=128, NB=256, BM=bm, MAX_BLOCKS=max_blocks,
                          B2=triton.next_power_of_2(max_blocks), C=chunk, CHUNKS=-(-pairs // chunk), RB=16),
                     ["ids_ptr", "counts_ptr", "sorted_pair_ptr", "block_expert_ptr", "pair_row_ptr"],
                     num_warps=warps)
    compile_sm90(al._align_kernel, {"ids_ptr": "*i64", "sorted_pair_ptr": "*i32", "block_expert_ptr": "*i32",
                                    "pair_row_ptr": "*i32", "expert_offset": "i32", "shared_id": "i32"},
                 dict(PAIRS=320, P2=512, N_LOCAL=129, ROUTED=128, NB=256, BM=16, MAX_ROWS=2256, MAX_BLOCKS=141,
                      B2=256, FILL=1024), ["ids_ptr", "sorted_pair_ptr", "block_expert_ptr", "pair_row_ptr"],
                 num_warps=8)
    # the program order's groups by expert, one program: an 8k prefill's 342 blocks of 192 rows and the
    # largest table one program takes
    from minimax_backend.kernels import moe_expert_groups as eg

    for width in (512, eg.MAX_BLOCKS_ONE_PROGRAM):
        compile_sm90(eg._groups_kernel, {"be_ptr": "*i32", "out_ptr": "*i32", "num_blocks": "i32", "cap": "i32"},
                     dict(B2=width), ["be_ptr", "out_ptr"], num_warps=eg.groups_kernel_warps(width))


@pytest.mark.parametrize("tokens", [1, 64])
def test_moe_select_align_kernel_compiles_for_m3_decode(moe, tokens, tmp_path):
    """The selection + shared slot + alignment in one program (kernels/moe_select_align.py) at M3's
    128 experts, top-4 and the shared slot, as one_program_outputs sizes it; no register spills."""
    from minimax_backend.kernels import moe_select_align as sa
    from minimax_backend.kernels.moe_align_triton import one_program_outputs

    _, constants, warps = one_program_outputs(tokens * 5, 128, 16, 128, torch.device("cpu"))
    kernel = compiled_sm90(sa._select_align_kernel,
                           {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "ids_ptr": "*i64", "w_ptr": "*fp32",
                            "sorted_pair_ptr": "*i32", "block_expert_ptr": "*i32", "pair_row_ptr": "*i32",
                            "E": "i32", "stride_l": "i32", "scaling": "fp32", "expert_offset": "i32",
                            "shared_id": "i32"},
                           dict(T=tokens, BT=triton.next_power_of_2(tokens), BE=128, HAS_BIAS=True, NORM=True,
                                TOP_K=4, SHARED=True, **constants),
                           ["logits_ptr", "bias_ptr", "ids_ptr", "w_ptr", "sorted_pair_ptr", "block_expert_ptr",
                            "pair_row_ptr"], num_warps=warps)
    assert local_memory_bytes(kernel, tmp_path) == 0


# ------------------------------------------------------------ norm + quant
NORM_SIG = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32",
            "y_ptr": "*bf16", "r_ptr": "*bf16", "M": "i32", "K_f": "fp32", "n_groups": "i32", "stride_x": "i32",
            "stride_res": "i32", "stride_q": "i32", "stride_s": "i32", "stride_y": "i32", "stride_r": "i32",
            "eps": "fp32"}
NORM_ALIGNED = ["x_ptr", "res_ptr", "w_ptr", "q_ptr", "s_ptr", "y_ptr", "r_ptr", "stride_x", "stride_res",
                "stride_q", "stride_y", "stride_r"]


@pytest.mark.parametrize("split, want_y, gemma, rows", [(False, False, True, 1), (True, False, True, 1),
                                                        (True, True, False, 2), (False, True, False, 2)])
def test_norm_quant_kernel_compiles_with_vector_accesses(split, want_y, gemma, rows):
    """Hidden 6144, G 128: one padded tile or two exact ones (32 + 16 groups)."""
    from minimax_backend.kernels import norm_quant_triton as nq

    ng, ng_b = nq.tile_groups(48, split)
    consts = dict(G=128, NG=ng, NG_B=ng_b, ROWS=rows, HAS_RESIDUAL=True, GEMMA=gemma, WANT_Y=want_y,
                  ROUND_BF16=True, NORM=True)
    ptx, _ = compile_sm90(nq._rms_norm_quant_fp8_kernel, NORM_SIG, consts, NORM_ALIGNED, num_warps=4)
    assert byte_loads(ptx) == 0
    assert re.search(r"ld\.global[^;\n]*\.v[24]", ptx), "bf16 rows are not loaded as vectors"


def test_quantize_only_kernel_compiles():
    from minimax_backend.kernels import norm_quant_triton as nq

    consts = dict(G=128, NG=64, NG_B=0, ROWS=1, HAS_RESIDUAL=False, GEMMA=False, WANT_Y=False, ROUND_BF16=False,
                  NORM=False)
    ptx, _ = compile_sm90(nq._rms_norm_quant_fp8_kernel, NORM_SIG, consts, NORM_ALIGNED, num_warps=4)
    assert byte_loads(ptx) == 0


def test_moe_quantize_scatter_kernel_compiles_with_vector_stores():
    """kernels/moe_quant_scatter.py: the FP8 rows stored as vectors (a byte-wise store would undo the
    point of replacing the byte-wise torch gather)."""
    from minimax_backend.kernels import moe_quant_scatter as mqs

    sig = {"x_ptr": "*bf16", "pair_row": "*i32", "sorted_pair": "*i32", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32",
           "T": "i32", "rows": "i32", "n_groups": "i32", "stride_x": "i32", "stride_q": "i32", "stride_s": "i32"}
    consts = dict(SLOTS=5, G=mqs.GROUP, NG=mqs.CHUNK_GROUPS, ZR=mqs.ZERO_ROWS, ZC=mqs.ZERO_COLUMNS,
                  SKIP_PADDING_GROUPS=True)  # as the Gluon path launches it
    ptx, _ = compile_sm90(mqs._quantize_scatter_kernel, sig, consts,
                          ["x_ptr", "pair_row", "sorted_pair", "q_ptr", "s_ptr", "stride_x", "stride_q"], num_warps=4)
    assert byte_loads(ptx) == 0
    assert re.search(r"st\.global[^;\n]*\.v[24]", ptx), "FP8 rows are not stored as vectors"
    # scatter_rows (BF16, no quantization): the rows stored as vectors too
    ptx, _ = compile_sm90(mqs._quantize_scatter_kernel, {**sig, "q_ptr": "*bf16", "s_ptr": "*bf16"},
                          {**consts, "QUANT": False},
                          ["x_ptr", "pair_row", "sorted_pair", "q_ptr", "s_ptr", "stride_x", "stride_q"], num_warps=4)
    assert re.search(r"st\.global[^;\n]*\.v[24]", ptx), "bf16 rows are not stored as vectors"


@pytest.mark.parametrize("m", [16, 4096])
def test_fp8_block_gemm_fallback_kernel_compiles(m):
    """The Triton FP8 block GEMM (fallback where torch._scaled_mm blockwise is unavailable), o_proj at TP 2."""
    from minimax_backend.kernels import fp8_gemm_cuda as fg

    cfg = fg._triton_config(m, 128)
    launch = {k: cfg.pop(k) for k in ("num_warps", "num_stages")}
    sig = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "c_ptr": "*bf16", "as_ptr": "*fp32", "bs_ptr": "*fp32",
           "M": "i32", "N": "i32", "stride_am": "i32", "stride_bn": "i32", "stride_cm": "i32", "stride_asm": "i32",
           "stride_bsn": "i32"}
    ptx, shared = compile_sm90(fg._fp8_block_gemm_kernel, sig, dict(K=4096, G=128, **cfg),
                               ["a_ptr", "b_ptr", "c_ptr", "as_ptr", "bs_ptr", "N", "stride_am", "stride_bn",
                                "stride_cm"], **launch)
    assert byte_loads(ptx) == 0
    assert shared <= H200_SHARED_BYTES


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("n, k", [(9216, 6144), (6144, 8192), (24576, 6144), (6144, 12288)])
def test_fp8_small_m_kernel_streams_weights_in_16_byte_copies(n, k, block_m, tmp_path):
    """The decode GEMM (kernels/fp8_small_m_triton.py) at M3's shapes, with the config its
    table picks, at its smallest and largest row tile: weights arrive as 16-byte async
    copies, no spills, shared memory fits."""
    from minimax_backend.kernels import fp8_small_m_triton as sm

    cfg = sm.small_m_config(n, k)
    sig = {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "out_ptr": "*bf16",
           "M": "i32", "N": "i32", "stride_am": "i32", "stride_asm": "i32", "stride_wn": "i32", "stride_wsn": "i32",
           "stride_os": "i32", "stride_om": "i32"}
    kernel = compiled_sm90(sm._small_m_kernel, sig,
                           dict(GROUPS_PER_SPLIT=k // 128 // cfg.split_k, BLOCK_M=block_m, BLOCK_N=cfg.block_n),
                           ["a_ptr", "as_ptr", "w_ptr", "ws_ptr", "out_ptr", "N", "stride_am", "stride_wn",
                            "stride_om"], num_warps=cfg.warps, num_stages=cfg.stages)
    copies = async_copies(kernel.asm["ptx"])
    assert copies.get(16, 0) > 0 and set(copies) == {16}, copies
    assert byte_loads(kernel.asm["ptx"]) == 0
    assert kernel.metadata.shared <= H200_SHARED_BYTES
    assert local_memory_bytes(kernel, tmp_path) == 0


# --------------------------------------------------------------------- MSA
SCORES_SIG = {"q_ptr": "*bf16", "k_ptr": "*bf16", "pos_ptr": "*i64", "out_ptr": "*fp32", "seq": "i32", "heads": "i32",
              "n_blocks": "i32", "blocks_per_prog": "i32", "stride_kb": "i32", "stride_kl": "i32"}
ATTN_SIG = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "blocks_ptr": "*i32", "pos_ptr": "*i64",
            "o_ptr": "*bf16", "lse_ptr": "*fp32", "seq": "i32", "n_tiles": "i32", "key_slots": "i32",
            "qk_scale": "fp32", "stride_qt": "i32", "stride_qh": "i32", "stride_kb": "i32", "stride_kh": "i32",
            "stride_kl": "i32", "stride_vb": "i32", "stride_vh": "i32", "stride_vl": "i32", "stride_bt": "i32",
            "stride_bh": "i32", "stride_ot": "i32", "stride_oh": "i32", "stride_os": "i32"}
ATTN_ALIGNED = ["q_ptr", "k_ptr", "v_ptr", "blocks_ptr", "pos_ptr", "o_ptr", "lse_ptr", "stride_qt", "stride_qh",
                "stride_kb", "stride_kh", "stride_kl", "stride_vb", "stride_vh", "stride_vl", "stride_bt",
                "stride_ot", "stride_oh"]


def test_msa_block_scores_kernel_uses_the_tensor_cores():
    """M3's indexer at prefill: 64 (token, head) rows x 128 keys x 128 dims per block."""
    from minimax_backend.kernels import msa_triton as mt

    consts = dict(BS=128, D=128, BLOCK_R=64, LOCAL=1, INIT=0, UPCAST=False, IEEE=False)
    ptx, shared = compile_sm90(mt._block_scores_kernel, SCORES_SIG, consts,
                               ["q_ptr", "k_ptr", "pos_ptr", "out_ptr", "stride_kb", "stride_kl"], num_warps=4)
    assert "wgmma" in ptx or "mma.sync" in ptx
    assert byte_loads(ptx) == 0 and shared <= H200_SHARED_BYTES
    compile_sm90(mt._top_blocks_kernel, {"scores_ptr": "*fp32", "out_ptr": "*i32", "n_blocks": "i32"},
                 dict(K_OUT=16, NB=1024), ["scores_ptr", "out_ptr"], num_warps=4)  # 128k keys


@pytest.mark.parametrize("tok, split", [(4, 1), (1, 8)])
def test_msa_attention_kernel_compiles_for_m3(tok, split):
    """M3 at TP 1: 16 query heads per index head; prefill tiles of 4 tokens (64 rows, wgmma),
    decode one token split over 8 programs."""
    from minimax_backend.kernels import msa_triton as mt

    sig = dict(ATTN_SIG, o_ptr="*bf16" if split == 1 else "*fp32")
    consts = dict(HQ=64, HI=4, HKV=4, G=16, G_PAD=16, TOK=tok, K=16, K_PAD=16, SPLIT=split, BS=128, D=128,
                  UPCAST=False, IEEE=False)
    ptx, shared = compile_sm90(mt._sparse_attention_kernel, sig, consts, ATTN_ALIGNED, num_warps=4)
    if tok * 16 >= 64:
        assert "wgmma" in ptx, "the 64-row prefill tile does not use Hopper's wgmma"
    assert byte_loads(ptx) == 0 and shared <= H200_SHARED_BYTES
    compile_sm90(mt._merge_kernel, {"part_ptr": "*fp32", "lse_ptr": "*fp32", "o_ptr": "*bf16", "stride_ot": "i32",
                                    "stride_oh": "i32"}, dict(HQ=64, SPLIT=8, D=128), ["part_ptr", "o_ptr"],
                 num_warps=4)


GLUON_WEIGHT_STREAM_SIG = {"w_ptr": "*fp8e4nv", "a_ptr": "*fp8e4nv", "rows_w": "i32", "rows_a": "i32",
                           "n_slabs": "i32", "row_sets": "i32"}


@pytest.mark.parametrize("stages, a_tiles", [(2, 0), (4, 3), (8, 0)])
def test_weight_stream_ring_compiles_to_tma_loads_in_the_shared_memory_it_counts(stages, a_tiles, tmp_path):
    """kernels/moe_weight_stream.py (tools/bench_weight_stream.py's ring): TMA loads by a producer
    warp, its registers set with setmaxnreg, no spills, and the shared memory ring_shared_bytes
    counts (which check_ring holds against the SM's) plus at most 1 KB of barriers."""
    from minimax_backend.kernels import moe_weight_stream as ws

    if not ws.HAVE_GLUON:
        pytest.skip(f"triton {triton.__version__} has no Gluon")
    kernel = compiled_gluon_sm90(ws._stream_kernel, GLUON_WEIGHT_STREAM_SIG,
                                 dict(K=6144, STAGES=stages, A_TILES=a_tiles, SLABS_PER_ROWS=24, num_warps=4), 4)
    ptx = kernel.asm["ptx"]
    assert "cp.async.bulk.tensor" in ptx and "setmaxnreg" in ptx
    assert 0 <= kernel.metadata.shared - ws.ring_shared_bytes(stages, a_tiles) <= 1024
    assert local_memory_bytes(kernel, tmp_path) == 0
