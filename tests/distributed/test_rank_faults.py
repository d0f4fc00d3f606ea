"""Tensor parallelism's failure model (issue 57): a forward that fails on rank 1, and rank 1
killed in the middle of a call. The surviving ranks end the call within seconds, not at the
process group's timeout (60 s here, two hours as transformers starts it), with the call's
requests ended and named on every rank alike; later calls raise ``RankError`` naming the failed
step instead of hanging; no block leaks."""

from pathlib import Path

from spmd_launch import launch
from tiny_models import make_tiny_model

WORKER = Path(__file__).with_name("fault_worker.py")
BOUND_S = 20  # far under the group's 60 s timeout and the messages' 30 s (tp_timeout_s)


def job(tmp: Path, fault: str) -> dict:
    model = make_tiny_model("llama")
    model.save_pretrained(tmp / "llama")
    return {
        "path": str(tmp / "llama"),
        "fault": fault,
        "prompts": [[5, 9, 13, 2, 7], [11, 3, 8]],
        "max_new_tokens": 6,
        "tp_timeout_s": 30,
    }


def test_a_forward_failing_on_one_rank_ends_the_call_on_every_rank(tmp_path):
    """Rank 1's forward raises inside a call: both ranks' calls raise within seconds naming the
    failed step (the model's group is the whole world here, so it goes with every group), and so
    does every later call; nothing is left in the engines."""
    ranks = launch(WORKER, job(tmp_path, "raise"), tmp_path)
    for rank, r in enumerate(ranks):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
        for call in ("call", "next"):
            assert "RankError" in r[call]["raised"], (rank, call, r[call])
            assert "a forward failed" in r[call]["raised"], (rank, call, r[call])
            assert "restart every rank" in r[call]["raised"]
        assert "injected: rank 1's forward failed" in ranks[1]["call"]["raised"]
        assert r["call"]["seconds"] < BOUND_S and r["next"]["seconds"] < 1
        assert r["blocks_used"] == 0 and r["requests_left"] == 0


def test_a_killed_rank_fails_the_survivors_call_within_a_bound(tmp_path):
    leader, killed = launch(WORKER, job(tmp_path, "kill"), tmp_path, exits={1: 3})
    assert killed is None
    assert "error" not in leader, leader.get("error")
    call = leader["call"]
    assert call["seconds"] < BOUND_S
    # the step's requests end with an error, or the call raises naming the lost rank
    assert "RankError" in call.get("raised", "") or all(e for e in call["value"]), call
    assert "RankError" in leader["next"]["raised"]
    assert leader["blocks_used"] == 0 and leader["requests_left"] == 0
