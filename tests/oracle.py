"""transformers as the oracle: teacher-forced checks of generated tokens.

A generated token passes if, given the same prefix, the reference model scores it within
``tol`` of its best logit. Exact-argmax comparisons would make tests flaky on the near-ties
tiny random models are full of; a wrong cache or mask moves logits far more than ``tol``.
"""

from __future__ import annotations

import torch

FP32_TOL = 1e-3


@torch.no_grad()
def teacher_forced_violations(
    reference: torch.nn.Module, prompt: list[int], generated: list[int], tol: float
) -> list[tuple[int, int, int, float]]:
    """(step, generated token, reference argmax, logit gap) for every step past ``tol``."""
    if not generated:
        return []
    ids = torch.tensor([prompt + generated])
    logits = reference(ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(generated)].float()
    chosen = logits[torch.arange(len(generated)), torch.tensor(generated)]
    best, argmax = logits.max(dim=-1)
    gap = best - chosen
    return [
        (i, generated[i], int(argmax[i]), float(gap[i]))
        for i in range(len(generated))
        if gap[i] > tol
    ]


def assert_teacher_forced(
    reference: torch.nn.Module,
    prompt: list[int],
    generated: list[int],
    tol: float = FP32_TOL,
    what: str = "",
) -> None:
    bad = teacher_forced_violations(reference, prompt, generated, tol)
    assert not bad, (
        f"{what}: tokens the reference would not pick (step, token, argmax, gap): {bad[:5]}"
    )


LOGPROB_TOL = 1e-4  # fp32: the engine's logprobs against the reference's log-softmax


@torch.no_grad()
def assert_logprobs_close(
    reference: torch.nn.Module,
    prompt: list[int],
    generated: list[int],
    logprobs: list,
    tol: float = LOGPROB_TOL,
    what: str = "",
) -> None:
    """The engine's logprobs of a generation (per token: (chosen, {token: logprob} top-k)) equal
    the reference's log-softmax at the same steps, teacher-forced, within ``tol``."""
    assert len(logprobs) == len(generated), (
        f"{what}: {len(logprobs)} logprob entries for {len(generated)} tokens"
    )
    if not generated:
        return
    ids = torch.tensor([prompt + generated])
    logits = reference(input_ids=ids, use_cache=False).logits[
        0, len(prompt) - 1 : len(prompt) - 1 + len(generated)
    ]
    expected = torch.log_softmax(logits.float(), dim=-1)
    worst = []
    for i, (tok, (chosen, top)) in enumerate(zip(generated, logprobs)):
        assert top, f"{what}: step {i} has no top logprobs"
        errors = [abs(chosen - float(expected[i, tok]))] + [
            abs(v - float(expected[i, t])) for t, v in top.items()
        ]
        worst.append((max(errors), i))
    bad = [(i, err) for err, i in worst if err > tol]
    assert not bad, (
        f"{what}: logprobs off the reference's by more than {tol} (step, error): {bad[:5]}"
    )


@torch.no_grad()
def assert_logprobs_close_incremental(
    reference: torch.nn.Module,
    prompt: list[int],
    generated: list[int],
    logprobs: list,
    tol: float = LOGPROB_TOL,
    what: str = "",
) -> None:
    """As ``assert_logprobs_close``, against transformers' own incremental path (its ``generate``'s: the
    prompt with a cache, then one token at a time), teacher-forced with ``generated``. For stateful
    models the two paths are different algorithms (Mamba2's chunked scan over a whole sequence, its
    recurrent update per token), whose fp32 results part by up to ~5e-4 on tiny models; the engine
    decodes as transformers' generate does, so this is the oracle its logprobs answer to."""
    assert len(logprobs) == len(generated), (
        f"{what}: {len(logprobs)} logprob entries for {len(generated)} tokens"
    )
    expected = incremental_logprobs(reference, prompt, generated)
    # where transformers' own two paths part by more than ``tol`` (Mamba2's scan against its
    # recurrence), the engine's chunk boundaries may land it anywhere between them
    ids = torch.tensor([prompt + generated])
    whole = torch.log_softmax(
        reference(input_ids=ids)
        .logits[0, len(prompt) - 1 : len(prompt) - 1 + len(generated)]
        .float(),
        dim=-1,
    )
    tol = max(tol, 1.5 * float((whole - expected).abs().max()))
    bad = []
    for i, (tok, (chosen, top)) in enumerate(zip(generated, logprobs)):
        errors = [abs(chosen - float(expected[i, tok]))] + [
            abs(v - float(expected[i, t])) for t, v in top.items()
        ]
        if max(errors) > tol:
            bad.append((i, max(errors)))
    assert not bad, (
        f"{what}: logprobs off transformers' incremental ones by more than {tol:.1e} (step, error): {bad[:5]}"
    )


@torch.no_grad()
def incremental_logprobs(
    reference: torch.nn.Module, prompt: list[int], generated: list[int]
) -> torch.Tensor:
    """[len(generated), vocab] log-softmax of transformers' incremental path, teacher-forced."""
    from paged_hf.model.support import incremental_logits

    return torch.log_softmax(incremental_logits(reference, prompt, generated), dim=-1)


@torch.no_grad()
def processed_violations(
    reference: torch.nn.Module,
    row: list[int],
    prompt: list[int],
    generated: list[int],
    processors: list,
    tol: float = FP32_TOL,
) -> list[tuple[int, int, int, float]]:
    """As ``teacher_forced_violations``, against the reference's logits after transformers' own logits
    ``processors``, called as its generate calls them: on ``row`` (the prompt as the caller padded
    it) followed by the tokens generated so far."""
    if not generated:
        return []
    from transformers import LogitsProcessorList

    ids = torch.tensor([prompt + generated])
    logits = reference(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 :].float()
    processors = LogitsProcessorList(processors)
    bad = []
    for i, tok in enumerate(generated):
        scores = processors(torch.tensor([row + generated[:i]]), logits[i : i + 1].clone())[0]
        gap = float(scores.max() - scores[tok])
        if gap > tol:
            bad.append((i, tok, int(scores.argmax()), gap))
    return bad
