"""The blocking calls: ``generate``, ``score``, ``score_rolling``, ``run_until_done``.

Each submits its requests, steps the engine until they finish and returns their outputs in
input order; interrupted (any exception, ``KeyboardInterrupt`` included) it aborts what it
submitted before raising. ``BlockingCallsMixin`` is a part of ``EngineCore`` (paged_hf/engine/core.py); what it reads of the
engine it declares.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch

from ..requests.request import Request
from ..requests.sampling_params import SamplingParams
from .outputs import RequestOutput
from .ranks import over_ranks
from .scoring import ScoreOutput

if TYPE_CHECKING:
    from .scheduler import Scheduler
    from .turns import TurnLock

logger = logging.getLogger("paged_hf")


@dataclass
class BlockingCall:
    """One blocking call's requests, between ``follow`` and ``wait``."""

    roots: list[Request]
    watch: Any  # paged_hf/engine/callers.py's Watch
    unwatched: bool  # nobody watches its tokens: a throughput call (``throughput_call``)
    bar: Any = None


class BlockingCallsMixin:
    """The blocking calls: submit, step until done, return in input order."""

    scheduler: Scheduler
    requests: dict[str, Request]
    lock: TurnLock
    watch: Callable[..., Any]
    unwatch: Callable[[Any], None]
    _add: Callable[..., str]
    _new_id: Callable[[Any], str]
    _collect_root: Callable[[Request], RequestOutput]
    abort: Callable[[str], None]
    fail: Callable[..., None]
    check_weights: Callable[[], None]
    step: Callable[[], tuple[dict[Request, int], list[Request]]]

    @over_ranks("Engine.generate")
    def generate(
        self,
        prompts: Sequence[Any],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        on_token: Callable[[str, int], None] | None = None,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """Run prompts to completion with continuous batching; outputs come back in input order.

        A prompt that is refused (empty, too long, bad ids, bad params, cannot fit the pool) or
        fails while it runs gets an output with ``error`` set (``finish_reason`` "error"); every
        other prompt still runs. Interrupted (KeyboardInterrupt, or any exception), it aborts
        every prompt it submitted before raising.
        """
        if isinstance(prompts, (str, torch.Tensor)) or (prompts and isinstance(prompts[0], int)):
            raise TypeError("generate takes a list of prompts; wrap a single prompt in a list")
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        ids: list[str | None] = []
        errors: dict[int, RequestOutput] = {}
        try:
            with self.lock:  # the rows join the batch together, not one by one
                for i, (prompt, p) in enumerate(zip(prompts, params)):
                    rid = self._new_id(None)
                    try:
                        ids.append(self._add(rid, prompt, p))
                    except Exception as e:  # noqa: BLE001 - this prompt's problem alone (a tokenizer may raise anything)
                        message = (
                            str(e)
                            if isinstance(e, (ValueError, TypeError))
                            else f"request {rid}: {type(e).__name__}: {e}"
                        )
                        logger.warning("paged_hf: %s", message)
                        ids.append(None)
                        errors[i] = RequestOutput(rid, [], error=message)
                call = self.follow(
                    [rid for rid in ids if rid is not None], on_token=on_token, progress=progress
                )
        except BaseException:
            self.abort_all(rid for rid in ids if rid is not None)
            raise
        outputs = self.wait(call)
        it = iter(outputs)
        return [errors[i] if rid is None else next(it) for i, rid in enumerate(ids)]

    @over_ranks("Engine.score")
    def score(
        self,
        pairs: Sequence[tuple[Any, Any]],
        *,
        top_logprobs: int | None = None,
        cache_salt: str | None = None,
        progress: bool = False,
    ) -> list[ScoreOutput]:
        """The loglikelihood of each continuation given its context, in input order.

        ``pairs``: ``(context, continuation)`` as text (tokenized as lm-evaluation-harness does:
        ``scoring.encode_pair``) or as token ids. Each pair is a prefill-only request through the
        scheduler, batched with anything else running; pairs with the same context share its KV
        (prefix cache), and each continuation token still gets its logprob. A refused or failed
        pair gets a ``ScoreOutput`` with ``error`` set; the others run. ``top_logprobs=k`` adds the k
        most likely tokens of every scored position.

        >>> outs = engine.score([("Q: 2 + 2 =", " 4"), ("Q: 2 + 2 =", " 5")])
        >>> [round(o.logprob, 2) for o in outs], outs[0].is_greedy
        """
        from .scoring import score

        return score(self, pairs, top_logprobs, cache_salt, progress)

    @over_ranks("Engine.score_rolling")
    def score_rolling(
        self,
        texts: Sequence[Any],
        *,
        window: int | None = None,
        prefix_token: int | None = None,
        cache_salt: str | None = None,
        progress: bool = False,
    ) -> list[ScoreOutput]:
        """The loglikelihood of each whole text (perplexity tasks): every token scored once, in
        windows of at most ``window`` tokens (default ``max_model_len``), the first conditioned on
        ``prefix_token`` (default the tokenizer's BOS, else EOS), each later one on as much of the
        preceding text as fits (``scoring.rolling_windows``, lm-evaluation-harness's windows).
        Texts are tokenized without special tokens; token ids are taken as they are.

        >>> out = engine.score_rolling(["It was the best of times, it was the worst of times."], window=8)[0]
        >>> math.exp(-out.logprob / len(out.token_ids))   # perplexity
        """
        from .scoring import score_rolling

        return score_rolling(self, texts, window, prefix_token, cache_salt, progress)

    def run_until_done(
        self,
        request_ids: Sequence[str],
        *,
        on_token: Callable[[str, int], None] | None = None,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """Step until the given (already added) requests finish; their outputs in the given order.

        ``on_token(request_id, token)`` runs for every token sampled, in whichever thread runs
        that step (under the engine's lock); if it raises, that request ends with
        ``finish_reason`` "error" and the others go on. It may abort requests. On any exception
        from here (KeyboardInterrupt included) the given requests are aborted, their blocks
        freed, and the exception raised. Other threads may run their own calls meanwhile: all
        rows share the steps, and each call returns when its own rows are over.
        """
        return self.wait(self.follow(request_ids, on_token=on_token, progress=progress))

    def follow(
        self,
        request_ids: Sequence[str],
        *,
        on_token: Callable[[str, int], None] | None = None,
        progress: bool = False,
    ) -> BlockingCall:
        """``run_until_done``'s first half: from now on the requests' tokens go to ``on_token``
        and their ends are noted, whichever thread steps. Call it in the same hold of the engine's
        lock as the submission when ``on_token`` must see every token; then ``wait``."""
        with self.lock:
            roots = [self._root(rid) for rid in request_ids]
            self.check_weights(rescan=True)
            bar = _progress(len(roots)) if progress else None
            watch = self.watch(roots, on_token, None if bar is None else lambda _r: bar.update(1))
            if bar is not None:
                bar.update(len(roots) - len(watch.open))
            return BlockingCall(roots, watch, on_token is None, bar)

    @contextlib.contextmanager
    def throughput_call(self) -> Iterator[None]:
        """A throughput call: the scheduler's policy for a blocking call where nobody watches tokens arrive and
        only the whole call's time counts: with ``max_prefill_tokens_while_decoding="auto"``, prompt
        chunks are not capped while others decode (1.2x on W-mixed; a decode may wait for a whole
        step budget of prefill), and on a CPU, where ``max_num_batched_tokens`` was not set, a step
        takes up to ``DEFAULT_CPU_THROUGHPUT_CALL_TOKENS`` (2048) tokens. ``generate``, ``score`` and ``score_rolling`` (and so
        ``generate_dataset``, the lm-eval backend, a patched ``generate`` without a streamer) run in
        it; a background engine, ``on_token`` callbacks and stepping by hand keep the cap. With
        calls in several threads, it holds while any throughput call runs."""
        with self.lock:
            self.scheduler.throughput_calls += 1
        try:
            yield
        finally:
            with self.lock:
                self.scheduler.throughput_calls -= 1

    def wait(self, call: BlockingCall) -> list[RequestOutput]:
        """``run_until_done``'s second half: step until the call's requests are over (a throughput
        call where nobody watches its tokens)."""
        roots, watch = call.roots, call.watch
        with self.throughput_call() if call.unwatched else contextlib.nullcontext():
            try:
                while True:
                    # one step a turn: between two, the lock passes to a thread waiting to submit
                    # or to step for its own call (the engine's lock is first come, first served)
                    with self.lock:
                        if not watch.open:
                            return [self._collect_root(root) for root in roots]
                        if not self.scheduler.has_unfinished:
                            raise RuntimeError(
                                "engine went idle with requests unfinished (this is a bug)"
                            )
                        self.step()
            except BaseException:
                with self.lock:
                    self.unwatch(watch)
                    self.abort_all(
                        r.request_id for r in roots if self.requests.get(r.request_id) is r
                    )
                raise
            finally:
                if call.bar is not None:
                    call.bar.close()

    def _root(self, request_id: str) -> Request:
        root = self.requests.get(request_id)
        if root is None:
            raise ValueError(f"request {request_id}: unknown or already collected")
        return root

    def abort_all(self, request_ids: Any) -> None:
        """Abort those of ``request_ids`` still live (unknown or finished ones are skipped)."""
        with self.lock:
            for rid in list(request_ids):
                if rid in self.requests:
                    self.abort(rid)


def _progress(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="paged_hf", unit="req")
