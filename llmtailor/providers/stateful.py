"""Stateful objects: more of a training job's own state, saved and restored by a ``Tailor`` beside
the model, optimizer and LR scheduler (a data loader's position, a framework's loop state).

    tailor = Tailor("runs/exp", model, optimizer, stateful={"loader": loader, "ema": ema})

As torchtitan's checkpointer takes its map of stateful objects: a name -> an object with
``state_dict()`` and ``load_state_dict(state)``. The integrations hand their framework's own state
to their ``Tailor`` this way (``integrations/resume.py``); ``extra`` stays the user's.

Per rank, as ``extra`` is: at each save every rank calls each object's ``state_dict()`` and
encodes it at once (a copy, by the codec's rules: dicts, lists, tuples, numbers, strings, tensors,
numpy arrays; what would need pickle is refused naming it); the states are written, by name,
under ``STATEFUL_KEY`` of the rank's own global state: rank 0's in ``global.json``, another
rank's in its ``ranks/`` file. A restore, once the model, optimizer and scheduler are loaded,
calls each object's ``load_state_dict`` with the state its rank saved (rank r's at the same world
size; a rank beyond the saved world gets rank 0's, as its extras; an error the object raises is
raised as it is); an object the snapshot holds
no state for is left as it was and named in ``RestoreReport.unmapped``; a saved state no object
is given for is not read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from llmtailor.constants import STATEFUL_KEY
from llmtailor.errors import ConfigError


@runtime_checkable
class Stateful(Protocol):
    """What a ``Tailor`` saves and restores of a stateful object."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


class StatefulObjects:
    """The stateful objects of one ``Tailor``, by name (module docstring)."""

    def __init__(self, objects: dict[str, Stateful]):
        self.objects = objects

    @classmethod
    def of(cls, objects: Mapping[str, Any] | None) -> StatefulObjects:
        """``objects`` checked: a mapping of non-empty names to objects with ``state_dict`` and
        ``load_state_dict`` (a ConfigError naming every one that is not)."""
        if objects is None:
            return cls({})
        if not isinstance(objects, Mapping):
            raise ConfigError(f"stateful must map names to objects with state_dict() and load_state_dict(), "
                              f"got {objects!r}")
        wrong = [f"{name!r}: {type(obj).__name__}" for name, obj in objects.items()
                 if not isinstance(name, str) or not name or not isinstance(obj, Stateful)]
        if wrong:
            raise ConfigError(f"stateful: expected names (non-empty strings) of objects with state_dict() and "
                              f"load_state_dict(state), got {', '.join(wrong)}")
        return cls(dict(objects))

    def captured(self) -> dict[str, Any]:
        """What a save adds to this rank's own global state: ``{STATEFUL_KEY: {name: state}}``, or
        nothing when there are no objects (the global state of a run without them is unchanged)."""
        if not self.objects:
            return {}
        return {STATEFUL_KEY: {name: obj.state_dict() for name, obj in self.objects.items()}}

    def load(self, own: Mapping[str, Any]) -> list[str]:
        """Load each object from ``own`` (the rank state a restore maps to this rank); return a
        note for each object ``own`` holds no state for (left as it was)."""
        states = own.get(STATEFUL_KEY)
        states = states if isinstance(states, dict) else {}
        absent = []
        for name, obj in self.objects.items():
            if name not in states:
                absent.append(not_saved(name))
                continue
            obj.load_state_dict(states[name])  # its own error, if any, is the one to see
        return absent


def not_saved(name: str) -> str:
    """The ``RestoreReport.unmapped`` note for a stateful object the snapshot holds no state for."""
    return f"the snapshot holds no state for stateful object {name!r}: left as it was"


def saved_state(state: Mapping[str, Any], name: str) -> Any:
    """The state stateful object ``name`` saved in ``state`` (a rank's global state, as
    ``Run.read_global`` returns rank 0's), or None. A run written before stateful objects kept an
    integration's state in its extras, under the same name (as an import of a Trainer checkpoint
    keeps ``trainer_state``): read from there where the stateful objects' states lack it."""
    states = state.get(STATEFUL_KEY)
    if isinstance(states, dict) and name in states:
        return states[name]
    extra = state.get("extra")
    return extra.get(name) if isinstance(extra, dict) else None
