"""transformers as the oracle, for tests: asserting wrappers over ``paged_hf.model.oracle``, the
teacher-forced checks the support sweep judges by too."""

from __future__ import annotations

import torch

from paged_hf.model.oracle import (
    LOGPROB_TOL,
    TOKEN_TOL,
    incremental_logits,
    logprob_errors,
    reference_logits,
    token_violations,
)

FP32_TOL = TOKEN_TOL
teacher_forced_violations = token_violations


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
    assert all(top for _, top in logprobs), f"{what}: a step has no top logprobs"
    expected = torch.log_softmax(reference_logits(reference, prompt, generated), dim=-1)
    bad = [(i, err) for i, err in logprob_errors(expected, generated, logprobs) if err > tol]
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
    whole = torch.log_softmax(reference_logits(reference, prompt, generated), dim=-1)
    tol = max(tol, 1.5 * float((whole - expected).abs().max()))
    bad = [(i, err) for i, err in logprob_errors(expected, generated, logprobs) if err > tol]
    assert not bad, (
        f"{what}: logprobs off transformers' incremental ones by more than {tol:.1e} "
        f"(step, error): {bad[:5]}"
    )


@torch.no_grad()
def incremental_logprobs(
    reference: torch.nn.Module, prompt: list[int], generated: list[int]
) -> torch.Tensor:
    """[len(generated), vocab] log-softmax of transformers' incremental path, teacher-forced."""
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

    logits = reference_logits(reference, prompt, generated)
    processors = LogitsProcessorList(processors)
    bad = []
    for i, tok in enumerate(generated):
        scores = processors(torch.tensor([row + generated[:i]]), logits[i : i + 1].clone())[0]
        gap = float(scores.max() - scores[tok])
        if gap > tol:
            bad.append((i, tok, int(scores.argmax()), gap))
    return bad


def assert_hidden_states_close(
    ours, theirs, mask: torch.Tensor, eos: int, tol: float = 1e-4
) -> None:
    """``output_hidden_states`` of two generate outputs agree (``tol``, absolute) at every position
    both compute: the prompt's real tokens in the first entry, then each row's generated tokens
    until it ends (after that transformers runs pad tokens, a patched model nothing: zeros)."""
    width = mask.shape[1]
    generated = theirs.sequences[:, width:]
    assert len(ours.hidden_states) == len(theirs.hidden_states) == generated.shape[1]
    for step, (a, b) in enumerate(zip(ours.hidden_states, theirs.hidden_states)):
        assert len(a) == len(b)
        if step == 0:
            keep = mask.bool()
        else:  # the token fed at step j is the row's j-1th; a row that made EOS before is over
            keep = ~(generated[:, :step] == eos).any(dim=1, keepdim=True)
        for x, y in zip(a, b):
            assert x.shape == y.shape, (step, x.shape, y.shape)
            gap = float((x[keep] - y[keep]).abs().max()) if keep.any() else 0.0
            assert gap < tol, f"step {step}: hidden states {gap:.2e} apart"
            assert not x[~keep].any(), f"step {step}: states where nothing was computed"
