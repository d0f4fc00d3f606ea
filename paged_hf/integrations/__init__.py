"""Integrations with other tools; each module imports its tool only when it is imported.

lm_eval   lm-evaluation-harness backend ``paged_hf`` (``pip install 'paged_hf[eval]'``)
"""
