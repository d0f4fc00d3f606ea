"""A call's rows through the engine: each submitted as a request, followed to the end, and what
was submitted aborted if anything fails on the way (``model.generate``, ``Engine.beam_search``)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..engine.outputs import RequestOutput
from .generate_callbacks import GenerateCall


def run_rows(
    engine: Any,
    add_row: Callable[[int, list[int]], str],
    prompts: list[list[int]],
    call: GenerateCall | None,
    what: str,
    streamer: Any = None,
    shown: torch.Tensor | None = None,
) -> list[RequestOutput]:
    """Each prompt a request (``add_row(i, prompt)`` submits row ``i`` and returns its id), run to
    the end; on any exception (a refused row, Ctrl-C in a notebook) what was submitted is aborted.
    A callback of ``call`` that raised raises here; a row that failed fails the call, naming it (a
    tensor has no per-row errors). ``streamer`` is shown ``shown``, then each token."""
    rids: list[str] = []
    try:
        # the rows, their call and their watch at once: no other thread steps in between
        with engine.lock:
            for i, prompt in enumerate(prompts):
                rids.append(add_row(i, prompt))
            if streamer is not None:
                streamer.put(shown.cpu())
            running = engine.follow(
                rids,
                on_token=(lambda _rid, tok: streamer.put(torch.tensor([tok])))
                if streamer is not None
                else None,
            )
        outputs = engine.wait(running)
        if streamer is not None:
            streamer.end()
    except BaseException:
        engine.abort_all(rids)
        raise
    if call is not None and call.rows.error is not None:
        raise call.rows.error  # the caller's callback raised: so does its call
    failed = [(i, out.error) for i, out in enumerate(outputs) if out.error is not None]
    if failed:
        raise RuntimeError(
            f"{what}: {len(failed)} row(s) failed: "
            + "; ".join(f"row {i}: {err}" for i, err in failed[:3])
        )
    return outputs
