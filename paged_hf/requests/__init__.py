"""Request state, the bottom layer: what one request carries and what it has produced so far.

  request.py          Request (prompt and output ids, status, progress, block table, timestamps),
                      the engine's id namespace
  sampling_params.py  SamplingParams, validated at admission
  detokenizer.py      incremental detokenization and stop strings (per-request text state)

The scheduler, the block manager and the runner all read a Request, so it lies below all of
them and imports nothing else of paged_hf.
"""
