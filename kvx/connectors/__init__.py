"""Engine connectors: kvx inside vLLM and SGLang.

``kvx.connectors.kvcache`` (block geometry, tensor-parallel read plans) has
no engine dependency; ``kvx.connectors.vllm`` imports vLLM.
"""
