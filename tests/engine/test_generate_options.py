"""Every option of transformers' ``generate``, walked: each field of its ``GenerationConfig`` and each
keyword of ``generate`` has a row in paged_hf/model/generate_options.py, docs/generate.md's table is
rendered from it, and each field, set to a value that changes transformers' result, gives a patched
model transformers' result or a NotImplementedError naming it; never a silent difference. Each
field is set in each place a value comes from (a keyword, a passed ``GenerationConfig``, the
model's ``generation_config`` edited in place) and left unset (transformers' defaults: an unset
``max_length`` is 20 *new* tokens).

Greedy options are compared token for token (the tiny model's greedy paths here have clear winners:
checked). Sampling options run by transformers' processors on the call's rows draw from torch's
default generator as transformers does: seeded alike, the same tokens. Sampling options the engine's
own sampler runs are compared as distributions: the one the engine draws from for the call's
resolved settings against the one transformers' own processors for the same call give (its draws
against those distributions: tests/unit/test_sampler.py).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from oracle import assert_hidden_states_close
from tiny_models import EOS_ID, left_pad, make_tiny_model, tiny_prompts
from tiny_tokenizer import make_tiny_tokenizer
from transformers import (
    ContinuousBatchingConfig,
    GenerationConfig,
    GenerationMixin,
    WatermarkingConfig,
)
from transformers.generation import CompileConfig

import paged_hf
from paged_hf.execution.sampler import drawn_probs
from paged_hf.model import generate_options as options

MAX_NEW = 8
DEFAULT_NEW = 20  # transformers' new tokens where no length is set anywhere
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
    base = reference.generate(  # 20 new tokens: the unset max_length's, longer than the walk's
        ids,
        attention_mask=mask,
        max_new_tokens=DEFAULT_NEW,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
    )
    for step, scores in enumerate(base.scores):  # clear winners: exact comparisons are fair
        top = scores.topk(2, dim=-1).values
        assert bool((top[:, 0] - top[:, 1] > 1e-3).all()), f"near-tie at step {step}"
    return reference, model, ids, mask, base.sequences[:, width:]


def _stop_string(gen: torch.Tensor, tok) -> str:
    """Text of one of row 0's greedy tokens past its first, clean (whole characters) on its own."""
    for j in range(1, MAX_NEW - 1):
        text = tok.decode([int(gen[0, j])])
        if text.strip() and "\ufffd" not in text:
            return text
    raise AssertionError("no clean token text to stop on")


def _values(gen: torch.Tensor, tok) -> dict:
    """A value for each field that changes transformers' result on these prompts (``gen``: its greedy
    tokens), with what else it needs. ``_ids``: other prompts; ``_keywords``: generate keywords."""
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
        "stop_strings": dict(stop_strings=[_stop_string(gen, tok)], _keywords={"tokenizer": tok}),
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
        # speculation: transformers runs it on one row; a prompt whose tail recurs
        "max_matching_ngram_size": dict(
            prompt_lookup_num_tokens=3, max_matching_ngram_size=3, _ids=LOOKUP_IDS
        ),
        "prompt_lookup_num_tokens": dict(prompt_lookup_num_tokens=3, _ids=LOOKUP_IDS),
        "assistant_lookbehind": dict(assistant_lookbehind=5),
        "target_lookbehind": dict(target_lookbehind=5),
        "speculation_type": dict(speculation_type="dflash"),
        "is_assistant": dict(is_assistant=True),
        "assistant_ensemble_weight": dict(assistant_ensemble_weight=0.5),
        "continuous_batching_config": dict(continuous_batching_config=ContinuousBatchingConfig()),
        "cache_config": dict(cache_config={"max_cache_len": 64}),
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
        "assistant_early_exit": dict(assistant_early_exit=1),
        "use_mtp": dict(use_mtp=True),
        "dola_layers": dict(dola_layers="low"),
        "watermarking_config": dict(watermarking_config=WatermarkingConfig(bias=2.5)),
        "token_healing": dict(token_healing=True),
        "output_attentions": dict(output_attentions=True, return_dict_in_generate=True),
        "output_hidden_states": dict(output_hidden_states=True, return_dict_in_generate=True),
    }


# the engine's own sampler: compared as distributions (their draws are the sampler's own)
ENGINE_SAMPLING = {
    "do_sample": dict(do_sample=True),
    "temperature": dict(do_sample=True, temperature=0.5),
    "top_k": dict(do_sample=True, top_k=5),
    "top_p": dict(do_sample=True, top_p=0.5),
    "min_p": dict(do_sample=True, min_p=0.2),
    "num_return_sequences": dict(do_sample=True, num_return_sequences=2),
}
TRANSFORMERS_FAILS = {  # set on a plain call, transformers' generate raises; a patched one runs
    "is_assistant": "transformers' assisted decoding sets it on the assistant model's config",
}
LOOKUP_IDS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]]
SAME_TOKENS = {  # speculative decoding: faster, and the tokens greedy search gives (its promise)
    "prompt_lookup_num_tokens": "paged_hf/engine/speculation.py",
    "max_matching_ngram_size": "paged_hf/engine/speculation.py",
}
UNCHANGED_HERE = {  # a value that changes transformers' result needs logits these models never give
    "remove_invalid_values": "tests/engine/test_generate_processors.py feeds it inf and NaN",
}
SOURCES = ("keyword", "passed config", "model config")
FIELDS = sorted(name for name in options.option_rows() if not name.endswith("="))


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


def _settings(field: str, gen: torch.Tensor, tok, unset: bool = False) -> tuple[dict, dict, dict]:
    """(config fields, generate keywords, prompt override) of the walk's call for ``field``; ``unset``:
    the same call without the field (nor, for a length, any length at all)."""
    values = dict(ENGINE_SAMPLING.get(field) or _values(gen, tok)[field])
    keywords, ids = values.pop("_keywords", {}), values.pop("_ids", None)
    settings = dict(max_new_tokens=MAX_NEW, do_sample=False) | values
    if unset:
        lengths = {"max_length", "max_new_tokens"}
        drop = lengths if field in lengths else {field}
        if field in options.REFUSED_SETTINGS:  # and the refused companions it needs
            drop |= set(options.REFUSED_SETTINGS)
        for name in drop:
            settings.pop(name, None)
    return settings, keywords, ({} if ids is None else {"ids": ids})


@contextlib.contextmanager
def _on_model_config(m: torch.nn.Module, settings: dict):
    """``settings`` written into the model's own generation_config in place, as users edit it."""
    saved = copy.deepcopy(m.generation_config.__dict__)
    for name, value in settings.items():
        setattr(m.generation_config, name, value)
    try:
        yield
    finally:
        m.generation_config.__dict__.clear()
        m.generation_config.__dict__.update(saved)


def _call(m, ids, mask, settings: dict, keywords: dict, source: str):
    """``m.generate`` with ``settings`` coming from ``source``; the output, or what it raised."""
    torch.manual_seed(0)
    try:
        if source == "keyword":
            return m.generate(ids, attention_mask=mask, **settings, **keywords)
        if source == "passed config":
            config = GenerationConfig(**settings)
            return m.generate(ids, attention_mask=mask, generation_config=config, **keywords)
        with _on_model_config(m, settings):
            return m.generate(ids, attention_mask=mask, **keywords)
    except Exception as e:  # noqa: BLE001
        return e


@contextlib.contextmanager
def _capturing(reference, model=None):
    """What each side samples from: the processor lists transformers builds, and the SamplingParams
    of each row the patched generate submits."""
    seen: dict[str, list] = {"theirs": [], "ours": []}
    build = reference._get_logits_processor

    def recorded_build(*args, **kwargs):
        seen["theirs"].append(build(*args, **kwargs))
        return seen["theirs"][-1]

    reference._get_logits_processor = recorded_build
    engine = None if model is None else paged_hf.engine_for(model)
    if engine is not None:
        add = engine.add_request

        def recorded_add(prompt, params=None, *args, **kwargs):
            seen["ours"].append(params)
            return add(prompt, params, *args, **kwargs)

        engine.add_request = recorded_add
    try:
        yield seen
    finally:
        del reference._get_logits_processor
        if engine is not None:
            del engine.add_request


def _both(reference, model, ids, mask, settings, keywords, source):
    with _capturing(reference, model) as seen:
        ours = _call(model, ids, mask, settings, keywords, source)
        theirs = _call(reference, ids, mask, settings, keywords, source)
    return ours, theirs, seen


def _sequences(out):
    return out.sequences if hasattr(out, "sequences") else out


def _logits(vocab: int) -> torch.Tensor:
    return 4 * torch.randn(3, vocab, generator=torch.Generator().manual_seed(5))


def _their_distribution(processors, vocab: int) -> torch.Tensor:
    return processors(torch.zeros(3, 1, dtype=torch.long), _logits(vocab)).softmax(-1)


def _assert_same_result(field, ids, mask, ours, theirs, seen, vocab):
    assert not isinstance(theirs, Exception), f"pick a value transformers runs: {theirs!r}"
    assert not isinstance(ours, Exception), f"{field}: {ours!r}"
    ours_seq, theirs_seq = _sequences(ours), _sequences(theirs)
    if seen["ours"] and not seen["ours"][0].is_greedy:  # the engine's own draws
        assert ours_seq.shape == theirs_seq.shape
        assert torch.equal(ours_seq[:, : ids.shape[1]], theirs_seq[:, : ids.shape[1]])
        (processors,) = seen["theirs"]
        mine = drawn_probs(_logits(vocab), [SimpleNamespace(params=p) for p in seen["ours"][:3]])
        expected = _their_distribution(processors, vocab)
        assert torch.equal(mine == 0, expected == 0), f"{field}: other tokens filtered"
        assert float((mine - expected).abs().max()) < 1e-6, field
        return
    assert torch.equal(ours_seq, theirs_seq), (
        f"{field}: {ours_seq[:, ids.shape[1] :]} vs {theirs_seq[:, ids.shape[1] :]}"
    )
    if getattr(theirs, "hidden_states", None) is not None:
        assert_hidden_states_close(ours, theirs, mask, EOS_ID)
    for name in ("scores", "logits"):
        if getattr(theirs, name, None) is not None:
            for a, b in zip(getattr(ours, name), getattr(theirs, name), strict=True):
                finite = torch.isfinite(b)
                assert (
                    torch.equal(torch.isfinite(a), finite)
                    and float((a[finite] - b[finite]).abs().max()) < 1e-4
                )


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("field", FIELDS)
def test_each_field_from_each_place_is_transformers_or_refused(setup, tok, field, source):
    reference, model, ids, mask, gen = setup
    how, _ = options.option_rows()[field]
    settings, keywords, prompts = _settings(field, gen, tok)
    if prompts:
        ids = torch.tensor(prompts["ids"])
        mask = torch.ones_like(ids)
    ours, theirs, seen = _both(reference, model, ids, mask, settings, keywords, source)
    if how == options.REFUSED:
        assert isinstance(ours, NotImplementedError) and field in str(ours), ours
        return
    if field in TRANSFORMERS_FAILS:  # no effect: ours is the call without it
        assert isinstance(theirs, Exception)
        settings.pop(field)
        theirs = _call(reference, ids, mask, settings, keywords, source)
    _assert_same_result(field, ids, mask, ours, theirs, seen, reference.config.vocab_size)


@pytest.mark.parametrize("field", FIELDS)
def test_each_field_unset_is_transformers_and_setting_it_changes_transformers(setup, tok, field):
    """The same call without the field is transformers' too; and the walk's value of the field
    changes transformers' result (else the walk above tests nothing)."""
    reference, model, ids, mask, gen = setup
    settings, keywords, prompts = _settings(field, gen, tok, unset=True)
    if prompts:
        ids = torch.tensor(prompts["ids"])
        mask = torch.ones_like(ids)
    ours, theirs, seen = _both(reference, model, ids, mask, settings, keywords, "keyword")
    _assert_same_result(field, ids, mask, ours, theirs, seen, reference.config.vocab_size)
    how, _ = options.option_rows()[field]
    if how in (options.NO_EFFECT, options.REFUSED) or field in UNCHANGED_HERE | SAME_TOKENS:
        return
    with_field, keywords, _ = _settings(field, gen, tok)
    with _capturing(reference) as seen_set:
        changed = _call(reference, ids, mask, with_field, keywords, "keyword")
    differs = (
        _sequences(changed).shape != _sequences(theirs).shape
        or not torch.equal(_sequences(changed), _sequences(theirs))
        or any(getattr(changed, k, None) is not None for k in ("scores", "logits", "hidden_states"))
    )
    if with_field.get("do_sample"):  # the distribution transformers draws from, not the draw
        vocab = reference.config.vocab_size
        (set_processors,), (unset_processors,) = seen_set["theirs"], seen["theirs"]
        differs = _sequences(changed).shape != _sequences(theirs).shape or not torch.allclose(
            _their_distribution(set_processors, vocab), _their_distribution(unset_processors, vocab)
        )
    assert differs or field == "return_dict_in_generate", f"{field}: the value tests nothing"


@pytest.mark.parametrize("lengths", [[8], [31], [4, 7, 11]])
def test_no_length_anywhere_is_twenty_new_tokens_as_in_transformers(setup, lengths):
    """transformers' tutorial call, ``generate(**tok(prompt, return_tensors="pt"))``: 20 new tokens
    whatever the prompt's length (a patched model once read 20 as the total)."""
    reference, model, *_ = setup
    ids, mask = left_pad(tiny_prompts(reference.config.vocab_size, len(lengths), lengths, seed=5))
    with pytest.warns(UserWarning, match="model-agnostic default `max_length`"):
        ours = model.generate(input_ids=ids, attention_mask=mask)
    theirs = reference.generate(input_ids=ids, attention_mask=mask)
    assert ours.shape[1] - ids.shape[1] == DEFAULT_NEW and torch.equal(ours, theirs)


def test_the_default_length_is_capped_by_max_position_embeddings(setup):
    reference, model, *_ = setup
    ids = torch.tensor(tiny_prompts(reference.config.vocab_size, 1, [31], seed=4))
    saved = reference.config.max_position_embeddings
    try:
        for m in (reference, model):
            m.config.max_position_embeddings = 40
        ours, theirs = model.generate(ids), reference.generate(ids)
    finally:
        for m in (reference, model):
            m.config.max_position_embeddings = saved
    assert ours.shape[1] == 40 and torch.equal(ours, theirs)


@pytest.mark.parametrize(
    "keyword",
    [
        name[:-1]
        for name, (how, _) in options.option_rows().items()
        if how == options.REFUSED and name.endswith("=")
    ],
)
def test_each_refused_keyword_is_refused_naming_it(setup, keyword):
    """generate's own keywords the table calls refused raise NotImplementedError naming them
    (negative_prompt_attention_mask alone was once ignored)."""
    _, model, ids, mask, _ = setup
    value = {"custom_generate": "some/repo"}.get(keyword, ids)
    with pytest.raises(NotImplementedError, match=keyword):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, **{keyword: value})
