"""The pass frame end to end at TP 1: logging, report, strict mode, dumps."""

from __future__ import annotations

import logging

import pytest
import torch

import minimax_backend.graph_passes as gp
from minimax_backend.graph_passes import backend as backend_mod
from minimax_backend.graph_passes import manager as manager_mod
from minimax_backend.graph_passes.base import GraphPass, PassError, PassWarning
from minimax_backend.patterns.fx import is_op


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)
        self.register_buffer("cache", torch.zeros(16, 8))

    def forward(self, x, pos):
        self.cache.index_copy_(0, pos, x)  # an input mutation, as the KV cache does
        return self.down(torch.relu(self.up(x))).view(-1) + self.cache.sum()


def _inputs(t=5):
    return torch.randn(t, 8), torch.arange(t)


@pytest.fixture
def registry():
    """Dummy passes registered by a test are removed afterwards."""
    saved = dict(manager_mod._REGISTRY)
    yield manager_mod._REGISTRY
    manager_mod._REGISTRY.clear()
    manager_mod._REGISTRY.update(saved)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _pass_error(e: BaseException) -> PassError | None:
    # Dynamo wraps backend errors in BackendCompilerFailed (.inner_exception)
    while e is not None and not isinstance(e, PassError):
        e = getattr(e, "inner_exception", None) or e.__cause__
    return e


def _register(registry, name, **attrs):
    cls = type(f"Dummy_{name}", (GraphPass,), {"name": name, **attrs})
    gp.register_pass(cls, replace=True)
    return cls


def _count_mm(self, gm, ctx):
    n = sum(is_op(node, "aten.mm", "aten.addmm") for node in gm.graph.nodes)
    return self.result(matches=n, breakdown={"mm": n})


def test_identity_equals_eager_and_logs_one_line_per_pass(caplog):
    m = Mlp()
    x, pos = _inputs()
    ref = m(x, pos)
    ref_cache = m.cache.clone()
    m.cache.zero_()
    with caplog.at_level(logging.INFO, logger="minimax"):
        out = gp.compile(m, codegen="fx")(x, pos)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(m.cache, ref_cache)  # the buffer write survived AOT + passes
    assert not out.requires_grad  # inference only, though the parameters require grad
    lines = [r.getMessage() for r in caplog.records if r.name == "minimax"]
    summaries = [l for l in lines if l.startswith("minimax: ") and (" matched " in l or " skipped" in l)]
    assert [l.split()[1] for l in summaries] == list(gp.DEFAULT_ORDER)
    assert summaries[0].startswith("minimax: cleanup matched ")


def test_report(registry):
    _register(registry, "gemm_reduce_scatter", apply=_count_mm)
    _register(registry, "moe_lower", apply=_count_mm)
    captured = []

    def capture(gm, example_inputs, **kw):  # see the Dynamo graph the backend got
        captured.append(gm)
        return gp.minimax_backend(gm, example_inputs, **kw)

    cfg = gp.BackendConfig(codegen="fx", gemm_reduce_scatter="on", moe_lower="off")
    torch.compile(Mlp(), backend=capture, options=cfg)(*_inputs())
    rep = gp.last_compile_report()
    assert captured[0].meta["minimax_report"]["index"] == rep["index"]
    assert {"passes", "ops_before", "ops_after", "dump_dir", "config_hash", "timings_s"} <= set(rep)
    by_name = {p["name"]: p for p in rep["passes"]}
    assert by_name["gemm_reduce_scatter"]["matches"] == 2
    assert by_name["gemm_reduce_scatter"]["breakdown"] == {"mm": 2}
    assert by_name["moe_lower"]["enabled"] is False
    assert by_name["moe_lower"]["skipped"] == "off in config (moe_lower='off')"
    assert rep["ops_before"]["aten.addmm"] == 2 and rep["ops_after"]["aten.addmm"] == 2
    assert rep["dump_dir"] is None and rep["config"]["codegen"] == "fx"
    assert rep["config_hash"] == cfg.stable_hash()
    assert rep["tp_size"] == 1 and rep["rank"] == 0
    # the kernel switches are in the report and in the compile-cache key
    from minimax_backend.kernels.options import KernelOptions, override_kernel_options

    assert rep["kernel_options"] == KernelOptions().to_dict()
    before = gp.PassManager(cfg).stable_hash()
    with override_kernel_options(moe_kernel="reference"):
        assert gp.PassManager(cfg).stable_hash() != before


def test_strict_mode_error_on_a_pass_that_matches_nothing(registry):
    _register(registry, "moe_canonicalize", apply=lambda self, gm, ctx: self.result(matches=0, skipped="no MoE block found"))
    f = gp.compile(Mlp(), codegen="fx", moe_canonicalize="on", strict=True)
    with pytest.raises(Exception) as e:
        f(*_inputs())
    err = _pass_error(e.value)
    assert "moe_canonicalize" in str(err) and "no MoE block found" in str(err) and "matched nothing" in str(err)


def test_non_strict_warns_and_still_runs(registry, caplog):
    _register(registry, "moe_canonicalize", apply=lambda self, gm, ctx: self.result(matches=0))
    m = Mlp()
    x, pos = _inputs()
    ref = m(x, pos)
    with caplog.at_level(logging.WARNING, logger="minimax"), pytest.warns(PassWarning, match="moe_canonicalize"):
        out = gp.compile(m, codegen="fx", moe_canonicalize="on")(x, pos)
    torch.testing.assert_close(out, ref)
    assert any("moe_canonicalize" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_auto_rule_reason_is_recorded(registry, caplog):
    _register(registry, "moe_lower", auto_rule=lambda self, gm, ctx: "needs expert parallelism", apply=_count_mm)
    with caplog.at_level(logging.INFO, logger="minimax"):
        gp.compile(Mlp(), codegen="fx", strict=True)(*_inputs())
    rec = {p["name"]: p for p in gp.last_compile_report()["passes"]}["moe_lower"]
    assert (rec["enabled"], rec["skipped"]) == (False, "auto: needs expert parallelism")
    assert "minimax: moe_lower skipped: auto: needs expert parallelism" in caplog.text


def test_matching_pass_logs_breakdown(registry, caplog):
    _register(registry, "gemm_reduce_scatter", apply=_count_mm)
    with caplog.at_level(logging.INFO, logger="minimax"):
        gp.compile(Mlp(), codegen="fx", gemm_reduce_scatter="on", strict=True)(*_inputs())
    assert "minimax: gemm_reduce_scatter matched 2 (mm 2)" in caplog.text


def test_pass_failures_are_pass_errors(registry):
    def boom(self, gm, ctx):
        raise KeyError("oops")

    def no_meta(self, gm, ctx):  # adds a node without meta["val"]
        ph = next(iter(gm.graph.nodes))
        with gm.graph.inserting_after(ph):
            gm.graph.call_function(torch.ops.aten.neg.default, (ph,))
        return self.result(matches=1, graph_changed=True)

    for apply, msg in ((boom, "pass moe_lower failed: KeyError"), (no_meta, "without meta")):
        _register(registry, "moe_lower", apply=apply)
        torch._dynamo.reset()
        with pytest.raises(Exception) as e:
            gp.compile(Mlp(), codegen="fx", moe_lower="on")(*_inputs())
        assert msg in str(_pass_error(e.value))


def test_dump_stages(monkeypatch, tmp_path):
    dumpers = []

    def spy(out_dir, title):
        d = manager_mod.make_dumper(out_dir, title)
        dumpers.append(d)
        return d

    monkeypatch.setattr(backend_mod, "make_dumper", spy)
    gp.compile(Mlp(), codegen="fx", dump_dir=str(tmp_path))(*_inputs())
    stages = [s for s, _ in dumpers[0].stages]
    enabled = [p["name"] for p in gp.last_compile_report()["passes"] if p["enabled"]]
    assert stages[0] == "captured" and stages[-1] == "final"
    assert [s.split("_2")[0] for s in stages[1:-1]] == enabled
    assert dict(dumpers[0].stages)["final"] == gp.last_compile_report()["ops_after"]
    rep = gp.last_compile_report()
    assert rep["dump_dir"].startswith(str(tmp_path))
    if rep["dump_index"]:  # H4's dumper writes an HTML index
        assert (tmp_path / rep["dump_index"]).exists()


@pytest.mark.parametrize("dynamic, compiles", [(False, (3, 3)), (None, (1, 2))])
def test_recompile_for_a_new_token_count_adds_a_report(dynamic, compiles):
    torch._dynamo.reset()
    m = Mlp()
    f = gp.compile(m, codegen="fx", dynamic=dynamic)  # gp.compile's default: static, one compile per size
    n0 = len(gp.compile_reports())
    for t in (3, 6, 9):
        x, pos = _inputs(t)
        m.cache.zero_()
        out = f(x, pos)
        ref_m = Mlp()
        ref_m.load_state_dict({k: v for k, v in m.state_dict().items() if k != "cache"}, strict=False)
        torch.testing.assert_close(out, ref_m(x, pos))
    # dynamic=None: static first, then one dynamic-shape graph
    assert compiles[0] <= len(gp.compile_reports()) - n0 <= compiles[1]


def test_dataclass_options_through_torch_compile():
    cfg = gp.BackendConfig(codegen="fx", strict=True)
    torch.compile(Mlp(), backend="minimax", options=cfg)(*_inputs())
    assert gp.last_compile_report()["config"] == cfg.to_dict()
