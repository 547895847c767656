"""The engine's options are declared once (``EngineArgs``): the checks, ``configure``, the
docs table, the docstring and the server's flags all come from that list; the plain step
never imports the speculative package."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_utils import tiny

from torch_topg.engine import Engine
from torch_topg.engine.errors import ParameterError
from torch_topg.engine.options import (
    TABLE_BEGIN,
    TABLE_END,
    EngineArgs,
    markdown_table,
    names,
    runtime_names,
)

ROOT = Path(__file__).resolve().parents[1]


def test_docs_table_is_the_options_list():
    text = (ROOT / "docs" / "engine.md").read_text()
    block = text[text.index(TABLE_BEGIN) + len(TABLE_BEGIN) : text.index(TABLE_END)].strip()
    assert block == markdown_table(), (
        "docs/engine.md's options table is stale: python -m torch_topg options "
        "--write docs/engine.md"
    )
    for n in names():
        assert f"| `{n}` |" in block


def test_every_option_has_help_a_check_and_a_docstring_line():
    from torch_topg.engine.builder import from_pretrained

    for f in dataclasses.fields(EngineArgs):
        assert f.metadata["help"] and callable(f.metadata["check"]), f.name
        assert f"    {f.name} (default" in from_pretrained.__doc__
    assert EngineArgs().replace() == EngineArgs()  # the defaults pass their own checks


@pytest.mark.parametrize(
    ("options", "param"),
    [
        (dict(max_batch_size=0), "max_batch_size"),
        (dict(max_batch_size=True), "max_batch_size"),
        (dict(block_size=2.5), "block_size"),
        (dict(prefetch_depth=-1), "prefetch_depth"),
        (dict(batch_timeout=-1), "batch_timeout"),
        (dict(kv_cache_memory="lots"), "kv_cache_memory"),
        (dict(kv_cache_memory="99%"), "kv_cache_memory"),
        (dict(kv_cache_memory=0), "kv_cache_memory"),
        (dict(disk_kv_memory="95%", disk_kv_path="/tmp"), "disk_kv_memory"),
        (dict(dtype="float64"), "dtype"),
        (dict(device="warp-drive"), "device"),
        (dict(kv_cache_dtype="fp8"), "kv_cache_dtype"),
        (dict(prefix_caching="yes"), "prefix_caching"),
        (dict(session_ttl=0), "session_ttl"),
        (dict(session_kv_share=1.5), "session_kv_share"),
        (dict(seed="7"), "seed"),
        (dict(speculative={"method": "telepathy"}), "speculative"),
        (dict(quantization="int3"), "quantization"),
        (dict(deterministic=True, compile=False), "deterministic"),
        (dict(host_kv_memory="10%", prefix_caching=False), "host_kv_memory"),
        (dict(disk_kv_memory=1 << 20), "disk_kv_memory"),
        (dict(tp_size=2, kv_cache_dtype="int8"), "kv_cache_dtype"),
        (dict(tp_size=2, speculative={"method": "ngram"}), "speculative"),
        (dict(tp_size=2, prefetch_depth=2), "prefetch_depth"),
        (dict(tp_size=2, quantization="gguf"), "quantization"),
        (dict(max_batch_sise=4), "max_batch_sise"),
    ],
)
def test_bad_options_are_refused_naming_them(options, param):
    with pytest.raises(ParameterError, match=param) as e:
        EngineArgs.from_options(options)
    assert e.value.param == param
    # the same check before any weight loads (a path that does not exist is never read)
    with pytest.raises(ParameterError, match=param):
        Engine.from_pretrained("/nonexistent/model", **options)


def test_options_are_normalised_once():
    a = EngineArgs.from_options(
        dict(dtype="bf16", device="cpu", kv_cache_memory=" 30% ", batch_timeout=5)
    )
    assert a.dtype is torch.bfloat16 and a.device == torch.device("cpu")
    assert a.kv_cache_memory == "30%" and a.batch_timeout == 5.0
    spec = EngineArgs.from_options(dict(speculative={"method": "ngram"})).speculative
    assert spec.method == "ngram" and spec.num_speculative_tokens == 4


def test_configure_changes_runtime_options_through_the_same_checks():
    assert set(runtime_names()) == {"max_batch_size", "batch_timeout"}
    with Engine.from_model(tiny("llama-tiny"), block_size=4, compile=False) as eng:
        eng.configure(max_batch_size=3, batch_timeout=2)
        assert eng.config.args.max_batch_size == 3 == eng.scheduler.max_batch_size
        assert eng.config.args.batch_timeout == 2.0
        with pytest.raises(ParameterError, match="max_batch_size") as e:
            eng.configure(max_batch_size=0)
        assert e.value.param == "max_batch_size"
        assert eng.config.args.max_batch_size == 3  # unchanged by the refused call
        with pytest.raises(ParameterError, match="block_size"):
            eng.configure(block_size=8)


def test_resolved_config_holds_the_derived_values():
    with Engine.from_model(
        tiny("llama-tiny"), block_size=4, compile=False, kv_cache_memory=1 << 20
    ) as eng:
        cfg = eng.config
        assert cfg.args.max_model_len is None and cfg.max_model_len > 0
        assert cfg.args.max_num_batched_tokens is None and cfg.max_num_batched_tokens == 512
        per_block = eng.runner.bytes_per_block(eng.model.config, 4, cfg.dtype)
        assert cfg.num_blocks == (1 << 20) // per_block == eng.pool.num_blocks


def test_plain_steps_never_import_the_speculative_package():
    """With ``torch_topg.engine.speculative`` made impossible to import, an engine without
    ``speculative=`` builds, generates and reports its stats."""
    code = textwrap.dedent(
        """
        import sys

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.startswith("torch_topg.engine.speculative"):
                    raise ImportError(f"blocked: {name}")
                return None

        sys.meta_path.insert(0, Block())
        sys.path.insert(0, "tests")
        from engine_utils import tiny
        from torch_topg.engine import Engine

        with Engine.from_model(tiny("llama-tiny"), block_size=4, compile=False) as eng:
            out = eng.generate([[1, 2, 3, 4, 5]], max_new_tokens=5, temperature=0, ignore_eos=True)
            assert len(out[0].token_ids) == 5, out
            assert "speculative" not in eng.stats()
        assert not [m for m in sys.modules if m.startswith("torch_topg.engine.speculative")]
        print("ok")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


@pytest.mark.parametrize(
    ("file_type", "quantization", "dtype", "expected"),
    [
        (32, "gguf", None, torch.bfloat16),  # a BF16 file served packed: its own dtype
        (1, "gguf", None, torch.float32),  # F16: the CPU default
        (15, "gguf", None, torch.float32),  # Q4_K_M: the CPU default
        (32, None, None, torch.float32),  # de-quantised: the CPU default
        (32, "gguf", "float32", torch.float32),  # as given
    ],
)
def test_a_bf16_gguf_file_served_packed_computes_in_bfloat16(
    tmp_path, file_type, quantization, dtype, expected
):
    """dtype unset, on the CPU, quantization="gguf": the file's general.file_type decides
    (float32 would widen a BF16 file's weights at load); anything else keeps float32."""
    import gguf

    from torch_topg.engine.config import dtype_of

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_file_type(file_type)
    w.add_tensor("x", np.zeros(4, dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    args = EngineArgs(quantization=quantization, dtype=dtype)
    assert dtype_of(args, torch.device("cpu"), path) == expected
    assert dtype_of(args, torch.device("cpu")) == (expected if dtype else torch.float32)
    assert dtype_of(EngineArgs(quantization="gguf"), torch.device("cpu"), tmp_path / "no.gguf") == (
        torch.float32
    )
