"""noisy_neighbour: a steady multi-tenant load; one tenant floods 10,000 requests, then stops.

Phases quiet -> flood -> recovery. The victim is an interactive chat tenant whose TTFT is the
figure to watch; the demo runs this twice through the sidecar (FCFS baseline vs weighbridge)
with deploy/examples/noisy-neighbour-sidecar.yaml, whose keys match these tenants.
"""

from pathlib import Path

from weighbridge.loadgen.scenario import Phase, Scenario

SCENARIO = Scenario(
    name="noisy_neighbour",
    description="Victim + two steady tenants; 'flooder' sends 10,000 requests in 20 s.",
    phases=(Phase("quiet", 15.0), Phase("flood", 20.0), Phase("recovery", 25.0)),
    tenants_file=Path("tenants/noisy_neighbour.yaml"),
    notes="--scale multiplies every rate and the flood's size (--scale 0.2: 2,000 requests).",
    victim="victim",
)
