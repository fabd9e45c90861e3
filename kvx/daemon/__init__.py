"""``kvx prefill`` and ``kvx decode``: kvx as a service on a node.

A daemon runs one engine (``synthetic``, kvx's own; ``vllm``; ``sglang``),
publishes it in the metadata service (``engine_info``: ``api_url``,
``admin_url``, ``draining``) so that ``kvx proxy --metadata`` routes to it,
serves an admin API (``/healthz``, ``/readyz``, ``/v1/status``,
``POST /v1/drain``, ``/metrics``) and drains on SIGTERM.

- :mod:`kvx.daemon.settings`: flags, ``KVX_*`` variables and a YAML file.
- :mod:`kvx.daemon.synthetic`: the synthetic engine (KV derived from the
  prompt, moved through kvx and checked byte for byte).
- :mod:`kvx.daemon.engines`: vLLM and SGLang as supervised child processes.
- :mod:`kvx.daemon.admin`, :mod:`kvx.daemon.metrics`: what operators see.
- :mod:`kvx.daemon.run`: the lifecycle (start, ready, drain, stop).
"""
