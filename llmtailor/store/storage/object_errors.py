"""obstore's errors as one line each, for ``ObjectStorage``'s messages.

obstore's text of a failed request is a dump over many lines: a first line ending in the start
of the server's XML body (``... 404 Not Found: <?xml version="1.0" ...>``), the body on the
next, then a debug print of the Rust error chain. What a user needs is in the middle: the
server's error ``Code`` and ``Message`` (``NoSuchBucket``, ``SignatureDoesNotMatch``,
``InvalidAccessKeyId``, ``AccessDenied``, ...) and its HTTP status, or, when no server
answered, why (the connection refused, the host unknown); and which endpoint was asked.
``explain`` finds those and says what kind of failure it was; ``failure`` turns one into the
error the storage raises, naming the object (a refusal of the credentials with ``errno.EACCES``).
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from llmtailor.errors import IntegrityError, StorageError, TailorError

MISSING, DENIED, NO_BUCKET, OTHER = "missing", "denied", "no bucket", "other"

AUTH_CODES = frozenset({
    "AccessDenied", "AllAccessDisabled", "AccountProblem", "AuthenticationFailed", "AuthorizationFailure",
    "ExpiredToken", "InvalidAccessKeyId", "InvalidToken", "SignatureDoesNotMatch", "TokenRefreshRequired",
})
"""Error codes of S3 and Azure that mean the credentials or their rights are wrong."""
NO_BUCKET_CODES = frozenset({"NoSuchBucket", "ContainerNotFound"})
_AUTH_STATUSES = {401, 403}
_SERVICE_HOSTS = frozenset({"169.254.169.254", "fd00:ec2::254", "169.254.170.2", "169.254.170.23", "fd00:ec2::23",
                            "metadata.google.internal", "metadata"})
"""The hosts of the credential services a client asks when it is given no credentials: the
instance metadata services of AWS (IPv4 and IPv6), GCP and Azure, ECS's task credentials, EKS's
pod identity agent. A request there failing means none were found. Told by the host, never by
the path: a request of the store itself may have any path (a virtual-hosted bucket's starts with
the run's prefix, a path-style one's with the bucket's name: ``s3://latest/meta-data/run``)."""
_SERVICE_OPTIONS = ("metadata_endpoint", "container_credentials_full_uri", "msi_endpoint", "identity_endpoint")
"""obstore's options (with or without their ``aws_`` / ``azure_`` prefix) that move a credential
service elsewhere; ``_SERVICE_VARIABLES``: the environment variables that do."""
_SERVICE_VARIABLES = ("AWS_METADATA_ENDPOINT", "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AZURE_MSI_ENDPOINT",
                      "AZURE_IDENTITY_ENDPOINT", "GCE_METADATA_HOST")
_CREDENTIAL_VARIABLES = {"S3": "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY", "GCS": "GOOGLE_APPLICATION_CREDENTIALS",
                         "MicrosoftAzure": "AZURE_STORAGE_ACCOUNT_KEY"}
_LONGEST = 300


@dataclass(frozen=True)
class Explained:
    """A failure's ``kind`` (``MISSING``: no such object; ``DENIED``; ``NO_BUCKET``;
    ``OTHER``) and ``text``: one line saying what the server said, or why none answered."""

    kind: str
    text: str


def credential_services(options: Mapping[str, Any]) -> frozenset[str]:
    """Where ``options`` (a store's, lowercased) and the environment move a credential service:
    each ``host[:port]`` (``_SERVICE_OPTIONS``, ``_SERVICE_VARIABLES``), for ``explain``."""
    values = [value for name, value in options.items()
              if name.removeprefix("aws_").removeprefix("azure_") in _SERVICE_OPTIONS and isinstance(value, str)]
    values += [os.environ[name] for name in _SERVICE_VARIABLES if os.environ.get(name)]
    return frozenset(_host(value) for value in values)


def _host(location: str) -> str:
    """``host[:port]`` of a URL, or of a bare ``host[:port]`` (``GCE_METADATA_HOST``'s), lowercased."""
    return (urlsplit(location).netloc if "://" in location else location.split("/", 1)[0]).lower()


def explain(err: BaseException, denied: bool = False, missing: bool = False,
            services: frozenset[str] = frozenset()) -> Explained:
    """``err`` (an obstore error) explained; ``denied`` / ``missing``: obstore classed it so
    (its permission or not-found exception types); ``services``: where the store's options or
    the environment moved a credential service (``credential_services``)."""
    text = str(err)
    code, message = _tag(text, "Code"), _tag(text, "Message")
    status = _number(r"status code: (\d{3})", text)
    origin = _origin(text)
    if code or message:
        said = ": ".join(part for part in (code, message) if part)
    else:
        said = _json_message(text) or ""
    where = f"HTTP {status} from {origin}" if status else f"from {origin}"
    if _asks_credentials(text, services):
        why = f"HTTP {status}" if status else _unanswered(text, origin) or _first_line(err)
        store = re.search(r"Generic (\w+) error", text)
        variables = _CREDENTIAL_VARIABLES.get(store.group(1) if store else "", "the cloud's credential variables")
        return Explained(DENIED, _shorten(
            f"no credentials (none in the environment or the options, none from the instance metadata service at "
            f"{origin}: {why}): set {variables}, or give the credentials as storage options"))
    retries = _number(r"after (\d+) retries", text)
    if retries:
        where += f", after {retries} retries"
    if code in NO_BUCKET_CODES:
        return Explained(NO_BUCKET, _shorten(f"{said} ({where})"))
    if denied or code in AUTH_CODES or status in _AUTH_STATUSES:
        return Explained(DENIED, _shorten(f"permission denied ({said + '; ' if said else ''}{where})"))
    if missing:
        return Explained(MISSING, _shorten(f"not found ({said + '; ' if said else ''}{where})"))
    if said:
        return Explained(OTHER, _shorten(f"{said} ({where})"))
    return Explained(OTHER, _shorten(_unanswered(text, origin) or _first_line(err)))


def _asks_credentials(text: str, services: frozenset[str]) -> bool:
    """Whether the request that failed went to a credential service (``_SERVICE_HOSTS``, or one
    of ``services``), not to the store."""
    match = re.search(r"Error performing [A-Z]+ (\S+)", text)
    if not match:
        return False
    parts = urlsplit(match.group(1))
    return (parts.hostname or "") in _SERVICE_HOSTS or parts.netloc.lower() in services


def _unanswered(text: str, origin: str) -> str | None:
    """Why no server answered, from the error chain's debug print; None when one did."""
    if "ConnectionRefused" in text:
        return f"connection refused by {origin} (no server listening there: check the endpoint)"
    if "dns error" in text:
        return f"cannot resolve the host of {origin} (check the endpoint)"
    if "kind: Connect" in text:
        reasons = re.findall(r'message: "([^"]*)"', text)
        return f"cannot connect to {origin}" + (f" ({reasons[-1]})" if reasons else "")
    if "builder error" in text and origin.startswith("http://"):  # the client's https-only setting
        return f"plain HTTP to {origin} is not allowed (allow_http is false)"
    if "kind: Timeout" in text or "TimedOut" in text:
        return f"no answer from {origin} in time"
    return None


def _tag(text: str, name: str) -> str | None:
    """The first line of the XML element ``name`` (Azure's ``Message`` goes on with lines of its
    own: ``RequestId:...``, ``Time:...``)."""
    match = re.search(rf"<{name}>([^<]*)</{name}>", text)
    if not match or not match.group(1).strip():
        return None
    return match.group(1).strip().splitlines()[0].strip().rstrip(".")


def _json_message(text: str) -> str | None:
    """The ``message`` of a JSON error body (Google Cloud Storage's)."""
    match = re.search(r'"message"\s*:\s*"([^"]*)"', text)
    return match.group(1).rstrip(".") if match else None


def _number(pattern: str, text: str) -> int | None:
    match = re.search(pattern, text)
    return int(match.group(1)) if match else None


def _origin(text: str) -> str:
    """``scheme://host:port`` of the request that failed, or "the object store"."""
    match = re.search(r"Error performing [A-Z]+ (\S+)", text)
    if not match:
        return "the object store"
    parts = urlsplit(match.group(1))
    return f"{parts.scheme}://{parts.netloc}" if parts.scheme and parts.netloc else "the object store"


def _first_line(err: BaseException) -> str:
    """The first line of an error, without the start of a body it quotes."""
    line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return line.split("<?xml", 1)[0].rstrip(" :") or type(err).__name__


def _shorten(text: str) -> str:
    return text if len(text) <= _LONGEST else text[: _LONGEST - 3] + "..."


def failure(err: Exception, where: str, missing: str = "file is missing",
            services: frozenset[str] = frozenset()) -> TailorError:
    """An obstore error as one line naming the object ``where``: IntegrityError when it is
    missing, StorageError otherwise (after obstore's retries of transient errors); ``services``:
    as ``explain``'s."""
    from obstore import exceptions  # loaded: obstore raised ``err``

    denied = isinstance(err, exceptions.PermissionDeniedError | exceptions.UnauthenticatedError)
    explained = explain(err, denied=denied, missing=isinstance(err, FileNotFoundError), services=services)
    if explained.kind == MISSING:
        return IntegrityError(f"{where}: {missing}")
    # Refused credentials or rights carry EACCES, as a local run's permission error does: a
    # caller tells them by their errno (``strategies.CANNOT_CREATE``), never by their text.
    denied_here = PermissionError(errno.EACCES, explained.text) if explained.kind == DENIED else None
    return StorageError(f"{where}: {explained.text}", denied_here)
