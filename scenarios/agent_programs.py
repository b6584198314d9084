"""agent_programs: two tenants' agents, each task a program of many calls with tool runs
between them and subagents that fork from it and join back.

Every call resends its program's growing context (system prompt, task, each answer and tool
output), a second or so of tool run after the previous answer; some calls fork subagents
that start from the parent's context, and the parent resumes when they have all ended.
``coder`` names its programs as Claude Code and vllm-router's agentic context do,
``researcher`` as OpenCode does. Programs start in the first phase; the second lets them
finish. What to watch: the report's Agent programs section, program completion p50/p90 per
tenant, beside Jain's index over the tenants' computed tokens.
"""

from pathlib import Path

from weighbridge.loadgen.scenario import Phase, Scenario

SCENARIO = Scenario(
    name="agent_programs",
    description="Two tenants' agent programs (calls, tool runs, fork-join subagents) start "
                "for 45 s; 30 s more let them finish.",
    phases=(Phase("programs", 45.0), Phase("drain", 30.0)),
    tenants_file=Path("tenants/agent_programs.yaml"),
    notes="--scale multiplies the program arrival rates. Contexts grow to about 10,000 "
          "tokens: max_model_len >= 16,384 (deploy/stacks/agent-programs.yaml).",
)
