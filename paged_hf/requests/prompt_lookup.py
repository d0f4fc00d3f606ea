"""Prompt lookup: the tokens a request is likely to write next, read from what it has written
and read before (transformers' ``PromptLookupCandidateGenerator``, Saxena 2023). The last ``n``
tokens (``n`` from ``max_ngram`` down to 1) are searched for earlier in the sequence; the tokens
that followed their first match are the proposal, cut before any EOS. A proposal costs a
search of the sequence on the host; a wrong one costs only the positions verified in vain.
"""

from __future__ import annotations

from typing import Sequence


def propose(
    tokens: Sequence[int], k: int, max_ngram: int, stop_ids: frozenset[int] = frozenset()
) -> list[int]:
    """Up to ``k`` tokens that followed the first earlier match of the longest matching tail
    of ``tokens`` (an n-gram of ``max_ngram`` down to 1 tokens); none without a match."""
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), 0, -1):
        tail = list(tokens[length - n :])
        first = tail[0]
        for start in range(length - n):  # an earlier occurrence, the tail itself excluded
            if tokens[start] != first or list(tokens[start : start + n]) != tail:
                continue
            follow = list(tokens[start + n : min(start + n + k, length)])
            if not follow:
                continue
            for i, t in enumerate(follow):
                if t in stop_ids:
                    return follow[:i]
            return follow
    return []
