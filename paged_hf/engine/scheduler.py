"""Who runs this step, and how many tokens each: decode first, then prefill chunks, within a
token budget (optionally a smaller one for prefill while decodes run), a sequence cap and the
free KV blocks; preempt (recompute or swap) when blocks run out.

Every request is the same thing to the scheduler: tokens whose KV is not computed yet. A
decode has one such token; a prompt has many and may take several steps (chunked prefill).
"""

from __future__ import annotations

import enum
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from ..cache.block_manager import BlockManager
from ..requests.request import Request, RequestStatus
from .draft_scheduling import DraftSchedulingMixin
from .schedule_output import Budget, SchedulerOutput, TierLoad
from .scheduler_queues import QueuesMixin
from .scheduling_policy import Fcfs
from .sibling_prefill import blocks_in_flight, waits_for_sibling_prefill
from .speculation import draft_costs
from .step_time import StepTimeModel

if TYPE_CHECKING:
    from .kv_tiers import KVTiers


class Admission(enum.Enum):
    """What became of a waiting request the loop tried to admit."""

    ADMITTED = "admitted"
    SIBLING = "sibling"  # the next block of its prompt is computed this step by another request
    NO_BLOCKS = "no blocks"
    NO_SEATS = "no seats"  # max_num_seqs


class Scheduler(QueuesMixin, DraftSchedulingMixin):
    def __init__(
        self,
        kv_manager: BlockManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        preemption_mode: str = "recompute",
        max_prefill_tokens_while_decoding: int | None = None,
        continues_chunks: bool = True,
        max_waiting: int | None = None,
        policy: Fcfs | None = None,
        throughput_call_budget: int | None = None,
        lift_cap_in_throughput_calls: bool = False,
        kv_tiers: KVTiers | None = None,
    ) -> None:
        """``continues_chunks=False``: the model's stateful layers cannot carry their state into a
        chunk of several tokens (Mamba1-style mixers), so after a request's first chunk its prompt
        goes on one token at a time. ``policy``: who goes first (paged_hf/engine/scheduling_policy.py;
        fcfs by default). ``throughput_call_budget``: the step budget inside a blocking call nobody
        watches (``EngineCore.throughput_call``), where set; ``lift_cap_in_throughput_calls``: no
        prefill cap meanwhile (the cap was "auto"). ``kv_tiers``: the tiers under the prefix cache
        (paged_hf/engine/kv_tiers.py), asked at admission."""
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError(
                f"max_num_batched_tokens={max_num_batched_tokens} and max_num_seqs={max_num_seqs} "
                "must both be >= 1"
            )
        if max_num_seqs > max_num_batched_tokens:
            # every running decode needs one token of budget per step, or decodes could starve
            raise ValueError(
                f"max_num_seqs={max_num_seqs} exceeds max_num_batched_tokens={max_num_batched_tokens}"
            )
        self.kv_manager = kv_manager
        self.preemption_mode = preemption_mode
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        # prefill tokens a step may carry next to running decodes (None: whatever budget they leave);
        # a long prompt's chunks then cost each decode a little latency per step, not a long stall
        self.max_prefill_tokens_while_decoding = max_prefill_tokens_while_decoding
        self.policy = policy or Fcfs()
        self.throughput_calls = 0  # throughput calls running (``EngineCore.throughput_call``)
        self.lift_cap_in_throughput_calls = lift_cap_in_throughput_calls
        self.throughput_call_budget = throughput_call_budget
        self.continues_chunks = continues_chunks
        # a hybrid's state cannot take back rejected draft tokens: its rows do not speculate
        self.speculates = kv_manager.state is None
        self._decode_rows, self._draft_costs = 0, None  # this step's (set as it schedules)
        self.drafter = None  # the draft model's proposer (paged_hf/engine/draft_model.py), if any
        self._proposals: dict[Request, list[int]] = {}  # this step's, from the draft model
        self.draft_seconds = 0.0  # this step's time in the draft model
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order; the tail is preempted first
        self.num_preemptions = 0
        self.prefix_hit_tokens = 0
        self.max_waiting = max_waiting
        self.shed: list[Request] = []  # waiting requests refused to make room, until the next step
        self.clock = time.perf_counter  # the engine's clock (a fake one in tests)
        self.step_time = StepTimeModel()  # fed by the engine after each step
        self.kv_tiers = kv_tiers  # the tiers under the prefix cache, if any

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """This step's requests and token counts: running ones first (decodes, then the
        unfinished prefills the policy does not hold back, preempting when blocks run out), then
        waiting ones in the policy's order while they fit, then the prefills the policy
        defers in what is left."""
        out = SchedulerOutput(scheduled=[])
        self.draft_seconds = 0.0
        chosen: dict[Request, int] = {}
        budget = Budget(
            self.throughput_call_budget
            if self.throughput_calls and self.throughput_call_budget
            else self.max_num_batched_tokens
        )
        now = self.clock()
        deferred = self._schedule_running(out, chosen, budget, now)
        self._schedule_waiting(out, chosen, budget, now)
        # deferred prefills take what is left; they preempt nobody (the step's plan is set)
        self._run_rows(deferred, out, chosen, budget, now, may_preempt=False)
        out.scheduled = list(chosen.items())
        if self.kv_manager.checkpoints:
            for req, n in out.scheduled:
                self.kv_manager.plan_checkpoints(
                    req, n, whole_chunks_only=not self.continues_chunks
                )
        out.state_copies = self.kv_manager.take_state_copies()
        return out

    def _schedule_running(
        self, out: SchedulerOutput, chosen: dict[Request, int], budget: Budget, now: float
    ) -> list[Request]:
        """Decodes, then the running prefills at least as urgent as the most urgent waiting
        request, most urgent first; the others (returned) wait for what the waiting requests
        leave, so a long batch prompt does not take an urgent one's prefill room."""
        urgency = self.policy.urgency
        best = self.policy.most_urgent_waiting(
            (r for r in self.waiting if not _waits_for_call(r)), now
        )
        decodes = [r for r in self.running if r.num_pending_tokens == 1]
        # what a drafted token costs this step against what a taken one saves
        self._decode_rows = len(decodes)
        self._draft_costs = draft_costs(self.step_time.coef, len(decodes))
        if self.drafter is not None:
            self._proposals = self._propose_drafts(decodes, budget)
        prefills = sorted(
            (r for r in self.running if r.num_pending_tokens > 1), key=lambda r: urgency(r, now)
        )
        first = len(prefills)
        if best is not None:  # prefills sorted by urgency: the deferred ones are a tail
            first = next((i for i, r in enumerate(prefills) if urgency(r, now) > best), first)
        self._run_rows(decodes + prefills[:first], out, chosen, budget, now)
        return prefills[first:]

    def _run_rows(
        self,
        rows: list[Request],
        out: SchedulerOutput,
        chosen: dict[Request, int],
        budget: Budget,
        now: float,
        may_preempt: bool = True,
    ) -> None:
        """Schedule running ``rows`` in order; where blocks run out, preempt (``may_preempt``) or
        leave the row for a later step."""
        for req in rows:
            if (
                req.status is not RequestStatus.RUNNING
                or budget.tokens == 0
                or _waits_for_call(req)
            ):
                continue
            prefill = req.num_pending_tokens > 1
            if not prefill and self._schedule_draft(req, out, chosen, budget):
                continue
            if prefill and budget.prefill_room is None:
                budget.prefill_room = self._prefill_room(budget.tokens, chosen)
            n = min(req.num_pending_tokens, budget.prefill_room if prefill else budget.tokens)
            if not self.continues_chunks and req.num_computed_tokens:
                n = min(n, 1)
            elif prefill:
                n = self._no_lone_token(req, n)
            if n == 0:
                continue
            while not self.kv_manager.allocate_slots(req, n, out.block_copies):
                if not may_preempt:
                    n = 0
                    break
                victim = self._victim(now)
                self._preempt_scheduled(victim, out, chosen, budget)
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING and n:
                chosen[req] = n
                budget.tokens -= n
                if prefill:
                    budget.prefill_room -= n

    def _schedule_waiting(
        self, out: SchedulerOutput, chosen: dict[Request, int], budget: Budget, now: float
    ) -> None:
        """Waiting requests in the policy's order while the budget lasts. One that does not fit is
        passed over (at most ``lookahead`` a step; then the queue stops). Requests preempted this
        step wait; only more urgent ones may take their room (under fcfs: none)."""
        pending = blocks_in_flight(self.kv_manager, chosen)
        if budget.prefill_room is None:
            budget.prefill_room = self._prefill_room(budget.tokens, chosen)
        urgency = self.policy.urgency
        preempted = set(out.preempted)
        floor = min((urgency(r, now) for r in preempted), default=None)
        front = [r for r in self.waiting if r in preempted] if preempted else []
        rest = deque(r for r in self.waiting if r not in preempted) if preempted else self.waiting
        queue = self.policy.admission_order(rest, now)
        # victims displaced below queue here, first, and are not reconsidered this step
        self.waiting = deque()
        kept: list[Request] = []
        admitted: set[Request] = set()
        passed_over = 0
        while queue and min(budget.tokens, budget.prefill_room) > 0:
            req = queue[0]
            if passed_over > self.policy.lookahead:
                break
            if floor is not None and urgency(req, now) >= floor:  # so is everyone after it
                break
            queue.popleft()
            if _waits_for_call(
                req
            ):  # its call's other rows first: it does not block the queue meanwhile
                kept.append(req)
                continue
            verdict = self._admit(req, out, chosen, budget, pending, admitted, now)
            if verdict is Admission.ADMITTED:
                admitted.add(req)
                continue
            kept.append(req)
            if verdict is not Admission.SIBLING:
                passed_over += 1
        victims, self.waiting = self.waiting, queue
        self.waiting.extendleft(reversed(kept))
        self.waiting.extendleft(reversed(front))
        self.waiting.extendleft(reversed(victims))

    def _admit(
        self,
        req: Request,
        out: SchedulerOutput,
        chosen: dict[Request, int],
        budget: Budget,
        pending: set,
        admitted: set[Request],
        now: float,
    ) -> Admission:
        """Admit ``req``, displacing less urgent running requests (where the policy displaces)
        while the sequence cap or the blocks stand in its way."""
        while self.num_running_seqs() + req.seqs_when_running > self.max_num_seqs:
            if not self._displace(req, out, chosen, budget, admitted, now):
                return Admission.NO_SEATS
        while True:
            verdict = self._try_admit(req, out, chosen, budget, pending)
            if verdict is not Admission.NO_BLOCKS:
                return verdict
            if not self._displace(req, out, chosen, budget, admitted, now):
                # rows that wait on it hold the blocks it needs
                if not chosen and self._preempt_a_waiting_row(out):
                    continue
                return verdict

    def _displace(
        self,
        req: Request,
        out: SchedulerOutput,
        chosen: dict[Request, int],
        budget: Budget,
        admitted: set[Request],
        now: float,
    ) -> bool:
        """Preempt the running request the policy gives up first among those strictly less urgent
        than ``req`` (never one admitted this step: its swap-in or first chunk is already
        planned). False where the policy does not displace, or none is less urgent."""
        if not self.policy.displaces:
            return False
        urgency = self.policy.urgency(req, now)
        victims = [
            r for r in self.running if self.policy.urgency(r, now) > urgency and r not in admitted
        ]
        if not victims:
            return False
        self._preempt_scheduled(self.policy.first_to_give_up(victims, now), out, chosen, budget)
        return True

    def _try_admit(
        self,
        req: Request,
        out: SchedulerOutput,
        chosen: dict[Request, int],
        budget: Budget,
        pending: set,
    ) -> Admission:
        """Admit waiting ``req`` with this step's first chunk: ADMITTED, SIBLING (the next block
        of its prompt is computed this step by another request: it waits a step and takes it from
        the prefix cache instead of computing it twice) or NO_BLOCKS. Leaves ``waiting`` as it is."""
        swapped, match = req.swapped_tokens, None
        if swapped:  # its KV comes back from host memory into fresh blocks
            req.num_computed_tokens, cached = swapped, 0
        else:
            cached = self.kv_manager.admit(req)
            match = self._match_tier(req)
        if not swapped and waits_for_sibling_prefill(self.kv_manager, req, pending):
            self.kv_manager.free(req)
            return Admission.SIBLING
        n = min(req.num_pending_tokens, budget.tokens, budget.prefill_room)
        if not self.continues_chunks and req.num_computed_tokens:  # swapped in: it has a state
            n = min(n, 1)
        else:
            n = self._no_lone_token(req, n)
        if not self.kv_manager.allocate_slots(req, n, out.block_copies):
            self.kv_manager.free(req)
            return Admission.NO_BLOCKS
        if swapped:
            out.swap_in.append((req, self.kv_manager.live_pages(req, swapped)))
            req.swapped_tokens = 0
        if match:
            end = req.num_computed_tokens // self.kv_manager.block_size
            pages = req.block_tables[0][end - len(match) : end]
            out.tier_loads.append(TierLoad(req, match, pages, not req.admitted_once))
            req.tier_state.last_match = None  # kept for this admission, which took it
        if not req.admitted_once:
            req.num_cached_tokens = (
                cached + (len(match) if match else 0) * self.kv_manager.block_size
            )
            req.admitted_once = True
            req.first_scheduled_time = self.clock()
        self.prefix_hit_tokens += cached
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        chosen[req] = n
        budget.tokens -= n
        budget.prefill_room -= n
        pending |= blocks_in_flight(self.kv_manager, {req: n})
        return Admission.ADMITTED

    def _match_tier(self, req: Request) -> Any:
        """Where the prefix cache's hit ends, the tiers' records may go on (prompt blocks): what
        their lookup found (paged_hf/engine/kv_tiers.py's TierMatch; nothing read: the step loads
        it), its blocks counted computed; or None."""
        if self.kv_tiers is None:
            return None
        bs = self.kv_manager.block_size
        match = self.kv_tiers.lookup(
            req, req.num_computed_tokens // bs, self.kv_manager.hit_limit(req) // bs
        )
        if match is not None:
            req.num_computed_tokens += len(match) * bs
        return match

    def tier_loaded(self, load: TierLoad, blocks: int) -> None:
        """The step loaded ``blocks`` of ``load``'s match. Where a record turned out bad or gone
        since the lookup, the rest are computed instead: the request's chunk this step starts where
        the loaded blocks end (their pages are its already), and they are not counted cached."""
        missing = (len(load.match) - blocks) * self.kv_manager.block_size
        if missing:
            load.req.num_computed_tokens -= missing
            if load.first_admission:
                load.req.num_cached_tokens -= missing

    def _no_lone_token(self, req: Request, n: int) -> int:
        """A hybrid's prompt chunk leaves two tokens or none behind: a lone last token would go through
        the mixers' one-token (decode) path, not the chunk path ``generate`` runs a prompt through, and
        some mixers' two paths part (Zamba2's Mamba2 clamps its time step in its chunk scan only)."""
        if self.kv_manager.state is not None and n > 1 and req.num_pending_tokens - n == 1:
            return n - 1
        return n

    def _prefill_room(self, budget: int, chosen: dict[Request, int]) -> int:
        """Prefill tokens this step may carry beside the decodes in ``chosen``."""
        if not chosen:
            return budget
        cap = (
            None
            if self.throughput_calls and self.lift_cap_in_throughput_calls
            else self.max_prefill_tokens_while_decoding
        )
        room = budget if cap is None else min(budget, cap)
        targets = [r.tpot_target_s for r, n in chosen.items() if n == 1 and r.tpot_target_s]
        if targets:  # requests with a TPOT target decode: keep the step within the tightest
            decodes = sum(1 for n in chosen.values() if n == 1)
            within = self.step_time.prefill_within(
                min(targets), decodes, floor=self.kv_manager.block_size
            )
            if within is not None:
                room = min(room, within)
        return room

    def _victim(self, now: float) -> Request:
        """Who is preempted for blocks: a row waiting for its generate call's others (it is idle),
        else the one the policy gives up first."""
        waiting_rows = (
            [r for r in self.running if _waits_for_call(r)]
            if any(r.call is not None for r in self.running)
            else ()
        )
        return waiting_rows[-1] if waiting_rows else self.policy.first_to_give_up(self.running, now)

    def _preempt_scheduled(
        self, victim: Request, out: SchedulerOutput, chosen: dict[Request, int], budget: Budget
    ) -> None:
        """Preempt ``victim`` while this step is planned: its tokens go back to the budget."""
        budget.tokens += chosen.pop(victim, 0)
        self._preempt(victim, out, self.preemption_mode)
        out.preempted.append(victim)

    def _preempt_a_waiting_row(self, out: SchedulerOutput) -> bool:
        """With nothing else to run, preempt a row waiting for its call (recompute: it keeps its
        tokens) so that the rows it waits for get blocks. False where none waits."""
        waiting_rows = [r for r in self.running if _waits_for_call(r)]
        if not waiting_rows:
            return False
        self._preempt(waiting_rows[-1], out, "recompute")
        return True

    def _preempt(self, req: Request, out: SchedulerOutput, mode: str) -> None:
        """Free the request's blocks, keep its tokens, requeue it first. Its KV is recomputed on
        readmission, or with ``mode="swap"`` copied to host memory and back."""
        self.running.remove(req)
        if mode == "swap" and req.num_computed_tokens:
            out.swap_out.append((req, self.kv_manager.live_pages(req, req.num_computed_tokens)))
            req.swapped_tokens = req.num_computed_tokens
            req.swap_state_slot = req.state_slot  # its state goes to host memory with its KV
        self.kv_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        self.num_preemptions += 1
        req.num_preemptions += 1


def _waits_for_call(req: Request) -> bool:
    """A row of a lock-step generate call that has its token for the call's next step."""
    return req.call is not None and req.call.waits(req)
