"""The real-size benchmark models (torch_topg/bench/real_size.py): the shapes are the
published models' (parameter counts), the writer's checkpoint loads in transformers, and
llama.cpp's converter turns it into a GGUF file whose tensors read back (through the
gguf package and the engine's GGUF loader) equal to the checkpoint's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from torch_topg.bench.real_size import SHAPES, _parameter_shapes, config_for, write_checkpoint

pytestmark = pytest.mark.native_independent

#: Parameters of the published models (their model cards), tied LM heads counted once.
PUBLISHED = {"llama-3.2-1b": 1.24e9, "qwen2.5-3b": 3.09e9, "llama-3.1-8b": 8.03e9,
             "olmoe-1b-7b": 6.92e9}  # fmt: skip

TINY = {
    "llama-3.2-1b": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "qwen2.5-3b": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2),
}  # fmt: skip


@pytest.mark.parametrize("shape", list(SHAPES))
def test_shapes_have_the_published_parameter_counts(shape):
    n = sum(torch.Size(s).numel() for s in _parameter_shapes(config_for(shape)).values())
    assert abs(n / PUBLISHED[shape] - 1) < 0.01, f"{shape}: {n / 1e9:.3f}B parameters"


def test_unknown_shape_is_refused():
    with pytest.raises(ValueError, match="unknown shape 'llama-9b'; known: llama-3.2-1b"):
        config_for("llama-9b")


@pytest.fixture(scope="module")
def converter() -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python" / "benchmarks"))
    from llama_cpp_build import llama_cpp_sources

    return llama_cpp_sources() / "convert_hf_to_gguf.py"  # downloaded once (PyPI's sdist)


@pytest.mark.parametrize("shape", list(TINY))
def test_gguf_from_llama_cpp_converter_reads_back_equal(shape, tmp_path, converter, monkeypatch):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from torch_topg.bench.real_size import convert_to_gguf
    from torch_topg.engine.gguf_meta import config_and_tokenizer
    from torch_topg.models.hf import smollm2_folder
    from torch_topg.quant.gguf_arch import read_file
    from torch_topg.quant.gguf_direct import load_packed

    # SmolLM2's converted folder from the shared cache (converting it again here took 65 s
    # of the test's 124 on a Zen 3); the new file's metadata converted fresh, below
    smollm2 = smollm2_folder()
    monkeypatch.setenv("TOPG_CACHE_DIR", str(tmp_path / "cache"))
    folder = write_checkpoint(shape, tmp_path / shape, smollm2, **TINY[shape])
    cfg = config_for(shape, **TINY[shape])
    stored = {}
    for f in folder.glob("*.safetensors"):
        stored.update(load_file(f))
    assert set(stored) == set(_parameter_shapes(cfg))
    # transformers loads the checkpoint with no missing or unexpected weight
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.vocab_size == SHAPES[shape][1]["vocab_size"]

    out = convert_to_gguf(folder, tmp_path / f"{shape}.gguf", converter)
    _, tensors = read_file(out)  # (gguf-py's reader parses a 128k vocabulary for ~17 s)
    assert {t.tensor_type.name for t in tensors} <= {"BF16", "F32"}
    # every checkpoint tensor, plus Llama 3's RoPE frequency factors (rope_freqs)
    assert len([t for t in tensors if t.name != "rope_freqs.weight"]) == len(stored)
    config, _ = config_and_tokenizer(out)
    if shape.startswith("llama"):  # Llama 3's RoPE scaling, kept as rope_freqs in the file
        assert config.rope_parameters["rope_type"] == "llama3"
        assert config.rope_parameters["factor"] == cfg.rope_parameters["factor"]
    loaded = load_packed(out, config, torch.bfloat16)
    assert loaded is not None
    state = loaded.state_dict()
    for name, t in stored.items():
        assert torch.equal(state[name].to(t.dtype), t), name
    # the same weights and the same rotary angles: the same logits
    ids = torch.randint(0, 49152, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = model.to(torch.bfloat16)(ids).logits.float()
        got = loaded(ids).logits.float()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("fit", [True, False])
def test_sides_take_turns_when_they_do_not_fit_in_memory(fit, tmp_path, monkeypatch):
    """real_size.py's sides each hold the file's bytes: side by side (interleaved rounds)
    when they fit, else one at a time, never two loaded at once."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python" / "benchmarks"))
    import real_size as rs

    from torch_topg.bench.timing import summarize

    events: list[str] = []
    live: set[str] = set()
    peak = [0]

    class Side:
        def __init__(self, name: str) -> None:
            self.name = name
            live.add(name)
            peak[0] = max(peak[0], len(live))

        def round(self) -> None:
            events.append(self.name)

        def close(self) -> dict:
            live.discard(self.name)
            return {"decode_ms": summarize([2.0 if "topg" in self.name else 4.0])}

    monkeypatch.setattr(rs, "LlamaBench", lambda bench, path: Side("llama.cpp"))
    monkeypatch.setattr(rs, "EngineSide", lambda path, i8, ttft: Side(f"topg {i8}"))
    monkeypatch.setattr(rs, "read_bytes", lambda path, ctx: (10**9, {"q8_0": 1}))
    monkeypatch.setattr(rs, "sides_fit", lambda sizes: fit)
    path = tmp_path / "m.gguf"
    path.write_bytes(b"0")
    row = rs.run_format("s", "q8_0", path, {"llama-bench": "x"}, 2, 1e9, ["int8", "fp32"])
    assert set(row["figures"]) == {"llama.cpp", "topg int8 act.", "topg fp32 act."}
    assert row["ratios"]["topg int8 act. / llama.cpp"]["median"] == pytest.approx(0.5)
    if fit:
        assert peak[0] == 3 and row["order"] == "interleaved rounds"
        rotated = ["topg True", "topg False", "llama.cpp"]  # round 2 starts one side on
        assert events == ["llama.cpp", "topg True", "topg False", *rotated]
    else:
        assert peak[0] == 1 and row["order"] == "one side at a time (memory)"
        assert events == ["llama.cpp"] * 2 + ["topg True"] * 2 + ["topg False"] * 2


def test_a_file_that_would_fill_the_disk_is_refused(tmp_path, monkeypatch):
    """A quantised file that would leave less than the reserve free is refused before
    llama-quantize runs, naming the file, the sizes and how to make room; with room,
    the file is made."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python" / "benchmarks"))
    import real_size as rs

    from torch_topg.bench import memory

    monkeypatch.setenv("TOPG_CACHE_DIR", str(tmp_path))
    bf16 = rs.cache_root() / "s-bf16.gguf"
    bf16.parent.mkdir()
    bf16.write_bytes(b"0" * 16_000)
    runs: list[list[str]] = []

    def quantize(cmd, **kw):
        runs.append(cmd)
        Path(cmd[2]).write_bytes(b"q")
        return type("P", (), {"returncode": 0, "stderr": ""})()

    monkeypatch.setattr(rs.subprocess, "run", quantize)
    usage = type("U", (), {"free": 2**30 + 6_000})()  # 1 GiB + 6,000 bytes free
    monkeypatch.setattr(memory.shutil, "disk_usage", lambda path: usage)
    monkeypatch.setenv("TOPG_BENCH_DISK_RESERVE_GIB", "1")
    with pytest.raises(OSError, match=r"s-q8_0\.gguf.*needs.*free.*TOPG_BENCH_DISK_RESERVE_GIB"):
        rs.quantized_file("s", "q8_0", bf16, Path("llama-quantize"))  # ~8,500 bytes
    assert runs == [] and not list(bf16.parent.glob("s-q8_0*"))
    out = rs.quantized_file("s", "q4_0", bf16, Path("llama-quantize"))  # ~4,500 bytes: fits
    assert out.read_bytes() == b"q" and len(runs) == 1
    with pytest.raises(OSError, match="needs"):
        memory.check_disk_room(tmp_path / "new" / "f", 2**30)
