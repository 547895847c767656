"""The packed weight formats (torch_topg.quant): de-quantisation bit for bit against
gguf-py's own de-quantiser, on random blocks and on the real tensors of the shipped
SmolLM2 GGUF; quantisers against gguf-py's; round trips of this package's formats."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from torch_topg.models.hf import gguf_path, smollm2_available
from torch_topg.quant import FORMATS, GGUF_FORMATS, OWN_FORMATS, dequantize, quantize_weight

gguf = pytest.importorskip("gguf")
GGMLType = gguf.GGMLQuantizationType

# Byte offsets of the half-precision scales inside one block, per GGUF format.
HALF_AT = {
    "q8_0": (0,),
    "q4_0": (0,),
    "q4_1": (0, 2),
    "q5_0": (0,),
    "q5_1": (0, 2),
    "q4_k": (0, 2),
    "q5_k": (0, 2),
    "q6_k": (208,),
}


def _bits(x: np.ndarray | torch.Tensor) -> np.ndarray:
    a = x.numpy() if isinstance(x, torch.Tensor) else x
    return np.ascontiguousarray(a, dtype=np.float32).view(np.int32)


def _random_blocks(seed: int, fmt: str, rows: int, blocks: int) -> np.ndarray:
    """Random bytes [rows, blocks * block_bytes] whose half scales are finite (any sign,
    subnormals included): an exponent of all ones loses its top bit."""
    f = FORMATS[fmt]
    raw = np.random.default_rng(seed).integers(0, 256, (rows * blocks, f.block_bytes), np.uint8)
    for at in HALF_AT[fmt]:
        high = raw[:, at + 1]
        high[(high & 0x7C) == 0x7C] &= 0xBF
    return raw.reshape(rows, blocks * f.block_bytes)


@pytest.mark.parametrize("fmt", GGUF_FORMATS)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 9), blocks=st.integers(1, 5))
def test_dequantize_random_blocks_bit_exact(fmt, seed, rows, blocks):
    raw = _random_blocks(seed, fmt, rows, blocks)
    expected = gguf.quants.dequantize(raw, GGMLType(FORMATS[fmt].gguf_type))
    got = dequantize(torch.from_numpy(raw), fmt)
    assert got.shape == expected.shape and got.dtype == torch.float32
    assert np.array_equal(_bits(got), _bits(expected))


def test_random_blocks_cover_subnormal_and_negative_scales():
    raw = _random_blocks(0, "q8_0", 64, 8).reshape(-1, 34)
    d = raw[:, :2].copy().view(np.float16)
    assert (d < 0).any() and (np.abs(d) < 2**-14).any() and np.isfinite(d).all()


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
@given(
    seed=st.integers(0, 2**32 - 1),
    rows=st.integers(1, 6),
    blocks=st.integers(1, 4),
    scale=st.sampled_from([1e-4, 0.02, 1.0, 300.0]),
)
def test_quantize_equals_gguf(fmt, seed, rows, blocks, scale):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, 32 * blocks)) * scale).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero block: scale 0, codes of zero
    expected = gguf.quants.quantize(w, GGMLType(FORMATS[fmt].gguf_type))
    got = quantize_weight(torch.from_numpy(w), fmt)
    assert np.array_equal(got.numpy(), expected)


@pytest.mark.parametrize("fmt", OWN_FORMATS)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 7),
    k=st.integers(1, 300),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_own_formats_round_trip(fmt, seed, n, k, dtype):
    """De-quantising gives every weight back to within half a step of its group (plus
    the rounding of the half scale and minimum), for K that the group does not divide."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    packed = quantize_weight(w, fmt)
    f = FORMATS[fmt]
    assert packed.dtype == torch.uint8 and packed.shape == (n, f.row_bytes(k))
    back = dequantize(packed, fmt, k)
    assert back.shape == (n, k)
    wf = w.float()
    if fmt == "int8":
        step = wf.abs().amax(-1, keepdim=True) / 127
    else:
        pad = torch.nn.functional.pad(wf, (0, -k % f.block)).reshape(n, -1, f.block)
        step = (pad.amax(-1) - pad.amin(-1)) / 15
        step = step.repeat_interleave(f.block, dim=-1)[:, :k]
    err = (back - wf).abs()
    assert (err <= step * 0.5 + step * 2e-3 + 1e-7).all(), (err - step / 2).max()


def test_int4_g32_is_q4_1():
    w = torch.randn(6, 128)
    packed = quantize_weight(w, "int4_g32")
    expected = gguf.quants.dequantize(packed.numpy(), GGMLType.Q4_1)
    assert np.array_equal(_bits(dequantize(packed, "int4_g32")), _bits(expected))


def test_codes_and_padding_layout():
    """int4_g64 with K = 70: two groups, the second padded; codes 0..15 read back at the
    documented nibble positions."""
    w = torch.cat([torch.arange(64.0) % 16, torch.tensor([0.0, 15, 7, 3, 1, 2])])[None]
    packed = quantize_weight(w, "int4_g64")
    assert packed.shape == (1, 2 * (4 + 32))
    group = packed[0, :36]
    d, m = group[:2].view(torch.float16).item(), group[2:4].view(torch.float16).item()
    assert (d, m) == (1.0, 0.0)
    assert group[4].item() == 0x00 and group[5].item() == 0x11  # elements 0|32, 1|33
    torch.testing.assert_close(dequantize(packed, "int4_g64", 70), w, rtol=0, atol=0)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_no_rows_and_no_weights(fmt):
    f = FORMATS[fmt]
    k = f.block or 5
    assert dequantize(torch.zeros(0, f.row_bytes(k), dtype=torch.uint8), fmt, k).shape == (0, k)
    if fmt not in ("q4_k", "q5_k", "q6_k"):  # (read from files only)
        assert quantize_weight(torch.zeros(0, k), fmt).shape == (0, f.row_bytes(k))


def test_int8_row_layout():
    w = torch.tensor([[127.0, -63.5, 0.0, 1.0]])
    packed = quantize_weight(w, "int8")
    assert packed[0, :4].view(torch.float32).item() == 1.0
    assert packed[0, 4:].view(torch.int8).tolist() == [127, -64, 0, 1]


def test_errors():
    with pytest.raises(ValueError, match="unknown weight format 'q2_k'; known: q8_0, "):
        dequantize(torch.zeros(1, 34, dtype=torch.uint8), "q2_k")
    with pytest.raises(ValueError, match="rows of 35 bytes do not hold 32 weights in q8_0"):
        dequantize(torch.zeros(1, 35, dtype=torch.uint8), "q8_0", 32)
    with pytest.raises(ValueError, match="K = 40 must be a multiple of 32"):
        quantize_weight(torch.randn(2, 40), "q4_0")
    with pytest.raises(ValueError, match="read from GGUF files only"):
        quantize_weight(torch.randn(2, 256), "q4_k")
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_weight(torch.tensor([[float("nan")] * 32]), "int4_g32")
    with pytest.raises(ValueError, match="must be uint8"):
        dequantize(torch.zeros(1, 34, dtype=torch.int8), "q8_0")


# --- the shipped SmolLM2 file ----------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_reader():
    reason = smollm2_available()
    if reason:
        pytest.skip(reason)
    return gguf.GGUFReader(gguf_path())


def test_smollm2_tensors_bit_exact(smollm2_reader):
    """The token embedding (Q8_0) and every quantised tensor of the first and last
    layers (Q4_1) de-quantise to gguf-py's floats, bit for bit."""
    tensors = [t for t in smollm2_reader.tensors if t.tensor_type.value in FORMATS_BY_TYPE]
    last = max(int(t.name.split(".")[1]) for t in tensors if t.name.startswith("blk."))
    chosen = [
        t
        for t in tensors
        if t.name == "token_embd.weight" or t.name.startswith(("blk.0.", f"blk.{last}."))
    ]
    seen = {t.tensor_type.name for t in chosen}
    assert seen == {"Q8_0", "Q4_1"}, seen
    assert len(chosen) == 1 + 2 * 7
    for t in chosen:
        raw = np.array(t.data)
        fmt = FORMATS_BY_TYPE[t.tensor_type.value]
        k = int(t.shape[0])  # GGUF lists the innermost dimension first
        got = dequantize(torch.from_numpy(raw), fmt, k)
        expected = gguf.quants.dequantize(raw, t.tensor_type)
        assert got.shape == (int(t.shape[1]), k), t.name
        assert np.array_equal(_bits(got), _bits(expected)), t.name


FORMATS_BY_TYPE = {f.gguf_type: n for n, f in FORMATS.items() if f.gguf_type is not None}
