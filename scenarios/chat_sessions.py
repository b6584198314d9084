"""chat_sessions: multi-turn chat sessions behind shared and per-tenant system prompts.

Each turn resends the whole conversation (system prompt, every earlier message and answer)
plus a new message, so a server with a prefix cache computes only the new part. One phase;
the report's per-tenant hit rate is the figure to watch (cache on against off).
"""

from pathlib import Path

from weighbridge.loadgen.scenario import Phase, Scenario

SCENARIO = Scenario(
    name="chat_sessions",
    description="Two chat tenants in multi-turn sessions (one system prompt shared) and an "
                "API tenant with a fixed system prompt.",
    phases=(Phase("sessions", 60.0),),
    tenants_file=Path("tenants/chat_sessions.yaml"),
    notes="--scale multiplies the session arrival rates. Histories stay under 1,024 tokens "
          "(the real-vLLM harness's max_model_len).",
)
