"""Op naming/counting (graph_passes/op_counts.py) and the graph dump: its writer
(graph_passes/graph_dump.py, graph_diff.py, graph_dump_html.py): files, diff,
HTML, trace artifacts; and its command line (tools/graph_dump.py)."""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

from minimax_backend.graph_passes.graph_dump import GraphDumper
from minimax_backend.graph_passes.op_counts import count, count_delta, op_counts, op_name
from minimax_backend.tools import graph_dump

c10d = torch.ops._c10d_functional


# ------------------------------------------------------------------ fixtures


@pytest.fixture
def group_name():
    """A 2-rank fake process group (rank 0): collectives trace, nothing runs."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    except Exception:  # older torch without the fake backend
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


def _tp_block(group, layers=1):
    """A tiny tensor-parallel block per layer: matmuls, then an all-reduce."""

    def f(x, w1, w2):
        for _ in range(layers):
            h = torch.relu(x @ w1)
            y = c10d.wait_tensor(c10d.all_reduce(h @ w2, "sum", group))
            x = x + y
        return x

    return make_fx(f, tracing_mode="fake")(torch.randn(4, 8), torch.randn(8, 16), torch.randn(16, 8))


def _split_all_reduce(gm, group):
    """The rewrite under test, in place like a real pass:
    all_reduce -> wait  becomes  reduce_scatter -> wait -> all_gather -> wait."""
    g = gm.graph
    for ar in [n for n in g.nodes if n.target == c10d.all_reduce.default]:
        (wait,) = ar.users
        with g.inserting_before(ar):
            rs = g.call_function(c10d.reduce_scatter_tensor.default, (ar.args[0], "sum", 2, group))
            rs_wait = g.call_function(c10d.wait_tensor.default, (rs,))
            ag = g.call_function(c10d.all_gather_into_tensor.default, (rs_wait, 2, group))
            ag_wait = g.call_function(c10d.wait_tensor.default, (ag,))
        wait.replace_all_uses_with(ag_wait)
        g.erase_node(wait)
        g.erase_node(ar)
    gm.recompile()


def _page_data(index_html: str) -> list[dict]:
    m = re.search(r'<script type="application/json" id="dump-data">(.*?)</script>', index_html, re.S)
    return json.loads(m.group(1))


# ------------------------------------------------------------------ op names


def test_op_names_of_an_aten_graph(group_name):
    gm = _tp_block(group_name)
    names = [op_name(n) for n in gm.graph.nodes]
    assert names == [
        None, None, None,  # placeholders
        "aten.mm", "aten.relu", "aten.mm",
        "_c10d_functional.all_reduce", "_c10d_functional.wait_tensor",
        "aten.add",
        None,  # output
    ]


def test_op_names_of_python_level_graphs():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(torch.matmul(x, x)).view(-1)
            return torch.nn.functional.relu(y)[0]

    ops = op_counts(torch.fx.symbolic_trace(M()))
    assert ops == {
        "Tensor.view": 1,
        "module.Linear": 1,
        "operator.getitem": 1,
        "torch.matmul": 1,
        "torch.nn.functional.relu": 1,
    }
    assert list(ops) == sorted(ops)


def test_op_names_of_a_dynamo_graph():
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    lin = torch.nn.Linear(4, 4)
    torch._dynamo.reset()
    torch.compile(lambda x: torch.relu(lin(torch.matmul(x, x) @ x)), backend=capture, fullgraph=True)(torch.randn(4, 4))
    assert op_counts(graphs[0]) == {
        "operator.matmul": 1,  # the @ operator
        "torch.matmul": 1,
        "torch.nn.functional.linear": 1,
        "torch.relu": 1,
    }


def test_custom_op_and_multi_output_names():
    @torch.library.custom_op("minimax_dumptest::split2", mutates_args=())
    def split2(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.clone(), x.clone()

    @split2.register_fake
    def _(x):
        return torch.empty_like(x), torch.empty_like(x)

    def f(x):
        a, b = torch.ops.minimax_dumptest.split2(x)
        return a + b

    gm = make_fx(f, tracing_mode="fake")(torch.randn(3))
    ops = op_counts(gm)
    assert ops == {"aten.add": 1, "minimax_dumptest.split2": 1, "operator.getitem": 2}
    assert count(gm, "operator.getitem") == 2 and count(gm, "aten.mm") == 0
    # Overload packets name the same op as their overloads.
    node = next(n for n in gm.graph.nodes if op_name(n) == "minimax_dumptest.split2")
    node.target = torch.ops.minimax_dumptest.split2
    assert op_name(node) == "minimax_dumptest.split2"


def test_ops_inside_graph_submodules_count_inline():
    from torch.fx.passes.split_module import split_module

    gm = torch.fx.symbolic_trace(lambda x: torch.relu(x + 1) * 2)
    # Two pieces, split at the relu, as a piecewise backend would.
    split = split_module(gm, None, lambda n: 0 if n.name == "add" else 1)
    assert [n.op for n in split.graph.nodes].count("call_module") == 2
    assert op_counts(split) == op_counts(gm) == {"operator.add": 1, "operator.mul": 1, "torch.relu": 1}


def test_count_delta():
    assert count_delta({"a": 1, "b": 2}, {"b": 3, "c": 1}) == {"a": (1, 0), "b": (2, 3), "c": (0, 1)}


# ------------------------------------------------------------------ dumps


def test_dump_of_one_rewrite(tmp_path, group_name):
    gm = _tp_block(group_name)
    d = GraphDumper(tmp_path, "tp block")
    d.record("captured", gm, note="make_fx")
    _split_all_reduce(gm, group_name)
    d.record("split_all_reduce", gm, note="all_reduce -> reduce_scatter + all_gather")
    index = d.finish()

    # One folder per compile, named by title and rank.
    assert d.dir == tmp_path / "tp_block-rank0"
    assert index == d.dir / "index.html"
    files = sorted(p.name for p in d.dir.iterdir())
    assert files == [
        "00_captured.diff.txt", "00_captured.ops.json", "00_captured.py",
        "01_split_all_reduce.diff.txt", "01_split_all_reduce.ops.json", "01_split_all_reduce.py",
        "index.html",
    ]

    before = json.loads((d.dir / "00_captured.ops.json").read_text())
    after = json.loads((d.dir / "01_split_all_reduce.ops.json").read_text())
    assert before == {
        "_c10d_functional.all_reduce": 1,
        "_c10d_functional.wait_tensor": 1,
        "aten.add": 1,
        "aten.mm": 2,
        "aten.relu": 1,
    }
    assert after == {
        "_c10d_functional.all_gather_into_tensor": 1,
        "_c10d_functional.reduce_scatter_tensor": 1,
        "_c10d_functional.wait_tensor": 2,
        "aten.add": 1,
        "aten.mm": 2,
        "aten.relu": 1,
    }
    assert d.stages == [("captured", before), ("split_all_reduce", after)]

    code = (d.dir / "01_split_all_reduce.py").read_text()
    assert "reduce_scatter_tensor" in code and "all_reduce.default" not in code

    # The diff: op delta, and exactly the nodes the rewrite touched.
    diff = d.records[1].diff
    assert diff.ops == {
        "_c10d_functional.all_gather_into_tensor": (0, 1),
        "_c10d_functional.all_reduce": (1, 0),
        "_c10d_functional.reduce_scatter_tensor": (0, 1),
        "_c10d_functional.wait_tensor": (1, 2),
    }
    assert diff.removed == ["all_reduce", "wait_tensor"]
    assert len(diff.added) == 4 and diff.changed == ["add"]  # add now reads the new wait
    assert diff.unchanged == 7 and not diff.retraced
    assert len(diff.regions) == 1
    text = (d.dir / "01_split_all_reduce.diff.txt").read_text()
    assert "_c10d_functional.all_reduce                           1 -> 0" in text
    assert "- all_reduce: " in text and "+ reduce_scatter_tensor" in text
    assert "+ all_gather_into_tensor" in text and "~ add: " in text

    # The page: stage names, op table, the added lines marked in the code view.
    page = index.read_text()
    assert "captured" in page and "split_all_reduce" in page
    assert '<td class="down">0<sup>-1</sup></td>' in page  # all_reduce fell
    assert '<td class="up">1<sup>+1</sup></td>' in page  # reduce_scatter rose
    assert "http://" not in page and "https://" not in page and "<link" not in page
    data = _page_data(page)
    marks = data[1]["marks"]
    marked = {data[1]["code"][int(k)].strip().split(" ")[0]: v for k, v in marks.items()}
    assert marked == {
        "reduce_scatter_tensor_default": "add",
        "wait_tensor_default": "add",
        "all_gather_into_tensor_default": "add",
        "wait_tensor_default_1": "add",
        "add:": "chg",
    }
    removed = data[1]["diff"]["regions"][0]["removed"]
    assert [r.split(":")[0] for r in removed] == ["all_reduce", "wait_tensor"]


def test_alike_rewrites_form_one_region_per_layer(tmp_path, group_name):
    gm = _tp_block(group_name, layers=3)
    d = GraphDumper(tmp_path, "three")
    d.record("captured", gm)
    _split_all_reduce(gm, group_name)
    diff = d.record("split", gm).diff
    assert len(diff.regions) == 3
    assert len({r.summary for r in diff.regions}) == 1
    assert diff.regions[0].summary.startswith(
        "_c10d_functional.all_reduce, _c10d_functional.wait_tensor -> _c10d_functional.reduce_scatter_tensor"
    )
    assert "3 x  _c10d_functional.all_reduce" in (d.dir / "01_split.diff.txt").read_text()


def test_a_retrace_is_reported_as_such(tmp_path):
    def f(x):
        return torch.relu(x @ x) + 1

    d = GraphDumper(tmp_path, "retrace")
    d.record("python", torch.fx.symbolic_trace(f))
    d.record("aten", make_fx(f)(torch.randn(3, 3)))
    assert d.records[1].diff.retraced
    assert "traced anew" in (d.dir / "01_aten.diff.txt").read_text()
    # Recording the same graph again: nothing changed.
    d.record("again", make_fx(f)(torch.randn(3, 3)))
    diff = d.records[2].diff
    assert (diff.added, diff.removed, diff.changed, diff.ops) == ([], [], [], {})


def test_no_out_dir_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    gm = torch.fx.symbolic_trace(lambda x: torch.relu(x) + 1)
    d = GraphDumper(None, "mem")
    d.record("a", gm)
    d.record("b", gm)
    assert d.finish() is None and d.dir is None
    assert d.stages == [("a", {"operator.add": 1, "torch.relu": 1}), ("b", {"operator.add": 1, "torch.relu": 1})]
    assert list(tmp_path.iterdir()) == []


def test_dumpers_sharing_an_out_dir_do_not_collide(tmp_path):
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    dumpers = [GraphDumper(tmp_path, "same"), GraphDumper(tmp_path, "same"), GraphDumper(tmp_path, "")]
    for d in dumpers:
        d.record("captured", gm)
        d.finish()
    names = [d.dir.name for d in dumpers]
    assert names[:2] == ["same", "same-2"]
    assert re.fullmatch(r"compile-\d+", names[2])
    for d in dumpers:
        assert (d.dir / "index.html").exists() and (d.dir / "00_captured.py").exists()


def test_structured_trace_artifacts():
    from torch._logging._internal import trace_log

    seen = []

    class Collect(logging.Handler):
        def emit(self, record):
            seen.append((getattr(record, "metadata", {}), getattr(record, "payload", None)))

    handler = Collect()
    trace_log.addHandler(handler)  # what TORCH_TRACE does, without a file
    try:
        GraphDumper(None, "trace").record("captured", torch.fx.symbolic_trace(lambda x: torch.relu(x)))
    finally:
        trace_log.removeHandler(handler)
    artifacts = {m["artifact"]["name"]: p for m, p in seen if "artifact" in m}
    assert "def forward" in artifacts["minimax_captured"]
    assert json.loads(artifacts["minimax_captured_ops"]) == {"torch.relu": 1}


# ------------------------------------------------------------------ command line


def test_summarize_command(tmp_path, group_name, capsys):
    gm = _tp_block(group_name)
    d = GraphDumper(tmp_path, "cli")
    d.record("captured", gm)
    _split_all_reduce(gm, group_name)
    d.record("split", gm)
    table = graph_dump.summarize(tmp_path)  # the dump folder; d.dir works too
    assert table == graph_dump.summarize(d.dir)
    row = next(line for line in table.splitlines() if line.startswith("_c10d_functional.all_reduce"))
    assert row.split() == ["_c10d_functional.all_reduce", "1", "0*"]
    assert "00 captured" in table and "01 split" in table

    # As users run it (a fresh process: the module is runnable with -m).
    out = subprocess.run(
        [sys.executable, "-m", "minimax_backend.tools.graph_dump", "summarize", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == table
    assert graph_dump.main(["summarize", str(tmp_path / "nope")]) == 1
    assert "nope" in capsys.readouterr().err


# ------------------------------------------------------------------ the page in a browser


@pytest.mark.skipif(not shutil.which("chromium"), reason="headless chromium not installed")
def test_page_renders_in_a_browser(tmp_path, group_name):
    gm = _tp_block(group_name)
    d = GraphDumper(tmp_path, "browser")
    d.record("captured", gm)
    _split_all_reduce(gm, group_name)
    d.record("split", gm)
    url = d.finish().as_uri() + "#s1"
    flags = ["chromium", "--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1000"]
    dom = subprocess.run(flags + ["--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    # The script drew stage 01: its regions and the highlighted code lines.
    assert "Stage 01 · split" in dom
    assert re.search(r'<div id="L\d+" class="add">.*?reduce_scatter_tensor_default', dom)
    assert '<div class="rl rem">- all_reduce: ' in dom
    shot = tmp_path / "page.png"
    subprocess.run(flags + [f"--screenshot={shot}", url], capture_output=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 10_000
