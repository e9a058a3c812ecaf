"""Stateful objects handed to a ``Tailor`` (``providers/stateful.py``): saved at every save beside
the extras, loaded back by ``restore`` once the model is, refused when they would need pickle."""

import json

import pytest
import torch
from helpers import tiny, train

from llmtailor import Tailor
from llmtailor.errors import ConfigError, TailorError
from llmtailor.providers.stateful import saved_state
from llmtailor.store.run import Run


class Position:
    """A data loader's position: what a job keeps beside its model."""

    def __init__(self, batch: int = 0):
        self.batch, self.order = batch, torch.arange(4)
        self.loaded: list = []

    def state_dict(self):
        return {"batch": self.batch, "order": self.order}  # the save encodes a copy

    def load_state_dict(self, state):
        self.loaded.append(state)
        self.batch, self.order = state["batch"], state["order"]


def test_stateful_objects_are_saved_with_each_snapshot_and_restored_in_place(tmp_path, tokens):
    model, opt, sched = tiny()
    position = Position()
    with Tailor(tmp_path, model, opt, sched, stateful={"position": position}) as tailor:
        for step in (1, 2):
            train(model, opt, sched, tokens, [step])
            position.batch, position.order = step * 10, torch.arange(4).flip(0) + step
            tailor.save(step, extra={"next": step + 1})
    doc = json.loads(Run(tmp_path).snapshot_dir(2).joinpath("global.json").read_text())
    assert doc["stateful"]["position"]["batch"] == 20 and doc["extra"] == {"next": 3}

    fresh = Position()
    report = Tailor(tmp_path, *tiny(seed=5), stateful={"position": fresh}, read_only=True).restore(step=1)
    assert (report.step, report.extra, report.unmapped) == (1, {"next": 2}, ())
    assert fresh.batch == 10 and torch.equal(fresh.order, torch.arange(4).flip(0) + 1)
    assert saved_state(Run(tmp_path).read_global(2), "position")["batch"] == 20


def test_an_object_the_snapshot_holds_no_state_for_is_left_as_it_was_and_named(tmp_path):
    Tailor(tmp_path, *tiny()).save(1, extra={"position": {"batch": 3}})  # a key of the extras is no state
    position = Position(batch=7)
    report = Tailor(tmp_path, *tiny(), stateful={"position": position}, read_only=True).restore()
    assert position.loaded == [] and position.batch == 7 and report.extra == {"position": {"batch": 3}}
    assert report.unmapped == ("the snapshot holds no state for stateful object 'position': left as it was",)
    assert Tailor(tmp_path, *tiny(), read_only=True).restore().unmapped == ()  # no object: nothing to load


def test_what_is_not_a_stateful_object_is_refused_when_the_tailor_is_built(tmp_path):
    with pytest.raises(ConfigError, match=r"^stateful: expected names .* got 'position': int, 3: Position$"):
        Tailor(tmp_path, *tiny(), stateful={"position": 3, 3: Position()})
    with pytest.raises(ConfigError, match="stateful must map names to objects"):
        Tailor(tmp_path, *tiny(), stateful=[Position()])
    assert not (tmp_path / "snapshots").exists()


def test_a_state_only_pickle_could_store_is_refused_naming_it_without_writing(tmp_path):
    position = Position()
    position.order = lambda: 0
    tailor = Tailor(tmp_path, *tiny(), stateful={"position": position})
    with pytest.raises(TailorError, match=r"global state.stateful.position.order is a builtins.function"):
        tailor.save(1)
    assert Run(tmp_path).steps() == []
