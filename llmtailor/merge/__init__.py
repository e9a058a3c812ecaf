"""Merge plans: assemble layers, and their optimizer state, from several checkpoints.

``plan.py`` reads the YAML, ``llmtailor/interop/sources.py`` opens every kind of source
lazily, ``planner.py`` resolves the plan into per-tensor actions and validates them from
headers and manifests alone, ``execute.py`` streams the units into the output's sink (a
snapshot, a Trainer checkpoint or a model directory: ``llmtailor/outputs/``).
"""

from llmtailor.merge.execute import merge
from llmtailor.merge.plan import load_plan
from llmtailor.merge.planner import Action, MergePlan, open_plan

__all__ = ["Action", "MergePlan", "load_plan", "merge", "open_plan"]
