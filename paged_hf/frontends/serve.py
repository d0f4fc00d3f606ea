"""A background engine for notebooks and services: submit, stream, cancel, watch.

Design notes: docs/internals.md, paged_hf/frontends/serve.py.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Iterator

import torch

from ..engine.admission import with_drawn_seed
from ..engine.outputs import RequestOutput
from ..requests.detokenizer import IncrementalDetokenizer, StopStrings
from ..requests.sampling_params import SamplingParams

logger = logging.getLogger("paged_hf")

_IDLE_WAIT_S = 0.5  # how long an idle loop sleeps between checks of its queue


class EngineStopped(RuntimeError):
    """The background engine has shut down, or its loop thread failed (the cause is chained)."""


class RequestHandle:
    """One submitted prompt: ``stream()``, ``result()``, ``cancel()``, ``done()``.

    With ``n > 1``, ``stream()`` follows the first sample; ``result()`` has them all.
    """

    def __init__(
        self,
        owner: "BackgroundEngine",
        request_id: str | None,
        tokenizer: Any,
        params: SamplingParams | None = None,
    ) -> None:
        self.request_id = request_id  # set by the engine when None
        self._owner = owner
        self._tokenizer = tokenizer
        self._params = params
        self._cond = threading.Condition()
        self._tokens: list[int] = []
        self._output: RequestOutput | None = None
        self._error: BaseException | None = None

    # ---- called on the loop thread -----------------------------------------------------------
    def _push(self, token: int) -> None:
        with self._cond:
            self._tokens.append(token)
            self._cond.notify_all()

    def _finish(self, output: RequestOutput | None, error: BaseException | None = None) -> None:
        with self._cond:
            if self._output is None and self._error is None:
                self._output, self._error = output, error
            self._cond.notify_all()

    # ---- the caller's side -------------------------------------------------------------------
    def done(self) -> bool:
        with self._cond:
            return self._output is not None or self._error is not None

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Wait for the request to finish; its ``RequestOutput`` (``finish_reason`` "abort" if cancelled)."""
        with self._cond:
            if not self._cond.wait_for(
                lambda: self._output is not None or self._error is not None, timeout
            ):
                raise TimeoutError(f"request {self.request_id}: not finished after {timeout} s")
            if self._error is not None:
                raise EngineStopped(f"request {self.request_id}: {self._error}") from self._error
            return self._output

    def token_ids(self) -> Iterator[int]:
        """Yield the generated token ids as they arrive."""
        k = 0
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda k=k: (
                        len(self._tokens) > k or self._output is not None or self._error is not None
                    )
                )
                new, finished = (
                    self._tokens[k:],
                    self._output is not None or self._error is not None,
                )
            k += len(new)
            yield from new
            if finished:
                with self._cond:
                    if len(self._tokens) == k:
                        break
        if self._error is not None:
            raise EngineStopped(f"request {self.request_id}: {self._error}") from self._error

    def stream(self) -> Iterator[str] | Iterator[int]:
        """Yield text deltas (token ids when the engine has no tokenizer) as they are produced.

        Text is detokenized incrementally (``paged_hf.requests.detokenizer``) and never splits a UTF-8
        character: a token that ends mid-character waits for the next one. With stop strings,
        the last ``len(longest stop) - 1`` characters wait until they cannot begin one, so a
        stop string is never shown. The concatenated deltas equal ``result().text``. Can be
        called more than once; each call starts from the beginning.
        """
        if self._tokenizer is None:
            return self.token_ids()
        return self._text_stream()

    def _text_stream(self) -> Iterator[str]:
        detok = IncrementalDetokenizer(self._tokenizer)
        params = self._params
        stops = (
            StopStrings(self._tokenizer, params.stop, params.include_stop_str_in_output)
            if params is not None and params.stop
            else None
        )
        for tok in self.token_ids():
            if stops is None:
                delta = detok.push(tok)
            else:
                if stops.hit is None:  # the engine ends the request at a hit: nothing follows
                    stops.push(tok)
                delta = stops.safe_text()[len(detok.emitted) :]
                detok.emitted += delta
            if delta:
                yield delta
        tail = detok.finish(self.result().text or "")  # what only the whole output's decode has
        if tail:
            yield tail

    def cancel(self) -> None:
        """Stop generating and free the request's KV blocks now (returns once they are freed).
        A finished request is left as it is."""
        if self.done():
            return
        self._owner._call("cancel", self.request_id)


class BackgroundEngine:
    """An ``Engine`` stepping on a daemon thread. Build it with ``paged_hf.serve``."""

    def __init__(self, engine: Any) -> None:
        if engine.serving:
            raise RuntimeError(
                "this engine is already stepped by a background engine; shut that one down first"
            )
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._commands: queue.Queue = queue.Queue()
        # root request id -> handle; changed under the engine's lock (a watch may end one in any
        # thread that steps)
        self._handles: dict[str, RequestHandle] = {}
        self._error: BaseException | None = None
        engine.serving = True  # unpatch refuses while it is set
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="paged_hf-engine", daemon=True)
        self._thread.start()

    # ---- public API ----------------------------------------------------------------------------
    def submit(
        self, prompt: Any, params: SamplingParams | None = None, request_id: str | None = None
    ) -> RequestHandle:
        """Queue a prompt (text, or token ids); returns its handle at once. Bad input raises the
        engine's ValueError here, in the caller's thread (the loop thread validates it before
        its next step, so this waits at most one step; its TTFT counts from this call). Without
        ``request_id`` the engine makes one. A full queue (``max_waiting``) raises ``QueueFull``."""
        arrival = self.engine.scheduler.clock()
        # its random stream keyed here, in the caller's thread (the loop adds it later)
        if isinstance(params, SamplingParams):
            params = with_drawn_seed(params)
        handle = RequestHandle(self, request_id, self.tokenizer, params)
        self._call("add", handle, prompt, params, arrival)
        return handle

    def generate(self, prompt: Any, params: SamplingParams | None = None) -> RequestOutput:
        """Submit and wait: the ``RequestOutput``."""
        return self.submit(prompt, params).result()

    def stats(
        self, ttft_target_s: float | None = None, tpot_target_s: float | None = None
    ) -> dict[str, Any]:
        """``Engine.stats()`` of the engine, read from the loop thread between steps."""
        return self._call("stats", ttft_target_s, tpot_target_s)

    def stats_frame(self) -> Any:
        """A pandas DataFrame with one row per engine step: step, time (seconds since the first
        step), running, waiting, tokens, blocks_used, kv_waste, preempted."""
        import pandas as pd

        # appended by the loop thread; a copy is consistent
        rows = list(self.engine._stats.step_log)
        frame = pd.DataFrame(
            rows,
            columns=[
                "step",
                "time",
                "running",
                "waiting",
                "tokens",
                "blocks_used",
                "kv_waste",
                "preempted",
            ],
        )
        if len(frame):
            frame["time"] = frame["time"] - frame["time"].iloc[0]
        return frame

    def requests_frame(self) -> Any:
        """A pandas DataFrame with one row per finished request: time (its finish, on
        ``stats_frame``'s clock), arrival, priority, queued_s, ttft, tpot, max_itl, preemptions,
        output_tokens, error, and its targets."""
        import pandas as pd

        rows = list(self.engine._stats.finished_log)
        frame = pd.DataFrame(rows)
        steps = list(self.engine._stats.step_log)
        if len(frame) and steps:
            start = steps[0]["time"]
            frame["time"] = frame["time"] - start
            frame["arrival"] = frame["arrival"] - start
        return frame

    def plot(self) -> Any:
        """A matplotlib figure over time: sequences running / waiting, tokens per step, KV blocks
        used against the pool size, and each finished request's TTFT by priority."""
        import matplotlib.pyplot as plt

        frame = self.stats_frame()
        fig, axes = plt.subplots(4, 1, figsize=(8, 8.5), sharex=True, layout="constrained")
        x = frame["time"]
        axes[0].plot(x, frame["running"], label="running", drawstyle="steps-post")
        axes[0].plot(x, frame["waiting"], label="waiting", drawstyle="steps-post")
        axes[0].set_ylabel("requests")
        axes[0].legend(loc="upper right")
        axes[1].plot(x, frame["tokens"], color="tab:green", drawstyle="steps-post")
        axes[1].set_ylabel("tokens / step")
        axes[2].plot(x, frame["blocks_used"], color="tab:red", label="used", drawstyle="steps-post")
        axes[2].axhline(
            self.engine.kv_manager.num_blocks, color="gray", linestyle="--", label="pool"
        )
        axes[2].set_ylabel("KV blocks")
        axes[2].legend(loc="upper right")
        requests = self.requests_frame()
        for priority, rows in requests.groupby("priority") if len(requests) else ():
            axes[3].scatter(rows["time"], rows["ttft"], s=8, label=f"priority {priority}")
        axes[3].set_ylabel("TTFT (s) at finish")
        axes[3].set_xlabel("seconds since first step")
        if len(requests):
            axes[3].legend(loc="upper right")
        fig.suptitle(f"paged_hf engine: {len(frame)} steps")
        plt.close(fig)  # returned, not shown twice by pyplot in a notebook
        return fig

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopped.is_set()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the loop; requests still running are aborted (their ``result()`` has
        finish_reason "abort"). Idempotent."""
        if self._thread.is_alive():
            self._commands.put(("stop", None, (), threading.Event()))
            self._thread.join(timeout)

    def __enter__(self) -> "BackgroundEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---- plumbing --------------------------------------------------------------------------------
    def _call(self, op: str, *args: Any) -> Any:
        """Run ``op`` on the loop thread and wait for it; its exception is raised here."""
        if self._error is not None or self._stopped.is_set() or not self._thread.is_alive():
            raise EngineStopped(
                f"the background engine is stopped{': ' + repr(self._error) if self._error else ''}"
            ) from self._error
        box: dict[str, Any] = {}
        done = threading.Event()
        self._commands.put((op, box, args, done))
        while not done.wait(_IDLE_WAIT_S):
            if not self._thread.is_alive():
                raise EngineStopped(
                    "the background engine stopped before handling the call"
                ) from self._error
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def _loop(self) -> None:
        engine = self.engine
        try:
            while True:
                block = not engine.has_unfinished
                try:
                    cmd = (
                        self._commands.get(timeout=_IDLE_WAIT_S)
                        if block
                        else self._commands.get_nowait()
                    )
                except queue.Empty:
                    cmd = None
                while cmd is not None:
                    if self._do(*cmd):
                        return
                    try:
                        cmd = self._commands.get_nowait()
                    except queue.Empty:
                        cmd = None
                if engine.has_unfinished:
                    self._step()
        except BaseException as e:  # surface to every waiter instead of dying silently
            self._error = e
            for handle in self._handles.values():
                handle._finish(None, e)
            self._handles.clear()
            self._fail_queued(e)
            self._abort_all()
        finally:
            self.engine.serving = False
            self._stopped.set()

    def _abort_all(self) -> None:
        """Free what the dead loop left in the engine, so it can be used (or unpatched) again."""
        for rid in list(self.engine.requests):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - best effort on the way down
                logger.exception("paged_hf: aborting request %s after the loop failed", rid)

    def _do(self, op: str, box: dict | None, args: tuple, done: threading.Event) -> bool:
        """Handle one command; True when the loop must stop."""
        try:
            if op == "add":
                with self.engine.lock:  # watched before any thread can step it
                    self._add(*args)
            elif op == "cancel":
                self._cancel(args[0])
            elif op == "stats":
                box["value"] = self.engine.stats(*args)
            elif op == "stop":
                for rid in list(self._handles):
                    self._cancel(rid)
                self._fail_queued(EngineStopped("the background engine was shut down"))
                return True
        except Exception as e:  # the caller's error (bad prompt, ...): raised in its thread
            if box is not None:
                box["error"] = e
        finally:
            done.set()
        return False

    def _add(self, handle: RequestHandle, prompt: Any, params: Any, arrival: float) -> None:
        """Submit, and follow the request whichever thread steps the engine (a patched model's
        ``generate`` may be called beside the background engine): its first sample's tokens to
        its handle as they come, its output when it is over."""
        engine = self.engine
        rid = engine.add_request(prompt, params, request_id=handle.request_id, arrival_time=arrival)
        handle.request_id = rid
        self._handles[rid] = handle

        def on_token(request_id: str, token: int) -> None:
            if request_id == rid:  # streams follow the first sample
                handle._push(token)

        def on_done(root: Any) -> None:
            if self._handles.pop(rid, None) is not None:
                handle._finish(engine.collect([root]))

        engine.watch([engine.requests[rid]], on_token, on_done)

    def _fail_queued(self, error: BaseException) -> None:
        while True:
            try:
                _op, box, _args, done = self._commands.get_nowait()
            except queue.Empty:
                return
            if box is not None:
                box["error"] = EngineStopped(str(error))
            done.set()

    def _cancel(self, rid: str) -> None:
        with self.engine.lock:
            handle = self._handles.pop(rid, None)
            if handle is None or rid not in self.engine.requests:
                return  # finished already
            handle._finish(self.engine.abort(rid))  # frees the blocks now

    def _step(self) -> None:
        self.engine.step()  # tokens and outputs reach the handles through their watches


def serve(
    model: torch.nn.Module, tokenizer: Any = None, *, warmup: bool = True, **config: Any
) -> BackgroundEngine:
    """Start an engine for ``model`` on a background thread; returns the ``BackgroundEngine``.

    ``config`` takes the ``EngineConfig`` fields. A model patched with ``paged_hf.patch`` and
    no ``config`` runs its own engine (``engine_for``); its ``generate``, called meanwhile from any
    thread, shares the background engine's steps. ``warmup``: run ``Engine.warmup()`` first, here, so the first
    request does not wait for kernel compilation or CUDA-graph capture (on a GPU machine's first
    use FlashInfer compiles its kernels: a minute or more; on CPU it takes a moment).

    >>> bg = paged_hf.serve(model, tokenizer)
    >>> print("".join(bg.submit("Hello", SamplingParams(max_new_tokens=8)).stream()))
    >>> bg.shutdown()
    """
    from ..model.patching import (  # Engine patches the model if needed
        Engine,
        engine_for,
        is_patched,
    )

    if is_patched(model) and not config:
        engine = engine_for(model)
        if tokenizer is not None and engine.tokenizer is None:
            engine.tokenizer = tokenizer
    else:
        engine = Engine(model, tokenizer, **config)
    if warmup:
        engine.warmup()
    return BackgroundEngine(engine)
