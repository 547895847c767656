"""Pallas (JAX) kernels of the topg ops for TPU: installed as ``torch_topg._tpu_kernels``.

One module per family: ``norm`` (rms_norm, fused_add_rms_norm), ``attention`` (flash-style
prefill), ``paged_attention`` (decode over the paged KV cache), ``moe`` (moe_topk and the
grouped-matmul fused_moe). Each public function takes JAX arrays with the shapes of the
torch op, block-size arguments with documented defaults and ``interpret`` (run the kernel
in Pallas interpret mode, on any JAX backend: how they are tested on the CPU).

Each module also exposes ``*_kernel`` functions: exactly one ``pallas_call`` on arrays
already in the kernel layout. Those are what the torch_xla bridge
(``torch_topg/tpu/_xla.py``) lowers to a TPU custom call, since torch_xla extracts the
Mosaic payload of a single ``pallas_call`` and does the surrounding work in torch.

This package imports JAX; nothing else in torch_topg imports it eagerly.
"""
