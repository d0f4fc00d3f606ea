"""The CPU's own code: paged_hf's C++ library (``csrc/``, loaded by ``ops``) and what runs on it."""
