"""The core step: schedule -> execute -> sample -> update, and what a failure in it ends.

A request that fails on its own (its sampling, its logits, its stop-string check) ends alone
with ``finish_reason`` "error"; a step that fails as a whole ends exactly the requests it
touched; an interrupted step is undone. ``StepMixin`` is a part of ``EngineCore``
(paged_hf/engine/core.py); it drives the engine's ``scheduler``, ``runner`` and ``kv``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..execution.metadata import keep_hidden_states
from ..execution.sampler import sample
from ..execution.stateful_mixers import decodes_from_state
from ..requests.request import FinishReason, Request, sample_request_id
from .binding import check_still_patched
from .engine_stats import record_step
from .schedule_output import SchedulerOutput
from .scoring import score_step_rows
from .speculation import Verified, append_accepted, verify

if TYPE_CHECKING:
    from ..cache.block_manager import BlockManager
    from ..execution.runner import ModelRunner
    from ..requests.lock_step_call import CallStep, LockStepCall
    from .scheduler import Scheduler
    from .structured import StructuredOutputs

logger = logging.getLogger("paged_hf")


def _hand_rows_to_their_calls(
    rows: list[Request], logits: torch.Tensor
) -> tuple[list[Request], torch.Tensor, list[LockStepCall[Request]]]:
    """Rows whose generate call picks its rows' tokens (paged_hf/requests/lock_step_call.py) hand
    it their logits; the rest are sampled here."""
    keep, calls = [], {}
    for i, r in enumerate(rows):
        if r.call is not None and r.call.offer(r, logits[i]):
            calls[id(r.call)] = r.call
        else:
            keep.append(i)
    if not calls:
        return rows, logits, []
    return (
        [rows[i] for i in keep],
        logits[torch.tensor(keep, dtype=torch.long, device=logits.device)],
        list(calls.values()),
    )


def _failing(decided: CallStep[Request]) -> list[Request]:
    """The rows a generate call fails, each with its error set."""
    for req, why in decided.failed:
        req.error = f"request {req.request_id}: {why}"
    return [req for req, _ in decided.failed]


@dataclass
class _StepRows:
    """The rows a step samples, and what its scored rows gave."""

    rows: list[Request]
    logits: torch.Tensor
    scores: dict
    score_errors: dict
    calls: list[LockStepCall[Request]]  # generate calls that pick their rows' tokens themselves


def _decode_tokens(out: SchedulerOutput) -> int:
    """Tokens of the step that are decodes of running outputs (the step log's decode count)."""
    return sum(
        1
        for req, n in out.scheduled
        if n == 1 and req.num_output_tokens > 0 and req.num_pending_tokens == 1
    )


class StepMixin:
    """One step: schedule, execute, sample, update."""

    model: torch.nn.Module
    scheduler: Scheduler
    runner: ModelRunner
    kv_manager: BlockManager
    structured: StructuredOutputs | None
    state_layout: Any
    page_bytes: int
    _stats: Any  # EngineStats
    _patch_state: Any
    check_weights: Callable[[], None]
    wake_up: Callable[[], None]
    lock: Any  # TurnLock
    ranks: Any  # paged_hf/engine/ranks.py's Ranks under tensor parallelism, else None
    _deliver: Callable[[dict[Request, int], list[Request]], list[Request]]
    _verified: Verified  # this step's draft verifications (the tokens each drafting row takes)

    def step(self) -> tuple[dict[Request, int], list[Request]]:
        """One engine step; returns ({request: new token}, finished requests).

        A request that fails on its own (its sampling, its logits, its watch's ``on_token``) ends
        with ``finish_reason`` "error"; if the step fails as a whole (the forward raised), every
        request in it ends so, and the engine goes on serving. Interrupted (KeyboardInterrupt),
        the step is undone: its requests keep their tokens and recompute their KV when next
        scheduled. Any thread may step; one at a time (the engine's lock), and each caller's
        watch hears of its requests whoever stepped (paged_hf/engine/callers.py).
        """
        with self.lock:
            sampled, finished = self._step()
            return sampled, finished + self._deliver(sampled, finished)

    def _step(self) -> tuple[dict[Request, int], list[Request]]:
        self._before_step()
        start = self.scheduler.clock()
        out = self.scheduler.schedule()
        if out.is_empty:
            if self.scheduler.has_unfinished:
                raise RuntimeError(
                    "scheduler made no progress with requests pending (this is a bug)"
                )
            return {}, self.scheduler.take_shed()
        decode_tokens = _decode_tokens(out)  # before the step moves the requests on
        forked: list[Request] = []
        self._verified = Verified()
        try:
            logits, meta = self._execute(out)
            keep_hidden_states(meta)
            batch = self._rows_to_sample(logits, meta, forked)
            result = self._sample(batch)
            self._verify_drafts(batch, result)
        except Exception as e:  # noqa: BLE001 - ends the step's requests, not the engine
            return {}, self.scheduler.take_shed() + self._fail_step(out, forked, e)
        except BaseException:
            self._undo_step(out, forked)
            raise
        sampled, finished = self._update(out, batch, result, decode_tokens)
        seconds = self.scheduler.clock() - start - self.scheduler.draft_seconds
        self.scheduler.step_time.observe(decode_tokens, out.num_tokens - decode_tokens, seconds)
        # waiting requests the queue refused to make room for more urgent ones end here too
        return sampled, self.scheduler.take_shed() + finished

    def _before_step(self) -> None:
        check_still_patched(self.model, self._patch_state)
        self.check_weights()
        if self.runner.asleep:
            self.wake_up()

    def _execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, Any]:
        """Move the KV and states the schedule asks for, then run the forward: the logits of the
        sampled rows, then the scored ones."""
        # forked samples' states first: a sample preempted before its first step swaps out its copy
        self.runner.copy_states(out.state_copies)
        self._swap_out(out)
        for req, blocks in out.swap_in:
            self.runner.backend.swap_in(req.swap_handle, blocks)
            req.swap_handle = None
            if req.swapped_state is not None:
                self.runner.states.restore(req.state_slot, req.swapped_state)
                req.swapped_state = None
        tier = self.scheduler.kv_tiers
        for load in out.tier_loads:  # the records admissions' tier lookups found, read into pages
            self.scheduler.tier_loaded(load, tier.load(load.match, load.pages))
        self._decode_states_in_front(out.scheduled)
        run, copies = self.runner.execute, out.block_copies
        if self.ranks is None:
            logits, meta = run(out.scheduled, copies)
        else:  # tensor parallelism: the followers run this forward too (paged_hf/engine/ranks.py)
            forward = lambda: run(out.scheduled, copies)  # noqa: E731
            logits, meta = self.ranks.lead_step(out.scheduled, copies, forward)
        self.scheduler.mark_computed(out)
        if tier is not None:  # the prompt blocks this step completed, to the tiers (or watched)
            for req, _ in out.scheduled:
                tier.write(req)
        return logits, meta

    def _rows_to_sample(self, logits: torch.Tensor, meta: Any, forked: list[Request]) -> _StepRows:
        """The step's rows: scored rows' entries, then one row per sampled request, its first
        step's n - 1 forked samples sharing its logits; rows a generate call picks for itself
        go to their call."""
        n_sampled = len(meta.sampled_requests)
        scores, score_errors = (
            score_step_rows(logits[n_sampled:], meta.score_rows) if meta.score_rows else ({}, {})
        )
        logits = logits[:n_sampled]
        rows = list(meta.sampled_requests)
        row_of = list(range(len(rows)))
        for i, req in enumerate(meta.sampled_requests):
            if req.params.n > 1 and not req.forked and req.parent is None:
                children = [self._fork_child(req, k) for k in range(1, req.params.n)]
                self.scheduler.fork(req, children)
                forked.append(req)
                rows += children
                row_of += [i] * len(children)
        if len(rows) != n_sampled:
            logits = logits[torch.tensor(row_of, device=logits.device)]
        rows, logits, calls = _hand_rows_to_their_calls(rows, logits)
        return _StepRows(rows, logits, scores, score_errors, calls)

    def _sample(self, batch: _StepRows) -> Any:
        matchers = {i: r.grammar for i, r in enumerate(batch.rows) if r.grammar is not None}
        mask = (lambda lg, errs: self.structured.apply(lg, matchers, errs)) if matchers else None
        return sample(batch.logits, batch.rows, mask)

    def _verify_drafts(self, batch: _StepRows, result: Any) -> None:
        """Drafting rows' k + 1 sampled rows become one (paged_hf/engine/speculation.py)."""
        if len(set(map(id, batch.rows))) == len(batch.rows):
            return
        rows, tokens, lps, errors, self._verified = verify(
            batch.rows, result.tokens, result.logprobs, result.errors
        )
        if self.scheduler.drafter is not None:
            self.scheduler.drafter.learn(self._verified.model_taken, self._verified.model_stops)
        batch.rows = rows
        result.tokens, result.logprobs, result.errors = tokens, lps, errors

    def _undo_step(self, out: SchedulerOutput, forked: list[Request]) -> None:
        """An interrupted step: its requests keep their tokens and recompute what was lost."""
        for victim, _ in out.swap_out:  # preempted, KV not (all) saved: recompute it
            if victim.swap_handle is None:
                victim.swapped_tokens = 0
        for parent in forked:
            self.scheduler.unfork(parent)
        self.scheduler.requeue([req for req, _ in out.scheduled])

    def _update(
        self, out: SchedulerOutput, batch: _StepRows, result: Any, decode_tokens: int
    ) -> tuple[dict[Request, int], list[Request]]:
        """The step's tokens and failures applied: requests advance, stop, or end with an error."""
        sampled: dict[Request, int] = {}
        failed: list[Request] = []
        for req, entries in batch.scores.items():
            req.scored.extend(entries)
        for req, why in batch.score_errors.items():
            req.error = f"request {req.request_id}: {why}"
            failed.append(req)
        for i, (req, tok, lp) in enumerate(zip(batch.rows, result.tokens, result.logprobs)):
            if tok is None:
                req.error = f"request {req.request_id}: {result.errors[i]}"
                failed.append(req)
                continue
            sampled[req] = tok
            if lp is not None:  # a draft's taken tokens' first (paged_hf/engine/speculation.py)
                req.logprobs.extend(self._verified.logprobs.get(req, ()))
                req.logprobs.append(lp)
        failed += self._let_calls_choose(batch.calls, sampled)
        now = self.scheduler.clock()
        sched = self.scheduler
        stopped, bad = append_accepted(self._verified, sampled, now)  # drafts first
        failed += bad
        finished = sched.update(out, sampled, now)
        for req in stopped:  # a stop string a draft token completed
            sched.finish(req, FinishReason.STOP, now)
            finished.append(req)
        finished += self._finish_prefill_only(out, failed, now)
        failed += self._check_stop_strings(sampled, finished, now)
        failed += self._advance_grammars(sampled, finished, now)
        failed += self._advance_calls([*sampled, *finished, *failed], finished, now)
        for req in failed:
            if not req.is_finished:
                sched.finish(req, FinishReason.ERROR, now)
            else:  # its last token's stop-string check failed: the output says so
                req.finish_reason = FinishReason.ERROR
            logger.warning("paged_hf: %s", req.error)
        record_step(self, out, sampled, decode_tokens)
        return sampled, finished + [req for req in failed if req not in finished]

    def _let_calls_choose(
        self, calls: list[LockStepCall[Request]], sampled: dict[Request, int]
    ) -> list[Request]:
        """Calls whose every row has its logits for the step pick their tokens now (into
        ``sampled``); returns the rows that failed."""
        failed = []
        for call in calls:
            chosen = call.choose()
            if chosen.continues:  # beam search: a beam continues another's
                self.scheduler.reassign(chosen.continues)
            sampled.update(chosen.tokens)
            failed += _failing(chosen)
        return failed

    def _decode_states_in_front(self, scheduled: list[tuple[Request, int]]) -> None:
        """A hybrid's decode batch in slots 0..N-1, its states moved with it, so the mixers update
        them in place: a request moves about twice in its life, where a gather and a scatter of
        every decoding state would cost two copies per step."""
        slots = self.kv_manager.state
        if slots is None:
            return
        decoders = [
            req
            for req, n in scheduled
            if decodes_from_state(n, req.num_computed_tokens, req.pending_checkpoints)
        ]
        moves = slots.plan_front(decoders)
        if moves:
            self.runner.copy_states([(req.state_slot, slot) for req, slot in moves])
            slots.renumber(moves)

    def _finish_prefill_only(
        self, out: SchedulerOutput, failed: list[Request], now: float
    ) -> list[Request]:
        """Scoring requests whose last position was computed this step are done."""
        done = [
            req
            for req, _ in out.scheduled
            if req.prefill_only and req.num_computed_tokens == req.num_tokens and req not in failed
        ]
        for req in done:
            self.scheduler.finish(req, FinishReason.STOP, now)
        return done

    def _check_stop_strings(
        self, sampled: dict[Request, int], finished: list[Request], now: float
    ) -> list[Request]:
        """Feed each sampled token to its request's stop strings; a request whose token completed
        one stops there (even if the same token also ended it by length). Returns the requests
        whose check raised (a tokenizer failing on their ids): they fail alone."""
        failed = []
        for req, tok in sampled.items():
            stops = req.stop_strings
            if stops is None:
                continue
            try:
                hit = stops.push(tok)
            except Exception as e:  # noqa: BLE001 - this request's detokenization, no one else's
                req.error = (
                    f"request {req.request_id}: detokenizing its output for stop strings failed: "
                    f"{type(e).__name__}: {e}"
                )
                failed.append(req)
                continue
            if hit is None:
                continue
            req.stop_reason = hit
            if req.is_finished:
                req.finish_reason = FinishReason.STOP
            else:
                self.scheduler.finish(req, FinishReason.STOP, now)
                finished.append(req)
        return failed

    def _advance_grammars(
        self, sampled: dict[Request, int], finished: list[Request], now: float
    ) -> list[Request]:
        """Feed each constrained request's token to its grammar; one whose grammar is complete stops.
        Returns the requests whose grammar refused their token (they fail alone)."""
        failed = []
        for req, tok in sampled.items():
            grammar = req.grammar
            if grammar is None or req.finish_reason is FinishReason.ERROR:
                continue
            if not grammar.accept_token(tok):
                req.error = f"request {req.request_id}: token {tok} is not one its structured-output grammar allows"
                failed.append(req)
            elif grammar.is_terminated() and not req.is_finished:
                self.scheduler.finish(req, FinishReason.STOP, now)
                finished.append(req)
        return failed

    def _advance_calls(
        self, touched: list[Request], finished: list[Request], now: float
    ) -> list[Request]:
        """Run the stopping criteria of the generate calls whose rows all have this step's token;
        end the rows they stop. Returns the rows of calls whose callbacks raised (they fail together)."""
        failed = []
        for call in {id(r.call): r.call for r in touched if r.call is not None}.values():
            ended = call.advance()
            failed += _failing(ended)
            for req, reason in ended.stopped:
                req.stop_reason = reason
                self.scheduler.finish(req, FinishReason.STOP, now)
                finished.append(req)
        return failed

    def _swap_out(self, out: SchedulerOutput) -> None:
        """Copy preempted requests' KV to host memory before anything reuses their blocks. A copy
        that fails turns that request's preemption into a recompute one: same tokens, more work."""
        for req, blocks in out.swap_out:
            slot, req.swap_state_slot = req.swap_state_slot, None
            try:
                req.swap_handle = self.runner.backend.swap_out(blocks)
                if slot is not None:  # a hybrid's state goes with its KV
                    req.swapped_state = self.runner.states.save(slot)
            except Exception as e:  # noqa: BLE001
                req.swapped_tokens, req.swap_handle, req.swapped_state = 0, None, None
                logger.warning(
                    "paged_hf: request %s: swapping its KV out failed (%s: %s); it will recompute it",
                    req.request_id,
                    type(e).__name__,
                    e,
                )

    def _fail_step(
        self, out: SchedulerOutput, forked: list[Request], error: Exception
    ) -> list[Request]:
        """End every request the failed step touched with the error; free their blocks."""
        logger.error(
            "paged_hf: a step of %d request(s) failed; they end with finish_reason 'error'",
            len(out.scheduled),
            exc_info=error,
        )
        touched = [req for req, _ in out.scheduled] + [c for p in forked for c in p.children]
        now = self.scheduler.clock()
        for req in touched:
            req.error = f"request {req.request_id}: the step it ran in failed: {type(error).__name__}: {error}"
            self.scheduler.finish(req, FinishReason.ERROR, now)
        return touched

    def _fork_child(self, parent: Request, k: int) -> Request:
        child = Request(
            sample_request_id(parent.request_id, k),
            parent.prompt_ids,
            parent.params,
            parent.eos_token_ids,
            parent.max_model_len,
            arrival_time=parent.arrival_time,
            sample_index=k,
            parent=parent,
        )
        child.num_cached_tokens = parent.num_cached_tokens
        # sample k draws from the stream of the request's seed + k (a seed of its own, when drawn)
        child.seed = None if parent.seed is None else parent.seed + k
        child.stop_strings = (
            parent.stop_strings.fresh() if parent.stop_strings is not None else None
        )
        child.grammar = (
            self.structured.matcher(*parent.params.constraint)
            if parent.grammar is not None
            else None
        )
        child.encoder_token_ids = parent.encoder_token_ids
        child.prompt_embeds, child.embeds_key = parent.prompt_embeds, parent.embeds_key
        child.tpot_target_s = parent.tpot_target_s
        if parent.call is not None:
            parent.call.join_sample(parent, k, child)
        return child
