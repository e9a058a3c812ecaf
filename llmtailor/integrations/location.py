"""A run's location as every integration takes it: as ``Tailor`` does.

A local path or an object-store URL (``s3://bucket/run``, ``gs://``, ``az://``, or ``file://``),
with ``TailorConfig.storage_options`` for the store. A URL is kept as the string given: wrapped in
a ``Path`` it would become the local directory ``s3:/bucket/run``. Whether two locations are one
run is the storage's identity (``Storage.same_place``, ``Tiers.index_of``), never a comparison of
paths: ``file:///data/run`` and ``/data/run`` are one run, ``s3://b/run`` is no local path."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from llmtailor.errors import ConfigError
from llmtailor.store.storage import is_url
from llmtailor.store.storage.location import refuse_other_schemes


def run_location(location: Any, name: str = "run_dir") -> str | Path:
    """``location`` as ``Tailor`` takes it: a URL as the string given, a local path as a
    ``Path``. Anything else is a ConfigError naming ``name``."""
    if isinstance(location, os.PathLike):
        location = os.fspath(location)
    if not isinstance(location, str) or not location.strip():
        raise ConfigError(f"{name}={location!r}: expected a local path or a URL (s3://, gs://, az://, file://)")
    refuse_other_schemes(location)  # before a Path folds its // into a local directory's name
    return location if is_url(location) else Path(location)


def child_location(location: str | Path, name: str) -> str | Path:
    """The location ``name`` inside ``location`` (a URL stays a URL)."""
    if isinstance(location, Path):
        return location / name
    return f"{location.rstrip('/')}/{name}"
