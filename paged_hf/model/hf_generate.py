"""``model.generate`` after ``patch``: transformers' arguments in, transformers' output out,
run through the continuous-batching engine.

Generation settings resolve exactly as in transformers (the model's generation_config, then
the global defaults, then keyword arguments). What the engine cannot honour raises
NotImplementedError naming the option: never a silently different result.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..engine.binding import patch_state
from ..engine.ranks import digest
from ..requests.detokenizer import StopStrings
from ..requests.sampling_params import SamplingParams
from . import generate_embeds
from .generate_assistant import assisted_params, use_assistant
from .generate_callbacks import CallPlan, plan_call
from .generate_hidden_states import as_transformers_returns
from .generate_options import REFUSED_SETTINGS
from .run_rows import run_rows

logger = logging.getLogger("paged_hf")

# model.generate(..., paged_hf_json_schema=... | paged_hf_regex=... | paged_hf_choice=[...] | paged_hf_grammar=...)
STRUCTURED_KEYWORDS = ("json_schema", "regex", "choice", "grammar")
_UNSUPPORTED_MODEL_KWARGS = (
    "past_key_values",
    "cache",
    "position_ids",
    "token_type_ids",
    "cache_position",
    "decoder_input_ids",
)
# keyword arguments that carry media for multimodal models (pixel_values, image_grid_thw, input_features, ...)
_MEDIA_KWARG_PREFIXES = (
    "pixel_values",
    "image_",
    "video_",
    "audio_",
    "input_features",
    "mm_token_type_ids",
)


@dataclass
class _Call:
    """One ``generate`` call as read: its rows and settings, before any request exists."""

    input_ids: torch.Tensor  # [batch, padded length]
    attention_mask: torch.Tensor
    gc: GenerationConfig
    params: SamplingParams
    pad: int
    eos: list[int]
    tokenizer: Any  # what stop_strings are read with, as in transformers
    stop_strings: list[str] | None
    encoder_rows: bool  # encoder_repetition_penalty favours each row's own ids, pad included
    embeds: generate_embeds.PromptEmbeds | None = None  # inputs_embeds, where given

    @property
    def shown_ids(self) -> torch.Tensor:
        """The prompt rows the result and the callbacks show (none for inputs_embeds alone)."""
        return self.input_ids if self.embeds is None else self.embeds.shown

    @property
    def shown_mask(self) -> torch.Tensor:
        return self.attention_mask if self.embeds is None else self.embeds.shown_mask


def paged_generate(
    self: torch.nn.Module,
    inputs: torch.Tensor | None = None,
    generation_config: GenerationConfig | None = None,
    logits_processor: Any = None,
    stopping_criteria: Any = None,
    prefix_allowed_tokens_fn: Any = None,
    synced_gpus: Any = None,
    assistant_model: Any = None,
    streamer: Any = None,
    negative_prompt_ids: Any = None,
    negative_prompt_attention_mask: Any = None,
    custom_generate: Any = None,
    **kwargs: Any,
) -> torch.Tensor | GenerateDecoderOnlyOutput:
    """transformers' ``generate`` on the engine: each row a request, the result as transformers
    returns it; refused before anything runs where the engine cannot honour an option."""
    _refuse_arguments(
        negative_prompt_ids=negative_prompt_ids,
        negative_prompt_attention_mask=negative_prompt_attention_mask,
        custom_generate=custom_generate,
    )
    call = _read_call(self, inputs, generation_config, kwargs)
    if streamer is not None and call.input_ids.shape[0] * call.params.n != 1:
        raise NotImplementedError("paged_hf generate: a streamer needs a batch of one sequence")
    plan = plan_call(
        self,
        call.gc,
        call.shown_ids,
        call.shown_mask,
        call.params,
        call.pad,
        call.eos,
        call.tokenizer,
        logits_processor,
        stopping_criteria,
        prefix_allowed_tokens_fn,
    )
    generate_embeds.refuse_reading_the_prompt(call.embeds, call.params, plan.call is not None)
    if call.params.prompt_lookup_num_tokens and plan.call is not None:
        raise NotImplementedError(
            "paged_hf generate: prompt_lookup_num_tokens with stopping criteria, logits "
            "processors, max_time or transformers-only options is not supported yet (speculation "
            "runs the engine's own greedy rows)"
        )
    # transformers' own processor applies the encoder penalty in a joint call
    call.params, call.eos = plan.params, plan.eos
    if assistant_model is not None:
        call.params = assisted_params(call.params, call.gc, assistant_model, plan.call is not None)
    call.encoder_rows = call.encoder_rows and not plan.joint
    state = patch_state(self)
    if state is None:
        raise ValueError(
            "paged_hf generate: this model is not patched (call paged_hf.patch(model))"
        )
    engine = state.get_engine()
    use_assistant(engine, assistant_model)
    if engine.ranks is None:
        return _run_call(engine, call, plan, streamer)
    if call.embeds is not None:
        raise NotImplementedError(
            "paged_hf generate: inputs_embeds under tensor parallelism is not supported yet"
        )
    # every rank called alike (SPMD): the leader runs the call, the others its forwards
    same = digest(call.input_ids, call.attention_mask, call.params, sorted(kwargs))
    run = lambda: _run_call(engine, call, plan, streamer)  # noqa: E731
    return engine.ranks.run("model.generate", same, run, engine.runner)


def _run_call(
    engine: Any, call: _Call, plan: CallPlan, streamer: Any
) -> torch.Tensor | GenerateDecoderOnlyOutput:
    """The call's rows through the engine, and transformers' result of them."""
    prompts = [
        row[mask.bool()].tolist()
        for row, mask in zip(call.input_ids.cpu(), call.attention_mask.cpu())
    ]
    outputs = run_rows(
        engine,
        lambda i, prompt: _add_row(engine, call, plan, i, prompt),
        prompts,
        plan.call,
        "paged_hf generate",
        streamer,
        call.shown_ids,
    )
    result = _result(call, plan, outputs)
    if call.params.output_hidden_states:
        result.hidden_states = as_transformers_returns(
            outputs, call.attention_mask, result.sequences.shape[1] - call.shown_ids.shape[1]
        )
    return result


def _refuse_arguments(**arguments: Any) -> None:
    """generate's own arguments the engine does not run, refused by name where given."""
    for name, value in arguments.items():
        if value is not None and not (isinstance(value, list) and len(value) == 0):
            raise NotImplementedError(
                f"paged_hf generate: {name} is not supported; unpatch the model to use it"
            )


def _read_call(
    model: torch.nn.Module, inputs: Any, generation_config: Any, kwargs: dict[str, Any]
) -> _Call:
    """The call's rows and settings, resolved as transformers resolves them; what the engine
    cannot honour raises NotImplementedError naming it."""
    tokenizer = kwargs.pop("tokenizer", None)
    # paged_hf's own keywords (structured outputs: the engine needs a tokenizer, patch(model, tok))
    constraint = {
        name: kwargs.pop(f"paged_hf_{name}")
        for name in STRUCTURED_KEYWORDS
        if f"paged_hf_{name}" in kwargs
    }
    input_ids = kwargs.pop("input_ids", inputs)
    embeds = kwargs.pop("inputs_embeds", None)
    if input_ids is None and embeds is None:
        raise ValueError("paged_hf generate needs input_ids or inputs_embeds")
    if input_ids is not None and input_ids.dim() == 1:
        input_ids = input_ids[None]
    unset = _unset_lengths(model, generation_config, kwargs)
    gc, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    attention_mask = model_kwargs.pop("attention_mask", None)
    model_kwargs.pop("use_cache", None)
    model_kwargs.pop("output_hidden_states", None)  # the config's, read below
    _refuse_model_kwargs(model_kwargs)
    hidden = _refuse_settings(gc)
    eos = gc.eos_token_id
    eos_list = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    pad = gc.pad_token_id if gc.pad_token_id is not None else (eos_list[0] if eos_list else 0)
    input_ids, attention_mask, prompt = _prompt_rows(
        model, gc, input_ids, embeds, attention_mask, eos_list
    )
    shown = input_ids if prompt is None else prompt.shown
    _warn_right_padding(attention_mask if prompt is None else prompt.shown_mask)
    _resolve_lengths(
        model, gc, shown, unset, None if prompt is None or prompt.hook else prompt.embeds
    )
    params = _sampling_params(gc, shown.shape[1]).with_(output_hidden_states=hidden)
    # transformers favours every id of the rows as they are, pad included, and ignores the penalty
    # (with a warning) where an id is negative
    encoder_rows = params.encoder_repetition_penalty != 1.0 and bool((shown >= 0).all())
    if params.encoder_repetition_penalty != 1.0 and not encoder_rows:
        warnings.warn(
            "Passing `encoder_repetition_penalty` requires some form of `input_ids` to be passed to "
            "`generate`, ignoring the argument.",
            UserWarning,
            stacklevel=3,
        )
        params = params.with_(encoder_repetition_penalty=1.0)
    if constraint:
        params = params.with_(**constraint)
        params.validate("paged_hf generate")
    stop_strings = [gc.stop_strings] if isinstance(gc.stop_strings, str) else gc.stop_strings
    if stop_strings and tokenizer is None:
        raise ValueError(
            "paged_hf generate: stop_strings need the model's tokenizer: pass it as "
            "generate(..., stop_strings=..., tokenizer=tokenizer), as transformers requires"
        )
    return _Call(
        input_ids,
        attention_mask,
        gc,
        params,
        pad,
        eos_list,
        tokenizer,
        stop_strings,
        encoder_rows,
        prompt,
    )


def _unset_lengths(
    model: torch.nn.Module, generation_config: Any, kwargs: dict[str, Any]
) -> dict[str, bool]:
    """Whether a length was set anywhere, read before the defaults fill it in (transformers: an
    unset max_length means 20 *new* tokens, capped by max_position_embeddings)."""
    return {
        name: kwargs.get(name) is None
        and getattr(generation_config, name, None) is None
        and getattr(model.generation_config, name, None) is None
        for name in ("max_length", "min_length")
    }


def _refuse_settings(gc: GenerationConfig) -> bool:
    """Raise NotImplementedError naming what the engine cannot run; whether the call asks for
    hidden states (transformers returns them only in its output dict)."""
    refused = [
        f"{name}={getattr(gc, name, None)!r}"
        for name, neutral in REFUSED_SETTINGS.items()
        if getattr(gc, name, None) not in neutral
    ]
    hidden = bool(gc.output_hidden_states and gc.return_dict_in_generate)
    if hidden and ((gc.num_beams or 1) > 1 or (gc.num_return_sequences or 1) > 1):
        refused.append(
            "output_hidden_states=True with num_beams > 1 or num_return_sequences > 1 (one "
            "sequence a prompt)"
        )
    if refused:
        raise NotImplementedError(
            f"paged_hf generate: {', '.join(refused)}: not supported on a patched model (its "
            "generate runs greedy search, sampling and beam search; docs/generate.md lists what "
            "runs); paged_hf.unpatch(model) gives transformers' own generate"
        )
    return hidden


def _prompt_rows(
    model: torch.nn.Module,
    gc: GenerationConfig,
    input_ids: torch.Tensor | None,
    embeds: Any,
    attention_mask: torch.Tensor | None,
    eos: list[int],
) -> tuple[torch.Tensor, torch.Tensor, generate_embeds.PromptEmbeds | None]:
    """(the requests' token rows, their mask, the prompt's embeddings where it has some)."""
    if embeds is not None:
        return generate_embeds.read(input_ids, embeds, attention_mask)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
        if gc.pad_token_id is not None and gc.pad_token_id not in eos:
            # transformers infers it the same way
            attention_mask = (input_ids != gc.pad_token_id).long()
    hooked = generate_embeds.from_generation_hook(model, input_ids, attention_mask)
    return hooked if hooked is not None else (input_ids, attention_mask, None)


def _refuse_model_kwargs(model_kwargs: dict[str, Any]) -> None:
    bad = [k for k in model_kwargs if k in _UNSUPPORTED_MODEL_KWARGS or model_kwargs[k] is not None]
    media = [k for k in bad if k.startswith(_MEDIA_KWARG_PREFIXES)]
    if media:
        raise NotImplementedError(
            f"paged_hf generate: image / video / audio inputs ({', '.join(media)}) are not "
            "supported yet; paged_hf runs the text path of multimodal models (text-only input_ids)"
        )
    if bad:
        raise NotImplementedError(f"paged_hf generate: argument(s) {bad} are not supported")


def _add_row(engine: Any, call: _Call, plan: CallPlan, i: int, prompt: list[int]) -> str:
    """Row ``i`` as a request; a refused row refuses the whole call before anything runs (a
    tensor API has no per-row errors)."""
    try:
        # stop on the generation config's EOS, as transformers does; stop strings as its
        # StopStringCriteria: on special tokens' text too, and beginning in the prompt
        stops = None
        if call.stop_strings and plan.native_stops:
            shown = call.shown_ids[i][call.shown_mask[i].bool()].tolist()
            stops = StopStrings(
                call.tokenizer,
                call.stop_strings,
                include=True,
                context_ids=shown,
                skip_special_tokens=False,
            )
        rid = engine.add_request(
            prompt,
            call.params,
            eos_token_ids=frozenset(call.eos),
            stop_strings=stops,
            encoder_token_ids=tuple(call.shown_ids[i].tolist()) if call.encoder_rows else None,
            prompt_embeds=None
            if call.embeds is None
            else call.embeds.embeds[i][call.attention_mask[i].bool()],
        )
        if plan.call is not None:
            plan.call.join(engine.requests[rid], i * call.params.n)
        return rid
    except (ValueError, TypeError) as e:
        raise ValueError(f"paged_hf generate: row {i}: {e}") from e


def _result(call: _Call, plan: CallPlan, outputs: list) -> torch.Tensor | GenerateDecoderOnlyOutput:
    """The call's sequences (prompt rows as given, then the new tokens, pad after each row's
    end), as a tensor or transformers' output dict."""
    gc, input_ids = call.gc, call.shown_ids
    if plan.joint:  # the call picked its rows' tokens: its result is its own, as transformers'
        return plan.call.output(gc)
    rows = [c.token_ids for out in outputs for c in out.completions]
    width = max(len(r) for r in rows)
    new = torch.full((len(rows), width), call.pad, dtype=input_ids.dtype)
    for i, r in enumerate(rows):
        new[i, : len(r)] = torch.tensor(r, dtype=input_ids.dtype)
    prompts = input_ids.cpu().repeat_interleave(call.params.n, dim=0)
    sequences = torch.cat([prompts, new], dim=1).to(input_ids.device)
    if gc.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


def _warn_right_padding(attention_mask: torch.Tensor) -> None:
    """Pads after a row's tokens (a tokenizer left at padding_side="right"): each row continues
    after its own last token here, where transformers continues after the pads (and warns). The
    caller is told, every call."""
    mask = attention_mask.detach().cpu().long()
    rows = ((mask.cummax(dim=1).values - mask) > 0).any(dim=1).nonzero().flatten().tolist()
    if rows:
        logger.warning(
            "paged_hf generate: right padding in row(s) %s: each row continues after its own last "
            "token, where transformers' generate continues after the pads (a different result); "
            "set tokenizer.padding_side = 'left' to match it",
            rows[:8],
        )


def _resolve_lengths(
    model: torch.nn.Module,
    gc: GenerationConfig,
    input_ids: torch.Tensor,
    unset: dict[str, bool],
    embeds: torch.Tensor | None = None,
) -> None:
    """max_length / min_length as transformers' own generate sets them, by its own code: with
    max_new_tokens / min_new_tokens taking precedence, and an unset max_length as 20 new tokens;
    its warnings and its error for an input that leaves no room. ``input_ids``: the rows the
    result shows (none, for inputs_embeds alone: the lengths count new tokens only)."""
    length = input_ids.shape[1]
    model._prepare_generated_length(
        generation_config=gc,
        has_default_max_length=unset["max_length"],
        has_default_min_length=unset["min_length"],
        model_input_name="input_ids" if embeds is None else "inputs_embeds",
        input_ids_length=length,
        inputs_tensor=input_ids if embeds is None else embeds,
    )
    model._validate_generated_length(gc, length, unset["max_length"])


def _sampling_params(gc: GenerationConfig, padded_len: int) -> SamplingParams:
    """``gc`` with its lengths resolved (_resolve_lengths): max_length and min_length are totals."""
    max_new = gc.max_length - padded_len
    if max_new < 1:
        raise ValueError(
            f"paged_hf generate: max_length={gc.max_length} leaves no room after the "
            f"{padded_len}-token input; set max_new_tokens"
        )
    min_new = max(0, (gc.min_length or 0) - padded_len)
    return SamplingParams.from_generation_config(
        gc,
        max_new_tokens=max_new,
        min_new_tokens=min(min_new, max_new),
        n=gc.num_return_sequences or 1,
    )
