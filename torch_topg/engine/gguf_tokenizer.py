"""A GGUF file's tokenizer built from its ``tokenizer.ggml.*`` metadata.

transformers' ``AutoTokenizer.from_pretrained(folder, gguf_file=...)`` first reads the
file's config, so it refuses every architecture its GGUF reader does not know (``olmoe``:
"GGUF model with architecture olmoe is not supported yet"), although the tokenizer itself
is described by the file alone. For those files (``torch_topg.quant.gguf_arch``) the
tokenizer is built here, for the byte-level BPE vocabularies (``tokenizer.ggml.model`` =
``gpt2``, what llama.cpp's converter writes for every GPT-2-style tokenizer):

* the vocabulary is ``tokenizer.ggml.tokens`` (ids by position, spelled in the byte-level
  alphabet), the merges ``tokenizer.ggml.merges`` (``"a b"``, best first);
* tokens of type CONTROL (3) are special added tokens (matched whole, skipped when
  decoding with ``skip_special_tokens``), USER_DEFINED (4) plain added tokens;
* the pre-tokenizer follows ``tokenizer.ggml.pre``, llama.cpp's name for how text is cut
  before the merges: :data:`PRE_TOKENIZERS` (GPT-2's split; GPT-2's split after single
  digits), else the split transformers' GGUF tokenizer reader knows for that name;
* ``bos`` / ``eos`` / ``unk`` / ``pad`` are the tokens of the ``*_token_id`` entries;
  ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` add them to every encoding;
  ``tokenizer.chat_template`` is the chat template.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: ``tokenizer.ggml.pre`` names llama.cpp splits with GPT-2's expression alone, and those
#: it first cuts into single digits (its pre-tokenizer types GPT2 / OLMO / MPT / ... and
#: SMOLLM / STARCODER / REFACT / ...).
_GPT2_SPLIT = ("default", "gpt-2", "gpt2", "olmo", "mpt", "jais", "trillion")
_DIGITS_FIRST = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
PRE_TOKENIZERS: dict[str, str] = {
    **dict.fromkeys(_GPT2_SPLIT, "gpt2"),
    **dict.fromkeys(_DIGITS_FIRST, "digits"),
}

_CONTROL, _USER_DEFINED = 3, 4


def _pre_tokenizer(pre: str | None) -> Any:
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    kind = PRE_TOKENIZERS.get(pre or "default")
    if kind == "gpt2":
        return byte_level
    if kind == "digits":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])  # fmt: skip
    try:  # the splits transformers' GGUF tokenizer reader knows (llama3, qwen2, ...)
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_PRE_TOKENIZER_SPLITS,
        )
    except ImportError:
        GGUF_PRE_TOKENIZER_SPLITS = {}
    split = GGUF_PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        raise ValueError(
            f"GGUF tokenizer.ggml.pre {pre!r}: no pre-tokenizer known for it here "
            f"(known: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def tokenizer_from_metadata(metadata: Mapping[str, Any]) -> Any:
    """A transformers fast tokenizer (``PreTrainedTokenizerFast``) from a GGUF file's
    metadata (as ``torch_topg.quant.gguf_arch.read_metadata`` gives it). Raises
    ValueError for a tokenizer model other than ``gpt2`` or an unknown pre-tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    model = metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(
            f"GGUF tokenizer.ggml.model {model!r}: only byte-level BPE ('gpt2') "
            "vocabularies are built from the file's metadata here"
        )
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    vocab = {t: i for i, t in enumerate(tokens)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tk.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre"))
    tk.decoder = decoders.ByteLevel()
    types = metadata.get("tokenizer.ggml.token_type")
    types = [0] * len(tokens) if types is None else [int(t) for t in types]
    if len(types) != len(tokens):
        raise ValueError(f"GGUF: {len(types)} token types for {len(tokens)} tokens")
    pairs = list(zip(tokens, types, strict=True))
    control = [AddedToken(t, normalized=False, special=True) for t, k in pairs if k == _CONTROL]
    user = [AddedToken(t, normalized=False, special=False) for t, k in pairs if k == _USER_DEFINED]
    tk.add_special_tokens(control)
    tk.add_tokens(user)

    def token(key: str) -> str | None:
        i = metadata.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    special = {"bos_token": token("bos"), "eos_token": token("eos"),
               "unk_token": token("unknown"), "pad_token": token("padding")}  # fmt: skip
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False)) and special["bos_token"]
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and special["eos_token"]
    if add_bos or add_eos:
        bos, eos = special["bos_token"], special["eos_token"]
        pre, post = ([f"{bos}:0"] if add_bos else []), ([f"{eos}:0"] if add_eos else [])
        tk.post_processor = processors.TemplateProcessing(
            single=[*pre, "$A:0", *post],
            pair=[*pre, "$A:0", *post, *pre, "$B:1", *post],
            special_tokens=[(t, vocab[t]) for t in {bos, eos} if t is not None],
        )
    kw: dict[str, Any] = {k: v for k, v in special.items() if v is not None}
    template = metadata.get("tokenizer.chat_template")
    if template is not None:
        kw["chat_template"] = template
    return PreTrainedTokenizerFast(tokenizer_object=tk, clean_up_tokenization_spaces=False, **kw)
