"""Running a GGUF file's quantised tensors as they are: ``use_gguf_weights(model, path)``.

``model`` is the transformers model loaded from the same file (transformers de-quantises
it, in float32). Each of its linears, and the input embedding, whose weight is a
quantised tensor of the file is replaced by :class:`QuantizedLinear` /
:class:`QuantizedEmbedding` holding the file's packed rows. A tied LM head and the
embedding share one packed buffer (SmolLM2: the q8_0 ``token_embd``).

Which file tensor a module's weight came from is found from the data, not from names:
transformers renames tensors per architecture and, for Llama-style attention, permutes
the rows of ``attn_q`` / ``attn_k`` (llama.cpp's converter stores them in another rotary
order). Every row of every quantised file tensor is de-quantised and hashed (two 64-bit
hashes of its float32 bits); a weight's rows are looked up, which gives the tensor and
the row permutation (rows with equal values, as some unused token embeddings are, may
share one packed row). A module is replaced only when every row is found in one tensor:
its numbers stay the ones transformers loaded (tests/test_quant_gguf.py
checks the logits bit for bit).

The model's float copy exists during the swap (it is what is matched); loading straight
into packed modules without it is left to do.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from torch_topg.formats import BY_GGUF_TYPE, dequantize
from torch_topg.quant.modules import QuantizedEmbedding, QuantizedLinear, embedding_scale


@dataclass
class _FileTensor:
    name: str
    format: str
    k: int
    packed: torch.Tensor  # uint8 [rows, row_bytes]


def _row_keys(w: torch.Tensor) -> list[tuple[int, int]]:
    """Two 64-bit hashes per row of a float32 matrix (its bits, wrapped int64 sums)."""
    bits = w.contiguous().view(torch.int32).long()
    g = torch.Generator().manual_seed(0)
    mult = torch.randint(1, 2**62, (2, w.shape[1]), generator=g) | 1
    h = bits @ mult.T  # int64 arithmetic wraps: a hash, not a sum
    return list(map(tuple, h.tolist()))


def _file_tensors(path: str | os.PathLike[str]) -> list[_FileTensor]:
    import gguf

    out = []
    for t in gguf.GGUFReader(path).tensors:
        fmt = BY_GGUF_TYPE.get(int(t.tensor_type))
        if fmt is None or len(t.shape) != 2:
            continue
        k = int(t.shape[0])  # GGUF lists the innermost dimension first
        packed = torch.from_numpy(np.array(t.data)).reshape(int(t.shape[1]), -1)
        out.append(_FileTensor(t.name, fmt, k, packed))
    return out


def use_gguf_weights(
    model: torch.nn.Module, path: str | os.PathLike[str], int8_activations: bool = False
) -> dict[str, str]:
    """Swap ``model``'s linears and input embedding for packed modules over the GGUF
    file's quantised tensors (see the module docstring). ``model`` must hold the
    float32 weights transformers de-quantised from ``path``. ``int8_activations``: for
    every packed linear, the LM head included (``linear_q``'s option).

    Returns:
        module name -> ``"<file tensor> (<format>)"`` for every module replaced.
    """
    tensors = _file_tensors(path)
    index: dict[tuple[int, int], tuple[int, int]] = {}
    for ti, ft in enumerate(tensors):
        keys = _row_keys(dequantize(ft.packed, ft.format, ft.k))
        for row, key in enumerate(keys):
            index.setdefault(key, (ti, row))

    def match(w: torch.Tensor) -> tuple[_FileTensor, torch.Tensor] | None:
        if w.dtype != torch.float32 or w.dim() != 2:
            return None
        found = [index.get(k) for k in _row_keys(w.detach())]
        if not found or any(f is None for f in found) or len({f[0] for f in found}) != 1:
            return None
        ft = tensors[found[0][0]]
        rows = torch.tensor([f[1] for f in found])
        if ft.k != w.shape[1] or rows.numel() != ft.packed.shape[0]:
            return None
        return ft, ft.packed.index_select(0, rows).contiguous()

    replaced: dict[str, str] = {}
    by_weight: dict[int, torch.Tensor] = {}  # id(float weight) -> its packed buffer (ties)
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    for name, m in list(model.named_modules()):
        if isinstance(m, torch.nn.Linear) or (m is emb and isinstance(m, torch.nn.Embedding)):
            hit = match(m.weight)
            if hit is None:
                continue
            ft, packed = hit
            packed = by_weight.setdefault(id(m.weight), packed)
            if isinstance(m, torch.nn.Embedding):
                new: torch.nn.Module = QuantizedEmbedding(
                    packed, ft.format, ft.k, embed_scale=embedding_scale(m)
                )
            else:
                new = QuantizedLinear(
                    ft.k,
                    m.out_features,
                    ft.format,
                    m.bias is not None,
                    int8_activations=int8_activations,
                )
                new.qweight = packed  # the same buffer as a tied embedding
                if m.bias is not None:
                    new.bias.data.copy_(m.bias.detach())
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, new)
            replaced[name] = f"{ft.name} ({ft.format})"
    return replaced
