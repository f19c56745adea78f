"""BackendConfig.module_dict_guards: Dynamo checks parameters per unchanged module tree
(torch._dynamo.config.use_recursive_dict_tags_for_guards), and a replaced parameter is
still seen."""

from __future__ import annotations

import pytest
import torch

import minimax_backend.graph_passes as gp

FLAG = "use_recursive_dict_tags_for_guards"
pytestmark = pytest.mark.skipif(not hasattr(torch._dynamo.config, FLAG), reason=f"this torch has no dynamo {FLAG}")


@pytest.fixture
def flag_off():
    # config.patch, not monkeypatch: Dynamo's config entries are not module attributes, and
    # monkeypatch's undo would delete the entry for the rest of the session
    with torch._dynamo.config.patch(**{FLAG: False}):
        torch._dynamo.reset()
        yield
    torch._dynamo.reset()


def test_on_by_default_and_a_replaced_parameter_of_another_shape_recompiles(flag_off):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    f = gp.compile(model, codegen="fx")
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(f(x), model(x))
        assert getattr(torch._dynamo.config, FLAG) is True
        model[0].weight = torch.nn.Parameter(torch.randn(3, 4))  # a new tensor, another shape
        model[0].bias = torch.nn.Parameter(torch.randn(3))
        out = f(x)
    assert out.shape == (2, 3)
    torch.testing.assert_close(out, model(x))


def test_off_leaves_dynamo_alone(flag_off):
    model = torch.nn.Linear(4, 4)
    with torch.no_grad():
        gp.compile(model, codegen="fx", module_dict_guards=False)(torch.randn(2, 4))
    assert getattr(torch._dynamo.config, FLAG) is False
