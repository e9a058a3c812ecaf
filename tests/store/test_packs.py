"""Pack files (issue 33): a save writes its small units together into one file per rank, a
large unit into a file of its own; units read back from either, bit for bit, in a fresh
process; the bytes add up; verify, retention and a run written before packs (schema 4) keep
working."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import flip_unit_byte, tiny, train, unit_file

import llmtailor.store.writer as writer
from llmtailor import Full, Parity, Tailor, Tier
from llmtailor.constants import MANIFEST_FILE, PACKS_DIR, SCHEMA_VERSION, UNITS_DIR
from llmtailor.store.retention import apply_retention, plan_retention
from llmtailor.store.tiers import promote
from llmtailor.store.run import Run
from llmtailor.training_example import TinyConfig, build_model

FIXTURE = Path(__file__).parent / "fixtures" / "schema4_run"
FIXTURE_CONFIG = TinyConfig(hidden_size=8, layers=2, heads=2, kv_heads=1, intermediate_size=8, seq_len=8, vocab_size=16)

DUMP = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from helpers import tiny
from llmtailor import Tailor
from llmtailor.store.tensor_files import tensor_checksum
model, opt, sched = tiny(hidden=16, seed=9)
Tailor({run!r}, model, opt, sched, read_only=True).restore()
state = {{n: tensor_checksum(p.detach()) for n, p in model.named_parameters()}}
state.update({{f"{{n}}/{{k}}": tensor_checksum(v) for n, p in model.named_parameters()
              for k, v in opt.state[p].items() if torch.is_tensor(v)}})
print(json.dumps(state))
"""


def checksums(model, opt) -> dict[str, str]:
    from llmtailor.store.tensor_files import tensor_checksum

    state = {n: tensor_checksum(p.detach()) for n, p in model.named_parameters()}
    state.update({f"{n}/{k}": tensor_checksum(v) for n, p in model.named_parameters()
                  for k, v in opt.state[p].items() if torch.is_tensor(v)})
    return state


@pytest.mark.slow
def test_small_units_share_one_pack_file_large_ones_their_own_and_a_fresh_process_restores_both(tmp_path, tokens, monkeypatch):
    model, opt, sched = tiny(hidden=16)
    train(model, opt, sched, tokens, [1])
    # Large here: embed and head (vocab x hidden weights, AdamW's two moments, its step); a layer is smaller.
    monkeypatch.setattr(writer, "PACK_UNIT_BYTES", model.model.embed_tokens.weight.numel() * 12)
    with Tailor(tmp_path, model, opt, sched, policy=Full()) as tailor:
        report = tailor.save(1)
    snapshot = Run(tmp_path).snapshot_dir(1)
    assert sorted(p.name for p in (snapshot / UNITS_DIR).iterdir()) == ["embed.safetensors", "head.safetensors"]
    assert [p.name for p in (snapshot / PACKS_DIR).iterdir()] == ["rank-00000.0.safetensors"]
    for unit in ("layer.0", "layer.3", "norm"):
        assert unit_file(tmp_path, 1, unit) == snapshot / PACKS_DIR / "rank-00000.0.safetensors"
    # Every byte counted once: the report, and the units' shares, add up to the files.
    on_disk = sum(p.stat().st_size for p in snapshot.rglob("*") if p.is_file() and not p.name.startswith("."))
    assert report.bytes == on_disk
    manifest = Run(tmp_path).manifest(1)
    assert manifest.total_bytes() + (snapshot / MANIFEST_FILE).stat().st_size == on_disk
    assert Run(tmp_path).verify() == []

    script = DUMP.format(tests=str(Path(__file__).parents[1]), run=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == checksums(model, opt)


def test_a_damaged_unit_in_a_pack_is_named_by_verify_and_refused_by_restore(tmp_path, tokens):
    model, opt, sched = tiny()
    train(model, opt, sched, tokens, [1])
    with Tailor(tmp_path, model, opt, sched) as tailor:
        tailor.save(1)
    path = flip_unit_byte(tmp_path, 1, "layer.2")
    problems = Run(tmp_path).verify()
    assert len(problems) == 1 and f"{path.name}: checksum mismatch" in problems[0]  # the pack, checked once
    with pytest.raises(Exception, match=r"checksum mismatch in tensor 'weight/model\.layers\.2\."):
        Tailor(tmp_path, *tiny(seed=3)).restore()


def test_retention_keeps_a_pack_while_a_kept_composite_needs_a_unit_of_it(tmp_path, tokens):
    """Parity writes odd and even layers in turn: the composite of step 3 needs step 2's pack
    (its half of the layers), not step 1's."""
    model, opt, sched = tiny()
    with Tailor(tmp_path, model, opt, sched, policy=Parity()) as tailor:
        for step in (1, 2, 3):
            train(model, opt, sched, tokens, [step])
            tailor.save(step)
    run = Run(tmp_path)
    needed = {s for s in run.resolve(3).sources.values()}
    assert needed == {2, 3}
    before = tiny(seed=4)
    Tailor(tmp_path, *before, read_only=True).restore()
    apply_retention(run, plan_retention(run, keep=1))
    assert Run(tmp_path).steps() == [2, 3]
    assert Run(tmp_path).verify() == []
    after = tiny(seed=5)
    Tailor(tmp_path, *after, read_only=True).restore()
    assert checksums(after[0], after[1]) == checksums(before[0], before[1])


def test_a_run_written_before_packs_restores_verifies_and_takes_packed_saves(tmp_path):
    """``fixtures/schema4_run``: written by llmtailor before issue 33 (schema 4, a file per
    unit): a tiny model (seed 0) + 0.5 saved at step 1 with Parity (whole), + 0.75 at step 2
    (half its units; layer.0 stays step 1's)."""
    run_dir = tmp_path / "old"
    shutil.copytree(FIXTURE, run_dir)
    assert Run(run_dir).manifest(2).schema_version == 4
    assert Run(run_dir).verify() == []
    model = build_model(FIXTURE_CONFIG, seed=0)
    expected = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            expected[name] = param + 0.5 if ".layers.0." in name else (param + 0.5) + 0.25
            param.zero_()
    tailor = Tailor(run_dir, model, policy=Full())
    assert tailor.restore().step == 2
    for name, param in model.named_parameters():
        assert torch.equal(param, expected[name]), name
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    tailor.save(3)  # packed, on top of the schema-4 snapshots
    tailor.close()
    assert Run(run_dir).manifest(3).schema_version == SCHEMA_VERSION
    assert unit_file(run_dir, 3, "layer.0").parent.name == PACKS_DIR
    assert Run(run_dir).verify() == []
    again = build_model(FIXTURE_CONFIG, seed=1)
    Tailor(run_dir, again, read_only=True).restore()
    for (name, param), (_, want) in zip(again.named_parameters(), model.named_parameters()):
        assert torch.equal(param, want), name


def test_a_promotion_copies_a_pack_file_once_not_once_per_unit_in_it(tmp_path, tokens, monkeypatch):
    """Every unit's index lists the pack it lies in; the snapshot's files (``Run.stored_files``)
    name it once, so a promotion to the next tier sends its bytes once."""
    copied = []
    copy_file = promote.copy_file

    def counted(source, key, sink, entry):
        copied.append(key.split("/", 2)[-1])
        return copy_file(source, key, sink, entry)

    monkeypatch.setattr(promote, "copy_file", counted)
    model, opt, sched = tiny()
    tailor = Tailor(tmp_path / "home", model, opt, sched, policy=Full(), tiers=[Tier(tmp_path / "memory")])
    train(model, opt, sched, tokens, [1])
    tailor.save(1)
    tailor.close()
    packs = [path for path in copied if path.startswith(f"{PACKS_DIR}/")]
    assert packs and len(copied) == len(set(copied)), copied
    assert Run(tmp_path / "home").verify() == []
