"""The rows of one lock-step ``generate`` call: who they are, transformers' view of their tokens,
the logits they offered for the next step, and how they end. Each call holds one
(paged_hf/model/lock_step_calls.py, paged_hf/model/beam_call.py).

Design notes: docs/internals.md, paged_hf/model/call_rows.py.
"""

from __future__ import annotations

from typing import Any

import torch

from ..requests.lock_step_call import CallStep, LockStepCall
from ..requests.request import FinishReason, Request

STOP_REASON = "stopping_criteria"  # a row's stop reason where its call's criteria ended it


class CallRows:
    """``prompts``: the call's prompts as the caller padded them ``[batch, width]``, each repeated
    ``n`` times as transformers expands them; ``max_new_tokens``: the room after them; ``pad``: the
    token a finished row shows; ``pads_finished``: whether finished rows show pad (transformers does
    where the criteria list has an EOS criterion) or go on generating until the call ends;
    ``device``: where the callbacks' tensors live."""

    def __init__(
        self,
        prompts: torch.Tensor,
        n: int,
        max_new_tokens: int,
        pad: int,
        pads_finished: bool,
        device: torch.device | None = None,
    ) -> None:
        rows = prompts.detach().to("cpu", torch.long).repeat_interleave(n, dim=0)
        self.width = rows.shape[1]
        # transformers' input_ids: the padded prompts, then each step's tokens (pad where none)
        self.view = torch.full((rows.shape[0], self.width + max_new_tokens), pad, dtype=torch.long)
        self.view[:, : self.width] = rows
        self.pad, self.pads_finished, self.device = pad, pads_finished, device
        self.members: list[Request | None] = [None] * rows.shape[0]  # samples join when forked
        self.row_of: dict[int, int] = {}  # id(request) -> its row
        self.done = [False] * rows.shape[0]  # transformers' ~unfinished_sequences
        self.steps = 0  # steps the callbacks have seen
        self.error: BaseException | None = None  # what a callback raised: the call raises it
        self.offered: dict[int, torch.Tensor] = {}  # row -> its logits for the next step
        self.over = False  # a call that picks its tokens has decided every row is done

    def join(self, req: Request, row: int, call: LockStepCall[Request]) -> None:
        self.members[row] = req
        self.row_of[id(req)] = row
        req.call = call

    def join_sample(
        self, parent: Request, k: int, child: Request, call: LockStepCall[Request]
    ) -> None:
        self.join(child, self.row_of[id(parent)] + k, call)

    def ready(self) -> bool:
        """Every row has its token for the next step, or has ended."""
        return all(
            req is not None and (req.is_finished or req.num_output_tokens > self.steps)
            for req in self.members
        )

    def input_ids(self) -> torch.Tensor:
        """transformers' ``input_ids`` for the steps seen so far, where the callbacks live."""
        view = self.view[:, : self.width + self.steps]
        return view if self.device is None or self.device.type == "cpu" else view.to(self.device)

    def is_done(self, answer: Any) -> list[bool]:
        """A criteria list's answer per row (one bool for the call: every row)."""
        return torch.as_tensor(answer, dtype=torch.bool).cpu().expand(len(self.members)).tolist()

    def offer(self, req: Request, logits: torch.Tensor) -> None:
        self.offered[self.row_of[id(req)]] = logits

    def has_offered(self, req: Request) -> bool:
        return self.row_of[id(req)] in self.offered

    def take_offered(self, device: torch.device) -> torch.Tensor | None:
        """The rows' logits for the step, fp32 ``[rows, vocab]`` on ``device``, once every row has
        offered them (then they are taken); else None."""
        if self.over or len(self.offered) < len(self.members) or None in self.members:
            return None
        logits = torch.stack([self.offered[i] for i in range(len(self.members))]).to(
            device, torch.float32
        )
        self.offered = {}
        return logits

    def live(self) -> list[Request]:
        """Every row of the call that has not ended."""
        return [req for req in self.members if req is not None and not req.is_finished]

    def fail(self, error: BaseException, callback: str) -> CallStep[Request]:
        """A callback raised: the call raises it, and every row still running fails with it."""
        self.error = error
        why = f"its generate call's {callback} raised {type(error).__name__}: {error}"
        return CallStep(failed=[(req, why) for req in self.live()])

    def lost_row(self) -> CallStep[Request] | None:
        """A row that failed or was aborted fails its call: a tensor result has no per-row errors,
        and rows waiting for it would wait for ever. None where no row was lost."""
        lost = [
            req
            for req in self.members
            if req is not None and req.finish_reason in (FinishReason.ERROR, FinishReason.ABORT)
        ]
        if not lost:
            return None
        first = lost[0]
        why = f"row {self.row_of[id(first)]} of its generate call ended: {first.error or 'aborted'}"
        return CallStep(failed=[(req, why) for req in self.live()])

    def end_when_over(self) -> CallStep[Request]:
        """A call that picks its rows' tokens: all of them stop once it is over, or once one ends by
        its length (every row's, at once)."""
        lost = self.lost_row()
        if lost is not None:
            return lost
        if self.over or any(req.is_finished for req in self.members):
            return CallStep(stopped=[(req, STOP_REASON) for req in self.live()])
        return CallStep()


class PicksTokens:
    """What the calls that pick their rows' tokens from the rows' offered logits (``JointCall``,
    ``BeamCall``) do alike: rows join them, each waits with its logits until every row has offered,
    and all end when the call is over."""

    rows: CallRows

    def join(self, req: Request, row: int) -> None:
        self.rows.join(req, row, self)

    def join_sample(self, parent: Request, k: int, child: Request) -> None:
        self.rows.join_sample(parent, k, child, self)

    def waits(self, req: Request) -> bool:
        """A row whose logits for the next step wait for the others' (it has nothing to compute)."""
        return self.rows.has_offered(req)

    def offer(self, req: Request, logits: torch.Tensor) -> bool:
        self.rows.offer(req, logits)
        return True

    def advance(self) -> CallStep[Request]:
        return self.rows.end_when_over()
