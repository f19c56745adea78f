"""MiniMaxConfig: reading HF configs (M3, M3 inside VL, M2 old and new rope), presets, errors."""

from __future__ import annotations

import json

import pytest

from minimax_backend.model.config import MiniMaxConfig
from minimax_backend.model.config_error import ConfigError
from minimax_backend.model.presets import PRESET_NAMES, load_preset


def m3_text_dict(**over) -> dict:
    d = {
        "model_type": "minimax_m3_text",
        "vocab_size": 512,
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "use_gemma_norm": True,
        "rope_theta": 5e6,
        "rotary_dim": 32,
        "partial_rotary_factor": 0.5,
        "hidden_act": "swigluoai",
        "swiglu_alpha": 1.702,
        "swiglu_beta": 1.0,
        "swiglu_limit": 7.0,
        "use_qk_norm": True,
        "qk_norm_type": "per_head",
        "intermediate_size": 128,
        "dense_intermediate_size": 512,
        "shared_intermediate_size": 128,
        "n_shared_experts": 1,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "scoring_func": "sigmoid",
        "use_routing_bias": True,
        "routed_scaling_factor": 2.0,
        "num_mtp_modules": 1,
        "moe_layer_freq": [0, 0, 1, 1],
        "sparse_attention_config": {
            "use_sparse_attention": True,
            "sparse_num_index_heads": 4,
            "sparse_index_dim": 64,
            "sparse_topk_blocks": 16,
            "sparse_block_size": 128,
        },
        "tie_word_embeddings": False,
    }
    d.update(over)
    return d


def m2_old_dict(**over) -> dict:
    """The MiniMax-M2 hub config style: top-level rotary_dim / rope_theta."""
    d = {
        "model_type": "minimax_m2",
        "architectures": ["MiniMaxM2ForCausalLM"],
        "vocab_size": 512,
        "hidden_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "rotary_dim": 16,
        "rope_theta": 1e6,
        "hidden_act": "silu",
        "intermediate_size": 64,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "use_qk_norm": True,
        "qk_norm_type": "per_layer",
        "scoring_func": "sigmoid",
        "use_routing_bias": True,
        "routed_scaling_factor": 1.0,
        "shared_intermediate_size": 0,
        "use_mtp": True,
        "num_mtp_modules": 3,
        "max_position_embeddings": 196608,
        "quantization_config": {"quant_method": "fp8", "fmt": "float8_e4m3fn",
                                "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    }
    d.update(over)
    return d


# ------------------------------------------------------------------ M3
def test_m3_text_fields():
    c = MiniMaxConfig.from_hf_dict(m3_text_dict())
    assert c.model_type == "minimax_m3_text" and c.is_m3
    assert c.mlp_layer_types == ("dense", "dense", "moe", "moe")
    assert c.moe_layers == (2, 3) and c.dense_layers == (0, 1)
    # default sparse layers: every layer after the leading dense ones
    assert c.sparse_attention_layers == (2, 3)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk_blocks, c.index_block_size) == (4, 64, 16, 128)
    assert c.rotary_dim == 32 and c.rope_theta == 5e6
    assert c.use_gemma_norm and c.qk_norm_type == "per_head" and c.hidden_act == "swigluoai"
    assert c.shared_intermediate_size == 128 and c.n_shared_experts == 1
    assert c.routed_scaling_factor == 2.0 and c.norm_topk_prob
    assert c.quant_method is None and c.aux_hidden_state_layers == ()
    assert MiniMaxConfig.from_hf_dict(c.to_hf_dict()) == c


def test_m3_nested_in_vl():
    text = m3_text_dict()
    del text["model_type"]
    vl = {"model_type": "minimax_m3_vl", "text_config": text, "vision_config": {"hidden_size": 32},
          "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    c = MiniMaxConfig.from_hf_dict(vl)
    assert c == MiniMaxConfig.from_hf_dict(m3_text_dict()).replace(quant_method="fp8")


def test_m3_sparse_layer_forms_and_moe_freq_int():
    c = MiniMaxConfig.from_hf_dict(m3_text_dict(sparse_attention_config={"sparse_attention_freq": [0, 1, 0, 1]}))
    assert c.sparse_attention_layers == (1, 3)
    c = MiniMaxConfig.from_hf_dict(m3_text_dict(sparse_attention_config={"sparse_attention_layers": [3]}))
    assert c.sparse_attention_layers == (3,)
    c = MiniMaxConfig.from_hf_dict(m3_text_dict(sparse_attention_config={"use_sparse_attention": False}))
    assert c.sparse_attention_layers == ()
    d = m3_text_dict()
    del d["sparse_attention_config"]
    assert MiniMaxConfig.from_hf_dict(d).sparse_attention_layers == ()
    c = MiniMaxConfig.from_hf_dict(m3_text_dict(moe_layer_freq=1, first_k_dense_replace=1))
    assert c.mlp_layer_types == ("dense", "moe", "moe", "moe")
    # rotary_dim from partial_rotary_factor alone, and from rope_parameters
    d = m3_text_dict()
    del d["rotary_dim"]
    assert MiniMaxConfig.from_hf_dict(d).rotary_dim == 32
    d = m3_text_dict()
    for k in ("rotary_dim", "partial_rotary_factor", "rope_theta"):
        del d[k]
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}
    c = MiniMaxConfig.from_hf_dict(d)
    assert (c.rotary_dim, c.rope_theta) == (16, 1e4)


def test_m3_full_sparse_attention_config():
    """Every key of M3's sparse_attention_config is read (and written back)."""
    sc = {"use_sparse_attention": True, "sparse_num_index_heads": 2, "sparse_index_dim": 64,
          "sparse_block_size": 64, "sparse_topk_blocks": 8, "sparse_score_type": "max", "sparse_init_block": 1,
          "sparse_local_block": 2, "sparse_attention_freq": [0, 0, 1, 1], "sparse_disable_index_value": 1}
    c = MiniMaxConfig.from_hf_dict(m3_text_dict(sparse_attention_config=sc))
    assert c.sparse_attention_layers == (2, 3)
    assert (c.index_n_heads, c.index_head_dim, c.index_block_size, c.index_topk_blocks) == (2, 64, 64, 8)
    assert (c.index_init_blocks, c.index_local_blocks, c.index_score_type) == (1, 2, "max")
    assert MiniMaxConfig.from_hf_dict(c.to_hf_dict()) == c


def test_m3_as_transformers_writes_it():
    """MiniMaxM3VLTextConfig's saved form: model_type minimax_m3_vl_text, flat index_* names,
    layer_types / mlp_layer_types, and hidden_act rewritten to "silu" for a SwiGLU-OAI model."""
    d = m3_text_dict(model_type="minimax_m3_vl_text", hidden_act="silu",
                     layer_types=["full_attention", "minimax_m3_sparse", "full_attention", "minimax_m3_sparse"],
                     mlp_layer_types=["dense", "sparse", "sparse", "sparse"], index_n_heads=2, index_head_dim=64,
                     index_block_size=16, index_topk_blocks=4, index_local_blocks=1)
    for k in ("sparse_attention_config", "moe_layer_freq", "use_gemma_norm", "qk_norm_type", "n_shared_experts"):
        del d[k]
    c = MiniMaxConfig.from_hf_dict(d)
    assert c.is_m3 and c.hidden_act == "swigluoai"
    assert c.sparse_attention_layers == (1, 3) and c.mlp_layer_types == ("dense", "moe", "moe", "moe")
    assert (c.index_n_heads, c.index_block_size, c.index_topk_blocks, c.index_local_blocks) == (2, 16, 4, 1)
    assert c.use_gemma_norm and c.qk_norm_type == "per_head" and c.n_shared_experts == 1
    vl = MiniMaxConfig.from_hf_dict({"model_type": "minimax_m3_vl", "text_config": d})
    assert vl == c
    # M3's own legacy keys win over the flat ones, as transformers reads them
    d2 = dict(d, sparse_attention_config={"sparse_topk_blocks": 8, "sparse_local_block": 2})
    c2 = MiniMaxConfig.from_hf_dict(d2)
    assert (c2.index_topk_blocks, c2.index_local_blocks, c2.sparse_attention_layers) == (8, 2, (1, 3))


@pytest.mark.parametrize("sparse,field", [
    ({"sparse_score_type": "mean"}, "index_score_type"),
    ({"sparse_disable_index_value": 0}, "sparse_attention_config.sparse_disable_index_value"),
    ({"sparse_window": 3}, "sparse_attention_config.sparse_window"),
    ({"sparse_topk_blocks": 2, "sparse_local_block": 2, "sparse_init_block": 1}, "index_local_blocks"),
    ({"sparse_num_index_heads": 3}, "index_n_heads"),  # does not nest with 2 KV heads / 4 heads
    ({"sparse_index_dim": 16}, "index_head_dim"),  # smaller than rotary_dim 32
])
def test_sparse_attention_config_we_cannot_honour(sparse, field):
    with pytest.raises(ConfigError) as e:
        MiniMaxConfig.from_hf_dict(m3_text_dict(sparse_attention_config=sparse))
    assert e.value.field == field, str(e.value)


def test_unknown_per_layer_types_are_errors():
    with pytest.raises(ConfigError, match="layer 1: 'sliding_attention'") as e:
        MiniMaxConfig.from_hf_dict(m3_text_dict(layer_types=["full_attention", "sliding_attention"] * 2))
    assert e.value.field == "layer_types"
    with pytest.raises(ConfigError, match="layer 0: 'mixture'") as e:
        MiniMaxConfig.from_hf_dict(m3_text_dict(mlp_layer_types=["mixture"] * 4))
    assert e.value.field == "mlp_layer_types"


# ------------------------------------------------------------------ M2
def test_m2_old_hub_format():
    c = MiniMaxConfig.from_hf_dict(m2_old_dict())
    assert c.model_type == "minimax_m2" and not c.is_m3
    assert (c.rotary_dim, c.rope_theta) == (16, 1e6)
    assert c.mlp_layer_types == ("moe",) * 3 and c.dense_layers == ()
    assert not c.use_gemma_norm and c.qk_norm_type == "per_layer" and c.use_qk_norm
    assert c.hidden_act == "silu" and c.shared_intermediate_size == 0 and c.n_shared_experts == 0
    assert c.sparse_attention_layers == () and c.routed_scaling_factor == 1.0
    assert c.num_mtp_modules == 3 and c.quant_method == "fp8" and c.weight_block_size == (128, 128)
    assert MiniMaxConfig.from_hf_dict(c.to_hf_dict()) == c


def test_m2_new_rope_parameters_format():
    d = m2_old_dict()
    for k in ("rotary_dim", "rope_theta", "use_mtp", "num_mtp_modules", "quantization_config"):
        del d[k]
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}
    c = MiniMaxConfig.from_hf_dict(d)
    assert (c.rotary_dim, c.rope_theta, c.num_mtp_modules) == (16, 1e6, 0)
    assert c == MiniMaxConfig.from_hf_dict(m2_old_dict(use_mtp=False, quantization_config=None))


def test_m2_transformers_config_round_trip():
    transformers = pytest.importorskip("transformers")
    hf = transformers.MiniMaxM2Config(
        vocab_size=512, hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_local_experts=8, num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
    )
    c = MiniMaxConfig.from_hf_dict(hf.to_dict())
    assert (c.rotary_dim, c.rope_theta, c.head_dim, c.num_local_experts) == (16, 1e6, 32, 8)
    assert c.qk_norm_type == "per_layer" and not c.use_gemma_norm and c.hidden_act == "silu"
    # ...and transformers reads ours back to the same shapes
    back = transformers.MiniMaxM2Config.from_dict(c.to_hf_dict())
    assert back.rope_parameters["partial_rotary_factor"] == 0.5 and back.rope_parameters["rope_theta"] == 1e6
    assert (back.hidden_size, back.num_local_experts, back.head_dim) == (128, 8, 32)


# ------------------------------------------------------------------ presets
@pytest.mark.parametrize("name", PRESET_NAMES)
def test_presets_load_and_round_trip(name, tmp_path):
    c = load_preset(name)
    assert MiniMaxConfig.from_hf_dict(c.to_hf_dict()) == c
    c.to_json_file(tmp_path / "config.json")
    assert MiniMaxConfig.from_json_file(tmp_path) == c
    c.validate_for_parallel(1, 1)
    c.validate_for_parallel(2, 2)


def test_preset_facts():
    m3 = load_preset("m3")
    assert m3 == MiniMaxConfig()  # the dataclass defaults are the real M3
    assert (m3.hidden_size, m3.num_hidden_layers, m3.num_attention_heads, m3.num_key_value_heads) == (6144, 60, 64, 4)
    assert m3.dense_layers == (0, 1, 2) and m3.sparse_attention_layers == tuple(range(3, 60))
    assert (m3.num_local_experts, m3.num_experts_per_tok, m3.intermediate_size, m3.vocab_size) == (128, 4, 3072, 200064)
    tiny = load_preset("tiny-m3")
    assert tiny.mlp_layer_types == ("dense", "moe", "moe") and tiny.sparse_attention_layers == (1, 2)
    assert tiny.num_mtp_modules == 1
    fp8 = load_preset("tiny-m3-fp8")
    assert fp8.is_fp8 and fp8.head_dim == 128
    for tp, ep in ((1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4)):
        fp8.validate_for_parallel(tp, ep)
    assert load_preset("tiny-m2").model_type == "minimax_m2"
    sl = load_preset("m3-slice")
    assert sl.hidden_size == 6144 and sl.mlp_layer_types == ("dense",) * 3 + ("moe",) * 2
    with pytest.raises(ConfigError, match="preset"):
        load_preset("m4")


def test_replace_changes_depth_consistently():
    c = load_preset("tiny-m3").replace(num_hidden_layers=5)
    assert c.mlp_layer_types == ("dense", "moe", "moe", "moe", "moe")
    assert c.sparse_attention_layers == (1, 2, 3, 4)
    c = load_preset("tiny-m3").replace(num_hidden_layers=1)
    assert c.mlp_layer_types == ("dense",) and c.sparse_attention_layers == ()
    with pytest.raises(ConfigError, match="not_a_field"):
        load_preset("tiny-m3").replace(not_a_field=1)


# ------------------------------------------------------------------ errors
BAD_M3 = [
    ({"model_type": "llama"}, "model_type"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"vocab_size": -5}, "vocab_size"),
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ({"num_attention_heads": 4, "num_key_value_heads": 3}, "num_key_value_heads"),
    ({"head_dim": 0}, "head_dim"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"num_local_experts": 0}, "num_local_experts"),
    ({"intermediate_size": 0}, "intermediate_size"),
    ({"rotary_dim": 96, "partial_rotary_factor": None}, "rotary_dim"),
    ({"rotary_dim": 31, "partial_rotary_factor": None}, "rotary_dim"),
    ({"rotary_dim": 16}, "rotary_dim"),  # disagrees with partial_rotary_factor 0.5 x 64
    ({"partial_rotary_factor": 1.5, "rotary_dim": None}, "partial_rotary_factor"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_parameters.rope_type"),
    ({"moe_layer_freq": [0, 1, 1]}, "moe_layer_freq"),
    ({"moe_layer_freq": [0, 2, 1, 1]}, "moe_layer_freq"),
    ({"mlp_layer_types": ["dense", "moe", "moe"]}, "mlp_layer_types"),
    ({"mlp_layer_types": ["dense", "moe", "moe", "mlp"]}, "mlp_layer_types"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"qk_norm_type": "per_token"}, "qk_norm_type"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"rms_norm_eps": 0}, "rms_norm_eps"),
    ({"dense_intermediate_size": 0}, "dense_intermediate_size"),
    ({"shared_intermediate_size": 0}, "shared_intermediate_size"),
    ({"n_shared_experts": 2}, "n_shared_experts"),
    ({"sparse_attention_config": {"sparse_attention_layers": [1, 4]}}, "sparse_attention_layers"),
    ({"sparse_attention_config": {"sparse_attention_freq": [0, 1]}}, "sparse_attention_config.sparse_attention_freq"),
    ({"sparse_attention_config": {"sparse_num_index_heads": 0}}, "index_n_heads"),
    ({"aux_hidden_state_layers": [0, 4]}, "aux_hidden_state_layers"),
    ({"aux_hidden_state_layers": [1, 1]}, "aux_hidden_state_layers"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config.quant_method"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}}, "weight_block_size"),
    ({"num_mtp_modules": -1}, "num_mtp_modules"),
]


@pytest.mark.parametrize("over,field", BAD_M3, ids=[f for _, f in BAD_M3])
def test_config_errors_name_the_field(over, field):
    with pytest.raises(ConfigError) as e:
        MiniMaxConfig.from_hf_dict(m3_text_dict(**over))
    assert e.value.field == field, str(e.value)
    assert field in str(e.value)


def test_config_error_is_value_error_and_files(tmp_path):
    assert issubclass(ConfigError, ValueError)
    with pytest.raises(ConfigError, match="text_config"):
        MiniMaxConfig.from_hf_dict({"model_type": "minimax_m3_vl"})
    with pytest.raises(ConfigError, match="no config file"):
        MiniMaxConfig.from_json_file(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        MiniMaxConfig.from_json_file(tmp_path / "bad.json")
    (tmp_path / "config.json").write_text(json.dumps(m2_old_dict(hidden_act="relu")))
    with pytest.raises(ConfigError, match="hidden_act"):
        MiniMaxConfig.from_json_file(tmp_path)
    with pytest.raises(ConfigError, match="rotary_dim"):
        MiniMaxConfig().replace(rotary_dim=130)


def test_validate_for_parallel_errors():
    tiny = load_preset("tiny-m3")
    cases = [
        (tiny, 3, 1, "num_attention_heads", "4 heads are not divisible by tp_size 3"),
        (tiny, 4, 3, "ep_size", "ep_size 3 must divide tp_size 4"),
        (tiny.replace(num_attention_heads=6, num_key_value_heads=3, index_n_heads=3), 2, 1, "num_key_value_heads",
         "3 KV heads neither divide nor are divisible by tp_size 2"),
        (tiny.replace(num_local_experts=6), 4, 4, "num_local_experts", "6 experts are not divisible by ep_size 4"),
        (tiny.replace(intermediate_size=130), 4, 1, "intermediate_size", "MoE TP size 4 (tp_size 4 / ep_size 1)"),
        (tiny.replace(vocab_size=511), 2, 1, "vocab_size", "511"),
        (tiny.replace(dense_intermediate_size=510), 4, 4, "dense_intermediate_size", "510"),
        (tiny.replace(shared_intermediate_size=130), 4, 4, "shared_intermediate_size", "130"),
        (load_preset("tiny-m3-fp8").replace(intermediate_size=256), 4, 1, "intermediate_size",
         "= 64 is not a multiple of the weight block 128"),
        (tiny.replace(quant_method="fp8"), 2, 1, "num_key_value_heads", "k_proj/v_proj rows per rank = 64"),
        (tiny.replace(quant_method="fp8", head_dim=48), 1, 1,
         "num_attention_heads", "q_proj rows per rank (heads/tp * head_dim) = 192"),
        (load_preset("m3").replace(quant_method="fp8"), 32, 1, "shared_intermediate_size", "= 96"),
    ]
    for cfg, tp, ep, field, text in cases:
        with pytest.raises(ConfigError) as e:
            cfg.validate_for_parallel(tp, ep)
        assert e.value.field == field, (tp, ep, str(e.value))
        assert text in str(e.value), str(e.value)
    load_preset("m3").validate_for_parallel(8, 8)
    load_preset("m3").replace(quant_method="fp8").validate_for_parallel(8, 8)
    load_preset("m3").replace(quant_method="fp8").validate_for_parallel(8, 1)
    with pytest.raises(ConfigError, match="tp_size"):
        tiny.validate_for_parallel(0, 1)
