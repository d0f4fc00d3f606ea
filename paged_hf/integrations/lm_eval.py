"""lm-evaluation-harness backend: ``--model paged_hf``.

Design notes: docs/internals.md, paged_hf/integrations/lm_eval.py.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import (
        handle_stop_sequences,
        normalize_gen_kwargs,
        postprocess_generated_text,
    )
except ImportError as _err:  # pragma: no cover - the message is the point
    raise ImportError(
        "paged_hf.integrations.lm_eval needs lm-evaluation-harness: pip install 'paged_hf[eval]' "
        f"(lm-eval==0.4.13) ({_err})"
    ) from _err

from ..engine.scoring import prefix_token_id, rolling_windows
from ..model.generate_assistant import DEFAULT_ASSISTANT_TOKENS
from ..requests.sampling_params import SamplingParams
from .lm_eval_engine import ENGINE_OPTIONS, engine_for_eval, special_kwargs, use_draft_for_eval

logger = logging.getLogger("paged_hf")

# generation kwargs of lm-eval tasks that map onto SamplingParams (do_sample and temperature are
# read first); anything else is refused, never silently ignored
_SAMPLING_KWARGS = {"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed"}
# speculative decoding, as transformers' generate takes it (``--gen_kwargs prompt_lookup_num_tokens=10``;
# ``num_assistant_tokens`` with the ``draft_model`` model arg, 20 where unset)
_SPECULATION_KWARGS = {
    "prompt_lookup_num_tokens",
    "max_matching_ngram_size",
    "num_assistant_tokens",
}


@register_model("paged_hf")
class PagedHFLM(TemplateLM):
    """lm-evaluation-harness backend running a transformers causal LM through ``paged_hf``.

    >>> import lm_eval
    >>> from paged_hf.integrations.lm_eval import PagedHFLM
    >>> from paged_hf.model.default_model import load_default_model
    >>> model, tok = load_default_model()
    >>> lm = PagedHFLM(pretrained=model, tokenizer=tok, max_num_seqs=64)
    >>> tasks = lm_eval.tasks.TaskManager(include_path="my_tasks/")   # YAML tasks on disk
    >>> lm_eval.simple_evaluate(model=lm, tasks=["my_task"], task_manager=tasks)["results"]
    """

    backend = "causal"

    def __init__(
        self,
        pretrained: Any = "default",
        tokenizer: Any = None,
        dtype: str | torch.dtype = "auto",
        device: str | None = None,
        batch_size: int | str | None = None,
        max_batch_size: int | None = None,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        truncation: bool = False,
        revision: str | None = None,
        trust_remote_code: bool = False,
        gguf_file: str | None = None,
        chat_template_args: dict | None = None,
        think_end_token: str | int | None = None,
        tp_size: int = 1,
        draft_model: Any = None,
        **engine_options: Any,
    ) -> None:
        super().__init__()
        unknown = sorted(set(engine_options) - ENGINE_OPTIONS)
        if unknown:
            raise TypeError(
                f"paged_hf: unknown model_args {unknown}; known: the lm-eval options in "
                f"docs/internals.md (paged_hf/integrations/lm_eval.py) and the engine options {sorted(ENGINE_OPTIONS)}"
            )
        self.engine, model, tokenizer = engine_for_eval(
            pretrained,
            tokenizer,
            dtype,
            device,
            batch_size,
            max_batch_size,
            revision,
            trust_remote_code,
            gguf_file,
            engine_options,
            int(tp_size),
        )
        if tokenizer is None:
            raise ValueError(
                "paged_hf: lm-eval passes text, so a tokenizer is needed (tokenizer=...)"
            )
        if self.engine.tokenizer is None:
            self.engine.tokenizer = tokenizer  # stop strings are read with it
        use_draft_for_eval(self.engine, draft_model, dtype, device, revision, trust_remote_code)
        self.model = model
        self.tokenizer = tokenizer
        self._device = next(model.parameters()).device
        self._max_length = max_length
        self._max_gen_toks = max_gen_toks
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self.truncation = truncation
        self.chat_template_args = chat_template_args or {}
        self.think_end_token = _token_or_id(think_end_token)
        self.pretrained = (
            pretrained if isinstance(pretrained, str) else getattr(model, "name_or_path", "")
        )
        if self.max_length > self.engine.max_model_len:
            raise ValueError(
                f"paged_hf: max_length={self.max_length} exceeds the engine's max_model_len="
                f"{self.engine.max_model_len}"
            )

    # ---- what lm-eval reads ---------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        return prefix_token_id(self.tokenizer)  # BOS, else EOS, as Engine.score_rolling

    @property
    def max_length(self) -> int:
        return self._max_length or self.engine.max_model_len

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self.engine.config.max_num_seqs

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "") or "").replace("/", "__")

    def get_model_info(self) -> dict:
        return {
            "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
            "model_dtype": str(next(self.model.parameters()).dtype),
            "paged_hf_engine": {
                k: getattr(self.engine.config, k)
                for k in (
                    "max_num_seqs",
                    "max_num_batched_tokens",
                    "block_size",
                    "enable_prefix_caching",
                )
            },
        }

    def tok_encode(
        self,
        string: str,
        add_special_tokens: bool | None = None,
        left_truncate_len: int | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """As lm-eval's ``hf`` backend: the tokenizer's own special tokens unless told otherwise
        (``add_bos_token``), none when the text already starts with the BOS text."""
        special = special_kwargs(add_special_tokens, self.add_bos_token)
        if add_special_tokens is None and string.startswith(
            self.tokenizer.decode(self.prefix_token_id)
        ):
            special["add_special_tokens"] = False
        ids = list(self.tokenizer.encode(string, **special))
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: Any, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The tokenizer's chat template, as lm-eval's ``hf`` backend applies it (a template that
        refuses a system message gets the history without it)."""
        import jinja2

        kwargs = dict(
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
            **self.chat_template_args,
        )
        try:
            return self.tokenizer.apply_chat_template(chat_history, **kwargs)
        except jinja2.exceptions.TemplateError:
            logger.warning(
                "paged_hf: the chat template failed; trying again without the system message"
            )
            return self.tokenizer.apply_chat_template(
                [m for m in chat_history if m["role"] != "system"], **kwargs
            )

    # ---- the three request types ------------------------------------------------------------------
    def _loglikelihood_tokens(
        self, requests: list, disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """(logprob, is greedy) of each (key, context ids, continuation ids), through ``Engine.score``.
        Requests with the same context are submitted together so its KV is computed once."""
        pairs = []
        for _key, ctx, cont in requests:
            if not ctx or not cont:
                raise ValueError(
                    f"paged_hf: empty context or continuation ({len(ctx)}, {len(cont)} tokens)"
                )
            if len(cont) > self.max_length:
                raise ValueError(
                    f"paged_hf: a continuation of {len(cont)} tokens exceeds max_length={self.max_length}"
                )
            whole = (ctx + cont)[
                -(self.max_length + 1) :
            ]  # lm-eval truncates from the left, so do we
            pairs.append((whole[: len(whole) - len(cont)], cont))
        results = self._score(pairs, disable_tqdm)
        for (key, _ctx, _cont), answer in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def _score(
        self, pairs: list[tuple[list[int], list[int]]], disable_tqdm: bool
    ) -> list[tuple[float, bool]]:
        first_seen: dict[tuple, int] = {}
        order = sorted(
            range(len(pairs)), key=lambda i: first_seen.setdefault(tuple(pairs[i][0]), i)
        )
        outs = self.engine.score([pairs[i] for i in order], progress=not disable_tqdm)
        results: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
        for i, out in zip(order, outs):
            if out.error is not None:
                raise RuntimeError(f"paged_hf: scoring failed: {out.error}")
            results[i] = (out.logprob, out.is_greedy)
        return results

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Each text's loglikelihood over lm-eval's disjoint rolling windows of ``max_length``."""
        pairs, counts = [], []
        for (text,) in [req.args for req in requests]:
            windows = rolling_windows(self.tok_encode(text), self.max_length, self.prefix_token_id)
            pairs.extend(windows)
            counts.append(len(windows))
        scored = self._score(pairs, disable_tqdm)
        totals, at = [], 0
        for req, n in zip(requests, counts):
            total = sum(lp for lp, _ in scored[at : at + n])
            at += n
            totals.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Generation with ``until`` as stop strings, ``max_gen_toks`` new tokens at most, and the
        task's sampling kwargs; the text is post-processed as lm-eval's ``hf`` backend does."""
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        prompts, params, untils = [], [], []
        for context, gen_kwargs in [req.args for req in requests]:
            kwargs = normalize_gen_kwargs(copy.deepcopy(gen_kwargs), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen = kwargs.pop("max_gen_toks")
            if max_gen >= self.max_length:
                raise ValueError(
                    f"paged_hf: max_gen_toks={max_gen} leaves no room for a context in "
                    f"max_length={self.max_length}"
                )
            ids = self.tok_encode(context, left_truncate_len=self.max_length - max_gen)
            prompts.append(ids)
            stops = [s for s in until if s]
            params.append(_sampling_params(kwargs, max_gen, stops, self.engine.scheduler.drafter))
            untils.append(until)
        outs = self.engine.generate(prompts, params, progress=not disable_tqdm)
        results = []
        for req, out, until in zip(requests, outs, untils):
            if out.error is not None:
                raise RuntimeError(f"paged_hf: generation failed: {out.error}")
            text = out.text or ""
            if isinstance(self.think_end_token, int) and self.think_end_token in out.token_ids:
                last = len(out.token_ids) - 1 - out.token_ids[::-1].index(self.think_end_token)
                text = self.tok_decode(out.token_ids[last + 1 :]).lstrip()
            text = postprocess_generated_text(
                text, until, self.think_end_token if isinstance(self.think_end_token, str) else None
            )
            results.append(text)
            self.cache_hook.add_partial("generate_until", req.args, text)
        return results


# ---- helpers ----------------------------------------------------------------------------------------


def _sampling_params(
    kwargs: dict, max_new_tokens: int, stop: list[str], drafter: Any = None
) -> SamplingParams:
    do_sample = bool(kwargs.pop("do_sample", False))
    temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
    unknown = sorted(set(kwargs) - _SAMPLING_KWARGS - _SPECULATION_KWARGS)
    if unknown:
        raise NotImplementedError(
            f"paged_hf: generation kwargs {unknown} are not supported (supported: until, "
            f"max_gen_toks, do_sample, {', '.join(sorted(_SAMPLING_KWARGS | _SPECULATION_KWARGS))})"
        )
    fields: dict[str, Any] = {}
    if do_sample:
        fields["temperature"] = temperature if temperature > 0 else 1.0
        for name in ("top_p", "top_k", "min_p"):
            if kwargs.get(name) is not None:
                fields[name] = kwargs[name]
    if kwargs.get("repetition_penalty") is not None:
        fields["repetition_penalty"] = float(kwargs["repetition_penalty"])
    if kwargs.get("seed") is not None:
        fields["seed"] = int(kwargs["seed"])
    for name in _SPECULATION_KWARGS:
        if kwargs.get(name) is not None:
            fields[name] = int(kwargs[name])
    if drafter is not None and not fields.keys() & {
        "prompt_lookup_num_tokens",
        "num_assistant_tokens",
    }:
        fields["num_assistant_tokens"] = DEFAULT_ASSISTANT_TOKENS  # the draft_model model arg's
    return SamplingParams(max_new_tokens=max_new_tokens, stop=stop, **fields)


def _token_or_id(token: str | int | None) -> str | int | None:
    """lm-eval's ``think_end_token``: a token id where the model arg is all digits."""
    return int(token) if isinstance(token, str) and token.isdigit() else token


def run_cli(argv: list[str]) -> int:
    """lm-eval's command line (``lm-eval ...``) with this backend registered; its exit code."""
    import sys

    from lm_eval.__main__ import cli_evaluate

    old = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        cli_evaluate()
    except SystemExit as exit_:
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv = old
    return 0


def wrap(model: torch.nn.Module, tokenizer: Any, **options: Any) -> PagedHFLM:
    """An lm-eval ``LM`` over a model you already loaded (patched or not); ``options`` are
    ``PagedHFLM``'s (``max_num_seqs=64``, ``max_gen_toks=128``, ...).

    >>> lm = paged_hf.integrations.lm_eval.wrap(model, tokenizer)
    >>> lm_eval.simple_evaluate(model=lm, tasks=["my_task"], task_manager=lm_eval.tasks.TaskManager(include_path="tasks/"))
    """
    return PagedHFLM(pretrained=model, tokenizer=tokenizer, **options)


__all__ = ["PagedHFLM", "run_cli", "wrap"]
