"""Merge plans: assemble layers, and their optimizer state, from several checkpoints.

``plan.py`` reads the YAML, ``planner.py`` resolves it into per-tensor actions and validates
them from manifests alone, ``execute.py`` streams the units into one committed snapshot.
"""

from llmtailor.merge.execute import merge
from llmtailor.merge.plan import load_plan
from llmtailor.merge.planner import Action, MergePlan, open_plan

__all__ = ["Action", "MergePlan", "load_plan", "merge", "open_plan"]
