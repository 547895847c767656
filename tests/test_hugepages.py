"""torch_topg.utils.hugepages: host tensors advised for transparent huge pages, and the
engine's CPU weights, fused weights and KV cache placed in them."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from engine_utils import prompts, tiny
from hypothesis import given
from hypothesis import strategies as st

from torch_topg.engine import Engine
from torch_topg.utils import hugepages

pytestmark = pytest.mark.above_ops  # the reference lane deselects it (docs/build.md)

DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.uint8]


@given(
    rows=st.integers(1, 1100),
    cols=st.sampled_from([1, 7, 256, 1024, 1031]),
    dtype=st.sampled_from(DTYPES),
)
def test_empty_has_the_shape_and_dtype_and_is_advised_from_one_huge_page(rows, cols, dtype):
    t = hugepages.empty((rows, cols), dtype)
    assert t.shape == (rows, cols) and t.dtype == dtype and t.device.type == "cpu"
    assert t.is_contiguous()
    big = t.numel() * t.element_size() >= hugepages.HUGE_PAGE
    if big and hugepages.enabled():
        assert hugepages.is_advised(t)
    else:  # torch's own allocation (whether malloc's arena is advised is not ours to say:
        # after other tests it can be), not a mapping of ours (those do not resize)
        assert t.untyped_storage().resizable()
    t.fill_(3)  # writable, every byte
    assert bool((t == 3).all())


def test_views_keep_the_mapping_alive():
    t = hugepages.empty((1024, 1024), torch.float32)
    t.copy_(torch.arange(t.numel(), dtype=torch.float32).view_as(t))
    v = t[1000:1002]
    del t
    gc.collect()
    junk = [torch.full((1 << 20,), 7.0) for _ in range(4)]  # reuse freed memory, if any
    assert torch.equal(v, torch.arange(1000 * 1024, 1002 * 1024, dtype=torch.float32).view(2, -1))
    del junk


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("TOPG_HUGEPAGES", "0")
    assert not hugepages.enabled()
    t = hugepages.empty((1024, 1024), torch.float32)
    # torch's own allocation (resizable storage; the advised mapping never is). Not
    # is_advised: after earlier tests malloc may hand out memory that was advised before.
    assert t.untyped_storage().resizable()
    assert hugepages.rehome_(torch.nn.Linear(1024, 1024)) == 0


def test_rehome_keeps_values_sharing_and_small_tensors():
    emb = torch.nn.Embedding(1000, 1024)
    head = torch.nn.Linear(1024, 1000, bias=False)
    head.weight = emb.weight  # tied, as SmolLM2's
    small = torch.nn.Linear(16, 16)
    mod = torch.nn.ModuleList([emb, head, small])
    mod.register_buffer("table", torch.randn(600, 1024))
    before = {k: v.clone() for k, v in mod.state_dict().items()}
    small_ptr = small.weight.data_ptr()
    moved = hugepages.rehome_(mod)
    expect = 1000 * 1024 * 4 + 600 * 1024 * 4 if hugepages.enabled() else 0
    assert moved == expect
    for k, v in mod.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert emb.weight.data_ptr() == head.weight.data_ptr()
    assert isinstance(emb.weight, torch.nn.Parameter) and emb.weight.requires_grad
    assert small.weight.data_ptr() == small_ptr
    assert hugepages.is_advised(emb.weight) == hugepages.enabled()
    assert hugepages.is_advised(mod.table) == hugepages.enabled()


def _mapping_rss(ptr: int) -> int:
    """Resident bytes of the /proc/self/smaps mapping holding address ``ptr``."""
    inside = False
    for line in open("/proc/self/smaps").read().splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and line.startswith("Rss:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no mapping")


def test_rehome_releases_a_read_only_file_mappings_pages(tmp_path):
    # A GGUF file's tensors are views of a read-only mapping: once copied into huge pages
    # the mapped pages are dropped (else a load's peak RSS is the weights twice), and a
    # view still reading them gets the file's bytes again.
    import numpy as np

    want = torch.randn(1024, 1024)
    path = tmp_path / "w.bin"
    want.numpy().tofile(path)
    mm = np.memmap(path, dtype=np.float32, mode="r", shape=(1024, 1024))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only array: torch warns it is not writable
        src = torch.from_numpy(mm)
    lin = torch.nn.Linear(1024, 1024, bias=False)
    lin.weight = torch.nn.Parameter(src, requires_grad=False)
    assert torch.equal(src, want)  # every page of the mapping read in
    resident = _mapping_rss(src.data_ptr())
    assert resident >= 4 << 20
    # the bytes the copy will take from the available memory (the engine's KV budget)
    assert hugepages.file_mapped_bytes(lin) == (4 << 20 if hugepages.enabled() else 0)
    moved = hugepages.rehome_(lin, lock=threading.Lock())
    assert torch.equal(lin.weight, want)
    assert hugepages.file_mapped_bytes(lin) == 0
    if hugepages.enabled():
        assert moved == 4 << 20 and lin.weight.data_ptr() != src.data_ptr()
        assert _mapping_rss(src.data_ptr()) < resident // 8
    assert torch.equal(src, want)  # faulted in again from the file


def test_rehome_file_mapped_in_chunks_tied_objects_swapped_together(tmp_path, monkeypatch):
    # A tied embedding and LM head as two parameter objects over one mapped tensor: one
    # copy, both swapped to it at once (a step between the two swaps would fault the
    # released pages in again: the transient the background warm-up had). The copy
    # releases the mapping chunk by chunk, here 1 MiB chunks of a tensor of an awkward
    # size (not a multiple of the chunk or of a page).
    import warnings

    import numpy as np

    if not hugepages.enabled():
        pytest.skip(
            "the kernel refuses MADV_HUGEPAGE (no transparent huge pages): rehome_ moves nothing"
        )
    monkeypatch.setattr(hugepages, "RELEASE_CHUNK", 1 << 20)
    rows, cols = 1001, 1031
    want = torch.randn(rows, cols)
    path = tmp_path / "w.bin"
    want.numpy().tofile(path)
    mm = np.memmap(path, dtype=np.float32, mode="r", shape=(rows, cols))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        src = torch.from_numpy(mm)
    emb = torch.nn.Embedding(rows, cols)
    head = torch.nn.Linear(cols, rows, bias=False)
    emb.weight = torch.nn.Parameter(src, requires_grad=False)
    head.weight = torch.nn.Parameter(src.view(rows, cols), requires_grad=False)  # another object
    mod = torch.nn.ModuleList([emb, head])
    assert torch.equal(src, want)
    released: list[int] = []
    real = hugepages._release_file_pages
    monkeypatch.setattr(hugepages, "_release_file_pages",
                        lambda t, maps: (released.append(t.numel()), real(t, maps)))  # fmt: skip
    moved = hugepages.rehome_(mod, lock=threading.RLock())
    assert moved == rows * cols * 4
    assert emb.weight.data_ptr() == head.weight.data_ptr() != src.data_ptr()
    assert torch.equal(emb.weight, want) and torch.equal(head.weight, want)
    assert len(released) == -(-rows * cols // (1 << 18)) + 1  # each chunk, then the seams
    assert _mapping_rss(src.data_ptr()) < 1 << 20


def test_tensors_built_in_huge_pages_stay_there():
    # A loader that builds a tensor in empty() memory (the GGUF loader's concatenated
    # expert rows) needs no second copy: rehome_ leaves it, and the registry forgets a
    # mapping once its last view is freed.
    if not hugepages.enabled():
        pytest.skip("the kernel refuses MADV_HUGEPAGE (no transparent huge pages)")
    t = hugepages.empty((1024, 1024), torch.float32).fill_(3.0)
    lin = torch.nn.Linear(1024, 1024, bias=False)
    lin.weight = torch.nn.Parameter(t, requires_grad=False)
    assert hugepages.in_huge_pages(lin.weight) and hugepages.in_huge_pages(t[5:])
    assert not hugepages.in_huge_pages(torch.empty(1024, 1024))
    ptr = t.data_ptr()
    assert hugepages.rehome_(lin) == 0 and lin.weight.data_ptr() == ptr
    del t, lin
    import gc

    gc.collect()
    assert ptr not in hugepages._MAPPED


def _in_read_only_file_map(t: torch.Tensor) -> bool:
    return any(a <= t.data_ptr() < b for a, b in hugepages._read_only_file_maps())


def test_gguf_load_mapped_then_copied_equals_copied(monkeypatch):
    # The engine builds a GGUF model from views of the mapped file, which rehome_ copies
    # into huge pages (dropping the mapped pages): the same tokens as a load that copies
    # every tensor, and no weight left in the read-only mapping (nothing can fault on a
    # write). Every tensor counts as big here, so every one takes the mapped path. With
    # the compile in the background, the first steps run on the mapped tensors and the
    # copy happens on the compile thread, between steps: those steps run on the decode
    # plan (the prompt in chunks: ModelRunner.step_token_cap), held there here until the
    # request is done (the trace waits after the copy), so their tokens are those of the
    # same chunked steps over tensors copied at load. The chunks' sums are not the
    # one-shot prefill's (attention over the cached chunks, the GEMV rows against the
    # GEMM), and this prompt's first three tokens lie within 0.4 nats of each other: the
    # chunked tokens differed from the compiled graph's on a Zen 4 (2026-12-08). After
    # the compile, the tokens are a compiled engine's (an un-compiled one differs: int8
    # activations, the compiled graph's fused ops round the activations from other
    # inputs). Prefix caching is off: the second request would prefill only the prompt's
    # last 5 tokens, whose int8 sums take another path than the 37-row prefill's where the
    # CPU has no VNNI (the GEMV against the AVX2 integer GEMM from 8 rows: the same rounded
    # activations, another summation order; with VNNI both take the GEMM from 4), and
    # near-tied tokens then flip (measured on a Zen 3, the Q4_1 file: 24.66 / 24.40
    # against 24.98 / 24.90).
    if not hugepages.enabled():
        pytest.skip("no MADV_HUGEPAGE here: the engine copies every tensor")
    from torch_topg.engine import model_runner

    question = [{"role": "user", "content": "What is the capital of France?"}]

    def tokens(eng):
        return eng.generate(question, max_new_tokens=6, temperature=0)[0].token_ids

    release = threading.Event()
    mark = model_runner._mark_dynamic

    def held(b):  # on the compile thread, after the copy into huge pages, before the trace
        if threading.current_thread().name == "topg-compile":
            release.wait(600)
        mark(b)

    monkeypatch.setattr(model_runner, "_mark_dynamic", held)
    runs: dict[str, list[int]] = {}
    for huge, compile, background in ((1 << 40, False, False), (4096, False, False),
                                      (4096, True, False), (1 << 40, True, True),
                                      (4096, True, True)):  # fmt: skip
        monkeypatch.setattr(hugepages, "HUGE_PAGE", huge)
        release.clear()
        with Engine.from_pretrained(quantization="gguf", seed=0, compile=compile,
                                    background_compile=background,
                                    prefix_caching=False) as eng:  # fmt: skip
            try:
                if background:  # during the background warm-up, then after it
                    runs[f"during-{huge}"] = tokens(eng)
            finally:
                release.set()
            if background:
                assert eng.runner.wait_compiled(timeout=600)
            tensors = [*eng.model.parameters(), *eng.model.buffers()]
            assert not [t.shape for t in tensors if _in_read_only_file_map(t)]
            runs[f"{huge}-{compile}-{background}"] = tokens(eng)
    eager, compiled = runs[f"{1 << 40}-False-False"], runs["4096-True-False"]
    assert runs["4096-False-False"] == eager, runs
    assert runs["during-4096"] == runs[f"during-{1 << 40}"], runs
    assert runs["4096-True-True"] == compiled == runs[f"{1 << 40}-True-True"], runs


def _engine_run(monkeypatch, on: bool):
    monkeypatch.setenv("TOPG_HUGEPAGES", "1" if on else "0")
    # every tiny tensor counts as big, so the tiny model takes the same paths as SmolLM2
    monkeypatch.setattr(hugepages, "HUGE_PAGE", 4096)
    with Engine.from_model(tiny("llama-tiny"), block_size=4) as eng:
        out = eng.generate(prompts(3, [5, 11]), max_new_tokens=6, temperature=0, ignore_eos=True)
        assert eng.runner.wait_compiled(timeout=600)  # the copy is on the compile thread
        r = eng.runner
        big = [p for p in r.model.parameters() if p.numel() * p.element_size() >= 4096]
        if on:
            advised = [hugepages.is_advised(p) for p in big]
            kv = [hugepages.is_advised(t) for t in r.kv_caches]
        else:  # from the advised mappings (not resizable), whatever malloc reused since
            advised = [not p.untyped_storage().resizable() for p in big]
            kv = [not t.untyped_storage().resizable() for t in r.kv_caches]
    return [o.outputs[0].token_ids for o in out], advised, kv


def test_engine_weights_fused_weights_and_kv_cache_in_huge_pages(monkeypatch):
    # (the decode plan runs the steps in the native lane, the compiled graph in the other)
    toks_on, advised, kv = _engine_run(monkeypatch, True)
    on = hugepages.enabled()  # False only where the kernel refuses MADV_HUGEPAGE
    assert advised and all(a == on for a in advised), advised  # incl. fused q/k/v, gate/up
    assert kv and all(k == on for k in kv)
    toks_off, advised_off, kv_off = _engine_run(monkeypatch, False)
    assert not any(advised_off) and not any(kv_off)
    assert toks_on == toks_off
