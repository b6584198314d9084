"""noisy_neighbour_sessions: chat tenants with long histories, flooded by long prefix-free
prompts.

The chat tenants' turns resend histories of up to a few thousand tokens that a prefix cache
mostly holds; the flooder's prompts share nothing, so in the flood phase they compete for
the same KV cache and compute. Phases and keys are noisy_neighbour's, so it runs through the
demo's sidecar config (deploy/examples/noisy-neighbour-sidecar.yaml).
"""

from pathlib import Path

from weighbridge.loadgen.scenario import Phase, Scenario

SCENARIO = Scenario(
    name="noisy_neighbour_sessions",
    description="Chat sessions with long histories; 'flooder' sends 600 long prefix-free "
                "prompts in 20 s.",
    phases=(Phase("quiet", 15.0), Phase("flood", 20.0), Phase("recovery", 25.0)),
    tenants_file=Path("tenants/noisy_neighbour_sessions.yaml"),
    notes="Needs max_model_len >= 4,096 (the emulator's default). --scale multiplies the "
          "session rates and the flood's size.",
    victim="victim",
)
