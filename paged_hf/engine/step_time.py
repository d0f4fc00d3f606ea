"""How long a step takes, learned from this engine's own steps, and how many prefill tokens a step
may carry so that requests with a time-per-output-token target keep it (Sarathi-Serve sizes its
chunks to a time-between-tokens target the same way, from a profile).

The model is linear, fitted by least squares over recent steps:
seconds ~ base + per_row * decode rows + per_token * prefill tokens.
"""

from __future__ import annotations

from collections import deque

import numpy as np

WINDOW = 512  # recent steps the fit reads
REFIT_EVERY = 16  # steps between fits
MIN_STEPS = 8  # and with prefill in at least two of them, before the model predicts anything


class StepTimeModel:
    def __init__(self) -> None:
        self._rows: deque[tuple[int, int, float]] = deque(maxlen=WINDOW)
        self._since_fit = 0
        self.coef: tuple[float, float, float] | None = None  # base, per decode row, per token

    def observe(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        self._rows.append((decode_rows, prefill_tokens, seconds))
        self._since_fit += 1
        if self._since_fit >= REFIT_EVERY or (self.coef is None and self._fittable()):
            self._fit()

    def _fittable(self) -> bool:
        return len(self._rows) >= MIN_STEPS and sum(p > 0 for _, p, _ in self._rows) >= 2

    def _fit(self) -> None:
        self._since_fit = 0
        if not self._fittable():
            return
        data = np.array(self._rows, dtype=np.float64)
        x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
        coef, *_ = np.linalg.lstsq(x, data[:, 2], rcond=None)
        base, per_row, per_token = (float(c) for c in coef)
        if per_token > 0:  # else the steps did not vary enough to tell a prefill token's cost
            self.coef = (max(base, 0.0), max(per_row, 0.0), per_token)

    def predict(self, decode_rows: int, prefill_tokens: int) -> float | None:
        if self.coef is None:
            return None
        base, per_row, per_token = self.coef
        return base + per_row * decode_rows + per_token * prefill_tokens

    def prefill_token_s(self) -> float | None:
        """Seconds one more prefill token adds to a step (None while unfitted)."""
        return None if self.coef is None else self.coef[2]

    def prefill_within(self, seconds: float, decode_rows: int, floor: int) -> int | None:
        """Prefill tokens a step with ``decode_rows`` decodes may carry and take at most
        ``seconds``; never below ``floor`` (prompts must still move), None while unfitted."""
        if self.coef is None:
            return None
        base, per_row, per_token = self.coef
        room = (seconds - base - per_row * decode_rows) / per_token
        return max(floor, int(room + 1e-9))  # 29.999... from rounding is 30
