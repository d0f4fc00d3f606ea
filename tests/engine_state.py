"""What an engine must look like after any failure: nothing left behind."""

from __future__ import annotations

import paged_hf


def assert_clean(engine: paged_hf.Engine) -> None:
    """Nothing left behind: no live request, no queued work, no block held beyond the prefix cache."""
    assert not engine.requests and not engine.has_unfinished
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.kv_manager.pool.num_used == 0
    assert (
        engine.kv_manager.pool.num_free + engine.kv_manager.pool.num_cached
        == engine.kv_manager.num_blocks
    )
