"""State slots' renumbering (paged_hf/cache/state_slots.py): before every step of a hybrid model,
the decode batch is moved to slots 0..N-1 so its mixers update the states in place; each move
carries a state with its request. Random schedules of takes, give-backs and renumberings, with
the slots' memory simulated: every request must keep its own state, in a slot only it holds."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from paged_hf.cache.state_slots import StateSlots
from paged_hf.requests.request import Request
from paged_hf.requests.sampling_params import SamplingParams


def _check(slots: StateSlots, live: list[Request], memory: list) -> None:
    owned = {r.state_slot for r in live}
    assert len(owned) == len(live), "two requests share a slot"
    assert sorted(owned | set(slots._free)) == list(range(slots.num_slots)) and not owned & set(
        slots._free
    )
    assert slots.num_used == len(live)
    for r in live:
        assert memory[r.state_slot] == r.request_id, "a request's state did not move with it"


@settings(max_examples=200, deadline=None)
@given(
    num_slots=st.integers(1, 12),
    ops=st.lists(st.tuples(st.sampled_from("tgr"), st.integers(0, 2**16)), max_size=60),
)
def test_renumbering_moves_each_state_with_its_request(num_slots, ops):
    slots = StateSlots(num_slots)
    memory: list = [None] * num_slots  # what each slot's state is: its owner's id
    live: list[Request] = []
    for n, (op, pick) in enumerate(ops):
        if op == "t" and slots.num_free:
            req = Request(f"r{n}", [1, 2], SamplingParams())
            memory[slots.take(req)] = req.request_id  # its first step writes its state
            live.append(req)
        elif op == "g" and live:
            slots.give_back(live.pop(pick % len(live)))
        elif op == "r" and live:
            decoding = [r for k, r in enumerate(live) if (pick >> k) & 1]
            moves = slots.plan_front(decoding)
            moved = [memory[r.state_slot] for r, _ in moves]  # copied together, as copy_slots does
            for (_, slot), state in zip(moves, moved):
                memory[slot] = state
            slots.renumber(moves)
            assert sorted(r.state_slot for r in decoding) == list(range(len(decoding)))
            assert len(moves) <= 2 * len(decoding)
        _check(slots, live, memory)


def test_taking_hands_out_the_lowest_free_slot():
    slots = StateSlots(4)
    reqs = [Request(f"r{i}", [1], SamplingParams()) for i in range(4)]
    assert [slots.take(r) for r in reqs[:3]] == [0, 1, 2]
    slots.give_back(reqs[1])
    slots.give_back(reqs[0])
    assert slots.take(reqs[3]) == 0
