"""llmtailor: layer-wise tailoring of LLM training checkpoints.

Save only the layers a policy picks at each checkpoint (with their optimizer state), and
resume exactly from the composite: each unit from its newest saved version.
"""

from llmtailor.errors import TailorError
from llmtailor.policies import Adaptive, Filter, Full, Interval, Parity, Policy, make_policy
from llmtailor.store.run import Run
from llmtailor.tailor import PendingSave, RestoreReport, SaveReport, Tailor

__all__ = [
    "Adaptive",
    "Filter",
    "Full",
    "Interval",
    "Parity",
    "PendingSave",
    "Policy",
    "RestoreReport",
    "Run",
    "SaveReport",
    "Tailor",
    "TailorError",
    "make_policy",
]
__version__ = "0.1.0"
