"""transformers as the oracle: teacher-forced checks of what the engine generated.

A generated token passes if, given the same prefix, the reference scores it within ``TOKEN_TOL``
of its best logit (tiny random models are full of near-ties; a wrong cache or mask moves logits
far more). A logprob passes within ``LOGPROB_TOL`` of the reference's log-softmax. The support
sweep and the tests both judge through these functions.
"""

from __future__ import annotations

import inspect

import torch

TOKEN_TOL = 1e-3  # a generated token's logit may trail the reference's best by this much
LOGPROB_TOL = 1e-4  # |engine logprob - reference log-softmax| (fp32)


@torch.no_grad()
def reference_logits(
    reference: torch.nn.Module, prompt: list[int], generated: list[int]
) -> torch.Tensor:
    """[len(generated), vocab] fp32 logits the reference gives each generated position, from one
    forward over the whole sequence."""
    ids = torch.tensor([prompt + generated])
    logits = reference(input_ids=ids, use_cache=False).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)]


def violations_in(
    logits: torch.Tensor, generated: list[int], tol: float = TOKEN_TOL
) -> list[tuple[int, int, int, float]]:
    """(step, generated token, reference argmax, logit gap) for every step whose token trails the
    best of ``logits`` by more than ``tol``."""
    if not generated:
        return []
    chosen = logits[torch.arange(len(generated)), torch.tensor(generated)]
    best, argmax = logits.max(dim=-1)
    gap = best - chosen
    return [
        (i, generated[i], int(argmax[i]), float(gap[i]))
        for i in range(len(generated))
        if gap[i] > tol
    ]


def token_violations(
    reference: torch.nn.Module, prompt: list[int], generated: list[int], tol: float = TOKEN_TOL
) -> list[tuple[int, int, int, float]]:
    """``violations_in`` the reference's teacher-forced logits."""
    if not generated:
        return []
    return violations_in(reference_logits(reference, prompt, generated), generated, tol)


def logprob_errors(
    expected: torch.Tensor, generated: list[int], logprobs: list
) -> list[tuple[int, float]]:
    """(step, worst error) of the engine's logprobs (per token: (chosen, {token: logprob} top-k))
    against ``expected`` ([steps, vocab] log-softmax), over the chosen token and the top-k."""
    errors = []
    for i, (tok, (chosen, top)) in enumerate(zip(generated, logprobs)):
        diffs = [abs(chosen - float(expected[i, tok]))]
        diffs += [abs(v - float(expected[i, t])) for t, v in top.items()]
        errors.append((i, max(diffs)))
    return errors


@torch.no_grad()
def incremental_logits(
    reference: torch.nn.Module, prompt: list[int], gen: list[int]
) -> torch.Tensor:
    """The logits transformers' generate computes for ``gen``, teacher-forced: the prompt with the
    cache the model builds for itself (transformers' DynamicCache, or its own class: MiniMax's),
    then one token at a time through it (positions given, as generate gives them).

    For stateful layers this is another algorithm than the whole sequence's forward (Mamba2's
    recurrent update against its chunked scan); the engine decodes as generate does."""
    params = inspect.signature(reference.forward).parameters
    name = "cache" if "cache" in params else "past_key_values"
    out = reference(
        input_ids=torch.tensor([prompt]),
        position_ids=torch.arange(len(prompt))[None],
        use_cache=True,
    )
    rows, cache = [out.logits[0, -1]], out[name]
    for i, tok in enumerate(gen[:-1]):
        step = reference(
            input_ids=torch.tensor([[tok]]),
            position_ids=torch.tensor([[len(prompt) + i]]),
            **{name: cache},
            use_cache=True,
        )
        rows.append(step.logits[0, -1])
    return torch.stack(rows).float()
