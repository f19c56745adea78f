"""An external reference: a tiny random MiniMax-M2 made by HF transformers.

transformers' `MiniMaxM2ForCausalLM` (float32, tiny sizes, QK norm and routing
bias on) is saved with `save_pretrained` (safetensors, original checkpoint
names: block_sparse_moe.experts.E.w1/w2/w3, ...), loaded into OUR model with
our config reader and checkpoint loader, and both produce logits for the same
tokens at an odd token count. transformers' checkpoint names and math are the
ground truth.

Tolerance (float32): max |ours - HF| <= 1e-4 * max |HF| + 1e-5, i.e. about 1e-4
relative to the logits' scale (the two sum in different orders: fused QKV,
float32 router, expert accumulation order).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency")
MiniMaxM2Config = getattr(transformers, "MiniMaxM2Config", None)
MiniMaxM2ForCausalLM = getattr(transformers, "MiniMaxM2ForCausalLM", None)
if MiniMaxM2ForCausalLM is None:  # pragma: no cover
    pytest.skip(f"transformers {transformers.__version__} has no MiniMaxM2ForCausalLM", allow_module_level=True)

from minimax_backend.model.checkpoint_loader import load_checkpoint  # noqa: E402
from minimax_backend.model.config import MiniMaxConfig  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5
BATCH, TOKENS = 2, 7  # odd token count: not divisible by the TP size


def _inputs(vocab: int):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (BATCH, TOKENS), generator=g)
    pos = torch.arange(TOKENS).expand(BATCH, TOKENS)
    return ids, pos


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    err = (ours - ref).abs().max().item()
    bound = RTOL * ref.abs().max().item() + ATOL
    assert err <= bound, f"max |ours - HF| = {err:.3g} > {bound:.3g}"


@pytest.fixture(scope="module")
def hf_m2(tmp_path_factory):
    """(checkpoint dir, HF logits) of a tiny random transformers MiniMax-M2."""
    torch.manual_seed(0)
    cfg = MiniMaxM2Config(
        vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        use_qk_norm=True, qk_norm_type="per_layer", use_routing_bias=True, scoring_func="sigmoid",
        bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=512,
        initializer_range=0.2,
    )
    cfg._attn_implementation = "eager"
    model = MiniMaxM2ForCausalLM(cfg).float().eval()
    # HF initializes norms to 1 and the correction bias to 0: make them non-trivial,
    # so a wrong norm form or a bias in the wrong place shows in the logits.
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
        for layer in model.model.layers:
            layer.mlp.e_score_correction_bias.copy_(0.2 * torch.randn(cfg.num_local_experts, generator=g))
    out = tmp_path_factory.mktemp("hf_m2")
    model.save_pretrained(out, safe_serialization=True)
    ids, _ = _inputs(cfg.vocab_size)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    return out, ref


def test_hf_checkpoint_names(hf_m2):
    from safetensors import safe_open

    out, _ = hf_m2
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    for n in ("model.layers.0.block_sparse_moe.experts.3.w1.weight", "model.layers.1.block_sparse_moe.gate.weight",
              "model.layers.0.block_sparse_moe.e_score_correction_bias", "model.layers.0.self_attn.q_norm.weight",
              "lm_head.weight"):
        assert n in names, (n, sorted(names)[:20])


def test_hf_m2_config_reads(hf_m2):
    out, _ = hf_m2
    c = MiniMaxConfig.from_json_file(out)
    assert c.model_type == "minimax_m2" and c.rotary_dim == 8 and c.rope_theta == 10000.0
    assert c.qk_norm_type == "per_layer" and not c.use_gemma_norm and c.hidden_act == "silu"
    assert c.mlp_layer_types == ("moe", "moe") and c.shared_intermediate_size == 0
    assert c.routed_scaling_factor == 1.0 and c.num_mtp_modules == 0


def test_hf_m2_logits_tp1(hf_m2):
    from minimax_backend.model.minimax import build_model
    from minimax_backend.model.parallel import ParallelState

    out, ref = hf_m2
    cfg = MiniMaxConfig.from_json_file(out)
    model = build_model(cfg, ParallelState.single(), torch.float32, "cpu")
    load_checkpoint(model, out)
    with torch.no_grad():
        ours = model(*_inputs(cfg.vocab_size))
    _close(ours, ref)


def _tp_worker(rank, world, path, ep_sizes):
    from minimax_backend.model.minimax import build_model
    from minimax_backend.model.parallel import ParallelState

    cfg = MiniMaxConfig.from_json_file(path)
    out = {}
    for ep in ep_sizes:
        model = build_model(cfg, ParallelState.from_world(ep), torch.float32, "cpu")
        load_checkpoint(model, path)
        with torch.no_grad():
            out[ep] = model(*_inputs(cfg.vocab_size))
    return out


def test_hf_m2_logits_tp2(hf_m2):
    from multirank import run_multirank

    out, ref = hf_m2
    results = run_multirank(_tp_worker, 2, args=(str(out), (1, 2)), timeout=600)
    for rank, res in enumerate(results):
        for ep, logits in res.items():
            _close(logits, ref)
