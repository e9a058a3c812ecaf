"""A tailored run as a merge source: versions that keep frozen tensors from older snapshots (a
LoRA run), links out of the run refused, and retention kept away while a merge reads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import yaml
from helpers import tiny, train, unit_file

from llmtailor import Full, Tailor
from llmtailor.errors import IntegrityError
from llmtailor.merge import merge
from llmtailor.store.retention import apply_retention, plan_retention
from llmtailor.store.run import Run


def plan(tmp_path: Path, run: Path) -> Path:
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump({"models": [{"model": str(run)}]}))
    return path


def test_a_run_keeping_frozen_tensors_merges_them_from_the_snapshot_that_holds_them(tmp_path, tokens):
    model, opt, sched = tiny()
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)
    with Tailor(tmp_path / "run", model, opt, sched, policy=Full()) as tailor:
        for s in (1, 2):
            train(model, opt, sched, tokens, [s])
            tailor.save(s)
    assert Run(tmp_path / "run")._stored_entry(2, "layer.0").kept  # the shape under test
    out = merge(plan(tmp_path, tmp_path / "run"), tmp_path / "merged", format="model")
    from safetensors.torch import load_file

    weights = load_file(str(out / "model.safetensors"))
    for name, param in model.named_parameters():
        assert torch.equal(weights[name], param.detach()), name


def test_a_unit_file_linked_out_of_the_run_is_refused_by_a_merge(tmp_path, tokens):
    model, opt, sched = tiny()
    with Tailor(tmp_path / "run", model, opt, sched) as tailor:
        train(model, opt, sched, tokens, [1])
        tailor.save(1)
    unit = unit_file(tmp_path / "run", 1, "layer.1")  # the tiny model's pack file
    outside = tmp_path / "elsewhere.safetensors"
    unit.rename(outside)
    os.symlink(outside, unit)
    with pytest.raises(IntegrityError, match="outside the run"):
        merge(plan(tmp_path, tmp_path / "run"), tmp_path / "merged", format="model")


def test_retention_leaves_what_an_open_merge_source_reads(tmp_path, tokens):
    from llmtailor.interop.tailored import RunSource

    model, opt, sched = tiny()
    with Tailor(tmp_path / "run", model, opt, sched) as tailor:
        for s in (1, 2):
            train(model, opt, sched, tokens, [s])
            tailor.save(s)
    run = Run(tmp_path / "run")
    source = RunSource("old", Run(tmp_path / "run"), 1)  # the composite of step 1, being read
    outcome = apply_retention(run, plan_retention(run, 1))
    assert outcome.in_use == [1] and run.steps() == [1, 2]
    source.close()
    assert apply_retention(run, plan_retention(run, 1)).deleted == [1]
