"""KV-cache shapes of well-known models, for the synthetic engine.

A shape gives what one token costs in KV per layer: ``planes`` (2: K and V;
1: an MLA latent) x ``kv_heads`` x ``head_dim`` x ``dtype`` bytes. The
numbers are the models' own ``config.json`` values (full attention on every
layer; DeepSeek-V3's latent is ``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64).
"""

from __future__ import annotations

import dataclasses

from kvx.errors import ConfigError

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "fp8": 1}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    planes: int = 2  # K and V; 1 for MLA

    def __post_init__(self) -> None:
        for field in ("layers", "kv_heads", "head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or not 1 <= value <= 1 << 16:
                raise ConfigError(f"model shape {field} must be 1..65536, not {value!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(
                f"model shape dtype must be one of {', '.join(DTYPE_BYTES)}, not {self.dtype!r}"
            )
        if self.planes not in (1, 2):
            raise ConfigError(f"model shape planes must be 1 (MLA) or 2 (K and V), not {self.planes!r}")
        if self.token_plane_bytes % 8:
            raise ConfigError(
                f"model shape {self.name}: {self.token_plane_bytes} bytes per token and plane; "
                "kv_heads x head_dim x dtype bytes must be a multiple of 8"
            )

    @property
    def token_plane_bytes(self) -> int:
        """One token's bytes in one plane of one layer."""
        return self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def token_bytes(self) -> int:
        """One token's KV bytes, all layers and planes."""
        return self.layers * self.planes * self.token_plane_bytes


PRESETS = {
    "tiny": ModelShape("tiny", layers=2, kv_heads=2, head_dim=64, dtype="float16"),
    "llama-3.1-8b": ModelShape("llama-3.1-8b", layers=32, kv_heads=8, head_dim=128),
    "llama-3.1-70b": ModelShape("llama-3.1-70b", layers=80, kv_heads=8, head_dim=128),
    "deepseek-v3": ModelShape("deepseek-v3", layers=61, kv_heads=1, head_dim=576, planes=1),
}
