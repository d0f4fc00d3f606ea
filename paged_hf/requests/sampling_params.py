"""Per-request sampling parameters (what to generate and how), validated at construction.

Validation is the admission contract: whatever a request carries that passes here cannot make
its step fail later (the engine adds the checks that need the model, e.g. the vocabulary size).
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, fields, replace
from typing import Any

# vLLM's default cap: more costs a top-k over the vocabulary per token and says nothing new.
MAX_LOGPROBS = 20
# Below this a temperature is greedy decoding: logits / T overflow fp32 long before T reaches 0,
# and the distribution is already one-hot to fp32 precision (vLLM uses the same threshold).
GREEDY_TEMPERATURE = 1e-5
# Dividing fp32 logits by a penalty outside this range overflows them (or zeroes them): every
# token ties, and the argmax is the last vocabulary id.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-6, 1e6
# Sample k of a seeded request draws with seed + k; every one must be a valid generator seed.
MAX_SEED = 2**63 - 1
# Every token searches the last characters for each stop string: O(count x length) per token.
MAX_STOP_STRINGS, MAX_STOP_STRING_LEN = 64, 1024
# logprobs_mode: "raw" (log_softmax of the model's logits) or "processed" (of the distribution sampled
# from, after penalties, temperature, top-k / top-p / min-p); vLLM's names for the same two accepted
LOGPROBS_MODES = {
    "raw": "raw",
    "processed": "processed",
    "raw_logprobs": "raw",
    "processed_logprobs": "processed",
}


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. ``temperature=0`` (the default) is greedy decoding, and so is
    any temperature below 1e-5 (``GREEDY_TEMPERATURE``).

    >>> SamplingParams(max_new_tokens=32, temperature=0.7, top_p=0.9, seed=1).is_greedy
    False
    >>> SamplingParams(stop="Question:").stop      # one string or several
    ('Question:',)
    """

    max_new_tokens: int = 16
    min_new_tokens: int = 0
    temperature: float = 0.0
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    # transformers' encoder_repetition_penalty (its "hallucination penalty"): above 1 favours the
    # prompt's tokens (a logit < 0 times 1/penalty, one > 0 divided by it), before repetition_penalty
    encoder_repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    # None: none; 0 <= k <= 20: the chosen token's logprob plus the top k
    logprobs: int | None = None
    cache_salt: str | None = None  # requests with different salts never share cached KV
    # text that ends the request on the token completing it (needs the engine's tokenizer); the
    # text returned ends before it (include_stop_str_in_output: after it)
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    # None: none; 0 <= k <= 20: each prompt token's logprob plus the top k (vLLM's meaning; the
    # first token has none). Positions need logits, so the prefix cache serves none of the prompt.
    prompt_logprobs: int | None = None
    # "raw" (default): logprobs of the model's own distribution; "processed": of the one sampled
    # from (what an RL importance-sampling correction needs; vLLM's processed_logprobs). A greedy
    # request's processed distribution is its penalised, masked logits' log_softmax.
    logprobs_mode: str = "raw"
    # token ids never generated, and ids not generated as the first token (transformers' options)
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()
    # callables (token_ids, logits) -> logits, run in order on each step's fp32 logits row [vocab]
    # after the penalties and bans above, before temperature / top-k / top-p / min-p (where
    # transformers runs a generate call's logits_processor); token_ids: the prompt, then the tokens
    # generated so far. One that raises, or returns another shape, ends its request alone.
    logits_processors: tuple = ()
    # structured outputs (at most one; xgrammar, the "structured" extra): the output must match a
    # JSON schema (a dict or its JSON text), a regular expression, one of ``choice``, or an EBNF
    # grammar (xgrammar's dialect, root rule ``root``); the request stops when it is complete
    json_schema: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    # under EngineConfig(scheduling_policy="priority"): lower runs first, and preempts requests of
    # a higher number (vLLM's convention); "fcfs" ignores it. Latency targets, in seconds: which
    # requests stats() counts as good (goodput); a TPOT target also bounds the step's prefill
    priority: int = 0
    ttft_target_s: float | None = None
    tpot_target_s: float | None = None
    # every layer's hidden states (and the embeddings') at each position it computes: the prompt's
    # and each generated token's but the last (transformers' output_hidden_states); only requests
    # that ask pay, and they compute their whole prompt (the prefix cache keeps no hidden states)
    output_hidden_states: bool = False
    # speculative decoding by prompt lookup (transformers' prompt_lookup_num_tokens): each decode
    # step proposes up to this many tokens, those that followed an earlier match of the last
    # tokens (up to max_matching_ngram_size of them) in the prompt and output, and one forward
    # verifies them; greedy or sampled (docs/speculative.md)
    prompt_lookup_num_tokens: int = 0
    max_matching_ngram_size: int = 2
    # speculative decoding by a draft model (transformers' assistant_model): each decode step the
    # engine's draft model (``Engine.set_draft_model``) proposes up to this many tokens, greedily,
    # and one forward verifies them, as prompt lookup's are
    num_assistant_tokens: int = 0

    def __post_init__(self) -> None:
        # its text is the key compiled grammars are cached by
        if isinstance(self.json_schema, dict):
            object.__setattr__(self, "json_schema", json.dumps(self.json_schema, sort_keys=True))
        if self.choice is not None and not isinstance(self.choice, tuple):
            if isinstance(self.choice, str):
                raise ValueError(
                    f"sampling params: choice={self.choice!r}, must be a list of strings"
                )
            object.__setattr__(self, "choice", tuple(self.choice))
        if callable(self.logits_processors):
            object.__setattr__(self, "logits_processors", (self.logits_processors,))
        elif not isinstance(self.logits_processors, tuple):
            object.__setattr__(self, "logits_processors", tuple(self.logits_processors or ()))
        for name in ("suppress_tokens", "begin_suppress_tokens"):
            value = getattr(self, name)
            if value is None:
                object.__setattr__(self, name, ())
            elif not isinstance(value, tuple):
                try:
                    object.__setattr__(self, name, tuple(int(t) for t in value))
                except (TypeError, ValueError):
                    raise ValueError(
                        f"sampling params: {name}={value!r}, must be a list of token ids (int)"
                    ) from None
        ids = self.stop_token_ids
        if (
            isinstance(ids, (str, bytes))
            or not isinstance(ids, (list, tuple, set, frozenset))
            or not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids)
        ):
            raise ValueError(
                f"sampling params: stop_token_ids={ids!r}, must be a list of token ids (int)"
            )
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise ValueError(
                f"sampling params: stop={self.stop!r}, must be a string or a list of strings"
            )
        object.__setattr__(self, "stop", tuple(stop))
        self.validate()

    def validate(self, who: str = "sampling params") -> None:
        """Raise ValueError naming ``who``, the field, its value and what it must be."""
        self._check_sampling(who)
        self._check_outputs(who)
        self._check_stop_strings(who)
        self._check_rest(who)

    def _check_sampling(self, who: str) -> None:
        """Lengths, temperature, top-k/p, min-p, penalties."""
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise _bad(who, "max_new_tokens", self.max_new_tokens, "an integer >= 1")
        if not _is_int(self.min_new_tokens) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise _bad(
                who,
                "min_new_tokens",
                self.min_new_tokens,
                f"an integer in [0, max_new_tokens={self.max_new_tokens}]",
            )
        if not _finite(self.temperature) or self.temperature < 0:
            raise _bad(who, "temperature", self.temperature, "a finite number >= 0")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise _bad(who, "top_k", self.top_k, "an integer >= 0 (0 disables)")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            raise _bad(who, "top_p", self.top_p, "in (0, 1]")
        if not _finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise _bad(who, "min_p", self.min_p, "in [0, 1]")
        for name in ("repetition_penalty", "encoder_repetition_penalty"):
            value = getattr(self, name)
            if not _finite(value) or not MIN_REPETITION_PENALTY <= value <= MAX_REPETITION_PENALTY:
                raise _bad(
                    who,
                    name,
                    value,
                    f"in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (1 disables)",
                )

    def _check_outputs(self, who: str) -> None:
        """Samples, seeds, logprobs, EOS and stop ids."""
        if not _is_int(self.n) or self.n < 1:
            raise _bad(who, "n", self.n, "an integer >= 1")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise _bad(who, "logprobs", self.logprobs, f"None or an integer in [0, {MAX_LOGPROBS}]")
        if self.seed is not None and (
            not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED - (self.n - 1)
        ):
            raise _bad(
                who,
                "seed",
                self.seed,
                f"None or an integer in [0, {MAX_SEED} - (n - 1)] "
                "(sample k of n draws with seed + k)",
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise _bad(who, "stop_token_ids", self.stop_token_ids, "non-negative token ids")
        if not isinstance(self.ignore_eos, bool):
            raise _bad(who, "ignore_eos", self.ignore_eos, "True or False")
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise _bad(
                who,
                "prompt_logprobs",
                self.prompt_logprobs,
                f"None or an integer in [0, {MAX_LOGPROBS}]",
            )

    def _check_stop_strings(self, who: str) -> None:
        """Stop strings."""
        if not all(isinstance(s, str) and s for s in self.stop):
            raise _bad(who, "stop", self.stop, "non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS or any(
            len(s) > MAX_STOP_STRING_LEN for s in self.stop
        ):
            raise _bad(
                who,
                "stop",
                self.stop,
                f"at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_LEN} "
                "characters each",
            )
        if not isinstance(self.include_stop_str_in_output, bool):
            raise _bad(
                who, "include_stop_str_in_output", self.include_stop_str_in_output, "True or False"
            )

    def _check_rest(self, who: str) -> None:
        """Structured-output constraints, logprobs mode, suppressed tokens, processors, salt."""
        set_ = [
            name
            for name in ("json_schema", "regex", "choice", "grammar")
            if getattr(self, name) is not None
        ]
        if len(set_) > 1:
            raise ValueError(
                f"{who}: {' and '.join(set_)} are set; a request takes at most one constraint"
            )
        for name in ("json_schema", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise _bad(
                    who,
                    name,
                    value,
                    "a non-empty str" + (" or a dict" if name == "json_schema" else ""),
                )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise _bad(who, "choice", self.choice, "a non-empty list of non-empty strings")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise _bad(who, "logprobs_mode", self.logprobs_mode, f"one of {sorted(LOGPROBS_MODES)}")
        for name in ("suppress_tokens", "begin_suppress_tokens"):
            if any(not _is_int(t) or t < 0 for t in getattr(self, name)):
                raise _bad(who, name, getattr(self, name), "non-negative token ids")
        if not all(callable(f) for f in self.logits_processors):
            raise _bad(
                who,
                "logits_processors",
                self.logits_processors,
                "callables (token_ids, logits) -> logits",
            )
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            # 1, True and 1.0 are equal as dict keys: they would share one cache
            raise _bad(who, "cache_salt", self.cache_salt, "None or a str")
        if not _is_int(self.priority):
            raise _bad(who, "priority", self.priority, "an integer (lower runs first)")
        for name in ("ttft_target_s", "tpot_target_s"):
            value = getattr(self, name)
            if value is not None and not (_finite(value) and value > 0):
                raise _bad(who, name, value, "None or a number of seconds > 0")
        if self.output_hidden_states not in (True, False):
            raise _bad(who, "output_hidden_states", self.output_hidden_states, "True or False")
        if self.output_hidden_states and self.n > 1:
            raise ValueError(
                f"{who}: output_hidden_states with n={self.n} parallel samples is not supported "
                "(one sample a request)"
            )
        self._check_speculation(who)

    def _check_speculation(self, who: str) -> None:
        """Prompt lookup's and the draft model's sizes, and what they do not run with yet
        (refused by name)."""
        k, ngram = self.prompt_lookup_num_tokens, self.max_matching_ngram_size
        if not _is_int(k) or k < 0:
            raise _bad(who, "prompt_lookup_num_tokens", k, "an integer >= 0")
        if not _is_int(ngram) or ngram < 1:
            raise _bad(who, "max_matching_ngram_size", ngram, "an integer >= 1")
        drafted = self.num_assistant_tokens
        if not _is_int(drafted) or drafted < 0:
            raise _bad(who, "num_assistant_tokens", drafted, "an integer >= 0")
        if k and drafted:
            raise ValueError(
                f"{who}: prompt_lookup_num_tokens and num_assistant_tokens together: a request "
                "takes its drafts from one proposer"
            )
        if not (k or drafted):
            return
        option = "prompt_lookup_num_tokens" if k else "num_assistant_tokens"
        unsupported = [
            name
            for name, applies in (
                (f"n={self.n}", self.n > 1),
                ("prompt_logprobs", self.prompt_logprobs is not None),
                ("repetition_penalty", self.repetition_penalty != 1.0),
                ("encoder_repetition_penalty", self.encoder_repetition_penalty != 1.0),
                ("suppress_tokens", bool(self.suppress_tokens)),
                ("logits_processors", bool(self.logits_processors)),
                ("structured outputs", self.constraint is not None),
                ("output_hidden_states", self.output_hidden_states),
            )
            if applies
        ]
        if unsupported:
            raise NotImplementedError(
                f"{who}: {option} with {', '.join(unsupported)} is not supported "
                "yet (speculation runs rows whose processors read no history)"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, text) of the request's structured-output constraint, or None."""
        for name in ("json_schema", "regex", "grammar"):
            if getattr(self, name) is not None:
                return name, getattr(self, name)
        if self.choice is not None:
            return "choice", json.dumps(list(self.choice))
        return None

    @property
    def processed_logprobs(self) -> bool:
        return LOGPROBS_MODES.get(self.logprobs_mode) == "processed"

    def with_(self, **changes: Any) -> "SamplingParams":
        return replace(self, **changes)

    @classmethod
    def from_generation_config(cls, generation_config: Any, **overrides: Any) -> "SamplingParams":
        """Translate a transformers ``GenerationConfig`` (sampling fields only) into SamplingParams.

        Options with no equivalent here (beam search, assisted decoding, ...) are the caller's to reject;
        see ``paged_hf.model.hf_generate``.
        """
        gc = generation_config
        do_sample = bool(getattr(gc, "do_sample", False))
        if do_sample and gc.temperature is not None and not gc.temperature > 0:
            # transformers' TemperatureLogitsWarper raises too; greedy is do_sample=False
            raise ValueError(
                f"temperature={gc.temperature!r} with do_sample=True: the temperature must be > 0 "
                "(for greedy decoding set do_sample=False)"
            )
        kw: dict[str, Any] = {}
        if getattr(gc, "max_new_tokens", None) is not None:
            kw["max_new_tokens"] = gc.max_new_tokens
        if getattr(gc, "min_new_tokens", None):
            kw["min_new_tokens"] = gc.min_new_tokens
        if do_sample:
            kw["temperature"] = 1.0 if gc.temperature is None else float(gc.temperature)
            kw["top_k"] = int(gc.top_k or 0)
            kw["top_p"] = 1.0 if gc.top_p is None else float(gc.top_p)
            kw["min_p"] = float(getattr(gc, "min_p", None) or 0.0)
        for name in ("repetition_penalty", "encoder_repetition_penalty"):
            if getattr(gc, name, None) is not None:
                kw[name] = float(getattr(gc, name))
        for name in ("suppress_tokens", "begin_suppress_tokens"):
            if getattr(gc, name, None):
                kw[name] = tuple(getattr(gc, name))
        if getattr(gc, "prompt_lookup_num_tokens", None):
            kw["prompt_lookup_num_tokens"] = int(gc.prompt_lookup_num_tokens)
            # transformers' PromptLookupCandidateGenerator: 2 where unset
            kw["max_matching_ngram_size"] = int(getattr(gc, "max_matching_ngram_size", None) or 2)
        kw.update(overrides)
        names = {f.name for f in fields(cls)}
        unknown = set(kw) - names
        if unknown:
            raise TypeError(f"unknown SamplingParams fields: {sorted(unknown)}")
        return cls(**kw)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _bad(who: str, name: str, value: Any, limit: str) -> ValueError:
    return ValueError(f"{who}: {name}={value!r}, must be {limit}")
