"""What a newcomer gets wrong on the command line first, and what it says: a run at a URL with no
credentials, a URL of a scheme llmtailor does not open (docs/command-line.md: one line naming
the location at fault and what to do, exit 2, no traceback)."""

from __future__ import annotations

import http.server
import os
import threading

import pytest
from helpers import tiny
from typer.testing import CliRunner

from llmtailor import Tailor
from llmtailor.cli import app
from llmtailor.errors import ConfigError


class Refusing(http.server.BaseHTTPRequestHandler):
    """An instance metadata service that gives no credentials (HTTP 403 to every request)."""

    def refuse(self) -> None:
        self.send_response(403)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_PUT = refuse

    def log_message(self, *args) -> None:
        pass


def test_a_run_at_a_url_without_credentials_says_so_and_what_to_set(monkeypatch):
    """BEFORE: ``error: s3://b/run: permission denied (HTTP 403 from http://169.254.169.254)``:
    obstore, given no credentials, asks the instance metadata service, and its refusal read as
    the bucket's."""
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        result = CliRunner().invoke(app, ["-S", f"metadata_endpoint=http://127.0.0.1:{server.server_port}",
                                          "-S", "region=us-east-1", "inspect", "s3://b/run"], env={"COLUMNS": "80"})
    finally:
        server.shutdown()
        server.server_close()
    assert result.exit_code == 2
    assert result.output.startswith("error: s3://b/run: no credentials (none in the environment or the options, none from "
                                    f"the instance metadata service at http://127.0.0.1:{server.server_port}: HTTP 403)")
    assert result.output.rstrip().endswith("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or give the credentials as "
                                           "storage options")
    assert "Traceback" not in result.output


@pytest.mark.parametrize("url", ["https://example.com/runs/exp1", "ftp://host/runs/exp1", "s4://bucket/runs/exp1"])
def test_a_url_of_a_scheme_llmtailor_does_not_open_is_refused_naming_it(url, tmp_path, monkeypatch):
    """BEFORE: ``error: ftp:/host/runs/exp1: no such run directory`` (the URL taken for a local path,
    its // folded), and a Tailor at ``https://example.com/runs/exp1`` wrote a local directory
    ``https:/example.com/runs/exp1`` under the working directory."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["inspect", url], env={"COLUMNS": "80"})
    scheme = url.split("://")[0]
    assert (result.exit_code, result.output) == (2, f"error: {url}: {scheme}:// is not a storage llmtailor opens; give a "
                                                    "local path, or an s3://, gs://, az:// (abfs://, abfss://) or file:// URL\n")
    model, optimizer, _ = tiny()
    with pytest.raises(ConfigError, match=f"{scheme}:// is not a storage"):
        Tailor(url, model, optimizer)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("url,meant", [("memory://x", "memory:///x"), ("memory://runs/exp1", "memory:///runs/exp1")])
def test_a_memory_url_with_a_host_is_refused_saying_how_one_is_written(url, meant):
    """obstore's in-process store (``memory:///prefix``) has no bucket: a name after ``memory://``
    is refused in one line saying how to write it, by the CLI and by a Tailor. BEFORE:
    ``error: memory://x: cannot use this location (Generic URL error: Unable to recognise URL
    "memory://x")``."""
    result = CliRunner().invoke(app, ["inspect", url], env={"COLUMNS": "80"})
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert result.output.startswith(f"error: {url}: a memory:// URL names no bucket (it is obstore's in-process store, "
                                    f"empty each time it is opened): write {meant}"), result.output
    model, optimizer, _ = tiny()
    with pytest.raises(ConfigError, match=f"write {meant}"):
        Tailor(url, model, optimizer)
