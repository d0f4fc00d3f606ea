"""TPOT targets steer the step: while a request with a target decodes, the prefill carried beside
it is cut to what the engine's learned step-time model says keeps the target. Steps are timed on a
fake clock that a step advances by a known linear cost, so the model and the limits are exact."""

from __future__ import annotations

import pytest
from engine_state import assert_clean
from tiny_models import tiny_prompts

import paged_hf
from paged_hf import SamplingParams
from paged_hf.engine.step_time import StepTimeModel

BASE, PER_ROW, PER_TOKEN = 0.01, 0.002, 0.001  # the fake step cost


class StepClock:
    """A clock each step advances by BASE + PER_ROW * decode rows + PER_TOKEN * prefill tokens."""

    def __init__(self, engine) -> None:
        self.now = 0.0
        self.log: list[tuple[list[str], int, int]] = []  # (ids, decode rows, prefill tokens)
        execute = engine.runner.execute

        def timed(scheduled, copies):
            rows = sum(1 for r, n in scheduled if n == 1 and r.num_output_tokens > 0)
            prefill = sum(n for _, n in scheduled) - rows
            self.now += BASE + PER_ROW * rows + PER_TOKEN * prefill
            self.log.append(([r.request_id for r, _ in scheduled], rows, prefill))
            return execute(scheduled, copies)

        engine.runner.execute = timed
        engine.scheduler.clock = self

    def __call__(self) -> float:
        return self.now


def test_the_model_learns_a_linear_step_cost():
    model = StepTimeModel()
    assert model.prefill_within(0.05, 4, floor=4) is None, "no prediction before data"
    for rows, prefill in [(1, 0), (4, 0), (2, 30), (8, 100), (3, 0), (5, 64), (7, 0), (2, 200)]:
        model.observe(rows, prefill, BASE + PER_ROW * rows + PER_TOKEN * prefill)
    assert model.predict(10, 50) == pytest.approx(BASE + PER_ROW * 10 + PER_TOKEN * 50)
    assert model.prefill_within(0.05, 5, floor=4) == 30  # 0.01 + 0.01 + 0.030
    assert model.prefill_within(0.015, 5, floor=4) == 4, "prompts still move"


def run(model, target):
    engine = paged_hf.Engine(
        model,
        block_size=4,
        num_blocks=256,
        max_num_batched_tokens=256,
        max_num_seqs=8,
        max_prefill_tokens_while_decoding=None,
    )
    clock = StepClock(engine)
    vocab = model.config.vocab_size
    # steps of varied shape first: the model is fitted before the measured part
    engine.generate(
        tiny_prompts(vocab, 6, [40, 9, 220, 3, 150, 60], seed=1), SamplingParams(max_new_tokens=8)
    )
    assert engine.scheduler.step_time.coef is not None, "fitted before the measured part"
    prompts = tiny_prompts(vocab, 4, [8, 200, 180, 220], seed=2)
    chat = SamplingParams(max_new_tokens=12, ignore_eos=True, tpot_target_s=target)
    batch = SamplingParams(max_new_tokens=6, ignore_eos=True)
    engine.add_request(prompts[0], chat, "chat")
    engine.step()
    engine.step()  # chat decodes from here on
    for i, p in enumerate(prompts[1:]):
        engine.add_request(p, batch, f"batch{i}")
    start = len(clock.log)
    outputs = {}
    while engine.has_unfinished:
        for req in engine.step()[1]:
            outputs[req.request_id] = engine.collect([req])
    assert_clean(engine)
    return outputs, clock.log[start:]


def test_a_tpot_target_bounds_the_prefill_beside_its_decodes(model):
    free, free_log = run(model, None)
    kept, kept_log = run(model, 0.05)
    # no target: a step carries up to the whole budget of prefill beside chat's decode
    assert max(p for ids, _, p in free_log if "chat" in ids) > 200
    # with one: every step that decodes chat costs at most the target on the fake clock
    chat_steps = [(rows, p) for ids, rows, p in kept_log if "chat" in ids]
    assert chat_steps and all(
        BASE + PER_ROW * r + PER_TOKEN * p <= 0.05 + 1e-6 for r, p in chat_steps
    )
    # the longest gap between chat's tokens: a whole budget of prefill without the target
    assert free["chat"].max_itl > 0.2 and kept["chat"].max_itl <= 0.05 + 1e-6
    assert kept["chat"].tpot <= 0.05
    # the batch work still finishes, with the same tokens (fp64 greedy)
    assert {k: o.token_ids for k, o in kept.items()} == {k: o.token_ids for k, o in free.items()}
    # once chat is done the prefill is no longer held back
    last_chat = max(i for i, (ids, _, _) in enumerate(kept_log) if "chat" in ids)
    assert max(p for _, _, p in kept_log[last_chat + 1 :]) > 100


def test_an_engine_wide_target_applies_to_requests_without_their_own(model):
    engine = paged_hf.Engine(model, block_size=4, num_blocks=64, tpot_target_s=0.2)
    prompts = tiny_prompts(model.config.vocab_size, 2, [5, 6], seed=3)
    engine.add_request(prompts[0], SamplingParams(max_new_tokens=3), "default")
    engine.add_request(prompts[1], SamplingParams(max_new_tokens=3, tpot_target_s=0.5), "own")
    assert engine.requests["default"].tpot_target_s == 0.2
    assert engine.requests["own"].tpot_target_s == 0.5
    with pytest.raises(ValueError, match="tpot_target_s=0"):
        paged_hf.Engine(model, tpot_target_s=0)
    with pytest.raises(ValueError, match="tpot_target_s=-1, must be None or a number of sec"):
        SamplingParams(tpot_target_s=-1)
