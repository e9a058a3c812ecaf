"""One index file per snapshot (schema 6, issue 33): a save writes its units' indexes as lines of
one ``indexes.json`` (one durable file, not one per unit); each unit reads and checks its own
line; a run written by schema 5 (``fixtures/schema5_run``) restores bit for bit, verifies, and
takes schema-6 saves whose composite mixes both; inspect, verify and gc work on either; a save
killed between the index file and the manifest leaves no snapshot."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny, train, wait_launches
from typer.testing import CliRunner

from llmtailor import Full, Parity, Tailor
from llmtailor.cli import app
from llmtailor.constants import INDEX_DIR, INDEXES_FILE, MANIFEST_FILE, SCHEMA_VERSION
from llmtailor.errors import IntegrityError
from llmtailor.store.run import Run
from llmtailor.store.tensor_files import tensor_checksum
from llmtailor.training_example import TinyConfig, build_model

FIXTURES = Path(__file__).parent / "fixtures"
FIXTURE = FIXTURES / "schema5_run"
FIXTURE_CONFIG = TinyConfig(hidden_size=8, layers=2, heads=2, kv_heads=1, intermediate_size=8, seq_len=8, vocab_size=16)
"""``fixtures/schema5_run``: written by llmtailor at main cb592a3 (schema 5: packs, a file per
unit index) with ``fixtures/make_schema5_run.py``: this model (seed 0), its embedding and the
first layer's q_proj frozen,
AdamW, one real step before each of two Parity saves (step 2 keeps half its units from step 1).
``fixtures/schema5_expected.json``: the checksums a fresh restore of it gave then."""

DUMP = """
import json, sys, torch
sys.path[:0] = [{here!r}, {tests!r}]
from test_index_file import fixture_model, state_checksums
from llmtailor import Tailor
for run in sys.stdin:
    model, opt = fixture_model(seed=7)
    Tailor(run.rstrip("\\n"), model, opt, read_only=True).restore()
    print(json.dumps(state_checksums(model, opt)), flush=True)
"""


def fixture_model(seed: int):
    model = build_model(FIXTURE_CONFIG, seed=seed)
    model.model.embed_tokens.weight.requires_grad_(False)
    model.model.layers[0].self_attn.q_proj.weight.requires_grad_(False)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)


def state_checksums(model, opt) -> dict[str, str]:
    state = {n: tensor_checksum(p.detach()) for n, p in model.named_parameters()}
    state.update({f"{n}/{k}": tensor_checksum(v) for n, p in model.named_parameters()
                  for k, v in opt.state[p].items() if torch.is_tensor(v)})
    return state


def restore_in_fresh_process() -> subprocess.Popen:
    """A fresh interpreter (another process than the one that wrote the runs) that restores
    read-only each run directory ``restore_in`` hands it, each into a model and optimizer of its
    own; started at once, so that what this test does meanwhile runs beside its start, and one
    for the test's restores (an interpreter importing torch and llmtailor costs seconds of CPU
    here): ``restored`` waits for it."""
    code = DUMP.format(here=str(Path(__file__).parent), tests=str(Path(__file__).parents[1]))
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def restore_in(proc: subprocess.Popen, run_dir: Path) -> None:
    """``proc`` (``restore_in_fresh_process``) restores ``run_dir`` next (if it already failed,
    ``restored`` says how)."""
    try:
        proc.stdin.write(f"{run_dir}\n")
        proc.stdin.flush()
    except BrokenPipeError:
        pass


def restored(proc: subprocess.Popen) -> list[dict[str, str]]:
    """The checksums of every weight and moment of each restore ``proc`` (``restore_in_fresh_process``)
    did, in the order they were asked for; it ends first."""
    [(stdout, stderr)] = wait_launches([proc])  # its input closed: it ends once every restore is done
    assert proc.returncode == 0, stderr[-3000:]
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def test_a_save_writes_its_unit_indexes_as_lines_of_one_file_each_read_and_checked(tmp_path, tokens):
    model, opt, sched = tiny(layers=2, hidden=16)
    train(model, opt, sched, tokens, [1])
    with Tailor(tmp_path, model, opt, sched, policy=Full()) as tailor:
        tailor.save(1)
    run = Run(tmp_path)
    snapshot, manifest = run.snapshot_dir(1), run.manifest(1)
    assert manifest.schema_version == SCHEMA_VERSION >= 6
    assert not (snapshot / INDEX_DIR).exists() and (snapshot / INDEXES_FILE).is_file()
    assert INDEXES_FILE in [f.path for f in manifest.files]
    lines = (snapshot / INDEXES_FILE).read_bytes().splitlines(keepends=True)
    assert [json.loads(line)["unit"] for line in lines] == list(manifest.composite)  # layout order, one line each
    for unit, ref in manifest.units.items():
        assert (ref.index.path, ref.index_at) == (INDEXES_FILE, sum(len(line) for line in lines[:list(manifest.units).index(unit)]))
        assert run.units.stored_entry(1, unit).unit == unit
    # The manifest's bytes count the index file once (it is listed with the global state's files).
    assert manifest.total_bytes() == sum(p.stat().st_size for p in snapshot.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)
    # A unit whose line is damaged is refused, naming it; the others still read; verify names the file.
    raw = bytearray((snapshot / INDEXES_FILE).read_bytes())
    ref = manifest.units["layer.1"]
    raw[ref.index_at + 5] ^= 0x01
    (snapshot / INDEXES_FILE).write_bytes(bytes(raw))
    fresh = Run(tmp_path)
    with pytest.raises(IntegrityError, match="the index of unit 'layer.1'.*checksum"):
        fresh.units.stored_entry(1, "layer.1")
    assert fresh.units.stored_entry(1, "layer.0").unit == "layer.0"  # each line checked alone
    problems = Run(tmp_path).verify()
    assert any(INDEXES_FILE in p for p in problems), problems


@pytest.mark.slow
def test_a_schema5_run_restores_bit_for_bit_verifies_and_takes_schema6_saves_into_a_mixed_composite(tmp_path):
    run_dir = tmp_path / "old"
    shutil.copytree(FIXTURE, run_dir)
    shutil.copytree(FIXTURE, tmp_path / "pristine")  # restored in a fresh process while this one saves into run_dir
    fresh = restore_in_fresh_process()
    restore_in(fresh, tmp_path / "pristine")
    expected = json.loads((FIXTURES / "schema5_expected.json").read_text())
    assert Run(run_dir).manifest(2).schema_version == 5 and Run(run_dir).verify() == []
    model, opt = fixture_model(seed=3)
    tailor = Tailor(run_dir, model, opt, policy=Parity())
    assert tailor.restore().step == 2
    assert state_checksums(model, opt) == expected
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(1.0)
    tailor.save(3)  # schema 6, the other half of the units: the composite of step 3 mixes both schemas
    tailor.close()
    run = Run(run_dir)
    composite = run.resolve(3)
    assert run.manifest(3).schema_version == SCHEMA_VERSION and {run.manifest(s).schema_version for s in composite.sources.values()} == {5, SCHEMA_VERSION}
    # The frozen q_proj of layer.0, unchanged, is kept from the schema-5 snapshot that wrote it.
    assert run.units.stored_entry(3, "layer.0").kept == {"weight/model.layers.0.self_attn.q_proj.weight": 1}
    assert run.verify() == []
    saved_at_3 = {name for unit in run.manifest(3).units for name in run.manifest(3).layout["units"][unit]}
    want = dict(expected)
    want.update({n: tensor_checksum(p.detach()) for n, p in model.named_parameters() if n in saved_at_3})
    assert saved_at_3 and any(want[n] != expected[n] for n in saved_at_3)  # the shape under test: both versions needed
    shutil.copytree(run_dir, tmp_path / "mixed")  # the mixed run before gc, restored in a fresh process while gc runs
    restore_in(fresh, tmp_path / "mixed")
    # inspect and gc on the mixed run; the schema-5 snapshot of step 2 stays while step 3 needs it.
    runner = CliRunner()
    shown = runner.invoke(app, ["inspect", str(run_dir)])
    assert shown.exit_code == 0 and "composite as of step 3" in shown.output, shown.output
    assert runner.invoke(app, ["verify", str(run_dir)]).exit_code == 0
    assert runner.invoke(app, ["gc", str(run_dir), "--keep", "1"]).exit_code == 0
    assert Run(run_dir).steps() == sorted(set(Run(run_dir).resolve(3).sources.values()))
    restore_in(fresh, run_dir)
    pristine, mixed, after_gc = restored(fresh)
    assert pristine == expected  # the schema-5 run as the fixture holds it
    assert mixed == want and after_gc == want


KILLED_SAVE = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from helpers import tiny
from llmtailor import Full, Tailor
from llmtailor.constants import INDEXES_FILE
from llmtailor.store import commit

model, opt, sched = tiny(layers=2, hidden=16, seed=1)
tailor = Tailor({run!r}, model, opt, sched, policy=Full())
tailor.save(1)
real = commit.SnapshotCommit.commit

def killed(self, manifest, confirm=None, **pointer):
    assert (self.run.root / self.staging / INDEXES_FILE).is_file()  # written (durable once the commit has drained its batch); the manifest not yet
    os.kill(os.getpid(), signal.SIGKILL)

commit.SnapshotCommit.commit = killed
tailor.save(2)
"""


@pytest.mark.slow
def test_a_save_killed_between_its_index_file_and_its_manifest_leaves_no_snapshot(tmp_path):
    code = KILLED_SAVE.format(tests=str(Path(__file__).parents[1]), run=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert any((tmp_path / ".tmp").rglob(INDEXES_FILE))  # what the killed save left, unseen
    run = Run(tmp_path)
    assert run.steps() == [1] and run.latest_step() == 1 and run.verify() == []
    model, opt, sched = tiny(layers=2, hidden=16, seed=2)
    with Tailor(tmp_path, model, opt, sched, policy=Full()) as tailor:
        assert tailor.restore().step == 1
        tailor.save(2)  # the next writer clears what the crash left
    assert Run(tmp_path).steps() == [1, 2] and Run(tmp_path).verify() == []
    assert not any((tmp_path / ".tmp").rglob("*"))
