"""docs/configuration.md is the schema's own documentation, rendered: every field has a
docstring, and the committed reference is what the schema renders today."""

from pathlib import Path

from weighbridge.sidecar.config_reference import render, undocumented

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_every_field_has_a_docstring() -> None:
    assert undocumented() == []


def test_the_committed_reference_matches_the_schema() -> None:
    # On a failure: python -m weighbridge.sidecar.config_reference > docs/configuration.md
    assert REFERENCE.read_text() == render()


def test_the_reference_names_every_section_once() -> None:
    text = render()
    for section in ("Config", "Tier", "Tenant", "Endpoint", "Backend", "Model", "Scheduler",
                    "Admission", "HealthProbe", "ModelDiscovery", "Telemetry", "SharedState",
                    "RateLimits", "Limits"):
        assert text.count(f"\n## {section}\n") == 1, section
    # Derived defaults read as what they are, not as the placeholder None.
    assert "| `headroom_slots` | integer ≥ 0 or none | derived: work-conserving |" in text
