"""One ``model.generate`` call's rows as a group, for callbacks written for transformers' loop.

Design notes: docs/internals.md, paged_hf/engine/call_group.py.
"""

from __future__ import annotations

from typing import Any

import torch

from ..requests.request import FinishReason, Request

STOP_REASON = "stopping_criteria"
Ending = tuple[Request, FinishReason, "str | None"]  # (row, why it ends, its stop reason or error)


class CallGroup:
    """``rows``: the call's prompts as the caller padded them ``[batch, width]`` (each repeated
    ``n`` times, as transformers expands them); ``criteria``: transformers' ``StoppingCriteriaList``
    for the call (its own criteria and the caller's); ``pad``: the token a finished row shows;
    ``pads_finished``: whether finished rows show pad (transformers does where the list has an EOS
    criterion) or go on generating until the call ends; ``device``: where the callbacks' tensors live."""

    chooses_tokens = False

    def __init__(
        self,
        rows: torch.Tensor,
        n: int,
        criteria: Any,
        pad: int,
        pads_finished: bool,
        max_new_tokens: int,
        device: torch.device | None = None,
    ) -> None:
        prompts = rows.detach().to("cpu", torch.long).repeat_interleave(n, dim=0)
        self.width = prompts.shape[1]
        self.view = torch.full(
            (prompts.shape[0], self.width + max_new_tokens), pad, dtype=torch.long
        )
        self.view[:, : self.width] = prompts
        self.criteria, self.pad, self.pads_finished, self.device = (
            criteria,
            pad,
            pads_finished,
            device,
        )
        self.members: list[Request | None] = [None] * prompts.shape[0]  # samples join when forked
        self.row_of: dict[int, int] = {}  # id(request) -> its row
        self.done = [False] * prompts.shape[0]  # transformers' ~unfinished_sequences
        self.steps = 0  # steps the criteria have seen
        self.error: BaseException | None = None  # what a callback raised: the call raises it

    def join(self, req: Request, row: int) -> None:
        self.members[row] = req
        self.row_of[id(req)] = row
        req.group = self

    def join_sample(self, parent: Request, k: int, child: Request) -> None:
        """Sample ``k`` of a parent's ``n`` (parallel sampling forks them after the prompt)."""
        self.join(child, self.row_of[id(parent)] + k)

    def holds(self, req: Request) -> bool:
        """Whether ``req`` has its token for the call's next step and waits for the others' (a step
        it ran ahead would be one the criteria never saw)."""
        return req.num_output_tokens > self.steps

    def ready(self) -> bool:
        """Every row has its token for the next step, or has ended."""
        return all(
            req is not None and (req.is_finished or req.num_output_tokens > self.steps)
            for req in self.members
        )

    def advance(self) -> list[Ending]:
        """Run the criteria for each step every row has finished; the rows to end."""
        failed = self._failed_rows()
        if failed:
            return failed
        ending: list[Ending] = []
        while self.error is None and not all(self.done) and self.ready():
            column = self.width + self.steps
            for i, req in enumerate(self.members):
                if req.num_output_tokens > self.steps:  # rows that ended earlier show pad
                    self.view[i, column] = req.output_ids[self.steps]
            self.steps += 1
            try:
                is_done = self._is_done(self.criteria(self._input_ids(), None))
            except Exception as e:  # noqa: BLE001 - the caller's criterion: its call ends, no one else's
                return self._fail(e, "stopping criteria")
            for i, req in enumerate(self.members):
                # a row that ended on its own EOS, length or stop string: transformers' criteria say so too
                if req.is_finished or (is_done[i] and not self.done[i]):
                    self.done[i] = True
                    if self.pads_finished and not req.is_finished:
                        ending.append((req, FinishReason.STOP, STOP_REASON))
        if all(self.done):  # the call is over: rows that ran on past their own stop end with it
            stopped = {id(req) for req, _, _ in ending}
            ending += [
                e for e in self._end_rest(FinishReason.STOP, STOP_REASON) if id(e[0]) not in stopped
            ]
        return ending

    def _is_done(self, answer: Any) -> list[bool]:
        return torch.as_tensor(answer, dtype=torch.bool).cpu().expand(len(self.members)).tolist()

    def _input_ids(self) -> torch.Tensor:
        view = self.view[:, : self.width + self.steps]
        return view if self.device is None or self.device.type == "cpu" else view.to(self.device)

    def _end_rest(self, reason: FinishReason, text: str | None) -> list[Ending]:
        """Every row of the call that has not ended, to end with ``reason``."""
        return [
            (req, reason, text) for req in self.members if req is not None and not req.is_finished
        ]

    def _fail(self, error: BaseException, callback: str) -> list[Ending]:
        self.error = error
        return self._end_rest(
            FinishReason.ERROR,
            f"its generate call's {callback} raised {type(error).__name__}: {error}",
        )

    def _failed_rows(self) -> list[Ending]:
        """A row that failed or was aborted fails its call: a tensor result has no per-row errors,
        and rows waiting for it would wait for ever."""
        lost = [
            req
            for req in self.members
            if req is not None and req.finish_reason in (FinishReason.ERROR, FinishReason.ABORT)
        ]
        if not lost:
            return []
        return self._end_rest(
            FinishReason.ERROR,
            f"row {self.row_of[id(lost[0])]} of its generate call ended: {lost[0].error or 'aborted'}",
        )


class JointCallGroup(CallGroup):
    """The rows' tokens picked together, as transformers' loop picks them: ``processors`` (its
    ``LogitsProcessorList`` for the call: its own processors, the caller's, its warpers) on the
    rows' fp32 logits, then argmax (``do_sample``: a draw from the softmax with torch's default
    generator), pad for finished rows, then the criteria. ``scores`` / ``logits``: record each
    step's processed scores / raw logits."""

    chooses_tokens = True

    def __init__(
        self,
        rows: torch.Tensor,
        n: int,
        criteria: Any,
        pad: int,
        pads_finished: bool,
        max_new_tokens: int,
        device: torch.device | None,
        processors: Any,
        do_sample: bool,
        scores: bool,
        logits: bool,
    ) -> None:
        super().__init__(rows, n, criteria, pad, pads_finished, max_new_tokens, device)
        self.processors, self.do_sample = processors, do_sample
        self.scores: tuple | None = () if scores else None
        self.logits: tuple | None = () if logits else None
        self.offered: dict[int, torch.Tensor] = {}  # row -> its logits for the next step
        self.over = False

    def holds(self, req: Request) -> bool:
        """A row whose logits for the next step wait for the others' (it has nothing to compute)."""
        return self.row_of[id(req)] in self.offered

    def offer(self, req: Request, logits: torch.Tensor) -> None:
        self.offered[self.row_of[id(req)]] = logits

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

    def choose(self) -> dict[Request, int] | list[Ending]:
        """Every row's token for the step, once every row has offered its logits (else nothing); the
        rows to end, where a callback raised."""
        raw = self.take_offered(self.device or torch.device("cpu"))
        if raw is None:
            return {}
        try:
            scores = self.processors(self._input_ids(), raw.clone())
            if self.scores is not None:
                self.scores += (scores,)
            if self.logits is not None:
                self.logits += (raw,)
            tokens = (
                torch.multinomial(torch.softmax(scores, dim=-1), 1).squeeze(1)
                if self.do_sample
                else torch.argmax(scores, dim=-1)
            )
            if self.pads_finished:
                tokens = torch.where(
                    torch.tensor(self.done, device=tokens.device), self.pad, tokens
                )
            self.view[:, self.width + self.steps] = tokens.cpu()
            self.steps += 1
            is_done = self._is_done(self.criteria(self._input_ids(), self.scores))
        except Exception as e:  # noqa: BLE001 - the caller's processor or criterion: its call ends
            return self._fail(e, "logits processors or stopping criteria")
        self.done = [a or b for a, b in zip(self.done, is_done)]
        self.over = all(self.done)
        return dict(zip(self.members, self.view[:, self.width + self.steps - 1].tolist()))

    def advance(self) -> list[Ending]:
        failed = self._failed_rows()
        if failed:
            return failed
        # its length: every row at once
        if self.over or any(req.is_finished for req in self.members):
            return self._end_rest(FinishReason.STOP, STOP_REASON)
        return []

    def sequences(self) -> torch.Tensor:
        return self._input_ids()
