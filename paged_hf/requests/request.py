"""One request's state: its tokens, sampling params, progress, blocks and timestamps.

The request never decides what runs; the scheduler reads and updates it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .detokenizer import StopStrings
    from .lock_step_call import LockStepCall


# Ids the engine makes start with this; a caller's id may not, so the two never collide: the
# engine's own ids ("paged_hf:<n>") and the ids of samples 1..n-1 of an n > 1 request
# ("paged_hf:<root id>#<k>") are unlike any id a caller can choose.
AUTO_ID_PREFIX = "paged_hf:"


def sample_request_id(root_id: str, k: int) -> str:
    """The id of sample ``k`` (1..n-1) of request ``root_id`` (sample 0 is the root itself)."""
    return f"{AUTO_ID_PREFIX}{root_id}#{k}"


def root_request_id(request_id: str) -> str:
    """The id of the request a sample's id belongs to (``request_id`` itself for a root)."""
    if request_id.startswith(AUTO_ID_PREFIX) and "#" in request_id:
        return request_id[len(AUTO_ID_PREFIX) :].rsplit("#", 1)[0]
    return request_id


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_new_tokens or max_model_len
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # failed inside a step (its sampling, callback, or the step's forward); see Request.error


@dataclass(eq=False)  # identity semantics: requests are dict keys and list members
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int = 1 << 62
    arrival_time: float = field(default_factory=time.perf_counter)
    sample_index: int = 0  # which of the parent's n samples this is
    parent: "Request | None" = None  # set on forked samples 1..n-1
    # on the root: samples 1..n-1, once forked
    children: "list[Request]" = field(default_factory=list)

    token_ids: list[int] = field(init=False)  # prompt followed by outputs
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # of the prompt, served from the prefix cache at first admission
    # per cache group (paged_hf/cache/kv_groups.py), the page of each block of its context; -1 where a
    # sliding or chunked group holds none (out of every later query's reach); empty: holds nothing
    block_tables: list = field(default_factory=list)
    # per group: the blocks before this are -1 (freed)
    kv_released: list = field(default_factory=list)
    # deepest locked prefix-index node (the block manager's handle; opaque here)
    prefix_node: Any = None
    num_tree_blocks: int = 0  # leading blocks of the tables that the prefix index holds
    first_scheduled_time: float | None = None  # first admitted: its time in the queue ends
    first_token_time: float | None = None
    last_token_time: float | None = None
    max_itl: float = 0.0  # the longest gap between two of its tokens (inter-token latency)
    num_preemptions: int = 0
    # its time-per-output-token target (its params', else the engine's): steps that decode it
    # carry only the prefill that keeps it (paged_hf/engine/step_time.py)
    tpot_target_s: float | None = None
    finish_time: float | None = None
    admitted_once: bool = False
    forked: bool = False  # for n > 1: the siblings have been created
    swapped_tokens: int = 0  # KV tokens waiting in host memory (swap preemption)
    swap_handle: Any = None  # the backend's host copy of that KV
    state_slot: int | None = None  # hybrid models: the slot holding its stateful layers' state
    swap_state_slot: int | None = None  # swap preemption: the slot whose state is to be copied out
    swapped_state: Any = None  # the host copy of that state
    # hybrids: (position, checkpoint slot) of the state snapshots this step takes, attached after it
    pending_checkpoints: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    # the key of its random stream (paged_hf/execution/random_streams.py): its params' seed (+ its
    # sample index), else drawn from torch's default generator when it was added; None: greedy
    seed: int | None = None
    error: str | None = None  # why it finished with FinishReason.ERROR
    # prefix-cache namespace it was admitted under (the weights' generation)
    cache_namespace: Any = None
    # its part in the tiers under the prefix cache (paged_hf/engine/kv_tiers.py's TierState): its
    # blocks' keys, how many every tier holds, a lookup kept for an admission; None before one
    tier_state: Any = None
    stop_strings: "StopStrings | None" = None  # matches params.stop in the output as it grows
    grammar: Any = None  # structured outputs: its grammar matcher (paged_hf/engine/structured.py)
    # the tokens encoder_repetition_penalty favours: None, the prompt's; patched generate's, the row
    # as the caller padded it, pad included (transformers penalises its input_ids as they are)
    encoder_token_ids: tuple[int, ...] | None = None
    # the generate call it is a row of, where that call's callbacks need its rows in lock-step
    # (paged_hf/requests/lock_step_call.py): a row waits while its call is not ready to move on
    call: "LockStepCall[Request] | None" = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    # Scoring: the logprob of token score_targets[i] comes from the logits of position
    # score_start + i (prompt_logprobs: the prompt's own tokens 1.. from positions 0..; a scoring
    # request: its continuation). Positions served from the prefix cache have no logits, so the
    # cache may serve only positions before the next one still to score (prefix_limit).
    score_targets: list[int] | None = None
    score_start: int = 0
    # per target so far: (logprob, is greedy, top-k dict or None)
    scored: list = field(default_factory=list)
    # a scoring request: computes its prompt's logits and finishes, samples nothing
    prefill_only: bool = False
    # params.output_hidden_states: per step that computed positions of it not recorded yet,
    # [layers + 1, positions, hidden] (positions 0.. in order; a recompute adds none twice)
    hidden_states: list = field(default_factory=list)
    hidden_positions: int = 0  # positions recorded so far
    # a prompt given as embeddings ([prompt tokens, hidden]: transformers' inputs_embeds): they enter
    # the forward at the prompt's positions instead of its token ids' embeddings
    prompt_embeds: Any = None
    embeds_key: str | None = None  # a digest of their bytes: equal embeddings share cached KV
    # speculative decoding: the tokens proposed to follow its own, verified by this step's
    # forward after its pending token (paged_hf/engine/speculation.py); counts over its life
    draft: list = field(default_factory=list)
    draft_proposed: int = 0
    draft_accepted: int = 0
    draft_rejections: int = 0  # verifications that stopped short of the draft's end

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_ids)

    @property
    def block_table(self) -> list[int]:
        """Group 0's pages: a full-attention group's (the only group of most models)."""
        return self.block_tables[0] if self.block_tables else []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    def step_ids(self, start: int, end: int) -> list[int]:
        """The tokens at positions [start, end): its own, then its draft's."""
        if end <= len(self.token_ids):
            return self.token_ids[start:end]
        return (self.token_ids + self.draft)[start:end]

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose KV still has to be computed before the next sample."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def samples(self) -> "list[Request]":
        """The root and its forked samples, in sample order."""
        return [self] + self.children

    @property
    def samples_finished(self) -> bool:
        """Every sample of this root is finished (a root that ended before forking has only itself)."""
        return all(r.is_finished for r in self.samples)

    @property
    def prefix_limit(self) -> int:
        """How many leading tokens the prefix cache may serve at admission: all but the last (its
        logits give the next sample), and none from the next position still to be scored."""
        limit = self.num_tokens - 1
        if self.score_targets is not None and len(self.scored) < len(self.score_targets):
            limit = min(limit, self.score_start + len(self.scored))
        if self.params.output_hidden_states:  # the cache keeps KV, not hidden states
            limit = min(limit, self.hidden_positions)
        return limit

    def score_rows(self, start: int, end: int) -> tuple[int, int]:
        """(first target, count) of the targets whose logits are at positions [start, end)."""
        if self.score_targets is None:
            return 0, 0
        first = max(start, self.score_start + len(self.scored))
        last = min(end, self.score_start + len(self.score_targets))
        return first - self.score_start, max(0, last - first)

    @property
    def cache_salt(self) -> str | None:
        """The salt its prefix-cache keys carry: its own, and the prompt's embeddings' digest where
        the prompt came as embeddings (its token ids are placeholders then, or do not decide the KV)."""
        if self.embeds_key is None:
            return self.params.cache_salt
        return f"{self.params.cache_salt}|embeds:{self.embeds_key}"

    @property
    def seqs_when_running(self) -> int:
        """Sequences this request will occupy once it samples (n > 1 forks into n)."""
        return 1 if self.forked or self.parent is not None or self.prefill_only else self.params.n

    def append_token(self, token: int, now: float) -> bool:
        """Record a sampled token; return True when that finishes the request."""
        self.token_ids.append(token)
        if self.first_token_time is None:
            self.first_token_time = now
        else:
            self.max_itl = max(self.max_itl, now - self.last_token_time)
        self.last_token_time = now
        p = self.params
        n_out = self.num_output_tokens
        if n_out >= p.min_new_tokens and (
            token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)
        ):
            self.finish_reason = FinishReason.STOP
            self.stop_reason = token if token in p.stop_token_ids else None
        elif n_out >= p.max_new_tokens or self.num_tokens >= self.max_model_len:
            self.finish_reason = FinishReason.LENGTH
        return self.finish_reason is not None
