"""Identity pipeline == eager on a tiny tensor-parallel toy, at TP 1 and TP 2 (gloo)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import minimax_backend.graph_passes as gp

HIDDEN, FFN, VOCAB = 32, 64, 50


def _all_reduce(x: torch.Tensor, group_name: str | None) -> torch.Tensor:
    # The model's collective form: functional op + wait (identity at TP 1).
    if group_name is None:
        return x
    return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", group_name))


class ToyTP(torch.nn.Module):
    """Embedding (vocab-sharded) -> norm -> column/row-parallel MLP -> residual
    -> lm head; writes a KV-cache-like buffer. Full weights from a seed, then
    this rank's shard, so every TP size computes the same function."""

    def __init__(self, tp_rank: int = 0, tp_size: int = 1, group_name: str | None = None):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        emb = torch.randn(VOCAB, HIDDEN, generator=g)
        w1 = torch.randn(FFN, HIDDEN, generator=g) / HIDDEN**0.5
        w2 = torch.randn(HIDDEN, FFN, generator=g) / FFN**0.5
        head = torch.randn(VOCAB, HIDDEN, generator=g) / HIDDEN**0.5
        self.norm_w = torch.nn.Parameter(torch.randn(HIDDEN, generator=g) * 0.1)
        v, f = VOCAB // tp_size + (VOCAB % tp_size > 0), FFN // tp_size
        self.v0, self.v1 = tp_rank * v, min(VOCAB, (tp_rank + 1) * v)
        self.emb = torch.nn.Parameter(emb[self.v0 : self.v1].clone())
        self.w1 = torch.nn.Parameter(w1[tp_rank * f : (tp_rank + 1) * f].clone())
        self.w2 = torch.nn.Parameter(w2[:, tp_rank * f : (tp_rank + 1) * f].clone())
        self.head = torch.nn.Parameter(head)
        self.register_buffer("cache", torch.zeros(64, HIDDEN))
        self.group_name = group_name

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        local = ids - self.v0
        mask = (local >= 0) & (local < self.emb.shape[0])
        h = torch.nn.functional.embedding(local.clamp(0, self.emb.shape[0] - 1), self.emb) * mask[..., None]
        h = _all_reduce(h, self.group_name)
        x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + self.norm_w)
        self.cache.index_copy_(0, pos, x)
        y = torch.nn.functional.silu(x @ self.w1.t()) @ self.w2.t()
        h = h + _all_reduce(y, self.group_name)
        return h @ self.head.t()


def _check(model: ToyTP, codegen: str, tokens: int) -> None:
    ref_model = ToyTP()
    ids = torch.randint(0, VOCAB, (tokens,), generator=torch.Generator().manual_seed(tokens))
    pos = torch.arange(tokens)
    with torch.no_grad():
        ref = ref_model(ids, pos)
        out = gp.compile(model, codegen=codegen, strict=True)(ids, pos)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model.cache, ref_model.cache, rtol=1e-4, atol=1e-4)
    rep = gp.last_compile_report()
    assert [p["name"] for p in rep["passes"]] == list(gp.DEFAULT_ORDER)


@pytest.mark.parametrize("codegen", ["fx", "inductor"])
def test_identity_pipeline_tp1(codegen):
    torch._dynamo.reset()
    _check(ToyTP(), codegen, tokens=7)
    assert gp.last_compile_report()["tp_size"] == 1


def _rank_main(rank: int, world: int, codegens: tuple[str, ...]) -> list[dict]:
    reports = []
    for codegen in codegens:  # one launch for both: process start-up dominates
        torch._dynamo.reset()
        _check(ToyTP(rank, world, dist.group.WORLD.group_name), codegen, tokens=7)
        reports.append(gp.last_compile_report())
    return reports


@pytest.mark.slow
def test_identity_pipeline_tp2_fx_and_inductor():
    from multirank import run_multirank

    for rank, reports in enumerate(run_multirank(_rank_main, 2, args=(("fx", "inductor"),))):
        for rep, codegen in zip(reports, ("fx", "inductor")):
            assert (rep["codegen"], rep["tp_size"], rep["world_size"], rep["rank"]) == (codegen, 2, 2, rank)
            assert rep["ops_before"]["_c10d_functional.all_reduce"] == 2
            assert rep["ops_after"]["_c10d_functional.all_reduce"] == 2
