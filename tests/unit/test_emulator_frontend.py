"""The API front end's admission rule (emulator/frontend.py), in virtual time: what
``t_api_contended`` adds to a request accepted while the engine has work, and what it
leaves alone."""

from __future__ import annotations

import pytest

from weighbridge.emulator.engine import EngineConfig, Sequence, StepModel
from weighbridge.emulator.frontend import ApiFrontEnd
from weighbridge.emulator.profiles import PROFILES, StepTimeProfile

PROFILE = StepTimeProfile(name="t", t_fixed=0.003, t_prefill_token=1e-5, t_decode_seq=1e-4,
                          t_kv_token=0.0, t_api_serial=0.003, t_api_latency=0.003,
                          t_api_token=1e-4, t_api_contended=0.004)


def test_an_idle_engine_pays_no_contention() -> None:
    front = ApiFrontEnd(PROFILE)
    assert front.ready_at(1.0, engine_busy=False) == pytest.approx(1.0 + 0.003 + 0.003)


def test_a_busy_engine_lengthens_the_serial_part() -> None:
    front = ApiFrontEnd(PROFILE)
    assert front.ready_at(1.0, engine_busy=True) == pytest.approx(1.0 + 0.003 + 0.004 + 0.003)


def test_the_contended_part_is_serial_so_the_next_request_waits_behind_it() -> None:
    front = ApiFrontEnd(PROFILE)
    front.ready_at(1.0, engine_busy=True)  # serial part busy until 1.007
    assert front.ready_at(1.001, engine_busy=False) == pytest.approx(1.007 + 0.003 + 0.003)


def test_without_the_term_busy_and_idle_are_alike() -> None:
    profile = PROFILES["cpu-tiny"].with_overrides(t_api_contended=0.0)
    idle, busy = ApiFrontEnd(profile), ApiFrontEnd(profile)
    assert idle.ready_at(2.0, engine_busy=False) == busy.ready_at(2.0, engine_busy=True)


def test_the_term_alone_makes_the_front_end_not_instant() -> None:
    profile = StepTimeProfile(name="t", t_fixed=0.001, t_prefill_token=0.0, t_decode_seq=0.0,
                              t_kv_token=0.0, t_api_contended=0.001)
    assert not ApiFrontEnd(profile).instant


def test_every_profile_but_cpu_tiny_leaves_it_off() -> None:
    for name, profile in PROFILES.items():
        if name != "cpu-tiny":
            assert profile.t_api_contended == 0.0, name


def _ttft(engine_busy_turn: bool, contended: float) -> float:
    """Virtual time: request A decodes from t=0; request B is accepted at 0.05 s (while A
    decodes, or after A is gone) and its first token ends a step. B's time to first token."""
    profile = PROFILE.with_overrides(t_api_contended=contended)
    model = StepModel(EngineConfig(max_num_seqs=4, num_kv_blocks=64, block_size=16,
                                   max_model_len=512), profile)
    front = ApiFrontEnd(profile)
    long_a = 200 if engine_busy_turn else 2
    a = Sequence("a", prompt_tokens=16, target_output_tokens=long_a, max_tokens=long_a,
                 arrival_s=0.0)
    b = Sequence("b", prompt_tokens=64, target_output_tokens=4, max_tokens=4, arrival_s=0.05)
    entries = [(front.ready_at(0.0, model.has_work), a)]
    now = 0.0
    accepted = False
    while b.first_token_s is None:
        if not accepted and now >= b.arrival_s:
            entries.append((front.ready_at(b.arrival_s, model.has_work), b))
            accepted = True
        for t, seq in list(entries):
            if t <= now:
                model.add(seq)
                entries.remove((t, seq))
        result = model.step(now)
        if result is None:
            pending = [t for t, _ in entries] + ([] if accepted else [b.arrival_s])
            now = min(pending)
            continue
        if result.emitted:
            front.streamed(result.end_s, len(result.emitted))
        now = result.end_s
    return b.first_token_s - b.arrival_s


def test_a_request_beside_a_decode_waits_the_contended_time_longer() -> None:
    # B enters the engine 4 ms later; it then waits for the decode step in flight, so its
    # first token comes 4 ms later give or take one decode step.
    step = PROFILE.step_time(0, 1, 0)
    longer = _ttft(True, 0.004) - _ttft(True, 0.0)
    assert 0.004 - step < longer <= 0.004 + step


def test_a_request_at_an_idle_engine_is_not_delayed() -> None:
    assert _ttft(False, 0.004) == pytest.approx(_ttft(False, 0.0))
