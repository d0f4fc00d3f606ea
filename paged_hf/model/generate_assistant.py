"""``generate(assistant_model=...)`` on a patched model: transformers' assisted decoding as the
engine's draft-model speculation (paged_hf/engine/draft_model.py), for every row of the call.

transformers drafts up to the assistant's ``generation_config.num_assistant_tokens`` (20 unless
set) and stops a draft early where the assistant's confidence falls below a threshold; the engine
drafts up to the same number and cuts the length by what its steps cost and what each row's drafts
have been worth (docs/speculative.md). Greedy rows give transformers' greedy tokens; sampled rows
its distribution.

Design notes: docs/speculative.md, paged_hf/model/generate_assistant.py.
"""

from __future__ import annotations

from typing import Any

import torch

from ..requests.sampling_params import SamplingParams

DEFAULT_ASSISTANT_TOKENS = 20  # transformers' GenerationConfig default


def assisted_params(
    params: SamplingParams, gc: Any, assistant_model: torch.nn.Module, joint: bool
) -> SamplingParams:
    """The call's params (of generation config ``gc``) drafting with ``assistant_model``; what
    speculation does not run with is refused by name (``joint``: the call runs transformers'
    criteria or processors)."""
    if not isinstance(assistant_model, torch.nn.Module):
        raise TypeError(
            f"paged_hf generate: assistant_model must be a model, not {type(assistant_model).__name__}"
        )
    if params.prompt_lookup_num_tokens:
        raise ValueError(
            "paged_hf generate: assistant_model and prompt_lookup_num_tokens together: a call "
            "takes its drafts from one proposer"
        )
    for name, plain in (("assistant_ensemble_weight", None), ("speculation_type", None)):
        if getattr(gc, name, plain) != plain:
            raise NotImplementedError(
                f"paged_hf generate: assistant_model with {name}={getattr(gc, name)!r} is not "
                "supported (the engine verifies drafts losslessly)"
            )
    if joint:
        raise NotImplementedError(
            "paged_hf generate: assistant_model with stopping criteria, logits processors, "
            "max_time or transformers-only options is not supported yet (speculation runs the "
            "engine's own rows)"
        )
    own = getattr(assistant_model, "generation_config", None)
    k = getattr(own, "num_assistant_tokens", None) or DEFAULT_ASSISTANT_TOKENS
    assisted = params.with_(num_assistant_tokens=int(k))
    assisted.validate("paged_hf generate")
    return assisted


def use_assistant(engine: Any, assistant_model: torch.nn.Module | None) -> None:
    """The engine drafts with ``assistant_model`` from now on (kept for later calls with it)."""
    if assistant_model is not None:
        engine.use_draft_model(assistant_model)
