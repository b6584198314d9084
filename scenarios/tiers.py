"""tiers: interactive chat, a standard API and a batch flood competing for one engine."""

from pathlib import Path

from weighbridge.loadgen.scenario import Phase, Scenario

SCENARIO = Scenario(
    name="tiers",
    description="Interactive chat and a standard API; a closed-loop batch flood joins at 10 s.",
    phases=(Phase("warm", 10.0), Phase("contention", 50.0)),
    tenants_file=Path("tenants/tiers.yaml"),
    notes="--scale multiplies the rates and the batch users.",
)
