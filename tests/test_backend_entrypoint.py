"""`torch.compile(model, backend="minimax")` in a fresh process, found through
the `torch_dynamo_backends` entry point with no import of ours first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    assert not any(m.startswith("minimax_backend") for m in sys.modules), "imported too early"
    assert "minimax" in torch._dynamo.list_backends(), torch._dynamo.list_backends()
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = torch.randn(3, 4)
    with torch.no_grad():
        out = torch.compile(m, backend="minimax", fullgraph=True)(x)
        torch.testing.assert_close(out, m(x))
    from minimax_backend.graph_passes.backend import last_compile_report
    rep = last_compile_report()
    print(json.dumps({"config": rep["config"], "passes": [p["name"] for p in rep["passes"]]}))
    """
)


def test_entry_point_in_a_fresh_process():
    env = dict(os.environ, MINIMAX_OPTIONS=json.dumps({"codegen": "fx", "strict": True}))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(proc.stdout.strip().splitlines()[-1])
    # the options came from $MINIMAX_OPTIONS, since none were passed
    assert rep["config"]["codegen"] == "fx" and rep["config"]["strict"] is True
    assert rep["passes"][0] == "cleanup" and rep["passes"][-1] == "cleanup"
