"""The MiniMax model on one device: compile capture, KV cache, FP8, aux states, MTP,
load plans and the error cases of the parallel layout."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_m2_config, tiny_m3_config

from minimax_backend.model.config_error import ConfigError
from minimax_backend.model.linear import ColumnParallelLinear, Piece, RowParallelLinear, ShardingError
from minimax_backend.model.minimax import MTPModule, build_model, init_random_weights
from minimax_backend.model.parallel import ParallelError, ParallelState
from minimax_backend.model.weights import get_plan

SINGLE = ParallelState.single()


def _model(config=None, dtype=torch.float32, **kw):
    return init_random_weights(build_model(config or tiny_m3_config(), SINGLE, dtype, **kw), seed=3)


def _ids(batch, seq, vocab=512, seed=0):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _pos(batch, start, end):
    return torch.arange(start, end).expand(batch, -1)


# ------------------------------------------------------------------ compile
def test_compile_fullgraph_aot_eager_matches_eager():
    """One graph, no breaks; the compiled MoE (every expert on every token) equals
    the eager MoE (experts on their routed tokens only). No collectives at TP 1."""
    from torch._dynamo.testing import CompileCounterWithBackend

    model = _model()
    ids = _ids(2, 7)
    with torch.no_grad():
        eager = model(ids, _pos(2, 0, 7))
        cnt = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(model, backend=cnt, fullgraph=True)(ids, _pos(2, 0, 7))
    assert cnt.frame_count == 1
    torch.testing.assert_close(compiled, eager, atol=2e-5, rtol=0)
    targets = {str(n.target) for g in cnt.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert not any("c10d" in t for t in targets), "TP 1 must have no collective nodes"
    torch._dynamo.reset()


def test_moe_dense_and_gathered_paths_agree():
    model = _model()
    moe = model.layers[1].block_sparse_moe
    x = torch.randn(13, 256)
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(13)])
    w = torch.rand(13, 2)
    zeros = torch.zeros(13, 256)
    torch.testing.assert_close(moe._experts_dense(x, ids, w, zeros), moe._experts_gathered(x, ids, w, zeros.clone()),
                               atol=1e-5, rtol=0)


# ----------------------------------------------------------------- KV cache
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 0.1)])
def test_prefill_then_decode_equals_full_forward(dtype, atol):
    model = _model(dtype=dtype)
    ids = _ids(2, 9)
    with torch.no_grad():
        full = model(ids, _pos(2, 0, 9)).float()
        model.allocate_kv_cache(batch=2, max_len=32)
        steps = [model(ids[:, :6], _pos(2, 0, 6))]
        steps += [model(ids[:, t:t + 1], _pos(2, t, t + 1)) for t in range(6, 9)]
        model.free_kv_cache()
    torch.testing.assert_close(torch.cat(steps, 1).float(), full, atol=atol, rtol=0.02 if atol > 1e-3 else 0)
    assert all(layer.self_attn.kv_cache is None for layer in model.layers)


def test_decode_rows_at_different_positions():
    """Batched decode where each row is at its own position (static cache, masks per row)."""
    model = _model(tiny_m2_config())
    a, b = _ids(1, 8, seed=1), _ids(1, 5, seed=2)
    with torch.no_grad():
        full_a, full_b = model(a, _pos(1, 0, 8)), model(b, _pos(1, 0, 5))
        model.allocate_kv_cache(batch=2, max_len=16)
        model(torch.cat([a[:, :4], b[:, :4]]), _pos(2, 0, 4))  # prefill 4 tokens of each
        out = model(torch.cat([a[:, 4:5], b[:, 4:5]]), _pos(2, 4, 5))
    torch.testing.assert_close(out[0, 0], full_a[0, 4], atol=2e-5, rtol=0)
    torch.testing.assert_close(out[1, 0], full_b[0, 4], atol=2e-5, rtol=0)
    with torch.no_grad():
        # Row 0 at position 5, row 1 rewrites position 4 (a no-op repeat): independent positions.
        out = model(torch.cat([a[:, 5:6], b[:, 4:5]]), torch.tensor([[5], [4]]))
    torch.testing.assert_close(out[0, 0], full_a[0, 5], atol=2e-5, rtol=0)
    torch.testing.assert_close(out[1, 0], full_b[0, 4], atol=2e-5, rtol=0)


def test_kv_cache_batch_mismatch_is_an_error():
    model = _model()
    model.allocate_kv_cache(batch=2, max_len=8)
    with pytest.raises(ValueError, match="KV cache batch"):
        model(_ids(1, 3), _pos(1, 0, 3))


# ---------------------------------------------------------------------- FP8
# FP8 against a BF16 model holding the FP8 model's own (dequantized) weights, so only the
# activations' 1 x 128 quantization differs: measured 0.041 (relative Frobenius norm of the
# logits) on these well-conditioned random weights (model/random_weights.py); twice that.
FP8_ACTIVATION_NOISE = 0.08


def _dequantize(w, ws):
    """w * its block's scale, written here by index (independent of kernels/fp8.py)."""
    rows = torch.arange(w.shape[0]) // 128
    cols = torch.arange(w.shape[1]) // 128
    return w.float() * ws.float()[rows][:, cols]


def _dequantized_twin(fp8_model):
    from minimax_backend.model.linear import ParallelLinear

    twin = _model(dtype=torch.bfloat16)
    fp8_linears = {n: m for n, m in fp8_model.named_modules() if isinstance(m, ParallelLinear)}
    with torch.no_grad():
        for n, m in twin.named_modules():
            if isinstance(m, ParallelLinear) and fp8_linears[n].fp8:
                src = fp8_linears[n]
                m.weight.copy_(_dequantize(src.weight, src.weight_scale_inv).to(m.weight.dtype))
    return twin


def test_fp8_model_close_to_its_dequantized_twin_and_every_block_scale_matters():
    """Same random weights, quantized to FP8 128 x 128 blocks at load; activations quantized per
    1 x 128 group. The weights' block amplitudes differ up to 4x, so their FP8 scales do: two
    swapped block scales (a kernel or a TP slice reading the wrong block) move the logits by
    several times the activation noise."""
    ids = _ids(1, 11)
    with torch.no_grad():
        fp8_model = _model(dtype=torch.bfloat16, quantize_fp8=True)
        ref = _dequantized_twin(fp8_model)(ids, _pos(1, 0, 11)).float()
        out = fp8_model(ids, _pos(1, 0, 11)).float()
        rel = ((out - ref).norm() / ref.norm()).item()
        assert rel < FP8_ACTIVATION_NOISE, rel
        scales = fp8_model.layers[0].self_attn.o_proj.weight_scale_inv
        flat = scales.view(-1)
        hi, lo = int(flat.argmax()), int(flat.argmin())
        assert flat[hi] / flat[lo] > 2  # the blocks' scales really differ
        flat[hi], flat[lo] = flat[lo].clone(), flat[hi].clone()
        swapped = fp8_model(ids, _pos(1, 0, 11)).float()
    assert ((swapped - ref).norm() / ref.norm()).item() > 2 * FP8_ACTIVATION_NOISE
    fp8_model = _model(dtype=torch.bfloat16, quantize_fp8=True)
    attn = fp8_model.layers[0].self_attn
    assert attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    # q (4 heads x 128) + k + v (2 heads x 128 each) rows, 256 columns, in 128 x 128 blocks
    assert attn.qkv_proj.weight_scale_inv.shape == (1024 // 128, 256 // 128)
    assert get_plan(attn.o_proj.weight_scale_inv).names == ("model.layers.0.self_attn.o_proj.weight_scale_inv",)
    # Router, norms, embedding and lm_head stay unquantized.
    assert fp8_model.layers[1].block_sparse_moe.gate.weight.dtype == torch.float32
    assert fp8_model.lm_head.weight.dtype == torch.bfloat16


def test_fp8_linear_close_to_float_linear():
    torch.manual_seed(0)
    w = torch.randn(384, 256) * 0.05
    x = torch.randn(9, 256)
    lin = ColumnParallelLinear([Piece("p", 384)], 256, dtype=torch.float32, fp8=True)
    lin.set_weight(w)
    assert lin.weight_scale_inv.shape == (3, 2)
    rel = ((lin(x) - x @ w.T).norm() / (x @ w.T).norm()).item()
    assert rel < 0.08, rel


def test_fp8_shard_off_block_boundary_names_the_layer():
    with pytest.raises(ShardingError, match="layers.0.self_attn.q_proj.*block"):
        ColumnParallelLinear([Piece("model.layers.0.self_attn.q_proj", 512, 64, 64)], 256, fp8=True)
    with pytest.raises(ShardingError, match="o_proj.*block"):
        RowParallelLinear("model.layers.0.self_attn.o_proj", 192, 192, 384, 256, fp8=True)
    # A whole model whose expert shards are 64 wide at TP 4 is refused before building.
    cfg = tiny_m3_config(quant_method="fp8")
    with pytest.raises(ConfigError, match="intermediate_size"):
        build_model(cfg, ParallelState(tp_rank=0, tp_size=4, group_name="unused"), torch.bfloat16)


# ------------------------------------------------------------- aux and MTP
def test_logits_to_keep_selects_positions():
    """The last n positions' logits, or those at given indices, equal the full forward's there
    (float32: the lm_head over fewer rows may block its sums differently); bad values are refused."""
    m = _model(tiny_m3_config())
    ids, pos = _ids(2, 9), _pos(2, 0, 9)
    with torch.no_grad():
        full = m(ids, pos)
        scale = full.abs().max()
        for keep, want in ((1, full[:, -1:]), (4, full[:, -4:]), (9, full),
                           (torch.tensor([0, 4, 8]), full[:, [0, 4, 8]])):
            got = m(ids, pos, logits_to_keep=keep)
            assert got.shape == want.shape
            assert ((got - want).abs().max() / scale) < 1e-6, keep
        for bad, match in ((10, "only 9 positions"), (-1, "got -1"), (True, "got True"),
                           (torch.tensor([[1]]), "1-D integer"), (torch.tensor([1.0]), "1-D integer")):
            with pytest.raises(ValueError, match=match):
                m(ids, pos, logits_to_keep=bad)


def test_aux_hidden_states_are_layer_outputs():
    model = _model(tiny_m3_config(aux_hidden_state_layers=(0, 2)))
    ids = _ids(2, 5)
    with torch.no_grad():
        logits, aux = model(ids, _pos(2, 0, 5))
        assert aux.shape == (2, 5, 2, 256)
        # The last layer's output, normed and projected, is the logits.
        again = model.compute_logits(model.norm(aux[:, :, 1].reshape(10, 256))).view(2, 5, -1)
    torch.testing.assert_close(again, logits, atol=1e-5, rtol=0)


def test_mtp_is_separate_from_main_forward(monkeypatch):
    model = _model(tiny_m3_config(aux_hidden_state_layers=(2,)))
    ids = _ids(1, 6)
    with torch.no_grad():
        logits, aux = model(ids, _pos(1, 0, 6))
        mtp_logits, h = model.mtp[0](aux[:, :, 0], _ids(1, 6, seed=5), _pos(1, 0, 6))
    assert mtp_logits.shape == (1, 6, 512) and h.shape == (1, 6, 256)
    assert torch.isfinite(mtp_logits).all()

    def boom(*a, **k):
        raise AssertionError("main forward must not call the MTP module")

    monkeypatch.setattr(MTPModule, "forward", boom)
    with torch.no_grad():
        model(ids, _pos(1, 0, 6))


# -------------------------------------------------------------- load plans
def _plans(model):
    """Every parameter and (persistent: no KV cache allocated) buffer has a plan."""
    out = {}
    for n, t in list(model.named_parameters()) + list(model.named_buffers()):
        plan = get_plan(t)
        assert plan is not None, f"{n} has no load plan"
        out[n] = plan
    return out


def _expected_names_m3(cfg):
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        names |= {f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"}
        names |= {f"{p}.self_attn.{x}.weight" for x in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
        if i in cfg.sparse_attention_layers:
            names |= {f"{p}.self_attn.index_{x}.weight" for x in ("q_proj", "k_proj", "q_norm", "k_norm")}
        if cfg.mlp_layer_types[i] == "dense":
            names |= {f"{p}.mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        else:
            m = f"{p}.block_sparse_moe"
            names |= {f"{m}.gate.weight", f"{m}.e_score_correction_bias"}
            names |= {f"{m}.experts.{e}.{w}.weight" for e in range(cfg.num_local_experts) for w in ("w1", "w2", "w3")}
            if cfg.shared_intermediate_size:
                names |= {f"{m}.shared_experts.{x}_proj.weight" for x in ("gate", "up", "down")}
    return names


def test_load_plans_name_every_checkpoint_tensor():
    cfg = tiny_m3_config(num_mtp_modules=0)
    model = build_model(cfg, SINGLE, torch.bfloat16)
    names = {n for plan in _plans(model).values() for n in plan.names}
    assert names == _expected_names_m3(cfg)
    fp8 = build_model(cfg, SINGLE, torch.bfloat16, quantize_fp8=True)
    fp8_names = {n for plan in _plans(fp8).values() for n in plan.names}
    scales = {n for n in fp8_names if n.endswith("weight_scale_inv")}
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight_scale_inv" in scales
    assert not any("gate.weight_scale_inv" in n or "norm" in n or "lm_head" in n for n in scales)
    # The indexer's projections are FP8 like q/k/v (they share QKV's quantized input and GEMM).
    assert {"model.layers.1.self_attn.index_q_proj.weight_scale_inv",
            "model.layers.1.self_attn.index_k_proj.weight_scale_inv"} <= scales
    tied = build_model(cfg.replace(tie_word_embeddings=True), SINGLE, torch.bfloat16)
    assert get_plan(tied.lm_head.weight).names == ("model.embed_tokens.weight",)


def test_routed_experts_are_stored_stacked_each_expert_from_its_own_tensors():
    """A layer's 8 routed experts are 4 parameters in FP8 (weights + block scales of gate/up and
    down), not 4 per expert: a compiled call's inputs (and its host time) grow with that count.
    Expert i's rows load from experts.i's checkpoint tensors, and expert i alone computes
    what its own weights give."""
    from minimax_backend.model.layers import swiglu_oai

    model = _model(tiny_m3_config(), quantize_fp8=True)
    experts = model.layers[1].block_sparse_moe.experts
    assert len(experts) == 8 and len(list(experts.parameters())) == 4
    pieces = [s.name for s in get_plan(experts.gate_up_proj.weight).pieces]
    assert pieces[6:8] == ["model.layers.1.block_sparse_moe.experts.3.w1.weight",
                           "model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    assert get_plan(experts.down_proj.weight_scale_inv).pieces[3].name.endswith("experts.3.w2.weight_scale_inv")
    w13, w2, s13, s2 = experts.per_expert()
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))

    def by_hand(i):  # expert i from its own weights and scales, as the model quantizes
        xq, xs = torch.ops.minimax.quantize_fp8(x, 128)
        gu = torch.ops.minimax.fp8_block_gemm(xq, xs, w13[i], s13[i], x.dtype)
        gate, up = gu.chunk(2, dim=-1)
        h = swiglu_oai(gate, up, experts.alpha, experts.limit, experts.beta)
        hq, hs = torch.ops.minimax.quantize_fp8(h, 128)
        return torch.ops.minimax.fp8_block_gemm(hq, hs, w2[i], s2[i], x.dtype)

    with torch.no_grad():
        for i in (0, 3, 7):
            torch.testing.assert_close(experts(i, x), by_hand(i), rtol=0, atol=0)
        assert not torch.allclose(experts(3, x), experts(4, x))


def test_mtp_plan_names():
    model = build_model(tiny_m3_config(), SINGLE, torch.bfloat16)
    names = {n for plan in _plans(model).values() for n in plan.names if n.startswith("model.mtp.")}
    for n in ("model.mtp.0.enorm.weight", "model.mtp.0.hnorm.weight", "model.mtp.0.eh_proj.weight",
              "model.mtp.0.shared_head.norm.weight", "model.mtp.0.self_attn.q_proj.weight",
              "model.mtp.0.block_sparse_moe.experts.7.w2.weight"):
        assert n in names


@pytest.mark.parametrize("make,tp,ep", [(tiny_m3_config, 2, 1), (tiny_m3_config, 4, 2), (tiny_m3_config, 4, 4),
                                        (tiny_m2_config, 4, 1), (tiny_m3_config, 2, 2)])
def test_shards_tile_every_checkpoint_tensor(make, tp, ep):
    """Across the ranks of a layout, the plan slices of each checkpoint tensor cover it
    exactly; only replicated tensors (norms, router, replicated KV heads) repeat."""
    cfg = make(num_mtp_modules=0)
    full = {}
    single = build_model(cfg, SINGLE, torch.bfloat16)
    for n, t in list(single.named_parameters()) + list(single.named_buffers()):
        plan = get_plan(t)
        if plan is None:
            continue
        sizes = [t.shape[0]] if len(plan.pieces) == 1 else None
        if sizes is None:  # fused linear at TP 1: one whole piece per checkpoint tensor
            mod = single.get_submodule(n.rsplit(".", 1)[0])
            sizes = [p.size for p in mod.pieces]
        for p, size in zip(plan.pieces, sizes):
            full[p.name] = (size, t.shape[1] if t.dim() == 2 else None)
    cover = {name: [] for name in full}
    for r in range(tp):
        ps = ParallelState.create(r, tp, ep, group_name="unused")
        m = build_model(cfg, ps, torch.bfloat16)
        for n, t in list(m.named_parameters()) + list(m.named_buffers()):
            plan = get_plan(t)
            if plan is not None:
                for p in plan.pieces:
                    cover[p.name].append((p.dim, p.start, p.length))
    for name, slices in cover.items():
        rows, cols = full[name]
        assert slices, f"{name} is on no rank"
        if all(d is None for d, _, _ in slices):
            continue  # replicated whole tensor
        d = slices[0][0]
        extent = rows if d == 0 else cols
        covered = torch.zeros(extent, dtype=torch.int64)
        for dim, start, length in slices:
            assert dim == d, name
            covered[start:start + length] += 1
        assert covered.min() >= 1, f"{name}: part of dim {d} is on no rank"
        replicated_kv = (".k_proj." in name or ".v_proj." in name or ".k_norm." in name) and \
            cfg.num_key_value_heads < tp
        replicated_index = ".index_q_proj." in name and cfg.index_n_heads < tp  # follows the KV rule
        if not (replicated_kv or replicated_index):
            assert covered.max() == 1, f"{name}: a slice is held by two ranks"


# --------------------------------------------------------- parallel errors
def test_parallel_state_errors():
    with pytest.raises(ParallelError, match="tp_rank must be in"):
        ParallelState(tp_rank=2, tp_size=2, group_name="g")
    with pytest.raises(ParallelError, match="ep_size=3 must be >= 1 and divide tp_size=4"):
        ParallelState(tp_rank=0, tp_size=4, ep_size=3, group_name="g")
    with pytest.raises(ParallelError, match="ep_rank=0 does not match tp_rank=3"):
        ParallelState(tp_rank=3, tp_size=4, ep_rank=0, ep_size=2, group_name="g")
    with pytest.raises(ParallelError, match="needs a process group name"):
        ParallelState(tp_rank=0, tp_size=2)
    with pytest.raises(ParallelError, match="tp_size must be >= 1"):
        ParallelState(tp_size=0)
    with pytest.raises(ParallelError, match="not initialized"):
        ParallelState.from_world()
    ps = ParallelState.create(5, 8, 2, "g")
    assert (ps.ep_rank, ps.moe_tp_size, ps.moe_tp_rank) == (1, 4, 1)


def test_layout_the_model_cannot_split_is_an_error():
    with pytest.raises(ConfigError, match="num_local_experts"):
        build_model(tiny_m3_config(num_local_experts=6), ParallelState.create(0, 4, 4, "g"), torch.bfloat16)
    with pytest.raises(ConfigError, match="num_attention_heads"):
        build_model(tiny_m3_config(), ParallelState.create(0, 8, 1, "g"), torch.bfloat16)
