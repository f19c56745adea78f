"""minimax::gemm_rs numerics on gloo at TP 2 and TP 4 (CPU).

Per rank, in one launch per TP size (process start-up dominates):
* the op equals its definition computed independently in float64 (every
  rank's x @ w.T summed, this rank's rows), for BF16-style and FP8 GEMMs,
  with and without bias, odd token counts, both sides of the threshold;
* a small tensor-parallel model (vocab-parallel embedding, an attention-like
  block whose o_proj is FP8 or not, a dense MLP) compiled with sequence
  parallelism + GEMM-RS equals eager at 7 and 37 tokens, and (TP 2) equals
  the same compile without GEMM-RS exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

HIDDEN, FFN, VOCAB = 128, 512, 48
c10d = torch.ops._c10d_functional


def _all_reduce(x, group):
    return c10d.wait_tensor(c10d.all_reduce(x, "sum", group))


class ToySP(torch.nn.Module):
    """Full weights from a seed, then this rank's shard (same function at every TP size)."""

    def __init__(self, rank: int, world: int, group: str, fp8_o_proj: bool):
        super().__init__()
        from minimax_backend.kernels.fp8 import quantize_weight_fp8

        g = torch.Generator().manual_seed(0)
        emb = torch.randn(VOCAB, HIDDEN, generator=g)
        w_v = torch.randn(FFN, HIDDEN, generator=g) / HIDDEN**0.5
        w_o = torch.randn(HIDDEN, FFN, generator=g) / FFN**0.5
        w_up = torch.randn(FFN, HIDDEN, generator=g) / HIDDEN**0.5
        w_down = torch.randn(HIDDEN, FFN, generator=g) / FFN**0.5
        self.head = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=g) / HIDDEN**0.5)
        self.n1 = torch.nn.Parameter(torch.randn(HIDDEN, generator=g) * 0.1)
        self.n2 = torch.nn.Parameter(torch.randn(HIDDEN, generator=g) * 0.1)
        v, f = VOCAB // world, FFN // world
        self.v0 = rank * v
        cols = slice(rank * f, (rank + 1) * f)
        self.emb = torch.nn.Parameter(emb[self.v0:self.v0 + v].clone())
        self.w_v = torch.nn.Parameter(w_v[cols].clone())
        self.w_up = torch.nn.Parameter(w_up[cols].clone())
        self.w_down = torch.nn.Parameter(w_down[:, cols].clone())
        self.fp8 = fp8_o_proj
        if fp8_o_proj:  # f is a multiple of 128 at TP 2 and 4: block-aligned shards
            q, s = quantize_weight_fp8(w_o)
            self.register_buffer("w_o", q[:, cols].contiguous())
            self.register_buffer("w_o_scale", s[:, rank * f // 128:(rank + 1) * f // 128].contiguous())
        else:
            self.w_o = torch.nn.Parameter(w_o[:, cols].clone())
        self.group = group

    @staticmethod
    def norm(h, w):
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w)

    def forward(self, ids):
        local = ids - self.v0
        inside = (local >= 0) & (local < self.emb.shape[0])
        h = _all_reduce(F.embedding(local.clamp(0, self.emb.shape[0] - 1), self.emb) * inside[:, None], self.group)
        v = F.linear(self.norm(h, self.n1), self.w_v)
        if self.fp8:
            q, s = torch.ops.minimax.quantize_fp8(v, 128)
            o = torch.ops.minimax.fp8_block_gemm(q, s, self.w_o, self.w_o_scale, v.dtype)
        else:
            o = F.linear(v, self.w_o)
        h = h + _all_reduce(o, self.group)
        h = h + _all_reduce(F.linear(F.silu(F.linear(self.norm(h, self.n2), self.w_up)), self.w_down), self.group)
        return h @ self.head.t()


def _rank_inputs(r: int, tokens: int):
    """Rank r's GEMM inputs (every rank can rebuild every other rank's)."""
    from minimax_backend.kernels.fp8 import quantize_weight_fp8

    g = torch.Generator().manual_seed(100 * r + tokens)
    x = torch.randn(tokens, 256, generator=g)
    w = torch.randn(64, 256, generator=g)
    bias = torch.randn(64, generator=g)
    wq, ws = quantize_weight_fp8(torch.randn(256, 256, generator=g))
    xq, xs = torch.ops.minimax.quantize_fp8(x, 128)
    return x, w, bias, wq, ws, xq, xs


def _dequantized(q, s, rows_per_scale):
    """float64 q * scale, the scale of each element found by index (1 x 128 or 128 x 128 blocks)."""
    r = torch.arange(q.shape[0]) // rows_per_scale
    c = torch.arange(q.shape[1]) // 128
    return q.double() * s.double()[r][:, c]


def _op_equals_reference(rank: int, world: int, group: str) -> int:
    """The op against its definition, computed here without it: this rank's rows of the sum over
    ranks of each rank's x @ w.T (+ bias), in float64 from every rank's inputs (float32 rounding
    apart: 1e-5 relative)."""
    checked = 0
    for tokens in (7, 37):
        padded = -(-tokens // world) * world
        rows = slice(rank * padded // world, (rank + 1) * padded // world)
        per_rank = [_rank_inputs(r, tokens) for r in range(world)]
        x, w, bias, wq, ws, xq, xs = per_rank[rank]
        total = {"bf16": 0, "bias": 0, "fp8": 0}
        for xr, wr, br, wqr, wsr, xqr, xsr in per_rank:
            total["bf16"] = total["bf16"] + xr.double() @ wr.double().T
            total["bias"] = total["bias"] + xr.double() @ wr.double().T + br.double()
            total["fp8"] = total["fp8"] + _dequantized(xqr, xsr, 1) @ _dequantized(wqr, wsr, 128).T
        cases = {"bf16": (x, w, None, None, None, None), "bias": (x, w, None, None, bias, None),
                 "fp8": (xq, wq, xs, ws, None, torch.float32)}
        for name, (a, b, a_s, b_s, bi, dt) in cases.items():
            want = torch.nn.functional.pad(total[name], (0, 0, 0, padded - tokens))[rows]
            for min_tokens in (0, 1 << 30):  # both sides of the threshold (the same path on CPU)
                got = torch.ops.minimax.gemm_rs(a, b, a_s, b_s, bi, padded - tokens, min_tokens, world, group,
                                                out_dtype=dt)
                assert got.shape == want.shape, (name, got.shape, want.shape)
                err = ((got.double() - want).abs().max() / want.abs().max()).item()
                assert err <= 1e-5, (name, tokens, min_tokens, err)
                checked += 1
    return checked


# (fp8 o_proj, tokens, also compile with GEMM-RS off and compare bit for bit)
CASES = {2: ((False, 7, True), (True, 37, True)), 4: ((True, 37, False),)}


def _compiled_equals_eager(rank: int, world: int, group: str) -> list[dict]:
    import minimax_backend.graph_passes as gp

    base = dict(codegen="fx", strict=True, sequence_parallel="on", moe_canonicalize="off",
                fuse_norm_quant="off", moe_lower="off", gemm_rs_min_tokens=16)
    out = []
    for fp8, tokens, against_off in CASES[world]:
        model = ToySP(rank, world, group, fp8)
        ids = torch.randint(0, VOCAB, (tokens,), generator=torch.Generator().manual_seed(tokens))
        with torch.no_grad():
            eager = model(ids)
            results = {}
            for mode in ("on", "off") if against_off else ("on",):
                torch._dynamo.reset()
                results[mode] = gp.compile(model, gemm_reduce_scatter=mode, **base)(ids)
                if mode == "on":
                    rep = gp.last_compile_report()
        torch._dynamo.reset()
        torch.testing.assert_close(results["on"], eager, rtol=1e-5, atol=1e-5)
        if against_off:  # the fused op returns exactly what the graph's reduce-scatter did
            assert torch.equal(results["on"], results["off"]), (results["on"] - results["off"]).abs().max()
        record = next(p for p in rep["passes"] if p["name"] == "gemm_reduce_scatter")
        out.append({"tokens": tokens, "fp8": fp8, "ops_after": rep["ops_after"], "breakdown": record["breakdown"]})
    return out


def _rank_main(rank: int, world: int):
    import minimax_backend.kernels  # noqa: F401

    group = dist.group.WORLD.group_name
    return {"op_checks": _op_equals_reference(rank, world, group), "models": _compiled_equals_eager(rank, world, group)}


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_gemm_rs_on_gloo(world):
    from multirank import run_multirank

    for result in run_multirank(_rank_main, world, timeout=300):
        assert result["op_checks"] == 2 * 3 * 2
        assert len(result["models"]) == len(CASES[world])
        for m in result["models"]:
            # o_proj and the MLP's down_proj; the embedding's reduce-scatter stays
            assert m["ops_after"]["minimax.gemm_rs"] == 2, m
            assert m["ops_after"]["_c10d_functional.reduce_scatter_tensor"] == 1, m
            assert m["breakdown"] == {"bf16": 1 + (not m["fp8"]), "fp8": int(m["fp8"]), "fp8_prequantized": 0}, m
