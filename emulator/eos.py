"""When a request stops without ``ignore_eos``: the end-of-sequence model.

A language model emits EOS with some probability at every step, so without ``ignore_eos``
the output length is drawn from a geometric distribution of the given mean, capped by
``max_tokens`` (which then gives ``finish_reason: length``). Seeded per engine; each draw
comes from one stream so a run with the same seed and request order repeats exactly.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field


@dataclass(slots=True)
class EosModel:
    mean_output_tokens: float = 128.0
    seed: int = 0
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.mean_output_tokens < 1:
            raise ValueError(f"mean_output_tokens must be >= 1, got {self.mean_output_tokens}")
        self._rng = random.Random(self.seed)

    def output_tokens(self, max_tokens: int, ignore_eos: bool) -> int:
        if ignore_eos:
            return max_tokens
        p = 1.0 / self.mean_output_tokens
        if p >= 1.0:
            return 1
        # Inverse-CDF draw of a geometric variable on {1, 2, ...}.
        u = 1.0 - self._rng.random()
        n = 1 + int(math.log(u) / math.log(1.0 - p))
        return min(n, max_tokens)
