"""Every ``topg`` operator schema, declared once.

This is the only place an op's signature is written. Native kernels (``csrc/cpu``,
``csrc/cuda``) register implementations only (``TORCH_LIBRARY_IMPL``); the Python
side registers the fake kernels and the reference fallback against these names.

Layout conventions (see ``docs/ops.md`` for the full semantics):

* activations are row-major with the hidden size last;
* prefill attention uses ``[batch, seq, heads, head_dim]`` (dense) or
  ``[tokens, heads, head_dim]`` with ``cu_seqlens`` (ragged), like FlashAttention;
  only the last dimension has to be contiguous;
* the paged KV cache is ``[num_blocks, block_size, kv_heads, head_dim]``, in the
  query's dtype or int8 with float32 scales ``[num_blocks, block_size, kv_heads]``
  (``key_scale`` / ``value_scale``, one per token and kv head);
* attention ``sinks``: float32 ``[query_heads]``, one learned logit per query head that
  joins the softmax with no value (GPT-OSS); None = no sink;
* ``Tensor(a!)`` marks an argument the op writes in place.
"""

from __future__ import annotations

SCHEMAS: dict[str, str] = {
    # --- norms -------------------------------------------------------------------
    "rms_norm": "rms_norm(Tensor input, Tensor weight, float epsilon) -> Tensor",
    "fused_add_rms_norm": (
        "fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, "
        "float epsilon) -> ()"
    ),
    # --- positions ---------------------------------------------------------------
    "rotary_embedding": (
        "rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!)? key, "
        "int head_size, Tensor cos_sin_cache, bool is_neox) -> ()"
    ),
    # --- activations -------------------------------------------------------------
    "silu_and_mul": "silu_and_mul(Tensor input) -> Tensor",
    "gelu_and_mul": "gelu_and_mul(Tensor input, str approximate='none') -> Tensor",
    # --- attention ---------------------------------------------------------------
    "attention": (
        "attention(Tensor query, Tensor key, Tensor value, *, Tensor? cu_seqlens_q=None, "
        "Tensor? cu_seqlens_k=None, bool causal=False, float? scale=None, "
        "int window_left=-1, float softcap=0.0, Tensor? mask=None, int? max_seqlen_q=None, "
        "int? max_seqlen_k=None, Tensor? sinks=None) -> Tensor"
    ),
    "paged_attention": (
        "paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor seq_lens, *, Tensor? cu_seqlens_q=None, "
        "float? scale=None, int window_left=-1, float softcap=0.0, Tensor? key_scale=None, "
        "Tensor? value_scale=None, Tensor? sinks=None) -> Tensor"
    ),
    "reshape_and_cache": (
        "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, "
        "Tensor(b!) value_cache, Tensor slot_mapping, *, Tensor(c!)? key_scale=None, "
        "Tensor(d!)? value_scale=None) -> ()"
    ),
    # --- mixture of experts ------------------------------------------------------
    "moe_topk": (
        "moe_topk(Tensor router_logits, int top_k, *, str scoring='softmax', "
        "bool renormalize=False, Tensor? correction_bias=None) -> (Tensor, Tensor)"
    ),
    "fused_moe": (
        "fused_moe(Tensor hidden_states, Tensor w_gate_up, Tensor w_down, "
        "Tensor topk_weights, Tensor topk_ids, *, str activation='silu') -> Tensor"
    ),
    # --- dense linear ------------------------------------------------------------
    "linear": "linear(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor",
    # weight: uint8 [N, row bytes], K weights per row packed in `format` (torch_topg.quant)
    "linear_q": (
        "linear_q(Tensor input, Tensor weight, str format, Tensor? bias=None, *, "
        "bool int8_activations=False) -> Tensor"
    ),
    # w_gate_up: uint8 [E, 2I, row bytes of H], w_down: uint8 [E, H, row bytes of I]
    "fused_moe_q": (
        "fused_moe_q(Tensor hidden_states, Tensor w_gate_up, Tensor w_down, "
        "Tensor topk_weights, Tensor topk_ids, str format, *, str? down_format=None, "
        "str activation='silu', bool int8_activations=False) -> Tensor"
    ),
    "embedding_q": (
        "embedding_q(Tensor input, Tensor weight, str format, int embedding_dim, "
        "ScalarType dtype=float) -> Tensor"
    ),
    # --- collectives (torch.distributed; group_name is a c10d group name) ----------
    "all_reduce": "all_reduce(Tensor input, str group_name) -> Tensor",
    "fused_all_reduce_add_rms_norm": (
        "fused_all_reduce_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, "
        "float epsilon, str group_name) -> ()"
    ),
}

# Internal control ops: not part of the op library (no fake kernel, reference or wrapper),
# implemented only by the native extension.
# - The eager interception (``torch_topg.eager``, csrc/cpu/intercept.cpp): ``ops`` are aten
#   op names; the result lists what was registered, as "<aten op>.<dispatch key>".
# - The batch-invariant mode (csrc/cpu/modes.cpp; the engine's ``deterministic=True``)
#   and the CUDA index checks (``torch_topg.index_checks``): return the previous setting.
# - ``_cpu_kernels``: the instruction-set forms the CPU kernels chose at run time
#   (``torch_topg.modes.cpu_kernels``); ``_set_amx`` switches the AMX path
#   (``torch_topg.modes.set_amx``).
# - ``_cuda_<op>`` for each op of ``DISPATCHED_ON_CUDA``: topg's own CUDA kernel of that op
#   (csrc/cuda), with the op's schema. The op's CUDA key runs ``torch_topg.ops.dispatch``,
#   which picks among this kernel, torch's built-in ones and the Triton kernels.
INTERNAL_SCHEMAS: dict[str, str] = {
    "_enable_interception": "_enable_interception(str[] ops) -> str[]",
    "_disable_interception": "_disable_interception() -> ()",
    "_set_batch_invariant": "_set_batch_invariant(bool enabled) -> bool",
    "_set_index_checks": "_set_index_checks(bool enabled) -> bool",
    "_cpu_kernels": "_cpu_kernels() -> str[]",
    "_set_amx": "_set_amx(bool enabled) -> bool",
}

#: The ops whose CUDA key is a measured choice among several implementations
#: (``torch_topg.ops.dispatch``, docs/gpu.md "Dispatch"). ``linear_q`` and ``fused_moe_q``
#: are next: adding an op here, renaming its ``m.impl`` in csrc/cuda and giving it candidates
#: and a shape class in the dispatch package is all it takes.
DISPATCHED_ON_CUDA: tuple[str, ...] = ("attention", "paged_attention", "fused_moe", "linear")

#: The prefix of the internal op that holds topg's own CUDA kernel of a dispatched op.
CUDA_KERNEL_PREFIX = "_cuda_"


def cuda_kernel_op(name: str) -> str:
    """``"_cuda_<name>"``: the internal op holding topg's CUDA kernel of ``topg::<name>``."""
    return CUDA_KERNEL_PREFIX + name


for _name in DISPATCHED_ON_CUDA:  # the same schema under the prefixed name
    INTERNAL_SCHEMAS[cuda_kernel_op(_name)] = CUDA_KERNEL_PREFIX + SCHEMAS[_name]
