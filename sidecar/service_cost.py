"""What a computed token costs its engine, learned per (endpoint, model, prompt-length band),
and the factor that normalises a request's DRR charge by it (opt-in:
``scheduler.service_cost``; decision 0026).

A token is one unit of the DRR charge whatever it costs the engine. Seed 001's "ideally"
charges the observed service cost instead: here an EMA of engine seconds per computed token
(computed prompt + output) for each key, from each completed request's own timing as the
sidecar sees it: its time on the engine (dispatch to end) over the mean number of our
requests in flight there at its dispatch and at its end, which is its share of the engine's
time while it ran. A request's charge is its tokens times its key's EMA over the EMA of every
key (so the mean factor stays about 1 and a quantum keeps its size in tokens), bounded to
[1/``MAX_FACTOR``, ``MAX_FACTOR``] and 1 until its key and the reference are both seen.

Keys are bounded: the configured endpoints x the served models x ``len(BANDS) + 1`` bands.
Invariants (tests/unit/sidecar/test_service_cost.py): a factor is 1 before any observation
and always within the bounds; a key whose tokens take longer has the larger factor.
"""

from __future__ import annotations

import bisect

# Upper bounds of the prompt-length bands, in prompt tokens (the last band is unbounded):
# attention grows with the context, so long prompts are their own keys.
BANDS = (1024, 4096, 16384)
MAX_FACTOR = 4.0
DEFAULT_ALPHA = 0.05  # slow: one request's timing is noisy (batching, queueing)


def band(prompt_tokens: int) -> int:
    """The band of a prompt of ``prompt_tokens`` tokens: 0 below ``BANDS[0]``, and so on."""
    return bisect.bisect_right(BANDS, max(0, prompt_tokens))


class ServiceCost:
    def __init__(self, alpha: float = DEFAULT_ALPHA) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self._alpha = alpha
        self._ema: dict[tuple[str, str, int], float] = {}
        self._reference: float | None = None  # every key's observations, one EMA

    def observe(self, endpoint: str, model: str | None, prompt_tokens: int,
                computed_tokens: int, engine_s: float) -> None:
        """A completed request's engine seconds (its share of its engine's time) for
        ``computed_tokens`` computed tokens."""
        if computed_tokens <= 0 or not engine_s > 0:
            return
        per_token = engine_s / computed_tokens
        key = (endpoint, model or "", band(prompt_tokens))
        self._ema[key] = self._fold(self._ema.get(key), per_token)
        self._reference = self._fold(self._reference, per_token)

    def _fold(self, previous: float | None, value: float) -> float:
        return value if previous is None else previous + self._alpha * (value - previous)

    def factor(self, endpoint: str, model: str | None, prompt_tokens: int) -> float:
        """What one token of such a request is charged, relative to the mean token."""
        ema = self._ema.get((endpoint, model or "", band(prompt_tokens)))
        if ema is None or not self._reference:
            return 1.0
        return min(MAX_FACTOR, max(1 / MAX_FACTOR, ema / self._reference))

    def snapshot(self) -> dict[str, float]:
        """Each key's factor, for /admin/state: "endpoint model band" -> factor."""
        return {f"{e} {m or '-'} {b}": round(self.factor(e, m, 0 if b == 0 else BANDS[b - 1]),
                                             4)
                for e, m, b in self._ema}
