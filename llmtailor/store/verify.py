"""Verifying a run (``llmtailor verify``, ``Run.check``): every file of every committed snapshot
(or of the composite as of a step) against its size and checksum, the composites restorable,
and every snapshot holding the whole model its layout and model config describe. Reads through
the run's catalog (``catalog.py``) and its unit read path (``units.py``), under read leases.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from llmtailor.constants import CARRIED_FOR, GLOBAL_JSON, layer_unit, writer_rank
from llmtailor.distributed.nodes import Nodes
from llmtailor.errors import ConfigError, SnapshotNotFoundError, TailorError
from llmtailor.layouts import Layout, load_family, name_units
from llmtailor.store.catalog import Catalog, ReadLeases, not_restorable
from llmtailor.store.checked import read_stored, stored_problem
from llmtailor.store.keys import lacking_weights
from llmtailor.store.manifest import FileEntry, Manifest
from llmtailor.store.node_parts import copy_node, parts_elsewhere
from llmtailor.store.storage.object_commit import tombstones_note
from llmtailor.store.units import UnitReader


@dataclass
class Verification:
    """What ``Run.check`` found. ``problems``: damage (exit 1 at the CLI). ``notes``: what is not
    damage but worth saying (a snapshot removed by retention while the check ran, an older
    composite no longer restorable because retention removed a snapshot it needs)."""

    checked: list[int] = field(default_factory=list)
    """Snapshots whose files were checked, ascending."""
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    base_checked: set[tuple[str, str]] = field(default_factory=set)
    """Base model directory files checked (each once)."""


class RunCheck:
    """One verification of a run: its ``catalog`` and ``units`` (the unit read path)."""

    def __init__(self, catalog: Catalog, units: UnitReader):
        self.catalog, self.units = catalog, units
        self._node = copy_node(catalog.storage)
        """The node whose copy of a node-local tier this run is (``node_parts.copy_node``), or None."""

    def check(self, step: int | None = None) -> Verification:
        """Verify the run: every file of every committed snapshot (or of the composite as of
        ``step``) against its size and checksum, and that the composites restore.

        The rule: a problem is a file that is missing, damaged, unreadable or outside the run,
        a composite naming a snapshot that does not hold the unit, a snapshot lacking part of
        the model (``_model_problems``: a unit of its layout its composite does not name, a
        layer its model config counts that its layout lacks), or the composite checked
        (``step``'s, or the newest) not restorable because a snapshot it needs is not in the
        run; an older composite that no longer restores because retention removed a snapshot
        it needs is a note (retention keeps only what the newest K composites need). The
        checked composite is leased for the whole check, each other snapshot while its files
        are checked; a snapshot removed by retention before it was leased is a note."""
        result = Verification()
        if step is None:
            committed = self.catalog.steps()
            if tombstones := self.catalog.tombstones():  # as that listing found them
                result.notes.append(tombstones_note(tombstones))
            if not committed:
                return result  # nothing committed (yet): nothing to be wrong
        with ReadLeases(self.catalog) as leases:
            try:
                composite, lost = self.catalog.lease_composite(leases, step, follow=step is None)
            except SnapshotNotFoundError:
                raise  # no snapshot (at that step): the user's mistake, not damage
            except TailorError as err:  # a damaged manifest on the way to the newest composite
                result.problems.append(str(err))
                composite, lost = None, {}
            if composite is not None and lost:
                result.problems.append(f"{not_restorable(composite.step, lost)}, so it cannot be restored")
            if step is None:
                targets: dict[int, set[str] | None] = {s: None for s in self.catalog.steps()}
            elif composite is None:
                targets = {step: None}
            else:
                targets = {source: set(units) for source, units in self.catalog.needs(composite).items() if source not in lost}
                targets[composite.step] = None  # the snapshot of `step` is needed whole (global state)
            for source, units in sorted(targets.items()):
                pinned = leases.holds(source)
                try:
                    if not leases.take(source):
                        result.notes.append(f"snapshot {source} was removed while verify ran (by retention); not checked")
                        continue
                    self._check_snapshot(source, units, step, result)
                except TailorError as err:
                    result.problems.append(str(err))
                finally:
                    if not pinned:
                        leases.release(source)  # one at a time: a run may hold more snapshots than descriptors
            if step is None:
                self._check_composites(composite.step if composite else None, result)
        result.checked.sort()
        result.problems = list(dict.fromkeys(result.problems))  # a damaged manifest is met twice
        return result

    def _check_snapshot(self, source: int, units: set[str] | None, step: int | None, result: Verification) -> None:
        manifest = self.catalog.manifest(source)
        snapshot = self.catalog.snapshot_key(source)
        elsewhere = self._elsewhere(manifest)
        held_elsewhere: set[str] = set()

        def problem_of(entry: FileEntry) -> str | None:
            writer = writer_rank(entry.path)
            if elsewhere is not None and writer is not None and elsewhere[0].node_of_rank(writer) in elsewhere[1]:
                held_elsewhere.add(entry.path)  # another node's part: this node's copy does not hold it
                return None
            return stored_problem(self.catalog.storage, f"{snapshot}/{entry.path}", entry)

        lacking = sorted(set(units or ()) - set(manifest.units))
        if lacking:
            result.problems.append(f"snapshot {source} holds no unit {lacking} although the composite of step {step} names it")
        for entry in manifest.files:
            problem = problem_of(entry)
            if problem:
                result.problems.append(problem)
        seen: set[str] = set()  # a pack file is listed by several units: checked once
        for unit in sorted(set(units or manifest.units) & set(manifest.units)):
            try:
                files = self.units.stored_entry(source, unit).files  # what this snapshot holds itself
                self.units.entry(source, unit)  # and what it keeps resolves
            except TailorError as err:
                result.problems.append(str(err))
                continue
            result.problems += [p for p in (problem_of(f) for f in files if f.path not in seen) if p]
            seen.update(f.path for f in files)
        if manifest.base is not None:
            base = self.units.base_storage(source)
            for file in manifest.base.files:
                if (manifest.base.path, file.path) not in result.base_checked:
                    result.base_checked.add((manifest.base.path, file.path))
                    problem = stored_problem(base, file.path, file)
                    if problem:
                        result.problems.append(f"base model directory: {problem}")
        if held_elsewhere:
            result.notes.append(f"snapshot {source}: {len(held_elsewhere)} file(s) of the parts of node(s) "
                                f"{sorted(elsewhere[1])} are held on other nodes (this is node {self._node}'s copy of a "
                                "node-local tier)")
        if units is None:  # checked whole: its own composite and layout too
            result.problems += self._model_problems(source, manifest)
        result.checked.append(source)

    def _elsewhere(self, manifest: Manifest) -> tuple[Nodes, set[int]] | None:
        """Where the run is one node's copy of a node-local tier: the nodes whose parts it does
        not hold, as the snapshot's placement says (``node_parts``); their files are not missing."""
        return parts_elsewhere(manifest.notes, self._node)

    def _model_problems(self, step: int, manifest: Manifest) -> list[str]:
        """Whether the snapshot of ``step`` holds the whole model: its composite names a version
        of every unit of its layout and no other, and its layout holds every layer its model
        config counts (where its family names the config's key). A snapshot committed by ranks
        holding different layers (pipeline stages, before they were refused) fails here."""
        try:
            layout = Layout.from_record(manifest.layout)
        except ConfigError as err:
            return [f"the manifest of step {step}: {err}"]
        problems = []
        unnamed = [u for u in layout.units if u not in manifest.composite]
        if unnamed:
            problems.append(f"the composite of step {step} names no version of units [{name_units(unnamed)}] that its "
                            "layout holds, so it cannot be restored")
        foreign = [u for u in manifest.composite if u not in layout.units]
        if foreign:
            problems.append(f"the composite of step {step} names units [{name_units(foreign)}] that its layout lacks")
        depth = self._configured_depth(step, manifest, layout.family)
        if depth is not None:
            missing = [layer_unit(i) for i in range(depth[1]) if layer_unit(i) not in layout.units]
            if missing:
                problems.append(f"the layout of step {step} lacks units [{name_units(missing)}] of the {depth[1]} "
                                f"layers its model config names ({depth[0]}): part of the model was not saved")
        for unit in manifest.units:  # each version written here holds (or keeps) every weight of its unit
            try:
                keys = {tensor.key for tensor in self.units.entry(step, unit).tensors}
            except TailorError:
                continue  # a damaged index: reported with the snapshot's files
            lacking = lacking_weights(layout.units.get(unit, ()), keys)
            if lacking:
                problems.append(f"unit {unit!r} of step {step} lacks (neither writes nor keeps) the weights of "
                                f"[{name_units(lacking)}]")
        return problems

    def _configured_depth(self, step: int, manifest: Manifest, family: str) -> tuple[str, int] | None:
        """(key, value) of the number of layers the model config saved at ``step`` names, where
        the layout's family says which key holds it; None where it is not known."""
        try:
            key = load_family(family).num_layers_key
        except ConfigError:
            return None  # a family this version does not ship
        if key is None or not any(entry.path == GLOBAL_JSON for entry in manifest.files):
            return None
        try:
            raw = read_stored(self.catalog.storage, f"{self.catalog.snapshot_key(step)}/{GLOBAL_JSON}", manifest.file_entry(GLOBAL_JSON))
            config = json.loads(bytes(raw)).get("model_config")
        except (TailorError, OSError, ValueError, RecursionError, AttributeError):
            return None  # a damaged file: reported with the snapshot's files
        depth = config.get(key) if isinstance(config, dict) else None
        return (key, depth) if isinstance(depth, int) and not isinstance(depth, bool) else None

    def _check_composites(self, newest: int | None, result: Verification) -> None:
        """Every checked snapshot's composite: a source present but lacking the unit is damage
        (retention removes whole snapshots); a source not in the run is a note, but for the
        newest composite (a problem already)."""
        present = set(self.catalog.steps())
        for step in result.checked:
            carrier = CARRIED_FOR in self.catalog.manifest(step).notes  # promoted to a tier for a newer composite only
            lost: dict[int, list[str]] = {}
            for unit, source in self.catalog.manifest(step).composite.items():
                if source == step:
                    continue
                if source not in present:
                    lost.setdefault(source, []).append(unit)
                    continue
                try:
                    holds = unit in self.catalog.manifest(source).units
                except TailorError:
                    continue  # its manifest is damaged: reported with that snapshot
                if not holds:
                    result.problems.append(
                        f"snapshot {source} holds no unit {[unit]} although the composite of step {step} names it"
                    )
            if lost and step != newest and not carrier:
                result.notes.append(f"{not_restorable(step, lost)} (removed by retention?)")
