"""burst: an on/off tenant (5 s at 30 req/s, 10 s silent) over a steady background."""

from pathlib import Path

from weighbridge.loadgen.scenario import Phase, Scenario

SCENARIO = Scenario(
    name="burst",
    description="On/off bursts of 150 requests every 15 s over 3 req/s of steady traffic.",
    phases=(Phase("bursts", 60.0),),
    tenants_file=Path("tenants/burst.yaml"),
    notes="--scale multiplies the rates; --stretch lengthens the run (not the on/off cycle).",
)
