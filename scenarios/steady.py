"""steady: constant Poisson load from three tenants, for Little's Law (L = lambda W)."""

from pathlib import Path

from weighbridge.loadgen.scenario import Phase, Scenario

SCENARIO = Scenario(
    name="steady",
    description="Three tenants at constant Poisson rates (10 req/s in all) for 60 s.",
    phases=(Phase("steady", 60.0),),
    tenants_file=Path("tenants/steady.yaml"),
    notes="--scale multiplies the rates; -t or --stretch sets the length.",
)
