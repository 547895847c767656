"""Weight-only quantisation: packed formats, their de-quantisers and quantisers.

* :mod:`~torch_topg.formats`: the formats of ``topg::linear_q`` (GGUF q8_0, q4_0,
  q4_1, q4_k, q5_k, q6_k as stored in the file; groupwise ``int4_g{32,64,128}``; per-channel
  ``int8``) and :func:`dequantize`, bit-exact against gguf-py's de-quantiser;
* :mod:`~torch_topg.quant.packing`: :func:`quantize_weight`, float -> packed;
* :mod:`~torch_topg.quant.modules`: :func:`quantize` (a model's linears and MoE experts
  in place, also ``torch_topg.quantize``), :class:`QuantizedLinear`, :func:`save_quantized`,
  :func:`load_quantized`;
* :mod:`~torch_topg.quant.experts`: :class:`QuantizedExperts` (``topg::fused_moe_q``).

docs/quantization.md describes the layouts.
"""

from torch_topg.formats import (
    FORMATS,
    GGUF_FORMATS,
    OWN_FORMATS,
    QuantFormat,
    dequantize,
    get_format,
)
from torch_topg.quant.experts import QuantizedExperts
from torch_topg.quant.modules import (
    QuantizedLinear,
    load_quantized,
    quantize,
    save_quantized,
)
from torch_topg.quant.packing import quantize_weight

__all__ = [
    "FORMATS",
    "GGUF_FORMATS",
    "OWN_FORMATS",
    "QuantFormat",
    "QuantizedExperts",
    "QuantizedLinear",
    "dequantize",
    "get_format",
    "load_quantized",
    "quantize",
    "quantize_weight",
    "save_quantized",
]
