"""Which storage a location is: a local path or ``file://`` URL, or an object-store URL."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from llmtailor.errors import ConfigError
from llmtailor.store.storage.base import Storage
from llmtailor.store.storage.local import LocalStorage
from llmtailor.store.storage.objects import ObjectStorage

URL_SCHEMES = ("s3", "gs", "az", "abfs", "abfss", "memory")
"""Schemes of object stores (``file://`` is the local filesystem)."""
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


def is_url(location: str | Path) -> bool:
    """Whether ``location`` names an object store (``s3://...``) or a ``file://`` URL rather
    than a plain local path."""
    text = str(location)
    return "://" in text and text.split("://", 1)[0].lower() in (*URL_SCHEMES, "file")


def refuse_other_schemes(text: str) -> None:
    """A ConfigError where ``text`` is a URL of a scheme llmtailor does not open (``https://``, a
    mistyped ``s4://``): not a local path either ("https://host/run" is no directory "https:");
    and where it is a ``memory://`` URL with a host (``memory://x``), which obstore does not open
    (its in-process store is ``memory:///prefix``, for tests: empty each time it is opened)."""
    scheme = _SCHEME.match(text)
    if scheme and not is_url(text):
        raise ConfigError(f"{text}: {scheme.group(1)}:// is not a storage llmtailor opens; give a local path, "
                          "or an s3://, gs://, az:// (abfs://, abfss://) or file:// URL")
    rest = text[scheme.end():] if scheme else ""
    if scheme and scheme.group(1).lower() == "memory" and rest and not rest.startswith("/"):
        # obstore opens memory:// and memory:///prefix only; a name read as a host is its "Generic URL error"
        raise ConfigError(f"{text}: a memory:// URL names no bucket (it is obstore's in-process store, empty each time "
                          f"it is opened): write memory:///{rest}")


def open_storage(location: str | Path | Storage, options: Mapping[str, Any] | None = None) -> Storage:
    """The storage of ``location``: a local path or ``file://`` URL (``LocalStorage``), or an
    object-store URL (``s3://bucket/prefix``, ``gs://``, ``az://``, ``memory:///prefix``:
    ``ObjectStorage``, configured by ``options`` and the environment, as obstore and each
    cloud's tools configure themselves). A ``Storage`` is returned as it is."""
    if isinstance(location, Storage):
        return location
    text = str(location)
    refuse_other_schemes(text)
    if is_url(text) and not text.lower().startswith("file://"):
        return ObjectStorage(text, options)
    if options:
        raise ConfigError(f"storage options {sorted(options)} were given for {text}, a local path; "
                          "they apply to object-store URLs (s3://, gs://, az://)")
    if text.lower().startswith("file://"):
        text = text[len("file://"):]
    return LocalStorage(Path(text))
