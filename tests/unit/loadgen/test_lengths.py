from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from weighbridge.loadgen.lengths import Distribution, Lengths

ADAPTER = TypeAdapter(Distribution)


@st.composite
def distributions(draw: st.DrawFn, depth: int = 0) -> dict:
    low = draw(st.integers(1, 2000))
    high = draw(st.integers(low, 5000))
    kinds = ["fixed", "uniform", "normal", "lognormal", "empirical"]
    if depth < 2:
        kinds.append("mixture")
    kind = draw(st.sampled_from(kinds))
    if kind == "fixed":
        return {"kind": "fixed", "value": low}
    if kind == "uniform":
        return {"kind": "uniform", "low": low, "high": high}
    if kind == "normal":
        return {"kind": "normal", "mean": draw(st.floats(-1000, 6000)),
                "std": draw(st.floats(0.1, 3000)), "low": low, "high": high}
    if kind == "lognormal":
        return {"kind": "lognormal", "median": draw(st.floats(0.5, 10000)),
                "sigma": draw(st.floats(0.01, 3)), "low": low, "high": high}
    if kind == "empirical":
        edges = sorted(draw(st.sets(st.integers(1, 5000), min_size=2, max_size=6)))
        counts = draw(st.lists(st.floats(0, 100), min_size=len(edges) - 1,
                               max_size=len(edges) - 1).filter(lambda c: sum(c) > 0))
        return {"kind": "empirical", "bins": [
            {"low": a, "high": b, "count": c}
            for a, b, c in zip(edges, edges[1:], counts, strict=False)]}
    components = draw(st.lists(st.tuples(st.floats(0.01, 10), distributions(depth + 1)),
                               min_size=1, max_size=3))
    return {"kind": "mixture", "components": [{"weight": w, "dist": d} for w, d in components]}


@settings(max_examples=200, deadline=None)
@given(distributions(), st.integers(0, 2**32))
# Found by hypothesis: random() * total rounded up to the total and drew the empty last bin.
@example({"kind": "empirical", "bins": [{"low": 1, "high": 2, "count": 5e-324},
                                       {"low": 2, "high": 3, "count": 0.0}]}, 0)
def test_draws_stay_within_bounds_and_repeat_with_the_seed(spec: dict, seed: int) -> None:
    dist = ADAPTER.validate_python(spec)
    low, high = dist.bounds()
    first = [dist.sample(random.Random(seed)) for _ in range(3)]
    rng = random.Random(seed)
    draws = [dist.sample(rng) for _ in range(200)]
    assert all(isinstance(x, int) and low <= x <= high and x >= 1 for x in draws)
    assert first == [draws[0]] * 3  # same seed, same first draw
    again = random.Random(seed)
    assert [dist.sample(again) for _ in range(200)] == draws


@settings(max_examples=30, deadline=None)
@given(st.floats(0.05, 0.95), st.integers(0, 2**32))
def test_mixture_follows_its_weights(share: float, seed: int) -> None:
    dist = ADAPTER.validate_python({"kind": "mixture", "components": [
        {"weight": share, "dist": 10}, {"weight": 1 - share, "dist": 3000}]})
    rng = random.Random(seed)
    n = 4000
    shorts = sum(dist.sample(rng) == 10 for _ in range(n))
    sigma = (n * share * (1 - share)) ** 0.5
    assert abs(shorts - n * share) < 6 * sigma


def test_length_classes_keep_prompt_and_output_together() -> None:
    lengths = Lengths.model_validate({"classes": [
        {"weight": 4, "prompt": 100, "output": 5},
        {"weight": 1, "prompt": 64, "output": {"kind": "uniform", "low": 2000, "high": 4000}},
    ]})
    rng = random.Random(7)
    draws = [lengths.draw(rng) for _ in range(5000)]
    assert all(d == (100, 5) or (d[0] == 64 and 2000 <= d[1] <= 4000) for d in draws)
    essays = sum(d[0] == 64 for d in draws)
    assert 800 < essays < 1200
    assert lengths.max_tokens() == (100, 4000)


def test_one_class_shorthand_and_integer_shorthand() -> None:
    lengths = Lengths.model_validate({"prompt": 12, "output": 3})
    assert lengths.draw(random.Random(0)) == (12, 3)


def test_truncated_normal_far_outside_its_range_returns_the_nearest_bound() -> None:
    dist = ADAPTER.validate_python({"kind": "normal", "mean": 1e6, "std": 1, "low": 5,
                                    "high": 9})
    assert {dist.sample(random.Random(s)) for s in range(20)} == {9}


def test_empirical_reads_a_histogram_file(tmp_path: Path) -> None:
    (tmp_path / "hist.csv").write_text("low,high,count\n10,20,1\n100,101,3\n")
    dist = ADAPTER.validate_python({"kind": "empirical", "file": "hist.csv"},
                                   context={"base_dir": tmp_path})
    rng = random.Random(1)
    draws = [dist.sample(rng) for _ in range(4000)]
    assert set(draws) <= set(range(10, 20)) | {100}
    assert 2700 < draws.count(100) < 3300
    assert dist.bounds() == (10, 100)


@pytest.mark.parametrize("spec, message", [
    ({"kind": "uniform", "low": 10, "high": 5}, r"high \(5\) must be >= low \(10\)"),
    ({"kind": "fixed", "value": 0}, "greater than 0"),
    ({"kind": "empirical", "bins": [{"low": 1, "high": 2, "count": 0}]}, "positive count"),
    ({"kind": "empirical", "file": "/nonexistent/h.csv"}, "cannot read histogram"),
    ({"kind": "zipf"}, "does not match any of the expected tags"),
])
def test_bad_distributions_are_refused(spec: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ADAPTER.validate_python(spec)


def test_empirical_reads_the_reports_lengths_json(tmp_path: Path) -> None:
    """The round trip the issue asks for: `weighbridge report` measures a run's lengths and
    the load generator replays them."""
    import json

    import pandas as pd

    from weighbridge.analysis.lengths import length_histograms

    rng = random.Random(3)
    outputs = [rng.choice((0, 16, 17, 400)) for _ in range(500)]
    frame = pd.DataFrame({"tenant": "a", "endpoint": "/v1/completions", "status": "ok",
                          "prompt_tokens": [rng.randrange(50, 60) for _ in outputs],
                          "output_tokens": outputs})
    (tmp_path / "lengths.json").write_text(json.dumps(
        {"run_id": "r", "lengths": length_histograms(frame)}))
    spec = {"kind": "empirical", "file": "lengths.json", "tenant": "a",
            "endpoint": "/v1/completions", "measure": "output_tokens"}
    dist = ADAPTER.validate_python(spec, context={"base_dir": tmp_path})
    draws = [dist.sample(random.Random(s)) for s in range(2000)]
    assert min(draws) >= 1  # the 0-token bin is drawn as 1
    assert dist.bounds()[1] == 400
    share_long = sum(d >= 400 for d in draws) / len(draws)
    assert abs(share_long - outputs.count(400) / len(outputs)) < 0.05
    with pytest.raises(ValidationError, match="no prompt_tokens histogram for tenant 'b'"):
        ADAPTER.validate_python({**spec, "tenant": "b", "measure": "prompt_tokens"},
                                context={"base_dir": tmp_path})
    with pytest.raises(ValidationError, match="needs tenant, endpoint and measure"):
        ADAPTER.validate_python({"kind": "empirical", "file": "lengths.json"},
                                context={"base_dir": tmp_path})
