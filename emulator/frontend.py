"""The API server in front of the engine: when a request it accepted reaches the scheduler.

vLLM's frontend admits concurrent requests one at a time (a serial part per request) and
then adds a latency that overlaps between requests; the step-time profile sets both. The
same single process streams every generated token out (``t_api_token`` each), so a new
request's serial part also waits behind the streaming of the running ones: callers report
each step's tokens with :meth:`ApiFrontEnd.streamed`.

On a CPU host the engine core's OpenMP threads fill every core while it steps, so the API
server's work for a request accepted then waits for a core: the serial part takes
``t_api_contended`` longer when the engine has work at acceptance (callers say so). Pure:
the emulator's HTTP face and the virtual-time simulator ask it the same question.
"""

from __future__ import annotations

from weighbridge.emulator.profiles import StepTimeProfile


class ApiFrontEnd:
    def __init__(self, profile: StepTimeProfile) -> None:
        self.serial_s = profile.t_api_serial
        self.latency_s = profile.t_api_latency
        self.token_s = profile.t_api_token
        self.contended_s = profile.t_api_contended
        self._free_at = 0.0  # when the serial part can take the next request

    @property
    def instant(self) -> bool:
        """Whether requests reach the engine the moment they are accepted."""
        return not (self.serial_s or self.latency_s or self.token_s or self.contended_s)

    def ready_at(self, now: float, engine_busy: bool = False) -> float:
        """When a request accepted at ``now`` enters the engine (call once per request);
        ``engine_busy``: the engine has requests running or waiting at ``now``."""
        serial = self.serial_s + (self.contended_s if engine_busy else 0.0)
        self._free_at = max(now, self._free_at) + serial
        return self._free_at + self.latency_s

    def streamed(self, now: float, tokens: int) -> None:
        """The engine handed ``tokens`` generated tokens to the front end at ``now``: it
        streams them before it takes the next request. (Only the admission delay is
        modelled; the tokens reach their streams at once.)"""
        if self.token_s and tokens:
            self._free_at = max(now, self._free_at) + self.token_s * tokens
