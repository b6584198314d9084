"""multi_model: tenants on two models and a LoRA adapter; a flood on one model.

Phases quiet -> flood -> recovery. ``app-a`` (chat) and ``tuned-a`` (the adapter
``model-a-lora``) use ``model-a``'s engines, ``app-b`` uses ``model-b``'s; ``flooder-a`` floods
``model-a`` in the flood phase. The question: does the flood reach ``app-a`` (same model),
and does it stay away from ``app-b`` (another model, other engines)? The report breaks its
figures down by model. Model names are the tenants' ``model`` fields: point them at what
the target serves with ``--tenants-file``. deploy/stacks/multi-model.yaml serves model-a (with
the adapter) and model-b on one emulated engine each.
"""

from pathlib import Path

from weighbridge.loadgen.scenario import Phase, Scenario

SCENARIO = Scenario(
    name="multi_model",
    description="Tenants on model-a, model-b and adapter model-a-lora; 'flooder-a' floods "
                "model-a with 1,200 requests in 20 s.",
    phases=(Phase("quiet", 15.0), Phase("flood", 20.0), Phase("recovery", 25.0)),
    tenants_file=Path("tenants/multi_model.yaml"),
    notes="The target must serve every model the tenants name (a model it does not serve "
          "is a 404); --scale multiplies every rate and the flood's size.",
    victim="app-a",
)
