"""vLLM general plugin: registers ``KvxConnector`` with vLLM's connector factory.

vLLM loads general plugins in every process it starts; registering twice
raises in the factory, so this checks first. The package imports nothing of
vLLM until ``KvxConnector`` is looked up, so loading the plugin imports no
more of vLLM than the factory.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

NAME = "KvxConnector"


def register() -> None:
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError as exc:  # vLLM without the KV-transfer package: nothing to plug into
        logger.debug("kvx vLLM plugin inactive: %s", exc)
        return
    if NAME in KVConnectorFactory._registry:
        return
    KVConnectorFactory.register_connector(NAME, "kvx.connectors.vllm.connector", NAME)
