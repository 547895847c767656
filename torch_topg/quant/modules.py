"""``torch_topg.quantize``: a model's linears replaced in place by :class:`QuantizedLinear`
(``topg::linear_q`` over a packed weight), and saving / loading the result.

A transform applied from outside, as gpt-fast does: the model's own code is unchanged,
each ``nn.Linear`` (the LM head only when asked) becomes a module with the same
``in_features`` / ``out_features`` / ``bias`` whose forward is ``linear_q``, and each
fused experts module (MoE) a :class:`~torch_topg.quant.experts.QuantizedExperts` whose
forward is ``fused_moe_q``.

Saved as one safetensors file (``torch_topg/utils/safetensors_file.py``): the model's
state dict, where a quantised linear contributes ``<name>.qweight`` (uint8) and, naming
its format, ``<name>.qformat`` (the format name's ASCII bytes, uint8); quantised experts
contribute ``<name>.qgate_up`` / ``<name>.qdown`` and their ``<name>.qformat``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

from torch_topg.formats import FORMATS, INT4_GROUPS, dequantize, get_format
from torch_topg.quant.experts import QuantizedExperts, experts_problem, is_experts
from torch_topg.quant.packing import quantize_weight
from torch_topg.utils.safetensors_file import read_safetensors, write_safetensors

#: ``method`` names of :func:`quantize` besides the format names themselves.
METHODS = ("int8", "int4")


class QuantizedLinear(torch.nn.Module):
    """``nn.Linear`` with a packed weight: ``forward(x) = linear_q(x, qweight, format, bias)``.

    Attributes:
        qweight: uint8 buffer ``[out_features, row_bytes(in_features)]``.
        bias: the float bias parameter (it follows ``model.to(dtype)``), or None.
        int8_activations: ``linear_q``'s option: activations rounded to int8 per block
            of 32 (integer dot products on the CPU, as llama.cpp; ~0.5% off).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        format: str,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        int8_activations: bool = False,
    ) -> None:
        super().__init__()
        self.int8_activations = int8_activations
        f = get_format(format)
        problem = f.k_problem(in_features)
        if problem is not None:
            raise ValueError(f"QuantizedLinear: in_features {in_features} must be {problem}")
        self.in_features, self.out_features, self.format = in_features, out_features, format
        shape = (out_features, f.row_bytes(in_features))
        self.register_buffer("qweight", torch.zeros(shape, dtype=torch.uint8, device=device))
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(
        cls, linear: torch.nn.Linear, format: str, int8_activations: bool = False
    ) -> QuantizedLinear:
        """Quantise ``linear``'s weight into ``format`` (its bias is kept in its dtype)."""
        w = linear.weight
        q = cls(
            linear.in_features,
            linear.out_features,
            format,
            bias=linear.bias is not None,
            device=w.device,
            dtype=w.dtype,
            int8_activations=int8_activations,
        )
        q.qweight.copy_(quantize_weight(w.detach(), format))
        if linear.bias is not None:
            q.bias.data.copy_(linear.bias.detach())
        return q

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight ``[out_features, in_features]`` the packed one stands for."""
        return dequantize(self.qweight, self.format, self.in_features)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        from torch_topg.ops.linear_q import linear_q

        bias = self.bias
        if bias is not None and bias.dtype != input.dtype:
            bias = bias.to(input.dtype)
        return linear_q(
            input, self.qweight, self.format, bias, int8_activations=self.int8_activations
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"format={self.format}, bias={self.bias is not None}, "
            f"int8_activations={self.int8_activations}"
        )


class QuantizedEmbedding(torch.nn.Module):
    """``nn.Embedding`` with packed rows: ``forward(ids) = embedding_q(ids, qweight, ...)``.

    The output dtype follows ``model.to(dtype)`` (an empty float buffer carries it).
    ``qweight`` may be the very buffer of a tied :class:`QuantizedLinear` LM head.
    ``embed_scale``: the output multiplied by it in the output dtype, as a scaled word
    embedding does (Gemma's ``sqrt(hidden_size)``: :func:`embedding_scale` of the module
    replaced).
    """

    def __init__(
        self,
        qweight: torch.Tensor,
        format: str,
        embedding_dim: int,
        embed_scale: float | None = None,
    ) -> None:
        super().__init__()
        self.format, self.embedding_dim = format, embedding_dim
        self.num_embeddings = qweight.shape[0]
        self.embed_scale = embed_scale
        self.register_buffer("qweight", qweight)
        self.register_buffer("dtype_ref", torch.empty(0, device=qweight.device), persistent=False)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        from torch_topg.ops.embedding_q import embedding_q

        out = embedding_q(
            input, self.qweight, self.format, self.embedding_dim, self.dtype_ref.dtype
        )
        if self.embed_scale is not None:  # the scale rounded to the dtype, as transformers
            out = out * torch.tensor(self.embed_scale, dtype=torch.float32).to(out.dtype)
        return out

    def extra_repr(self) -> str:
        scale = f", embed_scale={self.embed_scale:g}" if self.embed_scale is not None else ""
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.format}{scale}"


def embedding_scale(module: torch.nn.Module) -> float | None:
    """The constant a scaled word embedding multiplies its rows by (transformers'
    ``Gemma2TextScaledWordEmbedding`` and kin keep it as ``scalar_embed_scale`` and the
    buffer ``embed_scale``), or None for a plain ``nn.Embedding``."""
    scale = getattr(module, "scalar_embed_scale", None)
    if scale is None:
        buf = getattr(module, "embed_scale", None)
        if isinstance(buf, torch.Tensor) and buf.numel() == 1 and not buf.is_meta:
            scale = buf.item()
    return None if scale is None else float(scale)


def resolve_format(method: str, group_size: int = 64) -> str:
    """``"int8"`` -> ``int8``; ``"int4"`` -> ``int4_g<group_size>``; a format name as is."""
    if method == "int4":
        if group_size not in INT4_GROUPS:
            raise ValueError(
                f"quantize: group_size {group_size} is not one of "
                + ", ".join(map(str, INT4_GROUPS))
            )
        return f"int4_g{group_size}"
    if method in FORMATS:
        return method
    raise ValueError(
        f"quantize: unknown method {method!r}; expected 'int8', 'int4' (with group_size) "
        f"or a format: {', '.join(FORMATS)}"
    )


def _lm_head_names(model: torch.nn.Module) -> set[str]:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return {n for n, m in model.named_modules() if head is not None and m is head}


def _set(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def quantize(
    model: torch.nn.Module,
    method: str = "int8",
    *,
    group_size: int = 64,
    lm_head: bool = False,
    skip: Iterable[str] = (),
    int8_activations: bool = False,
    experts: bool = True,
) -> torch.nn.Module:
    """Replace ``model``'s ``nn.Linear`` modules in place by :class:`QuantizedLinear`, and
    its fused experts modules by :class:`QuantizedExperts`.

    Args:
        model: any module (a transformers causal LM, typically).
        method: ``"int8"`` (per output channel), ``"int4"`` (groupwise asymmetric, groups
            of ``group_size``: 32, 64 or 128), or a quantisable format name
            (``"q8_0"``, ``"q4_0"``, ``"q4_1"``, ``"int4_g32"``, ...).
        lm_head: also quantise the output embedding (``model.get_output_embeddings()``).
            It is skipped by default; a head tied to the input embedding stays tied.
        skip: module names (as in ``named_modules``) left unquantised.
        int8_activations: the modules round their activations to int8 per block of 32
            (``linear_q``'s option; faster CPU GEMV, ~0.5% off). Never on the LM head.
        experts: also quantise MoE experts (transformers 5 modules with 3-D
            ``gate_up_proj`` / ``down_proj``) that ``fused_moe`` can run.

    Returns:
        ``model``. A linear whose ``in_features`` the format cannot pack (GGUF formats
        need a multiple of 32) is left as it is, and so is an experts module whose sizes
        the format cannot pack or whose variant ``fused_moe`` does not cover (a bias, no
        gate, interleaved rows, a custom activation).
    """
    fmt = resolve_format(method, group_size)
    f = FORMATS[fmt]
    leave = set(skip) | (set() if lm_head else _lm_head_names(model))
    todo = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name not in leave
    ]
    heads = _lm_head_names(model)
    for name, m in todo:
        if f.k_problem(m.in_features) is None:
            act = int8_activations and name not in heads
            # a layer with its own packed form (a row-parallel shard: reduce, then bias)
            own = getattr(m, "quantized", None)
            q = own(fmt, act) if callable(own) else QuantizedLinear.from_linear(m, fmt, act)
            _set(model, name, q)
    if experts:
        for name, m in [(n, m) for n, m in model.named_modules() if is_experts(m)]:
            if name not in leave and experts_problem(m, fmt) is None:
                _set(model, name, QuantizedExperts.from_experts(m, fmt, int8_activations))
    return model


def quantized_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` plus one ``<name>.qformat`` per quantised module (experts
    whose down rows are in another format: ``"<format>,<down format>"``)."""
    state = dict(model.state_dict())
    for name, m in model.named_modules():
        if isinstance(m, (QuantizedLinear, QuantizedExperts)):
            key = f"{name}.qformat" if name else "qformat"
            fmt = m.format
            if isinstance(m, QuantizedExperts) and m.down_format != m.format:
                fmt = f"{fmt},{m.down_format}"
            state[key] = torch.tensor(list(fmt.encode()), dtype=torch.uint8)
    return state


def save_quantized(model: torch.nn.Module, path: str | os.PathLike[str]) -> None:
    """Write ``model`` (quantised or not) as one safetensors file at ``path``."""
    write_safetensors(path, quantized_state(model))


def load_quantized(
    model: torch.nn.Module, path: str | os.PathLike[str], *, strict: bool = True
) -> torch.nn.Module:
    """Load a file written by :func:`save_quantized` into ``model``, built from the same
    config (unquantised, e.g. ``AutoModelForCausalLM.from_config``): each linear the
    file quantised is replaced first, then the state dict is loaded (copied from the
    file's memory map). Returns ``model``."""
    tensors = read_safetensors(path)
    for key in [k for k in tensors if k == "qformat" or k.endswith(".qformat")]:
        name = key.removesuffix("qformat").removesuffix(".")
        fmt = bytes(tensors.pop(key).tolist()).decode()
        old = model.get_submodule(name)
        if is_experts(old) or isinstance(old, QuantizedExperts):
            fmt, _, down = fmt.partition(",")
            if isinstance(old, QuantizedExperts):
                q = QuantizedExperts(old.num_experts, old.hidden_dim, old.intermediate_dim,
                                     fmt, old.activation, old.int8_activations,
                                     down_format=down or None)  # fmt: skip
            else:
                q = QuantizedExperts.like(old, fmt, down_format=down or None)
            _set(model, name, q)
            continue
        if not isinstance(old, (torch.nn.Linear, QuantizedLinear)):
            raise ValueError(
                f"load_quantized: {path}: {name!r} is quantised ({fmt}) in the file but is "
                f"a {type(old).__name__} in the model"
            )
        p = next(old.parameters(), None)
        dtype = p.dtype if p is not None and p.is_floating_point() else None
        _set(
            model,
            name,
            QuantizedLinear(
                old.in_features, old.out_features, fmt, old.bias is not None, dtype=dtype
            ),
        )
    model.load_state_dict(tensors, strict=strict)
    return model
