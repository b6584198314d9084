"""Analysis of a load-generator run: the fairness report (``weighbridge report``), run
comparison, and the capacity planner (``weighbridge capacity``). Definitions and formulas of
every number: docs/analysis.md."""
