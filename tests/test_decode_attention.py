"""`minimax::decode_attention` and the pass that puts it in place of SDPA at decode.

The op's reference against F.scaled_dot_product_attention in float64 (bool and
additive masks, broadcast masks, grouped heads, 1 and 3 query rows); the Triton
kernel in the interpreter against the reference (float32 at 1e-5, bfloat16 at
2e-2), split and unsplit, at lengths that are not a multiple of its tile; the
pass on a decode step of the tiny M3 (float32, against eager) and on graphs it
must leave alone; on the GPU, the kernel at M3's decode shape.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from interpreted import INTERPRETING, in_child, run_this_file_interpreted
from minimax_backend.kernels import decode_attention as da


def _case(batch, hq, hkv, seq, slots, dim, mask_kind, seed=0, dtype=torch.float32, mask_batch=None):
    """q laid out as the model hands it to SDPA ([B, S, Hq, d] memory), a cache, and a mask
    where each query sees the slots up to a position somewhere in the second half (an
    additive one also biases the keys it sees, so its values count, not only its -inf)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, hq, dim, generator=g).transpose(1, 2).to(dtype)
    k, v = (torch.randn(batch, hkv, slots, dim, generator=g).to(dtype) for _ in range(2))
    pos = torch.randint(slots // 2, slots, (batch, 1), generator=g) - torch.arange(seq - 1, -1, -1)[None]
    mask = torch.arange(slots)[None, None, None, :] <= pos[:, None, :, None]  # [B, 1, S, L]
    if mask_batch == 1:
        mask = mask[:1, :, :1]
    if mask_kind == "additive":
        mask = torch.where(mask, torch.rand(mask.shape, generator=g) * 2 - 1, float("-inf")).to(dtype)
    return q, k, v, mask


def _sdpa64(q, k, v, mask, scale):
    m = mask if mask.dtype == torch.bool else mask.double()
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=m, scale=scale,
                                          enable_gqa=True)


CASES = [  # batch, Hq, Hkv, S, slots, d, mask, mask batch
    (3, 8, 2, 1, 100, 32, "bool", None),
    (2, 16, 4, 3, 77, 16, "additive", None),
    (1, 4, 4, 2, 130, 32, "bool", None),  # no grouping
    (2, 8, 2, 1, 200, 32, "additive", 1),  # one mask row for every sequence
]


@pytest.mark.parametrize("case", CASES)
def test_reference_equals_sdpa_in_float64(case):
    *shape, kind, mb = case
    q, k, v, mask = _case(*shape, kind, mask_batch=mb)
    scale = shape[-1] ** -0.5
    out = torch.ops.minimax.decode_attention(q, k, v, mask, scale)
    torch.testing.assert_close(out.double(), _sdpa64(q, k, v, mask, scale), rtol=1e-5, atol=1e-5)
    batch, hq, seq, dim = q.shape
    assert out.shape == q.shape and out.transpose(1, 2).is_contiguous()  # [B, S, Hq, d] memory, as SDPA's


def test_a_row_with_every_key_masked_gives_zeros():
    q, k, v, mask = _case(2, 4, 2, 1, 20, 16, "bool")
    mask[1] = False
    out = da.decode_attention_reference(q, k, v, mask, 0.25)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isfinite(out).all()


def test_bad_shapes_name_the_problem():
    q, k, v, mask = _case(2, 8, 2, 1, 20, 16, "bool")
    with pytest.raises(ValueError, match="not a multiple of 3 KV heads"):
        da.check_decode_attention(q, k[:, :1].expand(2, 3, 20, 16), v[:, :1].expand(2, 3, 20, 16), mask)
    with pytest.raises(ValueError, match="at most 4"):
        da.check_decode_attention(q.expand(2, 8, 5, 16), k, v, mask)
    with pytest.raises(ValueError, match=r"mask \(2, 8, 1, 20\) must be"):
        da.check_decode_attention(q, k, v, mask.expand(2, 8, 1, 20))
    with pytest.raises(ValueError, match="bool or floating point"):
        da.check_decode_attention(q, k, v, mask.int())


# ------------------------------------------------------------------- the pass
def _tiny_decode(batch=3, slots=40):
    from minimax_backend.model.minimax import build_model
    from minimax_backend.model.parallel import ParallelState
    from minimax_backend.model.presets import load_preset
    from minimax_backend.model.random_weights import fast_random_weights

    cfg = load_preset("tiny-m3")
    model = fast_random_weights(build_model(cfg, ParallelState.single(), dtype=torch.float32,
                                            device=torch.device("cpu"), quantize_fp8=False), seed=0).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (batch, 1), generator=g)
    pos = torch.tensor([[20], [5], [slots - 1]])[:batch]  # odd batch, different lengths
    return cfg, model, ids, pos


def _fill(model, batch, slots, seed=2):
    model.allocate_kv_cache(batch, slots)
    g = torch.Generator().manual_seed(seed)
    for layer in model.layers:
        for buf in (layer.self_attn.kv_cache.k, layer.self_attn.kv_cache.v):
            buf.copy_(torch.randn(buf.shape, generator=g))


def _passes():
    from minimax_backend.graph_passes import last_compile_report

    rep = last_compile_report()
    return {p["name"]: p for p in rep["passes"]}, rep


def test_pass_replaces_the_dense_layers_decode_attention():
    import minimax_backend.graph_passes as gp

    cfg, model, ids, pos = _tiny_decode()
    dense = [i for i in range(cfg.num_hidden_layers) if i not in cfg.sparse_attention_layers]
    with torch.no_grad():
        _fill(model, 3, 40)
        ref = model(ids, pos)
        _fill(model, 3, 40)  # the same cache again: the eager call wrote the new token's K/V
        out = gp.compile(model, codegen="fx", strict=True)(ids, pos)
    passes, rep = _passes()
    rec = passes["decode_attention"]
    assert rec["matches"] == len(dense) == rec["candidates"] and rec["expected"]
    assert "additive mask (3, 1, 1, 40)" in rec["details"][0] or "bool mask (3, 1, 1, 40)" in rec["details"][0]
    assert rep["ops_after"].get("minimax.decode_attention") == len(dense)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_pass_leaves_prefill_alone_and_fails_loudly_when_forced():
    import minimax_backend.graph_passes as gp

    cfg, model, _, _ = _tiny_decode()
    ids = torch.randint(0, cfg.vocab_size, (1, 7))
    pos = torch.arange(7)[None]
    with torch.no_grad():
        model.allocate_kv_cache(1, 16)
        gp.compile(model, codegen="fx", strict=True)(ids, pos)
        rec = _passes()[0]["decode_attention"]
        assert rec["matches"] == 0 and not rec["expected"] and "query rows" in rec["skipped"]
        torch._dynamo.reset()
        with pytest.raises(Exception, match="decode_attention"):
            gp.compile(model, codegen="fx", strict=True, decode_attention="on")(ids, pos)


class _CausalDecode(torch.nn.Module):
    """SDPA of one query row with is_causal and no mask: not the cache's masked attention."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_a_decode_shaped_attention_without_a_mask_stays_and_says_why():
    import minimax_backend.graph_passes as gp

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 1, 16, generator=g) for _ in range(3))
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = gp.compile(_CausalDecode(), codegen="fx", cudagraphs=False)(q, k, v)
    rec = _passes()[0]["decode_attention"]
    assert rec["matches"] == 0 and rec["candidates"] == 1
    assert "is_causal" in rec["skipped"] or "no attention mask" in rec["skipped"]
    assert any("decode_attention" in str(w.message) for w in caught)  # a loud miss
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))


# ------------------------------------------------------------ Triton kernel
@pytest.mark.skipif(INTERPRETING, reason="this is the child")
def test_in_interpreter_child():
    run_this_file_interpreted(__file__)


@in_child
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", [None, 1, 4])
def test_kernel_equals_the_reference(case, dtype, split):
    from minimax_backend.kernels import decode_attention_triton as dt

    *shape, kind, mb = case
    q, k, v, mask = _case(*shape, kind, seed=3, dtype=dtype, mask_batch=mb)
    scale = shape[-1] ** -0.5
    ref = da.decode_attention_reference(q, k, v, mask, scale)
    out = dt.decode_attention(q, k, v, mask, scale, split=split)
    assert out.stride() == ref.stride() and torch.isfinite(out).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@in_child
@pytest.mark.parametrize("split", [1, 4])
def test_kernel_gives_zeros_where_every_key_is_masked(split):
    from minimax_backend.kernels import decode_attention_triton as dt

    q, k, v, mask = _case(2, 8, 2, 1, 100, 16, "bool", seed=4)
    mask[0] = False
    out = dt.decode_attention(q, k, v, mask, 0.25, split=split)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out[1], da.decode_attention_reference(q, k, v, mask, 0.25)[1], rtol=1e-5, atol=1e-5)


@in_child
def test_split_plan_fills_the_gpu_and_keeps_a_tile_per_part():
    from minimax_backend.kernels import decode_attention_triton as dt

    cpu = torch.device("cpu")  # counts as 8 SMs
    assert dt.split_plan(1, 4, 8192, cpu) == 4  # 4 programs -> 16 = 2 x 8
    assert dt.split_plan(64, 4, 8192, cpu) == 1
    assert dt.split_plan(1, 1, 200, cpu, block_n=64) == 4  # four tiles of 64 keys: at most 4 parts
    assert dt.split_plan(1, 1, 200, cpu, block_n=128) == 2


# ------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_gpu_kernel_at_m3_decode_shape(kind):
    """64 query heads, 4 KV heads, head_dim 128, bfloat16, 3 sequences over a 9216-slot cache
    (each at its own position), against the float32 reference at 1e-2 relative norm."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from minimax_backend.kernels import decode_attention_triton as dt

    q, k, v, mask = (t.cuda() for t in _case(3, 64, 4, 1, 9216, 128, kind, seed=5, dtype=torch.bfloat16))
    ref = da.decode_attention_reference(q, k, v, mask, 128 ** -0.5)
    for split in (None, 1, 8):
        out = dt.decode_attention(q, k, v, mask, 128 ** -0.5, split=split)
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err <= 1e-2, (split, err)
    assert torch.equal(torch.ops.minimax.decode_attention(q, k, v, mask, 128 ** -0.5),
                       dt.decode_attention(q, k, v, mask, 128 ** -0.5))
