"""A ``generate`` call's rows in lock-step, for callbacks written for transformers' loop: its
stopping criteria (``CriteriaCall``), or its logits processors picking the rows' tokens
(``JointCall``). The engine knows either as a ``LockStepCall``
(paged_hf/requests/lock_step_call.py).

Design notes: docs/internals.md, paged_hf/model/lock_step_calls.py.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..requests.lock_step_call import CallStep
from ..requests.request import Request
from .call_rows import STOP_REASON, CallRows, PicksTokens


class CriteriaCall:
    """Rows that sample on their own, stopped by ``criteria`` (transformers'
    ``StoppingCriteriaList`` for the call: its own criteria and the caller's), run once per step on
    transformers' view."""

    def __init__(self, rows: CallRows, criteria: Any) -> None:
        self.rows, self.criteria = rows, criteria

    def join(self, req: Request, row: int) -> None:
        self.rows.join(req, row, self)

    def join_sample(self, parent: Request, k: int, child: Request) -> None:
        self.rows.join_sample(parent, k, child, self)

    def waits(self, req: Request) -> bool:
        """A row with its token for the call's next step waits (a step it ran ahead would be one the
        criteria never saw)."""
        return req.num_output_tokens > self.rows.steps

    def offer(self, req: Request, logits: torch.Tensor) -> bool:
        return False  # the engine samples these rows

    def choose(self) -> CallStep[Request]:
        return CallStep()

    def advance(self) -> CallStep[Request]:
        """Run the criteria for each step every row has finished; the rows to end."""
        rows = self.rows
        lost = rows.lost_row()
        if lost is not None:
            return lost
        stopped: list[tuple[Request, str]] = []
        while rows.error is None and not all(rows.done) and rows.ready():
            column = rows.width + rows.steps
            for i, req in enumerate(rows.members):
                if req.num_output_tokens > rows.steps:  # rows that ended earlier show pad
                    rows.view[i, column] = req.output_ids[rows.steps]
            rows.steps += 1
            try:
                is_done = rows.is_done(self.criteria(rows.input_ids(), None))
            except Exception as e:  # noqa: BLE001 - the caller's criterion
                return rows.fail(e, "stopping criteria")  # its call ends, no one else's
            for i, req in enumerate(rows.members):
                # a row that ended on its own EOS, length or stop string: transformers' criteria
                # say so too
                if req.is_finished or (is_done[i] and not rows.done[i]):
                    rows.done[i] = True
                    if rows.pads_finished and not req.is_finished:
                        stopped.append((req, STOP_REASON))
        if all(rows.done):  # the call is over: rows that ran on past their own stop end with it
            ending = {id(req) for req, _ in stopped}
            stopped += [(req, STOP_REASON) for req in rows.live() if id(req) not in ending]
        return CallStep(stopped=stopped)


class JointCall(PicksTokens):
    """The rows' tokens picked together, as transformers' loop picks them: ``processors`` (its
    ``LogitsProcessorList`` for the call: its own processors, the caller's, its warpers) on the
    rows' fp32 logits, then argmax (``do_sample``: a draw from the softmax with torch's default
    generator), pad for finished rows, then ``criteria``. ``scores`` / ``logits``: record each
    step's processed scores / raw logits."""

    def __init__(
        self,
        rows: CallRows,
        criteria: Any,
        processors: Any,
        do_sample: bool,
        scores: bool,
        logits: bool,
    ) -> None:
        self.rows, self.criteria, self.processors, self.do_sample = (
            rows,
            criteria,
            processors,
            do_sample,
        )
        self.scores: tuple | None = () if scores else None
        self.logits: tuple | None = () if logits else None

    def choose(self) -> CallStep[Request]:
        """Every row's token for the step, once every row has offered its logits (else nothing); the
        rows to fail, where a callback raised."""
        rows = self.rows
        raw = rows.take_offered(rows.device or torch.device("cpu"))
        if raw is None:
            return CallStep()
        try:
            scores = self.processors(rows.input_ids(), raw.clone())
            if self.scores is not None:
                self.scores += (scores,)
            if self.logits is not None:
                self.logits += (raw,)
            tokens = (
                torch.multinomial(torch.softmax(scores, dim=-1), 1).squeeze(1)
                if self.do_sample
                else torch.argmax(scores, dim=-1)
            )
            if rows.pads_finished:
                tokens = torch.where(
                    torch.tensor(rows.done, device=tokens.device), rows.pad, tokens
                )
            rows.view[:, rows.width + rows.steps] = tokens.cpu()
            rows.steps += 1
            is_done = rows.is_done(self.criteria(rows.input_ids(), self.scores))
        except Exception as e:  # noqa: BLE001 - the caller's processor or criterion: its call ends
            return rows.fail(e, "logits processors or stopping criteria")
        rows.done = [a or b for a, b in zip(rows.done, is_done)]
        rows.over = all(rows.done)
        column = rows.view[:, rows.width + rows.steps - 1].tolist()
        return CallStep(tokens=dict(zip(rows.members, column)))

    def output(self, gc: Any) -> torch.Tensor | GenerateDecoderOnlyOutput:
        """The call's result: its rows as transformers' loop left them, pad after each finished
        row."""
        sequences = self.rows.input_ids()
        if gc.return_dict_in_generate:
            return GenerateDecoderOnlyOutput(
                sequences=sequences, scores=self.scores, logits=self.logits
            )
        return sequences
