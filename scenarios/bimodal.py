"""bimodal: four tenants mixing short classifications with 2,000-4,000-token essays.

For comparing request-level and token-level routing and fairness: every tenant sends the
same number of requests, but the essays carry almost all of the tokens. Arrivals stop after
40 s and the last 20 s let the essays finish.
"""

from pathlib import Path

from weighbridge.loadgen.scenario import Phase, Scenario

SCENARIO = Scenario(
    name="bimodal",
    description="Four tenants, 80% short classifications / 20% long essays; 40 s + 20 s drain.",
    phases=(Phase("load", 40.0), Phase("drain", 20.0)),
    tenants_file=Path("tenants/bimodal.yaml"),
    notes="--scale multiplies the rates; essays need a server with max-model-len >= 4096.",
)
