"""kvx as a vLLM KV connector (imports vLLM).

``"kv_connector_module_path": "kvx.connectors.vllm"`` finds ``KvxConnector``
here; with kvx installed, the ``vllm.general_plugins`` entry point registers
the name so ``"kv_connector": "KvxConnector"`` alone is enough.
"""

from kvx.connectors.vllm.connector import KvxConnector

__all__ = ["KvxConnector"]
