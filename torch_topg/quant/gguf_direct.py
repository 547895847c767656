"""A GGUF file straight into a model with packed modules: no de-quantised copy.

``quantization="gguf"`` used to load the file through transformers (which de-quantises
every tensor to float32) and then find each module's packed rows by hashing
(:mod:`torch_topg.quant.gguf_model`): about 40 s and a float copy of every weight for
SmolLM2. For the architectures whose tensor names are known here, :func:`load_packed`
builds the transformers model on the ``meta`` device and fills it from the file:

* quantised 2-D tensors become :class:`QuantizedLinear` / :class:`QuantizedEmbedding`
  over the file's rows (a tied LM head shares the embedding's buffer);
* float tensors (norms, biases, an F16 / F32 linear) are copied in the model dtype;
* Llama-architecture files store ``attn_q`` / ``attn_k`` rows in another rotary order
  (llama.cpp's converter permutes them per head: rows ``(i, j)`` of a head's two halves
  become ``(j, i)``); the rows are put back, which for packed rows is a row gather.
* Gemma 2 files name the layer norms by position (``ffn_norm`` is the pre-FFN norm,
  ``post_attention_norm`` / ``post_ffw_norm`` the norms after each block) and store every
  RMSNorm weight plus one (Gemma scales by ``1 + w``; llama.cpp's converter folds the one
  in): the one is taken off again in float32, as transformers' GGUF reader does.

* OLMoE files (``olmoe``, configured by :mod:`torch_topg.quant.gguf_arch`, since
  transformers' reader does not read them) hold the names above: per-layer ``attn_q_norm``
  / ``attn_k_norm`` over the whole projection width, the router ``ffn_gate_inp`` and the
  stacked experts; llama.cpp's converter keeps q / k rows in transformers' order.
* A tensor in a block format :mod:`torch_topg.formats` has no kernel for (``q5_0`` rows
  that llama.cpp's quantiser writes where a K-quant does not fit, ``q2_k``, ...) is
  de-quantised to the model dtype, as are stacked experts whose parts cannot form one
  :class:`QuantizedExperts` (gate and up in different formats, a part de-quantised): one
  log line names them; the file still loads.

The result equals what the hashing path builds (``tests/test_quant_gguf.py`` compares the
packed buffers and the logits). Another architecture returns None and the caller takes
the hashing path.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from torch_topg.formats import BY_GGUF_TYPE, dequantize
from torch_topg.quant.experts import QuantizedExperts, experts_activation, experts_problem
from torch_topg.quant.gguf_arch import FileTensor, read_file
from torch_topg.quant.modules import QuantizedEmbedding, QuantizedLinear, embedding_scale
from torch_topg.utils import hugepages

log = logging.getLogger(__name__)

#: GGUF ``general.architecture`` values built here, and whether q / k rows are permuted.
ARCHITECTURES = {"llama": True, "qwen2": False, "qwen3": False, "qwen2moe": False,
                 "qwen3moe": False, "gemma2": False, "olmoe": False}  # fmt: skip
#: Architectures whose files store RMSNorm weights as ``1 + w`` (see above).
_NORM_PLUS_ONE = ("gemma2",)

#: MoE sizes the file states and transformers' GGUF config reader does not map (it
#: leaves the class defaults: a file with other sizes would not load): metadata key
#: suffix -> config attribute.
_MOE_SIZES = {
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}
#: Stacked expert tensors: file name -> which part of ``mlp.experts``.
_EXPERTS = {"ffn_gate_exps.weight": "gate", "ffn_up_exps.weight": "up",
            "ffn_down_exps.weight": "down"}  # fmt: skip

_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp.weight": "mlp.gate.weight",  # the MoE router
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}


#: Per architecture, layer tensors named otherwise than in _LAYER.
_LAYER_BY_ARCH = {
    "gemma2": {
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
}


def _target(name: str, arch: str | None = None) -> str | None:
    """The model path of a file tensor: ``blk.3.attn_q.weight`` -> ``model.layers.3.
    self_attn.q_proj.weight``; None for a tensor this module does not know."""
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if m is None:
        return None
    rest = m.group(2)
    own = _LAYER_BY_ARCH.get(arch or "", {})
    if rest in own:
        return f"model.layers.{m.group(1)}.{own[rest]}"
    if rest in _EXPERTS:
        return f"model.layers.{m.group(1)}.mlp.experts:{_EXPERTS[rest]}"
    if rest in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[rest]}"
    base, _, kind = rest.rpartition(".")
    if base in _LAYER and kind in ("weight", "bias"):
        return f"model.layers.{m.group(1)}.{_LAYER[base]}.{kind}"
    return None


def mixtral_config(metadata: Mapping[str, Any], config: Any) -> Any:
    """A ``MixtralConfig`` for a Mixtral-type file (its ``metadata`` as
    :func:`~torch_topg.quant.gguf_arch.read_metadata` gives it: architecture ``llama``
    with ``llama.expert_count`` > 0), which transformers' GGUF reader turns into a dense
    ``LlamaConfig``; ``config`` itself for any other file."""
    from transformers import MixtralConfig

    if getattr(config, "model_type", None) != "llama":
        return config
    experts = metadata.get("llama.expert_count")
    if experts is None or int(experts) == 0:
        return config
    used = metadata.get("llama.expert_used_count")
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
            "rms_norm_eps", "rope_parameters", "rope_theta", "tie_word_embeddings",
            "bos_token_id", "eos_token_id", "pad_token_id", "head_dim")  # fmt: skip
    kw = {k: getattr(config, k) for k in keep if getattr(config, k, None) is not None}
    kw["num_local_experts"] = int(experts)
    if used is not None:
        kw["num_experts_per_tok"] = int(used)
    return MixtralConfig(**kw)


def _set_experts(
    model: torch.nn.Module,
    path: str,
    parts: dict[str, tuple[torch.Tensor, str | None]],
    dtype: torch.dtype,
    int8_activations: bool,
) -> tuple[str | None, str | None]:
    """``mlp.experts`` at ``path`` from the file's stacked gate / up / down tensors: a
    :class:`QuantizedExperts` over the packed rows (gate and up rows concatenated per
    expert, a copy of the packed bytes) where the formats allow, else float weights (the
    packed parts de-quantised). Returns (why it could not be built, or None; why packed
    parts were de-quantised, or None)."""
    if set(parts) != {"gate", "up", "down"}:
        return f"{path}: stacked experts {sorted(parts)}, not gate / up / down", None
    (gate, fg), (up, fu), (down, fd) = parts["gate"], parts["up"], parts["down"]
    old = model.get_submodule(path)
    formats = (fg, fu, fd)
    if fg is None or fg != fu or fd is None:
        problem = "gate / up / down: " + " / ".join(f or "de-quantised" for f in formats)
    else:
        problem = experts_problem(old, fg, fd)
    if problem is None:
        e, inter, hidden = gate.shape[0], gate.shape[1], down.shape[1]
        new = QuantizedExperts(e, hidden, inter, fg, experts_activation(old),
                               int8_activations, down_format=fd, device="meta")  # fmt: skip
        new.qgate_up = _concat_rows(gate, up)
        new.qdown = down.contiguous()
        _set(model, path, new)
        return None, None
    current = getattr(old, "gate_up_proj", None)
    if current is None or current.dim() != 3:
        return f"{path}: {type(old).__name__} has no [E, 2I, H] gate_up_proj", None
    inter, hidden = current.shape[1] // 2, current.shape[2]
    gate, up, down = ((t if f is None else dequantize(t, f, k)) for t, f, k in
                      ((gate, fg, hidden), (up, fu, hidden), (down, fd, inter)))  # fmt: skip
    # the concatenation is a copy already; down_proj may be a view of the file's mapped
    # bytes: always copied
    for attr, value in (("gate_up_proj", torch.cat([gate, up], 1).to(dtype)),
                        ("down_proj", down.to(dtype, copy=True))):  # fmt: skip
        current = getattr(old, attr, None)
        if current is None or tuple(current.shape) != tuple(value.shape):
            return f"{path}.{attr}: {tuple(value.shape)} in the file", None
        setattr(old, attr, torch.nn.Parameter(value, requires_grad=False))
    hugepages.release_file_pages(gate, up, down)  # copied: the mapped pages they read go
    packed_parts = any(f is not None for f in formats)
    return None, (f"{path} ({problem})" if packed_parts else None)


def _concat_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``cat([gate, up], 1)`` of two ``[E, rows, bytes]`` stacks, built in huge-page memory
    (where it stays: the engine's move into huge pages skips it) expert by expert, and the
    sources' mapped pages released once copied: the bytes read from the file would
    otherwise stay resident beside the copy (an OLMoE file: two thirds of its bytes)."""
    g = gate.shape[1]
    out = hugepages.empty((gate.shape[0], g + up.shape[1], gate.shape[2]), gate.dtype)
    for e in range(gate.shape[0]):
        out[e, :g].copy_(gate[e])
        out[e, g:].copy_(up[e])
    hugepages.release_file_pages(gate, up)
    return out


def _unpermute(rows: int, heads: int) -> torch.Tensor:
    """Indices taking a permuted file tensor's rows back to transformers' order."""
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def _tensor(data: np.ndarray) -> torch.Tensor:
    """``data`` as a tensor without a copy (a read-only mapped array: torch's warning that
    it is not writable is expected; nothing writes packed weights)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(data)


def _set(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def load_packed(
    path: str | os.PathLike[str],
    config: Any,
    dtype: torch.dtype,
    int8_activations: bool = False,
    file: tuple[dict[str, Any], list[FileTensor]] | None = None,
    strict: bool = False,
    mapped: bool = False,
) -> torch.nn.Module | None:
    """The causal LM of ``config`` (loaded from the same file) with the file's tensors:
    quantised ones packed, the others in ``dtype`` (as are tensors in a block format
    without a packed kernel here, de-quantised); None if the file's architecture is not
    one of :data:`ARCHITECTURES` or a tensor has no place in the model (``strict``:
    raise ValueError saying which, instead). ``int8_activations``: for every packed
    linear, the LM head included (llama.cpp's semantics). ``file``: the file's :func:`~torch_topg.quant.gguf_arch.read_file`
    if the caller has it. ``mapped``: tensors of :data:`~torch_topg.utils.hugepages.HUGE_PAGE`
    bytes or more (packed, or floats already in ``dtype``) stay views of the read-only
    mapped file, for a caller that copies them out before anything could write them
    (the engine: ``hugepages.rehome_``, which drops each one's mapped pages once copied,
    so the load holds the weights once); else every tensor is a copy."""
    import gguf
    from transformers import AutoModelForCausalLM

    def refuse(why: str) -> None:
        if strict:
            raise ValueError(f"{os.fspath(path)}: {why}")
        log.debug("GGUF %s not built packed: %s", os.fspath(path), why)

    metadata, tensors = file if file is not None else read_file(path)
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        return refuse(f"architecture {arch!r} is not among {sorted(ARCHITECTURES)}")
    config = mixtral_config(metadata, config)  # a Mixtral file reads as a dense Llama
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key, attr in _MOE_SIZES.items():
        value = metadata.get(f"{arch}.{key}")
        if value is not None and hasattr(text, attr):
            setattr(text, attr, int(value))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    heads = {"attn_q": text.num_attention_heads,
             "attn_k": getattr(text, "num_key_value_heads", None) or text.num_attention_heads}  # fmt: skip
    packed: dict[str, tuple[torch.Tensor, str, int]] = {}  # module path -> rows, format, k
    floats: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, tuple[torch.Tensor, str | None]]] = {}  # path -> part
    unpacked: list[str] = []  # tensors de-quantised for want of a packed format
    for t in tensors:
        if t.name == "rope_freqs.weight":  # Llama 3's RoPE scaling: in the config (gguf_rope.py)
            continue
        target = _target(t.name, arch)
        if target is None:
            return refuse(f"tensor {t.name} has no place in {type(model).__name__}")
        fmt = BY_GGUF_TYPE.get(int(t.tensor_type))
        value: Any = None
        shape = list(t.shape)
        float_type = _FLOAT_TYPES.get(t.tensor_type.name)
        view = mapped and t.data.nbytes >= hugepages.HUGE_PAGE  # see the docstring
        data = t.data if float_type is not None or view else np.array(t.data)
        if float_type is not None:  # a view of the mapped bytes, cast below once (no float32 copy)
            with warnings.catch_warnings():  # read-only on purpose: cast to a copy below
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.from_numpy(data.reshape(-1).view(np.uint8))
            value = raw.view(float_type).reshape(shape)
        elif fmt is None:  # a block format without a kernel here: de-quantised
            unpacked.append(f"{t.name} ({t.tensor_type.name.lower()})")
            try:
                values = gguf.quants.dequantize(data, t.tensor_type)
            except NotImplementedError as e:
                return refuse(f"tensor {t.name}: gguf cannot de-quantise {t.tensor_type.name}: {e}")  # fmt: skip
            value = torch.from_numpy(np.ascontiguousarray(values)).reshape(shape)
        if ":" in target:  # [E, rows, k] stacked experts: packed rows, or floats
            path_, part = target.split(":")
            if fmt is not None and len(shape) != 3:
                return refuse(f"tensor {t.name}: stacked experts of shape {shape}")
            stack = value if fmt is None else _tensor(data).reshape(shape[0], shape[1], -1)
            experts.setdefault(path_, {})[part] = (stack, fmt)
            continue
        if fmt is not None and len(shape) != 2:
            return refuse(f"tensor {t.name}: {fmt} of shape {shape}")
        rows = value if fmt is None else _tensor(data).reshape(shape[0], -1)
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        source = rows
        if ARCHITECTURES[arch] and kind in heads:  # weights and biases alike
            rows = rows.index_select(0, _unpermute(rows.shape[0], heads[kind]))
        if fmt is not None:
            kept = rows.contiguous()
            packed[target.removesuffix(".weight")] = (kept, fmt, shape[1])
        else:
            if arch in _NORM_PLUS_ONE and target.endswith("norm.weight"):
                rows = rows.float() - 1.0
            # a copy in dtype (the mapped bytes are read-only), unless the caller copies it
            kept = rows if view and rows.dtype == dtype else rows.to(dtype, copy=True)
            floats[target] = kept
        if view and kept.data_ptr() != source.data_ptr():
            hugepages.release_file_pages(source)  # copied: its mapped pages go
    head_tied = "lm_head" not in packed and "lm_head.weight" not in floats
    for path_, parts in experts.items():
        why, note = _set_experts(model, path_, parts, dtype, int8_activations)
        if why is not None:
            return refuse(why)
        if note is not None:
            unpacked.append(note)
    if unpacked:
        log.info("GGUF %s: de-quantised to %s, no packed kernel for their format here: %s",
                 os.fspath(path), dtype, ", ".join(unpacked))  # fmt: skip
    for name, (rows, fmt, k) in packed.items():
        old = model.get_submodule(name)
        if not isinstance(old, (torch.nn.Embedding, torch.nn.Linear)):  # e.g. an MoE router
            floats[f"{name}.weight"] = dequantize(rows, fmt, k).to(dtype)
            continue
        if isinstance(old, torch.nn.Embedding):
            new: torch.nn.Module = QuantizedEmbedding(rows, fmt, k, embedding_scale(old))
            new.dtype_ref = torch.empty(0, dtype=dtype)
            if head_tied:
                head = QuantizedLinear(k, rows.shape[0], fmt, bias=False, dtype=dtype, device="meta",
                                       int8_activations=int8_activations)  # fmt: skip
                head.qweight = rows  # one buffer for both
                _set(model, "lm_head", head)
        else:
            # on meta: its buffers are the file's (a zero-filled allocation first cost ~0.5 s at 1B)
            new = QuantizedLinear(k, old.out_features, fmt, bias=old.bias is not None,
                                  dtype=dtype, device="meta", int8_activations=int8_activations)  # fmt: skip
            new.qweight = rows
            if old.bias is not None:
                bias = floats.pop(f"{name}.bias", None)
                if bias is None:
                    return refuse(f"no bias for {name} in the file")
                new.bias = torch.nn.Parameter(bias, requires_grad=False)
        _set(model, name, new)
    if head_tied and isinstance(model.model.embed_tokens, torch.nn.Embedding):
        if "model.embed_tokens.weight" in floats:  # a float embedding, tied
            floats.setdefault("lm_head.weight", floats["model.embed_tokens.weight"])
    for name, value in floats.items():
        owner, _, attr = name.rpartition(".")
        mod = model.get_submodule(owner)
        current = getattr(mod, attr, None)
        # the shape, up to unit dimensions (the shared-expert gate: [1, H] in the model,
        # [H] in the file)
        if current is None or tuple(current.squeeze().shape) != tuple(value.squeeze().shape):
            have = None if current is None else tuple(current.shape)
            return refuse(f"{name}: {tuple(value.shape)} in the file, {have} in the model")
        value = value.reshape(current.shape)
        setattr(mod, attr, torch.nn.Parameter(value, requires_grad=False))
    rotary = getattr(model.model, "rotary_emb", None)
    if rotary is not None:  # its buffers were made on meta: make them again
        model.model.rotary_emb = type(rotary)(config=text)
    head = getattr(model, "lm_head", None)
    if head_tied and type(head) is torch.nn.Linear and head.weight.is_meta:  # a float file
        emb = model.get_input_embeddings()
        if isinstance(emb, torch.nn.Embedding):
            head.weight = emb.weight
    missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing:
        return refuse(f"no tensor in the file for {missing[:5]}")
    return model.eval()


def _float_state(packed: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The state dict of ``packed`` with every packed module de-quantised to ``dtype``
    under the names of the module it replaced (``weight``; ``gate_up_proj`` /
    ``down_proj``). Each tensor is cast as it is made: one float32 tensor at a time."""
    state: dict[str, torch.Tensor] = {}
    for name, mod in packed.named_modules():
        pre = f"{name}." if name else ""
        if isinstance(mod, QuantizedLinear):
            state[pre + "weight"] = mod.dequantized_weight().to(dtype)
        elif isinstance(mod, QuantizedEmbedding):
            w = dequantize(mod.qweight, mod.format, mod.embedding_dim)
            state[pre + "weight"] = w.to(dtype)
        elif isinstance(mod, QuantizedExperts):
            gate_up, down = mod.dequantized()
            state[pre + "gate_up_proj"] = gate_up.to(dtype)
            del gate_up
            state[pre + "down_proj"] = down.to(dtype)
    for key, value in packed.state_dict().items():
        if not key.endswith((".qweight", ".qgate_up", ".qdown")):
            state.setdefault(key, value.to(dtype) if value.is_floating_point() else value)
    return state


def load_dequantized(
    path: str | os.PathLike[str], config: Any, dtype: torch.dtype, mapped: bool = False
) -> torch.nn.Module | None:
    """``quantization=None`` for a file of one of :data:`ARCHITECTURES`: built as
    :func:`load_packed` does, then every packed tensor de-quantised to ``dtype`` (the
    file's values, bit-exact with gguf-py's de-quantiser, which transformers' reader uses).
    A float file (BF16, F16, F32) is its tensors cast to ``dtype`` one at a time:
    transformers' GGUF reader makes a float32 copy of the whole model first (a BF16
    Llama-3.2-1B file grew past 24 GiB there). The file's architecture decides, not the
    reader: transformers refuses OLMoE files and builds a Mixtral-type file (architecture
    ``llama`` with experts) as a dense Llama whose MLPs are left random. None for other
    architectures (the caller loads the file through transformers). Raises ValueError
    naming a tensor that cannot be placed, rather than returning a model with missing
    weights."""
    from transformers import AutoModelForCausalLM

    file = read_file(path)
    if file[0].get("general.architecture") not in ARCHITECTURES:
        return None
    packed = load_packed(path, config, dtype, file=file, strict=True, mapped=mapped)
    assert packed is not None  # strict: raised otherwise
    if not any(isinstance(m, _PACKED) for m in packed.modules()):
        return packed  # a float file: nothing to de-quantise (load_packed tied and checked it)
    state, config = _float_state(packed, dtype), packed.config
    del packed  # the packed bytes: not needed beside the float tensors
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    expected = set(model.state_dict())
    missing = sorted(expected - set(state))
    if missing:
        raise ValueError(f"{os.fspath(path)}: no tensor for {missing[:5]} in the de-quantised file")
    model.load_state_dict({k: v for k, v in state.items() if k in expected}, assign=True)
    return _finish(model, path)


_PACKED = (QuantizedLinear, QuantizedEmbedding, QuantizedExperts)
#: GGUF float tensor types -> torch dtypes (read as views of the file's bytes).
_FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _finish(model: torch.nn.Module, path: str | os.PathLike[str]) -> torch.nn.Module:
    """``model`` (built on meta, its tensors assigned) with its rotary buffers made again
    and its tied embeddings tied; ValueError if a tensor is still on meta."""
    text = model.config.get_text_config()
    rotary = getattr(model.model, "rotary_emb", None)
    if rotary is not None:  # its buffers were made on meta: make them again
        model.model.rotary_emb = type(rotary)(config=text)
    if getattr(text, "tie_word_embeddings", False):
        model.tie_weights()
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"{os.fspath(path)}: {left[:5]} left unset after de-quantising")
    return model.eval()
