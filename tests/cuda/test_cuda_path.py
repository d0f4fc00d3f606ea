"""The CUDA path, checked on CPU: step metadata against FlashInfer's CSR semantics, bucket
padding, backend selection, the no-import guarantee, the FlashInfer backend's own logic (through
a pure-torch stand-in for flashinfer), the CUDA-graph plumbing (replayed eagerly), torch.compile
of the decode step without recompiles, swap round trips, KV budget arithmetic and the GPU check
script's dry run. What needs a GPU is in benchmarks/gpu/gpu_check.sh."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tarfile
import types
import warnings
from pathlib import Path

import pytest
import torch
from oracle import FP32_TOL, assert_teacher_forced
from stand_in_engines import (
    flashinfer_matches_torch,
    forget_flashinfer_backend,
    generate_tokens,
    use_backend,
    workload,
)
from tiny_models import FAMILIES, make_tiny_model, tiny_prompts
from torch.utils._python_dispatch import TorchDispatchMode

import paged_hf
import paged_hf.execution.runner
from paged_hf import SamplingParams
from paged_hf.execution.backends import TorchBackend, select_backend
from paged_hf.execution.backends.swap import swap_in, swap_out
from paged_hf.execution.cuda_memory import (
    FLOAT_WORKSPACE_BYTES,
    INT_WORKSPACE_BYTES,
    MARGIN_BYTES,
    kv_budget_from_profile,
    profile_forward,
    reserve_bytes,
)
from paged_hf.execution.decode_accelerator import (
    DecodeAccelerator,
    _EagerGraph,
    bucket_for,
    decode_buckets,
    pad_decode_metadata,
    padding_metadata,
)
from paged_hf.execution.metadata import build_step_metadata

REPO = Path(__file__).resolve().parents[2]


# ---- step metadata vs FlashInfer's CSR semantics ----------------------------------------------
def _fake_request(
    rid: int, num_tokens: int, computed: int, block_size: int, free: list[int]
) -> types.SimpleNamespace:
    n_blocks = -(-num_tokens // block_size)
    table = [free.pop() for _ in range(n_blocks)]
    return types.SimpleNamespace(
        request_id=str(rid),
        token_ids=list(range(100 + rid, 100 + rid + num_tokens)),
        num_tokens=num_tokens,
        num_computed_tokens=computed,
        block_table=table,
        prefill_only=False,
        score_rows=lambda start, end: (0, 0),
    )


def _csr_kv_slots(meta, i: int) -> list[int]:
    """Reference reading of FlashInfer's paged CSR: sequence i's KV slots, in position order."""
    bs = meta.block_size
    lo, hi = int(meta.kv_indptr[i]), int(meta.kv_indptr[i + 1])
    pages = meta.kv_indices[lo:hi].tolist()
    last = int(meta.kv_last_page_len[i])
    assert hi > lo and 1 <= last <= bs
    return [
        p * bs + o for j, p in enumerate(pages) for o in range(bs if j < len(pages) - 1 else last)
    ]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_metadata_matches_flashinfer_csr(block_size):
    gen = torch.Generator().manual_seed(block_size)
    free = torch.randperm(400, generator=gen).tolist()
    scheduled = []
    # decodes, chunks from the start, chunks after a cached prefix, chunks ending on a block edge
    for rid, (num_tokens, computed, n) in enumerate(
        [(9, 8, 1), (1, 0, 1), (33, 0, 20), (33, 20, 13), (16, 8, 8), (40, 17, 5), (5, 4, 1)]
    ):
        scheduled.append((_fake_request(rid, num_tokens, computed, block_size, free), n))
    meta = build_step_metadata(scheduled, block_size)

    for t in (
        meta.slot_mapping,
        meta.qo_indptr,
        meta.kv_indptr,
        meta.kv_indices,
        meta.kv_last_page_len,
    ):
        assert t.dtype == torch.int32
    assert meta.qo_indptr[0] == 0 and meta.kv_indptr[0] == 0
    assert int(meta.kv_indptr[-1]) == meta.kv_indices.numel()
    sampled = []
    for i, (req, n) in enumerate(scheduled):
        start, end = req.num_computed_tokens, req.num_computed_tokens + n
        rows = slice(int(meta.qo_indptr[i]), int(meta.qo_indptr[i + 1]))
        assert rows.stop - rows.start == n == meta.q_lens[i]
        # every KV position computed so far, this step's included, is where the block table says
        expected = [
            req.block_table[p // block_size] * block_size + p % block_size for p in range(end)
        ]
        assert _csr_kv_slots(meta, i) == expected
        assert meta.kv_lens[i] == end
        # the new tokens are the last n positions of that sequence, written where they are read
        assert meta.slot_mapping[rows].tolist() == expected[start:end]
        assert meta.positions[rows].tolist() == list(range(start, end))
        assert meta.input_ids[rows].tolist() == req.token_ids[start:end]
        if end == req.num_tokens:
            sampled.append(rows.stop - 1)
    assert meta.logits_indices.tolist() == sampled
    assert not meta.is_pure_decode
    kv_ptr = meta.kv_indptr.tolist()
    assert meta.kv_blocks == [
        meta.kv_indices[kv_ptr[i] : kv_ptr[i + 1]].tolist() for i in range(len(scheduled))
    ]
    # two uploads a step (one int64 buffer, one int32), not one copy per tensor
    storages = {
        t.untyped_storage().data_ptr()
        for t in (
            meta.input_ids,
            meta.positions,
            meta.logits_indices,
            meta.slot_mapping,
            meta.qo_indptr,
            meta.kv_indptr,
            meta.kv_indices,
            meta.kv_last_page_len,
        )
    }
    assert len(storages) == 2


def test_host_csr_equals_device_csr(fake_flashinfer):
    free = list(range(200))
    scheduled = [(_fake_request(0, 30, 0, 4, free), 30), (_fake_request(1, 9, 8, 4, free), 1)]
    meta = build_step_metadata(scheduled, 4)
    csr = fake_flashinfer.host_csr(meta)
    assert torch.equal(csr.qo_indptr, meta.qo_indptr)
    assert torch.equal(csr.kv_indptr, meta.kv_indptr)
    assert torch.equal(csr.last_page_len, meta.kv_last_page_len)


# ---- buckets and padding --------------------------------------------------------------------
def test_decode_buckets():
    assert decode_buckets(1) == [1]
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert decode_buckets(100) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100]
    buckets = decode_buckets(64)
    assert [bucket_for(b, buckets) for b in (1, 2, 3, 5, 8, 9, 16, 17, 33, 64)] == [
        1,
        2,
        4,
        8,
        8,
        16,
        16,
        32,
        48,
        64,
    ]
    assert bucket_for(65, buckets) is None


def test_pad_decode_metadata():
    bs, pad_block = 4, 99
    free = list(range(50))
    scheduled = [(_fake_request(i, n, n - 1, bs, free), 1) for i, n in enumerate([7, 1, 12])]
    meta = build_step_metadata(scheduled, bs)
    padded = pad_decode_metadata(meta, 8, pad_block)
    assert padded.num_seqs == padded.num_tokens == 8 and padded.is_pure_decode
    for i in range(3):  # real rows unchanged
        assert _csr_kv_slots(padded, i) == _csr_kv_slots(meta, i)
    for i in range(3, 8):  # padding rows: one token at position 0, in the pad block, never sampled
        assert _csr_kv_slots(padded, i) == [pad_block * bs]
        assert padded.slot_mapping[i] == pad_block * bs and padded.positions[i] == 0
        assert padded.kv_blocks[i] == [pad_block]
    assert torch.equal(padded.logits_indices, meta.logits_indices)
    assert padded.sampled_requests == meta.sampled_requests
    assert padded.qo_indptr.tolist() == list(range(9))
    for t in (
        padded.slot_mapping,
        padded.qo_indptr,
        padded.kv_indptr,
        padded.kv_indices,
        padded.kv_last_page_len,
    ):
        assert t.dtype == torch.int32
    assert pad_decode_metadata(meta, 3, pad_block) is meta
    only_pad = padding_metadata(4, bs, pad_block, "cpu")
    assert [_csr_kv_slots(only_pad, i) for i in range(4)] == [[pad_block * bs]] * 4


# ---- backend selection and the no-import guarantee ----------------------------------------------
def test_select_backend_on_cpu():
    cpu = torch.device("cpu")
    # the CPU kernel backend where it builds
    assert issubclass(select_backend("auto", cpu), TorchBackend)
    assert select_backend("torch", cpu) is TorchBackend
    with pytest.raises(ValueError, match="needs a CUDA device"):
        select_backend("flashinfer", cpu)
    with pytest.raises(ValueError, match="unknown backend"):
        select_backend("cudnn", cpu)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        paged_hf.Engine(make_tiny_model("llama"), backend="flashinfer", num_blocks=8)


def test_select_backend_on_cuda_without_flashinfer(monkeypatch):
    forget_flashinfer_backend()
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # `import flashinfer` raises ImportError
    cuda = torch.device("cuda")
    with pytest.warns(UserWarning, match="FlashInfer is not available") as record:
        assert select_backend("auto", cuda, torch.bfloat16, 128) is TorchBackend
    assert len([w for w in record if "paged_hf" in str(w.message)]) == 1
    with pytest.raises(ImportError, match=r"pip install paged_hf\[cuda\]"):
        select_backend("flashinfer", cuda)
    forget_flashinfer_backend()


@pytest.mark.parametrize(
    "error",
    [
        OSError("libcudart.so.13: cannot open shared object file"),
        RuntimeError("tvm_ffi: the library was built for another ABI"),
    ],
)
def test_select_backend_falls_back_when_flashinfer_fails_to_load(monkeypatch, error):
    """Not only a missing package: a library that does not load (OSError, RuntimeError from
    flashinfer or tvm_ffi) leaves 'auto' on torch with one warning naming it; quiet warns not."""
    import builtins

    forget_flashinfer_backend()
    real_import = builtins.__import__

    def failing(name, *args, **kwargs):
        if name == "flashinfer" or name.startswith("flashinfer."):
            raise error
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", failing)
    cuda = torch.device("cuda")
    with pytest.warns(UserWarning, match=type(error).__name__) as record:
        assert select_backend("auto", cuda, torch.bfloat16, 128) is TorchBackend
    assert len([w for w in record if "paged_hf" in str(w.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert select_backend("auto", cuda, torch.bfloat16, 128, quiet=True) is TorchBackend
    forget_flashinfer_backend()


def test_select_backend_on_cuda_with_flashinfer(fake_flashinfer, monkeypatch):
    monkeypatch.setattr(fake_flashinfer, "SUPPORTED_DTYPES", (torch.float16, torch.bfloat16))
    monkeypatch.setattr(fake_flashinfer, "SUPPORTED_HEAD_DIMS", (64, 128, 256, 512))
    cuda = torch.device("cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert (
            select_backend("auto", cuda, torch.bfloat16, 128) is fake_flashinfer.FlashInferBackend
        )
        assert select_backend("flashinfer", cuda) is fake_flashinfer.FlashInferBackend
    with pytest.warns(UserWarning, match="bfloat16"):
        assert select_backend("auto", cuda, torch.float32, 128) is TorchBackend
    with pytest.warns(UserWarning, match="head_dim"):
        assert select_backend("auto", cuda, torch.bfloat16, 16) is TorchBackend
    with pytest.raises(ValueError, match="float16 or bfloat16.*backend='torch'"):
        fake_flashinfer.FlashInferBackend(1, 4, 16, 2, 128, torch.float32, "cpu")


def test_cpu_run_never_imports_flashinfer():
    code = """
import sys
sys.path.insert(0, {tests!r})
import torch, paged_hf
from tiny_models import make_tiny_model
model = paged_hf.patch(make_tiny_model("llama"), num_blocks=16)
out = model.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=3, do_sample=False)
assert out.shape == (1, 7), out.shape
bad = sorted(m for m in sys.modules if "flashinfer" in m)
assert not bad, bad
print("ok")
""".format(tests=str(REPO / "tests"))
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


# ---- the FlashInfer backend's logic, through a stand-in flashinfer -------------------------------


@pytest.mark.parametrize("family", ["llama", "llama_mqa", "qwen2", "gemma2", "gpt2"])
def test_flashinfer_backend_matches_torch_backend(family, fake_flashinfer, monkeypatch):
    engine = flashinfer_matches_torch(
        make_tiny_model(family), fake_flashinfer.FlashInferBackend, monkeypatch
    )
    backend = engine.runner.backend
    assert isinstance(backend, fake_flashinfer.FlashInferBackend)
    kinds = {kind for kind, _ in backend._eager}
    assert kinds == {"prefill", "decode"}, (
        "mixed steps use the prefill wrapper, pure decode steps the decode one"
    )
    windows = {v[0] for v in backend.variants}
    caps = {v[1] for v in backend.variants}
    scales = {v[2] for v in backend.variants}
    if family in ("qwen2", "gemma2"):
        assert windows == {-1, 8 - 1}, "sliding layers plan window_left = sliding_window - 1"
    else:
        assert windows == {-1}
    assert caps == ({50.0} if family == "gemma2" else {0.0})
    assert len(scales) == (2 if family == "gpt2" else 1), (
        "gpt2 scales per layer: one planned variant each"
    )
    for (kind, _), wrapper in backend._eager.items():
        if kind == "prefill":
            assert wrapper.causal is True
        assert wrapper.run_count >= wrapper.plan_count >= 1


@pytest.mark.parametrize("model_type", ["gemma3_text", "cohere2"])
def test_flashinfer_backend_reads_each_cache_group_through_its_pages(
    model_type, fake_flashinfer, monkeypatch
):
    """Eager FlashInfer steps on sliding layers: each group's layers read their group's pages (window_left
    over a sequence's pages from its window's first block), the same tokens as the torch backend, and
    the sliding groups' blocks freed as they slide out."""
    from paged_hf.model.support import build_tiny_model

    model = build_tiny_model(model_type)
    prompts = tiny_prompts(model.config.vocab_size, 4, [3, 17, 30, 41], seed=21)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    kw = dict(num_blocks=96, block_size=4, max_num_seqs=8, max_num_batched_tokens=16)
    expected = [
        o.token_ids for o in paged_hf.Engine(model, backend="torch", **kw).generate(prompts, params)
    ]
    use_backend(monkeypatch, fake_flashinfer.FlashInferBackend)
    engine = paged_hf.Engine(model, **kw)
    assert (
        isinstance(engine.runner.backend, fake_flashinfer.FlashInferBackend)
        and len(engine.groups) > 1
    )
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected
    assert {v[-1] for v in engine.runner.backend.variants} == set(range(len(engine.groups)))
    keep = paged_hf.Engine(model, **kw, keep_every_kv_block=True)
    assert [o.token_ids for o in keep.generate(prompts, params)] == expected
    assert engine.stats()["kv_bytes_peak"] < keep.stats()["kv_bytes_peak"]


def test_flashinfer_backend_plans_once_per_step_per_variant(fake_flashinfer, monkeypatch):
    model = make_tiny_model("gemma2")  # 4 layers, 2 variants
    prompts, params = workload(model.config.vocab_size)
    use_backend(monkeypatch, fake_flashinfer.FlashInferBackend)
    _, engine = generate_tokens(model, prompts, params)
    backend = engine.runner.backend
    steps = engine.stats()["steps"]
    plans = sum(w.plan_count for w in backend._eager.values())
    runs = sum(w.run_count for w in backend._eager.values())
    assert plans == 2 * steps, (plans, steps)  # not once per layer
    assert runs == 4 * steps


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_cuda_graph_decode_path(family, fake_flashinfer, monkeypatch):
    """Decode steps padded to buckets and replayed from fixed buffers give the same tokens."""
    engine = flashinfer_matches_torch(
        make_tiny_model(family), fake_flashinfer.FlashInferBackend, monkeypatch, graphs=True
    )
    runner, backend = engine.runner, engine.runner.backend
    accel = runner.decode
    assert accel is not None and accel.use_graphs and accel._captured
    assert sorted(accel._graphs) == decode_buckets(8) == [1, 2, 4, 8]
    assert backend.num_blocks == 64 + 1 and accel.pad_block == 64, (
        "one extra block for padding rows"
    )
    graph_wrappers = list(backend._graph.values())
    assert graph_wrappers and all(w.use_cuda_graph for w in graph_wrappers)
    assert {b for b, _ in backend._graph} == {1, 2, 4, 8}
    replays = sum(w.run_count for w in graph_wrappers)
    assert replays > 2 * len(decode_buckets(8)) * len(backend.variants), (
        "decode steps replayed the graphs"
    )
    cap = backend._graph_bufs.kv_indices.numel()
    assert (
        backend.graph_fits(8, cap)
        and not backend.graph_fits(8, cap + 1)
        and not backend.graph_fits(9, 1)
    )
    # every graph wrapper reads the shared fixed buffers
    for (b, _), w in backend._graph.items():
        assert w._indptr_buf.data_ptr() == backend._graph_bufs.kv_indptr.data_ptr()
        assert w._indices_buf.data_ptr() == backend._graph_bufs.kv_indices.data_ptr()
    # one int workspace per variant for all its wrappers (eager and every bucket): the stand-in fails
    # a run whose workspace holds another wrapper's plan, so the tokens above also show they never clash
    wrappers = [(v, w) for (_, v), w in backend._graph.items()] + [
        (v, w) for (_, v), w in backend._eager.items()
    ]
    workspaces = {
        v: {w._int_workspace_buffer.data_ptr() for u, w in wrappers if u == v}
        for v in backend.variants
    }
    assert all(len(ptrs) == 1 for ptrs in workspaces.values()), workspaces
    assert len({p for ptrs in workspaces.values() for p in ptrs}) == len(backend.variants)


def test_warmup_captures_the_graphs_before_the_first_request(fake_flashinfer, monkeypatch):
    model = make_tiny_model("gemma2")
    prompts, params = workload(model.config.vocab_size)
    expected, _ = generate_tokens(model, prompts, params, backend="torch")
    use_backend(monkeypatch, fake_flashinfer.FlashInferBackend, graphs=True)
    engine = paged_hf.Engine(
        model, num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=24
    )
    engine.warmup()
    accel, backend = engine.runner.decode, engine.runner.backend
    assert accel._captured and sorted(accel._graphs) == decode_buckets(8)
    assert {kind for kind, _ in backend._eager} == {"prefill"} and len(backend.variants) == 2
    graphs = dict(accel._graphs)
    got = [o.token_ids for o in engine.generate(prompts, params)]
    assert got == expected
    assert accel._graphs == graphs, "no capture after warm-up"


class _HostSyncWatch(TorchDispatchMode):
    """Records ops that on CUDA would copy to or from the host or wait for the device: CUDA-graph
    capture fails on them (and outside capture they stall the step)."""

    SYNCING = {
        "_local_scalar_dense",
        "nonzero",
        "masked_select",
        "lift_fresh",
        "lift_fresh_copy",
        "unique",
        "_unique2",
        "item",
        "is_nonzero",
    }

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.SYNCING:
            self.seen.append(name)
        elif name == "index" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None
        ):
            self.seen.append("index with a bool mask")
        elif (
            name == "repeat_interleave"
            and isinstance(args[1] if len(args) > 1 else None, torch.Tensor)
            and (kwargs or {}).get("output_size") is None
        ):
            self.seen.append("repeat_interleave without output_size")
        return func(*args, **(kwargs or {}))


class _WatchedGraph(_EagerGraph):
    """An eager stand-in graph whose capture records what would break a real capture. As under a
    real one, torch.cuda.is_current_stream_capturing() is True meanwhile: transformers skips its
    data-dependent checks (packed-sequence detection, GPT-2's padding warning) when it is."""

    watches: list[_HostSyncWatch] = []

    def capture(self, fn) -> None:
        watch = _HostSyncWatch()
        self.watches.append(watch)
        self.fn = fn
        capturing = torch.cuda.is_current_stream_capturing
        torch.cuda.is_current_stream_capturing = lambda: True
        try:
            with watch:
                fn()
        finally:
            torch.cuda.is_current_stream_capturing = capturing


@pytest.mark.parametrize("family", FAMILIES)
def test_captured_decode_step_never_syncs_with_the_host(family, fake_flashinfer, monkeypatch):
    """What runs under CUDA-graph capture (the model's forward, paged attention, the K/V writes)
    makes no host round trip, which a real capture would refuse."""
    model = make_tiny_model(family)
    prompts, params = workload(model.config.vocab_size)
    use_backend(
        monkeypatch, fake_flashinfer.FlashInferBackend, graphs=True, graph_factory=_WatchedGraph
    )
    monkeypatch.setattr(_WatchedGraph, "watches", [])
    generate_tokens(model, prompts, params)
    assert len(_WatchedGraph.watches) == len(decode_buckets(8))
    assert [w.seen for w in _WatchedGraph.watches] == [[]] * len(decode_buckets(8))


def test_padding_rows_are_not_sampled():
    """A decode step padded to its bucket gives the real rows exactly the logits of the unpadded step."""
    model = make_tiny_model("llama")
    backend = TorchBackend(2, 33, 4, 2, 16, torch.float32, "cpu")
    accel = DecodeAccelerator(
        model, backend, max_num_seqs=8, pad_block=32, use_graphs=False, compile_backend=None
    )
    free = list(range(32))
    reqs = [_fake_request(i, n, 0, 4, free) for i, n in enumerate([6, 11, 3])]
    with torch.inference_mode():
        prefill = build_step_metadata([(r, r.num_tokens) for r in reqs], 4)
        backend.plan(prefill)
        with paged_hf.execution.attention.active_backend(backend):
            model(
                input_ids=prefill.input_ids[None],
                position_ids=prefill.positions[None],
                use_cache=False,
            )
        for r in reqs:
            r.num_computed_tokens = r.num_tokens
            r.token_ids.append(7)
            r.num_tokens += 1
            if len(r.block_table) * 4 < r.num_tokens:
                r.block_table.append(free.pop())
        step = build_step_metadata([(r, 1) for r in reqs], 4)
        padded = accel.run(step)  # bucket 4: one padding row
        assert padded.shape == (3, model.config.vocab_size)
        backend.plan(step)
        with paged_hf.execution.attention.active_backend(backend):
            plain = model(
                input_ids=step.input_ids[None], position_ids=step.positions[None], use_cache=False
            ).logits[0]
    torch.testing.assert_close(padded, plain)


# ---- torch.compile of the decode step ---------------------------------------------------------
def test_compiled_decode_does_not_recompile():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = make_tiny_model("llama")
    vocab = model.config.vocab_size
    # 8 requests; 3 stop early, so decode batches shrink 8 -> 5, all in bucket 8
    prompts = tiny_prompts(vocab, 8, [3, 7, 12, 5, 9, 4, 10, 6], seed=21)
    params = [SamplingParams(max_new_tokens=n) for n in (2, 3, 4, 12, 12, 12, 12, 12)]
    eager = paged_hf.Engine(
        model,
        num_blocks=64,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        backend="torch",
    )
    expected = [o.token_ids for o in eager.generate(prompts, params)]

    engine = paged_hf.Engine(
        model,
        num_blocks=64,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        backend="torch",
        compile_decode="aot_eager",
    )
    accel = engine.runner.decode
    assert accel is not None and accel.compile_backend == "aot_eager" and not accel.use_graphs
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    sizes, graphs_after_first = [], None
    while engine.has_unfinished:
        running = [r for r in engine.scheduler.running if r.num_pending_tokens == 1]
        compiled = (
            bool(running)
            and len(running) == len(engine.scheduler.running)
            and not engine.scheduler.waiting
        )
        engine.step()
        if compiled:
            sizes.append(len(running))
            if graphs_after_first is None:
                graphs_after_first = (
                    counters["stats"]["unique_graphs"],
                    counters["frames"]["total"],
                )
    assert len(sizes) >= 10 and len(set(sizes)) >= 3 and all(5 <= s <= 8 for s in sizes), sizes
    assert (
        (counters["stats"]["unique_graphs"], counters["frames"]["total"])
        == graphs_after_first
        == (1, 1)
    ), "decode steps of one bucket must reuse one compiled graph"
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert [engine.requests[rid].output_ids for rid in ids] == expected, (
        "compiled decode must match eager"
    )


# ---- swap preemption: data movement ----------------------------------------------------------
def test_swap_round_trip_torch_backend():
    backend = TorchBackend(3, 10, 4, 2, 8, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(0)
    for cache in backend.kv:
        cache.copy_(torch.randn(cache.shape, generator=gen))
    before = [c.clone() for c in backend.kv]
    handle = swap_out(backend.kv, [3, 1, 5])
    assert handle.num_blocks == 3 and handle.nbytes == 3 * 3 * 2 * 4 * 2 * 8 * 4
    # each tensor's part is one contiguous run of the host buffer (a device copy into pinned memory
    # is asynchronous only then), the parts tile the buffer without overlap
    assert all(p.is_contiguous() for p in handle.parts)
    starts = sorted(p.data_ptr() - handle.data.data_ptr() for p in handle.parts)
    assert starts == [i * handle.parts[0].nbytes for i in range(len(handle.parts))]
    for cache in backend.kv:  # the freed blocks are reused meanwhile
        cache[[3, 1, 5]] = 0
    swap_in(backend.kv, handle, [7, 2, 0])
    for layer, (old, new) in enumerate(zip(before, backend.kv)):
        assert torch.equal(new[[7, 2, 0]], old[[3, 1, 5]]), layer
        untouched = [b for b in range(10) if b not in (3, 1, 5, 7, 2, 0)]
        assert torch.equal(new[untouched], old[untouched])
    with pytest.raises(ValueError, match="holds 3 blocks"):
        swap_in(backend.kv, handle, [1, 2])
    with pytest.raises(ValueError, match="outside"):
        swap_out(backend.kv, [10])
    empty = swap_out(backend.kv, [])
    swap_in(backend.kv, empty, [])


def test_swap_methods_on_flashinfer_backend(fake_flashinfer):
    backend = fake_flashinfer.FlashInferBackend(2, 6, 4, 2, 16, torch.float32, "cpu")
    backend.kv[1][2].fill_(3.0)
    handle = backend.swap_out([2])
    backend.swap_in(handle, [4])
    assert torch.equal(backend.kv[1][4], backend.kv[1][2])


# ---- config and KV budget ------------------------------------------------------------------------
def test_config_fields():
    cfg = paged_hf.EngineConfig()
    assert (
        cfg.use_cuda_graphs is True
        and cfg.compile_decode is False
        and cfg.preemption_mode == "recompute"
    )
    with pytest.raises(ValueError, match="preemption_mode"):
        paged_hf.EngineConfig(preemption_mode="drop")
    with pytest.raises(ValueError, match="compile_decode"):
        paged_hf.EngineConfig(compile_decode=3)
    # on CPU, CUDA graphs are ignored: no accelerator, no extra block
    engine = paged_hf.Engine(make_tiny_model("llama"), num_blocks=8)
    assert engine.runner.decode is None and engine.runner.backend.num_blocks == 8


def test_kv_budget_arithmetic():
    gib = 1 << 30
    assert (
        kv_budget_from_profile(80 * gib, 0.9, 10 * gib, gib, reserve=gib)
        == int(72 * gib) - 12 * gib
    )
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.1"):
        kv_budget_from_profile(80 * gib, 0.1, 10 * gib, 0, reserve=0)
    from paged_hf.execution.cuda_memory import profile_kv_budget

    engine = paged_hf.Engine(make_tiny_model("llama"), num_blocks=8)
    with pytest.raises(ValueError, match="CUDA device"):
        profile_kv_budget(engine.model, paged_hf.EngineConfig(), engine.layout)


def test_kv_reserve_counts_workspaces_per_variant_and_the_graph_pool():
    """Gemma 2 has two attention variants (sliding and full): two int workspaces, whatever the
    number of graph buckets; GPT-2 scaled by layer index plans one variant per layer."""
    gemma = paged_hf.Engine(make_tiny_model("gemma2"), num_blocks=8).layout
    assert len(set(gemma.layers)) == 2
    assert (
        reserve_bytes(gemma, graph_pool=5)
        == FLOAT_WORKSPACE_BYTES + 2 * INT_WORKSPACE_BYTES + 5 + MARGIN_BYTES
    )
    assert reserve_bytes(gemma, 0, per_layer_scale=True) == (
        FLOAT_WORKSPACE_BYTES + len(gemma.layers) * INT_WORKSPACE_BYTES + MARGIN_BYTES
    )


def test_profiling_forward_runs_the_paged_seam_not_the_models_attention(monkeypatch):
    """KV sizing profiles what a paged step builds: Gemma 2's eager attention (its [heads, T, T]
    scores) must not run; the logits kept are the step's sampled rows."""
    engine = paged_hf.Engine(make_tiny_model("gemma2"), num_blocks=8)
    module = sys.modules[type(engine.model).__module__]

    def no_eager(*args, **kwargs):
        raise AssertionError("the model's own attention ran in the profiling forward")

    monkeypatch.setattr(module, "eager_attention_forward", no_eager)  # the tiny Gemma 2 runs eager
    with torch.inference_mode():
        logits = profile_forward(engine.model, engine.layout, tokens=40, rows=6, limit=16)
        assert logits.shape == (1, 6, engine.vocab_size)
        # the guard itself bites outside the seam
        with pytest.raises(AssertionError, match="own attention"):
            engine.model(input_ids=torch.zeros(1, 4, dtype=torch.long))


# ---- the GPU check script -------------------------------------------------------------------------
@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path):
    """gpu_check.sh as the GPU machine runs it (offline install of this repository into a private
    site, then gpu_check.py, each phase in its own process), with nothing carried, tiny sizes on CPU
    and FlashInfer's stand-in: the smoke test, agreement with graphs on and off and torch on the risky
    workload (graph buckets 8 -> 1 with padding rows, prefix hits), the throughput rows and the decode
    step; the report rewritten under the output folder after every phase."""
    out = tmp_path / "out"
    (tmp_path / "wheels").mkdir()
    # as if a phase had compiled one kernel
    jit = tmp_path / "home" / ".cache" / "flashinfer" / "batch_decode"
    jit.mkdir(parents=True)
    (jit / "batch_decode.so").write_bytes(b"\x7fELF" * 100)
    env = dict(
        os.environ,
        WHEELS=str(tmp_path / "wheels"),
        SITE=str(tmp_path / "site"),
        PYTHON=sys.executable,
        FLASHINFER_WORKSPACE_BASE=str(tmp_path / "home"),
    )
    result = subprocess.run(
        [
            "bash",
            str(REPO / "benchmarks" / "gpu" / "gpu_check.sh"),
            "--dry-run",
            "--out",
            str(out),
            "--families",
            "llama,gemma2",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["dry_run"] is True and all(
        v.startswith("ok") for v in report["phases"].values()
    ), report["phases"]
    assert list(report["phases"]) == [
        "env",
        "smoke",
        "agreement",
        "hf_generate",
        "hf_batch",
        "eager",
        "graphs",
        "decode",
        "memory",
    ]
    memory = report["memory"]
    assert memory["num_blocks"] > 0 and memory["requests_ok"] == 6
    assert memory["swap"]["preemptions"] > 0 and memory["swap"]["same_tokens"], memory["swap"]
    host = memory["host_tier"]
    assert host["same_tokens"] and host["host_hit_tokens"] > 0 and host["blocks_to_host"] > 0, host
    assert all(check["ok"] for check in report["smoke"]) and len(report["smoke"]) == 6
    assert [r["family"] for r in report["agreement"]] == ["llama", "gemma2"]
    sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))
    import gpu_check

    # the dry run's output lengths, the same for every family
    _, out_lens = gpu_check.agreement_workload(512, random.Random(0), dry=True)
    for row in report["agreement"]:
        graphs, eager, torch_row = row["flashinfer graphs"], row["flashinfer eager"], row["torch"]
        for variant in (graphs, eager, torch_row):
            # every token of the whole workload is transformers' pick, teacher-forced: its argmax or,
            # in fp32, within the oracle's tolerance of it
            assert variant["tokens"] == sum(out_lens), row
            assert variant["worst_logit_gap"] <= FP32_TOL, row
        assert (
            graphs["backend"] == eager["backend"] == "flashinfer"
            and torch_row["backend"] == "torch"
        )
        assert graphs["agrees_with_torch"] == eager["agrees_with_torch"] == 1.0, row
        assert {"1", "2", "4"} <= set(graphs["graph_steps_by_bucket"]) and not eager[
            "graph_steps_by_bucket"
        ]
        assert graphs["prefix_hit_tokens"] > 0
    names = {r["name"] for r in report["throughput"]}
    assert {
        "transformers generate",
        "transformers generate_batch",
        "paged_hf eager",
        "paged_hf cuda graphs",
    } <= names
    assert (
        "| paged_hf eager" in result.stdout
        and (out / "summary.md").exists()
        and (out / "gpu_check.log").exists()
    )
    assert f"paged_hf {tmp_path / 'site'}" in result.stdout  # the check ran the installed copy
    # the compiled kernels are kept for the next call to carry
    assert report["jit_cache"]["carried"] and report["jit_cache"]["bytes"] == 400
    with tarfile.open(out / "flashinfer_jit.tar.xz") as archive:
        assert "./batch_decode/batch_decode.so" in archive.getnames()


@pytest.mark.slow
def test_gpu_check_stops_at_once_without_flashinfer(tmp_path):
    """On a GPU run, a flashinfer that does not import stops the script before any timing."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "flashinfer.py").write_text(
        "raise OSError('libcudart.so.13: cannot open shared object file')\n"
    )
    (tmp_path / "wheels").mkdir()
    # kernels an earlier call compiled
    kernel = tmp_path / "built" / "batch_decode" / "batch_decode.so"
    kernel.parent.mkdir(parents=True)
    kernel.write_bytes(b"\x7fELF")
    with tarfile.open(tmp_path / "wheels" / "flashinfer_jit.tar.xz", "w:xz") as archive:
        archive.add(tmp_path / "built", arcname=".")
    env = dict(
        os.environ,
        WHEELS=str(tmp_path / "wheels"),
        SITE=str(tmp_path / "site"),
        PYTHON=sys.executable,
        PYTHONPATH=str(broken),
        FLASHINFER_WORKSPACE_BASE=str(tmp_path / "home"),
    )
    result = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu" / "gpu_check.sh"), "--call", "1"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=env,
    )
    assert result.returncode == 3, result.stdout[-2000:] + result.stderr[-2000:]
    assert "flashinfer / tvm_ffi do not import" in result.stderr and "libcudart" in result.stderr
    carried = tmp_path / "home" / ".cache" / "flashinfer" / "batch_decode" / "batch_decode.so"
    assert carried.read_bytes() == b"\x7fELF"  # unpacked before anything else ran


# ---- coherence: graphs hold weights' addresses -------------------------------------------------
GRAPH_GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


def test_captured_decode_graphs_follow_replaced_weights(fake_flashinfer, monkeypatch):
    model = make_tiny_model("llama")
    prompts = tiny_prompts(model.config.vocab_size, 3, [5, 9, 14], seed=11)
    use_backend(monkeypatch, fake_flashinfer.FlashInferBackend, graphs=True)
    engine = paged_hf.Engine(
        model, block_size=4, num_blocks=96, max_num_seqs=4, max_num_batched_tokens=24
    )
    engine.generate(prompts, GRAPH_GREEDY)
    accel = engine.runner.decode
    assert accel._captured
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.9)  # in place: the graphs read the live tensors
    for prompt, out in zip(prompts, engine.generate(prompts, GRAPH_GREEDY)):
        assert_teacher_forced(
            model, prompt, out.token_ids, what="after an update in place under CUDA graphs"
        )
    assert accel._captured, "an update in place needs no new capture"
    proj = model.model.layers[0].self_attn.q_proj
    # new storage: the old address is dead
    proj.weight = torch.nn.Parameter(proj.weight.detach() * -2)
    engine.check_weights(rescan=True)
    assert not accel._captured and not accel._graphs, "graphs holding the old address are dropped"
    replaced = engine.generate(prompts, GRAPH_GREEDY)
    assert accel._captured
    for prompt, out in zip(prompts, replaced):
        assert_teacher_forced(
            model, prompt, out.token_ids, what="after replacing a weight under CUDA graphs"
        )


def test_gpu_check_calls_expand_to_their_plan():
    """``--call N`` stands for its plan's options (either spelling); options after it still win."""
    sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))
    import gpu_check

    for spelled in (["--call", "1"], ["--call=1"]):
        argv = gpu_check.call_argv(["--dry-run", *spelled, "--requests", "8"])
        assert argv[0] == "--dry-run" and "--call" not in " ".join(argv)
        plan = gpu_check.CALLS["1"]
        assert argv[argv.index("--phases") + 1] == ",".join(plan["phases"])
        assert argv[argv.index("--prefill-backend") + 1] == "fa2" and argv[-2:] == [
            "--requests",
            "8",
        ]
    assert "--hf-max-time" in gpu_check.call_argv(["--call", "2"])
