"""The run store: format, atomic commit, retention, leases, composite resolution. Imports
nothing of llmtailor but ``constants``, ``errors`` and ``layouts`` (name recognisers of
``interop/*/files.py`` aside), and nothing heavy here."""

from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[str, int, int], None]
"""``progress(unit, done, total)``, called as each unit is done: what the CLI's bars take."""
