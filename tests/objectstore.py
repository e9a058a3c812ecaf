"""An S3-compatible server on loopback for the object-storage tests: moto's standalone server
(the real S3 HTTP protocol), started by the tests on a free port, in a process of its own or,
where a test injects faults, in a thread behind a WSGI layer that answers some requests with
errors, or lets moto act on a request and then loses its answer. Clients are the ones users run
(obstore through llmtailor, boto3 to look).
"""

from __future__ import annotations

import atexit
import io
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from helpers import free_port

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}


def environment(endpoint: str) -> dict[str, str]:
    """What a client (and a job started by a test) needs to reach the server: the variables the
    AWS tools read, and http allowed."""
    return {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint, "AWS_ALLOW_HTTP": "true"}


def wait_until_up(endpoint: str, server: subprocess.Popen | None = None, timeout: float = 300.0) -> None:
    """Wait for the server's answer to moto's own API (not an S3 request: a server checking
    credentials counts those); raise at once if its process ``server`` ended, and after
    ``timeout`` s only for a server that hangs (a busy machine may take long to import moto)."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=5).close()
            return
        except Exception:
            if server is not None and server.poll() is not None:
                raise RuntimeError(f"the S3 server for {endpoint} exited with status {server.returncode}") from None
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


_shared: tuple[subprocess.Popen, str] | None = None
"""The one default-settings server of this test process (``moto_process()``), started on first use."""


def _start_moto(settings: dict[str, str] | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **(settings or {})})
    endpoint = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(endpoint, proc)
    except BaseException:
        _stop(proc)
        raise
    return proc, endpoint


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(timeout=30)


def _stop_shared() -> None:
    if _shared is not None and _shared[0].poll() is None:
        _stop(_shared[0])


@contextmanager
def moto_process(settings: dict[str, str] | None = None) -> Iterator[str]:
    """moto's standalone server in a process of its own, with moto's environment ``settings``
    (``INITIAL_NO_AUTH_ACTION_COUNT``: check credentials after that many requests); yields its
    endpoint. Without ``settings``, one server serves every caller of this test process (each
    test makes buckets of its own with ``new_bucket``): it is started once, not once per test
    (importing moto costs a second of CPU and several on a busy machine), and stopped at exit."""
    global _shared
    if settings:
        proc, endpoint = _start_moto(settings)
        try:
            yield endpoint
        finally:
            _stop(proc)
        return
    if _shared is None or _shared[0].poll() is not None:
        if _shared is None:
            atexit.register(_stop_shared)
        _shared = _start_moto(None)
    yield _shared[1]


DROP = "drop"
"""``Faults.lose``: the connection is closed without an answer."""


class Faults:
    """Which requests the faulty server answers with an error: ``rule(method, key)`` returns an
    HTTP status to answer with, or None to pass the request to moto. ``lose(method, key)``, for
    a request passed to moto, returns how its answer is lost after moto acted on it (the client
    cannot know it did): an HTTP status sent in its place, or ``DROP``; None relays it."""

    def __init__(self):
        self.rule: Callable[[str, str], int | None] = lambda method, key: None
        self.lose: Callable[[str, str], int | str | None] = lambda method, key: None
        self.hold: Callable[[str, str], int | str | None] = lambda method, key: None
        """For a request not answered by ``rule``: how to answer it now (as ``lose``) while it is
        kept from moto, which acts on it only at ``land()`` (a request still on its way to the
        server, or queued there, when its client gave up)."""
        self.held: list[dict] = []
        self.seen: list[tuple[str, str, int | str | None]] = []
        self.ranges: list[tuple[str, str, str | None]] = []
        """``(method, key, its Range header or None)`` of every request, as ``seen``."""
        self._app: Callable | None = None

    def land(self) -> list[str]:
        """moto acts on the requests ``hold`` kept, in order, now; returns each one's status line."""
        statuses = []
        for environ in self.held:
            for _ in self._app(environ, lambda status, *rest: statuses.append(status) or (lambda data: None)):
                pass
        self.held.clear()
        return statuses


@contextmanager
def faulty_moto() -> Iterator[tuple[str, Faults]]:
    """moto's server app in a thread, behind a layer that answers the requests ``Faults.rule``
    picks with that status (a 503 "SlowDown", as S3 throttles, say); yields the endpoint and the
    ``Faults`` to set."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    faults = Faults()
    moto_app = faults._app = DomainDispatcherApplication(create_backend_app)

    def app(environ, start_response):
        method = environ["REQUEST_METHOD"]
        key = environ.get("PATH_INFO", "")
        status = faults.rule(method, key)
        if status is None and (held := faults.hold(method, key)) is not None:
            body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
            faults.held.append({**{k: v for k, v in environ.items() if k != "werkzeug.socket"}, "wsgi.input": io.BytesIO(body)})
            status = held
        elif status is None and (lost := faults.lose(method, key)) is not None:
            for _ in moto_app(environ, lambda *answer: lambda data: None):  # moto acts; its answer goes nowhere
                pass
            status = lost
        faults.seen.append((method, key, status))
        faults.ranges.append((method, key, environ.get("HTTP_RANGE")))
        if status == DROP:
            start_response("500 Dropped", [("Content-Length", "0")])
            environ["werkzeug.socket"].shutdown(socket.SHUT_RDWR)
            return []
        if status is not None:
            body = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
                    b"<Message>Please reduce your request rate.</Message></Error>")
            start_response(f"{status} Injected", [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
            return [body]
        return moto_app(environ, start_response)

    port = free_port()
    server = make_server("127.0.0.1", port, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(endpoint)
        yield endpoint, faults
    finally:
        server.shutdown()
        thread.join()


def new_bucket(endpoint: str) -> str:

    name = f"run-{uuid.uuid4().hex[:12]}"
    client(endpoint).create_bucket(Bucket=name)
    return name


def client(endpoint: str):
    return boto3_client("s3", endpoint)


def boto3_client(service: str, endpoint: str):
    """A boto3 client of ``service`` at the server, with the credentials the tests use."""
    import boto3

    return boto3.client(service, endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                        region_name="us-east-1")


def keys(endpoint: str, bucket: str, prefix: str = "") -> list[str]:
    """Every object key under ``prefix`` (boto3, as an operator would look)."""
    found, token = [], None
    while True:
        page = client(endpoint).list_objects_v2(Bucket=bucket, Prefix=prefix, **({"ContinuationToken": token} if token else {}))
        found += [o["Key"] for o in page.get("Contents", [])]
        if not page.get("IsTruncated"):
            return found
        token = page["NextContinuationToken"]


def staged_only(endpoint: str, url: str) -> list[str]:
    """Snapshot prefixes of the run at ``url`` that hold objects but no manifest (a promotion's staging)."""
    from llmtailor.constants import MANIFEST_FILE

    bucket, prefix = url.split("/")[2], "/".join(url.split("/")[3:]) + "/snapshots/"
    found = keys(endpoint, bucket, prefix)
    snapshots = {key[len(prefix):].split("/")[0] for key in found}
    return sorted(s for s in snapshots if f"{prefix}{s}/{MANIFEST_FILE}" not in found)


def uploads(endpoint: str, bucket: str) -> list[str]:
    """Keys of the unfinished multipart uploads in ``bucket``."""
    return [u["Key"] for u in client(endpoint).list_multipart_uploads(Bucket=bucket).get("Uploads", [])]


def set_environment(monkeypatch, endpoint: str) -> None:
    for name, value in environment(endpoint).items():
        monkeypatch.setenv(name, value)


__all__ = ["DROP", "Faults", "boto3_client", "environment", "faulty_moto", "keys", "moto_process", "new_bucket", "set_environment", "staged_only", "uploads",
           "client", "os"]
