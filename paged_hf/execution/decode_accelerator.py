"""Fast decode steps: padded to batch buckets, then replayed from CUDA graphs and/or compiled.

A pure-decode step of b sequences runs as a step of ``bucket_for(b)`` rows: rows past b are
padding that read and write one reserved KV block (``pad_block``, one block beyond those the
block manager hands out) and are never sampled, since ``logits_indices`` names real rows only.

Design notes: docs/internals.md, paged_hf/execution/decode_accelerator.py.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from .attention import active_backend
from .metadata import StepMetadata

logger = logging.getLogger("paged_hf")


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, 8, then every multiple of 16, and max_num_seqs itself."""
    sizes = {b for b in (1, 2, 4, 8) if b < max_num_seqs}
    sizes.update(range(16, max_num_seqs, 16))
    sizes.add(max_num_seqs)
    return sorted(sizes)


def bucket_for(num_seqs: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding ``num_seqs`` rows, or None when it is above the largest."""
    for b in buckets:
        if b >= num_seqs:
            return b
    return None


def padding_metadata(
    batch: int, block_size: int, pad_block: int, device: torch.device | str
) -> StepMetadata:
    """A decode step of ``batch`` padding rows only (what a bucket is captured with)."""

    def i32(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int32, device=device)

    return StepMetadata(
        input_ids=torch.zeros(batch, dtype=torch.long, device=device),
        positions=torch.zeros(batch, dtype=torch.long, device=device),
        slot_mapping=i32([pad_block * block_size] * batch),
        qo_indptr=i32(list(range(batch + 1))),
        kv_indptr=i32(list(range(batch + 1))),
        kv_indices=i32([pad_block] * batch),
        kv_last_page_len=i32([1] * batch),
        logits_indices=torch.zeros(0, dtype=torch.long, device=device),
        block_size=block_size,
        q_lens=[1] * batch,
        kv_lens=[1] * batch,
        kv_blocks=[[pad_block]] * batch,
        sampled_requests=[],
    )


def pad_decode_metadata(meta: StepMetadata, batch: int, pad_block: int) -> StepMetadata:
    """``meta`` (a pure-decode step) grown to ``batch`` rows; each padding row is a sequence of one
    token at position 0 whose only KV page is ``pad_block``. Sampled rows are unchanged."""
    n = meta.num_seqs
    assert meta.is_pure_decode and n <= batch, (n, batch)
    if n == batch:
        return meta
    pad = batch - n
    dev = meta.input_ids.device
    bs = meta.block_size

    def grow(t: torch.Tensor, fill: int, step: int = 0) -> torch.Tensor:
        # made on the device: no host-to-device copy
        values = (
            (torch.arange(1, pad + 1, dtype=t.dtype, device=dev) + fill)
            if step
            else torch.full((pad,), fill, dtype=t.dtype, device=dev)
        )
        return torch.cat([t, values])

    return StepMetadata(
        input_ids=grow(meta.input_ids, 0),
        positions=grow(meta.positions, 0),
        slot_mapping=grow(meta.slot_mapping, pad_block * bs),
        qo_indptr=grow(meta.qo_indptr, n, step=1),
        kv_indptr=grow(meta.kv_indptr, int(meta.kv_indices.numel()), step=1),
        kv_indices=grow(meta.kv_indices, pad_block),
        kv_last_page_len=grow(meta.kv_last_page_len, 1),
        logits_indices=meta.logits_indices,
        block_size=bs,
        q_lens=meta.q_lens + [1] * pad,
        kv_lens=meta.kv_lens + [1] * pad,
        kv_blocks=meta.kv_blocks + [[pad_block]] * pad,
        sampled_requests=meta.sampled_requests,
    )


class _CudaGraph:
    def __init__(self, pool: Any) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], None]) -> None:
        # thread_local: the background engine (serve.py) captures on its own thread, and "global"
        # would make any CUDA call of another thread (a notebook's) fail while it does.
        with torch.cuda.graph(self.graph, pool=self.pool, capture_error_mode="thread_local"):
            fn()

    def replay(self) -> None:
        self.graph.replay()


class _EagerGraph:
    """Stands in for a CUDA graph where there is none (tests on CPU): replay re-runs the capture
    function, which reads the same fixed buffers a real graph would."""

    def __init__(self, pool: Any = None) -> None:
        self.fn: Callable[[], None] | None = None

    def capture(self, fn: Callable[[], None]) -> None:
        self.fn = fn
        fn()

    def replay(self) -> None:
        self.fn()


def wants_decode_accelerator(config: Any, device: torch.device) -> bool:
    """Whether the runner should build a ``DecodeAccelerator`` (and reserve its padding block)."""
    return bool(config.compile_decode) or (config.use_cuda_graphs and device.type == "cuda")


class DecodeAccelerator:
    def __init__(
        self,
        model: torch.nn.Module,
        backend: Any,
        max_num_seqs: int,
        pad_block: int,
        *,
        use_graphs: bool,
        compile_backend: str | None,
        graph_factory: Callable[[Any], Any] | None = None,
    ) -> None:
        self.model = model
        self.backend = backend
        self.pad_block = pad_block
        self.buckets = decode_buckets(max_num_seqs)
        self.device = backend.device
        self.use_graphs = use_graphs
        self.compile_backend = compile_backend
        if compile_backend is not None:
            from .compile_decode import OpBackend, compile_forward

            self._forward = compile_forward(model, compile_backend)
            self._op_backend = OpBackend(backend.layout)
        self._graph_factory = graph_factory or _CudaGraph
        self._graphs: dict[int, Any] = {}
        self._captured = False
        self.steps_by_bucket: dict[
            int, int
        ] = {}  # decode steps run per padded batch size (gpu_check reads it)
        if use_graphs:
            max_b = self.buckets[-1]
            # page ids of one padded step: each sequence's blocks (prefix blocks may repeat across
            # sequences, so allow twice the pool) plus one pad page per row; bigger steps run eagerly
            backend.prepare_cuda_graphs(max_b, 2 * backend.num_blocks + max_b)
            self._input_ids = torch.zeros(1, max_b, dtype=torch.long, device=self.device)
            self._positions = torch.zeros(1, max_b, dtype=torch.long, device=self.device)
            self._logits: torch.Tensor | None = None

    @classmethod
    def build(
        cls, model: torch.nn.Module, backend: Any, config: Any, pad_block: int
    ) -> "DecodeAccelerator | None":
        use_graphs = (
            config.use_cuda_graphs
            and backend.device.type == "cuda"
            and getattr(backend, "supports_cuda_graphs", False)
        )
        if config.use_cuda_graphs and backend.device.type == "cuda" and not use_graphs:
            logger.info(
                "paged_hf: CUDA graphs need the flashinfer backend; the %s backend decodes eagerly",
                backend.name,
            )
        compile_backend = None
        if config.compile_decode:
            compile_backend = (
                "inductor" if config.compile_decode is True else str(config.compile_decode)
            )
        if not use_graphs and compile_backend is None:
            return None
        return cls(
            model,
            backend,
            config.max_num_seqs,
            pad_block,
            use_graphs=use_graphs,
            compile_backend=compile_backend,
        )

    # ---- one step ------------------------------------------------------------------------------
    def can_run(self, meta: StepMetadata) -> bool:
        if not meta.is_pure_decode:
            return False
        b = bucket_for(meta.num_seqs, self.buckets)
        if b is None:
            return False
        if self.use_graphs:  # padding rows read one page each
            return self.backend.graph_fits(b, int(meta.kv_indices.numel()) + b - meta.num_seqs)
        return True

    def run(self, meta: StepMetadata) -> torch.Tensor:
        """Logits [len(meta.logits_indices), V] of a step that ``can_run``."""
        b = bucket_for(meta.num_seqs, self.buckets)
        self.steps_by_bucket[b] = self.steps_by_bucket.get(b, 0) + 1
        padded = pad_decode_metadata(meta, b, self.pad_block)
        if not self.use_graphs:
            self.backend.plan(padded)
            logits = self._call(padded.input_ids[None], padded.positions[None])
            return logits.index_select(0, meta.logits_indices)
        if not self._captured:
            self.capture()
        self._input_ids[0, :b].copy_(padded.input_ids)
        self._positions[0, :b].copy_(padded.positions)
        self.backend.plan(padded, graph_batch=b)
        self._graphs[b].replay()
        return self._logits[:b].index_select(0, meta.logits_indices)

    def _call(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.compile_backend is not None:
            from .compile_decode import compiled_step

            if input_ids.storage_offset() or positions.storage_offset():
                # views of one uploaded buffer (metadata.upload): a compiled graph guards on the offset
                input_ids, positions = input_ids.clone(), positions.clone()
            with compiled_step(self._op_backend, self.backend):
                return self._forward(input_ids, positions)
        with active_backend(self.backend):
            return self.model(input_ids=input_ids, position_ids=positions, use_cache=False).logits[
                0
            ]

    def weights_changed(self, moved: bool) -> None:
        """A captured graph reads each weight at the address it had at capture, so an update in
        place is seen; new storage (``moved``) is not, so the graphs are captured again on next
        use. A compiled forward may have folded the weights into constants (inductor's
        freezing): it is compiled again on any change."""
        if moved or self.compile_backend is not None:
            self._graphs.clear()
            self._captured = False
        if self.compile_backend is not None:
            from .compile_decode import compile_forward

            self._forward = compile_forward(self.model, self.compile_backend)

    # ---- capture -------------------------------------------------------------------------------
    def capture(self) -> None:
        """Capture every bucket, largest first, into one memory pool."""
        bs = self.backend.block_size
        pool = torch.cuda.graph_pool_handle() if self._graph_factory is _CudaGraph else None
        for b in reversed(self.buckets):
            meta = padding_metadata(b, bs, self.pad_block, self.device)
            self._input_ids[0, :b].zero_()
            self._positions[0, :b].zero_()
            self.backend.plan(meta, graph_batch=b)
            ids, pos = self._input_ids[:, :b], self._positions[:, :b]
            warm = self._call(ids, pos)  # eager: learns attention variants, compiles, loads kernels
            if self._logits is None:
                self._logits = torch.zeros(
                    self.buckets[-1], warm.shape[-1], dtype=warm.dtype, device=self.device
                )
            del warm
            self.backend.plan(meta, graph_batch=b)  # now with every variant planned before capture
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            graph = self._graph_factory(pool)

            def step(b: int = b, ids: torch.Tensor = ids, pos: torch.Tensor = pos) -> None:
                self._logits[:b].copy_(self._call(ids, pos))

            graph.capture(step)
            self._graphs[b] = graph
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._captured = True
        logger.info("paged_hf: captured decode CUDA graphs for batch sizes %s", self.buckets)
