"""A run's storage tiers: faster stores in front of the run directory, fastest first.

Each tier is a complete run in the same format (``store.run``): host memory (``/dev/shm/...``,
outlives the training process, not the node), node-local disk, then the run directory itself,
the last and durable tier (a shared filesystem or an object store). A run without tiers is the
one-tier case: the run directory alone.

- Saves commit to the first tier (``Tiers.first``), with the usual commit protocol and retention.
- Committed composites move down the tiers in the background (``promote.py``): each tier's
  ``promote_every`` sets which reach the next; a composite promoted to a tier is complete there.
- ``choose`` picks what a restore reads (``choice.py``): the newest composite any tier holds
  whole (the faster tier on a tie), so losing the faster tiers loses only the saves since the
  last promotion.
- Each tier has its own writer lock (taken together by the writer) and its own retention
  (``levels.py``).
- ``tiers.json`` in every tier records the tiers (``record.py``; ``inspect`` and ``gc`` read it).
- A writer starts only where it can write every tier (taking each lock proves it), records the
  tiers in all of them only then, and a start that fails leaves every tier as it found it
  (``runtime.py``).

The modules, each importing only those before it: ``config`` (``Tier``, what a ``TailorConfig``
declares), ``levels`` (``Level``), ``promote`` (copying a composite down a tier; the
``Promoter``), ``choice``, ``record``, ``runtime`` (``Tiers``).
"""

from llmtailor.store.tiers.choice import Choice
from llmtailor.store.tiers.config import Tier
from llmtailor.store.tiers.levels import Level
from llmtailor.store.tiers.promote import Promoter, Promotion
from llmtailor.store.tiers.record import TierState, read_record, tier_states
from llmtailor.store.tiers.runtime import Tiers

__all__ = ["Choice", "Level", "Promoter", "Promotion", "Tier", "TierState", "Tiers", "read_record", "tier_states"]
