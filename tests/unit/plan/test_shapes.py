"""KV shapes from config.json values: the published bytes per token."""

from __future__ import annotations

import json

import pytest

from kvx.errors import ConfigError
from kvx.plan.shapes import PRESETS, load_shape
from tests.conftest import native_pass_only

# No byte path here: it runs in the KVX_NATIVE=1 pass only.
pytestmark = native_pass_only

# Values from each model's public config.json (only the fields the shape reads).
LLAMA_8B = {
    "model_type": "llama",
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_size": 4096,
    "torch_dtype": "bfloat16",
}
LLAMA_70B = {**LLAMA_8B, "num_hidden_layers": 80, "num_attention_heads": 64, "hidden_size": 8192}
LLAMA_405B = {**LLAMA_8B, "num_hidden_layers": 126, "num_attention_heads": 128, "hidden_size": 16384}
QWEN_72B = {
    "model_type": "qwen2",
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "hidden_size": 8192,
    "torch_dtype": "bfloat16",
    "sliding_window": 131072,
    "use_sliding_window": False,
    "max_window_layers": 70,
}
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "hidden_size": 7168,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "torch_dtype": "bfloat16",
}
GEMMA_2_9B = {
    "model_type": "gemma2",
    "num_hidden_layers": 42,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "hidden_size": 3584,
    "sliding_window": 4096,
    "torch_dtype": "float32",
}
GEMMA_3_27B = {
    "model_type": "gemma3",
    "torch_dtype": "bfloat16",
    "text_config": {
        "model_type": "gemma3_text",
        "num_hidden_layers": 62,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "head_dim": 128,
        "hidden_size": 5376,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
    },
}


def write(tmp_path, config, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize(
    "config, per_token",
    [
        (LLAMA_8B, 131_072),
        # Zhao et al., "Insights into DeepSeek-V3", ISCA 2025, Table 1:
        (LLAMA_70B, 327_680),
        (LLAMA_405B, 516_096),
        (QWEN_72B, 327_680),
        (DEEPSEEK_V3, 70_272),
    ],
)
def test_published_bytes_per_token(tmp_path, config, per_token):
    assert load_shape(write(tmp_path, config)).bytes_per_token() == per_token


def test_presets_match_the_configs(tmp_path):
    for name, config in (
        ("llama-3.1-8b", LLAMA_8B),
        ("llama-3.1-70b", LLAMA_70B),
        ("llama-3.1-405b", LLAMA_405B),
        ("qwen2.5-72b", QWEN_72B),
        ("deepseek-v3", DEEPSEEK_V3),
    ):
        assert PRESETS[name].bytes_per_token() == load_shape(write(tmp_path, config)).bytes_per_token()


def test_request_bytes_whole_blocks_and_tp_split():
    s = PRESETS["llama-3.1-70b"]
    # 1000 tokens = 63 blocks of 16 (the last one partly full) is sent whole.
    assert s.request_bytes(1000) == 63 * 16 * 327_680
    assert s.request_bytes(1008, tp=8) == 63 * 16 * 327_680 // 8
    # 8 KV heads over TP 16: each rank holds one head, replicated.
    assert s.request_bytes(1008, tp=16) == s.request_bytes(1008, tp=8)
    assert s.request_bytes(1008, pp=4) == 63 * 16 * 327_680 // 4
    assert s.request_bytes(1008, block_tokens=64) == 16 * 64 * 327_680


def test_mla_latent_is_replicated_on_every_tp_rank():
    s = PRESETS["deepseek-v3"]
    assert s.request_bytes(1024, tp=8) == s.request_bytes(1024) == 1024 * 70_272
    assert s.request_bytes(1024, pp=2) == 31 * 576 * 2 * 1024  # 31 of 61 layers on the larger stage


def test_sliding_layers_send_only_the_window(tmp_path):
    g2 = load_shape(write(tmp_path, GEMMA_2_9B))
    assert (g2.sliding_window, g2.sliding_layers, g2.dtype_bytes) == (4096, 21, 4)
    layer_block = 16 * 2 * 8 * 256 * 4
    # 8192 tokens: 512 blocks in the 21 global layers, 256 (the window, aligned) in the 21 sliding ones.
    assert g2.request_bytes(8192) == layer_block * (21 * 512 + 21 * 256)
    # Not aligned: the window's 4096 tokens touch 257 blocks.
    assert g2.request_bytes(8200) == layer_block * (21 * 513 + 21 * 257)
    # Shorter than the window: everything.
    assert g2.request_bytes(100) == layer_block * 42 * 7
    g3 = load_shape(write(tmp_path, GEMMA_3_27B))
    assert (g3.layers, g3.sliding_layers, g3.sliding_window) == (62, 52, 1024)
    qwen = load_shape(write(tmp_path, {**QWEN_72B, "use_sliding_window": True}))
    assert qwen.sliding_layers == 10  # layers 70..79
    listed = {**LLAMA_8B, "sliding_window": 512, "layer_types": ["sliding_attention", "full_attention"] * 16}
    assert load_shape(write(tmp_path, listed)).sliding_layers == 16
    mistral = load_shape(write(tmp_path, {**LLAMA_8B, "model_type": "mistral", "sliding_window": 4096}))
    assert mistral.sliding_layers == 32


@pytest.mark.parametrize(
    "config, message",
    [
        ({"num_attention_heads": 8, "torch_dtype": "bfloat16"}, "num_hidden_layers"),
        ({**LLAMA_8B, "torch_dtype": None}, "torch_dtype"),
        ({**LLAMA_8B, "torch_dtype": "int3"}, "dtype must be one of"),
        ({**LLAMA_8B, "hidden_size": 4095}, "does not split"),
        ({**LLAMA_8B, "num_key_value_heads": -1}, "positive whole number"),
        ({**LLAMA_8B, "head_dim": "big"}, "head_dim"),
        ({**LLAMA_8B, "sliding_window": 0}, "sliding_window"),
        ({**LLAMA_8B, "sliding_window": 64}, "does not say which layers"),
        ({**LLAMA_8B, "sliding_window": 64, "layer_types": ["full_attention"]}, "layer_types"),
        ({**DEEPSEEK_V3, "kv_lora_rank": None}, "kv_lora_rank"),
    ],
)
def test_odd_configs_are_refused_with_the_field_named(tmp_path, config, message):
    with pytest.raises(ConfigError, match=message):
        load_shape(write(tmp_path, config))


def test_bad_files_and_splits(tmp_path):
    with pytest.raises(ConfigError, match="neither a preset"):
        load_shape("no-such-model")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not JSON"):
        load_shape(str(tmp_path / "bad.json"))
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ConfigError, match="not an object"):
        load_shape(str(tmp_path / "list.json"))
    s = PRESETS["llama-3.1-70b"]
    with pytest.raises(ConfigError, match="do not split over TP 3"):
        s.request_bytes(16, tp=3)
    with pytest.raises(ConfigError, match="exceeds"):
        s.request_bytes(16, pp=81)
    assert load_shape("llama-3.1-70b", "fp8").bytes_per_token() == 327_680 // 2
