"""Scoring through the engine: the loglikelihood of continuations, rolling loglikelihood of
whole texts, and prompt logprobs.

Design notes: docs/internals.md, paged_hf/engine/scoring.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..requests.request import Request
from ..requests.sampling_params import SamplingParams
from .binding import check_still_patched

# The functions below take the engine (paged_hf.engine.core.EngineCore) as ``engine``; it is not imported
# here, even for type checking, since core.py imports this module.


@dataclass
class ScoreOutput:
    """One scored continuation (or, from ``score_rolling``, one whole text)."""

    request_id: str
    logprob: float  # sum of token_logprobs (natural log, float32 logits)
    is_greedy: bool  # every token is the argmax given what precedes it
    token_ids: list[int]  # the continuation's tokens
    token_logprobs: list[float]  # one per token
    # with top_logprobs=k: the k best per position
    top_logprobs: list[dict[int, float]] | None = None
    num_cached_tokens: int = 0  # context tokens the prefix cache served
    error: str | None = None  # refused or failed: the others still ran

    @property
    def finish_reason(self) -> str:
        return "error" if self.error is not None else "stop"


# ---- inside a step ----------------------------------------------------------------------------


def score_step_rows(
    logits: torch.Tensor, score_rows: list[tuple[Request, int, int]]
) -> tuple[dict[Request, list], dict[Request, str]]:
    """Logprobs of this step's scored rows: logits [R, V] in ``score_rows`` order (see
    ``StepMetadata.score_rows``) -> ({request: [(logprob, is greedy, top-k or None), ...]},
    {request: why it failed}). One request's failure (its logits not finite, say) is its own."""
    results: dict[Request, list] = {}
    errors: dict[Request, str] = {}
    row = 0
    for req, first, count in score_rows:
        part = logits[row : row + count]
        row += count
        try:
            results[req] = _score_rows(
                part, req.score_targets[first : first + count], req.params.prompt_logprobs
            )
        except Exception as e:  # noqa: BLE001 - whatever it was, it is this request's alone
            errors[req] = f"scoring failed: {type(e).__name__}: {e}"
    return results, errors


def _score_rows(logits: torch.Tensor, targets: list[int], top_k: int | None) -> list:
    # float32 at least: bf16/fp16 logits are widened, float64 ones kept
    lp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    target = torch.tensor(targets, device=lp.device)
    chosen = lp.gather(1, target[:, None])[:, 0]
    greedy = lp.argmax(dim=-1) == target
    values = chosen.tolist()
    if not all(math.isfinite(v) for v in values):
        raise ValueError("its logits are not finite (NaN or inf)")
    tops: list[dict[int, float] | None] = [None] * len(values)
    if top_k:
        top = torch.topk(lp, top_k, dim=-1)
        tops = [dict(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]
    elif top_k == 0:
        tops = [{} for _ in values]
    return list(zip(values, greedy.tolist(), tops))


# ---- admission --------------------------------------------------------------------------------


def add_score_request(
    engine: Any,
    rid: str,
    context: Any,
    continuation: Any | None = None,
    top_logprobs: int | None = None,
    cache_salt: str | None = None,
) -> str:
    """Queue one scoring request; ``context``/``continuation`` are token ids or text (see
    ``encode_pair``). Bad input raises ValueError naming the request, the value and the limit."""
    check_still_patched(engine.model, engine._patch_state)
    params = SamplingParams(max_new_tokens=1, prompt_logprobs=top_logprobs, cache_salt=cache_salt)
    params.validate(f"request {rid}")
    ctx, cont = _pair_ids(engine, rid, context, continuation)
    for what, ids in (("context", ctx), ("continuation", cont)):
        engine._check_token_ids(rid, ids, what)
    if not ctx:
        raise ValueError(
            f"request {rid}: empty context: the first continuation token needs a token before it "
            "(give a BOS token, or text, which gets the tokenizer's BOS/EOS)"
        )
    if not cont:
        raise ValueError(f"request {rid}: empty continuation: nothing to score")
    n = len(ctx) + len(cont) - 1  # the last continuation token is predicted, never input
    if n > engine.max_model_len:
        raise ValueError(
            f"request {rid}: context ({len(ctx)}) + continuation ({len(cont)}) - 1 = {n} tokens, "
            f"max_model_len is {engine.max_model_len}"
        )
    req = Request(
        rid,
        ctx + cont[:-1],
        params,
        frozenset(),
        engine.max_model_len,
        arrival_time=engine.scheduler.clock(),
    )
    req.prefill_only = True
    req.score_targets = list(cont)
    req.score_start = len(ctx) - 1
    return engine._queue(req)


def _pair_ids(
    engine: Any, rid: str, context: Any, continuation: Any
) -> tuple[list[int], list[int]]:
    if continuation is None:
        raise ValueError(f"request {rid}: a scoring request is a (context, continuation) pair")
    texts = [isinstance(x, str) for x in (context, continuation)]
    if all(texts):
        if engine.tokenizer is None:
            raise ValueError(f"request {rid}: text needs a tokenizer (Engine(model, tokenizer))")
        return encode_pair(engine.tokenizer, context, continuation)
    if any(texts):
        raise ValueError(
            f"request {rid}: context and continuation must both be text or both token ids"
        )
    ids = []
    for x in (context, continuation):
        if isinstance(x, torch.Tensor):
            x = x.flatten().tolist()
        if not isinstance(x, (list, tuple)):
            raise ValueError(
                f"request {rid}: context and continuation are text or lists of token ids, "
                f"got {type(x).__name__}"
            )
        ids.append(list(x))
    return ids[0], ids[1]


def prefix_token_id(tokenizer: Any) -> int:
    """The token an empty context stands for: BOS, else EOS (lm-evaluation-harness's choice)."""
    for tid in (getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if tid is not None:
            return int(tid)
    raise ValueError(
        "the tokenizer has neither a BOS nor an EOS token to stand for an empty context; "
        "pass token ids"
    )


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Token ids of a (context, continuation) text pair, the way lm-evaluation-harness makes them:
    trailing whitespace of the context moves to the continuation, the whole text is tokenized
    and the continuation is what follows the context's own tokens (so a word is tokenized as it
    would be in running text). An empty context is the BOS (else EOS) token.

    >>> encode_pair(tok, "The capital of France is ", "Paris")   # the space goes with "Paris"
    """
    if not context:
        cont = list(tokenizer(continuation, add_special_tokens=False)["input_ids"])
        prefix = prefix_token_id(tokenizer)
        return ([prefix], cont) if not cont or cont[0] != prefix else (cont[:1], cont[1:])
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = list(tokenizer(context + continuation)["input_ids"])
    ctx = list(tokenizer(context)["input_ids"])
    return ctx, whole[len(ctx) :]


def rolling_windows(
    token_ids: Sequence[int], window: int, prefix_token: int
) -> list[tuple[list[int], list[int]]]:
    """(context, continuation) pairs that score every token of ``token_ids`` exactly once, each
    pair at most ``window`` tokens of input: the first window is conditioned on ``prefix_token``,
    each later one on as many of the preceding tokens as fit (so the last, shorter window still
    has a full window of context). These are lm-evaluation-harness's disjoint rolling windows.

    >>> rolling_windows([10, 11, 12, 13, 14, 15], window=4, prefix_token=0)
    [([0], [10, 11, 12, 13]), ([11, 12, 13], [14, 15])]
    """
    if window < 1:
        raise ValueError(f"window={window}: must be >= 1")
    tokens = list(token_ids)
    if not tokens:
        return []
    first = min(window, len(tokens))
    pairs = [([prefix_token], tokens[:first])]
    done = first
    while done < len(tokens):
        end = min(len(tokens), done + window)
        pairs.append((tokens[end - window - 1 : done], tokens[done:end]))
        done = end
    return pairs


# ---- outputs ----------------------------------------------------------------------------------


def score_output(req: Request) -> ScoreOutput:
    """The ``ScoreOutput`` of a finished (or aborted, or failed) scoring request."""
    entries = req.scored
    error = req.error
    if error is None and req.finish_reason is not None and req.finish_reason.value == "abort":
        error = f"request {req.request_id}: aborted"
    if error is None and len(entries) != len(req.score_targets):
        error = f"request {req.request_id}: ended with {len(entries)} of {len(req.score_targets)} tokens scored"
    logprobs = [e[0] for e in entries]
    tops = [e[2] for e in entries] if req.params.prompt_logprobs is not None else None
    return ScoreOutput(
        req.request_id,
        math.fsum(logprobs),
        all(e[1] for e in entries),
        list(req.score_targets),
        logprobs,
        tops,
        req.num_cached_tokens,
        error,
    )


def prompt_logprobs_output(req: Request) -> list | None:
    """``RequestOutput.prompt_logprobs`` of a generation request: None for the first prompt token,
    then (logprob, {token: logprob} top-k) per token."""
    if req.params.prompt_logprobs is None:
        return None
    return [None] + [(lp, top) for lp, _greedy, top in req.scored]


def merge_windows(rid: str, parts: list[ScoreOutput]) -> ScoreOutput:
    """One text's ScoreOutput from those of its rolling windows."""
    error = next((p.error for p in parts if p.error is not None), None)
    tops = (
        None
        if any(p.top_logprobs is None for p in parts)
        else [t for p in parts for t in p.top_logprobs]
    )
    logprobs = [lp for p in parts for lp in p.token_logprobs]
    return ScoreOutput(
        rid,
        math.fsum(logprobs),
        all(p.is_greedy for p in parts),
        [t for p in parts for t in p.token_ids],
        logprobs,
        tops,
        sum(p.num_cached_tokens for p in parts),
        error,
    )


# ---- front ends -------------------------------------------------------------------------------


def score(
    engine: Any,
    pairs: Sequence[tuple[Any, Any]],
    top_logprobs: int | None = None,
    cache_salt: str | None = None,
    progress: bool = False,
) -> list[ScoreOutput]:
    """See ``Engine.score``."""
    if (
        isinstance(pairs, (str, tuple))
        and len(pairs) == 2
        and not isinstance(pairs[0], (tuple, list))
    ):
        raise TypeError(
            "score takes a list of (context, continuation) pairs; wrap a single pair in a list"
        )
    ids: list[str | None] = []
    errors: dict[int, ScoreOutput] = {}
    try:
        with engine.lock:  # the pairs join the batch together
            for i, pair in enumerate(pairs):
                rid = engine._new_id(None)
                try:
                    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                        raise ValueError(
                            f"request {rid}: expected a (context, continuation) pair, got {pair!r:.80}"
                        )
                    ids.append(
                        add_score_request(engine, rid, pair[0], pair[1], top_logprobs, cache_salt)
                    )
                except Exception as e:  # noqa: BLE001 - this pair's problem alone (a tokenizer may raise anything)
                    message = (
                        str(e)
                        if isinstance(e, (ValueError, TypeError))
                        else f"request {rid}: {type(e).__name__}: {e}"
                    )
                    ids.append(None)
                    errors[i] = ScoreOutput(rid, float("nan"), False, [], [], None, 0, message)
    except BaseException:
        engine.abort_all(rid for rid in ids if rid is not None)
        raise
    outputs = iter(
        engine.run_until_done([rid for rid in ids if rid is not None], progress=progress)
    )
    return [errors[i] if rid is None else next(outputs) for i, rid in enumerate(ids)]


def score_rolling(
    engine: Any,
    texts: Sequence[Any],
    window: int | None = None,
    prefix_token: int | None = None,
    cache_salt: str | None = None,
    progress: bool = False,
) -> list[ScoreOutput]:
    """See ``Engine.score_rolling``."""
    if isinstance(texts, str):
        raise TypeError("score_rolling takes a list of texts; wrap a single text in a list")
    window = engine.max_model_len if window is None else window
    if (
        not isinstance(window, int)
        or isinstance(window, bool)
        or not 1 <= window <= engine.max_model_len
    ):
        raise ValueError(
            f"window={window!r}: must be an integer in [1, max_model_len={engine.max_model_len}]"
        )
    if prefix_token is None:
        if engine.tokenizer is None:
            raise ValueError(
                "score_rolling without a tokenizer needs prefix_token (the token the first one is "
                "conditioned on, usually BOS)"
            )
        prefix_token = prefix_token_id(engine.tokenizer)
    pairs: list[tuple[list[int], list[int]]] = []
    spans: list[tuple[int, int] | str] = []
    for text in texts:
        try:
            if isinstance(text, str):
                if engine.tokenizer is None:
                    raise ValueError("text needs a tokenizer (Engine(model, tokenizer))")
                ids = list(engine.tokenizer(text, add_special_tokens=False)["input_ids"])
            elif isinstance(text, (list, tuple, torch.Tensor)):
                ids = text.flatten().tolist() if isinstance(text, torch.Tensor) else list(text)
            else:
                raise ValueError(
                    f"a text is a str or a list of token ids, got {type(text).__name__}"
                )
            if not ids:
                raise ValueError("empty text: nothing to score")
        except Exception as e:  # noqa: BLE001 - this text's problem alone
            spans.append(f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e))
            continue
        windows = rolling_windows(ids, window, prefix_token)
        spans.append((len(pairs), len(pairs) + len(windows)))
        pairs.extend(windows)
    scored = score(engine, pairs, cache_salt=cache_salt, progress=progress)
    results = []
    for k, span in enumerate(spans):
        if isinstance(span, str):
            results.append(
                ScoreOutput(f"text {k}", float("nan"), False, [], [], None, 0, f"text {k}: {span}")
            )
        else:
            results.append(merge_windows(scored[span[0]].request_id, scored[span[0] : span[1]]))
    return results
