"""patch / unpatch: switch a loaded transformers model to paged attention and the engine's
``generate``, and back.

Design notes: docs/internals.md, paged_hf/model/patching.py.
"""

from __future__ import annotations

import types
from typing import Any, Sequence

import torch

from ..config import EngineConfig
from ..engine.binding import STATE_ATTR, PatchState, patch_state
from ..engine.core import EngineCore
from ..engine.ranks import over_ranks
from ..execution import attention
from ..requests.sampling_params import SamplingParams
from . import capability
from .beam_call import search_call
from .hf_generate import paged_generate
from .run_rows import run_rows
from .tensor_parallel import keep_unsharded, tp_group

UnsupportedModelError = capability.UnsupportedModelError


def ensure_attention_patched(model: torch.nn.Module) -> PatchState:
    """Check the model and select the paged attention implementation (idempotent); ``generate``
    is left alone. Raises ``UnsupportedModelError`` naming the module and the reason."""
    state = patch_state(model)
    if state is not None:
        return state
    reshard = keep_unsharded(model)  # FSDP (data parallel): weights gathered once, kept
    try:
        cap = capability.check(model)
    except BaseException:
        if reshard is not None:
            reshard()
        raise
    attention.register()
    original = model.config._attn_implementation
    configs = capability.configs_of(model)
    saved = [(cfg, cfg.__dict__.get("_attn_implementation_internal")) for cfg in configs]
    for cfg in configs:
        attention.set_fallback(cfg, cfg._attn_implementation or original)
    model.set_attn_implementation(attention.NAME)
    # each application of a shared block: the layer its KV is kept as
    for (
        path,
        layer,
    ) in cap.attention_layers:
        setattr(model.get_submodule(path), attention.LAYER_ATTR, layer)
    stuck = [cfg for cfg in cap.attention_configs if cfg._attn_implementation != attention.NAME]
    if stuck:  # a sub-model that refused the switch: put everything back and say so
        _restore(model, original, saved)
        if reshard is not None:
            reshard()
        raise capability.UnsupportedModelError(
            f"paged_hf cannot run {model.config.model_type}: the attention implementation of its "
            f"{type(stuck[0]).__name__} could not be switched to {attention.NAME!r}"
        )
    state = PatchState(
        original_attn=original,
        layout=cap.layout,
        saved_implementations=saved,
        attention_configs=cap.attention_configs,
        media_token_ids=cap.media_token_ids,
        limits=dict(cap.limits),
        state=cap.state,
        tp_group=tp_group(model),
        reshard=reshard,
    )
    # engine_for / the patched generate build their engine from the options patch() stores
    state.engine_factory = lambda: Engine(model, state.tokenizer, **state.config)
    setattr(model, STATE_ATTR, state)
    return state


def patch(model: torch.nn.Module, tokenizer: Any = None, **config: Any) -> torch.nn.Module:
    """Turn a transformers causal LM into a continuous-batching generator; returns the model.

    ``config`` takes the fields of ``paged_hf.EngineConfig`` (block_size, num_blocks or
    kv_cache_memory, max_num_seqs, max_num_batched_tokens, enable_prefix_caching, backend, ...).
    The KV cache is allocated on the first ``generate``. A model paged_hf cannot run correctly
    is refused here with ``UnsupportedModelError`` (a ValueError) naming the module and why.
    """
    EngineConfig.from_kwargs(**config)  # fail now on a bad option, not at first generate
    state = ensure_attention_patched(model)
    state.config = dict(config)
    state.engine = None
    state.tokenizer = tokenizer
    model.generate = types.MethodType(paged_generate, model)
    return model


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Restore the original attention implementation and ``generate``; frees the KV cache."""
    state = patch_state(model)
    if state is None:
        raise ValueError("unpatch: this model was not patched by paged_hf")
    busy = [e for e in list(state.engines) if e.is_busy]
    if busy:
        raise RuntimeError(
            f"unpatch: {len(busy)} paged_hf engine(s) still run on this model (unfinished requests, "
            "or a background engine from paged_hf.frontends.serve); let them finish or shut the background "
            "engine down first"
        )
    _restore(model, state.original_attn, state.saved_implementations)
    if state.reshard is not None:
        state.reshard()
    model.__dict__.pop("generate", None)
    delattr(model, STATE_ATTR)
    return model


def _restore(model: torch.nn.Module, original: str, saved: list) -> None:
    """Every config's attention implementation exactly as it was before patch; no fallbacks left."""
    model.set_attn_implementation(original)
    for m in model.modules():
        m.__dict__.pop(attention.LAYER_ATTR, None)
    for cfg, impl in saved:
        cfg._attn_implementation_internal = impl
    for cfg in capability.configs_of(model):
        attention.set_fallback(cfg, None)
    for cfg, _ in saved:
        attention.set_fallback(cfg, None)


def is_patched(model: torch.nn.Module) -> bool:
    return patch_state(model) is not None


class Engine(EngineCore):
    """``paged_hf.Engine(model, tokenizer, **options)``: the engine (paged_hf/engine/core.py) over a
    model, which is checked and switched to paged attention first if it was not patched yet."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any = None,
        *,
        draft_model: torch.nn.Module | None = None,
        **config: Any,
    ) -> None:
        EngineConfig.from_kwargs(**config)  # a bad option fails before the model is touched
        ensure_attention_patched(model)
        super().__init__(model, tokenizer, **config)
        self.use_draft_model(draft_model)

    def use_draft_model(self, draft_model: torch.nn.Module | None) -> None:
        """Requests with ``num_assistant_tokens`` take their drafts from ``draft_model`` (this
        model's tokenizer; transformers' ``assistant_model``), run greedily in an engine of its own
        whose pool holds as many tokens as this one's (its attention is switched to paged
        attention, as ``Engine`` does). None: no draft model."""
        drafter = self.scheduler.drafter
        if draft_model is None or (drafter is not None and drafter.engine.model is draft_model):
            if draft_model is None:
                self.set_draft_model(None)
            return
        draft = Engine(
            draft_model,
            self.tokenizer,
            block_size=self.config.block_size,
            num_blocks=self.kv_manager.pool.num_blocks,
            max_num_seqs=self.config.max_num_seqs,
        )
        draft.warmup()  # its first steps' one-off costs are not what a draft step costs
        draft.calibrate()  # and the cost rule prices draft tokens from the first call
        self.set_draft_model(draft)

    @over_ranks("Engine.beam_search")
    def beam_search(
        self,
        prompts: Sequence[Any],
        num_beams: int = 4,
        max_new_tokens: int = 16,
        *,
        num_return_sequences: int = 1,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        eos_token_ids: Sequence[int] | None = None,
        logits_processors: Sequence[Any] = (),
    ) -> list[list[tuple[list[int], float]]]:
        """Beam search, transformers' own (``generate(num_beams=...)``'s hypotheses and scores),
        each prompt's beams sharing its blocks and batching with everything else. Per prompt, the
        ``num_return_sequences`` best (generated token ids, score), best first.
        ``logits_processors``: transformers ``LogitsProcessor`` s, on the beams' log-probabilities
        as its beam search runs them.

        >>> best = engine.beam_search([[1, 2, 3]], num_beams=4, max_new_tokens=8)
        >>> tokens, score = best[0][0]  # the first prompt's best hypothesis
        """
        if self.kv_manager.state is not None:
            raise NotImplementedError(
                "beam search on a model with recurrent / convolution state layers is not supported"
            )
        if not 1 <= num_return_sequences <= num_beams or num_beams < 2:
            raise ValueError(
                f"num_beams={num_beams} must be >= 2 and num_return_sequences="
                f"{num_return_sequences} in [1, num_beams]"
            )
        ids = [self._prompt_ids("beam search", p) for p in prompts]
        eos = sorted(self.eos_token_ids if eos_token_ids is None else set(eos_token_ids))
        call = search_call(
            self.model,
            ids,
            num_beams,
            max_new_tokens,
            num_return_sequences,
            length_penalty,
            early_stopping,
            eos,
            logits_processors,
        )
        # each prompt one request whose samples are its beams; the call picks every token
        params = SamplingParams(max_new_tokens=max_new_tokens, n=num_beams, ignore_eos=True)

        def add_row(i: int, prompt: list[int]) -> str:
            rid = self.add_request(prompt, params, eos_token_ids=frozenset())
            call.join(self.requests[rid], i * num_beams)
            return rid

        run_rows(self, add_row, ids, call, "paged_hf beam search")
        return call.best(num_return_sequences)


def engine_for(model: torch.nn.Module) -> Engine:
    """The engine behind a patched model's ``generate`` (created on first use)."""
    state = patch_state(model)
    if state is None:
        raise ValueError("this model is not patched; call paged_hf.patch(model) first")
    return state.get_engine()
