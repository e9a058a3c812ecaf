"""``tiers.json``: the record of a run's tiers in every tier, so ``inspect`` and ``gc`` of any
tier find the others (``TierRecord`` writes it for a writer; ``read_record`` and
``tier_states`` read it)."""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from llmtailor.constants import TIERS_FILE
from llmtailor.errors import ConfigError, IntegrityError, TailorError, describe_os_error
from llmtailor.store.run import Run
from llmtailor.store.storage import open_storage
from llmtailor.store.tiers.levels import Level

TIERS_FORMAT = "llmtailor.tiers"

log = logging.getLogger(__name__)


class TierRecord:
    """A writer's record of its tiers, written in each of them, and what it replaced there."""

    def __init__(self, levels: list[Level]):
        self.levels = levels
        self._replaced: list[tuple[Level, bytes | None]] = []
        """The tiers this writer recorded itself in, with what they recorded before (``put_back``)."""

    def write(self, where: list[Level] | None = None, node: int | None = None) -> str:
        """Record the tiers in each of them (``tiers.json``), or in those of ``where`` (a node's
        leader: its own copy of a node-local tier, which also records ``node``, the node it is
        the copy of: ``store.node_parts``), so ``inspect`` and ``gc`` of any tier find the
        others; returns the record's token (this writer's). Each tier's record is replaced
        atomically; a failure raises ConfigError naming the tier, and ``put_back`` puts back
        what was replaced."""
        token = uuid.uuid4().hex
        record = {"format": TIERS_FORMAT, "writer": token, "tiers": [level.record() for level in self.levels]}
        for level in self.levels if where is None else where:
            storage = level.run.storage
            mine = {**record, "node": node} if node is not None and level.node_local else record
            try:
                before = bytes(storage.read(TIERS_FILE)) if storage.is_file(TIERS_FILE) else None
                storage.replace(TIERS_FILE, json.dumps(mine, indent=1).encode())
            except TailorError as err:
                raise ConfigError(f"cannot record the tiers in tier {level.name}: {err}") from None
            except OSError as err:  # its cause alone: the temporary file it names is not the user's
                reason = describe_os_error(OSError(err.errno, err.strerror), storage.where(TIERS_FILE))
                raise ConfigError(f"cannot record the tiers in tier {level.name}: {reason}") from None
            self._replaced.append((level, before))
        return token

    def put_back(self) -> None:
        """Put each tier's record back as it was before ``write`` (a writer's start that failed)."""
        for level, before in reversed(self._replaced):
            storage = level.run.storage
            try:
                if before is None:
                    storage.remove(TIERS_FILE)
                else:
                    storage.replace(TIERS_FILE, before)
            except (TailorError, OSError) as err:
                log.warning("llmtailor: could not put back %s: %s", storage.where(TIERS_FILE), err)
        self._replaced = []

    @staticmethod
    def seen(level: Level, token: str) -> bool:
        """Whether ``level`` holds the record of the writer whose token is ``token``."""
        try:
            return json.loads(bytes(level.run.storage.read(TIERS_FILE))).get("writer") == token
        except (TailorError, OSError, ValueError, AttributeError):
            return False


@dataclass(frozen=True)
class TierState:
    """What ``inspect`` shows of one tier a run records."""

    location: str
    keep: int | None
    promote_every: int | None
    steps: list[int] | None
    """Its committed snapshots; None when it cannot be read here (``problem`` says why)."""
    newest: int | None = None
    problem: str | None = None
    here: bool = False
    """Whether it is the run asked about."""
    max_lag: int | None = None
    """How far the next tier may fall behind this one (``Tier.max_lag``)."""
    lag: int | None = None
    """Steps its newest composite is behind the faster tier's newest (None: the first tier, or
    either cannot be read here); the bound is the faster tier's ``max_lag``."""


def tier_states(run: Run) -> list[TierState] | None:
    """Every tier ``run`` records (``tiers.json``), fastest first, as found now; None when the
    run records no tiers. A tier that is not here (another node's memory, wiped) is shown so."""
    record = read_record(run)
    if record is None:
        return None
    states: list[TierState] = []
    for entry in record:
        location = str(entry.get("location"))
        keep, every, bound = entry.get("keep"), entry.get("promote_every"), entry.get("max_lag")
        try:
            here = open_storage(location).same_place(run.storage)
            tier = run if here else Run(location)
            if not tier.storage.exists(TIERS_FILE):
                states.append(TierState(location, keep, every, None, problem="not here (another node's, or wiped)",
                                        max_lag=bound))
                continue
            newest = tier.latest_step()
            ahead = states[-1].newest if states and states[-1].steps is not None else None
            lag = None if ahead is None else ahead - (newest if newest is not None else 0)
            states.append(TierState(location, keep, every, tier.steps(), newest, here=here, max_lag=bound,
                                    lag=None if lag is None else max(lag, 0)))
        except TailorError as err:
            states.append(TierState(location, keep, every, None, problem=str(err), max_lag=bound))
    return states


def read_record(run: Run) -> list[dict[str, Any]] | None:
    """The tiers a run records (``tiers.json``: location, keep, promote_every, max_lag,
    fastest first), or None when it has no tiers."""
    if not run.storage.is_file(TIERS_FILE):
        return None
    where = run.storage.where(TIERS_FILE)
    try:
        data = json.loads(bytes(run.storage.read(TIERS_FILE)))
    except ValueError as err:
        raise IntegrityError(f"{where}: not valid JSON ({err})") from None
    if not isinstance(data, dict) or data.get("format") != TIERS_FORMAT or not isinstance(data.get("tiers"), list):
        raise IntegrityError(f"{where}: not a record of llmtailor tiers")
    return data["tiers"]
