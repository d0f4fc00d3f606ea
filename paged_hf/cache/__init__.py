"""The cache: physical KV blocks and what may reuse them.

  block_pool.py     block ids, refcounts, free list, the LRU of cached-but-unused blocks
  prefix_index.py   radix tree of block-aligned token chunks -> block ids (prefix reuse)
  block_manager.py  a request's block table over the pool and the index (allocate, share, free)
  coherence.py      what cached KV depends on besides tokens: the weights that computed it

No tensors here: the execution layer owns the KV memory these ids point into.
"""
