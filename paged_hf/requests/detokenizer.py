"""Incremental detokenization and stop strings.

Design notes: docs/internals.md, paged_hf/requests/detokenizer.py.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Sequence

logger = logging.getLogger("paged_hf")

_REPLACEMENT = "\ufffd"  # what a decoder gives for the bytes of an unfinished character


class IncrementalDetokenizer:
    """Text deltas of a growing token sequence, never emitting a broken UTF-8 character.

    ``context_ids`` are tokens before the output (the end of a prompt): they are decoded as
    context for the first output tokens but produce no text. The concatenated deltas equal
    ``tokenizer.decode(ids, skip_special_tokens=...)`` of the pushed ids for byte-level and
    SentencePiece tokenizers; ``finish(final_text)`` hands over whatever a decoder's clean-up
    of the whole text changed.
    """

    def __init__(
        self, tokenizer: Any, skip_special_tokens: bool = True, context_ids: Sequence[int] = ()
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(context_ids)
        # the window: ids[start:read] were decoded to complete text (head_len characters);
        # ids[read:] are new, and `pending` characters of them were already emitted
        self._start = max(0, len(self.ids) - 1)
        self._read = len(self.ids)
        self._head_len = len(self._decode(self.ids[self._start : self._read]))
        self._pending = 0
        self.emitted = ""  # every delta so far

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token: int) -> str:
        """Add one token; the text it completes ("" while a character is unfinished)."""
        self.ids.append(token)
        window = self._decode(self.ids[self._start :])
        complete = not window.endswith(_REPLACEMENT)
        end = len(window) if complete else len(window.rstrip(_REPLACEMENT))
        begin = self._head_len + self._pending
        delta = window[begin:end] if end > begin else ""
        if complete:  # the next window starts at the last token of this one
            self._start, self._read = len(self.ids) - 1, len(self.ids)
            self._head_len = len(self._decode(self.ids[self._start :]))
            self._pending = 0
        else:
            self._pending += len(delta)
        self.emitted += delta
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of ``final_text`` (the whole output decoded at once) after what was emitted:
        an unfinished character at the end, or a clean-up the decoder applied to the whole."""
        if not final_text.startswith(self.emitted):
            # only a tokenizer whose clean-up rewrites earlier text (clean_up_tokenization_spaces
            # turning "do n't" into "don't") gets here; a stream cannot take text back
            logger.warning(
                "paged_hf: streamed text %r is not a prefix of the final text %r",
                self.emitted,
                final_text,
            )
            common = os.path.commonprefix([self.emitted, final_text])
            rest, self.emitted = final_text[len(common) :], final_text
            return rest
        rest, self.emitted = final_text[len(self.emitted) :], final_text
        return rest


class StopStrings:
    """Stop-string matching over a request's output as it is generated.

    ``push(token)`` returns the stop string the token completed (the first one in the text when
    several end in the same token), or None. After a hit, ``text`` is the output cut before the
    stop string (``include=True``: after it) and ``hit`` names it.

    ``context_ids`` (the end of the prompt) let a stop string begin in the prompt and end in the
    output, which is what transformers' ``StopStringCriteria`` does (``model.generate(...,
    stop_strings=...)`` uses that, with ``skip_special_tokens=False`` as its vocabulary matching
    sees special tokens' text too); ``SamplingParams.stop`` matches in the output only, as vLLM.
    """

    def __init__(
        self,
        tokenizer: Any,
        stops: Sequence[str],
        include: bool = False,
        context_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        if not stops or not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stops)!r}")
        self.stops = tuple(stops)
        self.include = include
        self.longest = max(len(s) for s in self.stops)
        # a stop string of L characters starting in the prompt needs its last L - 1 characters;
        # a token holds at least one byte, a character at most four (and the first output token
        # is decoded after at least one prompt token, as it reads in running text)
        context = list(context_ids)[-4 * self.longest :]
        self._args = (tokenizer, context, skip_special_tokens)
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens, context)
        tail = self.detok._decode(context)
        self._context = tail[len(tail) - (self.longest - 1) :] if self.longest > 1 else ""
        self.text = ""  # the output's text so far (cut at the stop string once hit)
        self.hit: str | None = None

    def fresh(self) -> "StopStrings":
        """A matcher with the same stop strings and prompt, and no output yet (another sample)."""
        tokenizer, context_ids, skip = self._args
        return StopStrings(tokenizer, self.stops, self.include, context_ids, skip)

    def push(self, token: int) -> str | None:
        if self.hit is not None:
            raise RuntimeError("this request already stopped on a stop string")
        delta = self.detok.push(token)
        if not delta:
            return None
        before = len(self.text)
        self.text += delta
        # a new match ends in the delta (an older one would have stopped the request already),
        # so it starts at most longest - 1 characters before it: in the prompt's tail, perhaps
        back = self.longest - 1
        if before >= back:
            base, region = before - back, self.text[before - back :]
        else:
            lead = self._context[max(0, len(self._context) - (back - before)) :]
            base, region = -len(lead), lead + self.text
        best: tuple[int, str] | None = None
        for stop in self.stops:
            at = region.find(stop)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        start = base + at  # in the output's text; negative if it began in the prompt
        cut = start + len(stop) if self.include else start
        self.text = self.text[: max(0, cut)]
        self.hit = stop
        return stop

    def safe_text(self) -> str:
        """What can be shown now without ever taking it back: the text cut at the stop string
        once one was hit; before that, all but the last ``longest - 1`` characters (they may be
        the start of a stop string)."""
        if self.hit is not None:
            return self.text
        return self.text[: max(0, len(self.text) - (self.longest - 1))]
