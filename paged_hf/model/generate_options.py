"""What a patched ``generate`` does with each of transformers' generation options, in one table.

Design notes: docs/internals.md, paged_hf/model/generate_options.py.
"""

from __future__ import annotations

ENGINE = "the engine's sampler"
CALLBACKS = "transformers' processors and criteria on the call's rows"
CRITERIA = "transformers' criteria on the call's rows"
REFUSED = "refused (NotImplementedError)"
NO_EFFECT = "no effect on the result (as in transformers)"

# the engine's own sampler and scheduler: mapped into SamplingParams (SamplingParams.from_generation_config)
ENGINE_SETTINGS = (
    "max_length",
    "max_new_tokens",
    "min_length",
    "min_new_tokens",
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "encoder_repetition_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
    "num_return_sequences",
    "eos_token_id",
    "pad_token_id",
    "stop_strings",
    "return_dict_in_generate",
)
# speculative decoding inside the engine (paged_hf/engine/speculation.py): rows of a call without
# callbacks; greedy, the same tokens up to near-ties; sampled, the same distribution
SPECULATION_SETTINGS = ("prompt_lookup_num_tokens", "max_matching_ngram_size")
SPECULATION_NOTE = "without criteria or processors; docs/speculative.md"
# transformers' own processor classes, run by a joint call group; with the value at which each does nothing
JOINT_SETTINGS = {
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "sequence_bias": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "exponential_decay_length_penalty": None,
    "remove_invalid_values": False,
    "renormalize_logits": False,
}
JOINT_SAMPLING_SETTINGS = {
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "top_h": None,
}  # with do_sample
JOINT_OUTPUTS = ("output_scores", "output_logits")  # with return_dict_in_generate
# recorded by the engine for the rows that ask (with return_dict_in_generate; one sequence a prompt)
ENGINE_OUTPUTS = ("output_hidden_states",)
# beam search: transformers' own, on shared blocks
BEAM_SETTINGS = (
    "num_beams",
    "early_stopping",
    "length_penalty",
)
CRITERIA_SETTINGS = ("max_time",)
# changes the result, not run here; with the values at which transformers does nothing
REFUSED_SETTINGS = {
    "num_beam_groups": (1,),
    "diversity_penalty": (0.0,),
    "penalty_alpha": (None, 0.0),
    "force_words_ids": (None,),
    "constraints": (None,),
    "guidance_scale": (None, 1.0),
    "assistant_early_exit": (None,),
    "use_mtp": (None, False),
    "dola_layers": (None,),
    "watermarking_config": (None,),
    "token_healing": (None, False),
    "output_attentions": (False,),
}
# what transformers itself does with them for a decoder-only model given input_ids: nothing to the result
NO_EFFECT_SETTINGS = {
    "use_cache": "the cache is paged_hf's",
    "cache_implementation": "the cache is paged_hf's",
    "cache_config": "the cache is paged_hf's",
    "max_cache_len": "the cache is paged_hf's",
    "compile_config": "speed only",
    "disable_compile": "speed only",
    "low_memory": "speed only",
    "prefill_chunk_size": "speed only",
    "continuous_batching_config": "transformers' own batching",
    "bos_token_id": "used without input_ids only",
    "decoder_start_token_id": "encoder-decoder models only",
    "is_assistant": "speed only; assisted decoding reads the assistant's own config",
    "num_assistant_tokens": "speed only; assisted decoding reads the assistant's own config",
    "num_assistant_tokens_schedule": "speed only; assisted decoding reads the assistant's own config",
    "assistant_confidence_threshold": "speed only; assisted decoding reads the assistant's own config",
    "assistant_lookbehind": "speed only; assisted decoding reads the assistant's own config",
    "target_lookbehind": "speed only; assisted decoding reads the assistant's own config",
    "assistant_ensemble_weight": "assisted decoding only; refused with assistant_model",
    "speculation_type": "assisted decoding only; refused with assistant_model",
}
# generate's own keywords: (how, note)
KEYWORDS = {
    "stopping_criteria": (CRITERIA, ""),
    "logits_processor": (CALLBACKS, ""),
    "prefix_allowed_tokens_fn": (CALLBACKS, ""),
    "tokenizer": (ENGINE, "for stop_strings"),
    "streamer": (ENGINE, "one sequence"),
    "attention_mask": (ENGINE, ""),
    "assistant_model": (ENGINE, SPECULATION_NOTE),
    "negative_prompt_ids": (REFUSED, ""),
    "negative_prompt_attention_mask": (REFUSED, ""),
    "custom_generate": (REFUSED, ""),
    "synced_gpus": (NO_EFFECT, "one process"),
}


def option_rows() -> dict[str, tuple[str, str]]:
    """option -> (how it runs, the note)."""
    rows: dict[str, tuple[str, str]] = {}
    rows.update((name, (ENGINE, "")) for name in ENGINE_SETTINGS)
    rows.update((name, (ENGINE, SPECULATION_NOTE)) for name in SPECULATION_SETTINGS)
    rows.update((name, (CALLBACKS, "")) for name in JOINT_SETTINGS)
    rows.update((name, (CALLBACKS, "with do_sample")) for name in JOINT_SAMPLING_SETTINGS)
    rows.update((name, (CALLBACKS, "with return_dict_in_generate")) for name in JOINT_OUTPUTS)
    rows.update(
        (name, (ENGINE, "with return_dict_in_generate; not with beams or n > 1"))
        for name in ENGINE_OUTPUTS
    )
    rows.update(
        (name, (CALLBACKS, "beam search" if name == "num_beams" else "with num_beams > 1"))
        for name in BEAM_SETTINGS
    )
    rows.update((name, (CRITERIA, "")) for name in CRITERIA_SETTINGS)
    rows.update(
        (name, (REFUSED, "accepted at " + " / ".join(map(repr, neutral))))
        for name, neutral in REFUSED_SETTINGS.items()
    )
    rows.update((name, (NO_EFFECT, why)) for name, why in NO_EFFECT_SETTINGS.items())
    rows.update((f"{name}=", how_note) for name, how_note in KEYWORDS.items())
    return rows


TABLE_START = "<!-- generate-options:start (python -m paged_hf.model.generate_options_page --page docs/generate.md) -->"
TABLE_END = "<!-- generate-options:end -->"


def render_table() -> str:
    by_kind: dict[str, list[str]] = {}
    for name, (how, note) in option_rows().items():
        by_kind.setdefault(how, []).append(f"`{name}`" + (f" ({note})" if note else ""))
    lines = [TABLE_START, "", "| how it runs | options |", "| --- | --- |"]
    lines += [f"| {how} | {', '.join(names)} |" for how, names in by_kind.items()]
    return "\n".join(lines + ["", TABLE_END])
