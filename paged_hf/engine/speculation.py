"""Speculative decoding by prompt lookup, inside the continuous batch.

A decoding request whose params ask for it (``prompt_lookup_num_tokens``) proposes up to k
tokens (paged_hf/requests/prompt_lookup.py) when it is scheduled, and the step computes its
pending token and the draft as one chunk: its KV slots and the token budget count them, and the
forward keeps the logits after each of the k + 1 positions, and the sampler picks a token at each
as a plain step would. The row takes the longest prefix of the draft those picks repeat, and the
pick after it: greedy, the tokens a step at a time would pick, up to the rounding of a chunk
against single steps (near-ties); sampled, each token drawn from the model's distribution after
the ones before it (a draft token is taken with its probability, else the draw is kept: the
rejection rule of speculative sampling for a proposal of one token, exact in distribution). The KV
of the rejected positions is left behind the request's count of computed tokens, where its next
tokens overwrite it; the prefix index only ever takes blocks below that count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..requests.prompt_lookup import propose
from ..requests.request import Request


@dataclass(frozen=True)
class DraftCosts:
    """What a step's tokens cost (paged_hf/engine/step_time.py's fit of this engine's steps):
    ``token_s`` is the plain step's time over the rows it decodes (what one written token costs
    now), ``per_token`` what a token of a chunk adds, ``per_row`` what a decoding row adds, and
    ``draft_token_s`` a drafted token's share of the draft model's steps (none for prompt lookup)."""

    token_s: float
    per_token: float
    per_row: float
    draft_token_s: float = 0.0

    def best_length(self, alpha: float, k: int, drafted: bool = False) -> int:
        """The draft length whose expected taken tokens (a chain: the j-th is taken with
        probability ``alpha`` ** j) are worth the most over what its positions add to the step
        (and, ``drafted`` by a draft model, what its draft steps cost)."""
        best, best_gain, expected = 0, 0.0, 0.0
        proposing = self.draft_token_s if drafted else 0.0
        for d in range(1, k + 1):
            expected += alpha**d
            gain = expected * self.token_s - ((d + 1) * self.per_token - self.per_row)
            gain -= d * proposing
            if gain > best_gain:
                best, best_gain = d, gain
        return best


def draft_costs(
    coef: tuple[float, float, float] | None, decode_rows: int, draft_step_s: float = 0.0
) -> DraftCosts | None:
    """The costs of a step of ``decode_rows`` decodes from the step-time fit (and the draft
    model's last step time, shared by the rows); None while there is no fit (then rows draft
    only in a step of at most ``UNFITTED_ROWS``)."""
    if coef is None or decode_rows == 0:
        return None
    base, per_row, per_token = coef
    # a lone row's taken token saves a whole step; among several, less (TAKEN_VALUE)
    value = 1.0 if decode_rows == 1 else TAKEN_VALUE
    token_s = (base + per_row * decode_rows) / decode_rows * value
    return DraftCosts(token_s, per_token, per_row, draft_step_s / decode_rows)


# A taken token is valued at this share of what a written token costs the step: rows finish at
# different steps once they draft, and the last rows of a call run in thin steps, so the call
# saves less than the tokens' share of steps (bench_speculative.py: at a full share, 32 rows of
# edits ran 0.86x of plain; docs/speculative.md)
TAKEN_VALUE = 0.5
UNFITTED_ROWS = 2  # before the engine has timed its steps: a notebook's call or two, where a step is its overhead


def acceptance(req: Request, prior: float = 0.5) -> float:
    """The chance its next draft token is taken: taken tokens over those and the verifications
    that stopped short (a geometric chain's estimate), from two of ``prior``'s odds before any."""
    return (req.draft_accepted + 2 * prior) / (req.draft_accepted + req.draft_rejections + 2)


def draft_room(
    req: Request, budget: int, costs: DraftCosts | None, decode_rows: int, prior: float = 0.5
) -> int:
    """How many tokens ``req`` may propose this step: none unless it decodes and its params ask;
    what the budget, its length limits and the step's costs leave."""
    p = req.params
    k = p.prompt_lookup_num_tokens or p.num_assistant_tokens
    if not k or req.num_pending_tokens != 1 or req.call is not None:
        return 0
    out = req.num_output_tokens
    room = min(
        k,
        budget - 1,
        p.max_new_tokens - out - 1,  # the step appends up to k + 1 tokens
        req.max_model_len - req.num_tokens - 1,
    )
    if out < p.min_new_tokens:  # EOS banned at all k + 1 positions, as the sampler bans it now
        room = min(room, p.min_new_tokens - out - 1)
    drafted = bool(p.num_assistant_tokens)
    if costs is not None:
        return max(0, min(room, costs.best_length(acceptance(req, prior), room, drafted)))
    if decode_rows > UNFITTED_ROWS:
        return 0
    if drafted:  # untimed draft steps: as long as the row's record says its runs are
        alpha = acceptance(req, prior)
        room = min(room, 1 + round(2 * alpha / (1 - alpha)))
    return max(0, room)


def stop_ids(req: Request) -> frozenset[int]:
    """The tokens no draft holds: they would end the request inside it."""
    p = req.params
    return frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else req.eos_token_ids)


def draft_for(req: Request, budget: int, costs: DraftCosts | None, decode_rows: int) -> list[int]:
    """The tokens ``req`` proposes by prompt lookup this step (``draft_room`` of them at most)."""
    room = draft_room(req, budget, costs, decode_rows)
    if room <= 0:
        return []
    return propose(req.token_ids, room, req.params.max_matching_ngram_size, stop_ids(req))


@dataclass
class Verified:
    """A step's verifications: per drafting request, the tokens it takes before its sampled one."""

    accepted: dict[Request, list[int]] = field(default_factory=dict)
    logprobs: dict[Request, list] = field(default_factory=dict)  # theirs, where the row asks
    proposed: int = 0
    taken: int = 0
    # the draft model's rows alone: their taken tokens, and verifications that stopped short
    model_taken: int = 0
    model_stops: int = 0


def verify(rows: list[Request], tokens: list, logprobs: list, errors: dict) -> tuple:
    """Collapse each drafting request's k + 1 sampled rows (consecutive, in ``rows``) into one: its
    last kept choice, with the choices before it as accepted draft tokens; roll its computed
    tokens back to the accepted ones. Returns (rows, tokens, logprobs, errors, Verified)."""
    out_rows: list[Request] = []
    out_tokens: list = []
    out_lp: list = []
    out_errors: dict[int, str] = {}
    verified = Verified()
    i = 0
    while i < len(rows):
        req = rows[i]
        k = len(req.draft) if i + 1 < len(rows) and rows[i + 1] is req else 0
        # taken up to the first pick that is not the draft's (a failed pick, None, is not); only
        # the positions up to there count, as a step at a time would have reached no further
        m = next((j for j in range(k) if tokens[i + j] != req.draft[j]), k)
        chosen = tokens[i + m]
        if chosen is None:
            out_errors[len(out_rows)] = errors[i + m]
        elif k:
            verified.accepted[req] = tokens[i : i + m]
            if req.params.logprobs is not None:
                verified.logprobs[req] = logprobs[i : i + m]
        if k:
            req.num_computed_tokens -= k - m  # the rejected positions' KV is left behind
            req.draft_proposed += k
            req.draft_accepted += m
            req.draft_rejections += m < k
            verified.proposed += k
            verified.taken += m
            if req.params.num_assistant_tokens:
                verified.model_taken += m
                verified.model_stops += m < k
        out_rows.append(req)
        out_tokens.append(chosen)
        out_lp.append(logprobs[i + m])
        i += k + 1
    return out_rows, out_tokens, out_lp, out_errors, verified


def append_accepted(
    verified: Verified, sampled: dict[Request, int], now: float
) -> tuple[list[Request], list[Request]]:
    """Append each request's accepted draft tokens, before its sampled one, each through its stop
    strings. None ends it by EOS or length: a draft holds no EOS or stop id and leaves room for
    the sampled token (``draft_for``). A stop string one completes ends it there: the tokens
    after, and its sampled one, are dropped (the accepted lists keep what was appended). Returns
    (the requests a stop string ended, those whose stop-string check raised: they fail alone)."""
    stopped: list[Request] = []
    failed: list[Request] = []
    for req, tokens in verified.accepted.items():
        for j, tok in enumerate(tokens):
            if req.append_token(tok, now):
                raise AssertionError(f"request {req.request_id}: a draft token ended it")
            if req.stop_strings is None:
                continue
            try:
                hit = req.stop_strings.push(tok)
            except Exception as e:  # noqa: BLE001 - this request's detokenization alone
                req.error = (
                    f"request {req.request_id}: detokenizing its output for stop strings failed: "
                    f"{type(e).__name__}: {e}"
                )
                ends = failed
            else:
                if hit is None:
                    continue
                req.stop_reason, ends = hit, stopped
            del tokens[j + 1 :]
            del req.logprobs[req.num_output_tokens :]  # what its dropped tokens had
            sampled.pop(req, None)
            # it ends with these tokens: their KV is computed, no more (the prefix index reads it)
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
            ends.append(req)
            break
    return stopped, failed
