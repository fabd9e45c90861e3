"""A tiny Llama checkpoint with seeded random weights, written on demand.

Random weights (standard normal x 0.15, bf16; RMSNorm weights 1) make the
next token depend on the whole context, so a decode that received wrong or
no KV cache produces different tokens: the token-equality oracle can fail.
(vLLM's ``load_format="dummy"`` weights are too small for that.)
"""

from __future__ import annotations

import json
from pathlib import Path

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 1024,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def write_tiny_llama(path: Path, seed: int = 1234, max_positions: int | None = None) -> Path:
    """Write config.json and model.safetensors into ``path``; returns it.
    ``max_positions`` raises the longest context (2,048 by default)."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    c = CONFIG
    h, inter, heads, kv_heads, hd = (
        c["hidden_size"],
        c["intermediate_size"],
        c["num_attention_heads"],
        c["num_key_value_heads"],
        c["head_dim"],
    )
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.15).to(torch.bfloat16)

    tensors = {
        "model.embed_tokens.weight": rand(c["vocab_size"], h),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
        "lm_head.weight": rand(c["vocab_size"], h),
    }
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "self_attn.q_proj.weight": rand(heads * hd, h),
                p + "self_attn.k_proj.weight": rand(kv_heads * hd, h),
                p + "self_attn.v_proj.weight": rand(kv_heads * hd, h),
                p + "self_attn.o_proj.weight": rand(h, heads * hd),
                p + "mlp.gate_proj.weight": rand(inter, h),
                p + "mlp.up_proj.weight": rand(inter, h),
                p + "mlp.down_proj.weight": rand(h, inter),
                p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            }
        )
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = dict(CONFIG, max_position_embeddings=max_positions or CONFIG["max_position_embeddings"])
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


if __name__ == "__main__":
    import sys

    # tiny_model.py PATH [MAX_POSITIONS]
    print(write_tiny_llama(Path(sys.argv[1]), max_positions=int(sys.argv[2]) if len(sys.argv) > 2 else None))
