"""Stop strings and incremental detokenization (issue 12).

The oracle for where generation stops is transformers' own ``generate(stop_strings=...,
tokenizer=...)`` (its ``StopStringCriteria``): on a tiny float64 model with the tiny byte-level
tokenizer (random outputs hold split multi-byte characters) and on SmolLM2 in float32 (greedy
tokens then agree exactly, so any difference is a stop-string difference). The returned text
must be the output decoded at once, cut before the stop string (or after it).
"""

from __future__ import annotations

import copy
import json
import random
import threading

import pytest
import torch
from tiny_models import make_tiny_model
from tiny_tokenizer import make_tiny_tokenizer

import paged_hf
from paged_hf import SamplingParams
from paged_hf.requests.detokenizer import IncrementalDetokenizer, StopStrings

pytestmark = pytest.mark.usefixtures("one_thread")

UNICODE_TEXT = "naïve café — 東京タワー 🙂 and ünïcödé, ça va? Ελληνικά 👍🏽 end"


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


@pytest.fixture(scope="module")
def model64():
    """float64: greedy tokens do not depend on how requests are batched or padded."""
    return make_tiny_model("llama").double()


def expected_stop(tok, tokens: list[int], stops: list[str], include: bool) -> tuple[list[int], str]:
    """The reference: the shortest prefix of ``tokens`` whose decoded text contains a stop string,
    and that text cut at the first stop string in it (all tokens and their text if none)."""
    for k in range(1, len(tokens) + 1):
        text = tok.decode(tokens[:k], skip_special_tokens=True)
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            at, stop = min(hits)
            return tokens[:k], text[: at + len(stop)] if include else text[:at]
    return tokens, tok.decode(tokens, skip_special_tokens=True)


def clean_substring(text: str, start: int, length: int) -> str:
    """The first ``length`` characters of ``text`` from ``start`` on that hold no U+FFFD."""
    for i in range(max(0, start), len(text) - length + 1):
        if "\ufffd" not in text[i : i + length]:
            return text[i : i + length]
    raise AssertionError(f"no clean substring in {text!r}")


# ---- the detokenizer ------------------------------------------------------------------------------


def test_incremental_detokenizer_equals_a_full_decode_and_reads_short_windows(tok, smollm2):
    for tokenizer in (tok, smollm2[1]):
        ids = tokenizer(UNICODE_TEXT * 40, add_special_tokens=False)["input_ids"]
        detok = IncrementalDetokenizer(tokenizer)
        windows = []
        decode = tokenizer.decode

        def counting_decode(token_ids, **kwargs):
            windows.append(len(token_ids))
            return decode(token_ids, **kwargs)

        detok.tokenizer = type("T", (), {"decode": staticmethod(counting_decode)})()
        deltas = [detok.push(t) for t in ids]
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
        assert "\ufffd" not in "".join(deltas)  # a split character waits for its last byte
        # O(window) per token, never a re-decode of the output: each decode reads a few tokens
        assert max(windows) <= 6 and sum(windows) <= 5 * len(ids), (
            max(windows),
            sum(windows),
            len(ids),
        )


def test_detokenizer_on_random_bytes_adds_up(tok):
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(4, 512) for _ in range(rng.randint(1, 40))]
        detok = IncrementalDetokenizer(tok)
        text = "".join(detok.push(t) for t in ids)
        final = tok.decode(ids)
        assert final.startswith(text) and text + detok.finish(final) == final


# ---- the matcher --------------------------------------------------------------------------------


def test_stop_strings_split_over_tokens_several_unicode_include(tok):
    def run(text, stops, include=False, context=""):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        ctx = tok(context, add_special_tokens=False)["input_ids"] if context else []
        matcher = StopStrings(tok, stops, include, context_ids=ctx)
        for k, t in enumerate(ids):
            if matcher.push(t) is not None:
                return matcher.hit, matcher.text, k + 1, len(ids)
        return None, matcher.text, len(ids), len(ids)

    # split over tokens: "lo wo" spans three byte-level pieces
    assert run("hello world again", ["lo wo"])[:2] == ("lo wo", "hel")
    # several at once: the one that completes first stops it; when two complete on the same
    # token, the one that starts first in the text
    assert run("one two three", ["three", "two"])[:2] == ("two", "one ")
    assert run("abcdef", ["cd", "bcd"])[:2] == ("bcd", "a")
    # unicode: "東" is three byte tokens; the third completes it, and the text has no broken char
    hit, text, used, total = run("x 東京 y", ["東"])
    assert (hit, text) == ("東", "x ") and used == 5 and total > used
    assert run("ça va 🙂 bien", ["🙂"], include=True)[:2] == ("🙂", "ça va 🙂")
    # the text after a stop string is never returned; include keeps the stop string itself
    assert run("end.\n\nmore text", ["\n\n"], include=True)[1] == "end.\n\n"
    # with the prompt as context (transformers' semantics) a stop string may begin in the prompt
    assert run("\nanswer", ["\n\n"], context="question\n")[:2] == ("\n\n", "")
    assert run("\nanswer", ["\n\n"])[0] is None  # SamplingParams.stop: the output only


def test_safe_text_never_shows_the_start_of_a_stop_string(tok):
    matcher = StopStrings(tok, ["END"])
    shown = []
    for t in tok("abc ENthen END", add_special_tokens=False)["input_ids"]:
        matcher.push(t)
        shown.append(matcher.safe_text())
        if matcher.hit:
            break
    assert all(b.startswith(a) for a, b in zip(shown, shown[1:]))  # only ever grows
    assert shown[-1] == "abc ENthen " and all("END" not in s for s in shown)


# ---- the engine ---------------------------------------------------------------------------------


def test_engine_stops_where_transformers_does(model64, tok):
    """Stop strings picked from the unstopped greedy outputs (across tokens, several per
    request, the second listed starting earlier): the engine keeps exactly the tokens up to the
    one completing the stop string, as transformers' generate(stop_strings=...), and cuts the
    text there; patched generate returns transformers' sequences."""
    prompts = [
        tok(p, add_special_tokens=False)["input_ids"]
        for p in ("hello there", "the cat", "naïve", "qz")
    ]
    base = SamplingParams(max_new_tokens=30, ignore_eos=True)
    engine = paged_hf.Engine(model64, tok, block_size=4, max_num_batched_tokens=16)
    plain = [o.token_ids for o in engine.generate(prompts, base)]
    stops = []
    for tokens in plain:
        text = tok.decode(tokens)
        mid = len(text) // 2
        # a 3-character stop string from the middle, and a 2-character one listed second that
        # starts earlier (a random model emits stray bytes, U+FFFD in text: stop strings avoid them)
        stops.append([clean_substring(text, mid, 3), clean_substring(text, mid - 6, 2)])
    for include in (False, True):
        outs = engine.generate(
            prompts, [base.with_(stop=ss, include_stop_str_in_output=include) for ss in stops]
        )
        for out, tokens, ss in zip(outs, plain, stops):
            want_ids, want_text = expected_stop(tok, tokens, ss, include)
            assert out.token_ids == want_ids and out.text == want_text, (ss, out.text, want_text)
            assert out.finish_reason == "stop" and out.completions[0].stop_reason in ss
            assert len(out.token_ids) < len(tokens)
    patched = paged_hf.patch(copy.deepcopy(model64), block_size=4)
    for prompt, ss in zip(prompts, stops):
        ids = torch.tensor([prompt])
        kw = dict(
            max_new_tokens=30,
            do_sample=False,
            stop_strings=ss,
            tokenizer=tok,
            pad_token_id=0,
            eos_token_id=None,
        )
        ref = model64.generate(ids, **kw)
        assert patched.generate(ids, **kw).tolist() == ref.tolist()
        assert (
            engine.generate([prompt], base.with_(stop=ss))[0].token_ids
            == ref[0, len(prompt) :].tolist()
        )


def test_multibyte_stop_strings_in_sampled_outputs(model64, tok):
    """Seeded samples hold multi-byte characters made of byte tokens; a stop string that is one
    stops on the token holding its last byte, and each sample stops on its own."""
    prompt = tok("naïve café", add_special_tokens=False)["input_ids"]
    engine = paged_hf.Engine(model64, tok)
    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=0, n=8, ignore_eos=True)
    free = engine.generate([prompt], params)[0]
    chars = [c for comp in free.completions for c in comp.text if ord(c) > 127 and c != "\ufffd"]
    assert chars, "no multi-byte character to stop on"
    stops = [chars[0], "~~"]  # the second never occurs: it must not disturb the first
    out = engine.generate([prompt], params.with_(stop=stops))[0]
    stopped = 0
    for sample, unstopped in zip(out.completions, free.completions):
        want_ids, want_text = expected_stop(tok, unstopped.token_ids, stops, False)
        assert sample.token_ids == want_ids and sample.text == want_text
        stopped += sample.stop_reason == chars[0]
    assert stopped >= 1


def test_stop_strings_are_validated_at_admission(model64, tok):
    assert SamplingParams(stop="abc").stop == ("abc",)
    for bad, match in (
        ([""], "non-empty"),
        ([1], "list of strings"),
        (["x" * 2000], "at most 1024"),
        (["a"] * 65, "at most 64"),
    ):
        with pytest.raises(ValueError, match=match):
            SamplingParams(stop=bad)
    with pytest.raises(ValueError, match="include_stop_str_in_output"):
        SamplingParams(include_stop_str_in_output=1)
    engine = paged_hf.Engine(model64)  # no tokenizer
    out = engine.generate([[5, 6, 7]], SamplingParams(stop=["ab"]))[0]
    assert out.finish_reason == "error" and "stop=['ab'] needs a tokenizer" in out.error
    assert out.error.startswith("request paged_hf:")
    with pytest.raises(ValueError, match="stop_strings need the model's tokenizer"):
        paged_hf.patch(copy.deepcopy(model64)).generate(
            torch.tensor([[5, 6]]), max_new_tokens=3, stop_strings=["x"]
        )


def test_a_stop_check_that_raises_ends_that_request_alone(model64, tok):
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ("ab", "cd", "ef")]
    base = SamplingParams(max_new_tokens=8, ignore_eos=True)
    engine = paged_hf.Engine(model64, tok)
    plain = engine.generate(prompts, base)
    others = plain[0].token_ids + plain[2].token_ids
    poison = next(t for t in plain[1].token_ids if t not in others)
    k = plain[1].token_ids.index(poison)

    class Fragile:  # the tiny tokenizer, failing on a token only the second request generates
        def decode(self, ids, **kwargs):
            if poison in ids:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
            return tok.decode(ids, **kwargs)

        def __getattr__(self, name):
            return getattr(tok, name)

    engine.tokenizer = Fragile()
    outs = engine.generate(prompts, base.with_(stop=["zzzz"]))
    assert (
        outs[1].finish_reason == "error"
        and "stop strings failed: UnicodeDecodeError" in outs[1].error
    )
    assert outs[1].token_ids == plain[1].token_ids[: k + 1]
    assert [o.token_ids for i, o in enumerate(outs) if i != 1] == [
        plain[0].token_ids,
        plain[2].token_ids,
    ]
    assert not engine.requests and engine.kv_manager.pool.num_used == 0


def test_stream_never_shows_a_stop_string(model64, tok):
    prompt = tok("the quick", add_special_tokens=False)["input_ids"]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    text = paged_hf.Engine(model64, tok).generate([prompt], params)[0].text
    stop = text[20:23]
    bg = paged_hf.serve(model64, tok, warmup=False)
    try:
        handle = bg.submit(prompt, params.with_(stop=[stop]))
        deltas: list[str] = []
        reader = threading.Thread(target=lambda: deltas.extend(handle.stream()))
        reader.start()
        reader.join(60)
        out = handle.result()
    finally:
        bg.shutdown()
    assert "".join(deltas) == out.text == text[: text.find(stop)] and stop not in "".join(deltas)


def test_generate_dataset_and_cli_take_stops(model64, tok, tmp_path):
    import datasets

    from paged_hf.frontends import cli

    prompts = ["hello there", "the cat", "qz"]
    base = SamplingParams(max_new_tokens=20, ignore_eos=True)
    plain = paged_hf.Engine(model64, tok).generate(prompts, base)
    stop = plain[0].text[5:7]
    ds = datasets.Dataset.from_dict({"prompt": prompts})
    # the prompts as they are, as the reference has them
    out = paged_hf.generate_dataset(
        model64, tok, ds, sampling_params=base.with_(stop=[stop]), progress=False, chat=False
    )
    for row, ref in zip(out, plain):
        assert row["generation"] == (
            ref.text[: ref.text.find(stop)] if stop in ref.text else ref.text
        )
    assert out[0]["generation_finish_reason"] == "stop"

    model_dir = tmp_path / "model"
    make_tiny_model("llama").save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    f32 = paged_hf.Engine(make_tiny_model("llama"), tok).generate(prompts, base)
    stop = f32[1].text[3:5]
    argv = [
        "generate",
        "--model",
        str(model_dir),
        "--input",
        str(data),
        "--output",
        str(tmp_path / "o.jsonl"),
        "--max-new-tokens",
        "20",
        "--ignore-eos",
        "--dtype",
        "float32",
        "--no-progress",
        "--raw",
        "--stop",
        stop.encode("unicode_escape").decode(),
        "--stop",
        "zzzz",
        "--include-stop-str",
    ]
    assert cli.main(argv) == 0
    rows = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    for row, ref in zip(rows, f32):
        want = ref.text[: ref.text.find(stop) + len(stop)] if stop in ref.text else ref.text
        assert row["generation"] == want


def test_smollm2_stop_strings_equal_transformers(smollm2_fp32):
    """One transformers call (its StopStringCriteria reads SmolLM2's 49k-token vocabulary once,
    ~30 s here) against patched generate and the engine's SamplingParams.stop."""
    model, tok = smollm2_fp32
    questions = [
        "What is the capital of France?",
        "List three fruits, one per line.",
        "Write two short sentences about the sea.",
        "Say hello in French and in Japanese.",
    ]
    chats = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in questions
    ]
    # "Paris" is a whole token, "\n2." spans tokens, " lif" ends inside the token " life",
    # "ç" is a multi-byte character inside "français"
    stops = ["Paris", "\n2.", " lif", "ç"]
    tok.padding_side = "left"
    batch = tok(chats, return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=40, do_sample=False, stop_strings=stops, tokenizer=tok)
    ref = model.generate(**batch, **kw)
    patched = paged_hf.patch(copy.deepcopy(model))
    assert patched.generate(**batch, **kw).tolist() == ref.tolist()
    width = batch["input_ids"].shape[1]
    engine = paged_hf.Engine(model, tok)
    outs = engine.generate(
        [tok(c)["input_ids"] for c in chats], SamplingParams(max_new_tokens=40, stop=stops)
    )
    hits = 0
    for row, out in zip(ref[:, width:].tolist(), outs):
        # transformers pads a finished row (SmolLM2's pad token is its EOS)
        assert row == out.token_ids + [tok.pad_token_id] * (len(row) - len(out.token_ids))
        full = tok.decode(out.token_ids, skip_special_tokens=True)
        found = [(full.find(s), s) for s in stops if s in full]
        if found:
            hits += 1
            assert out.finish_reason == "stop" and out.text == full[: min(found)[0]]
    assert hits == 4, [o.text for o in outs]
