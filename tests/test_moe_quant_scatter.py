"""kernels/moe_quant_scatter.py: x quantized into the experts' sorted order for the Gluon gate/up.

The FP8 rows and scales must equal quantize_fp8_triton's followed by a gather, bit for bit (the
Gluon path's output is checked against the Triton kernels' bit for bit on the GPU), and padding
rows must be zeros whatever the memory held before."""

from __future__ import annotations

import pytest
import torch

from interpreted import INTERPRETING, in_child, run_this_file_interpreted
from minimax_backend.kernels.fp8 import FP8_DTYPE, quantize_fp8_reference

pytest.importorskip("triton")


@pytest.mark.skipif(INTERPRETING, reason="this is the child")
def test_in_interpreter_child():
    run_this_file_interpreted(__file__)


def _layout(tokens: int, slots: int, seed: int, remote: float = 0.0):
    """A random sorted layout: each pair at its own sorted row, padding rows between, and a
    fraction `remote` of the pairs on another rank (pair_row -1)."""
    g = torch.Generator().manual_seed(seed)
    pairs = tokens * slots
    rows = pairs + int(torch.randint(1, 70, (1,), generator=g))
    dest = torch.randperm(rows, generator=g)[:pairs]
    local = torch.rand(pairs, generator=g) >= remote
    pair_row = torch.where(local, dest, -1).to(torch.int32)
    sorted_pair = torch.full((rows + 5,), -1, dtype=torch.int32)  # longer than rows, as the alignment's
    sorted_pair[dest[local]] = torch.arange(pairs, dtype=torch.int32)[local]
    return pair_row, sorted_pair, rows


def _expected(q, s, pair_row, sorted_pair, rows, slots):
    pair = sorted_pair[:rows].long()
    token = torch.where(pair >= 0, pair // slots, 0)
    qg = q.view(torch.uint8)[token].clone()
    sg = s[token].clone()
    qg[pair < 0] = 0
    sg[pair < 0] = 0
    return qg, sg


def _garbage_outputs(rows, k, device):
    return (torch.full((rows, k), 0x7F, dtype=torch.uint8, device=device).view(FP8_DTYPE),  # NaN in E4M3
            torch.full((rows, k // 128), float("nan"), device=device))


@in_child
@pytest.mark.parametrize("tokens,width,slots,remote", [(37, 384, 3, 0.0), (5, 6144, 5, 0.2), (1, 256, 2, 0.5),
                                                       (64, 128, 1, 0.0)])
def test_equals_quantize_then_gather_bit_for_bit(monkeypatch, tokens, width, slots, remote):
    from minimax_backend.kernels import moe_quant_scatter
    from minimax_backend.kernels.norm_quant_triton import quantize_fp8_triton

    monkeypatch.setattr(moe_quant_scatter, "_outputs", _garbage_outputs)  # padding must be written
    g = torch.Generator().manual_seed(tokens * 7 + width)
    # amplitudes that differ by group, so every group's scale matters
    amp = torch.exp(torch.randn(tokens, width // 128, 1, generator=g) * 2)
    x = (torch.randn(tokens, width // 128, 128, generator=g) * amp).reshape(tokens, width).to(torch.bfloat16)
    pair_row, sorted_pair, rows = _layout(tokens, slots, seed=tokens + slots, remote=remote)
    xg, xsg = moe_quant_scatter.quantize_scatter_fp8(x, pair_row, sorted_pair, rows, slots)
    q, s = quantize_fp8_triton(x, 128)
    want_q, want_s = _expected(q, s, pair_row, sorted_pair, rows, slots)
    assert torch.equal(xg.view(torch.uint8), want_q)
    assert torch.equal(xsg, want_s)
    assert (xg.view(torch.uint8)[sorted_pair[:rows] < 0] == 0).all()


def _aligned_layout(tokens: int, slots: int, run: int, seed: int):
    """The alignment's layout: each expert's pairs first in its run, the run padded to `run` rows
    (a multiple of 64), so some 64-row groups hold only padding."""
    g = torch.Generator().manual_seed(seed)
    pairs = tokens * slots
    expert = torch.randint(0, 4, (pairs,), generator=g)
    pair_row = torch.empty(pairs, dtype=torch.int32)
    sorted_pair, start = [], 0
    for e in range(4):
        mine = (expert == e).nonzero().flatten()
        size = -(-max(len(mine), 1) // run) * run
        pair_row[mine] = torch.arange(start, start + len(mine), dtype=torch.int32)
        sorted_pair += mine.tolist() + [-1] * (size - len(mine))
        start += size
    return pair_row, torch.tensor(sorted_pair, dtype=torch.int32), start


@in_child
@pytest.mark.parametrize("tokens,slots,run", [(70, 3, 192), (9, 5, 64), (100, 2, 192)])
def test_padding_groups_are_left_alone_only_when_asked(monkeypatch, tokens, slots, run):
    """skip_padding_groups: the 64-row groups that start with padding (all padding in the
    alignment's layout) keep what the memory held; every row of the other groups is as without it,
    its padding rows zeros."""
    from minimax_backend.kernels import moe_quant_scatter
    from minimax_backend.kernels.norm_quant_triton import quantize_fp8_triton

    monkeypatch.setattr(moe_quant_scatter, "_outputs", _garbage_outputs)
    g = torch.Generator().manual_seed(tokens)
    amp = torch.exp(torch.randn(tokens, 2, 1, generator=g) * 2)
    x = (torch.randn(tokens, 2, 128, generator=g) * amp).reshape(tokens, 256).to(torch.bfloat16)
    pair_row, sorted_pair, rows = _aligned_layout(tokens, slots, run, seed=tokens)
    q, s = quantize_fp8_triton(x, 128)
    want_q, want_s = _expected(q, s, pair_row, sorted_pair, rows, slots)
    dead = (sorted_pair[:rows].reshape(-1, 64)[:, :1] < 0).expand(-1, 64).reshape(-1)
    # the layout has padding in groups with rows, and (runs of 192) groups of padding only
    assert (~dead & (sorted_pair[:rows] < 0)).any() and dead.any() == (run > 64)
    xg, xsg = moe_quant_scatter.quantize_scatter_fp8(x, pair_row, sorted_pair, rows, slots, skip_padding_groups=True)
    assert torch.equal(xg.view(torch.uint8)[~dead], want_q[~dead])
    assert torch.equal(xsg[~dead], want_s[~dead])
    assert (xg.view(torch.uint8)[dead] == 0x7F).all() and xsg[dead].isnan().all()  # not written
    xg, xsg = moe_quant_scatter.quantize_scatter_fp8(x, pair_row, sorted_pair, rows, slots)
    assert torch.equal(xg.view(torch.uint8), want_q) and torch.equal(xsg, want_s)  # without it: every row


def _garbage_rows(rows, k, dtype, device):
    return torch.full((rows, k), float("nan"), dtype=dtype, device=device)


def _gathered_rows(x, pair_row, sorted_pair, rows, slots):
    pair = sorted_pair[:rows].long()
    want = x[torch.where(pair >= 0, pair // slots, 0)].clone()
    want[pair < 0] = 0
    return want


@in_child
@pytest.mark.parametrize("tokens,width,slots,remote", [(37, 384, 3, 0.0), (5, 6144, 5, 0.2), (1, 256, 2, 0.5)])
def test_scatter_rows_equals_a_gather(monkeypatch, tokens, width, slots, remote):
    """scatter_rows (the BF16 Gluon GEMMs' input): each pair's row of x as it is at its sorted row,
    zeros in every padding row whatever the memory held; with skip_padding_groups on the
    alignment's layout, the groups of padding only keep what they held."""
    from minimax_backend.kernels import moe_quant_scatter

    monkeypatch.setattr(moe_quant_scatter, "_rows_output", _garbage_rows)
    g = torch.Generator().manual_seed(tokens * 3 + width)
    x = (torch.randn(tokens, width, generator=g) * 3).to(torch.bfloat16)
    pair_row, sorted_pair, rows = _layout(tokens, slots, seed=tokens + slots, remote=remote)
    xg = moe_quant_scatter.scatter_rows(x, pair_row, sorted_pair, rows, slots)
    assert xg.dtype == torch.bfloat16
    assert torch.equal(xg, _gathered_rows(x, pair_row, sorted_pair, rows, slots))
    pair_row, sorted_pair, rows = _aligned_layout(tokens * 10, slots, 192, seed=tokens)
    x = (torch.randn(tokens * 10, width, generator=g) * 3).to(torch.bfloat16)
    want = _gathered_rows(x, pair_row, sorted_pair, rows, slots)
    dead = (sorted_pair[:rows].reshape(-1, 64)[:, :1] < 0).expand(-1, 64).reshape(-1)
    assert dead.any() and (~dead & (sorted_pair[:rows] < 0)).any()
    xg = moe_quant_scatter.scatter_rows(x, pair_row, sorted_pair, rows, slots, skip_padding_groups=True)
    assert torch.equal(xg[~dead], want[~dead]) and xg[dead].isnan().all()


def test_bad_shapes_are_named():
    from minimax_backend.kernels.moe_quant_scatter import quantize_scatter_fp8

    x = torch.zeros(4, 200, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="width 200 is not a multiple of 128"):
        quantize_scatter_fp8(x, torch.zeros(8, dtype=torch.int32), torch.zeros(8, dtype=torch.int32), 8, 2)
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="7 pair rows for 4 tokens x 2 slots"):
        quantize_scatter_fp8(x, torch.zeros(7, dtype=torch.int32), torch.zeros(8, dtype=torch.int32), 8, 2)
    with pytest.raises(ValueError, match="9 rows asked of 8 sorted rows"):
        quantize_scatter_fp8(x, torch.zeros(8, dtype=torch.int32), torch.zeros(8, dtype=torch.int32), 9, 2)
    from minimax_backend.kernels.moe_quant_scatter import scatter_rows

    with pytest.raises(ValueError, match="scatter_rows: 7 pair rows for 4 tokens x 2 slots"):
        scatter_rows(x, torch.zeros(7, dtype=torch.int32), torch.zeros(8, dtype=torch.int32), 8, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("tokens", [1, 37, 4097])
def test_on_gpu_equals_the_reference_quantization_gathered(monkeypatch, tokens):
    from minimax_backend.kernels import moe_quant_scatter

    monkeypatch.setattr(moe_quant_scatter, "_outputs", _garbage_outputs)
    g = torch.Generator().manual_seed(tokens)
    amp = torch.exp(torch.randn(tokens, 48, 1, generator=g) * 2)
    x = (torch.randn(tokens, 48, 128, generator=g) * amp).reshape(tokens, 6144).to(torch.bfloat16)
    pair_row, sorted_pair, rows = _layout(tokens, 5, seed=tokens, remote=0.1)
    xg, xsg = moe_quant_scatter.quantize_scatter_fp8(x.cuda(), pair_row.cuda(), sorted_pair.cuda(), rows, 5)
    q, s = quantize_fp8_reference(x, 128)
    want_q, want_s = _expected(q, s, pair_row, sorted_pair, rows, 5)
    assert torch.equal(xg.view(torch.uint8).cpu(), want_q)
    assert torch.equal(xsg.cpu(), want_s)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("tokens", [1, 4097])
def test_scatter_rows_on_gpu_equals_a_gather(monkeypatch, tokens):
    from minimax_backend.kernels import moe_quant_scatter

    monkeypatch.setattr(moe_quant_scatter, "_rows_output", _garbage_rows)
    x = torch.randn(tokens, 6144, generator=torch.Generator().manual_seed(tokens)).to(torch.bfloat16)
    pair_row, sorted_pair, rows = _layout(tokens, 5, seed=tokens, remote=0.1)
    xg = moe_quant_scatter.scatter_rows(x.cuda(), pair_row.cuda(), sorted_pair.cuda(), rows, 5)
    assert torch.equal(xg.cpu(), _gathered_rows(x, pair_row, sorted_pair, rows, 5))
