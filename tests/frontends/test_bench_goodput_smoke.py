"""bench_goodput.py end to end on a tiny random llama (`--smoke`, seconds): every system replays
the same trace, every request finishes without error, and the JSON has each field. No timing is
asserted."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_goodput_smoke(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_goodput.py"), "--smoke"]
        + ["--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    (path,) = tmp_path.glob("goodput-*.json")
    result = json.loads(path.read_text())
    rows = result["rows"]
    assert [r["system"] for r in rows] == ["fcfs", "priority", "priority+tpot"]
    for kind in ("interactive", "batch"):
        counts = {r[kind]["requests"] for r in rows}
        assert len(counts) == 1 and counts.pop() > 0, f"{kind}: one trace for every system"
        assert all(r[kind]["errors"] == 0 for r in rows)
        assert all(0 <= r[kind]["attainment"] <= 1 for r in rows)
    assert all(0 < r["schedule_share"] < 1 for r in rows)
    assert result["meta"]["tpot_target_s"] == 5 * result["meta"]["lone_decode_step_s"]
    assert "priority+tpot" in proc.stdout and "JSON:" in proc.stdout
