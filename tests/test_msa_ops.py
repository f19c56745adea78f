"""The MSA ops (kernels/msa.py): the reference's selection rule, its attention, and the Triton kernels.

The reference is checked against a brute-force loop written from the rule
(ARCHITECTURE.md, "MSA") in float64, and against dense causal attention where
the two must agree (a query that sees <= topk * block keys). The Triton
kernels (kernels/msa_triton.py) are checked against the reference under
TRITON_INTERPRET=1, in a child process (as tests/test_norm_quant_triton.py
explains), at awkward sizes: lengths that are not multiples of the block,
several sequences at different positions, one-token decode, K below topk.

Tolerances: block scores agree exactly in which blocks are +-inf and to
1e-5 (float32 dot products in another order) elsewhere; the selected blocks
are compared as sets; attention to 1e-5 of the output scale in float32, 2e-2
in bfloat16 (one bf16 rounding of the inputs of each product).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from interpreted import INTERPRETING, in_child, run_this_file_interpreted
from minimax_backend.kernels import msa



def _case(batch, seq, slots, heads, dim, seed, dtype=torch.float32, prefill_from_zero=False):
    g = torch.Generator().manual_seed(seed)
    iq = torch.randn(batch * seq, heads, dim, generator=g).to(dtype)
    ik = torch.randn(batch, slots, dim, generator=g).to(dtype)
    if prefill_from_zero:
        pos = torch.arange(seq).expand(batch, seq).contiguous()
    else:  # each sequence somewhere else in its cache
        start = torch.randint(0, slots - seq + 1, (batch,), generator=g)
        pos = start[:, None] + torch.arange(seq)
    return iq, ik, pos


def _brute_force_select(iq, ik, pos, block, topk, local, init):
    """The rule, one query and index head at a time, in float64."""
    batch, seq = pos.shape
    heads = iq.shape[1]
    n_blocks = math.ceil(ik.shape[1] / block)
    out = []
    for b in range(batch):
        for s in range(seq):
            p = int(pos[b, s])
            own = p // block
            row = []
            for h in range(heads):
                q = iq[b * seq + s, h].double()
                scores = {}
                for blk in range(n_blocks):
                    keys = [j for j in range(blk * block, min((blk + 1) * block, ik.shape[1])) if j <= p]
                    if not keys:
                        continue
                    forced = own - local < blk <= own or (blk < init and blk <= own)
                    scores[blk] = math.inf if forced else max(float(q @ ik[b, j].double()) for j in keys)
                best = sorted(scores, key=lambda k: -scores[k])[:topk]
                row.append(set(best))
            out.append(row)
    return out


@pytest.mark.parametrize("local,init", [(1, 0), (2, 1)])
def test_selection_follows_the_rule(local, init):
    block, topk = 4, 3
    iq, ik, pos = _case(2, 9, 30, 2, 8, seed=local)
    got = msa.msa_select_reference(iq, ik, pos, block, topk, local, init)
    assert got.dtype == torch.int32 and tuple(got.shape) == (18, 2, topk)
    want = _brute_force_select(iq, ik, pos, block, topk, local, init)
    for t in range(got.shape[0]):
        for h in range(2):
            ids = got[t, h].tolist()
            valid = [i for i in ids if i >= 0]
            assert ids == valid + [-1] * (len(ids) - len(valid)), ids  # left-packed, -1 padded
            assert set(valid) == want[t][h], (t, h, ids, want[t][h])
            assert len(set(valid)) == len(valid)
            own = int(pos.flatten()[t]) // block
            assert ids[0] == own or (local > 1 or init) and own in ids  # the query's block always


def test_short_context_selects_every_past_block():
    iq, ik, pos = _case(1, 5, 8, 1, 4, seed=0, prefill_from_zero=True)
    got = msa.msa_select_reference(iq, ik, pos, block_size=4, topk=16, local_blocks=1, init_blocks=0)
    assert got.shape[-1] == 2  # min(topk, blocks)
    assert got[:4, 0].tolist() == [[0, -1]] * 4  # positions 0-3 see block 0 only
    assert sorted(got[4, 0].tolist()) == [0, 1]


def _dense_causal(q, k, v, pos, scale):
    """SDPA over every key slot <= the query's position, GQA by repeating KV heads."""
    batch, seq = pos.shape
    hq, hkv = q.shape[1], k.shape[1]
    mask = torch.arange(k.shape[2]) <= pos[..., None]  # [B, S, L]
    qb = q.view(batch, seq, hq, -1).transpose(1, 2).double()
    kb = k.double().repeat_interleave(hq // hkv, 1)
    vb = v.double().repeat_interleave(hq // hkv, 1)
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask[:, None], scale=scale)
    return out.transpose(1, 2).reshape(q.shape)


def test_attention_is_dense_when_every_block_is_selected():
    g = torch.Generator().manual_seed(2)
    batch, seq, slots, hq, hkv, hi, d, block = 2, 7, 24, 8, 2, 4, 16, 4
    iq, ik, pos = _case(batch, seq, slots, hi, 8, seed=3)
    blocks = msa.msa_select_reference(iq, ik, pos, block, topk=16, local_blocks=1, init_blocks=0)
    q = torch.randn(batch * seq, hq, d, generator=g)
    k, v = torch.randn(2, batch, hkv, slots, d, generator=g)
    got = msa.msa_attention_reference(q, k, v, blocks, pos, block, d ** -0.5)
    torch.testing.assert_close(got.double(), _dense_causal(q, k, v, pos, d ** -0.5), rtol=1e-5, atol=1e-5)


def test_attention_attends_to_the_selected_keys_only():
    """Against a loop over queries that gathers exactly the selected blocks' keys <= position."""
    g = torch.Generator().manual_seed(4)
    batch, seq, slots, hq, hkv, hi, d, block = 2, 5, 40, 4, 2, 2, 8, 4
    iq, ik, pos = _case(batch, seq, slots, hi, 8, seed=5)
    blocks = msa.msa_select_reference(iq, ik, pos, block, topk=3, local_blocks=1, init_blocks=0)
    q = torch.randn(batch * seq, hq, d, generator=g)
    k, v = torch.randn(2, batch, hkv, slots, d, generator=g)
    got = msa.msa_attention_reference(q, k, v, blocks, pos, block, 0.3)
    for t in range(batch * seq):
        b, p = t // seq, int(pos.flatten()[t])
        for h in range(hq):
            sel = [blk for blk in blocks[t, h // (hq // hi)].tolist() if blk >= 0]
            keys = [j for blk in sel for j in range(blk * block, (blk + 1) * block) if j <= p]
            kk, vv = k[b, h // (hq // hkv), keys].double(), v[b, h // (hq // hkv), keys].double()
            w = torch.softmax(kk @ q[t, h].double() * 0.3, dim=0)
            torch.testing.assert_close(got[t, h].double(), w @ vv, rtol=1e-5, atol=1e-6)


def test_fakes_and_errors():
    with torch.device("meta"):
        iq, ik, pos = torch.empty(6, 4, 32), torch.empty(2, 100, 32), torch.empty(2, 3, dtype=torch.long)
        blocks = msa.msa_select(iq, ik, pos, 16, 4, 1, 0)
        assert tuple(blocks.shape) == (6, 4, 4) and blocks.dtype == torch.int32
        out = msa.msa_attention(torch.empty(6, 8, 16), torch.empty(2, 2, 100, 16), torch.empty(2, 2, 100, 16),
                                blocks, pos, 16, 0.25)
        assert tuple(out.shape) == (6, 8, 16)
    iq, ik, pos = _case(1, 3, 10, 2, 4, seed=0)
    with pytest.raises(ValueError, match="do not fit in top-2"):
        msa.msa_select_reference(iq, ik, pos, 4, 2, 2, 1)
    with pytest.raises(ValueError, match="index_q has 3 tokens, positions 1 x 4"):
        msa.msa_select_reference(iq, ik, torch.arange(4)[None], 4, 2, 1, 0)
    with pytest.raises(ValueError, match="not a multiple of 2 index heads"):
        blocks = msa.msa_select_reference(iq, ik, pos, 4, 2, 1, 0)
        msa.msa_attention_reference(torch.zeros(3, 3, 4), torch.zeros(1, 1, 10, 4), torch.zeros(1, 1, 10, 4),
                                    blocks, pos, 4, 1.0)


# ---------------------------------------------------------- Triton kernels
@pytest.mark.skipif(INTERPRETING, reason="this is the child")
def test_in_interpreter_child():
    run_this_file_interpreted(__file__)


SHAPES = [  # batch, seq, slots, index heads, index dim, block, topk, local, init, Hq, Hkv, d, from zero
    (2, 37, 64, 2, 32, 16, 3, 1, 0, 4, 2, 32, True),  # prefill, 37 not a multiple of the block
    (1, 5, 100, 4, 16, 16, 4, 1, 1, 4, 2, 16, False),  # a chunk in the middle of a cache, init block
    (3, 1, 130, 4, 32, 16, 4, 2, 0, 16, 2, 32, False),  # decode: one token per sequence, local 2
    (2, 40, 40, 2, 32, 16, 8, 1, 0, 32, 2, 16, True),  # K = 3 < topk; 16 query heads per index head
]


@in_child
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_scores_kernel(shape, dtype):
    from minimax_backend.kernels import msa_triton

    batch, seq, slots, hi, dim, block, topk, local, init, *_rest, from_zero = shape
    iq, ik, pos = _case(batch, seq, slots, hi, dim, seed=seq, dtype=dtype, prefill_from_zero=from_zero)
    ref = msa.block_scores_reference(iq, ik, pos, block, local, init).flatten(0, 1)
    got = msa_triton.block_scores(iq, ik, pos, block, local, init, msa.num_key_blocks(slots, block))
    assert torch.equal(got == math.inf, ref == math.inf) and torch.equal(got == -math.inf, ref == -math.inf)
    finite = torch.isfinite(ref)
    torch.testing.assert_close(got[finite], ref[finite], rtol=1e-5, atol=1e-5)
    sel_ref, sel_got = msa.top_blocks(ref, topk), msa_triton.top_blocks(got, topk)
    assert sel_got.dtype == torch.int32 and sel_got.shape == sel_ref.shape
    assert [sorted(r) for r in sel_ref.flatten(0, 1).tolist()] == [sorted(r) for r in sel_got.flatten(0, 1).tolist()]
    valid = sel_got >= 0  # left-packed, best first
    assert torch.equal(valid, valid.sort(-1, descending=True).values)


# Each shape with the plan the op picks, in both dtypes; the forced plans: tokens per
# program on a prefill, and tokens per program and the split on the decode shape.
ATTENTION_CASES = [(s, dt, None, None) for s in SHAPES for dt in (torch.float32, torch.bfloat16)] + [
    (SHAPES[0], torch.float32, 1, 1), (SHAPES[0], torch.float32, 4, 1)] + [
    (SHAPES[2], torch.float32, tok, split) for tok, split in ((1, 1), (1, 2), (4, 1))]


@in_child
@pytest.mark.parametrize("shape,dtype,tok,split", ATTENTION_CASES)
def test_attention_kernel(shape, dtype, tok, split):
    from minimax_backend.kernels import msa_triton

    batch, seq, slots, hi, dim, block, topk, local, init, hq, hkv, d, from_zero = shape
    iq, ik, pos = _case(batch, seq, slots, hi, dim, seed=seq, prefill_from_zero=from_zero)
    blocks = msa.msa_select_reference(iq, ik, pos, block, topk, local, init)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(batch * seq, hq, d, generator=g).to(dtype)
    k, v = (t.to(dtype) for t in torch.randn(2, batch, hkv, slots, d, generator=g))
    ref = msa.msa_attention_reference(q, k, v, blocks, pos, block, d ** -0.5)
    out = torch.full_like(q, float("nan"))  # every element must be written
    out.copy_(msa_triton.sparse_attention(q, k, v, blocks, pos, block, d ** -0.5, tok=tok, split=split))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@in_child
def test_attention_kernel_reads_strided_keys():
    """The no-cache path hands the kernel K and V as transposed views of the QKV output."""
    from minimax_backend.kernels import msa_triton

    batch, seq, hkv, d, block = 2, 33, 2, 16, 16
    g = torch.Generator().manual_seed(1)
    iq, ik, pos = _case(batch, seq, seq, 2, 16, seed=1, prefill_from_zero=True)
    blocks = msa.msa_select_reference(iq, ik, pos, block, 2, 1, 0)
    q = torch.randn(batch * seq, 4, d, generator=g)
    k, v = (t.view(batch, seq, hkv, d).transpose(1, 2) for t in torch.randn(2, batch * seq, hkv, d, generator=g))
    ref = msa.msa_attention_reference(q, k, v, blocks, pos, block, 0.25)
    torch.testing.assert_close(msa_triton.sparse_attention(q, k, v, blocks, pos, block, 0.25), ref,
                               rtol=1e-5, atol=1e-5)
