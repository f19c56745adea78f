"""Our model against Hugging Face transformers' own MiniMax code (float32, TP 1).

References no one here wrote: `MiniMaxM2ForCausalLM` and the text model of
`minimax_m3_vl` (`MiniMaxM3VLForCausalLM` with a `MiniMaxM3VLTextConfig`).
The HF state dict (fused expert tensors, HF module names) is translated to
checkpoint names, and our model is filled through its own load plans by a
ten-line loader here, so this checks the model's semantics and plan names
independently of model/checkpoint_loader.py (tests/test_hf_reference.py covers that
path with real safetensors files).

HF's M3 sparse layers run the indexer; with <= 16 blocks of 128 keys every
block is selected, so they are dense attention here, as ours is.
"""

from __future__ import annotations

import re

import pytest
import torch

from conftest import tiny_m2_config, tiny_m3_config

from minimax_backend.model.minimax import build_model
from minimax_backend.model.parallel import ParallelState
from minimax_backend.model.weights import get_plan

transformers = pytest.importorskip("transformers")


def _randomize(model, gemma: bool):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name:
                continue
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(0.1 * noise if gemma else 1 + 0.1 * noise)
            elif "e_score_correction_bias" in name:
                p.copy_(0.05 * noise)
            elif name.endswith("gate.weight"):
                p.copy_(noise / p.shape[-1] ** 0.5 * 2)
            else:
                p.copy_(noise * (1.0 if "embed" in name else 1 / p.shape[-1] ** 0.5))


def _to_checkpoint_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF in-memory names (fused experts, `mlp.`) -> checkpoint names (`block_sparse_moe.`, w1/w2/w3)."""
    out = {}
    for k, v in sd.items():
        m = re.match(r"(model\.layers\.\d+)\.mlp\.(.*)", k)
        if m is None:
            out[k.replace(".self_attn.indexer.", ".self_attn.index_")] = v
            continue
        layer, rest = m.groups()
        moe = f"{layer}.block_sparse_moe"
        if rest == "experts.gate_up_proj":
            n = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{moe}.experts.{e}.w1.weight"], out[f"{moe}.experts.{e}.w3.weight"] = v[e, :n], v[e, n:]
        elif rest == "experts.down_proj":
            for e in range(v.shape[0]):
                out[f"{moe}.experts.{e}.w2.weight"] = v[e]
        elif rest in ("gate.weight",):
            out[f"{moe}.gate.weight"] = v
        elif rest in ("e_score_correction_bias", "gate.e_score_correction_bias"):
            out[f"{moe}.e_score_correction_bias"] = v
        elif rest.startswith("shared_experts."):
            if "gate_up_proj" in rest:
                n = v.shape[0] // 2
                out[f"{moe}.shared_experts.gate_proj.weight"] = v[:n]
                out[f"{moe}.shared_experts.up_proj.weight"] = v[n:]
            else:
                out[f"{moe}.{rest}"] = v
        elif rest == "gate_up_proj.weight":  # dense MLP
            n = v.shape[0] // 2
            out[f"{layer}.mlp.gate_proj.weight"], out[f"{layer}.mlp.up_proj.weight"] = v[:n], v[n:]
        else:
            out[k] = v
    return out


@torch.no_grad()
def _load(model, ckpt: dict[str, torch.Tensor]) -> None:
    used = set()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        plan = get_plan(t)
        if plan is None:
            continue
        parts = []
        for p in plan.pieces:
            assert p.name in ckpt, f"{name}: {p.name} not in the HF checkpoint"
            parts.append(ckpt[p.name][p.index(ckpt[p.name].dim())])
            used.add(p.name)
        t.copy_(torch.cat(parts, dim=plan.cat_dim))
    assert used == set(ckpt), f"unused HF tensors: {sorted(set(ckpt) - used)[:5]}"


def _compare(hf_model, ours, vocab):
    ids = torch.randint(0, vocab, (2, 13), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(13).expand(2, -1)
    with torch.no_grad():
        ref = hf_model(input_ids=ids, position_ids=pos).logits
        out = ours(ids, pos)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_m2_matches_transformers():
    from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

    cfg = tiny_m2_config()
    hf_cfg = MiniMaxM2Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rotary_dim=cfg.rotary_dim,
        # Explicit: older transformers (5.17) ignore a bare rotary_dim and rotate the whole head.
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                         "partial_rotary_factor": cfg.rotary_dim / cfg.head_dim},
        num_local_experts=cfg.num_local_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        rms_norm_eps=cfg.rms_norm_eps, bos_token_id=None, eos_token_id=None,
    )
    hf_cfg._attn_implementation = "eager"
    hf = MiniMaxM2ForCausalLM(hf_cfg).float().eval()
    _randomize(hf, gemma=False)
    ours = build_model(cfg, ParallelState.single(), torch.float32)
    _load(ours, _to_checkpoint_names(hf.state_dict()))
    _compare(hf, ours, cfg.vocab_size)


def _hf_m3(cfg, mod, MiniMaxM3VLTextConfig):
    hf_cfg = MiniMaxM3VLTextConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        dense_intermediate_size=cfg.dense_intermediate_size, shared_intermediate_size=cfg.shared_intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rotary_dim=cfg.rotary_dim,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                         "partial_rotary_factor": cfg.rotary_dim / cfg.head_dim},
        num_local_experts=cfg.num_local_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        routed_scaling_factor=cfg.routed_scaling_factor, rms_norm_eps=cfg.rms_norm_eps,
        swiglu_limit=cfg.swiglu_limit,
        mlp_layer_types=["sparse" if t == "moe" else "dense" for t in cfg.mlp_layer_types],
        layer_types=["minimax_m3_sparse" if i in cfg.sparse_attention_layers else "full_attention"
                     for i in range(cfg.num_hidden_layers)],
        index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim,
        bos_token_id=None, eos_token_id=None,
    )
    hf_cfg._attn_implementation = "eager"
    hf = mod.MiniMaxM3VLForCausalLM(hf_cfg).float().eval()
    _randomize(hf, gemma=True)
    return hf


def test_m3_matches_transformers():
    mod = pytest.importorskip("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl")
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig

    cfg = tiny_m3_config(num_mtp_modules=0)
    hf = _hf_m3(cfg, mod, MiniMaxM3VLTextConfig)
    ours = build_model(cfg, ParallelState.single(), torch.float32)
    _load(ours, _to_checkpoint_names(hf.state_dict()))
    _compare(hf, ours, cfg.vocab_size)


def test_m3_swiglu_clamp_matches_transformers():
    """SwiGLU-OAI's clamp at work: at limit 0.5 most gate / up values cross it. Ours matches
    transformers there, and the same model without the clamp does not."""
    mod = pytest.importorskip("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl")
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig

    cfg = tiny_m3_config(num_mtp_modules=0, swiglu_limit=0.5)
    hf = _hf_m3(cfg, mod, MiniMaxM3VLTextConfig)
    ckpt = _to_checkpoint_names(hf.state_dict())
    ours = build_model(cfg, ParallelState.single(), torch.float32)
    _load(ours, ckpt)
    crossed = []
    hook = ours.layers[0].mlp.gate_up_proj.register_forward_hook(
        lambda m, i, o: crossed.append((o.abs() > cfg.swiglu_limit).float().mean().item()))
    _compare(hf, ours, cfg.vocab_size)
    hook.remove()
    assert crossed and crossed[0] > 0.2, crossed
    unclamped = build_model(cfg.replace(swiglu_limit=1e30), ParallelState.single(), torch.float32)
    _load(unclamped, ckpt)
    with pytest.raises(AssertionError):
        _compare(hf, unclamped, cfg.vocab_size)
