"""What one request's KV cache weighs: a model's KV shape.

A shape comes from a Hugging Face ``config.json`` or from a preset name. One
token costs ``planes`` (2: K and V; 1: an MLA latent) x ``kv_heads`` x
``head_dim`` x dtype bytes in each layer. Sliding-window layers keep only the
blocks still inside their window, and only those are sent.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from kvx.daemon.shapes import DTYPE_BYTES
from kvx.daemon.shapes import PRESETS as DAEMON_PRESETS
from kvx.errors import ConfigError

# The MLA models: one latent of kv_lora_rank + qk_rope_head_dim per token and
# layer, the same on every tensor-parallel rank.
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")
CONFIG_BYTES_MAX = 4 << 20


@dataclasses.dataclass(frozen=True)
class KVShape:
    """A model's KV cache per token: ``layers`` layers, of which
    ``sliding_layers`` attend only to the last ``sliding_window`` tokens."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    planes: int = 2
    sliding_window: int | None = None
    sliding_layers: int = 0

    def __post_init__(self) -> None:
        for field in ("layers", "kv_heads", "head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1 << 20:
                raise ConfigError(
                    f"model {self.name}: {field} must be a whole number 1..1048576, not {value!r}"
                )
        if self.dtype_bytes not in (1, 2, 4):
            raise ConfigError(f"model {self.name}: dtype_bytes must be 1, 2 or 4, not {self.dtype_bytes!r}")
        if self.planes not in (1, 2):
            raise ConfigError(
                f"model {self.name}: planes must be 1 (MLA) or 2 (K and V), not {self.planes!r}"
            )
        if not 0 <= self.sliding_layers <= self.layers:
            raise ConfigError(
                f"model {self.name}: sliding_layers must be 0..{self.layers}, not {self.sliding_layers!r}"
            )
        if self.sliding_layers and (self.sliding_window is None or self.sliding_window < 1):
            raise ConfigError(f"model {self.name}: sliding layers need a sliding_window of at least 1 token")

    @property
    def mla(self) -> bool:
        return self.planes == 1

    def bytes_per_token(self) -> int:
        """One token's KV bytes over all layers, as if every layer kept it."""
        return self.layers * self.planes * self.kv_heads * self.head_dim * self.dtype_bytes

    def heads_per_rank(self, tp: int) -> int:
        """KV heads one tensor-parallel rank holds: the heads split over the
        ranks, one (replicated) per rank when there are fewer heads than
        ranks, all of them for an MLA latent."""
        _check_split("tp", tp)
        if self.mla:
            return self.kv_heads
        if self.kv_heads >= tp:
            if self.kv_heads % tp:
                raise ConfigError(f"model {self.name}: {self.kv_heads} KV heads do not split over TP {tp}")
            return self.kv_heads // tp
        if tp % self.kv_heads:
            raise ConfigError(f"model {self.name}: TP {tp} is not a multiple of its {self.kv_heads} KV heads")
        return 1

    def layers_per_stage(self, pp: int) -> tuple[int, int]:
        """(full-attention layers, sliding layers) of the largest pipeline stage."""
        _check_split("pp", pp)
        if pp > self.layers:
            raise ConfigError(f"model {self.name}: PP {pp} exceeds its {self.layers} layers")
        full = self.layers - self.sliding_layers
        return math.ceil(full / pp), math.ceil(self.sliding_layers / pp)

    def request_bytes(self, tokens: int, tp: int = 1, pp: int = 1, block_tokens: int = 16) -> int:
        """Bytes one rank (of the largest pipeline stage) sends for a prompt of
        ``tokens``: whole blocks of ``block_tokens``."""
        if not isinstance(tokens, int) or tokens < 0:
            raise ConfigError(f"prompt tokens must be a whole number >= 0, not {tokens!r}")
        if not isinstance(block_tokens, int) or not 1 <= block_tokens <= 1 << 16:
            raise ConfigError(f"block size must be 1..65536 tokens, not {block_tokens!r}")
        block_layer_bytes = (
            block_tokens * self.planes * self.heads_per_rank(tp) * self.head_dim * self.dtype_bytes
        )
        full, sliding = self.layers_per_stage(pp)
        blocks = -(-tokens // block_tokens)
        return block_layer_bytes * (full * blocks + sliding * self.window_blocks(tokens, block_tokens))

    def window_blocks(self, tokens: int, block_tokens: int) -> int:
        """Blocks of a sliding layer still holding one of the last
        ``sliding_window`` tokens of a prompt of ``tokens``."""
        if tokens == 0 or self.sliding_window is None:
            return -(-tokens // block_tokens)
        first = max(0, tokens - self.sliding_window) // block_tokens
        return (tokens - 1) // block_tokens - first + 1


def _check_split(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1024:
        raise ConfigError(f"{name} must be a whole number 1..1024, not {value!r}")


def _from_daemon(name: str) -> KVShape:
    s = DAEMON_PRESETS[name]
    return KVShape(name, s.layers, s.kv_heads, s.head_dim, DTYPE_BYTES[s.dtype], s.planes)


# Presets: the synthetic engine's shapes, and a few more; values from each
# model's config.json.
PRESETS: dict[str, KVShape] = {name: _from_daemon(name) for name in DAEMON_PRESETS}
PRESETS.update(
    {
        "llama-3.1-405b": KVShape("llama-3.1-405b", layers=126, kv_heads=8, head_dim=128),
        "qwen2.5-72b": KVShape("qwen2.5-72b", layers=80, kv_heads=8, head_dim=128),
        "qwen2.5-7b": KVShape("qwen2.5-7b", layers=28, kv_heads=4, head_dim=128),
        "mistral-7b-v0.1": KVShape(
            "mistral-7b-v0.1", layers=32, kv_heads=8, head_dim=128, sliding_window=4096, sliding_layers=32
        ),
        "gemma-2-27b": KVShape(
            "gemma-2-27b", layers=46, kv_heads=16, head_dim=128, sliding_window=4096, sliding_layers=23
        ),
        "gemma-3-27b": KVShape(
            "gemma-3-27b", layers=62, kv_heads=16, head_dim=128, sliding_window=1024, sliding_layers=52
        ),
    }
)


def load_shape(spec: str, dtype: str | None = None) -> KVShape:
    """A preset name, or the path of a Hugging Face config.json. ``dtype``
    (a name in DTYPE_BYTES) overrides the config's, e.g. for an fp8 KV cache."""
    if spec in PRESETS and not os.path.exists(spec):
        shape = PRESETS[spec]
        if dtype is not None:
            shape = dataclasses.replace(shape, dtype_bytes=_dtype_bytes(dtype, spec))
        return shape
    if not os.path.isfile(spec):
        raise ConfigError(f"model {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json file")
    try:
        with open(spec, "rb") as f:
            raw = f.read(CONFIG_BYTES_MAX + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read {spec}: {exc}") from None
    if len(raw) > CONFIG_BYTES_MAX:
        raise ConfigError(f"{spec} is over {CONFIG_BYTES_MAX >> 20} MiB; is it a config.json?")
    try:
        config = json.loads(raw)
    except RecursionError:
        raise ConfigError(f"{spec} is nested too deeply to be a config.json") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{spec} is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{spec} holds a JSON {type(config).__name__}, not an object")
    return shape_from_config(config, os.path.basename(os.path.dirname(os.path.abspath(spec))) or spec, dtype)


def _dtype_bytes(dtype: Any, where: str) -> int:
    names = {**DTYPE_BYTES, "float8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "half": 2, "float": 4}
    if not isinstance(dtype, str) or dtype.removeprefix("torch.") not in names:
        raise ConfigError(f"{where}: dtype must be one of {', '.join(names)}, not {dtype!r}")
    return names[dtype.removeprefix("torch.")]


def _int(config: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = config.get(key)
    if value is None:
        if default is not None:
            return default
        raise ConfigError(f"{where}: config.json has no {key!r}; is it a decoder LLM's config?")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{where}: {key!r} must be a positive whole number, not {value!r}")
    return value


def shape_from_config(config: dict[str, Any], name: str, dtype: str | None = None) -> KVShape:
    """The KV shape a Hugging Face config.json (as a dict) describes."""
    where = f"model {name}"
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        # Multimodal configs (Gemma-3, Llama-4) keep the language model's under text_config.
        outer_dtype = config.get("torch_dtype") or config.get("dtype")
        config = {"torch_dtype": outer_dtype, **config["text_config"]}
    layers = _int(config, "num_hidden_layers", where)
    dtype_name = dtype or config.get("torch_dtype") or config.get("dtype")
    if dtype_name is None:
        raise ConfigError(f"{where}: config.json has no torch_dtype; pass the KV dtype (--kv-dtype bfloat16)")
    dtype_bytes = _dtype_bytes(dtype_name, where)
    model_type = config.get("model_type", "")
    if not isinstance(model_type, str):
        raise ConfigError(f"{where}: 'model_type' must be a string, not {model_type!r}")
    if model_type in MLA_MODEL_TYPES or config.get("kv_lora_rank"):
        latent = _int(config, "kv_lora_rank", where) + _int(config, "qk_rope_head_dim", where)
        return KVShape(name, layers, kv_heads=1, head_dim=latent, dtype_bytes=dtype_bytes, planes=1)
    heads = _int(config, "num_attention_heads", where)
    kv_heads = _int(config, "num_key_value_heads", where, default=heads)
    head_dim = config.get("head_dim")
    if head_dim is None:
        hidden = _int(config, "hidden_size", where)
        if hidden % heads:
            raise ConfigError(f"{where}: hidden_size {hidden} does not split over {heads} attention heads")
        head_dim = hidden // heads
    elif not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 1:
        raise ConfigError(f"{where}: 'head_dim' must be a positive whole number, not {head_dim!r}")
    window, sliding = _sliding(config, layers, model_type, where)
    return KVShape(name, layers, kv_heads, head_dim, dtype_bytes, 2, window, sliding)


def _sliding(config: dict[str, Any], layers: int, model_type: str, where: str) -> tuple[int | None, int]:
    """(window, sliding layers): from ``layer_types`` when the config has it
    (recent transformers write it for every family), else by family."""
    window = config.get("sliding_window")
    if window is None:
        return None, 0
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ConfigError(
            f"{where}: 'sliding_window' must be a positive whole number or null, not {window!r}"
        )
    types = config.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers:
            raise ConfigError(f"{where}: 'layer_types' must list one type for each of the {layers} layers")
        return window, sum(1 for t in types if t == "sliding_attention")
    if model_type == "gemma2":
        return window, (layers + 1) // 2  # even layers slide
    if model_type.startswith("gemma3"):
        pattern = _int(config, "sliding_window_pattern", where, default=6)
        return window, layers - layers // pattern  # every pattern-th layer is global
    if "use_sliding_window" in config:  # Qwen2/Qwen3: layers from max_window_layers on slide
        if not config["use_sliding_window"]:
            return None, 0
        first = _int(config, "max_window_layers", where, default=0) if config.get("max_window_layers") else 0
        return window, max(0, layers - min(first, layers))
    if model_type in ("mistral", "mixtral"):
        return window, layers
    raise ConfigError(
        f"{where}: sliding_window is set but model_type {model_type!r} does not say which layers "
        "slide; add 'layer_types' to the config"
    )
