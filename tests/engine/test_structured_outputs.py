"""Structured outputs (paged_hf/engine/structured.py, xgrammar): JSON schemas, regular expressions,
choices and EBNF grammars, per request, in any mix with unconstrained requests.

Oracles: xgrammar's own matcher token by token and transformers' logits (tiny model: every token
the engine picks is one the matcher allows, and its processed logprob is the log-softmax of
transformers' logits under xgrammar's bitmask, within 1e-4); on the shipped SmolLM2 (fp32),
outputs that parse and satisfy their schema, match their regex, are one of their choices, and
unconstrained requests beside them that give their tokens alone.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import xgrammar as xgr  # noqa: E402  (the "structured" extra; make install has it)
from tiny_models import make_tiny_model
from tiny_tokenizer import make_tiny_tokenizer

import paged_hf

pytestmark = pytest.mark.usefixtures("one_thread")

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "maxLength": 20},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 50},
        "size": {"enum": ["small", "medium", "large"]},
    },
    "required": ["city", "country", "population_millions", "size"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_model("llama"), make_tiny_tokenizer()


# bounded, so a random tiny model completes them within max_new_tokens
@pytest.mark.parametrize(
    "constraint",
    [
        dict(regex=r"(ab|cd){1,3}x[0-9]{2}"),
        dict(choice=["yes", "no", "maybe so"]),
        dict(
            json_schema={
                "type": "object",
                "properties": {"a": {"enum": [1, 22, 333]}},
                "required": ["a"],
                "additionalProperties": False,
            }
        ),
        dict(grammar='root ::= "(" [a-c] [a-c]? [a-c]? ")"'),
    ],
)
def test_the_mask_is_xgrammars_matcher_token_by_token(tiny, constraint):
    model, tok = tiny
    engine = paged_hf.Engine(model, tok, block_size=4, num_blocks=64)
    params = paged_hf.SamplingParams(
        max_new_tokens=24,
        temperature=1.0,
        seed=5,
        n=2,
        logprobs=5,
        logprobs_mode="processed",
        **constraint,
    )
    out = engine.generate([tok("hello")["input_ids"]], params)[0]
    kind, text = params.constraint
    compiled = engine.structured.compiled(kind, text)
    vocab = model.config.vocab_size
    for completion in out.completions:
        matcher = xgr.GrammarMatcher(compiled)
        ids = tok("hello")["input_ids"] + list(completion.token_ids)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
        start = len(ids) - len(completion.token_ids) - 1
        for i, (token, (chosen, top)) in enumerate(zip(completion.token_ids, completion.logprobs)):
            bitmask = xgr.allocate_token_bitmask(1, vocab)
            matcher.fill_next_token_bitmask(bitmask, 0)
            masked = logits[start + i].clone()[None]
            xgr.apply_token_bitmask_inplace(masked, bitmask)
            expected = torch.log_softmax(masked[0], dim=-1)
            assert expected[token] > float("-inf"), (
                f"step {i}: token {token} is one the grammar forbids"
            )
            assert abs(chosen - float(expected[token])) < 1e-4, (i, chosen, float(expected[token]))
            for t, v in top.items():
                assert (
                    v == float("-inf")
                    and expected[t] == float("-inf")
                    or abs(v - float(expected[t])) < 1e-4
                )
            assert matcher.accept_token(token)
        assert completion.finish_reason == "stop" and matcher.is_terminated(), (
            "it ends with its grammar"
        )
        text_out = tok.decode(completion.token_ids, skip_special_tokens=True)
        if "regex" in constraint:
            assert re.fullmatch(constraint["regex"], text_out)
        if "choice" in constraint:
            assert text_out in constraint["choice"]
        if "json_schema" in constraint:
            assert json.loads(text_out)["a"] in (1, 22, 333)
    assert engine.stats()["structured_mask_s"] > 0 and engine.stats()["structured_grammars"] == 1


def test_bad_constraints_are_refused_at_admission(tiny):
    model, tok = tiny
    engine = paged_hf.Engine(model, tok, block_size=4, num_blocks=64)
    with pytest.raises(ValueError, match=r"request bad: its json_schema does not compile"):
        engine.add_request(
            "x", paged_hf.SamplingParams(json_schema='{"type": "objec'), request_id="bad"
        )
    with pytest.raises(ValueError, match=r"request r2: its regex does not compile"):
        engine.add_request("x", paged_hf.SamplingParams(regex="(ab"), request_id="r2")
    with pytest.raises(ValueError, match="at most one constraint"):
        engine.add_request("x", paged_hf.SamplingParams(regex="a", choice=["a"]))
    with pytest.raises(ValueError, match="choice"):
        paged_hf.SamplingParams(choice="yes")
    with pytest.raises(ValueError, match="needs a tokenizer"):
        paged_hf.Engine(model, block_size=4, num_blocks=64).add_request(
            [5, 6], paged_hf.SamplingParams(regex="a+")
        )
    assert not engine.requests and engine.kv_manager.pool.num_used == 0


def test_without_xgrammar_a_constraint_names_the_extra(tiny, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_xgrammar(name, *args, **kwargs):
        if name == "xgrammar":
            raise ImportError("No module named 'xgrammar'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_xgrammar)
    model, tok = tiny
    engine = paged_hf.Engine(model, tok, block_size=4, num_blocks=64)
    with pytest.raises(ValueError, match=r"paged_hf\[structured\]"):
        engine.add_request("x", paged_hf.SamplingParams(regex="a+"))
    # unconstrained ones still run
    engine.generate(["x"], paged_hf.SamplingParams(max_new_tokens=2))


@pytest.fixture(scope="module")
def smollm2():
    from paged_hf.model.default_model import load_default_model

    model, tok = load_default_model()
    return model, tok


def _chat(tok, question: str) -> str:
    return tok.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )


def test_smollm2_constrained_and_unconstrained_requests_in_one_batch(smollm2):
    model, tok = smollm2
    cities = ["Paris", "Rome", "Tokyo", "Cairo"]
    json_prompts = [
        _chat(tok, f"Describe {c} as JSON with its city, country, population and size.")
        for c in cities
    ]
    free = [_chat(tok, "What is the capital of Italy?"), _chat(tok, "Name a fruit.")]
    # chunked: constrained rows mix with prefills
    engine = paged_hf.Engine(model, tok, max_num_batched_tokens=64)
    params = (
        [paged_hf.SamplingParams(max_new_tokens=80, json_schema=SCHEMA)] * 4
        + [paged_hf.SamplingParams(max_new_tokens=12)] * 2
        + [
            paged_hf.SamplingParams(max_new_tokens=16, regex=r"[A-Z][a-z]+ is in [A-Z][a-z]+\."),
            paged_hf.SamplingParams(max_new_tokens=8, choice=["Rome", "Milan", "Naples"]),
        ]
    )
    prompts = (
        json_prompts
        + free
        + [_chat(tok, "Where is Rome?"), _chat(tok, "What is the capital of Italy?")]
    )
    outs = engine.generate(prompts, params)
    for out in outs[:4]:
        assert out.finish_reason == "stop", "it ended by its grammar, not by length"
        value = json.loads(out.text)
        assert set(value) == set(SCHEMA["required"])
        assert isinstance(value["city"], str) and isinstance(value["country"], str)
        assert (
            isinstance(value["population_millions"], int)
            and 0 <= value["population_millions"] <= 50
        )
        assert value["size"] in SCHEMA["properties"]["size"]["enum"]
    assert (
        re.fullmatch(r"[A-Z][a-z]+ is in [A-Z][a-z]+\.", outs[6].text)
        and outs[6].finish_reason == "stop"
    )
    assert outs[7].text in ["Rome", "Milan", "Naples"]
    alone = paged_hf.Engine(model, tok).generate(free, paged_hf.SamplingParams(max_new_tokens=12))
    assert [o.token_ids for o in outs[4:6]] == [o.token_ids for o in alone], (
        "a constraint never touches another row"
    )


def test_smollm2_constraints_with_n_samples_and_preemption(smollm2):
    model, tok = smollm2
    prompt = _chat(tok, "Describe Paris as JSON with its city, country, population and size.")
    params = paged_hf.SamplingParams(
        max_new_tokens=80, json_schema=SCHEMA, temperature=0.8, seed=3, n=3
    )
    roomy = paged_hf.Engine(model, tok).generate([prompt, prompt], params)
    # 6 samples of up to 124 tokens (a 44-token prompt) in 10 blocks of 16: running ones are preempted
    tight = paged_hf.Engine(model, tok, num_blocks=10, max_num_seqs=6)
    outs = tight.generate([prompt, prompt], params)
    assert tight.stats()["preemptions"] > 0
    assert [[c.token_ids for c in o.completions] for o in outs] == [
        [c.token_ids for c in o.completions] for o in roomy
    ]
    for completion in (c for o in outs for c in o.completions):
        value = json.loads(completion.text)
        assert (
            set(value) == set(SCHEMA["required"])
            and value["size"] in SCHEMA["properties"]["size"]["enum"]
        )


def test_generate_dataset_with_a_schema_column_and_generate_with_its_keywords(tiny):
    import datasets

    model, tok = tiny
    schema = {
        "type": "object",
        "properties": {"k": {"enum": ["a", "bb"]}},
        "required": ["k"],
        "additionalProperties": False,
    }
    rows = datasets.Dataset.from_dict(
        {
            "prompt": ["hello", "world", "again"],
            "schema": [json.dumps(schema), None, json.dumps({"enum": [7, 8]})],
        }
    )
    params = paged_hf.SamplingParams(max_new_tokens=12, temperature=1.0, seed=1)
    out = paged_hf.generate_dataset(
        model,
        tok,
        rows,
        sampling_params=params,
        json_schema_column="schema",
        progress=False,
        block_size=4,
        num_blocks=64,
    )
    assert (
        json.loads(out["generation"][0])["k"] in ("a", "bb")
        and out["generation_finish_reason"][0] == "stop"
    )
    assert json.loads(out["generation"][2]) in (7, 8)
    free = paged_hf.generate_dataset(
        model,
        tok,
        rows.select([1]),
        sampling_params=params,
        progress=False,
        block_size=4,
        num_blocks=64,
    )
    assert out["generation"][1] != "" and out["generation_finish_reason"][1] != "error"
    everywhere = paged_hf.generate_dataset(
        model,
        tok,
        rows,
        sampling_params=params,
        json_schema=schema,
        progress=False,
        block_size=4,
        num_blocks=64,
    )
    assert all(json.loads(g)["k"] in ("a", "bb") for g in everywhere["generation"])
    assert free["generation_num_tokens"][0] > 0

    paged_hf.patch(model, tok, block_size=4, num_blocks=64)
    try:
        x = torch.tensor([tok("hello")["input_ids"]])
        ids = model.generate(x, max_new_tokens=12, do_sample=True, paged_hf_regex=r"(ab|cd){1,3}!")
        assert re.fullmatch(
            r"(ab|cd){1,3}!", tok.decode(ids[0, x.shape[1] :], skip_special_tokens=True)
        )
    finally:
        paged_hf.unpatch(model)
