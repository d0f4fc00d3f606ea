"""Engine configuration: one dataclass, validated where it is built."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# Each default below is where the measured trade-off settled (docs/measurements.md, "Why the
# engine's defaults"): a step budget that keeps prefill chunks near the best matmul rate without
# holding decodes up for long.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512
DEFAULT_MAX_NUM_SEQS = 128
DEFAULT_BLOCK_SIZE = 16
DEFAULT_CPU_KV_BYTES = 1 << 30  # 1 GiB of KV unless told otherwise
# Prefill tokens a step may carry while decodes run, on a CPU: a steady token stream beside long
# prompts for a few % of throughput. On CUDA no cap: a GPU step's cost hardly grows with its rows.
DEFAULT_CPU_MAX_PREFILL_TOKENS_WHILE_DECODING = 128
# A throughput call's step budget on a CPU when max_num_batched_tokens is not set (models
# without recurrent state): nobody waits on a token there, and wider steps run the linears faster.
DEFAULT_CPU_THROUGHPUT_CALL_TOKENS = 2048
DEFAULT_KV_CACHE_DIR_BYTES = 16 << 30


@dataclass
class EngineConfig:
    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int | None = None  # None: size from kv_cache_memory
    kv_cache_memory: float | int | None = None  # bytes on CPU, a fraction of free memory on CUDA
    gpu_memory_utilization: float = 0.9
    # None: the defaults below, each yielding to the other option when that one is set (a decode
    # needs one token of budget, so max_num_seqs can never exceed max_num_batched_tokens)
    max_num_seqs: int | None = None  # DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int | None = None  # DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # prefill tokens per step while decodes run (None: all the budget they leave); lower means a
    # steadier token stream next to long prompts, at the cost of those prompts' time to first token.
    # "auto": DEFAULT_CPU_MAX_PREFILL_TOKENS_WHILE_DECODING on a CPU, no cap on CUDA
    max_prefill_tokens_while_decoding: int | str | None = "auto"
    enable_prefix_caching: bool = True
    # sliding-window and chunked layers keep every block, as full ones do (for comparisons): by
    # default a block goes back to the pool once no query can read it (paged_hf/cache/kv_groups.py)
    keep_every_kv_block: bool = False
    backend: str = "auto"  # "auto", "torch" or "flashinfer"
    # prefix-cache namespace (model / adapter id); None: derived from the model
    namespace: str | None = None
    # the CUDA path: paged_hf/execution/decode_accelerator.py, compile_decode.py, backends/swap.py
    # capture pure-decode steps per batch bucket; CUDA + FlashInfer only, else ignored
    use_cuda_graphs: bool = True
    # torch.compile the decode step; a string names the compile backend
    compile_decode: bool | str = False
    # or "swap": preempted requests' blocks go to pinned host memory
    preemption_mode: str = "recompute"
    # "fcfs": arrival order, the head of the queue waits for room. "priority": lower
    # SamplingParams.priority first, then arrival; a request that does not fit lets up to
    # ``priority_lookahead`` behind it go first, and preempts running requests of a higher number
    scheduling_policy: str = "fcfs"
    priority_lookahead: int = 8
    # under "priority", a request waiting this long (seconds since it arrived) competes as priority
    # 0 for admission, so batch work is not starved (None: never)
    priority_aging_s: float | None = 60.0
    # requests waiting at most; a request beyond it is refused at once with QueueFull, or under
    # "priority" the least urgent waiting one is (None: no bound)
    max_waiting: int | None = None
    # seconds per output token for requests that set no SamplingParams.tpot_target_s (None: none);
    # while requests with a target decode, a step carries only the prefill that keeps the tightest
    tpot_target_s: float | None = None
    # bytes of host memory keeping KV records under the pool (paged_hf/engine/kv_tiers.py): prompt
    # blocks computed here are kept there, and read back where the prefix cache misses (None: none)
    kv_host_cache_bytes: int | None = None
    # when prompt blocks go to host memory: "eviction", as the pool evicts them from the prefix
    # cache (each block copied out once, and only if the pool lets it go); "through", as soon as
    # they are computed, as the disk tier is always written
    kv_host_write: str = "eviction"
    # a directory of KV records that outlives the process (paged_hf/engine/kv_tiers.py): prompt
    # blocks computed here are written there, and read back where the prefix cache misses, by any
    # process with the same weights. None: $PAGED_HF_KV_CACHE_DIR, or no disk tier
    kv_cache_dir: str | None = None
    kv_cache_dir_bytes: int = DEFAULT_KV_CACHE_DIR_BYTES  # least recently used records go beyond it
    # each sequence's tokens the same whatever else its steps hold and wherever its prompt's KV came
    # from (computed, the prefix cache, a tier): a bf16 model's GEMMs run 32 rows at a time, where
    # oneDNN sums each row in one order (at other row counts it sums otherwise). CPU, bf16, dense
    # models only, refused elsewhere (paged_hf/execution/cpu/batch_invariance.py); prefill slower
    batch_invariant: bool = False
    # on a CPU: linear layers run on weights packed once for oneDNN (paged_hf/execution/cpu/linear.py): bf16
    # for its bf16 matmul (same results), or as fp32 copies where the CPU has no bf16 matmul (within one bf16
    # rounding, ~5x faster there); fp32 models on its fp32 matmul (within fp32 rounding, up to 2.5x faster at
    # decode sizes). "onednn" / "fp32" asks for one way for a bf16 model
    cpu_packed_weights: bool | str = True
    # with packed weights: linears called on the same input (q/k/v, gate/up) run as one GEMM, same results
    cpu_fused_projections: bool = True
    # with oneDNN's bf16 packed weights, on AVX-512 bf16 CPUs: GEMMs of up to 512 rows (8 beside AMX) on a
    # second copy laid out for a kernel that streams it (1.4-2.4x oneDNN at 1-8 rows, 1.0-1.3x above; within
    # one bf16 rounding of its results, checked; paged_hf/execution/cpu/small_rows.py). Not under batch_invariant;
    # with memory for one packed copy only, this one where it serves a step's whole budget (no AMX)
    cpu_small_row_gemm: bool = True
    # on a CPU: RMSNorm, SiLU-and-multiply and rotary embedding as one C++ op each, where checked on the
    # model to give its modules' outputs (paged_hf/execution/cpu/fused_ops.py)
    cpu_fused_ops: bool = True
    # with fused ops and fused projections: a pre-norm decoder layer checked on the model to be the canonical
    # block runs as one compact function, its own code's ops without its Python (paged_hf/execution/cpu/compact_layers.py)
    cpu_compact_layers: bool = True
    # on a CPU: glibc's malloc keeps a step's freed temporaries mapped, and torch's CPU allocator keeps
    # freed large blocks, for the next step instead of faulting them in again (process-wide, once;
    # paged_hf/execution/cpu/malloc.py)
    cpu_tune_malloc: bool = True
    # under tensor parallelism (paged_hf/engine/ranks.py): seconds a rank waits for another's
    # message before it raises naming the ranks, instead of hanging on a rank that stopped
    tp_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "num_blocks"):
            value = getattr(self, name)
            if value is not None or name == "block_size":
                _check_int(name, value, 1)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 2)
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(
                DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_num_seqs or 0
            )
        if self.max_num_seqs is None:
            self.max_num_seqs = min(DEFAULT_MAX_NUM_SEQS, self.max_num_batched_tokens)
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError(
                f"max_num_seqs={self.max_num_seqs} exceeds max_num_batched_tokens="
                f"{self.max_num_batched_tokens}: decodes need one token of budget each"
            )
        cap = self.max_prefill_tokens_while_decoding
        if cap is not None and cap != "auto" and not _is_int_at_least(cap, 1):
            raise ValueError(
                f"max_prefill_tokens_while_decoding={cap!r}, must be 'auto', None or an integer >= 1"
            )
        memory = self.kv_cache_memory
        if memory is not None and (
            not isinstance(memory, (int, float)) or isinstance(memory, bool) or not memory > 0
        ):
            raise ValueError(f"kv_cache_memory={memory!r}, must be > 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization!r}, must be in (0, 1]"
            )
        if not (isinstance(self.tp_timeout_s, (int, float)) and self.tp_timeout_s > 0):
            raise ValueError(f"tp_timeout_s={self.tp_timeout_s!r}, must be > 0")
        self._check_switches()

    def _check_switches(self) -> None:
        """The options that take one of a few values."""
        if not (
            isinstance(self.cpu_packed_weights, bool)
            or self.cpu_packed_weights in ("onednn", "fp32", "rows")
        ):
            raise ValueError(
                f"cpu_packed_weights={self.cpu_packed_weights!r}: True, False, 'onednn', 'fp32' or 'rows'"
            )
        for name in (
            "batch_invariant",
            "enable_prefix_caching",
            "use_cuda_graphs",
            "keep_every_kv_block",
            "cpu_fused_projections",
            "cpu_small_row_gemm",
            "cpu_fused_ops",
            "cpu_compact_layers",
            "cpu_tune_malloc",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}, must be True or False")
        if self.backend not in ("auto", "torch", "flashinfer"):
            raise ValueError(f"backend={self.backend!r}, must be 'auto', 'torch' or 'flashinfer'")
        if not isinstance(self.compile_decode, (bool, str)) or self.compile_decode == "":
            raise ValueError(
                f"compile_decode={self.compile_decode!r}, must be a bool or a torch.compile backend name"
            )
        if self.batch_invariant and (self.cpu_packed_weights is False or self.compile_decode):
            raise ValueError(
                "batch_invariant=True runs the linears on packed weights and decodes eagerly; "
                f"cpu_packed_weights={self.cpu_packed_weights!r} and "
                f"compile_decode={self.compile_decode!r} contradict it"
            )
        if self.kv_host_write not in ("eviction", "through"):
            raise ValueError(
                f"kv_host_write={self.kv_host_write!r}, must be 'eviction' or 'through'"
            )
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(
                f"preemption_mode={self.preemption_mode!r}, must be 'recompute' or 'swap'"
            )
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy={self.scheduling_policy!r}, must be 'fcfs' or 'priority'"
            )
        _check_int("priority_lookahead", self.priority_lookahead, 0)
        if self.max_waiting is not None:
            _check_int("max_waiting", self.max_waiting, 1)
        _check_int("kv_cache_dir_bytes", self.kv_cache_dir_bytes, 1)
        if self.kv_host_cache_bytes is not None:
            _check_int("kv_host_cache_bytes", self.kv_host_cache_bytes, 1)
        if self.kv_cache_dir is None and self.enable_prefix_caching:
            self.kv_cache_dir = os.environ.get("PAGED_HF_KV_CACHE_DIR") or None
        tiers = self.kv_cache_dir is not None or self.kv_host_cache_bytes is not None
        if tiers and not self.enable_prefix_caching:
            raise ValueError(
                "kv_cache_dir and kv_host_cache_bytes need enable_prefix_caching=True: the tiers "
                "are under it"
            )
        target = self.tpot_target_s
        if target is not None and not (
            isinstance(target, (int, float)) and not isinstance(target, bool) and target > 0
        ):
            raise ValueError(f"tpot_target_s={target!r}, must be None or a number of seconds > 0")
        aging = self.priority_aging_s
        if aging is not None and not (
            isinstance(aging, (int, float)) and not isinstance(aging, bool) and aging >= 0
        ):
            raise ValueError(f"priority_aging_s={aging!r}, must be None or a number >= 0")

    def resolve_for(self, device: "torch.device") -> None:
        """Settle the defaults that depend on the device the model is on."""
        if self.max_prefill_tokens_while_decoding == "auto":
            self.max_prefill_tokens_while_decoding = (
                DEFAULT_CPU_MAX_PREFILL_TOKENS_WHILE_DECODING if device.type == "cpu" else None
            )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; known: {sorted(names)}")
        return cls(**kwargs)


def _is_int_at_least(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _check_int(name: str, value: Any, least: int) -> None:
    if not _is_int_at_least(value, least):
        raise ValueError(f"{name}={value!r}, must be an integer >= {least}")
