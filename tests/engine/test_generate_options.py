"""Every option of transformers' ``generate``, walked: each field of its ``GenerationConfig`` and each
keyword of ``generate`` has a row in paged_hf/model/generate_options.py, docs/generate.md's table is
rendered from it, and each field set to a value that changes transformers' result gives a patched
model transformers' result, or a NotImplementedError naming it. Never a silent difference.

Greedy options are compared token for token (the tiny model's greedy paths here have clear winners:
checked). Sampling options run by transformers' processors on the call's rows draw from torch's
default generator as transformers does: seeded alike, the same tokens. Sampling options the engine's
own sampler runs are checked to reach it (SamplingParams); its draws are checked against
transformers' distributions in tests/unit/test_sampler.py.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from tiny_models import EOS_ID, left_pad, make_tiny_model, tiny_prompts
from transformers import GenerationConfig, GenerationMixin, WatermarkingConfig
from transformers.generation import CompileConfig

import paged_hf
from paged_hf.model import generate_options as options
from paged_hf.model.hf_generate import _sampling_params

MAX_NEW = 8
PAGE = Path(__file__).resolve().parents[2] / "docs" / "generate.md"


def test_every_field_and_keyword_has_a_row():
    rows = options.option_rows()
    fields = set(GenerationConfig().to_dict()) - {"transformers_version", "_from_model_config"}
    assert {name for name in rows if not name.endswith("=")} == fields
    keywords = set(inspect.signature(GenerationMixin.generate).parameters) - {
        "self",
        "inputs",
        "generation_config",
        "kwargs",
        "use_model_defaults",
    }
    assert keywords <= {name[:-1] for name in rows if name.endswith("=")}, keywords


def test_the_options_page_is_current():
    assert options.render_table() in PAGE.read_text(), (
        "python -m paged_hf.model.generate_options_page --page docs/generate.md"
    )


@pytest.fixture(scope="module")
def setup(one_thread):
    reference = make_tiny_model("llama")
    model = paged_hf.patch(make_tiny_model("llama"))
    ids, mask = left_pad(tiny_prompts(reference.config.vocab_size, 3, [4, 7, 11], seed=11))
    width = ids.shape[1]
    base = reference.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=MAX_NEW,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
    )
    for step, scores in enumerate(base.scores):  # clear winners: exact comparisons are fair
        top = scores.topk(2, dim=-1).values
        assert bool((top[:, 0] - top[:, 1] > 1e-3).all()), f"near-tie at step {step}"
    return reference, model, ids, mask, base.sequences[:, width:]


def _values(gen: torch.Tensor) -> dict:
    """A value for each field that changes transformers' result on these prompts (``gen``: its greedy
    tokens), with what else it needs, and whether it samples."""
    first, third = int(gen[0, 0]), int(gen[0, 2])
    return {
        "max_length": dict(max_length=14, max_new_tokens=None),
        "max_new_tokens": dict(max_new_tokens=5),
        "min_length": dict(min_length=15, eos_token_id=third),
        "min_new_tokens": dict(min_new_tokens=5, eos_token_id=third),
        "repetition_penalty": dict(repetition_penalty=1.8),
        "encoder_repetition_penalty": dict(encoder_repetition_penalty=3.0),
        "suppress_tokens": dict(suppress_tokens=[first, int(gen[1, 0])]),
        "begin_suppress_tokens": dict(
            begin_suppress_tokens=[first, int(gen[1, 0]), int(gen[2, 0])]
        ),
        "eos_token_id": dict(eos_token_id=third),
        "pad_token_id": dict(pad_token_id=9, eos_token_id=third),
        "return_dict_in_generate": dict(return_dict_in_generate=True),
        "no_repeat_ngram_size": dict(no_repeat_ngram_size=1),
        "encoder_no_repeat_ngram_size": dict(
            encoder_no_repeat_ngram_size=1, encoder_repetition_penalty=30.0
        ),
        "bad_words_ids": dict(bad_words_ids=[[first]]),
        "sequence_bias": dict(sequence_bias={(first,): -20.0}),
        "forced_eos_token_id": dict(forced_eos_token_id=EOS_ID),
        # on a one-token input only
        "forced_bos_token_id": dict(forced_bos_token_id=7, _ids=[[5], [6], [8]]),
        "exponential_decay_length_penalty": dict(
            exponential_decay_length_penalty=(1, 3.0), eos_token_id=third
        ),
        "remove_invalid_values": dict(remove_invalid_values=True),
        "renormalize_logits": dict(
            renormalize_logits=True, output_scores=True, return_dict_in_generate=True
        ),
        "output_scores": dict(output_scores=True, return_dict_in_generate=True),
        "output_logits": dict(output_logits=True, return_dict_in_generate=True),
        "typical_p": dict(typical_p=0.5, do_sample=True),
        "epsilon_cutoff": dict(epsilon_cutoff=0.01, do_sample=True),
        "eta_cutoff": dict(eta_cutoff=0.9, do_sample=True),
        "top_h": dict(top_h=0.5, do_sample=True),
        "max_time": dict(max_time=0.0),
        # no effect on the result
        "use_cache": dict(use_cache=False),
        "cache_implementation": dict(cache_implementation="static"),
        "max_cache_len": dict(max_cache_len=64),
        "compile_config": dict(compile_config=CompileConfig()),
        "disable_compile": dict(disable_compile=True),
        "low_memory": dict(low_memory=True),
        "prefill_chunk_size": dict(prefill_chunk_size=4),
        "bos_token_id": dict(bos_token_id=1),
        "decoder_start_token_id": dict(decoder_start_token_id=1),
        "num_assistant_tokens": dict(num_assistant_tokens=3),
        "num_assistant_tokens_schedule": dict(num_assistant_tokens_schedule="constant"),
        "assistant_confidence_threshold": dict(assistant_confidence_threshold=0.2),
        "max_matching_ngram_size": dict(max_matching_ngram_size=3),
        "assistant_lookbehind": dict(assistant_lookbehind=5),
        "target_lookbehind": dict(target_lookbehind=5),
        "speculation_type": dict(speculation_type="dflash"),
        # beam search
        "num_beams": dict(num_beams=3),
        "early_stopping": dict(
            num_beams=3, early_stopping=True, eos_token_id=list(range(1, 512, 7)), max_new_tokens=12
        ),
        "length_penalty": dict(num_beams=3, length_penalty=-3.0, eos_token_id=int(gen[1, 1])),
        # refused
        "num_beam_groups": dict(num_beams=2, num_beam_groups=2, diversity_penalty=0.5),
        "diversity_penalty": dict(num_beams=2, num_beam_groups=2, diversity_penalty=0.5),
        "penalty_alpha": dict(penalty_alpha=0.5, top_k=4),
        "force_words_ids": dict(force_words_ids=[[5]]),
        "constraints": dict(constraints=[object()]),
        "guidance_scale": dict(guidance_scale=1.5),
        "prompt_lookup_num_tokens": dict(prompt_lookup_num_tokens=3),
        "assistant_early_exit": dict(assistant_early_exit=1),
        "use_mtp": dict(use_mtp=True),
        "dola_layers": dict(dola_layers="low"),
        "watermarking_config": dict(watermarking_config=WatermarkingConfig(bias=2.5)),
        "token_healing": dict(token_healing=True),
        "output_attentions": dict(output_attentions=True, return_dict_in_generate=True),
        "output_hidden_states": dict(output_hidden_states=True, return_dict_in_generate=True),
    }


# where the walk checks something else than the result of one greedy call
ENGINE_SAMPLING = {
    "do_sample": dict(do_sample=True),
    "temperature": dict(do_sample=True, temperature=0.5),
    "top_k": dict(do_sample=True, top_k=5),
    "top_p": dict(do_sample=True, top_p=0.5),
    "min_p": dict(do_sample=True, min_p=0.2),
    "num_return_sequences": dict(do_sample=True, num_return_sequences=2),
}
ELSEWHERE = {  # field: the test that checks it
    "stop_strings": "tests/unit/test_stop_strings.py (with the tokenizer it needs)",
    "cache_config": "no value changes transformers' result without a cache implementation that reads it",
    "continuous_batching_config": "transformers' own continuous batching only (generate_batch)",
    "is_assistant": "set by transformers on an assistant model's config",
    "assistant_ensemble_weight": "needs an assistant model",
}
UNCHANGED_HERE = {
    "remove_invalid_values": "the tiny model's logits are finite (tests/engine/test_generate_processors.py)"
}


def _both(reference, model, ids, mask, kwargs):
    kwargs = dict(kwargs)
    if "_ids" in kwargs:
        ids = torch.tensor(kwargs.pop("_ids"))
        mask = torch.ones_like(ids)
    out = {}
    for who, m in (("ours", model), ("theirs", reference)):
        kw = dict(max_new_tokens=MAX_NEW, do_sample=False) | kwargs
        torch.manual_seed(0)
        try:
            out[who] = m.generate(ids, attention_mask=mask, **kw)
        except Exception as e:  # noqa: BLE001
            out[who] = e
    return out["ours"], out["theirs"]


@pytest.mark.parametrize(
    "field",
    sorted(set(options.option_rows()) - {n for n in options.option_rows() if n.endswith("=")}),
)
def test_each_field_is_transformers_or_refused(setup, field):
    reference, model, ids, mask, gen = setup
    how, _ = options.option_rows()[field]
    if field in ELSEWHERE:
        return
    if field in ENGINE_SAMPLING:  # reaches the engine's sampler
        gc = GenerationConfig(max_new_tokens=MAX_NEW, **ENGINE_SAMPLING[field])
        assert (
            _sampling_params(gc, 4)
            != _sampling_params(
                GenerationConfig(
                    max_new_tokens=MAX_NEW, do_sample=True, top_k=0, top_p=1.0, temperature=1.0
                ),
                4,
            )
            or field == "do_sample"
        )
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=MAX_NEW, **ENGINE_SAMPLING[field]
        )
        assert out.shape[0] == ids.shape[0] * ENGINE_SAMPLING[field].get("num_return_sequences", 1)
        return
    kwargs = _values(gen)[field]
    ours, theirs = _both(reference, model, ids, mask, kwargs)
    if how == options.REFUSED:
        assert isinstance(ours, NotImplementedError) and field in str(ours), ours
        return
    assert not isinstance(theirs, Exception), f"pick a value transformers runs: {theirs!r}"
    assert not isinstance(ours, Exception), f"{field}: {ours!r}"
    ours_seq = ours.sequences if hasattr(ours, "sequences") else ours
    theirs_seq = theirs.sequences if hasattr(theirs, "sequences") else theirs
    assert torch.equal(ours_seq, theirs_seq), (
        f"{field}: {ours_seq[:, ids.shape[1] :]} vs {theirs_seq[:, ids.shape[1] :]}"
    )
    # against the same call without the field
    if how != options.NO_EFFECT and field not in UNCHANGED_HERE:
        plain, _ = _both(
            reference, reference, ids, mask, {k: v for k, v in kwargs.items() if k != field}
        )
        plain = plain.sequences if hasattr(plain, "sequences") else plain
        changed = not torch.equal(theirs_seq, plain) or any(
            hasattr(theirs, k) and getattr(theirs, k) is not None for k in ("scores", "logits")
        )
        assert changed or field == "return_dict_in_generate", f"{field}: the value tests nothing"
    for name in ("scores", "logits"):
        if getattr(theirs, name, None) is not None:
            for a, b in zip(getattr(ours, name), getattr(theirs, name), strict=True):
                finite = torch.isfinite(b)
                assert (
                    torch.equal(torch.isfinite(a), finite)
                    and float((a[finite] - b[finite]).abs().max()) < 1e-4
                )
