"""``model.generate`` after ``patch``: transformers' arguments in, transformers' output out,
run through the continuous-batching engine.

Generation settings resolve exactly as in transformers (the model's generation_config, then
the global defaults, then keyword arguments). What the engine cannot honour raises
NotImplementedError naming the option: never a silently different result.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation.utils import GenerateBeamDecoderOnlyOutput, GenerateDecoderOnlyOutput

from ..engine.beam_group import BeamCallGroup
from ..engine.binding import patch_state
from ..requests.detokenizer import StopStrings
from ..requests.sampling_params import SamplingParams
from .generate_callbacks import plan_call
from .generate_options import REFUSED_SETTINGS

# model.generate(..., paged_hf_json_schema=... | paged_hf_regex=... | paged_hf_choice=[...] | paged_hf_grammar=...)
STRUCTURED_KEYWORDS = ("json_schema", "regex", "choice", "grammar")
_UNSUPPORTED_MODEL_KWARGS = (
    "inputs_embeds",
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
    for name, value in (
        ("assistant_model", assistant_model),
        ("negative_prompt_ids", negative_prompt_ids),
        ("custom_generate", custom_generate),
    ):
        if value is not None and not (isinstance(value, list) and len(value) == 0):
            raise NotImplementedError(
                f"paged_hf generate: {name} is not supported; unpatch the model to use it"
            )
    tokenizer = kwargs.pop("tokenizer", None)  # what stop_strings are read with, as in transformers
    # paged_hf's own keywords (structured outputs: the engine needs a tokenizer, patch(model, tok))
    constraint = {
        name: kwargs.pop(f"paged_hf_{name}")
        for name in STRUCTURED_KEYWORDS
        if f"paged_hf_{name}" in kwargs
    }
    input_ids = kwargs.pop("input_ids", inputs)
    if input_ids is None:
        raise ValueError("paged_hf generate needs input_ids")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    gc, model_kwargs = self._prepare_generation_config(generation_config, **kwargs)
    attention_mask = model_kwargs.pop("attention_mask", None)
    model_kwargs.pop("use_cache", None)
    bad = [k for k in model_kwargs if k in _UNSUPPORTED_MODEL_KWARGS or model_kwargs[k] is not None]
    media = [k for k in bad if k.startswith(_MEDIA_KWARG_PREFIXES)]
    if media:
        raise NotImplementedError(
            f"paged_hf generate: image / video / audio inputs ({', '.join(media)}) are not "
            "supported yet; paged_hf runs the text path of multimodal models (text-only input_ids)"
        )
    if bad:
        raise NotImplementedError(f"paged_hf generate: argument(s) {bad} are not supported")
    refused = [
        f"{name}={getattr(gc, name, None)!r}"
        for name, neutral in REFUSED_SETTINGS.items()
        if getattr(gc, name, None) not in neutral
    ]
    if refused:
        raise NotImplementedError(
            f"paged_hf generate: {', '.join(refused)}: not supported (beam search, assisted "
            "decoding, contrastive search, guidance and watermarking are not)"
        )

    batch, padded_len = input_ids.shape
    eos = gc.eos_token_id
    eos_list = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    pad = gc.pad_token_id if gc.pad_token_id is not None else (eos_list[0] if eos_list else 0)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
        if gc.pad_token_id is not None and gc.pad_token_id not in eos_list:
            attention_mask = (
                input_ids != gc.pad_token_id
            ).long()  # transformers infers it the same way
    params = _sampling_params(gc, padded_len)
    # transformers favours every id of the rows as they are, pad included, and ignores the penalty
    # (with a warning) where an id is negative
    encoder_rows = params.encoder_repetition_penalty != 1.0 and bool((input_ids >= 0).all())
    if params.encoder_repetition_penalty != 1.0 and not encoder_rows:
        warnings.warn(
            "Passing `encoder_repetition_penalty` requires some form of `input_ids` to be passed to "
            "`generate`, ignoring the argument.",
            UserWarning,
            stacklevel=2,
        )
        params = params.with_(encoder_repetition_penalty=1.0)
    if constraint:
        params = params.with_(**constraint)
        params.validate("paged_hf generate")
    stop_strings = gc.stop_strings
    if isinstance(stop_strings, str):
        stop_strings = [stop_strings]
    if stop_strings and tokenizer is None:
        raise ValueError(
            "paged_hf generate: stop_strings need the model's tokenizer: pass it as "
            "generate(..., stop_strings=..., tokenizer=tokenizer), as transformers requires"
        )
    if streamer is not None and batch * params.n != 1:
        raise NotImplementedError("paged_hf generate: a streamer needs a batch of one sequence")
    plan = plan_call(
        self,
        gc,
        input_ids,
        attention_mask,
        params,
        pad,
        eos_list,
        tokenizer,
        logits_processor,
        stopping_criteria,
        prefix_allowed_tokens_fn,
    )
    group, params, eos_list = plan.group, plan.params, plan.eos
    encoder_rows = (
        encoder_rows and not plan.joint
    )  # transformers' own processor does it in a joint call

    state = patch_state(self)
    if state is None:
        raise ValueError(
            "paged_hf generate: this model is not patched (call paged_hf.patch(model))"
        )
    engine = state.get_engine()
    prompts = [
        row[mask.bool()].tolist() for row, mask in zip(input_ids.cpu(), attention_mask.cpu())
    ]
    rids: list[str] = []
    try:  # on any exception (a refused row, Ctrl-C in a notebook) abort what was submitted
        for i, prompt in enumerate(prompts):
            try:  # refuse the whole call before anything runs: a tensor API has no per-row errors
                # stop on the generation config's EOS, as transformers does; stop strings as its
                # StopStringCriteria: on special tokens' text too, and beginning in the prompt
                stops = (
                    StopStrings(
                        tokenizer,
                        stop_strings,
                        include=True,
                        context_ids=prompt,
                        skip_special_tokens=False,
                    )
                    if stop_strings and plan.native_stops
                    else None
                )
                encoder_ids = tuple(input_ids[i].tolist()) if encoder_rows else None
                rids.append(
                    engine._add(
                        engine._new_id(None),
                        prompt,
                        params,
                        frozenset(eos_list),
                        stops,
                        encoder_ids,
                    )
                )
                if group is not None:
                    group.join(engine.requests[rids[-1]], i * params.n)
            except (ValueError, TypeError) as e:
                raise ValueError(f"paged_hf generate: row {i}: {e}") from e
        if streamer is not None:
            streamer.put(input_ids.cpu())
        outputs = engine.run_until_done(
            rids,
            on_token=(lambda _rid, tok: streamer.put(torch.tensor([tok])))
            if streamer is not None
            else None,
        )
        if streamer is not None:
            streamer.end()
    except BaseException:
        engine.abort_all(rids)
        raise
    if (
        group is not None and group.error is not None
    ):  # the caller's criterion raised: so does its call
        raise group.error
    failed = [(i, out.error) for i, out in enumerate(outputs) if out.error is not None]
    if failed:  # a tensor has no per-row errors: the call fails, naming the rows
        raise RuntimeError(
            f"paged_hf generate: {len(failed)} row(s) failed: "
            + "; ".join(f"row {i}: {err}" for i, err in failed[:3])
        )

    if isinstance(group, BeamCallGroup):  # transformers' best hypotheses
        sequences, scores, indices = group.result(gc.num_return_sequences or 1)
        if gc.return_dict_in_generate:
            return GenerateBeamDecoderOnlyOutput(
                sequences=sequences,
                sequences_scores=scores if gc.output_scores else None,
                scores=group.scores,
                logits=group.logits,
                beam_indices=indices,
            )
        return sequences
    if plan.joint:  # its rows as transformers' loop left them, pad after each finished row
        sequences = group.sequences().to(input_ids.device)
        if gc.return_dict_in_generate:
            return GenerateDecoderOnlyOutput(
                sequences=sequences, scores=group.scores, logits=group.logits
            )
        return sequences
    rows = [c.token_ids for out in outputs for c in out.completions]
    width = max(len(r) for r in rows)
    new = torch.full((len(rows), width), pad, dtype=input_ids.dtype)
    for i, r in enumerate(rows):
        new[i, : len(r)] = torch.tensor(r, dtype=input_ids.dtype)
    sequences = torch.cat([input_ids.cpu().repeat_interleave(params.n, dim=0), new], dim=1).to(
        input_ids.device
    )
    if gc.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


def _sampling_params(gc: GenerationConfig, padded_len: int) -> SamplingParams:
    max_new = gc.max_new_tokens if gc.max_new_tokens is not None else gc.max_length - padded_len
    if max_new < 1:
        raise ValueError(
            f"paged_hf generate: max_length={gc.max_length} leaves no room after the "
            f"{padded_len}-token input; set max_new_tokens"
        )
    min_new = (
        gc.min_new_tokens
        if gc.min_new_tokens is not None
        else max(0, (gc.min_length or 0) - padded_len)
    )
    return SamplingParams.from_generation_config(
        gc,
        max_new_tokens=max_new,
        min_new_tokens=min(min_new, max_new),
        n=gc.num_return_sequences or 1,
    )
