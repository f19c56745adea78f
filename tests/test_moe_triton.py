"""The Triton grouped-GEMM MoE path (kernels/moe_triton.py) against the reference.

On CPU the kernels run under TRITON_INTERPRET=1 at tiny shapes (the same
kernel code the GPU compiles); on a GPU the `gpu` tests run them for real.
Triton picks interpreter or compiler when it is imported, and the test
process has imported it long before, so test_in_interpreter_child re-runs
this file in a child started with TRITON_INTERPRET=1, where the interpreter
tests run (they skip in the parent).

Tolerances (relative to max |reference|):
    float32   1e-5      (seen: 5e-7; summation order)
    bfloat16  1e-2      (seen: 5.6e-3; the GEMM rounds once, where the
                         reference's activation rounds after every op)
    FP8       Frobenius 3% (seen: ~1.5%): the activation is quantized to E4M3
              in the kernel; a one-ulp bf16 difference before that can move
              an element across an E4M3 rounding step (6% for that element)
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from conftest import tiny_m2_config, tiny_m3_config
from interpreted import INTERPRETING, run_this_file_interpreted
from minimax_backend.kernels import moe as K
from minimax_backend.kernels import moe_plan as plan
from minimax_backend.kernels import moe_parallel as P
from minimax_backend.kernels import moe_reference as R
from minimax_backend.kernels.options import override_kernel_options

triton = pytest.importorskip("triton", reason="the Triton MoE path needs triton (pip install triton)")

# The non-default MoE kernel switches (kernels/options.py), as option=value.
OTHER_SWITCHES = ["moe_align=torch", "moe_shared=separate", "moe_route=torch", "moe_select=separate", "moe_overlap=off",
                  "moe_gate_up=one_dot", "moe_gate_up=two_dots", "moe_group_m=4", "moe_group_m=0",
                  "moe_expert_groups=4", "moe_gemm=auto", "moe_half_blocks=on"]


class _Launches:
    """Stands in for a Triton kernel (kernel[grid](...)): records each launch's keyword
    arguments, then launches the real kernel."""

    def __init__(self, kernel):
        self.kernel, self.kwargs = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.kwargs.append(kwargs)
            return self.kernel[grid](*args, **kwargs)

        return launch


@contextlib.contextmanager
def _switched(switch: str):
    """override_kernel_options for one "option=value" of OTHER_SWITCHES, and a check, by spies
    on the modules the ops run, that the path the switch asks for ran. A switch the ops never
    see passes any check of the numbers alone (the default path computes the same numbers):
    in whole-suite runs until 2026-12-03 the ops ran a second copy of these modules
    (tests/test_import_names.py) and every test of a switch still passed."""
    import minimax_backend.kernels.moe_gluon as mg
    import minimax_backend.kernels.moe_triton as kt

    name, value = switch.split("=")
    grouped, sorted_in_torch, sorted_in_triton, routed, fits, gluon, selected = [], [], [], [], [], [], []

    def spy(record, real):
        def call(*args, **kwargs):
            out = real(*args, **kwargs)
            record.append((kwargs, out))
            return out

        return call

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kt, "grouped_gated_mlp", spy(grouped, kt.grouped_gated_mlp))
        mp.setattr(kt, "align_by_expert", spy(sorted_in_torch, kt.align_by_expert))
        mp.setattr(kt, "align_with_triton", spy(sorted_in_triton, kt.align_with_triton))
        mp.setattr(kt, "route_triton", spy(routed, kt.route_triton))
        mp.setattr(kt, "select_and_align", spy(selected, kt.select_and_align))
        mp.setattr(plan, "gluon_fits", spy(fits, plan.gluon_fits))
        mp.setattr(mg, "gate_up_act", spy(gluon, mg.gate_up_act))
        mp.setattr(mg, "gate_up_act_trio", spy(gluon, mg.gate_up_act_trio))
        gate_up, down = _Launches(kt._gate_up_act_kernel), _Launches(kt._down_kernel)
        mp.setattr(kt, "_gate_up_act_kernel", gate_up)
        mp.setattr(kt, "_down_kernel", down)
        # The Triton kernels' own switches are checked on the Triton gate/up: pinned, whatever
        # moe_gemm's default is (auto runs the Gluon gate/up at FP8 prefill sizes on sm_90, and
        # over 192-row blocks the Gluon down too: no Triton GEMM launch is left to look at)
        pin = ({"moe_gemm": "triton"} if name in ("moe_gate_up", "moe_group_m", "moe_expert_groups", "moe_overlap",
                                                  "moe_half_blocks") else {})
        with override_kernel_options(**{name: value, **pin}):
            yield
    assert grouped, f"{switch}: the ops never reached kernels/moe_triton.py's grouped GEMMs"
    if name == "moe_align":
        assert sorted_in_torch and not sorted_in_triton, \
            f"{switch}: torch sort {len(sorted_in_torch)} times, Triton alignment {len(sorted_in_triton)} times"
    elif name == "moe_route":
        assert not routed and not selected, f"{switch}: the Triton selection ran {len(routed + selected)} times"
    elif name == "moe_select":
        assert not selected and sorted_in_triton, f"{switch}: {len(selected)} fused selections"
    elif name == "moe_shared":
        assert all(kw.get("shared") is None for kw, _ in grouped), f"{switch}: the shared expert joined a launch"
        assert any(kw.get("single_expert") for kw, _ in grouped), f"{switch}: the shared expert's own launch never ran"
    elif name == "moe_gate_up":
        assert gate_up.kwargs and all(kw["ONE_DOT"] == (value == "one_dot") for kw in gate_up.kwargs), switch
    elif name == "moe_group_m":
        launches = gate_up.kwargs + down.kwargs
        assert launches and all(kw["GROUP_M"] == int(value) for kw in launches), switch
    elif name == "moe_overlap":  # the default takes PDL on sm_90 (tests/test_moe_select_align.py)
        launches = gate_up.kwargs + down.kwargs
        assert launches and not any(kw.get("PDL") or kw.get("launch_pdl") for kw in launches), switch
    elif name == "moe_expert_groups":
        launches = gate_up.kwargs + down.kwargs
        assert launches and all(kw["GROUP_M"] == -1 for kw in launches), switch
    elif name == "moe_half_blocks":  # the half copy wherever a block has halves of 16 rows or more
        launches = gate_up.kwargs + down.kwargs
        assert launches and all(kw["HALVES"] == (kw["BM"] >= 32) for kw in launches), switch
    elif name == "moe_gemm":  # where gluon_fits says yes a Gluon gate/up (64- or 192-row) runs, elsewhere the Triton one
        assert len(gluon) == sum(1 for _, yes in fits if yes), f"{switch}: {len(gluon)} Gluon launches"


@pytest.mark.skipif(INTERPRETING, reason="this is the child")
def test_in_interpreter_child():
    run_this_file_interpreted(__file__)


# -------------------------------------------------------- align_by_expert
@pytest.mark.parametrize("offset, n_local, block_m", [(0, 8, 16), (4, 4, 16), (2, 2, 4)])
def test_align_by_expert(offset, n_local, block_m):
    from minimax_backend.kernels.moe_triton import align_by_expert

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 8, (23, 2), generator=g)
    ids[:, 1] = (ids[:, 0] + 1 + torch.randint(0, 7, (23,), generator=g)) % 8  # distinct per token
    ids[ids == 3] = 5  # expert 3 idle
    al = align_by_expert(ids, offset, n_local, block_m)
    flat = ids.reshape(-1)
    local = (flat >= offset) & (flat < offset + n_local)
    assert al.max_rows % block_m == 0 and al.block_expert.numel() == al.max_rows // block_m
    # every local pair sits at exactly one row, in its expert's blocks; the rest nowhere
    for p in range(flat.numel()):
        r = int(al.pair_row[p])
        if not local[p]:
            assert r == -1
            continue
        assert int(al.sorted_pair[r]) == p
        assert int(al.block_expert[r // block_m]) == int(flat[p]) - offset
    assert int((al.sorted_pair >= 0).sum()) == int(local.sum())
    # runs ordered by expert; blocks past the used ones are idle (>= n_local)
    used = al.block_expert[al.block_expert < n_local]
    assert torch.equal(used, used.sort().values)
    assert (al.block_expert[len(used):] >= n_local).all()


@pytest.mark.parametrize("tokens", [1, 5, 16, 17, 37, 200])
@pytest.mark.parametrize("block_m", [16, 64])
def test_single_expert_alignment_equals_the_sort(tokens, block_m):
    from minimax_backend.kernels.moe_triton import align_by_expert, single_expert_alignment

    want = align_by_expert(torch.zeros(tokens, 1, dtype=torch.int64), 0, 1, block_m)
    got = single_expert_alignment(tokens, block_m, torch.device("cpu"))
    assert torch.equal(got.sorted_pair, want.sorted_pair)
    assert torch.equal(got.block_expert, want.block_expert)
    assert torch.equal(got.pair_row, want.pair_row)
    assert single_expert_alignment(tokens, block_m, torch.device("cpu")) is got  # built once


def test_kernel_switches_reach_the_moe_kernels():
    """The MoE readers of kernels/options.py (bad values: tests/test_kernel_options.py)."""
    from minimax_backend.kernels import moe_triton
    from minimax_backend.kernels.moe_route_triton import route_mode
    from minimax_backend.kernels.moe_plan import tile_config

    assert tile_config(8, 2, 8, True)["BM"] == 16  # the heuristic by default
    with override_kernel_options(moe_tiles="16,128,128,4,3,64"):  # the optional down BLOCK_N
        assert tile_config(8, 2, 8, True) == {"BM": 16, "BN": 128, "BK": 128, "num_warps": 4, "num_stages": 3,
                                              "BN_DOWN": 64, "down_warps": 4, "down_stages": 3, "ONE_DOT": False,
                                              "GROUP_M": 0}
    with override_kernel_options(moe_tiles="64,128,128,8,4,256,8,3"):  # and the down kernel's warps, stages
        cfg = tile_config(8192, 4, 128, True)
        assert (cfg["num_warps"], cfg["num_stages"], cfg["BN_DOWN"], cfg["down_warps"], cfg["down_stages"]) == \
            (8, 4, 256, 8, 3)
    with override_kernel_options(moe_tiles=(64, 128, 64, 4, 3)):
        assert tile_config(8, 2, 8, False) == {"BM": 64, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 3,
                                               "BN_DOWN": 128, "down_warps": 4, "down_stages": 3, "ONE_DOT": False,
                                               "GROUP_M": 0}
    assert route_mode() == "triton"
    with override_kernel_options(moe_route="torch"):
        assert route_mode() == "torch"
    calls = []

    def reference(x, *args, **kwargs):
        calls.append(kwargs)
        return x

    with override_kernel_options(moe_kernel="reference"):
        moe_triton._gpu_path(reference)(torch.zeros(1, 4))  # the plain-torch experts
    moe_triton._gpu_path(reference)(torch.zeros(1, 4))
    assert calls == [{}, {"experts": moe_triton.triton_experts, "weights_cls": moe_triton.TritonMoEWeights}]


def test_where_the_shared_expert_joins_the_grouped_launch():
    from minimax_backend.kernels.moe_plan import shared_in_grouped_launch

    m3 = dict(top_k=4, num_experts=128, fp8=True, float32=False, width=3072)
    assert shared_in_grouped_launch(8192, shared_width=3072, **m3)  # EP 1: always
    assert shared_in_grouped_launch(2, shared_width=1536, **m3)  # EP 2 (a half slice) at decode
    assert shared_in_grouped_launch(1024, shared_width=1536, **m3)  # BLOCK_M 32
    assert shared_in_grouped_launch(8192, shared_width=1536, **m3)  # BLOCK_M 64: the down pipeline keeps 4 stages
    with override_kernel_options(moe_tiles="128,128,128,8,4"):  # two K loops cut 4 stages to 3: measured slower
        assert not shared_in_grouped_launch(8192, shared_width=1536, **m3)
        assert shared_in_grouped_launch(8192, shared_width=3072, **m3)
    with override_kernel_options(moe_shared="separate"):
        assert not shared_in_grouped_launch(2, shared_width=3072, **m3)


# (tokens, k, experts, offset, local experts, BLOCK_M): decode sizes at M3 width, EP halves,
# one run per expert or none, other ranks' experts, a BLOCK_M larger than the runs, tiny blocks, 16 warps
ALIGN_CASES = [(1, 4, 128, 0, 128, 16), (23, 2, 8, 4, 4, 16), (64, 4, 128, 64, 64, 16),
               (200, 4, 16, 0, 16, 64), (7, 2, 8, 2, 2, 4), (5, 4, 128, 0, 128, 16), (256, 4, 128, 0, 128, 16),
               (700, 4, 128, 0, 128, 16)]  # 2800 pairs (3500 with the shared slot): 16 warps


def _align_ids(tokens, k, experts, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    if tokens >= 5:
        ids[2] = -1  # a padding row of the sequence-parallel shard: no expert
    if tokens >= 23:
        ids[5:15, 0] = ids[4, 0]  # a crowded expert (several blocks)
    return ids


# ------------------------------------------------------------ interpreter
@pytest.fixture(scope="module")
def interp():
    if not INTERPRETING:
        pytest.skip("runs in the TRITON_INTERPRET=1 child (test_in_interpreter_child)")
    import minimax_backend.kernels.moe_triton as kt

    return kt


_BLOCKS: dict = {}


def _block(make, dtype, fp8):
    from minimax_backend.model.minimax import init_random_weights
    from minimax_backend.model.moe import MoE
    from minimax_backend.model.parallel import ParallelState

    key = (make.__name__, dtype, fp8)
    if key not in _BLOCKS:
        cfg = make()
        blk = MoE(cfg, ParallelState.single(), "model.layers.0.block_sparse_moe", dtype=dtype, device="cpu", fp8=fp8)
        blk.config = cfg
        _BLOCKS[key] = init_random_weights(blk, seed=0).eval()
    return _BLOCKS[key]


def _err(got, ref, fp8):
    got, ref = got.float(), ref.float()
    if fp8:
        return ((got - ref).norm() / ref.norm()).item()
    return ((got - ref).abs().max() / ref.abs().max()).item()


def tiny_m3_clamping():
    """tiny-m3 with SwiGLU-OAI's limit at 0.75: the gate and up values of unit-scale inputs
    cross it often, so a kernel that clamps wrongly (or not at all) fails the comparison."""
    return tiny_m3_config(swiglu_limit=0.75)


TOL = {"f32": 1e-5, "bf16": 1e-2, "fp8": 3e-2}
CASES = {
    "m3_f32": (tiny_m3_clamping, torch.float32, False, "f32"),
    "m3_bf16": (tiny_m3_clamping, torch.bfloat16, False, "bf16"),
    "m3_fp8": (tiny_m3_clamping, torch.bfloat16, True, "fp8"),
    "m2_bf16": (tiny_m2_config, torch.bfloat16, False, "bf16"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_grouped_experts_match_reference(interp, case):
    make, dtype, fp8, tol = CASES[case]
    blk = _block(make, dtype, fp8)
    args = K.block_op_args(blk)
    x = torch.randn(13, 256, generator=torch.Generator().manual_seed(1)).to(dtype)
    w = R.MoEWeights(*args)
    ids, tw = w.route(x)
    assert interp.supported(x, w)
    got = interp.triton_experts(x, ids, tw, w)
    assert got.dtype == torch.float32 and got.shape == x.shape
    ref = R.local_experts_reference(x, ids, tw, w)
    assert _err(got, ref, fp8) <= TOL[tol]
    if case.startswith("m3"):  # the clamp is exercised: without it the reference moves far past TOL
        unclamped = R.MoEWeights(*args)
        unclamped.limit = float("inf")
        assert _err(R.local_experts_reference(x, ids, tw, unclamped), ref, fp8) > 10 * TOL[tol]
    if case not in ("m3_bf16", "m3_fp8"):
        return
    # this rank's half of the experts (EP 2, rank 1): other experts' pairs contribute nothing
    half = R.MoEWeights(*args)
    half.w13, half.w2, half.expert_offset = w.w13[4:], w.w2[4:], 4
    if fp8:
        half.w13_scale, half.w2_scale = w.w13_scale[4:], w.w2_scale[4:]
    assert _err(interp.triton_experts(x, ids, tw, half), R.local_experts_reference(x, ids, tw, half), fp8) <= TOL[tol]


@pytest.mark.parametrize("case, tokens", [("m3_bf16", 1), ("m3_bf16", 9), ("m3_fp8", 5)])
def test_gpu_path_of_the_ops_equals_eager(interp, case, tokens):
    """The whole CUDA code path of minimax::moe / mega_moe (one device), run by the interpreter."""
    make, dtype, fp8, tol = CASES[case]
    blk = _block(make, dtype, fp8)
    args = K.block_op_args(blk)
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    with torch.no_grad():
        ref = blk(x)
    path = dict(experts=interp.triton_experts, weights_cls=interp.TritonMoEWeights)
    moe = R.moe_reference(x, *args, **path)
    mega = P.mega_moe_reference(x, *args, "", 1, False, False, tokens, "allgather", **path)
    for out in (moe, mega):
        assert out.dtype == dtype
        assert _err(out, ref, fp8) <= (2 * TOL[tol] if not fp8 else TOL[tol])  # + the shared expert's rounding


def test_idle_and_crowded_experts(interp):
    """All tokens on one expert (a run of several blocks), the others idle."""
    blk = _block(tiny_m3_config, torch.float32, False)
    w = R.MoEWeights(*K.block_op_args(blk))
    x = torch.randn(37, 256, generator=torch.Generator().manual_seed(2))
    ids = torch.stack([torch.full((37,), 6), torch.full((37,), 1)], 1)
    tw = torch.rand(37, 2, generator=torch.Generator().manual_seed(3))
    cfg = {"BM": 16, "BN": 128, "BK": 64}
    got = interp.grouped_gated_mlp(x, ids, tw, w.w13, w.w2, None, None, 0, "swigluoai", 1.702, 7.0, 1.0, 8, cfg)
    assert _err(got, R.local_experts_reference(x, ids, tw, w), False) <= 1e-5


@pytest.mark.parametrize("case", ["m3_f32", "m3_bf16", "m3_fp8"])  # BF16 and FP8: the tables' orders at prefill
def test_programs_grouped_by_expert_compute_the_same_bits(interp, case):
    """moe_expert_groups (GROUP_M -1, kernels/moe_expert_groups.py) only reorders the programs: every
    tile is the one the table's orders compute, bit for bit. Expert 6 takes every token (a run of
    three 16-row blocks, cut by a cap of 2), the second slot spreads over the others, some idle."""
    make, dtype, fp8, _ = CASES[case]
    w = R.MoEWeights(*K.block_op_args(_block(make, dtype, fp8)))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(37, 256, generator=g).to(dtype)
    ids = torch.stack([torch.full((37,), 6), torch.randint(0, 4, (37,), generator=g)], 1)
    tw = torch.rand(37, 2, generator=g)
    sc = (w.w13_scale, w.w2_scale) if fp8 else (None, None)
    base = {"BM": 16, "BN": 128, "BK": 128 if fp8 else 64}
    outs = {}
    for order in ({"GROUP_M": 0}, {"GROUP_M": 4}, {"GROUP_M": -1, "EXPERT_GROUPS": 2},
                  {"GROUP_M": -1, "EXPERT_GROUPS": 8}):
        outs[str(order)] = interp.grouped_gated_mlp(x, ids, tw, w.w13, w.w2, *sc, 0, "swigluoai", w.alpha, w.limit,
                                                    w.beta, 8, {**base, **order})
    first = next(iter(outs.values()))
    assert _err(first, R.local_experts_reference(x, ids, tw, w), fp8) <= TOL[CASES[case][3]]
    for name, out in outs.items():
        assert torch.equal(out, first), name
    with pytest.raises(ValueError, match="EXPERT_GROUPS"):
        interp.grouped_gated_mlp(x, ids, tw, w.w13, w.w2, *sc, 0, "swigluoai", w.alpha, w.limit, w.beta, 8,
                                 {**base, "GROUP_M": -1})


def _shared_args(w, width):
    """The shared expert's weights cut to `width` columns (a TP slice, narrower than a routed expert)."""
    n = w.shared_w2.shape[1]
    w13 = torch.cat([w.shared_w13[:width], w.shared_w13[n:n + width]]).contiguous()
    w2 = w.shared_w2[:, :width].contiguous()
    if w.shared_w13_scale is None:
        return w13, w2, None, None
    nb = n // 128
    s13 = torch.cat([w.shared_w13_scale[:width // 128], w.shared_w13_scale[nb:nb + width // 128]]).contiguous()
    return w13, w2, s13, w.shared_w2_scale[:, :width // 128].contiguous()


# every dtype and both slice widths at 13 tokens; the one-token tiles in FP8 and BF16
@pytest.mark.parametrize("case, tokens, shared_width", [
    ("m3_f32", 13, "full"), ("m3_bf16", 13, "half"), ("m3_fp8", 13, "full"), ("m3_fp8", 13, "half"),
    ("m3_fp8", 1, "half"), ("m3_bf16", 1, "full"),
])
def test_shared_expert_in_the_grouped_launch_equals_its_own_launch(interp, case, tokens, shared_width):
    """The shared expert as one more expert of the routed launches gives, bit for bit, what
    its own launches give, also when its slice is narrower (TP) than a routed expert; and
    EP halves of the routed experts (other ranks' pairs contribute nothing)."""
    make, dtype, fp8, tol = CASES[case]
    w = R.MoEWeights(*K.block_op_args(_block(make, dtype, fp8)))
    width = w.shared_w2.shape[1] // (2 if shared_width == "half" else 1)
    if fp8 and width % 128:
        pytest.skip("FP8 slices are whole 128-column blocks")
    sh = _shared_args(w, width)
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    ids, tw = w.route(x)
    cfg = plan.tile_config(tokens, ids.shape[1], w.num_experts, fp8, float32=dtype == torch.float32)
    # all experts; EP 2 rank 0 (ids 4-7 belong to the other rank: the shared expert's id must
    # not be taken for expert 4); EP 2 rank 1
    for lo, hi in ((0, 8), (0, 4), (4, 8)):
        sc13 = w.w13_scale[lo:hi] if fp8 else None
        sc2 = w.w2_scale[lo:hi] if fp8 else None
        common = ("swigluoai", w.alpha, w.limit, w.beta, w.num_experts, cfg)
        merged = interp.grouped_gated_mlp(x, ids, tw, w.w13[lo:hi], w.w2[lo:hi], sc13, sc2, lo, *common, shared=sh)
        routed = interp.grouped_gated_mlp(x, ids, tw, w.w13[lo:hi], w.w2[lo:hi], sc13, sc2, lo, *common)
        alone = interp.grouped_gated_mlp(x, torch.zeros(tokens, 1, dtype=torch.int64), torch.ones(tokens, 1),
                                         [sh[0]], [sh[1]], [sh[2]] if fp8 else None, [sh[3]] if fp8 else None,
                                         0, *common, single_expert=True)
        assert merged.dtype == dtype
        assert torch.equal(merged, routed.to(dtype) + alone.to(dtype))


# prefill tiles (BLOCK_M 64 and 128, 8 warps) on 37 tokens, the shared expert full and half width
@pytest.mark.parametrize("case, bm, shared_width", [
    ("m3_fp8", 64, "full"), ("m3_fp8", 128, "half"), ("m3_bf16", 128, "full"), ("m3_bf16", 64, "half"),
    ("m3_f32", 64, "full"),
])
def test_gate_up_as_one_product_equals_two(interp, case, bm, shared_width):
    """moe_gate_up=one_dot (gate and up rows interleaved in one weight tile, one product per K
    step) sums the same terms as the two products: both match the reference, and each other
    to a tenth of the tolerance (seen: bit-equal in BF16 and FP8; float32 differs in the last
    bits, numpy's matmul blocking the product differently at twice the width)."""
    make, dtype, fp8, tol = CASES[case]
    w = R.MoEWeights(*K.block_op_args(_block(make, dtype, fp8)))
    sh = _shared_args(w, w.shared_w2.shape[1] // (2 if shared_width == "half" else 1))
    x = torch.randn(37, 256, generator=torch.Generator().manual_seed(37)).to(dtype)
    ids, tw = w.route(x)
    base = {"BM": bm, "BN": 128, "BK": 128 if fp8 else 32 if dtype == torch.float32 else 64, "num_warps": 8,
            "num_stages": 2}
    sc = (w.w13_scale, w.w2_scale) if fp8 else (None, None)
    out = {}
    for one_dot in (False, True):
        common = ("swigluoai", w.alpha, w.limit, w.beta, w.num_experts, dict(base, ONE_DOT=one_dot))
        out[one_dot] = interp.grouped_gated_mlp(x, ids, tw, w.w13, w.w2, *sc, 0, *common, shared=sh)
    assert _err(out[True], out[False], fp8) <= TOL[tol] / 10
    alone = R.gated_mlp(x, *sh, "swigluoai", w.alpha, w.limit, w.beta, w.group)
    ref = R.local_experts_reference(x, ids, tw, w).to(dtype) + alone
    assert _err(out[True], ref, fp8) <= (2 * TOL[tol] if not fp8 else TOL[tol])


@pytest.mark.parametrize("case", ["m3_bf16", "m3_fp8"])
def test_tile_orders_compute_the_same_tiles(interp, case):
    """moe_group_m only reorders the programs: every (row block, column tile) is still computed
    once, bit for bit as in the default order, with group sizes that do and do not divide the
    row blocks (37 tokens x top-2 + the shared expert at BLOCK_M 16: 11 blocks at most)."""
    make, dtype, fp8, tol = CASES[case]
    w = R.MoEWeights(*K.block_op_args(_block(make, dtype, fp8)))
    sh = _shared_args(w, w.shared_w2.shape[1])
    x = torch.randn(37, 256, generator=torch.Generator().manual_seed(11)).to(dtype)
    ids, tw = w.route(x)
    sc = (w.w13_scale, w.w2_scale) if fp8 else (None, None)
    cfg = {"BM": 16, "BN": 128, "BK": 128 if fp8 else 64, "BN_DOWN": 64, "num_warps": 4, "num_stages": 2}
    out = {}
    for group_m in (0, 1, 3, 4, 64):
        common = ("swigluoai", w.alpha, w.limit, w.beta, w.num_experts, dict(cfg, GROUP_M=group_m))
        out[group_m] = interp.grouped_gated_mlp(x, ids, tw, w.w13, w.w2, *sc, 0, *common, shared=sh)
    for group_m in (1, 3, 4, 64):
        assert torch.equal(out[group_m], out[0]), group_m


def _scatter_by_torch(x, pair_row, sorted_pair, rows, slots, skip_padding_groups=False):
    """quantize_scatter_fp8's output from the reference quantization and torch indexing (the
    interpreter's FP8 conversion rounds some values wrongly; the Triton path quantizes by the reference).
    Every padding row zeros, whether or not the caller lets groups of them be skipped."""
    from minimax_backend.kernels.fp8 import FP8_DTYPE, quantize_fp8_reference

    q, s = quantize_fp8_reference(x, 128)
    pair = sorted_pair[:rows].long()
    ok = pair >= 0
    xg = torch.zeros(rows, x.shape[1], dtype=FP8_DTYPE)
    xsg = torch.zeros(rows, x.shape[1] // 128, dtype=torch.float32)
    xg[ok], xsg[ok] = q[pair[ok] // slots], s[pair[ok] // slots]
    return xg, xsg


def _host_side_case(order: dict):
    """The host-side tests' layer (tiny M3, FP8) and input: expert 6 takes every one of 201 tokens,
    the shared expert too; the other slot spreads over experts 0-4, so 3 experts stay idle; the
    prefill tiles (BLOCK_M 64) in the program order `order`."""
    w = R.MoEWeights(*K.block_op_args(_block(tiny_m3_clamping, torch.bfloat16, True)))
    g = torch.Generator().manual_seed(13)
    x = torch.randn(201, 256, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.full((201,), 6), torch.randint(0, 5, (201,), generator=g)], 1)
    tw = torch.rand(201, 2, generator=g)
    shared = (w.shared_w13, w.shared_w2, w.shared_w13_scale, w.shared_w2_scale)
    cfg = {"BM": 64, "BN": 128, "BK": 128, "BN_DOWN": 128, "num_warps": 4, "num_stages": 2, "ONE_DOT": True,
           **order}
    return w, x, ids, tw, shared, cfg


@pytest.mark.parametrize("order", [{"GROUP_M": -1, "EXPERT_GROUPS": 4}, {"GROUP_M": 4}],
                         ids=["by_expert", "groups_of_4"])
def test_host_side_of_the_gluon_gate_up_equals_the_triton_path(interp, order, monkeypatch):
    """The host side of the Gluon gate/up path (the default on sm_90; CI has no GPU): the rows
    scattered into the experts' sorted layout, the block table with its groups, the down kernel and
    the combine. The Gluon kernel is replaced by the Triton gate/up kernel over the same sorted rows
    and block table (each row its own pair, k = 1; rows it skips stay NaN). Expert 6 takes every
    token, the shared expert too, 3 experts idle: the output equals the Triton path's bit for bit."""
    import minimax_backend.kernels.moe_gluon as mg

    kt = interp
    w, x, ids, tw, shared, cfg = _host_side_case(order)
    launched = []

    def gate_up(xg, xsg, w_t, ws_t, blocks, num_m, n_local, n, act, alpha, limit, beta, group_m):
        launched.append(group_m)
        rows, hidden = xg.shape
        h = torch.full((rows, n), float("nan")).to(xg.dtype)
        hs = torch.full((rows, n // 128), float("nan"))
        kt._gate_up_act_kernel[(num_m * (n // 128),)](
            xg, xsg, w_t, ws_t, torch.arange(rows, dtype=torch.int32), blocks, h, hs,
            hidden, n, n, 1, n_local, num_m, n // 128, xg.stride(0), xsg.stride(0), h.stride(0), hs.stride(0),
            alpha, limit, beta, False, ACT=act, FP8=True, OUT_KIND=1, INTERP=True, UPCAST=False, IEEE=False, BM=64,
            BN=128, BK=128, ONE_DOT=True, GROUP_M=group_m, num_warps=4, num_stages=2)
        return h, hs

    monkeypatch.setattr(mg, "gate_up_act", gate_up)
    monkeypatch.setattr(kt, "quantize_scatter_fp8", _scatter_by_torch)
    out = {}
    for gemm in ("triton", "gluon"):
        monkeypatch.setattr(plan, "gluon_fits", lambda *a, _on=gemm == "gluon": _on)
        out[gemm] = kt.grouped_gated_mlp(x, ids, tw, w.w13, w.w2, w.w13_scale, w.w2_scale, 0, "swigluoai", w.alpha,
                                         w.limit, w.beta, w.num_experts, cfg, shared=shared)
    assert launched == [order["GROUP_M"]]
    assert not torch.isnan(out["triton"]).any()
    assert torch.equal(out["gluon"], out["triton"])


@pytest.mark.parametrize("order", [{"GROUP_M": -1, "EXPERT_GROUPS": 4}, {"GROUP_M": 4}, {"GROUP_M": 0}],
                         ids=["by_expert", "groups_of_4", "rows_first"])
def test_host_side_of_the_192_row_gluon_gate_up_equals_the_triton_path(interp, order, monkeypatch):
    """moe_gemm=gluon192 on the host: the layout in 192-row blocks, the rows scattered into it, the
    gate/up's block table and order (the groups in 192-row blocks), the down GEMM (the Gluon one on
    the same blocks and order, or the Triton kernel on the 64-row thirds: a third with no rows idle,
    the groups in thirds) and the combine. The Gluon kernels are replaced by the Triton ones over
    the same sorted rows, in the order they are given; the rows they skip (thirds of padding) stay
    NaN. Expert 6 takes every token (201 rows: a 192-row block, then 9 rows in the next one's first
    third), the shared expert too; the other slot spreads, 3 experts idle. The output equals the
    Triton path's bit for bit."""
    import minimax_backend.kernels.moe_gluon as mg

    kt = interp
    parts = mg.TRIO_BLOCK_M // 64
    w, x, ids, tw, shared, cfg = _host_side_case(order)
    seen, seen_down = [], []

    def thirds(blocks, sorted_pair, num_m, n_local, group_m):
        """The kernel's 192-row blocks as the Triton kernels' 64-row ones: each third its block's
        expert, idle where it starts with padding; with groups (-1) their table in thirds too."""
        first_rows = sorted_pair[: num_m * mg.TRIO_BLOCK_M].view(parts * num_m, 64)[:, 0]
        out = torch.where(first_rows >= 0, blocks[:num_m].repeat_interleave(parts), n_local)
        if group_m < 0:
            out = torch.cat([out, (blocks[num_m:].view(num_m, 2) * parts).repeat_interleave(parts, 0).reshape(-1)])
        return out.to(torch.int32)

    def gate_up(xg, xsg, w_t, ws_t, blocks, sorted_pair, num_m, n_local, n, act, alpha, limit, beta, group_m):
        seen.append((num_m, group_m))
        rows, hidden = xg.shape
        assert rows == num_m * mg.TRIO_BLOCK_M
        h = torch.full((rows, n), float("nan")).to(xg.dtype)
        hs = torch.full((rows, n // 128), float("nan"))
        kt._gate_up_act_kernel[(parts * num_m * (n // 128),)](
            xg, xsg, w_t, ws_t, torch.arange(rows, dtype=torch.int32), thirds(blocks, sorted_pair, num_m, n_local,
                                                                              group_m), h, hs,
            hidden, n, n, 1, n_local, parts * num_m, n // 128, xg.stride(0), xsg.stride(0), h.stride(0), hs.stride(0),
            alpha, limit, beta, False, ACT=act, FP8=True, OUT_KIND=1, INTERP=True, UPCAST=False, IEEE=False, BM=64,
            BN=128, BK=128, ONE_DOT=True, GROUP_M=group_m * parts if group_m > 0 else group_m, num_warps=4,
            num_stages=2)
        return h, hs

    def down(h, hs, w_t, ws_t, blocks, sorted_pair, topk_w, num_m, n_local, n_out, group_m):
        seen_down.append((num_m, group_m))
        rows, n = h.shape
        assert rows == num_m * mg.TRIO_BLOCK_M
        y = torch.full((rows, n_out), float("nan")).to(torch.bfloat16)
        kt._down_kernel[(parts * num_m * (n_out // 128),)](
            h, hs, w_t, ws_t, sorted_pair, thirds(blocks, sorted_pair, num_m, n_local, group_m), topk_w, y,
            n_out, n_local, parts * num_m, n_out // 128, h.stride(0), hs.stride(0), y.stride(0), K=n, K_SHARED=n,
            SHARED=True, FP8=True, OUT_KIND=1, INTERP=True, UPCAST=False, IEEE=False, BM=64, BN=128, BK=128,
            GROUP_M=group_m * parts if group_m > 0 else group_m, num_warps=4, num_stages=2)
        return y

    monkeypatch.setattr(mg, "gate_up_act_trio", gate_up)
    monkeypatch.setattr(mg, "down_trio", down)
    monkeypatch.setattr(kt, "quantize_scatter_fp8", _scatter_by_torch)
    out = {}
    for gemm, down_gemm in (("triton", "auto"), ("gluon192", "triton"), ("gluon192", "auto")):
        monkeypatch.setattr(plan, "gluon_fits", lambda *a, _on=gemm != "triton": _on)
        with override_kernel_options(moe_gemm=gemm, moe_down=down_gemm):
            out[gemm, down_gemm] = kt.grouped_gated_mlp(x, ids, tw, w.w13, w.w2, w.w13_scale, w.w2_scale, 0,
                                                        "swigluoai", w.alpha, w.limit, w.beta, w.num_experts, cfg,
                                                        shared=shared)
    # the gate/up twice, the Gluon down once (moe_down=auto), in 192-row blocks (groups of 4 x 64 rows: 1 block)
    want_group = {-1: -1, 4: max(4 // parts, 1), 0: 0}[order["GROUP_M"]]
    assert [g for _, g in seen] == [want_group] * 2, seen
    assert seen_down == seen[:1], seen_down
    assert not torch.isnan(out["triton", "auto"]).any()
    assert torch.equal(out["gluon192", "triton"], out["triton", "auto"])
    assert torch.equal(out["gluon192", "auto"], out["triton", "auto"])


def test_host_side_of_the_bf16_gluon_path_equals_the_triton_path(interp, monkeypatch):
    """BF16 on sm_90 at prefill sizes (moe_gemm auto / gluon192): the layout in 192-row blocks, the
    bf16 rows scattered into it by scatter_rows (the real kernel, interpreted), the experts' groups as
    the block order, the Gluon gate/up and down over the same blocks, the combine. The Gluon kernels
    are replaced by the Triton BF16 kernels over the 64-row thirds of the same sorted rows (a third of
    padding only idle, its rows left NaN). The case of the FP8 host tests in BF16: expert 6 takes all
    201 tokens, the shared expert too, 3 experts idle. Equal to the Triton path's output (the same
    float32 sums per row and K step of 64, in the interpreter)."""
    import minimax_backend.kernels.moe_gluon as mg

    kt = interp
    parts = mg.TRIO_BLOCK_M // 64
    _, x, ids, tw, _, _ = _host_side_case({})
    w = R.MoEWeights(*K.block_op_args(_block(tiny_m3_clamping, torch.bfloat16, False)))
    shared = (w.shared_w13, w.shared_w2, None, None)
    seen, seen_down = [], []

    def thirds(blocks, sorted_pair, num_m, n_local):
        first_rows = sorted_pair[: num_m * mg.TRIO_BLOCK_M].view(parts * num_m, 64)[:, 0]
        return torch.where(first_rows >= 0, blocks[:num_m].repeat_interleave(parts), n_local).to(torch.int32)

    def gate_up(xg, xsg, w_t, ws_t, blocks, sorted_pair, num_m, n_local, n, act, alpha, limit, beta, group_m):
        seen.append((xg.dtype, group_m, blocks.numel() > num_m))
        rows, hidden = xg.shape
        h = torch.full((rows, n), float("nan")).to(torch.bfloat16)
        kt._gate_up_act_kernel[(parts * num_m * (n // 128),)](
            xg, xsg, w_t, ws_t, torch.arange(rows, dtype=torch.int32), thirds(blocks, sorted_pair, num_m, n_local),
            h, xsg, hidden, n, n, 1, n_local, parts * num_m, n // 128, xg.stride(0), 0, h.stride(0), 0,
            alpha, limit, beta, False, ACT=act, FP8=False, OUT_KIND=1, INTERP=True, UPCAST=True, IEEE=False, BM=64,
            BN=128, BK=64, ONE_DOT=True, GROUP_M=0, num_warps=4, num_stages=2)
        return h, xsg

    def down(h, hs, w_t, ws_t, blocks, sorted_pair, topk_w, num_m, n_local, n_out, group_m):
        seen_down.append((h.dtype, group_m))
        rows, n = h.shape
        y = torch.full((rows, n_out), float("nan")).to(torch.bfloat16)
        kt._down_kernel[(parts * num_m * (n_out // 128),)](
            h, hs, w_t, ws_t, sorted_pair, thirds(blocks, sorted_pair, num_m, n_local), topk_w, y,
            n_out, n_local, parts * num_m, n_out // 128, h.stride(0), 0, y.stride(0), K=n, K_SHARED=n,
            SHARED=True, FP8=False, OUT_KIND=1, INTERP=True, UPCAST=True, IEEE=False, BM=64, BN=128, BK=64,
            GROUP_M=0, num_warps=4, num_stages=2)
        return y

    monkeypatch.setattr(mg, "gate_up_act_trio", gate_up)
    monkeypatch.setattr(mg, "down_trio", down)
    out = {}
    for on in (False, True):
        monkeypatch.setattr(plan, "gluon_bf16_fits", lambda *a, _on=on: _on)
        out[on] = kt.grouped_gated_mlp(x, ids, tw, w.w13, w.w2, None, None, 0, "swigluoai", w.alpha, w.limit,
                                       w.beta, w.num_experts, shared=shared)
    # one launch each, BF16, in the groups that follow the experts (-1, the table after the blocks)
    assert seen == [(torch.bfloat16, -1, True)] and seen_down == [(torch.bfloat16, -1)], (seen, seen_down)
    assert not torch.isnan(out[False]).any()
    assert torch.equal(out[True], out[False])


def test_bf16_gluon_path_from_256_rows_per_expert_under_auto_and_always_under_gluon192():
    """gluon_bf16_fits: under moe_gemm=auto the BF16 Gluon GEMMs from BF16_TRIO_MIN_ROWS_PER_EXPERT
    rows per expert on average (M3 at EP 1: 8192 tokens yes, 4096 no), never where the GPU has no
    Gluon; under gluon192 always, an error off a Hopper GPU (never a silent Triton run of a pinned
    kernel); never under triton or gluon, with moe_down=triton, a float32 model or a narrower
    shared expert."""
    import minimax_backend.kernels.moe_gluon as mg

    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    experts = 129  # M3's 128 routed experts and the shared slot

    def pairs(tokens):  # top-4 over 128 experts, every token in the shared slot
        return tokens * 4 + tokens

    assert plan.BF16_TRIO_MIN_ROWS_PER_EXPERT * experts > pairs(4096)
    assert plan.BF16_TRIO_MIN_ROWS_PER_EXPERT * experts <= pairs(8192)
    big, small = (6144, 3072, 3072, pairs(8192), experts), (6144, 3072, 3072, pairs(4096), experts)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mg, "gluon_available", lambda device: True)
        with override_kernel_options(moe_gemm="auto"):
            assert plan.gluon_bf16_fits(cuda, bf16, *big)
            assert not plan.gluon_bf16_fits(cuda, bf16, *small)
            assert not plan.gluon_bf16_fits(torch.device("cpu"), bf16, *big)
            assert not plan.gluon_bf16_fits(cuda, torch.float32, *big)
            assert not plan.gluon_bf16_fits(cuda, bf16, 6144, 3072, 1536, pairs(8192), experts)
        for gemm in ("triton", "gluon"):
            with override_kernel_options(moe_gemm=gemm):
                assert not plan.gluon_bf16_fits(cuda, bf16, *big), gemm
        with override_kernel_options(moe_gemm="gluon192"):
            assert plan.gluon_bf16_fits(cuda, bf16, *small)
            assert not plan.gluon_bf16_fits(torch.device("cpu"), bf16, *small)
            assert not plan.gluon_bf16_fits(cuda, torch.float32, *small)
            assert not plan.gluon_bf16_fits(cuda, bf16, 6144, 3072, 1536, pairs(4096), experts)  # a narrower shared slice
        for gemm in ("auto", "gluon192"):
            with override_kernel_options(moe_gemm=gemm, moe_down="triton"):
                assert not plan.gluon_bf16_fits(cuda, bf16, *big), gemm
        mp.setattr(mg, "gluon_available", lambda device: False)
        with override_kernel_options(moe_gemm="auto"):
            assert not plan.gluon_bf16_fits(cuda, bf16, *big)
        with override_kernel_options(moe_gemm="gluon192"), pytest.raises(RuntimeError, match="moe_gemm=gluon192"):
            plan.gluon_bf16_fits(cuda, bf16, *small)


class _LaunchRecorder:
    """Stands in for a Gluon kernel: records each launch's grid and keyword arguments, and each warmup
    (a compile without a launch) with them."""

    def __init__(self):
        self.launches, self.warmups = [], []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, kwargs))

    def warmup(self, *args, grid, **kwargs):
        self.warmups.append((grid, dict(kwargs)))
        return ("compiled", len(self.warmups))


def _recorded_trio_kernels(monkeypatch, gate_up_kernel: str):
    """moe_gluon with its 192-row gate/up (the named kernel) and down replaced by _LaunchRecorders;
    skips without Gluon. (module, gate_up recorder, down recorder)."""
    import minimax_backend.kernels.moe_gluon as mg

    if not mg.HAVE_GLUON:
        pytest.skip("triton without Gluon")
    monkeypatch.setattr(mg, "_ensure_allocator", lambda: None)
    gate_up, down = _LaunchRecorder(), _LaunchRecorder()
    monkeypatch.setattr(mg, gate_up_kernel, gate_up)
    monkeypatch.setattr(mg, "_down_trio_kernel", down)
    return mg, gate_up, down


def test_fp8_192_row_launchers_edit_the_compiled_kernel_before_launching_under_moe_fp8_yield(monkeypatch):
    """moe_fp8_yield=n on the host (the edit itself: tests/test_ffma_yield.py; its results: the GPU
    test below): the FP8 192-row gate/up and down are compiled first with FFMA_YIELD=n (a compiled
    kernel of their own), that kernel is edited for n, then launched with the same arguments; off
    launches them as before, and the BF16 down (no promotion) is never edited."""
    mg, gate_up, down = _recorded_trio_kernels(monkeypatch, "_gate_up_trio_kernel")
    edits = []
    monkeypatch.setattr(mg.ffma_yield, "apply_to_compiled", lambda compiled, every: edits.append((compiled, every)))
    num_m, i32, fp8 = 2, torch.int32, torch.float8_e4m3fn
    blocks, pairs = torch.zeros(2 * num_m, dtype=i32), torch.zeros(num_m * mg.TRIO_BLOCK_M, dtype=i32)
    table, topk_w = torch.zeros(4, dtype=torch.int64), torch.ones(8)
    x = torch.zeros(num_m * mg.TRIO_BLOCK_M, 512, dtype=fp8)
    xs = torch.ones(x.shape[0], 4)

    def run(dtype=fp8):
        mg.gate_up_act_trio(x, xs, table, table, blocks, pairs, num_m, 4, 256, 0, 1.0, 7.0, 1.0, -1)
        h = torch.zeros(num_m * mg.TRIO_BLOCK_M, 256, dtype=dtype)
        mg.down_trio(h, torch.ones(h.shape[0], 2), table, table, blocks, pairs, topk_w, num_m, 4, 6144, -1)

    with override_kernel_options(moe_fp8_yield="off"):
        run()
    assert gate_up.warmups == down.warmups == edits == []
    assert "FFMA_YIELD" not in gate_up.launches[-1][1] and "FFMA_YIELD" not in down.launches[-1][1]
    with override_kernel_options(moe_fp8_yield="2"):
        run()
    for kernel, n in ((gate_up, 1), (down, 1)):
        assert len(kernel.warmups) == n and kernel.warmups[-1] == kernel.launches[-1]
        assert kernel.launches[-1][1]["FFMA_YIELD"] == 2
    assert edits == [(("compiled", 1), 2), (("compiled", 1), 2)]
    with override_kernel_options(moe_fp8_yield="4"):
        mg.down_trio(torch.zeros(num_m * mg.TRIO_BLOCK_M, 256, dtype=torch.bfloat16), xs, table, table, blocks, pairs,
                     topk_w, num_m, 4, 6144, -1)
    assert len(down.warmups) == 1 and len(edits) == 2 and "FFMA_YIELD" not in down.launches[-1][1]


def test_bf16_192_row_launchers_take_one_pass_only_under_moe_bf16_passes_1(monkeypatch):
    """moe_bf16_passes=1 (the default) on the host (the kernels themselves are GPU tests): the BF16
    gate/up runs in one pass with its own registers, the BF16 down two column tiles a pass, four tiles
    a program (a grid of 12 programs per block for 48 tiles instead of 16), never FP8 and never an
    odd number of column tiles; moe_bf16_passes=2 keeps the two-pass forms."""
    mg, gate_up, down = _recorded_trio_kernels(monkeypatch, "_gate_up_trio_bf16_kernel")
    num_m, i32 = 2, torch.int32
    blocks, pairs = torch.zeros(2 * num_m, dtype=i32), torch.zeros(num_m * mg.TRIO_BLOCK_M, dtype=i32)
    table, topk_w = torch.zeros(4, dtype=torch.int64), torch.ones(8)

    def run_down(dtype, n_out):
        h = torch.zeros(num_m * mg.TRIO_BLOCK_M, 256, dtype=dtype)
        mg.down_trio(h, torch.ones(h.shape[0], 2), table, table, blocks, pairs, topk_w, num_m, 4, n_out, -1)
        grid, kw = down.launches.pop()
        return grid[0], kw["COL_TILES"], kw["PAIRS"], kw["STAGES"], kw["CONSUMER_REGS"]

    def run_gate_up():
        x = torch.zeros(num_m * mg.TRIO_BLOCK_M, 512, dtype=torch.bfloat16)
        mg.gate_up_act_trio(x, x, table, table, blocks, pairs, num_m, 4, 256, 0, 1.0, 7.0, 1.0, -1)
        grid, kw = gate_up.launches.pop()
        return grid[0], kw["PASSES"], kw["STAGES"], kw["CONSUMER_REGS"]

    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    with override_kernel_options(moe_bf16_passes="2"):
        assert run_gate_up() == (num_m * 2, 2, 4, 168)
        assert run_down(bf16, 6144) == (num_m * 16, 3, False, 4, 168)
    with override_kernel_options(moe_bf16_passes="1"):
        assert run_gate_up() == (num_m * 2, 1, 4, 160)
        assert run_down(bf16, 6144) == (num_m * 12, 4, True, 3, 160)
        assert run_down(bf16, 256) == (num_m * 1, 2, True, 3, 160)
        assert run_down(bf16, 384) == (num_m * 1, 3, False, 4, 168)  # three tiles: no pairs
        assert run_down(fp8, 6144) == (num_m * 16, 3, False, 4, 168)  # FP8 has no paired form


def test_auto_takes_the_192_row_gluon_gate_up_from_128_rows_per_expert():
    """moe_gemm=auto picks the 192-row form by the average rows per local expert (one H100, 2026-12-06:
    faster at 159 and 238 rows per expert, even at 119, slower at 79: docs/kernel-notes.md); gluon
    and gluon192 pin it."""

    experts = 129  # M3's 128 routed experts and the shared one on one rank
    with override_kernel_options(moe_gemm="auto"):
        assert plan.trio_fits(plan.TRIO_MIN_ROWS_PER_EXPERT * experts, experts)
        assert not plan.trio_fits(plan.TRIO_MIN_ROWS_PER_EXPERT * experts - 1, experts)
        # M3 at EP 1: 4096 tokens x (4 routed + the shared slot) yes, 3072 and 2048 no
        assert plan.trio_fits(4096 * 4 * 128 // 128 + 4096, experts)
        assert not plan.trio_fits(3072 * 4 * 128 // 128 + 3072, experts)
        assert not plan.trio_fits(2048 * 4 * 128 // 128 + 2048, experts)
    with override_kernel_options(moe_gemm="gluon"):
        assert not plan.trio_fits(10 ** 9, experts)
    with override_kernel_options(moe_gemm="gluon192"):
        assert plan.trio_fits(1, experts)


def test_gate_up_and_order_switches_reach_the_kernel(interp, monkeypatch):
    """tile_config's table picks the product's shape and the program order by size (one
    product, grouped order at prefill sizes); the kernel options pin either way."""
    kt = interp
    seen = []

    class Launch:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append((kwargs["ONE_DOT"], kwargs["GROUP_M"]))
                raise RuntimeError("stop after the gate/up launch")
            return launch

    monkeypatch.setattr(kt, "_gate_up_act_kernel", Launch())
    w = R.MoEWeights(*K.block_op_args(_block(tiny_m3_clamping, torch.bfloat16, False)))

    def launched(tokens: int, **options):
        x = torch.randn(tokens, 256).to(torch.bfloat16)
        ids, tw = w.route(x)
        with override_kernel_options(**options), pytest.raises(RuntimeError, match="stop after"):
            kt.grouped_gated_mlp(x, ids, tw, w.w13, w.w2, None, None, 0, "swigluoai", w.alpha, w.limit, w.beta,
                                 w.num_experts)
        return seen[-1]

    # 8 experts, top-2: 5 tokens are a decode size, 301 a prefill size (> 48 rows per expert)
    assert launched(5) == (False, 0)
    assert launched(301) == (True, -1)  # groups by expert (kernels/moe_expert_groups.py)
    assert launched(301, moe_gate_up="two_dots", moe_group_m=0) == (False, 0)
    assert launched(5, moe_gate_up="one_dot", moe_group_m=3) == (True, 3)
    assert launched(301, moe_tiles="64,128,64,8,4") == (False, 0)  # hand-picked tiles: the plain kernel
    assert launched(301, moe_tiles="64,128,64,8,4", moe_gate_up="one_dot") == (True, 0)


@pytest.mark.parametrize("case", ALIGN_CASES)
@pytest.mark.parametrize("with_shared", [False, True])
def test_triton_alignment_equals_the_sort(interp, case, with_shared):
    from minimax_backend.kernels.moe_align_triton import MAX_PAIRS, align_by_expert_triton

    tokens, k, experts, offset, n_local, bm = case
    ids = _align_ids(tokens, k, experts, seed=tokens)
    shared_id = -2
    if with_shared:  # one more slot per token: the shared expert, id = the expert count
        if ids.numel() + tokens > MAX_PAIRS:
            pytest.skip("past the one-program limit")
        shared_id = experts
        ids = torch.cat([ids, torch.full((tokens, 1), experts)], 1)
    want = interp.align_by_expert(ids, offset, n_local, bm, shared_id)
    sorted_pair, block_expert, pair_row = align_by_expert_triton(ids, offset, n_local, bm, shared_id)
    assert torch.equal(sorted_pair, want.sorted_pair)
    assert torch.equal(block_expert, want.block_expert)
    assert torch.equal(pair_row, want.pair_row)


@pytest.mark.parametrize("tokens", [1, 37, 200])
def test_triton_alignment_with_one_crowded_expert_and_none_of_ours(interp, tokens):
    """Every pair on one expert (one long run, the other runs empty), then none of them local."""
    from minimax_backend.kernels.moe_align_triton import align_by_expert_triton

    crowded = torch.full((tokens, 4), 5)
    crowded[::3, 1] = 130  # another rank's expert
    crowded[-1] = -1  # a padding row
    for ids, offset, n_local in ((crowded, 0, 128), (crowded, 64, 64)):
        want = interp.align_by_expert(ids, offset, n_local, 16)
        got = align_by_expert_triton(ids, offset, n_local, 16)
        for a, b in zip(got, (want.sorted_pair, want.block_expert, want.pair_row)):
            assert torch.equal(a, b)


def test_alignment_puts_the_shared_expert_last_and_keeps_other_ranks_out():
    from minimax_backend.kernels.moe_triton import align_by_expert

    ids = torch.tensor([[0, 4], [5, 1], [3, 2]])  # EP 2 rank 0 owns experts 0-3 of 8
    ids = torch.cat([ids, torch.full((3, 1), 8)], 1)  # the shared expert, id 8
    al = align_by_expert(ids, 0, 4, 4, shared_id=8)
    experts_of = {p: int(al.block_expert[int(al.pair_row[p]) // 4]) for p in range(9) if al.pair_row[p] >= 0}
    # pairs 1 (expert 4) and 3 (expert 5) are the other rank's; the shared slots (2, 5, 8) are expert 4
    assert experts_of == {0: 0, 4: 1, 6: 3, 7: 2, 2: 4, 5: 4, 8: 4}


@pytest.mark.parametrize("tokens, k, experts, offset, n_local, bm, chunk, with_shared", [
    (1, 4, 8, 0, 8, 16, 64, False),  # one chunk, mostly empty
    (1, 4, 8, 0, 8, 16, 64, True),
    (37, 4, 128, 0, 128, 64, 64, False),  # 148 pairs in 3 chunks, the last one partial; a crowded expert
    (37, 4, 128, 0, 128, 64, 64, True),
    (1100, 4, 128, 0, 128, 192, 2048, True),  # 5500 pairs, past the one-program limit; 192-row blocks
    (777, 4, 128, 64, 64, 16, 256, False),  # EP: half the experts another rank's; 13 chunks
    (777, 4, 128, 64, 64, 16, 256, True),
])
def test_chunked_alignment_equals_the_sort(interp, tokens, k, experts, offset, n_local, bm, chunk, with_shared):
    """The alignment in chunks of pairs (two launches, any pair count): the torch path's three
    tensors element for element, with a padding row, a crowded expert and the shared expert."""
    from minimax_backend.kernels.moe_align_triton import align_by_expert_chunked

    ids = _align_ids(tokens, k, experts, seed=tokens)
    shared_id = -2
    if with_shared:
        shared_id = experts
        ids = torch.cat([ids, torch.full((tokens, 1), experts)], 1)
    want = interp.align_by_expert(ids, offset, n_local, bm, shared_id)
    got = align_by_expert_chunked(ids, offset, n_local, bm, shared_id, chunk=chunk)
    for a, b in zip(got, (want.sorted_pair, want.block_expert, want.pair_row)):
        assert torch.equal(a, b)


def test_default_alignment_takes_one_program_then_chunks_and_torch_only_when_asked(interp, monkeypatch):
    """moe_align=triton (the default): the one program up to ONE_PROGRAM_PAIRS, chunks of
    chunk_pairs past them; moe_align=torch: the torch sort at every size."""
    from minimax_backend.kernels import moe_align_triton as al

    calls = []
    monkeypatch.setattr(al, "align_by_expert_triton",
                        lambda *a, _f=al.align_by_expert_triton, **kw: calls.append(("one", a[0].numel())) or _f(*a, **kw))
    monkeypatch.setattr(al, "align_by_expert_chunked",
                        lambda *a, _f=al.align_by_expert_chunked, **kw: calls.append(("chunks", a[0].numel())) or _f(*a, **kw))
    at_limit = _align_ids(al.ONE_PROGRAM_PAIRS // 4, 4, 128, seed=3)
    past = _align_ids(al.ONE_PROGRAM_PAIRS // 4 + 1, 4, 128, seed=1)
    got = interp._align(past, 0, 128, 64)
    interp._align(at_limit, 0, 128, 64)
    assert calls == [("chunks", past.numel()), ("one", at_limit.numel())]
    want = interp.align_by_expert(past, 0, 128, 64)
    for a, b in zip((got.sorted_pair, got.block_expert, got.pair_row),
                    (want.sorted_pair, want.block_expert, want.pair_row)):
        assert torch.equal(a, b)
    with override_kernel_options(moe_align="torch"):
        interp._align(past, 0, 128, 64)
        interp._align(at_limit, 0, 128, 64)
    assert len(calls) == 2
    assert [al.chunk_pairs(n) for n in (1025, 16384, 16385, 81920)] == [256, 256, 1024, 1024]


def test_triton_alignment_refuses_too_many_pairs(interp):
    from minimax_backend.kernels.moe_align_triton import MAX_PAIRS, align_by_expert_triton

    with pytest.raises(ValueError, match="pairs"):
        align_by_expert_triton(torch.zeros(MAX_PAIRS + 1, 1, dtype=torch.int64), 0, 8, 16)


@pytest.fixture
def row_by_row_dot(monkeypatch):
    """The interpreter's tl.dot is numpy's matmul, and since numpy 2.4 (its BLAS) the bits of a row
    depend on how many rows are multiplied with it: rows 0-31 of a [64, K] product differ from a
    [32, K] product in the last bit. On the GPU a row's product does not depend on its neighbours.
    Multiplying row by row makes the interpreter behave so, and a test of which rows the kernels
    multiply sees the kernels, not numpy."""
    import numpy as np

    matmul = np.matmul

    def by_row(a, b, *args, **kwargs):
        if np.ndim(a) < 2:
            return matmul(a, b, *args, **kwargs)
        return np.concatenate([matmul(a[..., i:i + 1, :], b, *args, **kwargs) for i in range(a.shape[-2])], axis=-2)

    monkeypatch.setattr(np, "matmul", by_row)


@pytest.mark.parametrize("bm", [32, 64])
@pytest.mark.parametrize("case", ["m3_f32", "m3_bf16", "m3_fp8"])
def test_half_blocks_compute_the_same_bits(interp, monkeypatch, row_by_row_dot, case, bm):
    """moe_half_blocks=on: a block whose second half is padding multiplies only its first half, in
    both kernels; every row the same bits as the whole block's. Runs of 37 rows (a last block of 5),
    20 (past the half at BLOCK_M 32) and ~6 (a first half only), some experts idle."""
    kt = interp
    make, dtype, fp8, tol = CASES[case]
    w = R.MoEWeights(*K.block_op_args(_block(make, dtype, fp8)))
    g = torch.Generator().manual_seed(11)
    x = torch.randn(37, 256, generator=g).to(dtype)
    second = torch.cat([torch.full((20,), 5), torch.randint(0, 3, (17,), generator=g)])
    ids = torch.stack([torch.full((37,), 6), second], 1)
    tw = torch.rand(37, 2, generator=g)
    tails = torch.bincount(ids.flatten(), minlength=8) % bm
    assert ((tails > 0) & (tails <= bm // 2)).any()  # blocks that take the half copy
    if bm == 32:
        assert (tails > bm // 2).any()  # and a last block past its half, which does not
    sc = (w.w13_scale, w.w2_scale) if fp8 else (None, None)
    cfg = {"BM": bm, "BN": 128, "BK": 128 if fp8 else 64, "GROUP_M": 0}
    gate_up, down = _Launches(kt._gate_up_act_kernel), _Launches(kt._down_kernel)
    monkeypatch.setattr(kt, "_gate_up_act_kernel", gate_up)
    monkeypatch.setattr(kt, "_down_kernel", down)
    outs = {}
    for halves in ("off", "on"):
        with override_kernel_options(moe_half_blocks=halves):
            outs[halves] = kt.grouped_gated_mlp(x, ids, tw, w.w13, w.w2, *sc, 0, "swigluoai", w.alpha, w.limit,
                                                w.beta, 8, cfg)
    assert [kw["HALVES"] for kw in gate_up.kwargs] == [kw["HALVES"] for kw in down.kwargs] == [False, True]
    assert _err(outs["off"], R.local_experts_reference(x, ids, tw, w), fp8) <= TOL[tol]
    assert torch.equal(outs["on"], outs["off"])


@pytest.mark.parametrize("case, halves", [("m3_bf16", True), ("m3_fp8", False), ("m3_f32", False)])
def test_half_blocks_by_default_only_in_bf16_at_block_m_128(interp, monkeypatch, case, halves):
    """moe_half_blocks=auto (the default) takes the half copy where it was measured faster: BF16 at
    BLOCK_M 128 with at most a block of rows per expert (37 tokens, top 2 of 8: 9 rows); FP8 and
    float32 keep whole blocks at the same tiles."""
    kt = interp
    make, dtype, fp8, tol = CASES[case]
    w = R.MoEWeights(*K.block_op_args(_block(make, dtype, fp8)))
    x = torch.randn(37, 256, generator=torch.Generator().manual_seed(5)).to(dtype)
    ids, tw = w.route(x)
    sc = (w.w13_scale, w.w2_scale) if fp8 else (None, None)
    cfg = {"BM": 128, "BN": 128, "BK": 128 if fp8 else 64, "GROUP_M": 0, "num_warps": 8}
    gate_up, down = _Launches(kt._gate_up_act_kernel), _Launches(kt._down_kernel)
    monkeypatch.setattr(kt, "_gate_up_act_kernel", gate_up)
    monkeypatch.setattr(kt, "_down_kernel", down)
    out = kt.grouped_gated_mlp(x, ids, tw, w.w13, w.w2, *sc, 0, "swigluoai", w.alpha, w.limit, w.beta, 8, cfg)
    assert [kw["HALVES"] for kw in gate_up.kwargs + down.kwargs] == [halves, halves]
    assert _err(out, R.local_experts_reference(x, ids, tw, w), fp8) <= TOL[tol]


def test_half_blocks_auto_rule_at_m3_sizes():
    """The auto rule at M3's routing (top 4 of 128 experts): on at 4096 tokens (128 rows per expert,
    BLOCK_M 128), off at 8192 (256 rows), never in FP8 or below BLOCK_M 128; on / off override it,
    and no copy below halves of 16 rows."""
    rows = lambda tokens: plan.rows_per_expert(tokens, 4, 128)
    assert rows(4096) == 128
    assert plan.half_blocks_fit(128, True, rows(4096)) and plan.half_blocks_fit(128, True, rows(1024))
    assert not plan.half_blocks_fit(128, True, rows(8192))
    assert not plan.half_blocks_fit(128, False, rows(4096))  # FP8 / float32
    assert not plan.half_blocks_fit(64, True, rows(2048))
    with override_kernel_options(moe_half_blocks="on"):
        assert plan.half_blocks_fit(32, False, rows(16384)) and not plan.half_blocks_fit(16, True, 1.0)
    with override_kernel_options(moe_half_blocks="off"):
        assert not plan.half_blocks_fit(128, True, rows(4096))


# each switch once in the interpreter (the GPU tests run every switch x dtype): the sort and the
# route do not depend on the dtype; the shared expert's own launches carry FP8 scales
@pytest.mark.parametrize("switch, case, tokens", [
    ("moe_align=torch", "m3_bf16", 9), ("moe_shared=separate", "m3_fp8", 5), ("moe_route=torch", "m3_bf16", 9),
    ("moe_gate_up=one_dot", "m3_bf16", 9), ("moe_group_m=4", "m3_fp8", 5), ("moe_expert_groups=2", "m3_fp8", 5)])
def test_gpu_path_with_the_other_switches_equals_eager(interp, case, tokens, switch):
    """The non-default kernel switches (torch sort, shared expert in its own launches, torch route,
    one product per K step and grouped program order at decode sizes), each seen to take its path."""
    with _switched(switch):
        test_gpu_path_of_the_ops_equals_eager(interp, case, tokens)


def _route_cases():
    g = torch.Generator().manual_seed(7)
    for tokens, experts, k, bias, norm in [(1, 128, 4, True, True), (13, 8, 2, True, True), (5, 8, 2, False, False),
                                           (64, 128, 4, True, False), (3, 200, 8, True, True)]:
        x = torch.randn(tokens, 64, generator=g)
        rw = torch.randn(experts, 64, generator=g) * 0.2
        cb = torch.randn(experts, generator=g) * 0.1 if bias else None
        yield x, rw, cb, k, norm


def _check_route(got, want):
    """Same experts per token (any slot order), weights slot for slot to float32 rounding."""
    ids, w = got
    rids, rw = want
    order, rorder = ids.argsort(1), rids.argsort(1)
    assert torch.equal(ids.gather(1, order), rids.gather(1, rorder))
    torch.testing.assert_close(w.gather(1, order), rw.gather(1, rorder), rtol=2e-6, atol=0)


def test_triton_route_equals_the_torch_route(interp):
    from minimax_backend.kernels.moe_route_triton import route_triton

    for x, rw, cb, k, norm in _route_cases():
        _check_route(route_triton(x, rw, cb, k, norm, 2.5), R.route(x, rw, cb, k, norm, 2.5))


@pytest.mark.parametrize("tokens, experts, hidden, dtype", [(1, 128, 1000, torch.bfloat16), (13, 200, 300, torch.float32),
                                                       (16, 8, 70, torch.bfloat16), (64, 8, 64, torch.bfloat16),
                                                       (129, 8, 64, torch.float32), (17, 128, 1000, torch.bfloat16),
                                                       (131, 200, 300, torch.bfloat16),
                                                       (1030, 8, 200, torch.bfloat16)])  # the wide tiles
@pytest.mark.parametrize("mode", ["auto", "cublas"])
def test_router_logits_match_a_float64_product(interp, tokens, experts, hidden, dtype, mode):
    """The decode-size logits kernel, past LOGITS_MAX_TOKENS rows the three-bf16 kernel (bf16 rows,
    mode auto) or cuBLAS: float32 sums of the products, within 1e-6 of the sum of |products|
    (float32 rounding over ~1000 terms is ~1e-7; a wrong row, column or K step is off by O(1), a
    dropped bf16 part of the weight by ~2e-3 or ~8e-6)."""
    from minimax_backend.kernels.moe_route_triton import router_logits

    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w = torch.randn(experts, hidden, generator=g) * 0.05
    want = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    with override_kernel_options(moe_router_logits=mode):
        got = router_logits(x, w)
    assert got.dtype == torch.float32 and got.shape == (tokens, experts)
    assert ((got.double() - want).abs() / scale).max() <= 1e-6


def test_three_bf16_logits_carry_every_bit_of_the_float32_weight(interp):
    """Rows with one nonzero value (a power of two) pick single weights: each logit is then one
    exact product, so it must equal the float32 weight times that value bit for bit. Full 24-bit
    significands over a wide exponent range: a lost low part, a part rounded twice or a wrong
    column shows. Odd sizes: 37 rows (a partial row block), 200 experts (two column blocks),
    hidden 300 (a partial K step)."""
    from minimax_backend.kernels.moe_route_triton import logits_three_bf16

    g = torch.Generator().manual_seed(3)
    tokens, experts, hidden = 37, 200, 300
    w = (torch.rand(experts, hidden, generator=g) + 0.5) * torch.exp2(torch.randint(-20, 4, (experts, hidden),
                                                                                      generator=g).float())
    w = torch.where(torch.rand(experts, hidden, generator=g) < 0.5, -w, w)
    assert (w.view(torch.int32) & 0xFF).count_nonzero() > w.numel() // 2  # most values need the third part
    col = torch.randint(0, hidden, (tokens,), generator=g)
    power = torch.exp2(torch.randint(-3, 4, (tokens,), generator=g).float())
    x = torch.zeros(tokens, hidden)
    x[torch.arange(tokens), col] = power
    for splits in (1, 3):  # K in one share, and in shares of 2, 2 and 1 K steps
        got = logits_three_bf16(x.to(torch.bfloat16), w, splits=splits)
        assert torch.equal(got, w[:, col].T * power[:, None]), splits
    # bf16 weights are their own first part
    wb = w.to(torch.bfloat16)
    assert torch.equal(logits_three_bf16(x.to(torch.bfloat16), wb), wb.float()[:, col].T * power[:, None])


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, experts, hidden", [(17, 128, 6144), (1000, 128, 6144), (8191, 128, 6144),
                                                     (131, 200, 300)])
def test_gpu_router_logits_match_a_float64_product(tokens, experts, hidden):
    """The GPU's three-bf16 logits (wgmma products, float32 accumulation) at M3's router size and an
    odd one, within 1e-6 of the sum of |products| of the float64 product, as the float32 path is
    (cuBLAS, checked alongside)."""
    from minimax_backend.kernels.moe_route_triton import router_logits

    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    w = torch.randn(experts, hidden, generator=g) * hidden ** -0.5
    want = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    for mode in ("auto", "cublas"):
        with override_kernel_options(moe_router_logits=mode):
            got = router_logits(x.cuda(), w.cuda()).cpu()
        assert ((got.double() - want).abs() / scale).max() <= 1e-6, mode


@pytest.mark.gpu
def test_gpu_three_bf16_logits_carry_every_bit_of_the_float32_weight():
    """test_three_bf16_logits_carry_every_bit_of_the_float32_weight on the GPU (cvt.rn splits)."""
    from minimax_backend.kernels.moe_route_triton import logits_three_bf16

    g = torch.Generator().manual_seed(3)
    tokens, experts, hidden = 300, 128, 6144
    w = (torch.rand(experts, hidden, generator=g) + 0.5) * torch.exp2(torch.randint(-20, 4, (experts, hidden),
                                                                                      generator=g).float())
    col = torch.randint(0, hidden, (tokens,), generator=g)
    power = torch.exp2(torch.randint(-3, 4, (tokens,), generator=g).float())
    x = torch.zeros(tokens, hidden)
    x[torch.arange(tokens), col] = power
    for splits in (None, 1, 5):
        got = logits_three_bf16(x.to(torch.bfloat16).cuda(), w.cuda(), splits=splits).cpu()
        assert torch.equal(got, w[:, col].T * power[:, None]), splits


def test_three_bf16_logits_refuse_rows_they_cannot_split(interp):
    from minimax_backend.kernels.moe_route_triton import logits_three_bf16, router_logits

    x, w = torch.randn(20, 64), torch.randn(8, 64)
    with pytest.raises(ValueError, match="needs bf16 rows"):
        logits_three_bf16(x, w)
    # router_logits takes float32 rows past the decode sizes to cuBLAS instead
    torch.testing.assert_close(router_logits(x, w), x @ w.T, rtol=1e-5, atol=1e-5)


def test_triton_route_breaks_ties_towards_the_lower_id_and_orders_slots(interp):
    from minimax_backend.kernels.moe_route_triton import route_triton

    rw = torch.zeros(8, 4)
    rw[[1, 3, 6], 0] = 1.0  # experts 1, 3, 6 tie at the top; 2 and 5 tie next
    rw[[2, 5], 0] = 0.5
    ids, w = route_triton(torch.tensor([[1.0, 0, 0, 0]]), rw, None, 4, False, 1.0)
    assert ids.tolist() == [[1, 3, 6, 2]]
    torch.testing.assert_close(w, torch.sigmoid(torch.tensor([[1.0, 1.0, 1.0, 0.5]])))


def _cuda(args):
    return [a.cuda() if isinstance(a, torch.Tensor) else [t.cuda() for t in a] if isinstance(a, list) else a
            for a in args]


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
# rows per expert 0.25 / 16 / 32.25 / 50 / 250 (8 experts, top-2): BLOCK_M 16, 16, 32, then the
# prefill tiles (FP8 64, BF16 128; FP8 at 1000 the 192-row Gluon pair on sm_90)
@pytest.mark.parametrize("tokens", [1, 64, 129, 200, 1000])
def test_gpu_kernels_against_cpu_reference(case, tokens):
    make, dtype, fp8, tol = CASES[case]
    blk = _block(make, dtype, fp8)
    args = K.block_op_args(blk)
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    ref = R.moe_reference(x, *args)  # CPU
    cuda_args = _cuda(args)
    got = torch.ops.minimax.moe(x.cuda(), *cuda_args).cpu()
    mega = torch.ops.minimax.mega_moe(x.cuda(), *cuda_args, "", 1, False, False, tokens, "allgather").cpu()
    # GPU routing may break exact score ties differently; random inputs have none
    for out in (got, mega):
        assert _err(out, ref, fp8) <= (2 * TOL[tol] if not fp8 else TOL[tol])


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["m3_bf16", "m3_fp8"])
def test_gpu_op_captures_into_a_cuda_graph(case):
    """No host sync anywhere on the path: capture once, replay on new token values."""
    make, dtype, fp8, tol = CASES[case]
    args = _cuda(K.block_op_args(_block(make, dtype, fp8)))
    x = torch.randn(33, 256, device="cuda").to(dtype)

    def run():
        return torch.ops.minimax.mega_moe(x, *args, "", 1, False, False, 33, "allgather")

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    x.copy_(torch.randn(33, 256, device="cuda").to(dtype))
    graph.replay()
    torch.cuda.synchronize()
    ref = R.moe_reference(x.cpu(), *K.block_op_args(_block(make, dtype, fp8)))
    assert _err(out.cpu(), ref, fp8) <= (2 * TOL[tol] if not fp8 else TOL[tol])


@pytest.mark.gpu
def test_triton_route_on_gpu_equals_the_cpu_route():
    from minimax_backend.kernels.moe_route_triton import route_triton

    for x, rw, cb, k, norm in _route_cases():
        got = route_triton(x.cuda(), rw.cuda(), cb.cuda() if cb is not None else None, k, norm, 2.5)
        _check_route(tuple(t.cpu() for t in got), R.route(x, rw, cb, k, norm, 2.5))


@pytest.mark.gpu
@pytest.mark.parametrize("case", ALIGN_CASES)
def test_triton_alignment_on_gpu_equals_the_sort(case):
    from minimax_backend.kernels.moe_align_triton import align_by_expert_triton
    from minimax_backend.kernels.moe_triton import align_by_expert

    tokens, k, experts, offset, n_local, bm = case
    ids = _align_ids(tokens, k, experts, seed=tokens).cuda()
    want = align_by_expert(ids, offset, n_local, bm)
    got = align_by_expert_triton(ids, offset, n_local, bm)
    for a, b in zip(got, (want.sorted_pair, want.block_expert, want.pair_row)):
        assert torch.equal(a.cpu(), b.cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, bm", [(205, 64), (1100, 192), (8192, 192), (16384, 64), (3001, 16)])
@pytest.mark.parametrize("with_shared", [False, True])
def test_chunked_alignment_on_gpu_equals_the_sort(tokens, bm, with_shared):
    """The chunks at the size chunk_pairs picks (256 or 1024 pairs) against the torch sort."""
    from minimax_backend.kernels.moe_align_triton import align_by_expert_chunked
    from minimax_backend.kernels.moe_triton import align_by_expert

    ids = _align_ids(tokens, 4, 128, seed=tokens)
    shared_id = 128 if with_shared else -2
    if with_shared:
        ids = torch.cat([ids, torch.full((tokens, 1), 128)], 1)
    ids = ids.cuda()
    want = align_by_expert(ids, 0, 128, bm, shared_id)
    got = align_by_expert_chunked(ids, 0, 128, bm, shared_id)
    for a, b in zip(got, (want.sorted_pair, want.block_expert, want.pair_row)):
        assert torch.equal(a.cpu(), b.cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["m3_bf16", "m3_fp8"])
@pytest.mark.parametrize("tokens", [1, 64, 1000])  # 1000: the prefill tiles (BLOCK_M 64 / 128, 8 warps)
@pytest.mark.parametrize("switch", OTHER_SWITCHES)
def test_gpu_kernels_with_the_other_switches(case, tokens, switch):
    with _switched(switch):
        test_gpu_kernels_against_cpu_reference(case, tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["m3_bf16", "m3_fp8"])
def test_gpu_shared_expert_in_the_grouped_launch_equals_its_own_launch(case):
    """As the interpreter test: merged == separate bit for bit on the GPU, incl. a half-width slice."""
    import minimax_backend.kernels.moe_triton as kt

    make, dtype, fp8, tol = CASES[case]
    w = R.MoEWeights(*_cuda(K.block_op_args(_block(make, dtype, fp8))))
    for width in (w.shared_w2.shape[1], w.shared_w2.shape[1] // 2):
        sh = _shared_args(w, width)
        for tokens in (1, 13, 200, 1000):  # BLOCK_M 16 to 128 (two K loops in shared memory)
            x = torch.randn(tokens, 256, device="cuda").to(dtype)
            ids, tw = w.route(x)
            cfg = plan.tile_config(tokens, ids.shape[1], w.num_experts, fp8)
            sc = (w.w13_scale, w.w2_scale) if fp8 else (None, None)
            common = ("swigluoai", w.alpha, w.limit, w.beta, w.num_experts, cfg)
            merged = kt.grouped_gated_mlp(x, ids, tw, w.w13, w.w2, *sc, 0, *common, shared=sh)
            routed = kt.grouped_gated_mlp(x, ids, tw, w.w13, w.w2, *sc, 0, *common)
            alone = kt.grouped_gated_mlp(x, torch.zeros(tokens, 1, dtype=torch.int64, device="cuda"),
                                         torch.ones(tokens, 1, device="cuda"), [sh[0]], [sh[1]],
                                         [sh[2]] if fp8 else None, [sh[3]] if fp8 else None, 0, *common,
                                         single_expert=True)
            assert torch.equal(merged, routed.to(dtype) + alone.to(dtype)), (width, tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("switch", OTHER_SWITCHES[:2])
def test_gpu_op_with_the_other_switches_captures(switch):
    with _switched(switch):
        test_gpu_op_captures_into_a_cuda_graph("m3_fp8")


def test_where_the_gluon_gate_up_runs(monkeypatch):
    """moe_gemm: triton never, auto where the GPU runs Gluon, gluon there or a clear error; and only
    at its tiles (BLOCK_M 64), one expert width, a bf16 model (no GPU needed: the decision only)."""
    import minimax_backend.kernels.moe_gluon as mg

    cuda, bf16 = torch.device("cuda", 0), torch.bfloat16
    prefill, decode = {"BM": mg.BLOCK_M}, {"BM": 16}
    for available in (False, True):
        monkeypatch.setattr(mg, "gluon_available", lambda device, _a=available: _a)
        with override_kernel_options(moe_gemm="triton"):
            assert not plan.gluon_fits(cuda, bf16, 6144, prefill, 3072, 3072)
        with override_kernel_options(moe_gemm="auto"):
            assert plan.gluon_fits(cuda, bf16, 6144, prefill, 3072, 3072) == available
            assert not plan.gluon_fits(torch.device("cpu"), bf16, 6144, prefill, 3072, 3072)
        with override_kernel_options(moe_gemm="gluon"):
            if available:
                assert plan.gluon_fits(cuda, bf16, 6144, prefill, 3072, 3072)
                assert not plan.gluon_fits(cuda, bf16, 6144, decode, 3072, 3072)  # decode tiles: Triton
                assert not plan.gluon_fits(cuda, bf16, 6144, prefill, 3072, 1536)  # a narrower shared slice
                assert not plan.gluon_fits(cuda, torch.float16, 6144, prefill, 3072, 3072)
            else:
                with pytest.raises(RuntimeError, match="sm_90"):
                    plan.gluon_fits(cuda, bf16, 6144, prefill, 3072, 3072)
        with override_kernel_options(moe_gemm="gluon192"):
            if available:
                assert plan.gluon_fits(cuda, bf16, 6144, prefill, 3072, 3072)
            else:
                with pytest.raises(RuntimeError, match="moe_gemm=gluon192 needs .*sm_90"):
                    plan.gluon_fits(cuda, bf16, 6144, prefill, 3072, 3072)



def test_the_gluon_down_follows_the_192_row_gate_up():
    """moe_down=auto: the Gluon down wherever the gate/up runs over 192-row blocks, never after the
    64-row or Triton gate/up (their layout is in 64-row blocks); triton: never."""

    with override_kernel_options(moe_down="auto"):
        assert plan.gluon_down_fits(True) and not plan.gluon_down_fits(False)
    with override_kernel_options(moe_down="triton"):
        assert not plan.gluon_down_fits(True) and not plan.gluon_down_fits(False)


def test_gluon_entry_points_name_a_layout_they_cannot_take():
    """The Gluon launchers check the layout before anything runs (no GPU needed): rows that are not
    whole blocks, widths that are not whole 128-wide tiles, too few sorted rows. A clear error,
    never a kernel reading past a buffer."""
    import minimax_backend.kernels.moe_gluon as mg

    if not mg.HAVE_GLUON:
        pytest.skip("this triton has no Gluon")
    f8, i32, i64, f32 = torch.float8_e4m3fn, torch.int32, torch.int64, torch.float32
    table, blocks = torch.zeros(2, dtype=i64), torch.zeros(4, dtype=i32)
    x, xs = torch.zeros(190, 256, dtype=f8), torch.zeros(190, 2)
    with pytest.raises(ValueError, match="190 rows for 1 blocks of 192"):
        mg.gate_up_act_trio(x, xs, table, table, blocks, torch.zeros(192, dtype=i32), 1, 2, 256, 0, 1.7, 7.0, 1.0, 4)
    x, xs = torch.zeros(192, 256, dtype=f8), torch.zeros(192, 2)
    with pytest.raises(ValueError, match="100 sorted rows"):
        mg.gate_up_act_trio(x, xs, table, table, blocks, torch.zeros(100, dtype=i32), 1, 2, 256, 0, 1.7, 7.0, 1.0, 4)
    with pytest.raises(ValueError, match="n 200"):
        mg.gate_up_act(torch.zeros(64, 256, dtype=f8), torch.zeros(64, 2), table, table, blocks, 1, 2, 200, 0, 1.7,
                       7.0, 1.0, 4)
    h, hs, tw = torch.zeros(192, 256, dtype=f8), torch.zeros(192, 2), torch.zeros(192, dtype=f32)
    with pytest.raises(ValueError, match="192 rows for 2 blocks of 192"):
        mg.down_trio(h, hs, table, table, blocks, torch.zeros(384, dtype=i32), tw, 2, 2, 256, 4)
    with pytest.raises(ValueError, match="n_out 300"):
        mg.down_trio(h, hs, table, table, blocks, torch.zeros(192, dtype=i32), tw, 1, 2, 300, 4)


def test_down_programs_cover_whole_column_tiles():
    """The Gluon down's column tiles per program divide the output's tiles (M3: 48 of 128 columns),
    so no program runs past the output or leaves columns unwritten: the largest divisor up to the
    setting."""
    import minimax_backend.kernels.moe_gluon as mg

    assert [mg.col_tiles_per_program(48, most) for most in (1, 2, 3, 4, 5, 6, 7, 8)] == [1, 2, 3, 4, 4, 6, 6, 8]
    assert [mg.col_tiles_per_program(2, most) for most in (1, 2, 4)] == [1, 2, 2]
    assert mg.col_tiles_per_program(7, 6) == 1  # a prime count of tiles: one per program
    assert mg.col_tiles_per_program(48, 0) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [999, 1000])  # the FP8 prefill tiles (BLOCK_M 64), an odd count
@pytest.mark.parametrize("gemm", ["gluon", "gluon192"])
def test_gpu_gluon_gate_up_against_cpu_reference(tokens, gemm, monkeypatch):
    """moe_gemm=gluon / gluon192 (kernels/moe_gluon.py) on an sm_90 GPU: the warp-specialized gate/up
    kernel runs (counted; with gluon192 the Gluon down too) and the op matches the CPU reference as
    the Triton kernels do."""
    import minimax_backend.kernels.moe_gluon as mg
    import minimax_backend.kernels.moe_triton as kt
    from minimax_backend.kernels.options import kernel_options

    if not mg.gluon_available(torch.device("cuda")):
        pytest.skip("needs triton's Gluon and an sm_90 GPU")
    launched, downs = [], []
    name = {"gluon": "gate_up_act", "gluon192": "gate_up_act_trio"}[gemm]
    real, real_down = getattr(mg, name), mg.down_trio
    monkeypatch.setattr(mg, name, lambda *a, **kw: launched.append(1) or real(*a, **kw))
    monkeypatch.setattr(mg, "down_trio", lambda *a, **kw: downs.append(1) or real_down(*a, **kw))
    with override_kernel_options(moe_gemm=gemm):
        test_gpu_kernels_against_cpu_reference("m3_fp8", tokens)
        why = {"options": kernel_options().to_dict(), "same_module": kt.moe_gluon is mg,
               "tiles": plan.tile_config(tokens, 2, 8, True)}
    # It stayed empty in the whole suite while the file alone passed (2026-12-02/03): transformers'
    # import had loaded a second copy of our kernels, whose options the override did not reach
    # (fixed; tests/test_import_names.py). Say what was in force if it ever does again
    assert launched, why
    # the Gluon down runs over the 192-row blocks (moe_down=auto), never after the 64-row gate/up
    assert len(downs) == (len(launched) if gemm == "gluon192" else 0), (len(downs), len(launched))


def _with_partial_192_row_blocks(ids: torch.Tensor) -> None:
    """Moves 50 of expert 7's pairs to expert 1, so that (with the shared expert's run of every token)
    the 192-row layout has a last block with one live 64-row group and one with two: the three
    forms of a stage's loads under moe_trio_rows=live."""
    sevens = (ids == 7).nonzero()[:50]
    ids[sevens[:, 0], sevens[:, 1]] = 1
    runs = torch.cat([torch.bincount(ids.flatten().cpu(), minlength=8), torch.tensor([ids.shape[0]])]) % 192
    assert ((runs > 0) & (runs <= 64)).any() and ((runs > 64) & (runs <= 128)).any(), runs


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [999, 1000])
def test_gpu_bf16_gluon_kernels_against_cpu_reference_and_triton(tokens, monkeypatch):
    """BF16 on an sm_90 GPU under moe_gemm=gluon192: the Gluon gate/up and down over 192-row blocks run
    (counted) and the op matches the CPU reference as the Triton kernels do; with a crowded expert and
    an idle one the layer equals the Triton path's bits (the same bf16 products summed in K steps of
    64 on the tensor cores)."""
    import minimax_backend.kernels.moe_gluon as mg
    import minimax_backend.kernels.moe_triton as kt

    if not mg.gluon_available(torch.device("cuda")):
        pytest.skip("needs triton's Gluon and an sm_90 GPU")
    launched = []
    real_gate_up, real_down = mg.gate_up_act_trio, mg.down_trio
    monkeypatch.setattr(mg, "gate_up_act_trio", lambda *a, **kw: launched.append("gate_up") or real_gate_up(*a, **kw))
    monkeypatch.setattr(mg, "down_trio", lambda *a, **kw: launched.append("down") or real_down(*a, **kw))
    with override_kernel_options(moe_gemm="gluon192"):
        test_gpu_kernels_against_cpu_reference("m3_bf16", tokens)
    assert launched.count("gate_up") >= 1 and launched.count("gate_up") == launched.count("down"), launched
    w = R.MoEWeights(*_cuda(K.block_op_args(_block(tiny_m3_clamping, torch.bfloat16, False))))
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(tokens)).to(torch.bfloat16).cuda()
    ids, tw = w.route(x)
    ids[:300, 0] = 3  # one crowded expert
    ids[ids == 5] = 6  # and an idle one
    _with_partial_192_row_blocks(ids)
    common = (ids, tw, w.w13, w.w2, None, None, 0, "swigluoai", w.alpha, w.limit, w.beta, w.num_experts)
    shared = (w.shared_w13, w.shared_w2, None, None)
    out = {}
    for kernels in ("triton", "gluon192"):
        with override_kernel_options(moe_gemm=kernels):
            out[kernels] = kt.grouped_gated_mlp(x, *common, shared=shared)
    with override_kernel_options(moe_gemm="gluon192", moe_trio_rows="all"):  # idle groups' rows loaded too
        out["all_rows"] = kt.grouped_gated_mlp(x, *common, shared=shared)
    with override_kernel_options(moe_gemm="gluon192", moe_bf16_passes="2"):  # gate, then up: two passes
        out["two_passes"] = kt.grouped_gated_mlp(x, *common, shared=shared)
    for form in ("gluon192", "all_rows", "two_passes"):  # the default: one pass, live rows
        assert torch.equal(out[form], out["triton"]), (form, (out[form] - out["triton"]).abs().max())


@pytest.mark.gpu
@pytest.mark.parametrize("down_col_tiles", [1, 2])
def test_gpu_gluon_gate_up_equals_the_triton_kernel_bit_for_bit(down_col_tiles, monkeypatch):
    """The Gluon kernel sums the same float32 products in the same order as the Triton loop (per K
    step: the product, times the activation and weight block scales), so the layer's output is the
    same bits, with a crowded expert and an idle one; the Gluon down too, with one or two 128-column
    tiles per program (the tiny width has two); and the 192-row kernels with their promotion FFMAs
    edited to yield (kernel option moe_fp8_yield: scheduling hints only)."""
    import minimax_backend.kernels.moe_gluon as mg
    import minimax_backend.kernels.moe_triton as kt

    if not mg.gluon_available(torch.device("cuda")):
        pytest.skip("needs triton's Gluon and an sm_90 GPU")
    monkeypatch.setattr(mg, "DOWN_TRIO_COL_TILES", down_col_tiles)
    w = R.MoEWeights(*_cuda(K.block_op_args(_block(tiny_m3_clamping, torch.bfloat16, True))))
    x = torch.randn(1001, 256, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16).cuda()
    ids, tw = w.route(x)
    ids[:300, 0] = 3  # one crowded expert
    ids[ids == 5] = 6  # and an idle one
    _with_partial_192_row_blocks(ids)
    common = (ids, tw, w.w13, w.w2, w.w13_scale, w.w2_scale, 0, "swigluoai", w.alpha, w.limit, w.beta,
              w.num_experts)
    shared = (w.shared_w13, w.shared_w2, w.shared_w13_scale, w.shared_w2_scale)
    out = {}
    for kernels in ("triton", "gluon", "gluon192"):
        with override_kernel_options(moe_gemm=kernels):
            out[kernels] = kt.grouped_gated_mlp(x, *common, shared=shared)
    with override_kernel_options(moe_gemm="gluon192", moe_down="triton"):  # the 192-row gate/up, the Triton down
        out["gluon192_triton_down"] = kt.grouped_gated_mlp(x, *common, shared=shared)
    with override_kernel_options(moe_gemm="gluon192", moe_trio_rows="live"):  # idle groups' rows not loaded
        out["gluon192_live_rows"] = kt.grouped_gated_mlp(x, *common, shared=shared)
    for every in ("1", "2", "4"):  # the promotion FFMAs with yield hints (kernels/ffma_yield.py)
        with override_kernel_options(moe_gemm="gluon192", moe_fp8_yield=every):
            out[f"gluon192_yield_{every}"] = kt.grouped_gated_mlp(x, *common, shared=shared)
        assert torch.equal(out[f"gluon192_yield_{every}"], out["triton"]), every
    assert torch.equal(out["gluon192_live_rows"], out["triton"])
    assert torch.equal(out["gluon"], out["triton"])
    assert torch.equal(out["gluon192_triton_down"], out["triton"])
    assert torch.equal(out["gluon192"], out["triton"])  # the Gluon down too (moe_down=auto)
