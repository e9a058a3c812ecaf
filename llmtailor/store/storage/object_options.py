"""An object store's options: what llmtailor reads itself (``lock_ttl``), what goes to obstore's
store and HTTP client, retries, and defaults from the environment (``OPTIONS_ENV``, and each
cloud's own variables, which obstore reads as the cloud's tools do)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmtailor.errors import ConfigError

DEFAULT_LOCK_TTL = 30.0

_OWN_OPTIONS = {"lock_ttl"}
"""Options llmtailor reads itself; every other option goes to obstore's store constructor
(``endpoint``, ``region``, ``access_key_id``, ``allow_http``, ``client_options``,
``retry_config``, ...)."""

_ALIASES = {"endpoint_url": "endpoint", "aws_endpoint_url": "endpoint", "key": "access_key_id",
            "secret": "secret_access_key", "token": "session_token"}


_CLIENT_OPTIONS = {"allow_http", "allow_invalid_certificates", "timeout", "connect_timeout", "proxy_url",
                   "user_agent", "http1_only", "http2_only", "pool_idle_timeout", "pool_max_idle_per_host"}
"""Options of the HTTP client, not of the store: given with the others, passed to the client."""

DEFAULT_RETRY = {"max_retries": 6, "retry_timeout": 120.0,
                 "backoff": {"init_backoff": 0.1, "max_backoff": 5.0, "base": 2.0}}
"""Transient errors (5xx, throttling, dropped connections) are retried with exponential backoff
and jitter, at most 6 times within 2 minutes; then the error names the object."""

OPTIONS_ENV = "LLMTAILOR_STORAGE_OPTIONS"
"""An environment variable holding default storage options as a JSON object (the CLI's
``--storage-option KEY=VALUE`` sets it for the one command); options given in code win."""


def load_obstore():
    try:
        import obstore
        import obstore.store
    except ImportError:  # pragma: no cover - a dependency; named for a broken install
        raise ConfigError("object-store runs need the obstore package: pip install obstore") from None
    return obstore


@dataclass(frozen=True)
class StoreOptions:
    """The options of one object store, sorted out: ``given`` (as the user named them, aliases
    resolved), ``lock_ttl``, and what obstore's ``from_url`` takes (``retry``, ``client``, and the
    store's own ``store``)."""

    given: dict[str, Any]
    lock_ttl: float
    retry: dict[str, Any]
    client: dict[str, Any]
    store: dict[str, Any]


def resolve_options(scheme: str, options: Mapping[str, Any] | None) -> StoreOptions:
    """The options given in code over those of ``OPTIONS_ENV``, sorted out (``StoreOptions``);
    ConfigError naming a value that is not what its option takes."""
    given = {_ALIASES.get(k.lower(), k.lower()): v for k, v in {**_env_options(), **(options or {})}.items()}
    named = dict(given)
    lock_ttl = _lock_ttl(given.pop("lock_ttl", DEFAULT_LOCK_TTL))
    retry = _retry_config(_mapping("retry_config", given.pop("retry_config", DEFAULT_RETRY)))
    client = {**{k: given.pop(k) for k in list(given) if k in _CLIENT_OPTIONS},
              **_mapping("client_options", given.pop("client_options", None) or {})}
    endpoint = given.get("endpoint") or (env_endpoint() if scheme == "s3" else None)
    if str(endpoint or "").lower().startswith("http://"):
        client = {"allow_http": True, **client}  # the endpoint names http: what was meant (allow_http=false wins)
    return StoreOptions(given=named, lock_ttl=lock_ttl, retry=retry, client=client, store=given)


def _lock_ttl(value: Any) -> float:
    try:
        ttl = float(value)
    except (TypeError, ValueError):
        ttl = math.nan
    if not (math.isfinite(ttl) and ttl > 0):
        raise ConfigError(f"storage option lock_ttl={value!r}: expected seconds, a number > 0 "
                          f"(how long a writer's lease holds unrenewed; default {DEFAULT_LOCK_TTL:g})")
    return ttl


def _mapping(name: str, value: Any) -> Mapping[str, Any]:
    """A structured option (``retry_config``, ``client_options``): a mapping, or a JSON object
    as text (``--storage-option retry_config={"max_retries": 3}``)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            pass
    if not isinstance(value, Mapping):
        raise ConfigError(f"storage option {name}={value!r}: expected a JSON object of its settings")
    return value


def env_endpoint() -> str | None:
    """The S3 endpoint the environment names, as obstore (and the AWS tools) read it."""
    return os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT")


def _retry_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """obstore's retry configuration, with durations given as seconds accepted."""
    from datetime import timedelta

    def duration(value: Any) -> Any:
        return timedelta(seconds=float(value)) if isinstance(value, (int, float)) and not isinstance(value, bool) else value

    out = dict(config)
    if "retry_timeout" in out:
        out["retry_timeout"] = duration(out["retry_timeout"])
    if isinstance(out.get("backoff"), Mapping):
        backoff = dict(out["backoff"])
        for key in ("init_backoff", "max_backoff"):
            if key in backoff:
                backoff[key] = duration(backoff[key])
        out["backoff"] = backoff
    return out


def _env_options() -> dict[str, Any]:
    text = os.environ.get(OPTIONS_ENV)
    if not text:
        return {}
    try:
        options = json.loads(text)
    except ValueError as err:
        raise ConfigError(f"{OPTIONS_ENV} is not a JSON object ({err})") from None
    if not isinstance(options, dict):
        raise ConfigError(f"{OPTIONS_ENV} is not a JSON object")
    return options
