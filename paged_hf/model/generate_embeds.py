"""``inputs_embeds`` on a patched ``generate`` (soft prompts, prompt tuning, code that builds its
own embeddings): the prompt's positions enter the forward as the given embeddings, the generated
tokens through the model's embedding layer, as transformers' ``generate`` runs them.

Given alone, the prompt has no token ids: its requests carry placeholders (they only count its
length; the prefix cache keys such a prompt by its embeddings' bytes), and the result holds only
the new tokens, as transformers returns it; what would read the prompt's ids (the repetition
penalties, logits processors, stopping criteria, beams) is refused by name. Given beside
``input_ids`` of the same length, everything runs as with ``input_ids`` alone. PEFT's prompt
learning sets its own ``prepare_inputs_for_generation`` on the base model for the call: what it
makes of the prompt (the virtual tokens' embeddings, then the prompt's) is the prompt here, and the
result shows ``input_ids`` as given, as PEFT's ``generate`` returns them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

PLACEHOLDER = 0  # a request's token id at a position given as an embedding (never shown)


@dataclass
class PromptEmbeds:
    embeds: torch.Tensor  # [batch, positions, hidden]: what the forward takes at the prompt
    shown: torch.Tensor  # [batch, shown width]: the prompt rows the result and callbacks show
    shown_mask: torch.Tensor
    hook: bool = False  # made by the model's own prepare_inputs_for_generation (PEFT)


def read(
    input_ids: torch.Tensor | None, embeds: Any, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, PromptEmbeds]:
    """(the requests' token rows, their attention mask, the embeddings) of a call given
    ``inputs_embeds``."""
    if not isinstance(embeds, torch.Tensor) or embeds.dim() != 3:
        raise ValueError(
            "paged_hf generate: inputs_embeds must be a [batch, tokens, hidden] tensor"
        )
    if mask is None:
        mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
    if input_ids is None:
        rows = torch.full(embeds.shape[:2], PLACEHOLDER, dtype=torch.long, device=embeds.device)
        return rows, mask, PromptEmbeds(embeds, rows[:, :0], mask[:, :0])
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if tuple(input_ids.shape) != tuple(embeds.shape[:2]):
        raise NotImplementedError(
            f"paged_hf generate: input_ids {tuple(input_ids.shape)} beside inputs_embeds "
            f"{tuple(embeds.shape)}: not supported unless they cover the same positions"
        )
    return input_ids, mask, PromptEmbeds(embeds, input_ids, mask)


def from_generation_hook(
    model: torch.nn.Module, input_ids: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, PromptEmbeds] | None:
    """What a ``prepare_inputs_for_generation`` set on the model itself (not its class's) makes of
    the prompt, where it makes embeddings of it; None where it leaves the prompt's ids as they are.
    A hook that fills the cache instead (PEFT's prefix tuning) is refused by name."""
    hook = model.__dict__.get("prepare_inputs_for_generation")
    if hook is None:
        return None
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    made = hook(input_ids, attention_mask=mask, cache_position=positions, use_cache=True)
    if made.get("past_key_values") is not None or made.get("cache") is not None:
        raise NotImplementedError(
            "paged_hf generate: this model's prepare_inputs_for_generation fills the KV cache "
            "(PEFT's prefix tuning): not supported on a patched model; unpatch it to use it"
        )
    embeds = made.get("inputs_embeds")
    if embeds is None:
        ids = made.get("input_ids")
        if ids is not None and not torch.equal(ids, input_ids):
            raise NotImplementedError(
                "paged_hf generate: this model's prepare_inputs_for_generation changes the "
                "prompt's ids: not supported on a patched model; unpatch it to use it"
            )
        return None
    new_mask = made.get("attention_mask")
    new_mask = torch.ones(embeds.shape[:2], dtype=torch.long) if new_mask is None else new_mask
    new_mask = new_mask.to(input_ids.device).long()
    rows = torch.full(embeds.shape[:2], PLACEHOLDER, dtype=torch.long, device=input_ids.device)
    rows[:, embeds.shape[1] - input_ids.shape[1] :] = input_ids  # PEFT: its tokens, then the ids
    return rows, new_mask, PromptEmbeds(embeds.detach(), input_ids, mask, hook=True)


def refuse_reading_the_prompt(prompt: PromptEmbeds | None, params: Any, has_call: bool) -> None:
    """Options that read the prompt's token ids, where its requests hold placeholders."""
    if prompt is None or (prompt.shown.shape[1] and not prompt.hook):
        return
    reading = [
        name
        for name in ("repetition_penalty",)
        + (() if prompt.hook else ("encoder_repetition_penalty",))
        if getattr(params, name) != 1.0
    ]
    if has_call and not prompt.hook:
        reading.append("logits processors, stopping criteria, scores or beams")
    if reading:
        what = "a prompt-learning model" if prompt.hook else "inputs_embeds without input_ids"
        raise NotImplementedError(
            f"paged_hf generate: {what} and {', '.join(reading)}: not supported (they read the "
            "prompt's token ids, which its embeddings stand in for); unpatch the model to use it"
        )
