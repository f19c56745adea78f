"""Checkpoint I/O: random checkpoints, round trips at TP 1 and TP 2 (gloo), sharded
indexes, FP8 checkpoints, BF16 -> FP8 at load, and every error case."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from minimax_backend.model.checkpoint_format import INDEX_FILE, SINGLE_FILE, CheckpointError
from minimax_backend.model.checkpoint_loader import load_checkpoint
from minimax_backend.model.checkpoint_reader import CheckpointReader
from minimax_backend.model.checkpoint_writer import hf_tensor_shape, save_model_as_checkpoint, save_random_checkpoint
from minimax_backend.model.config import MiniMaxConfig
from minimax_backend.model.presets import load_preset
from minimax_backend.model.weights import LoadPlan, Shard, attach_plan, cols, plan, rows, whole

SEED = 3
TOKENS = 7  # odd: does not divide by the TP size


def _inputs(cfg: MiniMaxConfig, batch: int = 2, seq: int = TOKENS):
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    pos = torch.arange(seq).expand(batch, seq)
    return ids, pos


def _model(cfg, ps=None, dtype=torch.float32, **kw):
    from minimax_backend.model.minimax import build_model
    from minimax_backend.model.parallel import ParallelState

    return build_model(cfg, ps or ParallelState.single(), dtype, "cpu", **kw)


def _reference(cfg, dtype=torch.float32, **kw):
    from minimax_backend.model.minimax import init_random_weights

    return init_random_weights(_model(cfg, dtype=dtype, **kw), SEED)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """tiny-m3 written in float32 by save_random_checkpoint, and its TP-1 logits."""
    cfg = load_preset("tiny-m3")
    out = save_random_checkpoint(cfg, tmp_path_factory.mktemp("tiny_m3"), seed=SEED, dtype=torch.float32)
    model = _model(cfg)
    load_checkpoint(model, out)
    with torch.no_grad():
        logits = model(*_inputs(cfg))
    return out, cfg, logits


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    cfg = load_preset("tiny-m3-fp8")
    out = save_random_checkpoint(cfg, tmp_path_factory.mktemp("tiny_m3_fp8"), seed=SEED, dtype=torch.float32)
    return out, cfg


# ----------------------------------------------------------------- TP 1
def test_random_checkpoint_round_trip_tp1(tiny_ckpt, tmp_path):
    out, cfg, logits = tiny_ckpt
    assert (out / SINGLE_FILE).is_file() and not (out / INDEX_FILE).exists()
    assert MiniMaxConfig.from_json_file(out) == cfg
    names = set(load_file(str(out / SINGLE_FILE)))
    # HF names, fused tensors split back
    for n in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
              "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
              "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
              "model.layers.1.block_sparse_moe.gate.weight", "model.layers.1.block_sparse_moe.e_score_correction_bias",
              "model.layers.1.block_sparse_moe.experts.7.w3.weight",
              "model.layers.2.block_sparse_moe.shared_experts.down_proj.weight",
              "model.layers.1.self_attn.index_k_proj.weight"):
        assert n in names, n
    assert not any("qkv" in n or "gate_up" in n for n in names)
    sd = load_file(str(out / SINGLE_FILE))
    assert tuple(sd["model.layers.0.self_attn.q_proj.weight"].shape) == (4 * 64, 256)
    assert tuple(sd["model.layers.0.self_attn.k_proj.weight"].shape) == (2 * 64, 256)
    # the loaded model is the in-memory random model, exactly
    ref = _reference(cfg)
    with torch.no_grad():
        assert torch.equal(ref(*_inputs(cfg)), logits)
    # save the loaded model again: the same tensors
    model = _model(cfg)
    load_checkpoint(model, out)
    again = save_model_as_checkpoint(model, tmp_path / "again")
    sd2 = load_file(str(again / SINGLE_FILE))
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)


def test_sharded_index_round_trip(tiny_ckpt, tmp_path):
    out, cfg, logits = tiny_ckpt
    model = _model(cfg)
    load_checkpoint(model, out)
    sharded = save_model_as_checkpoint(model, tmp_path / "sharded", max_shard_bytes=1_000_000)
    index = json.loads((sharded / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and not (sharded / SINGLE_FILE).exists()
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in load_file(str(out / SINGLE_FILE)).values())
    m2 = _model(cfg)
    report = load_checkpoint(m2, sharded)
    assert report["files"] == len(files)
    with torch.no_grad():
        assert torch.equal(m2(*_inputs(cfg)), logits)


def test_bf16_checkpoint_default_dtype(tmp_path):
    cfg = load_preset("tiny-m2")
    out = save_random_checkpoint(cfg, tmp_path, seed=SEED)
    sd = load_file(str(out / SINGLE_FILE))
    assert sd["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    m = _model(cfg, dtype=torch.bfloat16)
    load_checkpoint(m, out)
    ref = _reference(cfg, dtype=torch.bfloat16)
    for (n, a), (_, b) in zip(ref.named_parameters(), m.named_parameters()):
        assert torch.equal(a, b), n


# ----------------------------------------------------------------- FP8
def test_fp8_checkpoint_loads_as_fp8(fp8_ckpt):
    out, cfg = fp8_ckpt
    hf = json.loads((out / "config.json").read_text())
    assert hf["quantization_config"]["quant_method"] == "fp8"
    assert hf["quantization_config"]["weight_block_size"] == [128, 128]
    sd = load_file(str(out / SINGLE_FILE))
    w = sd["model.layers.1.block_sparse_moe.experts.0.w1.weight"]
    s = sd["model.layers.1.block_sparse_moe.experts.0.w1.weight_scale_inv"]
    assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert tuple(w.shape) == (512, 256) and tuple(s.shape) == (4, 2)
    assert sd["model.layers.1.block_sparse_moe.gate.weight"].dtype == torch.float32  # router stays float
    model = _model(cfg)
    report = load_checkpoint(model, out)
    assert report["quantized"] == 0
    assert model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    ref = _reference(cfg)
    with torch.no_grad():
        assert torch.equal(model(*_inputs(cfg)), ref(*_inputs(cfg)))


def test_bf16_checkpoint_quantized_at_load(tmp_path):
    cfg = load_preset("tiny-m3-fp8")
    plain = cfg.replace(quant_method=None)
    out = save_random_checkpoint(plain, tmp_path, seed=SEED, dtype=torch.float32)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    model = _model(plain, quantize_fp8=True)
    with pytest.raises(CheckpointError, match="quantize_fp8=True"):
        load_checkpoint(model, out)
    report = load_checkpoint(model, out, quantize_fp8=True)
    assert report["quantized"] > 0
    # quantizing each checkpoint piece at load == drawing the same float weights and quantizing them
    ref = _reference(plain, quantize_fp8=True)
    for (n, a), (_, b) in zip(ref.named_parameters(), model.named_parameters()):
        assert a.dtype == b.dtype and torch.equal(a.float(), b.float()), n
    # and the FP8 weights dequantize close to the float checkpoint's
    from minimax_backend.kernels.fp8 import dequantize_weight_fp8

    w = load_file(str(out / SINGLE_FILE))["model.layers.0.self_attn.o_proj.weight"]
    o = model.layers[0].self_attn.o_proj
    deq = dequantize_weight_fp8(o.weight, o.weight_scale_inv)
    assert (deq - w).norm() / w.norm() < 0.05


def test_fp8_checkpoint_into_float_model_dequantizes(fp8_ckpt):
    from minimax_backend.kernels.fp8 import dequantize_weight_fp8

    out, cfg = fp8_ckpt
    model = _model(cfg.replace(quant_method=None))
    report = load_checkpoint(model, out)
    assert report["dequantized"] > 0
    sd = load_file(str(out / SINGLE_FILE))
    name = "model.layers.0.self_attn.o_proj.weight"
    want = dequantize_weight_fp8(sd[name], sd[name + "_scale_inv"])
    assert torch.equal(model.layers[0].self_attn.o_proj.weight, want)


# ----------------------------------------------------------------- TP 2 (gloo)
def _tp_worker(rank, world, ckpt, fp8_ckpt, ep_sizes):
    from minimax_backend.model.parallel import ParallelState

    torch.manual_seed(0)
    out = {}
    for path, tag in ((ckpt, "bf"), (fp8_ckpt, "fp8")):
        cfg = MiniMaxConfig.from_json_file(path)
        for ep in ep_sizes:
            model = _model(cfg, ParallelState.from_world(ep))
            report = load_checkpoint(model, path)
            with torch.no_grad():
                out[(tag, ep)] = (model(*_inputs(cfg)), report["bytes_read"])
    return out


def test_tp2_loads_tp1_checkpoint(tiny_ckpt, fp8_ckpt):
    from multirank import run_multirank

    out, cfg, logits = tiny_ckpt
    fp8_out, fp8_cfg = fp8_ckpt
    fp8_model = _model(fp8_cfg)
    tp1_bytes = load_checkpoint(fp8_model, fp8_out)["bytes_read"]
    with torch.no_grad():
        fp8_logits = fp8_model(*_inputs(fp8_cfg))
    results = run_multirank(_tp_worker, 2, args=(str(out), str(fp8_out), (1, 2)), timeout=600)
    total = sum(t.numel() * t.element_size() for t in load_file(str(out / SINGLE_FILE)).values())
    for rank_out in results:
        for ep in (1, 2):
            got, read = rank_out[("bf", ep)]
            torch.testing.assert_close(got, logits, rtol=1e-5, atol=1e-5)
            # each rank reads only its slices: well under the whole checkpoint
            assert read < 0.75 * total, (ep, read, total)
            got, read = rank_out[("fp8", ep)]
            torch.testing.assert_close(got, fp8_logits, rtol=1e-4, atol=1e-4)
            assert read < 0.75 * tp1_bytes


# ----------------------------------------------------------------- errors
def _tamper(src, dst, edit):
    sd = load_file(str(src / SINGLE_FILE))
    edit(sd)
    dst.mkdir()
    save_file(sd, str(dst / SINGLE_FILE))
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def test_every_problem_reported_at_once(tiny_ckpt, tmp_path):
    out, cfg, _ = tiny_ckpt
    missing = "model.layers.1.self_attn.k_proj.weight"
    misshaped = "model.layers.0.mlp.down_proj.weight"
    wrong_dtype = "model.norm.weight"

    def edit(sd):
        del sd[missing]
        sd[misshaped] = torch.zeros(256, 100)
        sd[wrong_dtype] = torch.zeros(256, dtype=torch.int32)
        sd["model.layers.9.mlp.up_proj.weight"] = torch.zeros(2, 2)
        sd["extra.thing"] = torch.zeros(1)

    bad = _tamper(out, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(_model(cfg), bad)
    msg = str(e.value)
    assert len(e.value.problems) == 5, msg
    assert f"missing tensor {missing}" in msg and "layers.1.self_attn.qkv_proj.weight" in msg
    assert f"mis-shaped tensor {misshaped}" in msg and "[256, 100]" in msg
    assert "unsupported dtype I32 for model.norm.weight" in msg
    assert "unexpected tensor model.layers.9.mlp.up_proj.weight" in msg
    assert "unexpected tensor extra.thing" in msg
    # ignore patterns and allow_unexpected only silence the unused ones
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(_model(cfg), bad, ignore=["model.layers.9.*", "extra.*"])
    assert len(e.value.problems) == 3 and "unexpected" not in str(e.value)


def test_unexpected_tensor_alone_and_ignored(tiny_ckpt, tmp_path):
    out, cfg, logits = tiny_ckpt
    bad = _tamper(out, tmp_path / "extra", lambda sd: sd.update({"model.mtp.5.enorm.weight": torch.ones(256)}))
    with pytest.raises(CheckpointError, match="unexpected tensor model.mtp.5.enorm.weight"):
        load_checkpoint(_model(cfg), bad)
    m = _model(cfg)
    report = load_checkpoint(m, bad, ignore=["model.mtp.5.*"])
    assert report["unused"] == []
    report = load_checkpoint(m, bad, allow_unexpected=True)
    assert report["unused"] == ["model.mtp.5.enorm.weight"]
    with torch.no_grad():
        assert torch.equal(m(*_inputs(cfg)), logits)


def test_mis_shaped_whole_tensor_names_both_shapes(tiny_ckpt, tmp_path):
    out, cfg, _ = tiny_ckpt
    name = "model.layers.1.block_sparse_moe.e_score_correction_bias"
    bad = _tamper(out, tmp_path / "shape", lambda sd: sd.update({name: torch.zeros(9)}))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(_model(cfg), bad)
    assert len(e.value.problems) == 1
    assert name in str(e.value) and "[9]" in str(e.value) and "expected [8]" in str(e.value)


def test_missing_files_and_dirs(tmp_path, tiny_ckpt):
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        CheckpointReader(tmp_path)
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": {"a.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="a.weight in model-00001-of-00002.safetensors, but that file"):
        CheckpointReader(tmp_path)
    # a single .safetensors file path also works
    out, _, _ = tiny_ckpt
    assert "lm_head.weight" in CheckpointReader(out / SINGLE_FILE)


# ------------------------------------------- the loader on a hand-built module
class _Toy(nn.Module):
    """Plans of every shape: whole, row slice, column slice, fused, stacked experts, a buffer."""

    def __init__(self, rank: int = 0, size: int = 1):
        super().__init__()
        n = 8 // size
        self.whole = nn.Parameter(torch.zeros(4, 6))
        attach_plan(self.whole, "a.weight")
        self.row = nn.Parameter(torch.zeros(n, 6))
        attach_plan(self.row, rows("b.weight", rank * n, n))
        self.col = nn.Parameter(torch.zeros(6, n))
        attach_plan(self.col, cols("c.weight", rank * n, n))
        self.fused = nn.Parameter(torch.zeros(4 + n, 6))
        attach_plan(self.fused, plan("a.weight", rows("b.weight", rank * n, n)))
        self.stacked = nn.Parameter(torch.zeros(2, n, 6))
        attach_plan(self.stacked, plan(rows("e.0.weight", rank * n, n), rows("e.1.weight", rank * n, n)))
        self.register_buffer("bias", torch.zeros(8, dtype=torch.float64))
        attach_plan(self.bias, whole("bias"))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)  # never loaded


def _toy_ckpt(path):
    g = torch.Generator().manual_seed(0)
    sd = {k: torch.randn(*s, generator=g) for k, s in
          {"a.weight": (4, 6), "b.weight": (8, 6), "c.weight": (6, 8), "e.0.weight": (8, 6),
           "e.1.weight": (8, 6), "bias": (8,)}.items()}
    sd["b.weight"] = sd["b.weight"].to(torch.bfloat16)  # cast at load
    path.mkdir()
    save_file(sd, str(path / SINGLE_FILE))
    return sd


def test_loader_on_hand_built_module(tmp_path):
    sd = _toy_ckpt(tmp_path / "toy")
    for rank, size in ((0, 1), (0, 2), (1, 2)):
        m = _Toy(rank, size)
        report = load_checkpoint(m, tmp_path / "toy")
        n = 8 // size
        sl = slice(rank * n, (rank + 1) * n)
        assert torch.equal(m.whole, sd["a.weight"])
        assert torch.equal(m.row, sd["b.weight"][sl].float())
        assert torch.equal(m.col, sd["c.weight"][:, sl])
        assert torch.equal(m.fused, torch.cat([sd["a.weight"], sd["b.weight"][sl].float()]))
        assert torch.equal(m.stacked, torch.stack([sd["e.0.weight"][sl], sd["e.1.weight"][sl]]))
        assert m.bias.dtype == torch.float64 and torch.equal(m.bias, sd["bias"].double())
        assert report["tensors_loaded"] == 6
    # the TP-1 toy writes back the same checkpoint (fused + stacked split by plan)
    m = _Toy()
    load_checkpoint(m, tmp_path / "toy")
    back = load_file(str(save_model_as_checkpoint(m, tmp_path / "back") / SINGLE_FILE))
    assert back.keys() == sd.keys()
    for k in sd:
        assert torch.equal(back[k], sd[k].float() if k == "b.weight" else sd[k]), k


def test_loader_reports_plan_problems(tmp_path):
    _toy_ckpt(tmp_path / "toy")
    m = _Toy()
    m.unplanned = nn.Parameter(torch.zeros(2))
    attach_plan(m.col, LoadPlan((Shard("c.weight", 1, 4, 8),)))  # runs past the end
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(m, tmp_path / "toy")
    msg = str(e.value)
    assert "model tensor unplanned has no load_plan" in msg
    assert "checkpoint shape [6, 8] has no slice c.weight[dim 1: 4:12]" in msg


def test_hf_tensor_shape():
    cfg = load_preset("m3")
    assert hf_tensor_shape(cfg, "model.layers.5.self_attn.k_proj.weight") == (512, 6144)
    assert hf_tensor_shape(cfg, "model.layers.5.block_sparse_moe.experts.3.w2.weight") == (6144, 3072)
    assert hf_tensor_shape(cfg, "model.layers.0.mlp.up_proj.weight_scale_inv") == (96, 48)
    assert hf_tensor_shape(cfg, "model.norm.weight") is None
