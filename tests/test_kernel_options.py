"""The kernel switches of kernels/options.py: defaults, parsing, errors, overrides, reporting."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

import pytest

from minimax_backend.kernels import options as O
from minimax_backend.kernels.options import KernelOptions, kernel_options, override_kernel_options

DEFAULTS = {
    "moe_kernel": "triton", "moe_tiles": None, "moe_gate_up": "auto", "moe_group_m": None,
    "moe_expert_groups": None, "moe_gemm": "auto", "moe_down": "auto", "moe_trio_rows": "live", "moe_bf16_passes": "1", "moe_fp8_yield": "off", "moe_half_blocks": "auto", "moe_align": "triton",
    "moe_route": "triton",
    "moe_select": "fused", "moe_overlap": "auto", "moe_router_logits": "auto", "moe_shared": "merged",
    "gemm_rs_fused": True, "gemm_rs_schedule": "auto", "gemm_rs_push": "copy", "gemm_rs_pieces": None,
    "fp8_gemm": "auto", "allreduce_norm": "unfused",
}


def test_defaults():
    assert KernelOptions().to_dict() == DEFAULTS
    assert KernelOptions.from_env({}) == KernelOptions()
    assert KernelOptions().changed() == {}


def test_every_variable_is_read():
    env = {"MINIMAX_MOE_KERNEL": "reference", "MINIMAX_MOE_TILES": "64,128,64,4,3", "MINIMAX_MOE_GATE_UP": "one_dot",
           "MINIMAX_MOE_GROUP_M": "4", "MINIMAX_MOE_EXPERT_GROUPS": "8", "MINIMAX_MOE_GEMM": "gluon",
           "MINIMAX_MOE_DOWN": "triton", "MINIMAX_MOE_TRIO_ROWS": "all", "MINIMAX_MOE_BF16_PASSES": "2",
           "MINIMAX_MOE_FP8_YIELD": "2",
           "MINIMAX_MOE_HALF_BLOCKS": "on", "MINIMAX_MOE_ALIGN": "torch",
           "MINIMAX_MOE_ROUTE": "torch", "MINIMAX_MOE_ROUTER_LOGITS": "cublas", "MINIMAX_MOE_SHARED": "separate",
           "MINIMAX_MOE_SELECT": "separate", "MINIMAX_MOE_OVERLAP": "off", "MINIMAX_GEMM_RS_FUSED": "0",
           "MINIMAX_GEMM_RS_SCHEDULE": "sum_after", "MINIMAX_GEMM_RS_PUSH": "store", "MINIMAX_GEMM_RS_PIECES": "3",
           "MINIMAX_FP8_GEMM": "scaled_mm", "MINIMAX_ALLREDUCE_NORM": "symm_mem", "MINIMAX_SOMETHING_ELSE": "ignored"}
    opts = KernelOptions.from_env(env)
    assert opts.to_dict() == {
        "moe_kernel": "reference", "moe_tiles": [64, 128, 64, 4, 3], "moe_gate_up": "one_dot", "moe_group_m": 4,
        "moe_expert_groups": 8, "moe_gemm": "gluon", "moe_down": "triton", "moe_trio_rows": "all", "moe_bf16_passes": "2", "moe_fp8_yield": "2", "moe_half_blocks": "on",
        "moe_align": "torch",
        "moe_route": "torch", "moe_router_logits": "cublas",
        "moe_shared": "separate", "moe_select": "separate", "moe_overlap": "off", "gemm_rs_fused": False, "gemm_rs_schedule": "sum_after", "gemm_rs_push": "store",
        "gemm_rs_pieces": 3, "fp8_gemm": "scaled_mm", "allreduce_norm": "symm_mem",
    }
    assert opts.moe_tiles == (64, 128, 64, 4, 3)  # a tuple: the instance is hashable and frozen
    assert set(opts.changed()) == set(DEFAULTS)
    assert KernelOptions.from_env({"MINIMAX_MOE_TILES": "16,128,128,4,3,64"}).moe_tiles == (16, 128, 128, 4, 3, 64)
    assert KernelOptions.from_env({"MINIMAX_MOE_TILES": ""}).moe_tiles is None  # empty = unset, as before
    assert KernelOptions.from_env({"MINIMAX_MOE_TILES": "64,128,128,8,4,256,8,3"}).moe_tiles[5:] == (256, 8, 3)


@pytest.mark.parametrize("variable, value, valid", [
    ("MINIMAX_MOE_KERNEL", "cutlass", "use one of triton, reference (default triton)"),
    ("MINIMAX_MOE_GATE_UP", "fused", "use one of auto, two_dots, one_dot (default auto)"),
    ("MINIMAX_MOE_GROUP_M", "-1", "use a whole number >= 0"),
    ("MINIMAX_MOE_GROUP_M", "four", "use a whole number >= 0"),
    ("MINIMAX_MOE_EXPERT_GROUPS", "0", "use a whole number >= 1"),
    ("MINIMAX_MOE_ALIGN", "cub", "use one of triton, torch (default triton)"),
    ("MINIMAX_MOE_ROUTE", "cub", "use one of triton, torch (default triton)"),
    ("MINIMAX_MOE_SHARED", "fused", "use one of merged, separate (default merged)"),
    ("MINIMAX_GEMM_RS_FUSED", "yes", "use one of 1, 0 (default 1)"),
    ("MINIMAX_GEMM_RS_SCHEDULE", "fast", "use one of auto, epilogue, sum_after (default auto)"),
    ("MINIMAX_GEMM_RS_PUSH", "nvlink", "use one of copy, store (default copy)"),
    ("MINIMAX_GEMM_RS_PIECES", "0", "use a whole number >= 1"),
    ("MINIMAX_GEMM_RS_PIECES", "two", "use a whole number >= 1"),
    ("MINIMAX_MOE_TILES", "64,128", "expected five, six or eight integers BM,BN,BK,warps,stages[,BN_DOWN[,down_warps,down_stages]]"),
    ("MINIMAX_MOE_TILES", "64,128,64,4,x", "expected five, six or eight integers"),
    ("MINIMAX_FP8_GEMM", "cublas", "use one of auto, scaled_mm, triton (default auto)"),
])
def test_a_bad_value_names_the_variable_and_the_valid_values(variable, value, valid):
    with pytest.raises(ValueError, match=re.escape(f"{variable}={value!r}") + ".*" + re.escape(valid)):
        KernelOptions.from_env({variable: value})


def test_bad_values_in_the_constructor_and_the_override():
    with pytest.raises(ValueError, match="MINIMAX_MOE_SHARED='fused'"):
        KernelOptions(moe_shared="fused")
    with pytest.raises(ValueError, match="MINIMAX_GEMM_RS_PIECES=0"):
        KernelOptions(gemm_rs_pieces=0)
    with pytest.raises(ValueError, match="MINIMAX_MOE_TILES=\\(1, 2\\)"):
        KernelOptions(moe_tiles=(1, 2))
    with pytest.raises(ValueError, match="five, six or eight integers"):  # a down warps without its stages
        KernelOptions(moe_tiles=(64, 128, 128, 8, 4, 256, 8))
    before = kernel_options()
    with pytest.raises(ValueError, match="MINIMAX_GEMM_RS_PUSH='nvlink'"):
        with override_kernel_options(gemm_rs_push="nvlink"):
            pass
    with pytest.raises(TypeError, match="unknown option.*gemm_rs_pish"):
        with override_kernel_options(gemm_rs_pish="store"):
            pass
    assert kernel_options() is before  # nothing changed
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.moe_align = "torch"


def test_override_changes_and_restores():
    before = kernel_options()
    with override_kernel_options(moe_align="torch", gemm_rs_pieces="2") as opts:
        assert kernel_options() is opts
        assert (opts.moe_align, opts.gemm_rs_pieces) == ("torch", 2)  # the variable's spelling is parsed
        assert opts.fp8_gemm == before.fp8_gemm  # the rest as before
        with override_kernel_options(moe_align="triton", gemm_rs_fused=False):  # nested: on top of the outer
            assert (kernel_options().moe_align, kernel_options().gemm_rs_pieces) == ("triton", 2)
            assert kernel_options().gemm_rs_fused is False
        assert kernel_options() is opts
    assert kernel_options() is before
    with pytest.raises(RuntimeError), override_kernel_options(moe_route="torch"):
        raise RuntimeError("the block failed")
    assert kernel_options() is before  # restored on an exception too


def test_read_once_from_the_environment(monkeypatch):
    monkeypatch.setattr(O, "_CURRENT", None)  # as in a fresh process
    monkeypatch.setenv("MINIMAX_MOE_ALIGN", "torch")
    first = kernel_options()
    assert first.moe_align == "torch"
    monkeypatch.setenv("MINIMAX_MOE_ALIGN", "triton")  # too late: read once
    assert kernel_options() is first
    monkeypatch.setattr(O, "_CURRENT", None)
    monkeypatch.setenv("MINIMAX_MOE_ALIGN", "cub")
    for _ in range(2):  # a bad value is an error at every use, and nothing is cached
        with pytest.raises(ValueError, match="MINIMAX_MOE_ALIGN='cub'"):
            kernel_options()
    assert O._CURRENT is None


def test_to_dict_and_stable_hash():
    a = KernelOptions()
    assert json.loads(json.dumps(a.to_dict())) == a.to_dict()  # JSON-ready
    assert a.stable_hash() == KernelOptions.from_env({}).stable_hash()
    assert re.fullmatch(r"[0-9a-f]{16}", a.stable_hash())
    hashes = {a.stable_hash()}
    for change in ({"moe_tiles": "64,128,64,4,3"}, {"moe_tiles": "64,128,64,4,3,64"}, {"gemm_rs_pieces": 1},
                   {"gemm_rs_fused": False}, {"fp8_gemm": "triton"}):
        hashes.add(dataclasses.replace(a, **change).stable_hash())
    assert len(hashes) == 6  # every change changes it
    # the same in another process (no per-process salt, unlike hash())
    code = ("from minimax_backend.kernels.options import KernelOptions as K; "
            "print(K.from_env({'MINIMAX_GEMM_RS_PIECES': '3'}).stable_hash())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == KernelOptions(gemm_rs_pieces=3).stable_hash()


def test_the_docstring_table_matches_the_declarations():
    """One table documents the switches (kernels/options.py's docstring): it lists every
    switch, with its variable, default and values as declared."""
    rows = {}
    for line in O.__doc__.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 5 and cells[0] in DEFAULTS:
            rows[cells[0]] = cells[1:4]
    assert list(rows) == list(DEFAULTS)
    for switch in KernelOptions.switches():
        assert rows[switch["option"]] == [switch["variable"], switch["default"], switch["values"]], switch["option"]


def test_no_kernel_reads_the_environment_itself():
    """Every switch is read through kernels/options.py, nowhere else in kernels/."""
    from pathlib import Path

    root = Path(O.__file__).parent
    for path in root.glob("*.py"):
        if path.name == "options.py":
            continue
        text = path.read_text()
        assert not re.search(r"environ(\.get)?\(?\[?[\"']MINIMAX_", text), path.name
        assert "env_choice" not in text, path.name


def test_the_kernels_pointers_into_the_tuning_notes_resolve():
    """Kernel comments keep a rule and point to its measurement in docs/kernel-notes.md#section:
    every such section exists (GitHub's anchor of a heading: lower case, spaces to dashes)."""
    from pathlib import Path

    kernels = Path(O.__file__).parent
    notes = (kernels.parent / "docs" / "kernel-notes.md").read_text()
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.lower()).strip().replace(" ", "-")
               for h in re.findall(r"^#+ (.+)$", notes, flags=re.M)}
    pointers = {a for path in kernels.glob("*.py") for a in re.findall(r"kernel-notes\.md#([a-z0-9-]+)", path.read_text())}
    assert pointers, "no pointers found"
    assert pointers <= anchors, sorted(pointers - anchors)
