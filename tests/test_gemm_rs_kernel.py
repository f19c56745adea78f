"""The overlapped GEMM-RS schedule of kernels/gemm_rs_cuda.py, checked on CPU.

The CUDA kernel is a schedule of ordinary tensor ops (row-block GEMMs, copies
into the peers' symmetric buffers, GEMMs that add the peer's partial, sums over
slots) around barriers, events and a side stream. Here W ranks are simulated in
one process: the "symmetric buffers" are plain tensors that every simulated
rank can write, barriers, events and streams are no-ops, and the push phase of
every rank runs before any rank computes its own rows (which is what the
per-piece barriers guarantee on the GPU). On CPU the addend of the own-rows
GEMM is added after it (cuBLASLt does it in the epilogue on the GPU). That
checks the indexing (who owns which rows, which slot a push lands in, padding
rows, pieces) for any world size, including the 4 and 8 the GPU box cannot
test.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from minimax_backend.kernels import gemm_rs_cuda
from minimax_backend.kernels.fp8 import quantize_weight_fp8
from minimax_backend.kernels.options import override_kernel_options


class SimWorkspace(gemm_rs_cuda._Workspace):
    def barrier(self):
        pass

    def fork(self):
        pass

    def side(self):
        return contextlib.nullcontext()

    def join(self):
        pass

    def mark_arrived(self, piece):
        self.marked.append(piece)

    def wait_arrived(self, piece):
        assert piece in self.marked, f"piece {piece} awaited before its barrier"


def _simulate(xs, weights, tokens, world, *, x_scales=None, w_scales=None, biases=None, out_dtype=None,
              gemms=None):
    """Every rank's output rows; `gemms`, if given, receives each rank's _RowsGemm."""
    rows = -(-tokens // world)
    dtype = out_dtype or xs[0].dtype
    syms = [torch.full((world, rows, weights[0].shape[0]), float("nan"), dtype=dtype) for _ in range(world)]
    workspaces = [
        SimWorkspace(rank=r, world=world, rows=rows, sym=syms[r], peers=syms,
                     stage=torch.full_like(syms[r], float("nan")))
        for r in range(world)
    ]
    for ws in workspaces:
        ws.marked = []
    k = xs[0].shape[1]
    schedule = gemm_rs_cuda.choose_schedule(rows * world, k, x_scales is not None)
    pieces = gemm_rs_cuda.piece_bounds(rows, gemm_rs_cuda.push_pieces(rows, k, schedule))
    assert pieces[0][0] == 0 and pieces[-1][1] == rows and all(b == c for (_, b), (c, _) in zip(pieces, pieces[1:]))
    gemms = [] if gemms is None else gemms
    for r, ws in enumerate(workspaces):
        gemm = gemm_rs_cuda._RowsGemm(xs[r], weights[r], None if x_scales is None else x_scales[r],
                                      None if w_scales is None else w_scales[r],
                                      None if biases is None else biases[r], dtype)
        gemm.lay_out_scales(gemm_rs_cuda.equal_runs(tokens, world, rows, pieces))  # as run_schedule does
        gemms.append(gemm)
        gemm_rs_cuda.push_partials(ws, gemm, tokens, pieces, mark_pieces=schedule == "epilogue",
                                   store=gemm_rs_cuda.push_mode() == "store")
        # every peer got its whole block from this rank, in pieces that tile [0, rows), into slot [r]
        assert sorted(ws.pushes) == sorted((d, r, a, b) for d in range(world) if d != r for a, b in pieces)
        assert ws.marked == (list(range(len(pieces))) if schedule == "epilogue" else [])
    # every rank's pushes land before any rank computes its own rows (the barriers on the GPU)
    outs = []
    for ws, gemm in zip(workspaces, gemms):
        if schedule == "sum_after":
            outs.append(gemm_rs_cuda.own_rows_sum_after(ws, gemm, tokens))
        else:
            out = torch.full((rows, weights[0].shape[0]), float("nan"), dtype=dtype)
            outs.append(gemm_rs_cuda.own_rows_epilogue(ws, gemm, tokens, pieces, out))
    return outs


@pytest.fixture(params=["sum_after", "epilogue"])
def schedule(request):
    """Both schedules of the own rows (choose_schedule picks by size; forced here)."""
    with override_kernel_options(gemm_rs_schedule=request.param):
        # forced at both ends of choose_schedule's size rule (the simulation asks it, as the op does)
        assert {gemm_rs_cuda.choose_schedule(r, k, fp8) for r in (8, 8192) for k in (512, 8192)
                for fp8 in (False, True)} == {request.param}
        yield request.param


@pytest.fixture(params=["copy", "store"])
def push(request):
    """Both ways a partial reaches its owner (copy engine from a stage, or the GEMM's own stores)."""
    with override_kernel_options(gemm_rs_push=request.param):
        assert gemm_rs_cuda.push_mode() == request.param  # what the simulation's pushes follow
        yield request.param


def _reference(partials, tokens, world):
    pad = -(-tokens // world) * world - tokens
    full = torch.stack([F.pad(p, (0, 0, 0, pad)) for p in partials])  # [W (source), M', N]
    return list(full.sum(0).chunk(world)) if world > 2 else list((full[0] + full[1]).chunk(world))


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("tokens", [1, 7, 37, 64])
def test_schedule_matches_reduce_scatter(schedule, push, world, tokens):
    # small integers: every sum is exact, whatever order a GEMM or reduction adds in
    g = torch.Generator().manual_seed(world * 100 + tokens)
    ints = lambda *shape: torch.randint(-3, 4, shape, generator=g).float()  # noqa: E731
    xs = [ints(tokens, 32) for _ in range(world)]
    ws = [ints(24, 32) for _ in range(world)]
    bs = [ints(24) for _ in range(world)]
    got = _simulate(xs, ws, tokens, world)
    want = _reference([x @ w.t() for x, w in zip(xs, ws)], tokens, world)
    for r in range(world):
        assert torch.equal(got[r], want[r]), (r, (got[r] - want[r]).abs().max())
    got = _simulate(xs, ws, tokens, world, biases=bs)
    want = _reference([torch.addmm(b, x, w.t()) for x, w, b in zip(xs, ws, bs)], tokens, world)
    for r in range(world):
        assert torch.equal(got[r], want[r])


@pytest.mark.parametrize("pieces", ["1", "2", "3", "16"])
@pytest.mark.parametrize("world,tokens", [(2, 2101), (3, 1537), (4, 4099)])
def test_schedule_in_pieces_matches_reduce_scatter(schedule, push, pieces, world, tokens):
    """Blocks pushed in pieces (the last one partly padding rows); 16 is more than
    fits and is capped at one piece per 128 rows."""
    rows = -(-tokens // world)
    g = torch.Generator().manual_seed(tokens)
    ints = lambda *shape: torch.randint(-3, 4, shape, generator=g).float()  # noqa: E731
    xs = [ints(tokens, 16) for _ in range(world)]
    ws = [ints(8, 16) for _ in range(world)]
    with override_kernel_options(gemm_rs_pieces=pieces):  # as the variable spells it
        assert len(gemm_rs_cuda.piece_bounds(rows, gemm_rs_cuda.push_pieces(rows, 16, schedule))) == min(
            int(pieces), rows // 128)
        got = _simulate(xs, ws, tokens, world)
    want = _reference([x @ w.t() for x, w in zip(xs, ws)], tokens, world)
    for r in range(world):
        assert torch.equal(got[r], want[r]), r


def test_default_pieces_and_schedules():
    assert gemm_rs_cuda.push_pieces(511, 2048) == 1  # below two 256-row pieces: one
    assert gemm_rs_cuda.push_pieces(512, 2048) == gemm_rs_cuda.DEFAULT_PIECES == 2
    assert gemm_rs_cuda.push_pieces(8192, 6144) == 2  # epilogue: the own rows wait per piece, at any K
    assert gemm_rs_cuda.push_pieces(8192, 6144, "sum_after") == 1  # the own-rows GEMM hides the whole push
    assert gemm_rs_cuda.push_pieces(8192, 2048, "sum_after") == 2
    choose = gemm_rs_cuda.choose_schedule
    assert [choose(m, 2048) for m in (4096, 8192)] == ["sum_after", "epilogue"]  # BF16, the measured crossovers
    assert [choose(m, 4096) for m in (2048, 4096)] == ["sum_after", "epilogue"]
    assert [choose(m, 6144) for m in (1024, 2048)] == ["sum_after", "epilogue"]
    assert [choose(m, 4096, fp8=True) for m in (4096, 8192)] == ["sum_after", "epilogue"]
    assert [choose(m, 6144, fp8=True) for m in (2048, 4096)] == ["sum_after", "epilogue"]
    assert choose(1 << 20, 2048, fp8=True) == "sum_after"  # FP8 K = 2048: never
    assert gemm_rs_cuda.piece_bounds(2048, 2) == [(0, 1024), (1024, 2048)]
    assert gemm_rs_cuda.piece_bounds(1000, 3) == [(0, 384), (384, 640), (640, 1000)]
    assert gemm_rs_cuda.push_mode() == "copy"
    # the switches pin them (bad values: tests/test_kernel_options.py)
    with override_kernel_options(gemm_rs_pieces=3, gemm_rs_schedule="epilogue", gemm_rs_push="store"):
        assert gemm_rs_cuda.push_pieces(8192, 6144, "sum_after") == 3
        assert gemm_rs_cuda.push_pieces(200, 2048) == 1  # capped at one piece per 128 rows
        assert gemm_rs_cuda.choose_schedule(1024, 2048) == "epilogue"
        assert gemm_rs_cuda.push_mode() == "store"


def _check_fp8_schedule(world, tokens, seed) -> list:
    """Simulate FP8 inputs (K = 256) through the schedule and compare with per-rank GEMMs + reduce-scatter;
    returns each rank's _RowsGemm."""
    g = torch.Generator().manual_seed(seed)
    xs, xss, wqs, wss = [], [], [], []
    for _ in range(world):
        q, s = torch.ops.minimax.quantize_fp8(torch.randn(tokens, 256, generator=g), 128)
        wq, ws = quantize_weight_fp8(torch.randn(128, 256, generator=g))
        xs.append(q), xss.append(s), wqs.append(wq), wss.append(ws)
    gemms = []
    got = _simulate(xs, wqs, tokens, world, x_scales=xss, w_scales=wss, out_dtype=torch.float32, gemms=gemms)
    want = _reference([torch.ops.minimax.fp8_block_gemm(*a, torch.float32) for a in zip(xs, xss, wqs, wss)],
                      tokens, world)
    for r in range(world):  # the row-block GEMMs may add in another order than one big GEMM
        torch.testing.assert_close(got[r], want[r], rtol=1e-5, atol=1e-4)
    return gemms


def test_schedule_fp8(schedule, push):
    _check_fp8_schedule(world=4, tokens=37, seed=0)


@pytest.mark.parametrize("world,tokens,equal_runs", [
    (2, 1024, True), (4, 2048, True),
    (2, 1030, False),  # pieces of 256 and 259 rows
    (4, 2046, False),  # two padding rows
])
def test_fp8_scales_transposed_once_per_call(schedule, world, tokens, equal_runs):
    """Where the GEMMs cut x into equal runs (no padding, equal pieces), the activation
    scales are laid out for all of them in one go; elsewhere each GEMM transposes its own.
    The result is the same either way."""
    gemms = _check_fp8_schedule(world, tokens, seed=tokens)
    rows = -(-tokens // world)
    pieces = gemm_rs_cuda.piece_bounds(rows, gemm_rs_cuda.push_pieces(rows, 256, schedule))
    gemm_calls = world * len(pieces) if schedule == "epilogue" else (world - 1) * len(pieces) + 1
    if not equal_runs:  # every GEMM transposes its own scales
        want_transposes = gemm_calls
    elif schedule == "epilogue" or len(pieces) == 1:
        want_transposes = 0
    else:  # sum_after's own rows are one GEMM over two pieces' rows
        want_transposes = 1
    assert [gemm.scale_transposes for gemm in gemms] == [want_transposes] * world


def test_first_call_during_capture_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(gemm_rs_cuda, "_is_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="cannot happen during CUDA graph capture.*prepare"):
        gemm_rs_cuda._workspace(19, 256, torch.bfloat16, "not-a-group", torch.device("cuda", 0))
    assert gemm_rs_cuda.workspace_count() == 0


def test_cpu_never_takes_the_fused_path(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("fused path on CPU")

    monkeypatch.setattr(gemm_rs_cuda, "gemm_rs_fused", boom)
    x, w = torch.randn(5, 16), torch.randn(8, 16)
    out = torch.ops.minimax.gemm_rs(x, w, None, None, None, 0, 0, 1, "unused")
    assert torch.equal(out, x @ w.t())


def test_fused_switch_off_means_matmul_and_reduce_scatter(monkeypatch):
    monkeypatch.setattr(gemm_rs_cuda, "_FUSED_OK", {})
    with override_kernel_options(gemm_rs_fused="0"), pytest.warns(UserWarning, match="MINIMAX_GEMM_RS_FUSED=0"):
        assert not gemm_rs_cuda.fused_available("any-group")
