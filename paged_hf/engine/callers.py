"""Several callers on one engine: who waits on which requests, told by whichever thread steps.

A blocking call (``generate``, ``score``, a patched ``model.generate``) or a background engine
registers a ``Watch`` over the requests it submitted. Whoever runs a step, in any thread, hands
each sampled token to its request's watch and tells the watch when a request is over (finished,
failed, aborted), so a thread's call ends as soon as its own rows do, whoever stepped them.
``CallersMixin`` is a part of ``EngineCore`` (paged_hf/engine/core.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

from ..requests.request import Request
from .turns import TurnLock


@dataclass(eq=False)
class Watch:
    """One caller's requests (roots) still open, and what it is told: ``on_token(request_id,
    token)`` for each token sampled (each sample of ``n > 1`` by its own id), ``on_done(root)``
    when a root and all its samples are over. Both run in the stepping thread, under the engine's
    lock: they must not wait for another thread that uses the engine."""

    open: set[Request]
    on_token: Callable[[str, int], None] | None = None
    on_done: Callable[[Request], None] | None = None


class CallersMixin:
    lock: TurnLock
    _watches: dict[Request, Watch]
    _verified: Any  # the step's speculation (paged_hf/engine/speculation.py's Verified)
    fail: Callable[..., None]

    def watch(
        self,
        roots: Iterable[Request],
        on_token: Callable[[str, int], None] | None = None,
        on_done: Callable[[Request], None] | None = None,
    ) -> Watch:
        """Follow ``roots`` (requests already added) until each is over."""
        with self.lock:
            watch = Watch({r for r in roots if not r.samples_finished}, on_token, on_done)
            for root in watch.open:
                self._watches[root] = watch
            return watch

    def unwatch(self, watch: Watch) -> None:
        with self.lock:
            for root in watch.open:
                if self._watches.get(root) is watch:
                    del self._watches[root]

    def _deliver(self, sampled: dict[Request, int], finished: list[Request]) -> list[Request]:
        """After a step: each token to its watch (a callback that raises fails its request alone),
        then the requests that ended. Returns the requests failed by their callbacks."""
        failed: list[Request] = []
        if not self._watches:
            return failed
        drafts = self._verified.accepted  # speculation's accepted tokens come first
        for req in dict.fromkeys([*drafts, *sampled]):  # a stop string may end one at a draft
            watch = self._watches.get(req.parent or req)
            if watch is None or watch.on_token is None:
                continue
            try:
                for tok in [*drafts.get(req, ()), *([sampled[req]] if req in sampled else [])]:
                    watch.on_token(req.request_id, tok)
            except Exception as e:  # noqa: BLE001 - the callback's failure is its request's alone
                self.fail(
                    req,
                    f"request {req.request_id}: on_token callback raised {type(e).__name__}: {e}",
                )
                failed.append(req)
        for req in finished + failed:
            self._settle(req.parent or req)
        return failed

    def _settle(self, root: Request) -> None:
        """Tell ``root``'s watch that it is over, once it and all its samples are."""
        if not root.samples_finished:
            return
        watch = self._watches.pop(root, None)
        if watch is None:
            return
        watch.open.discard(root)
        if watch.on_done is not None:
            watch.on_done(root)
