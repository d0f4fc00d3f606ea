"""Structured outputs: a request's output constrained to a JSON schema, a regular expression, a
list of choices or an EBNF grammar, through xgrammar (``pip install paged_hf[structured]``).

Design notes: docs/internals.md, paged_hf/engine/structured.py.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch

INSTALL_HINT = "pip install 'paged_hf[structured]' (xgrammar)"


def _ebnf_literal(text: str) -> str:
    return (
        '"'
        + text.replace("\\", "\\\\")
        .replace('"', '\\"')
        .replace("\n", "\\n")
        .replace("\r", "\\r")
        .replace("\t", "\\t")
        + '"'
    )


class StructuredOutputs:
    """One engine's grammar compiler, compiled-grammar cache and per-step mask."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        try:
            import xgrammar
        except ImportError as e:
            raise ValueError(
                f"structured outputs need xgrammar, which is not installed ({e}); {INSTALL_HINT}"
            ) from None
        self.xgr = xgrammar
        self.vocab_size = vocab_size
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(info)
        self._compiled: dict[tuple[str, str], Any] = {}
        self.compile_s = 0.0
        self.mask_s = 0.0
        self.masked_rows = 0

    def compiled(self, kind: str, text: str) -> Any:
        key = (kind, text)
        grammar = self._compiled.get(key)
        if grammar is None:
            start = time.perf_counter()
            # compact JSON: small models given free whitespace loop on newlines
            if kind == "json_schema":
                grammar = self.compiler.compile_json_schema(text, any_whitespace=False)
            elif kind == "regex":
                grammar = self.compiler.compile_regex(text)
            elif kind == "grammar":
                grammar = self.compiler.compile_grammar(text)
            elif kind == "choice":
                grammar = self.compiler.compile_grammar(
                    "root ::= " + " | ".join(_ebnf_literal(c) for c in json.loads(text))
                )
            else:
                raise ValueError(f"unknown constraint kind {kind!r}")
            self.compile_s += time.perf_counter() - start
            self._compiled[key] = grammar
        return grammar

    def matcher(self, kind: str, text: str) -> Any:
        return self.xgr.GrammarMatcher(self.compiled(kind, text))

    def apply(self, logits: torch.Tensor, matchers: dict[int, Any], errors: dict[int, str]) -> None:
        """Mask ``logits`` [B, V] in place: row i to what ``matchers[i]`` allows next."""
        if not matchers:
            return
        start = time.perf_counter()
        rows = sorted(matchers)
        bitmask = self.xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)
        filled = []
        for i in rows:
            try:
                matchers[i].fill_next_token_bitmask(bitmask, i)
                filled.append(i)
            except Exception as e:  # noqa: BLE001 - this row's grammar, no one else's
                errors[i] = f"its structured-output grammar failed: {type(e).__name__}: {e}"
        if filled:
            device = logits.device
            self.xgr.apply_token_bitmask_inplace(logits, bitmask.to(device), indices=filled)
        self.mask_s += time.perf_counter() - start
        self.masked_rows += len(filled)

    def stats(self) -> dict[str, Any]:
        return {
            "structured_grammars": len(self._compiled),
            "structured_compile_s": self.compile_s,
            "structured_mask_s": self.mask_s,
            "structured_masked_rows": self.masked_rows,
        }
