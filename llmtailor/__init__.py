"""llmtailor: layer-wise tailoring of LLM training checkpoints.

Save only the layers a policy picks at each checkpoint (with their optimizer state), and
resume exactly from the composite: each unit from its newest saved version.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

from llmtailor.interop.formats import describe_other_format
from llmtailor.store.storage.local_detect import recognise_other_formats

if TYPE_CHECKING:
    from llmtailor.errors import PromotionError, TailorError
    from llmtailor.policies import Adaptive, Filter, Full, Interval, Parity, Policy, make_policy
    from llmtailor.store.run import Run
    from llmtailor.config import TailorConfig
    from llmtailor.store.tiers import Tier
    from llmtailor.reports import PendingSave, RestoreReport, SaveReport
    from llmtailor.tailor import Tailor

# The store's run detection knows no other format: the package tells it those interop knows by
# their file names (torch-free), so a writer refused in a Trainer checkpoint names it. Done here,
# where every import of llmtailor passes first.
recognise_other_formats(describe_other_format)

# Each public name is imported on first use (PEP 562), so the command line's byte-moving paths
# (``llmtailor merge`` of weights) do not pay for importing torch (store/dtypes.py).
_HOMES = {
    **dict.fromkeys(("PromotionError", "TailorError"), "llmtailor.errors"),
    **dict.fromkeys(("Adaptive", "Filter", "Full", "Interval", "Parity", "Policy", "make_policy"), "llmtailor.policies"),
    "Run": "llmtailor.store.run",
    **dict.fromkeys(("PendingSave", "RestoreReport", "SaveReport"), "llmtailor.reports"),
    "Tailor": "llmtailor.tailor",
    "TailorConfig": "llmtailor.config",
    "Tier": "llmtailor.store.tiers",
}

__all__ = [
    "Adaptive",
    "Filter",
    "Full",
    "Interval",
    "Parity",
    "PendingSave",
    "PromotionError",
    "Policy",
    "RestoreReport",
    "Run",
    "SaveReport",
    "Tailor",
    "TailorConfig",
    "TailorError",
    "Tier",
    "make_policy",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'llmtailor' has no attribute {name!r}")
    value = getattr(import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
