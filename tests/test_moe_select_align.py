"""The MoE's decode launches before the expert GEMMs: the router's logits with x's FP8
quantization in one launch (kernels/moe_route_triton.py:router_logits_and_fp8), the selection,
the shared slot and the alignment in another (kernels/moe_select_align.py).

Against the separate launches they replace (the quantization kernel; the selection kernel,
torch.cat of the shared slot, the one-program alignment) and the torch route. On CPU the kernels run in a TRITON_INTERPRET=1
child (test_in_interpreter_child); the `gpu` tests compile them.
On sm_90 the decode launches are programmatic dependent launches (kernels/launch_overlap.py):
the last test checks they are, with the same bits as plain launches.
"""

from __future__ import annotations

import pytest
import torch

from interpreted import INTERPRETING, run_this_file_interpreted
from minimax_backend.kernels import moe_reference as R
from minimax_backend.kernels.options import override_kernel_options

triton = pytest.importorskip("triton", reason="the Triton MoE path needs triton (pip install triton)")

# (tokens, experts, top-k, bias, normalized, shared slot, expert offset, local experts, BLOCK_M):
# M3 decode (1 token, 64 tokens at 320 pairs), odd token counts, an EP half, no shared expert,
# more experts than a power of two, a BLOCK_M larger than every run
CASES = [(1, 128, 4, True, True, True, 0, 128, 16), (7, 128, 4, True, True, True, 0, 128, 16),
         (13, 8, 2, True, True, True, 4, 4, 16), (5, 8, 2, False, False, False, 0, 8, 16),
         (64, 128, 4, True, False, True, 64, 64, 16), (3, 200, 8, True, True, True, 0, 200, 64),
         (33, 128, 4, True, True, True, 0, 128, 192)]


def _inputs(tokens, experts, bias, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g) * 2
    cb = torch.randn(experts, generator=g) * 0.1 if bias else None
    return logits, cb


@pytest.fixture
def interp():
    if not INTERPRETING:
        pytest.skip("runs in the TRITON_INTERPRET=1 child (test_in_interpreter_child)")


@pytest.mark.skipif(INTERPRETING, reason="this is the child")
def test_in_interpreter_child():
    run_this_file_interpreted(__file__)


def _separate(logits, cb, k, norm, shared_id, offset, n_local, bm):
    """What the separate launches give: the selection kernel on the logits, the shared slot by
    torch.cat, the one-program alignment."""
    from minimax_backend.kernels import moe_route_triton as RT
    from minimax_backend.kernels.moe_align_triton import align_by_expert_triton

    t, e = logits.shape
    ids = torch.empty(t, k, dtype=torch.int64, device=logits.device)
    w = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    RT._select_kernel[(t,)](logits, cb if cb is not None else logits, ids, w, e, logits.stride(0), 2.5,
                            HAS_BIAS=cb is not None, NORM=norm, K=k, BE=triton.next_power_of_2(e))
    if shared_id >= 0:
        ids = torch.cat([ids, torch.full((t, 1), shared_id, device=ids.device)], 1)
        w = torch.cat([w, torch.ones(t, 1, device=w.device)], 1)
    return (ids, w, *align_by_expert_triton(ids, offset, n_local, bm, shared_id))


def _check(case, device):
    from minimax_backend.kernels.moe_select_align import select_and_align

    tokens, experts, k, bias, norm, shared, offset, n_local, bm = case
    logits, cb = _inputs(tokens, experts, bias, seed=tokens)
    logits, cb = logits.to(device), cb.to(device) if cb is not None else None
    shared_id = experts if shared else -2
    got = select_and_align(logits, cb, k, norm, 2.5, offset, n_local, bm, shared_id)
    want = _separate(logits, cb, k, norm, shared_id, offset, n_local, bm)
    names = ("ids", "weights", "sorted_pair", "block_expert", "pair_row")
    for name, a, b in zip(names, got, want):
        if name == "weights":  # a normalized weight's row sum may be reduced in another order
            torch.testing.assert_close(a, b, rtol=2e-7, atol=0, msg=name)
        else:
            assert torch.equal(a, b), name
    # and the model's route: the same experts, weights to float32 rounding
    scores = torch.sigmoid(logits.cpu())
    choice = scores + (cb.cpu() if cb is not None else 0)
    top = choice.topk(k, 1).indices
    ids = got[0][:, :k].cpu()
    assert torch.equal(ids.sort(1).values, top.sort(1).values)
    w = scores.gather(1, ids)
    if norm:
        w = w / w.sum(1, keepdim=True)
    torch.testing.assert_close(got[1][:, :k].cpu(), w * 2.5, rtol=2e-6, atol=0)
    if shared:
        assert (got[0][:, k] == shared_id).all() and (got[1][:, k] == 1).all()


@pytest.mark.parametrize("case", CASES)
def test_one_launch_equals_the_separate_launches(interp, case):
    _check(case, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_gpu_one_launch_equals_the_separate_launches(case):
    _check(case, "cuda")


def _check_logits_and_fp8(tokens, hidden, device):
    from minimax_backend.kernels.moe_route_triton import router_logits, router_logits_and_fp8
    from minimax_backend.kernels.fp8 import quantize_fp8_reference

    g = torch.Generator().manual_seed(tokens)
    # rows with groups of very different sizes, so the scales differ group to group
    x = (torch.randn(tokens, hidden, generator=g) * torch.logspace(-3, 2, hidden // 128).repeat_interleave(128))
    x = x.to(torch.bfloat16).to(device)
    w = (torch.randn(128, hidden, generator=g) * 0.02).to(device)
    logits, (q, s) = router_logits_and_fp8(x, w)
    want_q, want_s = (t.to(device) for t in quantize_fp8_reference(x.cpu(), 128))
    assert torch.equal(logits, router_logits(x, w))
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
    # scales are powers of two, and the rows span about 16 binades: that many differ at most
    assert s.unique().numel() > min(hidden // 128, 16) // 2
    # past the decode kernel's rows: the GEMM logits, no quantization from the router
    assert router_logits_and_fp8(torch.zeros(17, hidden, dtype=torch.bfloat16, device=device), w)[1] is None


@pytest.mark.parametrize("tokens, hidden", [(1, 1024), (5, 640), (16, 256)])
def test_logits_launch_quantizes_x_as_quantize_fp8(interp, tokens, hidden):
    _check_logits_and_fp8(tokens, hidden, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, hidden", [(1, 6144), (5, 6144), (16, 640)])
def test_gpu_logits_launch_quantizes_x_as_quantize_fp8(tokens, hidden):
    _check_logits_and_fp8(tokens, hidden, "cuda")


def test_what_one_program_takes():
    from minimax_backend.kernels.moe_select_align import select_align_fits, select_and_align

    assert select_align_fits(1, 4, 128, True) and select_align_fits(64, 4, 128, True)  # M3 decode
    assert not select_align_fits(65, 4, 128, True)  # a [128, 128] selection tile: past MAX_TILE
    assert select_align_fits(170, 2, 8, True) and not select_align_fits(171, 2, 8, True)  # 510, 513 pairs
    assert not select_align_fits(1, 4, 2048, True)  # more experts than a program's vector
    assert not select_align_fits(0, 4, 128, True)
    with pytest.raises(ValueError, match="more than one program takes"):
        select_and_align(torch.zeros(200, 128), None, 4, True, 1.0, 0, 128, 16, 128)
    with pytest.raises(ValueError, match="float32"):
        select_and_align(torch.zeros(2, 128, dtype=torch.bfloat16), None, 4, True, 1.0, 0, 128, 16, 128)


def test_grouped_gated_mlp_takes_ids_or_a_selection_not_both():
    from minimax_backend.kernels.moe_select_align import Selection
    from minimax_backend.kernels.moe_triton import grouped_gated_mlp

    x = torch.zeros(2, 256)
    sel = Selection(torch.zeros(2, 8), None, 2, True, 1.0)
    ids, w = torch.zeros(2, 2, dtype=torch.int64), torch.ones(2, 2)
    for a, b, s in ((ids, w, sel), (None, None, None), (ids, None, None)):
        with pytest.raises(ValueError, match="ids and weights, or a selection"):
            grouped_gated_mlp(x, a, b, [], [], None, None, 0, "silu", 1.0, 7.0, 1.0, 8, selection=s)


@pytest.mark.parametrize("fp8, tokens", [(True, 1), (True, 9), (False, 5)])
def test_the_op_runs_the_one_launch_at_decode(interp, fp8, tokens, monkeypatch):
    """minimax::mega_moe's CUDA path (one device) in the interpreter: the fused launch runs by
    default instead of the selection kernel and the alignment, and the block's output is the
    eager block's (tolerances of tests/test_moe_triton.py: FP8 3% Frobenius, BF16 2e-2 of the
    largest value with the shared expert's rounding). moe_select=separate: OTHER_SWITCHES there."""
    import minimax_backend.kernels.moe_triton as kt
    from conftest import tiny_m3_config
    from minimax_backend.kernels import moe as K
    from minimax_backend.kernels import moe_parallel as P
    from minimax_backend.model.minimax import init_random_weights
    from minimax_backend.model.moe import MoE
    from minimax_backend.model.parallel import ParallelState

    cfg = tiny_m3_config(swiglu_limit=0.75)
    blk = MoE(cfg, ParallelState.single(), "model.layers.0.block_sparse_moe", dtype=torch.bfloat16, device="cpu",
              fp8=fp8)
    blk.config = cfg
    init_random_weights(blk, seed=0).eval()
    x = torch.randn(tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(tokens)).to(torch.bfloat16)
    calls = {"fused": 0, "route": 0, "align": 0}

    def counting(name, real):
        def call(*a, **kw):
            calls[name] += 1
            return real(*a, **kw)
        return call

    monkeypatch.setattr(kt, "select_and_align", counting("fused", kt.select_and_align))
    monkeypatch.setattr(kt, "route_triton", counting("route", kt.route_triton))
    monkeypatch.setattr(kt, "align_with_triton", counting("align", kt.align_with_triton))
    grouped = []
    real_grouped = kt.grouped_gated_mlp
    monkeypatch.setattr(kt, "grouped_gated_mlp", lambda *a, **kw: grouped.append(kw) or real_grouped(*a, **kw))
    out = P.mega_moe_reference(x, *K.block_op_args(blk), "", 1, False, False, tokens, "allgather",
                               experts=kt.triton_experts, weights_cls=kt.TritonMoEWeights)
    assert calls == {"fused": 1, "route": 0, "align": 0}
    assert (grouped[0]["x_fp8"] is not None) == fp8  # FP8: x quantized by the logits launch
    with torch.no_grad():
        ref = blk(x).float()
    out = out.float()
    err = ((out - ref).norm() / ref.norm()) if fp8 else ((out - ref).abs().max() / ref.abs().max())
    assert err <= (0.03 if fp8 else 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8, tokens", [(True, 1), (True, 5), (False, 3)])
def test_gpu_decode_launches_overlap_by_default(fp8, tokens):
    """On sm_90 the decode layer's launches are programmatic dependent launches
    (kernels/launch_overlap.py), with the same bits as moe_overlap=off's plain launches, one call
    after another as in a CUDA graph's replay (a kernel that read too early would differ)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs an sm_90 GPU")
    import minimax_backend.kernels.moe_triton as kt
    from conftest import tiny_m3_config
    from minimax_backend.kernels import moe as K
    from minimax_backend.kernels import moe_parallel as P
    from minimax_backend.model.minimax import init_random_weights
    from minimax_backend.model.moe import MoE
    from minimax_backend.model.parallel import ParallelState

    cfg = tiny_m3_config(swiglu_limit=0.75)
    blk = MoE(cfg, ParallelState.single(), "model.layers.0.block_sparse_moe", dtype=torch.bfloat16, device="cuda",
              fp8=fp8)
    blk.config = cfg
    init_random_weights(blk, seed=0).eval()
    xs = [torch.randn(tokens, cfg.hidden_size, device="cuda").to(torch.bfloat16) for _ in range(4)]
    args = K.block_op_args(blk)
    outs = {}
    for overlap in ("auto", "off"):
        combine = []
        real = kt._combine_kernel

        class Spy:
            def __getitem__(self, grid):
                def launch(*a, **kw):
                    combine.append(kw)
                    return real[grid](*a, **kw)
                return launch

        kt._combine_kernel = Spy()
        try:
            with override_kernel_options(moe_overlap=overlap):
                outs[overlap] = [P.mega_moe_reference(x, *args, "", 1, False, False, tokens, "allgather",
                                                      experts=kt.triton_experts, weights_cls=kt.TritonMoEWeights)
                                 for x in xs]
        finally:
            kt._combine_kernel = real
        assert combine and all(kw.get("launch_pdl", False) == (overlap == "auto") for kw in combine), overlap
    for a, b in zip(outs["auto"], outs["off"]):
        assert torch.equal(a, b)
