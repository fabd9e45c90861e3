"""Test-environment stand-in for ``sgl_kernel`` (package sglang-kernel), which has
no CPU build on PyPI.

With SGLANG_USE_CPU_ENGINE=1, SGLang 0.5.23 imports these names from
``sgl_kernel`` at module level (``if _is_cpu: from sgl_kernel import ...``) and
calls them only on paths a plain engine or a prefill/decode pair on the
torch_native backend never takes (speculative decoding, paged KV moves). They
raise if ever called. Every other ``sgl_kernel`` import in SGLang is guarded or
has a fallback (``sgl_kernel.scalar_type``, ``sgl_kernel.allreduce`` stay absent).

Nothing is registered under ``torch.ops.sgl_kernel``: SGLang's Intel AMX backend
probes ``torch.ops.sgl_kernel.convert_weight_packed`` and so stays off, on any CPU.

Put the parent directory (tests/sglang_env/stubs) on PYTHONPATH; see
scripts/sglang_env.sh.
"""

__version__ = "0.0.0+stub"


def _not_on_this_build(name):
    def kernel(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name}: this is the test-environment stub of sgl_kernel "
            "(tests/sglang_env/stubs), which has no kernels"
        )

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


# sglang/srt/mem_cache/allocation.py
assign_req_to_token_pool_cpu = _not_on_this_build("assign_req_to_token_pool_cpu")
# sglang/kernels/ops/kvcache/cache_move.py
copy_all_layer_kv_cache_cpu = _not_on_this_build("copy_all_layer_kv_cache_cpu")
# sglang/kernels/ops/speculative/cache_locs.py
assign_draft_cache_locs_contiguous_cpu = _not_on_this_build("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _not_on_this_build("assign_extend_cache_locs_cpu")
# sglang/kernels/ops/speculative/eagle.py
fill_accept_out_cache_loc_cpu = _not_on_this_build("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _not_on_this_build("fill_bonus_tokens_cpu")
# sglang/kernels/ops/speculative/spec_tree.py
build_tree_kernel_efficient_cpu = _not_on_this_build("build_tree_kernel_efficient_cpu")
verify_tree_greedy_cpu = _not_on_this_build("verify_tree_greedy_cpu")
