"""The run store: format, atomic commit, retention, leases, composite resolution. Imports
nothing of llmtailor but ``constants``, ``errors``, ``distributed`` and ``layouts`` (what other
formats a directory may hold is told to ``storage`` from above), and nothing heavy here."""

from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[str, int, int], None]
"""``progress(unit, done, total)``, called as each unit is done: what the CLI's bars take."""
