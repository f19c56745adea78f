"""moe_canonicalize and moe_lower on the tiny models' ATen graphs (one process).

TP 2 graphs are traced on a fake process group (rank 0 of 2): shapes and
collectives are real, values are not, so these tests count ops and read the
new nodes' arguments; numerics are in test_moe_numerics.py (gloo) and, at
TP 1, here. Each test model has two MoE layers, so "one per MoE layer" is 2.

A graph is captured once per model (compiling costs seconds); the passes
are then run by hand on copies of it, which is also how the mismatch tests
break one detail of an otherwise real graph.
"""

from __future__ import annotations

import contextlib
import operator

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx

import minimax_backend.graph_passes as gp
from pass_harness import run_pass
from conftest import tiny_m2_config, tiny_m3_config
from minimax_backend.graph_passes import backend as backend_mod
from minimax_backend.graph_passes.base import PassContext, PassError, PassWarning
from minimax_backend.graph_passes.config import BackendConfig
from minimax_backend.graph_passes.manager import PassManager
from minimax_backend.graph_passes.moe_canonicalize import MoECanonicalizePass
from minimax_backend.graph_passes.moe_lower import MoELowerPass
from minimax_backend.graph_passes.op_counts import op_counts
from minimax_backend.graph_passes.sequence_parallel import SequenceParallelPass
from minimax_backend.patterns.fx import set_fake_val

MOE, MEGA = "minimax.moe", "minimax.mega_moe"
AG = "_c10d_functional.all_gather_into_tensor"
AR = "_c10d_functional.all_reduce"
RS = "_c10d_functional.reduce_scatter_tensor"
LOOP_OPS = ("aten.topk", "aten.eq", "aten.gather", "aten.sigmoid", "aten.clamp_max", "aten.clamp_min")
OFF = {"sequence_parallel": "off", "fuse_norm_quant": "off", "gemm_reduce_scatter": "off", "moe_lower": "off"}
TWO_MOE = dict(num_hidden_layers=2, mlp_layer_types=("moe", "moe"), sparse_attention_layers=(), num_mtp_modules=0)




@contextlib.contextmanager
def _capture_aten():
    """Record the ATen graph the backend hands to code generation."""
    graphs = []
    generate = backend_mod.generate

    def spy(gm, example_inputs, config):
        graphs.append(gm)
        return generate(gm, example_inputs, config)

    backend_mod.generate = spy
    try:
        yield graphs
    finally:
        backend_mod.generate = generate


def _model(cfg, tp=1, ep=1, dtype=torch.float32, fp8=False):
    from minimax_backend.model.minimax import build_model, init_random_weights
    from minimax_backend.model.parallel import ParallelState

    ps = ParallelState.create(0, tp, ep, dist.group.WORLD.group_name) if tp > 1 else None
    return init_random_weights(build_model(cfg, ps, dtype=dtype, quantize_fp8=fp8), seed=0)


def _compile(model, tokens=7, **options):
    torch._dynamo.reset()
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    pos = torch.arange(tokens)[None]
    with _capture_aten() as graphs, torch.no_grad():
        out = torch.compile(model, backend="minimax", fullgraph=True, dynamic=False,
                            options={"codegen": "fx", "sequence_parallel_min_tokens": 0, **options})(ids, pos)
    return graphs[-1], gp.last_compile_report(), out, (ids, pos)


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    g = fx.Graph()
    g.output(g.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, g)


def _nodes(gm, name):
    from minimax_backend.patterns.fx import op_name

    return [n for n in gm.graph.nodes if op_name(n) == name]


def _run(pass_cls, gm, **config):
    return run_pass(pass_cls.name, gm, **config)


def _mega_flags(node):
    # (..., group_name, group_size, input_sharded, output_sharded, num_tokens, dispatch)
    return tuple(node.args[-6:])


# ----------------------------------------------------------------- TP 1
def test_tp1_one_fused_op_per_moe_layer_equals_eager():
    model = _model(tiny_m3_config(**TWO_MOE))
    dumps = []

    def spy(out_dir, title):  # op counts after every pass
        from minimax_backend.graph_passes.manager import make_dumper

        dumps.append(make_dumper(out_dir, title))
        return dumps[-1]

    saved, backend_mod.make_dumper = backend_mod.make_dumper, spy
    try:
        gm, report, out, inputs = _compile(model, strict=True)
    finally:
        backend_mod.make_dumper = saved
    with torch.no_grad():
        torch.testing.assert_close(out, model(*inputs), rtol=0, atol=0)  # float32, same ops, same order
    stages = dict(dumps[0].stages)
    before, canon, after = report["ops_before"], stages["moe_canonicalize"], report["ops_after"]
    assert before["aten.topk"] == 2 and canon[MOE] == 2
    assert not any(op in canon for op in LOOP_OPS)
    # per layer: router 1 + 8 experts x (gate_up, down) + shared (gate_up, down) = 19 mm gone
    assert before["aten.mm"] - canon["aten.mm"] == 2 * 19
    assert after[MEGA] == 2 and MOE not in after
    (mega,) = {_mega_flags(n) for n in _nodes(gm, MEGA)}
    assert mega == ("", 1, False, False, 7, "allgather")
    passes = {p["name"]: p for p in report["passes"]}
    assert passes["moe_canonicalize"]["breakdown"] == {"shared": 2}
    assert passes["moe_lower"]["breakdown"] == {"single device": 2}
    assert any("experts 0..7 of 8, top-2, swigluoai" in d for d in passes["moe_canonicalize"]["details"])


def test_tp1_block_without_bias_renorm_or_shared_expert():
    """The optional steps: no correction bias, no renormalization, scaling 1.5, M2-style block."""
    cfg = tiny_m2_config(use_routing_bias=False, norm_topk_prob=False, routed_scaling_factor=1.5)
    model = _model(cfg)
    gm, report, out, inputs = _compile(model, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(out, model(*inputs), rtol=0, atol=0)
    assert report["ops_after"][MEGA] == 2
    passes = {p["name"]: p for p in report["passes"]}
    assert all("silu, scaling 1.5, not renormalized, unbiased choice, no shared expert" in d
               for d in passes["moe_canonicalize"]["details"])


# ------------------------------------------------------------------ TP 2
@pytest.fixture(scope="module")
def m3_tp2(fake_tp2):
    """tiny-m3 (2 MoE layers) at TP 2 / EP 2, bf16, 7 tokens, after cleanup + moe_canonicalize."""
    gm, report, _, _ = _compile(_model(tiny_m3_config(**TWO_MOE), 2, 2, torch.bfloat16), **OFF)
    return gm, report


def test_tp2_canonical_form_keeps_the_all_reduce(m3_tp2):
    gm, report = m3_tp2
    before, after = report["ops_before"], report["ops_after"]
    assert after[MOE] == 2 and not any(op in after for op in LOOP_OPS)
    assert after[AR] == before[AR]  # the block's all-reduce stays for the sequence-parallel pass
    for moe in _nodes(gm, MOE):
        (user,) = moe.users
        assert user.target is torch.ops._c10d_functional.all_reduce.default
        # 4 local experts of 8 from 0 (rank 0 of EP 2), constants read from the graph
        assert len(moe.args[3]) == 4 and moe.args[11:16] == (2, 2.0, True, 0, "swigluoai")
        assert moe.args[16:19] == (1.702, 7.0, 1.0)


def test_tp2_without_sequence_parallelism_lowers_moe_plus_all_reduce(m3_tp2):
    gm = _copy(m3_tp2[0])
    ar = op_counts(gm)[AR]
    res = _run(MoELowerPass, gm)
    counts = op_counts(gm)
    assert res.matches == 2 and res.breakdown == {"replicated": 2}
    assert counts[MEGA] == 2 and MOE not in counts and counts[AR] == ar - 2
    for node in _nodes(gm, MEGA):
        assert _mega_flags(node)[1:] == (2, False, False, 7, "allgather")
        assert tuple(node.meta["val"].shape) == (7, 256)


def test_tp2_sequence_parallel_lowering_takes_the_shard(m3_tp2):
    gm = _copy(m3_tp2[0])
    sp = _run(SequenceParallelPass, gm, sequence_parallel="on")
    assert sp.matches == 5  # embedding + 2 x (o_proj, MoE)
    mid = op_counts(gm)
    assert mid[AG] == 2 + 2 + 1 + 1 and mid[RS] == 5  # attention + MoE inputs, end, logits
    res = _run(MoELowerPass, gm)
    counts = op_counts(gm)
    assert res.matches == 2 and res.breakdown == {"sp": 2}
    # The MoE's gather, row slice, pad and reduce-scatter are gone: 2 fewer each.
    assert counts[MEGA] == 2 and counts[AG] == mid[AG] - 2 and counts[RS] == mid[RS] - 2
    assert counts["aten.constant_pad_nd"] == mid["aten.constant_pad_nd"] - 2
    for node in _nodes(gm, MEGA):
        assert _mega_flags(node)[1:] == (2, True, True, 7, "allgather")
        x = node.args[0]
        assert tuple(x.meta["val"].shape) == (4, 256)  # 7 tokens padded to 8, 4 rows on this rank
        assert x.target is not torch.ops._c10d_functional.wait_tensor.default
        assert tuple(node.meta["val"].shape) == (4, 256)
        (user,) = node.users
        assert user.target is torch.ops.aten.add.Tensor  # straight into the sharded residual add


def test_tp2_fp8_experts(fake_tp2):
    gm, report, _, _ = _compile(_model(tiny_m3_config(**TWO_MOE), 2, 2, torch.bfloat16, fp8=True), **OFF)
    before, after = report["ops_before"], report["ops_after"]
    assert after[MOE] == 2 and not any(op in after for op in LOOP_OPS)
    # per layer: 4 local experts x 2 + shared 2 block GEMMs and their quantizations
    assert before["minimax.fp8_block_gemm"] - after["minimax.fp8_block_gemm"] == 2 * 10
    assert before["minimax.quantize_fp8"] - after["minimax.quantize_fp8"] == 2 * 10
    for moe in _nodes(gm, MOE):
        assert len(moe.args[5]) == len(moe.args[6]) == 4  # block scales of w13 and w2
        assert moe.args[9] is not None and moe.args[19] == 128
    _run(SequenceParallelPass, gm, sequence_parallel="on")
    assert _run(MoELowerPass, gm).breakdown == {"sp": 2}


def test_tp2_m2_routed_only_uses_all_to_all(fake_tp2):
    gm, report, _, _ = _compile(_model(tiny_m2_config(), 2, 2, torch.bfloat16), **OFF)
    passes = {p["name"]: p for p in report["passes"]}
    assert passes["moe_canonicalize"]["breakdown"] == {"routed only": 2}
    for moe in _nodes(gm, MOE):
        assert moe.args[7] is None and moe.args[15] == "silu" and moe.args[12] == 1.0
    _run(SequenceParallelPass, gm, sequence_parallel="on")
    _run(MoELowerPass, gm)
    assert {_mega_flags(n)[-1] for n in _nodes(gm, MEGA)} == {"alltoall"}


def test_full_pipeline_tp2_sequence_parallel(fake_tp2):
    """The `tiny-m3` preset (1 dense + 2 MoE layers) through the default pipeline
    (every pass auto, EP 2): SP on, one mega_moe per MoE layer, nothing of the loop left."""
    from minimax_backend.model.presets import load_preset

    gm, report, out, _ = _compile(_model(load_preset("tiny-m3"), 2, 2, torch.bfloat16), ep_size=2, strict=True)
    after = report["ops_after"]
    assert after[MEGA] == 2 and MOE not in after and AR not in after
    # (the dense layer keeps its own SwiGLU-OAI clamps and sigmoid)
    assert not any(op in after for op in ("aten.topk", "aten.eq", "aten.gather"))
    assert {_mega_flags(n)[2:4] for n in _nodes(gm, MEGA)} == {(True, True)}
    assert out.shape == (1, 7, 512)


# ------------------------------------------------------------- mismatches
@pytest.fixture(scope="module")
def one_block():
    """A 1-MoE-layer tiny-m3 at TP 1 (float32), captured before any MoE pass."""
    cfg = tiny_m3_config(num_hidden_layers=1, mlp_layer_types=("moe",), sparse_attention_layers=(), num_mtp_modules=0)
    gm, _, _, _ = _compile(_model(cfg), moe_canonicalize="off", **OFF)
    return gm


def _find(gm, name, pred=lambda n: True):
    return [n for n in _nodes(gm, name) if pred(n)]


def _escape(gm, node):
    """Make `node` feed the graph output too (out = out + sum(node))."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    first = out.args[0][0]
    with gm.graph.inserting_before(out):
        s = gm.graph.call_function(torch.ops.aten.sum.default, (node,))
        set_fake_val(s)
        new = gm.graph.call_function(torch.ops.aten.add.Tensor, (first, s))
        set_fake_val(new)
    out.args = ((new, *out.args[0][1:]),)


def _mutations():
    def gate_limit(gm):  # one expert's gate clamp differs from its up clamp
        n = _find(gm, "aten.clamp_max", lambda n: n.args[0].target is operator.getitem)[0]
        n.args = (n.args[0], 6.0)

    def expert_ids(gm):  # the masks compare with experts 0, 1, 3, ...
        n = _find(gm, "aten.eq")[2]
        n.args = (n.args[0], 5)

    def biased_weights(gm):  # weights gathered from score + bias
        g = _find(gm, "aten.gather")[0]
        g.args = (_find(gm, "aten.topk")[0].args[0], *g.args[1:])

    def smallest(gm):  # top-k of the smallest scores
        t = _find(gm, "aten.topk")[0]
        t.args = (*t.args[:3], False, *t.args[4:])

    def escaping(gm):  # an expert's routing weight is also used after the block
        _escape(gm, _find(gm, "aten.unsqueeze", lambda n: n.args[0].target is torch.ops.aten.sum.dim_IntList)[0])

    def scale_before_norm(gm):  # the renormalization reads the scaled weights: not the eager order
        div = _find(gm, "aten.div", lambda n: n.args[0].target is torch.ops.aten.gather.default)[0]
        s = div.args[1]
        s.args = (s.args[0],) + (s.args[1], False)

    return {
        "gate_limit": (gate_limit, "gate clamp (max 6.0) differs from the up clamp (7.0)"),
        "expert_ids": (expert_ids, "are not consecutive ids"),
        "biased_weights": (biased_weights, "not gathered from the unbiased sigmoid scores"),
        "smallest": (smallest, "not the largest over experts"),
        "escaping": (escaping, "is used outside the MoE block"),
        "scale_before_norm": (scale_before_norm, "renormalization is not w / w.sum(-1, keepdim=True)"),
    }


@pytest.mark.parametrize("name", list(_mutations()))
def test_mismatch_is_left_alone_and_says_why(one_block, name):
    mutate, reason = _mutations()[name]
    gm = _copy(one_block)
    mutate(gm)
    gm.recompile()
    before = op_counts(gm)
    res = _run(MoECanonicalizePass, gm)
    assert res.matches == 0 and reason in res.skipped, res.skipped
    assert op_counts(gm) == before  # untouched
    # auto mode: a candidate that did not match is a miss; strict makes it an error
    strict = BackendConfig(strict=True)
    with pytest.raises(PassError, match="moe_canonicalize is enabled by its auto rule"):
        PassManager(strict, order=("moe_canonicalize",)).run(gm, PassContext.from_graph(strict, gm))
    with pytest.warns(PassWarning, match=reason.split("(")[0][:30]):
        PassManager(BackendConfig(), order=("moe_canonicalize",)).run(gm, PassContext.from_graph(BackendConfig(), gm))


def test_unmutated_copy_matches(one_block):
    gm = _copy(one_block)
    res = _run(MoECanonicalizePass, gm)
    assert res.matches == 1 and res.skipped is None
    assert op_counts(gm)[MOE] == 1


def test_lowering_leaves_a_moe_without_its_collective(m3_tp2):
    gm = _copy(m3_tp2[0])
    moe = _nodes(gm, MOE)[0]
    (ar,) = moe.users
    (wait,) = ar.users
    wait.replace_all_uses_with(moe)  # as if the block's all-reduce had been dropped
    gm.graph.erase_node(wait)
    gm.graph.erase_node(ar)
    with pytest.warns(PassWarning, match="rewrote 1 of 2"):
        res = _run(MoELowerPass, gm)
    assert res.matches == 1 and "does not go to an all-reduce or reduce-scatter" in res.skipped
    assert op_counts(gm)[MOE] == 1 and op_counts(gm)[MEGA] == 1


def test_graph_without_moe_is_not_a_miss():
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda x, w: torch.relu(x @ w), tracing_mode="fake")(torch.randn(4, 8), torch.randn(8, 8))
    strict = BackendConfig(strict=True)
    results = PassManager(strict, order=("moe_canonicalize", "moe_lower")).run(gm, PassContext(config=strict))
    assert [(r.matches, r.enabled) for r in results] == [(0, True), (0, True)]
    assert "no MoE block" in results[0].skipped
    forced = BackendConfig(strict=True, moe_canonicalize="on")
    with pytest.raises(PassError, match="forced on"):
        PassManager(forced, order=("moe_canonicalize",)).run(gm, PassContext(config=forced))


def test_a_row_block_of_a_parameter_is_a_weight_other_slices_are_not():
    """Stacked experts reach the linear pattern as slices of one parameter along dim 0;
    a column slice, a strided slice or a computed tensor is not a weight."""
    import torch.fx as fx

    from minimax_backend.patterns.fx import is_weight

    g = fx.Graph()
    w = g.placeholder("w")
    rows = g.call_function(torch.ops.aten.slice.Tensor, (w, 0, 256, 512))
    cols = g.call_function(torch.ops.aten.slice.Tensor, (w, 1, 0, 128))
    strided = g.call_function(torch.ops.aten.slice.Tensor, (w, 0, 0, 512, 2))
    computed = g.call_function(torch.ops.aten.slice.Tensor, (g.call_function(torch.ops.aten.neg.default, (w,)), 0, 0, 8))
    assert is_weight(w) and is_weight(rows)
    assert not is_weight(cols) and not is_weight(strided) and not is_weight(computed)
