"""Test-environment fix for SGLang 0.5.23's mooncake backend on a CPU-only engine.

``MooncakeKVSender`` declares ``supports_host_tensor_indices = True``; for such
a sender the prefill scheduler copies the page indices into pinned memory and
records a CUDA event (sglang/srt/disaggregation/prefill.py, ``_send_kv_chunk``),
which on the CPU build of torch fails with "pin_memory=True requires a CUDA or
other accelerator backend" and kills the prefill scheduler at the first
request. With SGLANG_USE_CPU_ENGINE=1 this plugin (an AFTER hook on
``get_kv_class`` through SGLang's HookRegistry) turns the flag off on
MooncakeKVSender (only there: another backend's sender keeps what it declares),
so the prefill takes the plain path (``kv_to_page_indices``), as it does for
senders without the flag.

Loaded by SGLang's ``load_plugins()`` (launcher, scheduler and detokenizer
processes) through the ``sglang.srt.plugins`` entry point ``cpu_mooncake_sender``
declared in the sibling ``sglang_cpu_test_fixes-0.0.0.dist-info``; both are
found because tests/sglang_env/stubs is on PYTHONPATH. When SGLANG_PLUGINS
allow-lists plugins, include ``cpu_mooncake_sender`` for a mooncake pair.
"""

MOONCAKE_CONN = "sglang.srt.disaggregation.mooncake.conn"


def _after_get_kv_class(cls, *args, **kwargs):
    if (
        isinstance(cls, type)
        and cls.__module__ == MOONCAKE_CONN
        and cls.__name__ == "MooncakeKVSender"
        and cls.__dict__.get("supports_host_tensor_indices", False)
    ):
        from sglang.srt.utils import is_cpu

        if is_cpu():
            cls.supports_host_tensor_indices = False
    return None  # keep get_kv_class's result


def register():
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", _after_get_kv_class, HookType.AFTER)
