"""BackendConfig: options in, errors that name the field, a stable hash."""

from __future__ import annotations

import json

import pytest
import torch

import minimax_backend.graph_passes as gp
from minimax_backend.graph_passes.config import ENV_VAR, PASS_SWITCHES, BackendConfig, BackendOptionError


def test_defaults_and_sources(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    cfg = BackendConfig.from_options(None)
    assert cfg == BackendConfig()
    assert (cfg.codegen, cfg.strict, cfg.gemm_rs_min_tokens) == ("inductor", False, 512)
    assert all(cfg.mode(p) == "auto" for p in PASS_SWITCHES)
    assert BackendConfig.from_options(cfg) is cfg
    assert BackendConfig.from_options({"codegen": "fx"}).codegen == "fx"
    # JSON lists become tuples
    assert BackendConfig.from_options({"cudagraph_buckets": [1, 8]}).cudagraph_buckets == (1, 8)


def test_env_var_is_the_fallback(monkeypatch):
    monkeypatch.setenv(ENV_VAR, json.dumps({"codegen": "fx", "strict": True}))
    assert BackendConfig.from_options(None).strict
    assert not BackendConfig.from_options({}).strict  # explicit options win, even empty
    monkeypatch.setenv(ENV_VAR, "{not json")
    with pytest.raises(BackendOptionError, match=ENV_VAR):
        BackendConfig.from_options(None)


def test_unknown_key_lists_valid_keys():
    with pytest.raises(BackendOptionError) as e:
        BackendConfig.from_options({"sequence_paralel": "on"})
    msg = str(e.value)
    assert "sequence_paralel" in msg
    for key in BackendConfig.valid_keys():
        assert key in msg


def test_unknown_key_through_torch_compile():
    # Raw torch.compile defers the error to the first call (Dynamo wraps it).
    torch._dynamo.reset()
    f = torch.compile(lambda x: x + 1, backend="minimax", options={"bogus": 1})
    with pytest.raises(Exception, match="valid keys"):
        f(torch.ones(2))
    # our compile() checks at once
    with pytest.raises(BackendOptionError, match="bogus"):
        gp.compile(torch.nn.Linear(2, 2), bogus=1)


@pytest.mark.parametrize(
    "options, field",
    [
        ({"sequence_parallel": "yes"}, "sequence_parallel"),
        ({"codegen": "triton"}, "codegen"),
        ({"quant_format": "int8"}, "quant_format"),
        ({"strict": 1}, "strict"),
        ({"gemm_rs_min_tokens": "2048"}, "gemm_rs_min_tokens"),
        ({"gemm_rs_min_tokens": True}, "gemm_rs_min_tokens"),
        ({"cudagraph_buckets": (8, 4)}, "cudagraph_buckets"),
        ({"tp_size": 0}, "tp_size"),
        ({"dump_dir": 3}, "dump_dir"),
        ({"tp_size": 4, "ep_size": 3}, "ep_size"),
    ],
)
def test_bad_values_name_the_field(options, field):
    with pytest.raises(BackendOptionError, match=field):
        BackendConfig.from_options(options)


def test_not_an_options_object():
    with pytest.raises(BackendOptionError, match="dict or BackendConfig"):
        BackendConfig.from_options(["codegen"])


def test_stable_hash():
    a, b = BackendConfig(), BackendConfig.from_options({})
    assert a.stable_hash() == b.stable_hash() and len(a.stable_hash()) == 64
    assert a.replace(gemm_rs_min_tokens=4096).stable_hash() != a.stable_hash()
    assert a.replace(sequence_parallel="off").stable_hash() != a.stable_hash()
    # where the dump goes does not change the generated code
    assert a.replace(dump_dir="/tmp/x").stable_hash() == a.stable_hash()


def test_on_for_a_pass_not_implemented_yet():
    missing = [p for p in PASS_SWITCHES if p not in gp.registered_passes()]
    if not missing:
        pytest.skip("every pass is implemented")
    with pytest.raises(gp.PassError, match="not implemented yet"):
        gp.PassManager(BackendConfig.from_options({missing[0]: "on"}))
