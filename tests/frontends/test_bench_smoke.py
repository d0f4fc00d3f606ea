"""The benchmark harness end to end on a tiny random llama (`bench.py --smoke`, seconds).

Checks the JSON has every system and field, and cross-checks correctness: with greedy,
forced-length decoding in fp32, paged_hf must produce exactly the tokens of transformers'
own padded static batches (and of the other transformers systems) on every workload.
No timing is asserted.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "bench.py"

ROW_FIELDS = (
    "workload",
    "system",
    "dtype",
    "wall_s",
    "output_tok_s",
    "total_tok_s",
    "computed_tokens",
    "needed_tokens",
    "computed_over_needed",
    "ttft_p50",
    "ttft_p99",
    "tpot_p50",
    "tpot_p99",
    "peak_rss_mib",
    "kv_waste",
    "prefix_hit_rate",
    "needed_flops",
    "utilisation",
    "floor_s",
    "match_reference",
    "tokens",
)
SYSTEMS = {"hf_seq", "hf_static_B2", "hf_static_B4", "hf_cb", "paged_hf"}
WORKLOADS = {"W-mixed-4", "W-prefix-4", "W-long"}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "smoke.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, (
        f"bench.py --smoke failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )
    return json.loads(out.read_text()), proc.stdout


def test_every_system_and_field(smoke):
    result, stdout = smoke
    rows = result["rows"]
    assert {r["workload"] for r in rows} == WORKLOADS
    for w in WORKLOADS:
        assert {r["system"] for r in rows if r["workload"] == w} == SYSTEMS, w
    for r in rows:
        missing = [f for f in ROW_FIELDS if f not in r]
        assert not missing, f"{r['workload']} {r['system']}: missing {missing}"
        assert r["wall_s"] > 0 and r["output_tok_s"] > 0 and r["needed_flops"] > 0
        assert r["computed_tokens"] >= 1
    assert result["ceilings"]["fp32"]["gflops"] > 0
    assert set(result["workloads"]) == WORKLOADS
    # the table went to stdout
    assert "paged_hf" in stdout and "out/s" in stdout


def test_paged_hf_tokens_equal_static_batches(smoke):
    result, _ = smoke
    for w in WORKLOADS:
        rows = {r["system"]: r for r in result["rows"] if r["workload"] == w}
        paged = rows["paged_hf"]["tokens"]
        wl = result["workloads"][w]
        assert sum(len(t) for t in paged) == wl["output_tokens"], w
        for system in ("hf_static_B2", "hf_static_B4", "hf_seq", "hf_cb"):
            assert rows[system]["tokens"] == paged, f"{w}: paged_hf tokens differ from {system}"


def test_accounting(smoke):
    result, _ = smoke
    rows = {(r["workload"], r["system"]): r for r in result["rows"]}
    # a padded static batch computes its padding; paged_hf computes exactly what is needed, and on
    # W-prefix serves the shared prefix from its cache
    assert rows[("W-mixed-4", "hf_static_B4")]["computed_over_needed"] > 1
    assert rows[("W-mixed-4", "paged_hf")]["computed_over_needed"] == pytest.approx(1.0)
    assert rows[("W-prefix-4", "paged_hf")]["prefix_hit_rate"] > 0
    assert (
        rows[("W-prefix-4", "paged_hf")]["computed_over_needed"]
        < rows[("W-prefix-4", "hf_seq")]["computed_over_needed"]
    )


def test_profile_mode(tmp_path):
    """--profile wraps the engine's parts from outside; this keeps it working as the engine changes."""
    out = tmp_path / "profile.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--profile", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, (
        f"bench.py --smoke --profile failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )
    report = json.loads(out.read_text())
    shares = report["all_steps"]["share"]
    assert shares["forward"] > 0 and 0 <= report["all_steps"]["overhead_share"] <= 1
    assert (
        abs(
            sum(
                shares[p]
                for p in ("schedule", "metadata", "plan", "forward", "sample", "update", "other")
            )
            - 1
        )
        < 0.05
    )
    assert "Self CPU" in proc.stdout and "outside the forward" in proc.stdout
