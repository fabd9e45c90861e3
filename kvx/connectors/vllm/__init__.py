"""kvx as a vLLM KV connector.

``"kv_connector_module_path": "kvx.connectors.vllm"`` finds ``KvxConnector``
here; with kvx installed, the ``vllm.general_plugins`` entry point registers
the name so ``"kv_connector": "KvxConnector"`` alone is enough. vLLM is
imported only when ``KvxConnector`` is looked up, so the settings module
(``kvx.connectors.vllm.config``) works without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvxConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvxConnector":
        try:
            from kvx.connectors.vllm.connector import KvxConnector
        except ImportError as exc:
            raise ImportError(
                f"KvxConnector needs vLLM ({exc}); install kvx into vLLM's environment"
            ) from exc
        return KvxConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
