"""Arrival processes: when a tenant's requests are due, as pure functions of a seeded RNG.

Open-loop processes produce *send times* that do not depend on the server: a request is
sent at its time whether or not earlier ones have finished, so a slow server shows up as
latency instead of a silently lower rate (coordinated omission). A closed loop is the
opposite model, N users each waiting for their answer and thinking before the next; it is
described here and run by the driver, because its send times depend on the responses.

YAML forms (``kind`` picks the process; rates are requests per second)::

    {kind: poisson, rate: 5}
    {kind: gamma, rate: 5, burstiness: 4}        # squared CV of the gaps; 1 is Poisson
    {kind: burst, count: 500, at_s: 2, over_s: 1} # 500 requests spread over [2 s, 3 s)
    {kind: on_off, rate: 20, on_s: 5, off_s: 10}  # Poisson while on, silent while off
    {kind: closed, users: 8, think_s: 1.0}        # exponential think time, mean 1 s
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveFloat, PositiveInt

__all__ = ["Arrival", "Burst", "Closed", "Gamma", "OnOff", "OpenLoop", "Poisson"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Poisson(_Model):
    kind: Literal["poisson"] = "poisson"
    rate: PositiveFloat

    def times(self, rng: random.Random, start_s: float, end_s: float) -> Iterator[float]:
        """Send times in ``[start_s, end_s)``; ``end_s`` may be ``math.inf``."""
        t = start_s
        while True:
            t += rng.expovariate(self.rate)
            if t >= end_s:
                return
            yield t

    def scaled(self, factor: float) -> Poisson:
        return self.model_copy(update={"rate": self.rate * factor})

    def mean_rate(self) -> float:
        return self.rate


class Gamma(_Model):
    """A renewal process with gamma gaps: burstier than Poisson when ``burstiness`` > 1
    (clumps of requests with long silences between), smoother when < 1."""

    kind: Literal["gamma"] = "gamma"
    rate: PositiveFloat
    burstiness: PositiveFloat = 1.0  # squared coefficient of variation of the gaps

    def times(self, rng: random.Random, start_s: float, end_s: float) -> Iterator[float]:
        shape = 1.0 / self.burstiness
        scale = self.burstiness / self.rate  # mean gap = shape * scale = 1 / rate
        t = start_s
        while True:
            t += rng.gammavariate(shape, scale)
            if t >= end_s:
                return
            yield t

    def scaled(self, factor: float) -> Gamma:
        return self.model_copy(update={"rate": self.rate * factor})

    def mean_rate(self) -> float:
        return self.rate


class Burst(_Model):
    """``count`` requests, evenly spread over ``[at_s, at_s + over_s)`` after the phase
    starts (all at once when ``over_s`` is 0)."""

    kind: Literal["burst"] = "burst"
    count: PositiveInt
    at_s: NonNegativeFloat = 0.0
    over_s: NonNegativeFloat = 0.0

    def times(self, rng: random.Random, start_s: float, end_s: float) -> Iterator[float]:
        step = self.over_s / self.count
        for i in range(self.count):
            t = start_s + self.at_s + i * step
            if t >= end_s:
                return
            yield t

    def scaled(self, factor: float) -> Burst:
        return self.model_copy(update={"count": max(1, round(self.count * factor))})

    def mean_rate(self) -> float:
        return math.inf if self.over_s == 0 else self.count / self.over_s


class OnOff(_Model):
    """Poisson at ``rate`` for ``on_s``, then silent for ``off_s``, repeating from the
    phase start (which begins with an on period)."""

    kind: Literal["on_off"] = "on_off"
    rate: PositiveFloat
    on_s: PositiveFloat
    off_s: NonNegativeFloat

    def times(self, rng: random.Random, start_s: float, end_s: float) -> Iterator[float]:
        period = self.on_s + self.off_s
        cycle_start = start_s
        while cycle_start < end_s:
            on_end = min(cycle_start + self.on_s, end_s)
            yield from Poisson(rate=self.rate).times(rng, cycle_start, on_end)
            cycle_start += period

    def scaled(self, factor: float) -> OnOff:
        return self.model_copy(update={"rate": self.rate * factor})

    def mean_rate(self) -> float:
        return self.rate * self.on_s / (self.on_s + self.off_s)


class Closed(_Model):
    """``users`` users, each sending its next request when the previous one ends plus a
    think time (exponential with mean ``think_s``, or exactly ``think_s``)."""

    kind: Literal["closed"] = "closed"
    users: PositiveInt
    think_s: NonNegativeFloat = 0.0
    think: Literal["exponential", "fixed"] = "exponential"

    def think_time(self, rng: random.Random) -> float:
        if self.think_s == 0 or self.think == "fixed":
            return self.think_s
        return rng.expovariate(1.0 / self.think_s)

    def scaled(self, factor: float) -> Closed:
        return self.model_copy(update={"users": max(1, round(self.users * factor))})


OpenLoop = Poisson | Gamma | Burst | OnOff
Arrival = Annotated[Poisson | Gamma | Burst | OnOff | Closed, Field(discriminator="kind")]
