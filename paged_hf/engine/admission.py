"""Admission: a request is validated, given its id and tokenized before the scheduler sees it.

What passes here cannot fail later for reasons of its own (the failure model): the prompt's ids
are ints inside the vocabulary and no media placeholder, the sampling params are valid for this
model, stop strings have a tokenizer to read them. Errors name the request.

Design notes: docs/internals.md, paged_hf/engine/admission.py.
"""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING, Any

import torch

from ..cache.stable_keys import hash_tensor
from ..config import EngineConfig
from ..execution.runner import max_positions
from ..requests.detokenizer import StopStrings
from ..requests.request import AUTO_ID_PREFIX, Request
from ..requests.sampling_params import MAX_SEED, SamplingParams
from .binding import check_still_patched
from .structured import StructuredOutputs

if TYPE_CHECKING:
    import itertools

    from ..execution.runner import ModelRunner
    from .scheduler import Scheduler
    from .turns import TurnLock

logger = logging.getLogger("paged_hf")


class AdmissionMixin:
    """Requests in: validated, given their ids, tokenized, queued."""

    model: torch.nn.Module
    tokenizer: Any
    config: EngineConfig
    vocab_size: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    scheduler: Scheduler
    runner: ModelRunner
    requests: dict[str, Request]
    structured: StructuredOutputs | None
    _ids: itertools.count
    _stats: Any  # EngineStats
    _patch_state: Any
    lock: TurnLock

    def add_request(
        self,
        prompt: Any,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        eos_token_ids: frozenset[int] | None = None,
        *,
        stop_strings: StopStrings | None = None,
        encoder_token_ids: tuple[int, ...] | None = None,
        arrival_time: float | None = None,
        prompt_embeds: torch.Tensor | None = None,
    ) -> str:
        """Queue one prompt (token ids, or a string with a tokenizer). Bad input raises
        ValueError naming the request; nothing else is disturbed. ``eos_token_ids`` replaces the
        model's EOS ids for this request (transformers' generate takes them from its config).
        ``request_id``: a str of the caller's choosing, or None for one the engine makes
        (``"paged_hf:<n>"``); returns the id. ``stop_strings``: a matcher of the caller's making
        (``model.generate``'s, with transformers' semantics) instead of one for ``params.stop``;
        ``encoder_token_ids``: the tokens ``encoder_repetition_penalty`` favours instead of the
        prompt's. ``arrival_time``: when the caller asked (``scheduler.clock()``'s time; default
        now), where its TTFT and queue time start. ``prompt_embeds``: ``[prompt tokens, hidden]``,
        what the forward takes at the prompt's positions instead of its tokens' embeddings
        (transformers' ``inputs_embeds``: soft prompts, prompt tuning); the prompt's token ids then
        only count its length and show in its output. A full queue raises ``QueueFull``."""
        with self.lock:
            rid = self._new_id(request_id)
            return self._add(
                rid,
                prompt,
                params,
                eos_token_ids,
                stop_strings,
                encoder_token_ids,
                arrival_time,
                prompt_embeds,
            )

    def _add(
        self,
        rid: str,
        prompt: Any,
        params: SamplingParams | None,
        eos_token_ids: frozenset[int] | None = None,
        stop_strings: StopStrings | None = None,
        encoder_token_ids: tuple[int, ...] | None = None,
        arrival_time: float | None = None,
        prompt_embeds: torch.Tensor | None = None,
    ) -> str:
        check_still_patched(self.model, self._patch_state)
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(
                f"request {rid}: params must be SamplingParams, got {type(params).__name__}"
            )
        params.validate(f"request {rid}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.vocab_size:
                raise ValueError(
                    f"request {rid}: {name}={k} exceeds the vocabulary ({self.vocab_size})"
                )
        if params.stop and self.tokenizer is None:
            raise ValueError(
                f"request {rid}: stop={list(params.stop)!r} needs a tokenizer to read the text "
                "(Engine(model, tokenizer)); stop_token_ids need none"
            )
        self._check_speculation(rid, params)
        bad_stop = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stop:
            raise ValueError(
                f"request {rid}: stop token id {bad_stop[0]} is outside the vocabulary "
                f"[0, {self.vocab_size})"
            )
        ids = self._prompt_ids(rid, prompt)
        eos = self.eos_token_ids if eos_token_ids is None else frozenset(eos_token_ids)
        arrival = self.scheduler.clock() if arrival_time is None else arrival_time
        req = Request(rid, ids, params, eos, self.max_model_len, arrival_time=arrival)
        req.tpot_target_s = (
            params.tpot_target_s if params.tpot_target_s is not None else self.config.tpot_target_s
        )
        req.seed = self._row_seed(params)
        req.stop_strings = stop_strings if stop_strings is not None else self._stop_strings(params)
        req.grammar = self._grammar(rid, params)
        if encoder_token_ids is not None:
            self._check_token_ids(rid, list(encoder_token_ids), "encoder_token_ids")
            req.encoder_token_ids = tuple(encoder_token_ids)
        if params.prompt_logprobs is not None:
            req.score_targets, req.score_start = ids[1:], 0
        if prompt_embeds is not None:
            req.prompt_embeds, req.embeds_key = self._checked_embeds(rid, prompt_embeds, len(ids))
        return self._queue(req)

    def _check_speculation(self, rid: str, params: SamplingParams) -> None:
        """A speculating request needs a model whose KV takes rejected tokens back, and a draft
        model where it asks for one."""
        option = (params.prompt_lookup_num_tokens and "prompt_lookup_num_tokens") or (
            params.num_assistant_tokens and "num_assistant_tokens"
        )
        if option and not self.scheduler.speculates:
            raise ValueError(
                f"request {rid}: {option} on a model with recurrent or convolution "
                "state (a hybrid) is not supported: its state cannot take back rejected tokens"
            )
        if params.num_assistant_tokens and self.scheduler.drafter is None:
            raise ValueError(
                f"request {rid}: num_assistant_tokens needs a draft model "
                "(Engine.set_draft_model, or generate's assistant_model)"
            )

    def _checked_embeds(self, rid: str, embeds: Any, n: int) -> tuple[torch.Tensor, str]:
        """A prompt's embeddings, checked against its length and the model's width, in the
        model's dtype on its device; and the digest of their bytes (its cache key's salt)."""
        width = self.model.get_input_embeddings().embedding_dim
        if not isinstance(embeds, torch.Tensor) or embeds.dim() != 2:
            raise ValueError(
                f"request {rid}: prompt_embeds must be a [prompt tokens, hidden] tensor"
            )
        if tuple(embeds.shape) != (n, width):
            raise ValueError(
                f"request {rid}: prompt_embeds has shape {tuple(embeds.shape)}; the prompt has {n} "
                f"tokens and the model's embeddings are {width} wide"
            )
        weight = self.model.get_input_embeddings().weight
        embeds = embeds.detach().to(weight.device, weight.dtype).contiguous()
        if not bool(torch.isfinite(embeds).all()):
            raise ValueError(f"request {rid}: prompt_embeds holds NaN or inf")
        h = hashlib.sha256()
        hash_tensor(h, embeds)
        digest = h.hexdigest()
        return embeds, digest

    def _queue(self, req: Request) -> str:
        """Hand a built request to the scheduler (which refuses what could never fit the pool)."""
        self.scheduler.add(req)
        self.requests[req.request_id] = req
        self._stats.prompt_tokens += req.num_prompt_tokens
        return req.request_id

    def _check_token_ids(self, rid: str, ids: list, field: str) -> None:
        """Token ids a request carries (its prompt; a scoring pair's context or continuation):
        ints, inside the vocabulary, none of them a media placeholder."""
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"request {rid}: {field} must be token ids (int)")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"request {rid}: {field} token id {bad[0]} is outside the vocabulary "
                f"[0, {self.vocab_size})"
            )
        media = [t for t in ids if t in self._patch_state.media_token_ids]
        if media:
            raise ValueError(
                f"request {rid}: {field} token id {media[0]} is this model's image/video/audio "
                "placeholder; media inputs are not supported yet (paged_hf runs the text path of "
                "multimodal models)"
            )

    def _grammar(self, rid: str, params: SamplingParams) -> Any:
        """A matcher of the request's structured-output constraint (compiled once per text), or None."""
        constraint = params.constraint
        if constraint is None:
            return None
        kind, text = constraint
        if self.tokenizer is None:
            raise ValueError(
                f"request {rid}: {kind} needs a tokenizer to map the grammar onto tokens "
                "(Engine(model, tokenizer))"
            )
        if self.structured is None:
            try:
                self.structured = StructuredOutputs(self.tokenizer, self.vocab_size)
            except ValueError as e:
                raise ValueError(f"request {rid}: {e}") from None
        try:
            return self.structured.matcher(kind, text)
        except Exception as e:  # noqa: BLE001 - xgrammar says what is wrong with it
            field = text if len(text) <= 200 else text[:200] + "..."
            raise ValueError(
                f"request {rid}: its {kind} does not compile ({type(e).__name__}: {e}): {field}"
            ) from None

    def _stop_strings(self, params: SamplingParams) -> StopStrings | None:
        if not params.stop:
            return None
        return StopStrings(self.tokenizer, params.stop, params.include_stop_str_in_output)

    def add_score_request(
        self,
        context: Any,
        continuation: Any,
        request_id: str | None = None,
        *,
        top_logprobs: int | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Queue one scoring request (see ``score``); returns its id. ``run_until_done`` gives
        its ``ScoreOutput``."""
        from .scoring import add_score_request

        return add_score_request(
            self, self._new_id(request_id), context, continuation, top_logprobs, cache_salt
        )

    def _new_id(self, request_id: Any) -> str:
        if request_id is None:
            return f"{AUTO_ID_PREFIX}{next(self._ids)}"
        if isinstance(request_id, bool) or not isinstance(request_id, (str, int)):
            raise TypeError(
                f"request_id={request_id!r}: must be a str (or None for an id the engine makes)"
            )
        rid = str(request_id)
        if rid.startswith(AUTO_ID_PREFIX):
            raise ValueError(
                f"request {rid}: ids starting with {AUTO_ID_PREFIX!r} are the ones the engine makes; "
                "choose another, or pass none"
            )
        if rid in self.requests:
            raise ValueError(f"request {rid}: id already in use")
        return rid

    def _prompt_ids(self, rid: str, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"request {rid}: a text prompt needs a tokenizer (Engine(model, tokenizer))"
                )
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        elif isinstance(prompt, torch.Tensor):
            ids = prompt.flatten().tolist()
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
        else:
            raise ValueError(
                f"request {rid}: a prompt is text or a list of token ids, got {type(prompt).__name__}"
            )
        if not ids:
            raise ValueError(f"request {rid}: empty prompt")
        self._check_token_ids(rid, ids, "prompt")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"request {rid}: prompt has {len(ids)} tokens, max_model_len is {self.max_model_len} "
                "(room for at least one new token is needed)"
            )
        return ids

    def _row_seed(self, params: SamplingParams) -> int | None:
        """The key of a sampled request's random stream (paged_hf/execution/random_streams.py): its
        seed, else one drawn now (``with_drawn_seed``). Greedy requests draw nothing."""
        if params.is_greedy:
            return None
        return params.seed if params.seed is not None else _drawn_seed(params)


def with_drawn_seed(params: SamplingParams) -> SamplingParams:
    """``params`` with a seed: its own, else one drawn from torch's default generator, which a
    caller should do in its own thread when it asks (``add_request`` does; a background engine's
    ``submit`` before handing the request to its loop), so a call under ``torch.manual_seed`` gets
    the same streams whatever the engine does after. Greedy params are returned as they are."""
    if params.is_greedy or params.seed is not None:
        return params
    return params.with_(seed=_drawn_seed(params))


def _drawn_seed(params: SamplingParams) -> int:
    # one draw a request, however many samples (sample k keys its stream with seed + k)
    return int(torch.randint(0, MAX_SEED - params.n, ()))


def max_model_len_for(model: torch.nn.Module, asked: int | None) -> int:
    """``asked``, if the model can position that many tokens; by default what it was trained for."""
    default, most = max_positions(model)
    if asked is None:
        return default or (1 << 31)
    if most is not None and asked > most:
        raise ValueError(
            f"max_model_len={asked} exceeds the {most} positions this {model.config.model_type} model "
            f"can encode (max_position_embeddings / n_positions{', with its RoPE scaling' if most != default else ''})"
        )
    return asked


def within_limits(config: EngineConfig, max_model_len: int, limits: dict) -> int:
    """``max_model_len``, lowered to what the model is exact up to (patch found the limits); an
    option set above a limit is refused naming why."""
    for option, (limit, why) in limits.items():
        value = max_model_len if option == "max_model_len" else getattr(config, option)
        if value <= limit:
            continue
        # the default: lower it, say so once
        if option == "max_model_len" and config.max_model_len is None:
            logger.info("paged_hf: max_model_len lowered to %d: %s", limit, why)
            max_model_len = limit
        else:
            raise ValueError(
                f"{option}={value} exceeds {limit}, the most this model runs exactly with: {why}"
            )
    return max_model_len


def eos_ids(model: torch.nn.Module, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    gc = getattr(model, "generation_config", None)
    for src in (
        getattr(gc, "eos_token_id", None),
        getattr(model.config, "eos_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
    ):
        if src is None:
            continue
        ids.update([src] if isinstance(src, int) else list(src))
    return frozenset(ids)
