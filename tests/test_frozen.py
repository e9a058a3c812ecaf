"""Frozen weights are written once (llmtailor/frozen.py): LoRA with real peft, partly frozen
models, a parameter frozen mid-run, an in-place change of a frozen tensor, retention."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import assert_bitwise, tiny, train, unit_versions

from llmtailor import Adaptive, Full, Parity, Tailor
from llmtailor.distributed.coordinator import CoordinationError, LocalCoordinator
from llmtailor.frozen import FrozenParts
from llmtailor.store.run import Run
from llmtailor.training_example import batch_at

peft = pytest.importorskip("peft")


def base_model():
    """The tiny Llama every LoRA here adapts (always the same weights)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, bos_token_id=None,
                                      eos_token_id=None, pad_token_id=None)
    return transformers.AutoModelForCausalLM.from_config(config)


def lora(seed: int = 0, r: int = 4, dora: bool = False):
    """``base_model()`` with LoRA on q and v (adapters drawn from ``seed``; ``dora``: DoRA's,
    with a magnitude vector per layer), its AdamW over the adapters only."""
    base = base_model()
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=r, target_modules=["q_proj", "v_proj"], init_lora_weights=False, use_dora=dora)
    model = peft.get_peft_model(base, config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, optimizer


def step(model, optimizer, tokens, s: int) -> float:
    batch = batch_at(tokens, s, 2, 32)
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def written_keys(run: Run, step: int) -> set[str]:
    return {t.key for unit in run.manifest(step).units for t in run._stored_entry(step, unit).tensors}


def stored_keys(names: list[str]) -> set[str]:
    """The weight keys a run stores the PeftModel parameters ``names`` under."""
    return {f"weight/{name.removeprefix('base_model.model.')}" for name in names}


def trainable_keys(model) -> set[str]:
    from llmtailor.providers.base import unwrap

    return {name for name, p in unwrap(model).named_parameters() if p.requires_grad}


def test_a_lora_run_writes_its_base_weights_once_and_then_only_what_trains(tmp_path, tokens):
    model, optimizer = lora()
    tailor = Tailor(tmp_path, model, optimizer, policy=Full())
    for s in range(1, 5):
        step(model, optimizer, tokens, s)
        tailor.save(s)
    tailor.close()
    run = Run(tmp_path)
    trained = trainable_keys(model)
    assert any(k.startswith("weight/") and k.split("/", 1)[1] not in trained for k in written_keys(run, 1))
    for s in (2, 3, 4):
        manifest = run.manifest(s)
        # Embeddings, final norm and head are all frozen: not written again, whatever Full picks.
        assert sorted(manifest.units) == [f"layer.{i}" for i in range(4)]
        assert manifest.decision["frozen_unchanged"] == ["embed", "norm", "head"]
        names = {k.split("/")[1] for k in written_keys(run, s)}
        assert names == trained  # adapters, their moments and steps: nothing frozen
        assert all(ref.kept == [1] for ref in manifest.units.values())
    # The tensors written are the trainable state exactly: each adapter, its two moments, its step.
    from llmtailor.store.manifest import tensor_bytes

    state = sum(p.numel() * p.element_size() * 3 + 4 for n, p in model.named_parameters() if p.requires_grad)
    assert sum(tensor_bytes(t) for u in run.manifest(4).units for t in run._stored_entry(4, u).tensors) == state
    assert run.verify() == []


RESUME = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[3])
    import torch
    from test_frozen import lora, step
    from llmtailor import Tailor
    from llmtailor.training_example import corpus_tokens
    model, optimizer = lora(seed=7)  # other adapter values: everything must come from the run
    report = Tailor(sys.argv[1], model, optimizer).restore()
    tokens = corpus_tokens()
    losses = [step(model, optimizer, tokens, s) for s in range(report.step + 1, int(sys.argv[2]) + 1)]
    print(" ".join(v.hex() for v in losses))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["full", "parity", "adaptive"])
def test_a_lora_run_restores_exactly_in_a_fresh_process(tmp_path, tokens, policy):
    """Full: training continues bit for bit; Parity, Adaptive: every tensor is its composite version."""
    reference, reference_opt = lora()
    expected = [step(reference, reference_opt, tokens, s) for s in range(1, 9)]
    model, optimizer = lora()
    versions = {}
    chosen = {"full": Full(), "parity": Parity(), "adaptive": Adaptive(budget=0.5, max_staleness=2)}[policy]
    with Tailor(tmp_path, model, optimizer, policy=chosen) as tailor:
        for s in range(1, 6):
            step(model, optimizer, tokens, s)
            if s % 2 == 1:
                tailor.save(s)
                versions[s] = unit_versions(model, optimizer)
    if policy == "full":
        done = subprocess.run([sys.executable, "-c", RESUME, str(tmp_path), "8", str(Path(__file__).parent)],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split() == [v.hex() for v in expected[5:]]
        return
    fresh, fresh_opt = lora(seed=7)
    Tailor(tmp_path, fresh, fresh_opt).restore()
    sources = Run(tmp_path).resolve().sources
    from llmtailor.layouts import build_layout
    from llmtailor.providers.base import unwrap

    layout = build_layout(unwrap(fresh))
    got = unit_versions(fresh, fresh_opt)
    for name in got:
        canonical = name.removeprefix("base_model.model.")
        assert_bitwise({name: got[name]}, {name: versions[sources[layout.unit_of(canonical)]][name]}, f"{name}: ")


RESTORE_AND_DUMP = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[1])
    import torch
    from safetensors.torch import save_file
    from helpers import unit_versions
    from test_frozen import lora
    from llmtailor import Tailor

    for run, out in zip(sys.argv[2::2], sys.argv[3::2]):
        model, optimizer = lora(seed=7)  # other adapters, every weight halved: all must come from the run
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(0.5)
        Tailor(run, model, optimizer, read_only=True).restore()
        save_file({f"{name}/{key}": value for name, state in unit_versions(model, optimizer).items()
                   for key, value in state.items()}, out)
    """
)


def restored_in_a_fresh_process(runs: list[Path]) -> list[dict[str, torch.Tensor]]:
    """Each LoRA run (of ``lora()``) restored by one fresh process into a fresh ``lora()``: its
    weights and optimizer state, ``"<parameter name>/<state key>"`` -> tensor."""
    from safetensors.torch import load_file

    outs = [Path(f"{run}.restored.safetensors") for run in runs]
    args = [str(arg) for pair in zip(runs, outs) for arg in pair]
    done = subprocess.run([sys.executable, "-c", RESTORE_AND_DUMP, str(Path(__file__).parent), *args],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [load_file(out) for out in outs]


LAYER_WEIGHT = "base_model.model.model.layers.1.self_attn.q_proj.base_layer.weight"  # 32 x 32: all sampled
EMBEDDING = "base_model.model.model.embed_tokens.weight"  # 256 x 32: larger than the sample, every row in it

CHANGES_THROUGH_DATA = {  # way -> (the change, the frozen tensors it changes); none bumps a version counter
    "data.copy_": (lambda param, new: param.data.copy_(new), [LAYER_WEIGHT, EMBEDDING]),
    "data[...] =": (lambda param, new: param.data.__setitem__(Ellipsis, new), [LAYER_WEIGHT, EMBEDDING]),
    # One row: the sample holds an element of every row (docs/training-loops.md).
    "data[row] =": (lambda param, new: param.data.__setitem__(1, new[1]), [LAYER_WEIGHT, EMBEDDING]),
    "data = new": (lambda param, new: setattr(param, "data", new.clone()), [LAYER_WEIGHT, EMBEDDING]),
}


@pytest.mark.slow
def test_a_frozen_tensor_changed_through_data_is_written_again_and_restored_new(tmp_path, tokens):
    """LoRA: a base weight of a layer (a partly frozen unit) and the embedding (an all-frozen
    unit), changed through ``.data`` after two saves (each way in its own run), must be written
    by the next save; a fresh process restores the new values, never the old ones."""
    original = unit_versions(*lora())
    expected = {}
    for change, (apply, changed) in CHANGES_THROUGH_DATA.items():
        model, optimizer = lora()
        params = dict(model.named_parameters())
        with Tailor(tmp_path / change, model, optimizer, policy=Full()) as tailor:
            for s in (1, 2):
                step(model, optimizer, tokens, s)
                tailor.save(s)
            assert written_keys(Run(tmp_path / change), 2).isdisjoint(stored_keys(changed))
            for name in changed:
                apply(params[name], torch.randn_like(params[name]))
                assert not params[name].requires_grad
            step(model, optimizer, tokens, 3)
            tailor.save(3)
            expected[change] = unit_versions(model, optimizer)
    everything = restored_in_a_fresh_process([tmp_path / change for change in CHANGES_THROUGH_DATA])
    for (change, (_, changed)), restored in zip(CHANGES_THROUGH_DATA.items(), everything):
        for name in changed:
            assert not torch.equal(expected[change][name]["weight"], original[name]["weight"])
            assert torch.equal(restored[f"{name}/weight"], expected[change][name]["weight"]), \
                f"{change}: {name} restored with its old value"
        for name, state in expected[change].items():
            for key, value in state.items():
                assert torch.equal(restored[f"{name}/{key}"], value), f"{change}: {name}/{key}"
        assert stored_keys(changed) <= written_keys(Run(tmp_path / change), 3), change


def test_a_fingerprint_sees_changes_through_data_to_sampled_elements_and_any_through_the_tensor():
    """``fingerprints`` on a tensor larger than the sample: what docs/training-loops.md promises is
    seen (through ``.data``: a sampled element, any one row, any one column)."""
    from llmtailor.frozen import fingerprints
    from llmtailor.store.samples import SAMPLE, covering_slots
    from llmtailor.store.staged import Piece

    param = torch.nn.Parameter(torch.randn(512, 96), requires_grad=False)
    assert param.numel() > SAMPLE

    def now() -> tuple:
        return fingerprints({"weight/w": [Piece.whole("weight/w", param.detach())]})["weight/w"]

    before = now()
    assert now() == before  # reading it changes nothing
    param.data.mul_(2)  # the whole tensor, through .data: no version bump
    assert param._version == 0 and now() != before
    start, spacing = covering_slots(Piece.whole("weight/w", param.detach()))
    before = now()
    param.data.view(-1)[start + 7 * spacing] += 1  # one sampled element
    assert now() != before
    for row in range(param.shape[0]):  # any one row
        before = now()
        param.data[row] += 1
        assert now() != before, row
    for column in range(param.shape[1]):  # any one column
        before = now()
        param.data[:, column] += 1
        assert now() != before, column
    before = now()
    with torch.no_grad():
        param.view(-1)[start + 1] += 1  # an element off the sample, through the tensor: its version
    assert now() != before
    before = now()
    param.data = param.data.clone()  # replaced, equal values: its memory moved
    assert now() != before


def with_an_inference_mode_embedding(seed: int):
    """``tiny(seed=seed)`` whose embedding is frozen and made under ``torch.inference_mode()``
    (an inference tensor: no version counter, changed in place only in inference mode; autograd
    can use it as an embedding's weight, which backward does not need); its optimizer over the rest."""
    from llmtailor.training_example import build_optimizer

    model, _, _ = tiny(seed=seed)
    embed = model.model.embed_tokens
    torch.manual_seed(seed)
    with torch.inference_mode():
        model.model.embed_tokens = torch.nn.Embedding(embed.num_embeddings, embed.embedding_dim)
    model.model.embed_tokens.weight.requires_grad_(False)
    assert model.model.embed_tokens.weight.is_inference()
    return (model, *build_optimizer(model, total_steps=50))


def test_a_frozen_parameter_made_under_inference_mode_saves_async_and_restores(tmp_path, tokens):
    """Fingerprints, the async save's version check and the restore's in-place copy all meet
    a tensor that keeps no version counter."""
    model, opt, sched = with_an_inference_mode_embedding(seed=0)
    with Tailor(tmp_path, model, opt, sched, policy=Full(), async_save=True) as tailor:
        for s in (1, 2, 3):
            train(model, opt, sched, tokens, [s])
            tailor.save(s, blocking=False)
    run = Run(tmp_path)
    assert "embed" in run.manifest(1).units and "embed" not in run.manifest(3).units  # kept, not written again
    expected = unit_versions(model, opt)
    fresh = with_an_inference_mode_embedding(seed=4)
    Tailor(tmp_path, *fresh).restore()
    assert_bitwise(unit_versions(fresh[0], fresh[1]), expected)


def test_a_fingerprint_of_an_inference_tensor_has_no_version_but_sees_changes():
    from llmtailor.frozen import fingerprints
    from llmtailor.store.staged import Piece

    with torch.inference_mode():
        tensor = torch.randn(8, 8)
    pieces = {"weight/w": [Piece.whole("weight/w", tensor)]}
    before = fingerprints(pieces)
    with torch.inference_mode():
        tensor[0, 0] += 1
    assert fingerprints(pieces) != before


def test_a_frozen_tensor_changed_in_place_is_written_again(tmp_path, tokens):
    model, opt, sched = tiny()
    frozen = model.model.layers[1].mlp.up_proj.weight
    frozen.requires_grad_(False)
    tailor = Tailor(tmp_path, model, opt, sched, policy=Full())
    for s in (1, 2):
        train(model, opt, sched, tokens, [s])
        tailor.save(s)
    key = "weight/model.layers.1.mlp.up_proj.weight"
    run = Run(tmp_path)
    assert key not in written_keys(run, 2) and run._stored_entry(2, "layer.1").kept[key] == 1
    with torch.no_grad():
        frozen.mul_(0.5)  # a frozen tensor changed outside training
    train(model, opt, sched, tokens, [3])
    tailor.save(3)
    assert key in written_keys(run, 3)
    expected = unit_versions(model, opt)
    tailor.close()
    fresh = tiny(seed=4)
    fresh[0].model.layers[1].mlp.up_proj.weight.requires_grad_(False)
    Tailor(tmp_path, *fresh).restore()
    assert_bitwise(unit_versions(fresh[0], fresh[1]), expected)


def test_a_unit_frozen_mid_run_is_saved_once_more_within_the_staleness_bound(tmp_path, tokens):
    """The case that found it: frozen right after a save, its unit changed since its last saved
    version; it must still reach a composite within max_staleness saves, then cost nothing."""
    model, opt, sched = tiny(layers=4)
    # A budget too small for any layer: only the staleness bound brings a layer in.
    tailor = Tailor(tmp_path, model, opt, sched, policy=Adaptive(budget=1, max_staleness=2, aux=False))
    saves = []
    for s in range(1, 21):
        train(model, opt, sched, tokens, [s])
        if s == 7:
            for p in model.model.layers[2].parameters():
                p.requires_grad_(False)  # frozen mid-run: its values changed since it was last saved
        if s % 2 == 0:
            saves.append((s, tailor.save(s).units))
    tailor.close()
    run = Run(tmp_path)
    written_after = [s for s, units in saves if s > 7 and "layer.2" in units]
    last_before = max(s for s, units in saves if s <= 7 and "layer.2" in units)
    assert written_after and (written_after[0] - last_before) // 2 <= 2  # within max_staleness saves
    assert len(written_after) == 1  # then frozen and unchanged: never again
    assert run.resolve().sources["layer.2"] == written_after[0]
    fresh = tiny(seed=3)
    Tailor(tmp_path, *fresh).restore()
    for a, b in zip(fresh[0].model.layers[2].parameters(), model.model.layers[2].parameters()):
        assert torch.equal(a, b)


def test_retention_keeps_the_snapshot_that_holds_kept_frozen_tensors(tmp_path, tokens):
    model, optimizer = lora()
    with Tailor(tmp_path, model, optimizer, policy=Full(), keep=1) as tailor:
        for s in range(1, 7):
            step(model, optimizer, tokens, s)
            tailor.save(s)
    run = Run(tmp_path)
    assert run.steps() == [1, 6]  # 1 holds the frozen base weights every later version keeps
    assert run.verify() == []
    fresh, fresh_opt = lora(seed=7)
    Tailor(tmp_path, fresh, fresh_opt).restore()
    for a, b in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(a, b)


def base_dir(tmp_path: Path) -> Path:
    """The base model of ``lora()`` as ``save_pretrained`` writes it."""
    base_model().save_pretrained(tmp_path / "base")
    return tmp_path / "base"


def test_a_base_directory_is_referenced_never_copied_and_checked_on_restore(tmp_path, tokens):
    base = base_dir(tmp_path)
    model, optimizer = lora()
    with Tailor(tmp_path / "run", model, optimizer, policy=Full(), base=base) as tailor:
        for s in range(1, 4):
            step(model, optimizer, tokens, s)
            tailor.save(s)
    run = Run(tmp_path / "run")
    trained = trainable_keys(model)
    for s in (1, 2, 3):  # not even the first save copies a base weight
        assert {k.split("/")[1] for k in written_keys(run, s)} == trained
    manifest = run.manifest(1)
    assert manifest.base is not None and manifest.base.path == str(base.resolve())
    assert [f.path for f in manifest.base.files] == ["model.safetensors"]
    # The first save: every unit, the all-frozen ones as indexes alone (no file, no byte).
    assert [u for u, ref in manifest.units.items() if ref.bytes == 0] == ["embed", "norm", "head"]
    assert sorted(run.manifest(2).units) == [f"layer.{i}" for i in range(4)] and run.verify() == []
    from typer.testing import CliRunner

    from llmtailor.cli import app

    shown = CliRunner().invoke(app, ["inspect", str(tmp_path / "run")], env={"COLUMNS": "100"}).output
    assert "frozen kept" in shown and "32.8 KB base" in shown and str(base.resolve()) in shown
    verified = CliRunner().invoke(app, ["verify", str(tmp_path / "run")])
    assert verified.exit_code == 0 and "base model directory" in verified.output
    ref = run._stored_entry(1, "layer.0").base["weight/model.layers.0.self_attn.q_proj.base_layer.weight"]
    assert ref.name == "model.layers.0.self_attn.q_proj.weight"  # peft's base_layer is the base's module

    fresh, fresh_opt = lora(seed=7)
    with torch.no_grad():
        for p in fresh.parameters():
            p.mul_(0.5)  # every base weight too: they must come back from the base directory
    Tailor(tmp_path / "run", fresh, fresh_opt, read_only=True).restore()
    for (name, a), b in zip(fresh.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name

    # A changed base file is named, never loaded silently.
    weights = base / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF
    weights.write_bytes(bytes(data))
    problems = run.verify()
    assert problems and all("model.safetensors" in p for p in problems) and "base model directory" in problems[0]
    from llmtailor.errors import IntegrityError

    def other_weights():
        fresh, fresh_opt = lora(seed=7)
        with torch.no_grad():
            for p in fresh.parameters():
                p.mul_(0.5)  # the base weights must then be read from the base directory
        return fresh, fresh_opt

    with pytest.raises(IntegrityError, match="model.safetensors.*checksum mismatch"):
        Tailor(tmp_path / "run", *other_weights(), read_only=True).restore()
    # A model that holds the base weights already (from_pretrained of the base, say) reads
    # nothing from the base directory: each tensor checked against its recorded checksum.
    held, held_opt = lora(seed=7)
    Tailor(tmp_path / "run", held, held_opt, read_only=True).restore()
    for (name, a), b in zip(held.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name
    # A base file of another size, or missing, is named, whatever the live model holds: the run's
    # damage (DamagedFileError, the CLI's verify hint), as verify names it. BEFORE: IntegrityError.
    from llmtailor.errors import DamagedFileError

    weights.write_bytes(bytes(data) + b"\0")
    with pytest.raises(DamagedFileError, match=r"model.safetensors: \d+ bytes, the run recorded \d+ \(the base model"):
        Tailor(tmp_path / "run", *lora(seed=7), read_only=True).restore()
    weights.unlink()
    with pytest.raises(DamagedFileError, match="model.safetensors: file is missing"):
        Tailor(tmp_path / "run", *lora(seed=7), read_only=True).restore()


def test_a_missing_base_directory_is_refused_when_the_tailor_is_built(tmp_path):
    from llmtailor.errors import ConfigError

    with pytest.raises(ConfigError, match="base=.*nope: no such model directory"):
        Tailor(tmp_path / "run", *lora(), base=tmp_path / "nope")


def assembled_as_peft_saves(model, optimizer, tokens, tmp_path, **save_options) -> None:
    """Parity saves at steps 1 to 3 of ``model`` into ``tmp_path/run``, assembled by the CLI as a
    peft adapter directory at ``tmp_path/out``, whose file holds exactly the keys peft's own
    ``save_pretrained(**save_options)`` writes (at ``tmp_path/reference``)."""
    from safetensors import safe_open
    from typer.testing import CliRunner

    from llmtailor.cli import app

    with Tailor(tmp_path / "run", model, optimizer, policy=Parity()) as tailor:
        for s in range(1, 4):
            step(model, optimizer, tokens, s)
            tailor.save(s)
    result = CliRunner().invoke(app, ["assemble", str(tmp_path / "run"), "--format", "peft", "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    model.save_pretrained(tmp_path / "reference", **save_options)  # peft's own: the same file names and keys
    with safe_open(str(tmp_path / "out" / "adapter_model.safetensors"), "pt") as ours, \
            safe_open(str(tmp_path / "reference" / "adapter_model.safetensors"), "pt") as theirs:
        assert sorted(ours.keys()) == sorted(theirs.keys())


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_assemble_peft_writes_an_adapter_directory_peft_loads_bit_for_bit(tmp_path, tokens, dora):
    """The adapter file's keys are those of peft's own ``save_pretrained`` (DoRA's magnitude
    vector included: peft saves it as ``...lora_magnitude_vector``, not as its parameter's
    ``...lora_magnitude_vector.default.weight``); peft loads every tensor bit for bit."""
    from typer.testing import CliRunner

    from llmtailor.cli import app

    assembled_as_peft_saves(*lora(dora=dora), tokens, tmp_path)
    loaded = peft.PeftModel.from_pretrained(base_model(), tmp_path / "out")  # no llmtailor code
    sources = Run(tmp_path / "run").resolve().sources
    assert {sources[f"layer.{i}"] for i in range(4)} == {2, 3}  # a Parity composite: adapters from two snapshots
    fresh, fresh_opt = lora(seed=7, dora=dora)
    Tailor(tmp_path / "run", fresh, fresh_opt, read_only=True).restore()  # the composite, as restore gives it
    expected = dict(fresh.named_parameters())
    magnitudes = [name for name in expected if ".lora_magnitude_vector." in name]
    assert bool(magnitudes) == dora
    initial = dict(lora(dora=dora)[0].named_parameters())
    for name in magnitudes:  # trained: peft's load must find it, not keep the value it starts with
        assert not torch.equal(expected[name], initial[name]), name
    for name, param in loaded.named_parameters():
        assert torch.equal(param, expected[name]), name
    again = CliRunner().invoke(app, ["assemble", str(tmp_path / "run"), "--format", "peft", "-o", str(tmp_path / "out")])
    assert again.exit_code == 2 and "refusing to overwrite" in again.output


@pytest.mark.slow
def test_tailor_trainer_with_a_peft_model_saves_the_adapters_and_resumes_bitwise(tmp_path):
    """TailorTrainer around a real PeftModel: after the first save only adapters and their
    state are written; a new trainer over a fresh PeftModel resumes from the composite and ends
    with the uninterrupted run's adapters, bit for bit."""
    import importlib.util

    import transformers

    from llmtailor.integrations.hf import TailorTrainer

    spec = importlib.util.spec_from_file_location("hf_job", Path(__file__).parent / "integrations" / "hf_job.py")
    hf_job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hf_job)

    def trainer(out: Path, steps: int, seed: int, cls=TailorTrainer):
        model, _ = lora(seed=seed)
        args = transformers.TrainingArguments(
            output_dir=str(out), per_device_train_batch_size=2, max_steps=steps, save_steps=2, report_to=[],
            use_cpu=True, seed=0, disable_tqdm=True, learning_rate=1e-2,
            **({"save_strategy": "no"} if cls is transformers.Trainer else {}),
        )
        return cls(model=model, args=args, train_dataset=hf_job.Windows())

    class StopAt4(transformers.TrainerCallback):  # a crash after the save of step 4, same schedule
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 4

    reference = trainer(tmp_path / "reference", 8, seed=0, cls=transformers.Trainer)
    reference.train()
    first = trainer(tmp_path / "run", 8, seed=0)
    first.add_callback(StopAt4())
    first.train()
    run = Run(tmp_path / "run" / "tailored")
    assert run.steps() == [2, 4]
    assert sorted(run.manifest(4).units) == [f"layer.{i}" for i in range(4)]  # adapters only
    resumed = trainer(tmp_path / "run", 8, seed=7)
    resumed.train(resume_from_checkpoint=True)
    expected = dict(reference.model.named_parameters())
    for name, param in resumed.model.named_parameters():
        assert torch.equal(param, expected[name]), name


PEFT_MODELS = {"lora": lambda seed: lora(seed=seed), "lora_saving_lm_head": lambda seed: lora_saving("lm_head", seed=seed)}
"""The PeftModels a vanilla Trainer resumes from an assembled checkpoint: adapters only, and
adapters with a module trained whole (``modules_to_save``)."""


@pytest.mark.slow
@pytest.mark.parametrize("peft_model", PEFT_MODELS)
def test_a_peft_run_assembled_as_hf_resumes_in_a_vanilla_trainer_with_the_same_peft_model(tmp_path, peft_model):
    import importlib.util

    import transformers
    from typer.testing import CliRunner

    from llmtailor.cli import app
    from llmtailor.integrations.hf import TailorTrainer

    spec = importlib.util.spec_from_file_location("hf_job", Path(__file__).parent / "integrations" / "hf_job.py")
    hf_job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hf_job)

    def trainer(out: Path, seed: int, cls):
        model, _ = PEFT_MODELS[peft_model](seed)
        args = transformers.TrainingArguments(output_dir=str(out), per_device_train_batch_size=2, max_steps=8,
                                              save_steps=2, report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
                                              learning_rate=1e-2, save_strategy="steps" if cls is TailorTrainer else "no")
        return cls(model=model, args=args, train_dataset=hf_job.Windows())

    class StopAt4(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 4

    reference = trainer(tmp_path / "reference", 0, transformers.Trainer)
    reference.train()
    tailored = trainer(tmp_path / "run", 0, TailorTrainer)
    tailored.add_callback(StopAt4())
    tailored.train()
    result = CliRunner().invoke(app, ["assemble", str(tmp_path / "run" / "tailored"), "--format", "hf",
                                      "-o", str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    checkpoint = tmp_path / "hf" / "checkpoint-4"
    assert (checkpoint / "adapter_model.safetensors").is_file() and not (checkpoint / "model.safetensors").exists()
    vanilla = trainer(tmp_path / "vanilla", 7, transformers.Trainer)  # other adapters: all must come from the files
    copies = [p for name, p in vanilla.model.named_parameters() if ".modules_to_save." in name]
    assert bool(copies) == (peft_model != "lora")
    with torch.no_grad():
        for copy in copies:
            copy.mul_(0.5)  # a trained copy starts as the base's module: it too must come from the files
    vanilla.train(resume_from_checkpoint=str(checkpoint))
    expected = dict(reference.model.named_parameters())
    for name, param in vanilla.model.named_parameters():
        assert torch.equal(param, expected[name]), name


def test_a_second_adapter_type_ia3_saves_only_what_trains_and_exports_for_peft(tmp_path, tokens):
    model = peft.get_peft_model(base_model(), peft.IA3Config(target_modules=["k_proj", "down_proj"],
                                                             feedforward_modules=["down_proj"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    with Tailor(tmp_path / "run", model, optimizer, policy=Full()) as tailor:
        for s in range(1, 3):
            step(model, optimizer, tokens, s)
            tailor.save(s)
    run = Run(tmp_path / "run")
    assert {k.split("/")[1] for k in written_keys(run, 2)} == trainable_keys(model)
    from typer.testing import CliRunner

    from llmtailor.cli import app

    result = CliRunner().invoke(app, ["assemble", str(tmp_path / "run"), "--format", "peft", "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    loaded = peft.PeftModel.from_pretrained(base_model(), tmp_path / "out")
    expected = dict(model.named_parameters())
    for name, param in loaded.named_parameters():
        assert torch.equal(param, expected[name]), name


# -- modules_to_save: a module trained whole beside the adapters. peft wraps it as
# X.original_module.* (the base's, frozen) and X.modules_to_save.<adapter>.* (the trained copy),
# and its adapter file names the trained copy X.* (ModulesToSaveWrapper.adapter_state_dict).

SAVED_WHOLE = [("lm_head", "untied", "lm_head"), ("embed_tokens", "tied", "model.embed_tokens")]
"""(module, tying, its path): the head, and an embedding its head is tied to."""
TIED_COPIES = ("embed_tokens", "tied copies", "model.embed_tokens")
"""With peft's ``ensure_weight_tying``: the head's trained copy is the embedding's too."""


def base_model_tied(tying: str):
    """``base_model()``, its head tied to its embedding unless ``tying`` is "untied" (same seed, same weights)."""
    import transformers

    config = base_model().config
    config.tie_word_embeddings = tying != "untied"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def lora_saving(module: str, tying: str = "untied", seed: int = 0):
    """``lora()`` with ``module`` trained whole too (peft's ``modules_to_save``)."""
    base = base_model_tied(tying)
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=[module], init_lora_weights=False,
                             ensure_weight_tying=tying == "tied copies")
    model = peft.get_peft_model(base, config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, optimizer


@pytest.mark.parametrize("module,tying,path", [*SAVED_WHOLE, TIED_COPIES])
def test_modules_to_save_assemble_peft_loads_in_peft_bit_for_bit(tmp_path, tokens, module, tying, path):
    # peft's own file holds the trained copy as `module`'s own weight: so must ours.
    assembled_as_peft_saves(*lora_saving(module, tying), tokens, tmp_path)
    loaded = peft.PeftModel.from_pretrained(base_model_tied(tying), tmp_path / "out")  # no llmtailor code
    fresh, fresh_opt = lora_saving(module, tying, seed=7)
    with torch.no_grad():
        for p in fresh.parameters():
            p.mul_(0.5)  # the trained copy starts as the base's: it too must come from the run
    Tailor(tmp_path / "run", fresh, fresh_opt, read_only=True).restore()  # the composite, as restore gives it
    expected = dict(fresh.named_parameters())
    trained = expected[f"base_model.model.{path}.modules_to_save.default.weight"]
    assert not torch.equal(trained, dict(base_model_tied(tying).named_parameters())[f"{path}.weight"])  # it trained
    for name, param in loaded.named_parameters():
        assert torch.equal(param, expected[name]), name


def lora_on_the_embedding(seed: int = 0):
    """LoRA on q and on the embedding itself (``lora_embedding_A/B``), the head trained whole."""
    base = base_model()
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "embed_tokens"], modules_to_save=["lm_head"], init_lora_weights=False)
    model = peft.get_peft_model(base, config)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def test_lora_on_the_embedding_assembles_what_peft_saves_without_the_frozen_embedding(tmp_path, tokens):
    """With the embedding among ``target_modules``, peft's default ``save_embedding_layers="auto"``
    also copies the frozen base embedding into the adapter file; ``assemble --format peft`` writes
    what ``save_embedding_layers=False`` writes, key for key (the base the adapter is loaded onto
    holds that embedding), and peft loads it bit for bit."""
    assembled_as_peft_saves(*lora_on_the_embedding(), tokens, tmp_path, save_embedding_layers=False)
    loaded = peft.PeftModel.from_pretrained(base_model(), tmp_path / "out")
    fresh, fresh_opt = lora_on_the_embedding(seed=7)
    with torch.no_grad():
        for p in fresh.parameters():
            p.mul_(0.5)
    Tailor(tmp_path / "run", fresh, fresh_opt, read_only=True).restore()
    expected = dict(fresh.named_parameters())
    assert any("lora_embedding_A" in name for name in expected)
    for name, param in loaded.named_parameters():
        assert torch.equal(param, expected[name]), name


RESTORE_SAVING = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import torch
    from test_frozen import lora_saving, state_digest
    from llmtailor import Tailor
    model, optimizer = lora_saving(sys.argv[3], sys.argv[4], seed=7)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)  # every tensor must come from the run or the base directory
    Tailor(sys.argv[2], model, optimizer, read_only=True).restore()
    print(json.dumps(state_digest(model, optimizer)))
    """
)


def state_digest(model, optimizer) -> dict[str, str]:
    """sha256 of every parameter and optimizer state tensor (dtype and shape included), by name."""
    import hashlib

    out = {}
    for name, entry in unit_versions(model, optimizer).items():
        for key, value in entry.items():
            data = value.reshape(-1).view(torch.uint8).numpy().tobytes() if isinstance(value, torch.Tensor) else repr(value).encode()
            tag = f"{value.dtype}{tuple(value.shape)}" if isinstance(value, torch.Tensor) else ""
            out[f"{name}/{key}"] = tag + hashlib.sha256(data).hexdigest()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("module,tying,path", SAVED_WHOLE)
def test_modules_to_save_with_a_base_directory_keeps_the_original_module_from_it(tmp_path, tokens, module, tying, path):
    import json

    base_model_tied(tying).save_pretrained(tmp_path / "base")
    model, optimizer = lora_saving(module, tying)
    with Tailor(tmp_path / "run", model, optimizer, policy=Full(), base=tmp_path / "base") as tailor:
        for s in range(1, 4):
            step(model, optimizer, tokens, s)
            tailor.save(s)
    run = Run(tmp_path / "run")
    for s in (1, 2, 3):  # not even the first save copies the wrapped module's frozen original
        assert {k.split("/")[1] for k in written_keys(run, s)} == trainable_keys(model)
    unit = "head" if module == "lm_head" else "embed"
    ref = run._stored_entry(1, unit).base[f"weight/{path}.original_module.weight"]
    assert ref.name == f"{path}.weight"  # the base's own module
    assert run.verify() == []
    done = subprocess.run([sys.executable, "-c", RESTORE_SAVING, str(Path(__file__).parent), str(tmp_path / "run"),
                           module, tying], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == state_digest(model, optimizer)


def test_frozen_tensors_the_live_model_holds_are_checked_by_sample_and_exactly_on_request(tmp_path, tokens, monkeypatch):
    """A restore into a model that holds the base weights already reads none of them and makes no
    pass over them: each is checked against the checksum of its sample recorded at save (issue
    33). A change confined to unsampled elements passes that check (the documented limit);
    ``verify="exact"`` checks every byte, finds it and restores the saved tensor."""
    import llmtailor.providers.local as local
    from llmtailor.store.samples import covering_slots
    from llmtailor.store.staged import Piece
    from llmtailor.store.tensor_files import tensor_checksum

    model, optimizer = lora()
    with Tailor(tmp_path, model, optimizer, policy=Full()) as tailor:
        for s in (1, 2):
            step(model, optimizer, tokens, s)
            tailor.save(s)
    passes = []
    monkeypatch.setattr(local, "tensor_checksum", lambda t: passes.append(t.numel()) or tensor_checksum(t))
    held, held_opt = lora(seed=7)  # the same base weights, other adapters
    Tailor(tmp_path, held, held_opt, read_only=True).restore()
    assert passes == []
    for (name, a), b in zip(held.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name

    name, key = EMBEDDING, "weight/model.embed_tokens.weight"  # 8192 elements: sampled, not all
    changed, changed_opt = lora(seed=7)
    target = dict(changed.named_parameters())[name]
    start, spacing = covering_slots(Piece.whole(key, target.detach()))
    sampled = set(range(start, target.numel(), spacing))
    outside = next(i for i in range(target.numel()) if i not in sampled)
    with torch.no_grad():
        target.view(-1)[outside] += 1.0
    Tailor(tmp_path, changed, changed_opt, read_only=True).restore()
    assert not torch.equal(target, dict(model.named_parameters())[name])  # not seen by the sample
    Tailor(tmp_path, changed, changed_opt, read_only=True).restore(verify="exact")
    assert passes  # every held frozen tensor hashed whole
    for (n, a), b in zip(changed.named_parameters(), model.parameters()):
        assert torch.equal(a, b), n
    with pytest.raises(Exception, match=r"verify='full'.*expected True, False or \"exact\""):
        Tailor(tmp_path, changed, changed_opt, read_only=True).restore(verify="full")


def test_a_restore_samples_each_frozen_tensor_once_and_the_next_save_writes_none(tmp_path, tokens, monkeypatch):
    """A restore into a model that holds the base weights takes each frozen tensor's sample once
    (issue 33): to check it against the one recorded at save; the fingerprint it keeps for the
    next save is that recorded sample, not a second pass. The next save finds every frozen tensor
    unchanged and writes only what trains."""
    import llmtailor.frozen as frozen_module
    import llmtailor.providers.local as local
    import llmtailor.store.samples as samples

    model, optimizer = lora()
    with Tailor(tmp_path, model, optimizer, policy=Full()) as tailor:
        for s in (1, 2):
            step(model, optimizer, tokens, s)
            tailor.save(s)
    real, taken = samples.covering, []
    counted = lambda piece: taken.append(piece.key) or real(piece)  # noqa: E731
    for module in (samples, frozen_module, local):  # where each module took its own name of it
        monkeypatch.setattr(module, "covering", counted)
    held, held_opt = lora(seed=7)  # the same base weights, other adapters
    tailor = Tailor(tmp_path, held, held_opt, policy=Full())
    assert tailor.restore().step == 2
    trained = trainable_keys(held)
    frozen = {k for k in written_keys(Run(tmp_path), 1) if k.startswith("weight/") and k.split("/", 1)[1] not in trained}
    # Every frozen tensor the model held (kept ones and those step 1 wrote itself): sampled once,
    # to check it, none read.
    assert set(taken) == frozen and sorted(taken) == sorted(set(taken))
    monkeypatch.undo()
    step(held, held_opt, tokens, 3)
    tailor.save(3)
    tailor.close()
    assert {k.split("/")[1] for k in written_keys(Run(tmp_path), 3)} == trained


def lora_saved_twice(tmp_path, tokens):
    """A LoRA trained two steps with a Full save after each: its model, optimizer and run."""
    model, optimizer = lora()
    with Tailor(tmp_path, model, optimizer, policy=Full()) as tailor:
        for s in (1, 2):
            step(model, optimizer, tokens, s)
            tailor.save(s)
    return model, optimizer, Run(tmp_path)


def test_frozen_tensors_a_snapshot_wrote_itself_are_not_read_when_the_live_model_holds_them(tmp_path, tokens, monkeypatch):
    """The frozen embedding, norms and head of a LoRA are written by its first save and kept from
    there by every later one; the composite names that first snapshot for their units. A
    restore into a model that holds them (its base loaded as before) checks each by its
    recorded sample and reads none of them (issue 33: a LoRA restore read the whole embedding
    and head); one the live model does not hold (changed) is read and restored."""
    import llmtailor.store.units as units

    model, optimizer, run = lora_saved_twice(tmp_path, tokens)
    frozen_units = [u for u, source in run.manifest(2).composite.items() if source == 1]
    assert "embed" in frozen_units and "head" in frozen_units  # written by step 1 itself, not kept
    real, read = units.read_stored_parts, []
    monkeypatch.setattr(units, "read_stored_parts",
                        lambda storage, key, header, names, into=None: read.extend(names) or real(storage, key, header, names, into))
    held, held_opt = lora(seed=7)  # the same base weights, other adapters
    Tailor(tmp_path, held, held_opt, read_only=True).restore()
    trained = trainable_keys(model)
    assert read and all(k.split("/")[1] in trained for k in read), [k for k in read if k.split("/")[1] not in trained]
    for (name, a), b in zip(held.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name

    read.clear()
    changed, changed_opt = lora(seed=7)
    embedding = changed.get_input_embeddings().weight
    with torch.no_grad():
        embedding.add_(1.0)  # every element: its sample differs, so it is read
    Tailor(tmp_path, changed, changed_opt, read_only=True).restore()
    assert "weight/model.embed_tokens.weight" in read
    for (name, a), b in zip(changed.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name


def test_a_units_merged_index_lists_each_file_it_keeps_tensors_from_once(tmp_path, tokens):
    """A layer of a LoRA keeps its frozen weights from the first save's pack file: the merged
    index lists that file once, not once per kept tensor (issue 33: each position cost a header
    check and a read of its own), and a restore into a model that does not hold them reads them
    from it, equal to the saved ones."""
    model, optimizer, run = lora_saved_twice(tmp_path, tokens)
    entry = run.unit_entry(2, "layer.0")
    assert len(run._stored_entry(2, "layer.0").kept) > 1
    places = [(f.path, f.origin) for f in entry.files]
    assert len(places) == len(set(places)) and (places[0][1], places[-1][1]) == (None, 1), places
    fresh, fresh_opt = lora(seed=7)
    with torch.no_grad():
        for p in fresh.parameters():
            p.mul_(0.5)  # no frozen weight held: every one read from the run
    Tailor(tmp_path, fresh, fresh_opt, read_only=True).restore()
    for (name, a), b in zip(fresh.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name


def test_a_frozen_embedding_differing_in_whole_rows_or_a_column_is_read_at_restore(tmp_path, tokens):
    """A LoRA's frozen embedding (256 x 32) that differs at restore only in rows the sample of
    schemas 5 and 6 (1024 elements spread over it) held no element of (new token rows the
    restoring launch initialised otherwise, say), or in one column: the sample a save records
    now holds an element of every row and of every column (``store.samples.covering``), so a
    default restore sees the difference and reads the saved embedding (issue 33: it kept the
    live rows without a word)."""
    from llmtailor.store.samples import SAMPLE, sample_slots
    from llmtailor.store.staged import Piece

    model, _, _ = lora_saved_twice(tmp_path, tokens)
    saved = dict(model.named_parameters())[EMBEDDING].detach()
    start, spacing = sample_slots(Piece.whole("weight/model.embed_tokens.weight", saved))
    old_rows = {i // saved.shape[1] for i in range(start, saved.numel(), spacing)[:SAMPLE]}
    missed = [row for row in range(saved.shape[0]) if row not in old_rows]
    assert missed  # the shape under test
    drawn = torch.Generator().manual_seed(1)
    changes = {
        "rows": lambda embedding: embedding.index_copy_(0, torch.tensor(missed),
                                                         torch.randn(len(missed), saved.shape[1], generator=drawn)),
        "column": lambda embedding: embedding[:, 5].add_(1.0),
    }
    for change, apply in changes.items():
        changed, changed_opt = lora(seed=7)  # the same base weights, other adapters
        embedding = dict(changed.named_parameters())[EMBEDDING]
        with torch.no_grad():
            apply(embedding)
        assert not torch.equal(embedding, saved)
        Tailor(tmp_path, changed, changed_opt, read_only=True).restore()
        for (name, a), b in zip(changed.named_parameters(), model.parameters()):
            assert torch.equal(a, b), f"{change}: {name}"


SCHEMA6_FROZEN = Path(__file__).parent / "store" / "fixtures" / "schema6_frozen_run"
"""Written by llmtailor at main 9b73174 (schema 6) with ``fixtures/make_schema6_frozen_run.py``:
a tiny Llama (one layer, hidden size 16, 128 tokens) whose embedding is frozen, one Full save."""


def test_a_frozen_record_of_schema_6_is_still_checked_by_its_own_1024_elements(tmp_path):
    """A run written before schema 7 recorded a frozen weight's checksum over 1024 sampled
    elements (``Chunk.sample_xxh3``). A restore checks that record by those elements, as then:
    a live embedding equal to the saved one is held; one differing in a sampled element is read;
    one differing only in rows that sample holds no element of passes, as it did (the record
    cannot tell: the limit schema 7 lifts), and ``verify="exact"`` reads it."""
    import shutil

    from llmtailor.store.samples import SAMPLE, sample_slots
    from llmtailor.store.staged import Piece
    from llmtailor.training_example import TinyConfig, build_model

    key = "weight/model.embed_tokens.weight"
    run_dir = tmp_path / "run"
    shutil.copytree(SCHEMA6_FROZEN, run_dir)
    run = Run(run_dir)
    chunk = run.unit_entry(1, "embed").tensor(key).chunks[0]
    assert run.manifest(1).schema_version == 6 and chunk.sample_xxh3 is not None and chunk.cover_xxh3 is None
    saved = run.read_unit(1, "embed")[0][key]
    start, spacing = sample_slots(Piece.whole(key, saved))
    sampled = range(start, saved.numel(), spacing)[:SAMPLE]
    rows = {i // saved.shape[1] for i in sampled}
    missed = next(row for row in range(saved.shape[0]) if row not in rows)
    config = TinyConfig(hidden_size=16, layers=1, heads=2, kv_heads=1, intermediate_size=16, seq_len=8, vocab_size=128)

    def restored(change, verify: bool | str = True) -> torch.Tensor:
        model = build_model(config, seed=3)
        embedding = model.model.embed_tokens.weight
        embedding.requires_grad_(False)
        with torch.no_grad():
            embedding.copy_(saved)
            change(embedding)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
        Tailor(run_dir, model, optimizer, read_only=True).restore(verify=verify)
        return embedding.detach().clone()

    assert torch.equal(restored(lambda e: None), saved)
    assert torch.equal(restored(lambda e: e.view(-1)[sampled[5]].add_(1.0)), saved)
    kept = restored(lambda e: e[missed].add_(1.0))
    assert torch.equal(kept[missed], saved[missed] + 1.0)  # off the old sample: passes, as then
    assert torch.equal(restored(lambda e: e[missed].add_(1.0), verify="exact"), saved)


class _FailingExchange(LocalCoordinator):
    """Two ranks' exchanges seen from one (the other's report is this one's); ``fail``: the
    exchange raises, as when a rank's wait ran out while the others completed it."""

    world_size = 2

    def __init__(self) -> None:
        super().__init__()
        self.fail = False

    def exchange(self, tag, value):
        if self.fail:
            raise CoordinationError("rank(s) [1] did not report: a rank died or is stuck")
        return [value, value]


def test_a_rank_whose_frozen_exchange_failed_has_news_at_its_next_save(tmp_path):
    """The frozen reports are exchanged only when some rank's report changed since the last
    exchange (a flag in the drift all-reduce); otherwise each rank reuses that exchange's
    agreement. A rank whose exchange failed (the others may have completed it, agreeing on
    their new reports) must not reuse its older agreement: it has news at its next save, so
    every rank exchanges again and all agree."""
    model, opt, sched = tiny(seed=0)
    tailor = Tailor(tmp_path / "run", model, opt, sched, policy=Full())
    coordinator = _FailingExchange()
    frozen = FrozenParts(tailor.provider, coordinator)
    first = frozen.survey()
    assert first.news
    frozen.plan("1", set(), first, news_anywhere=True)
    assert not frozen.survey().news  # nothing changed since: no exchange needed
    coordinator.fail = True
    with pytest.raises(CoordinationError):
        frozen.plan("2", set(), frozen.survey(), news_anywhere=True)  # another rank had news
    assert frozen.survey().news
    tailor.close()
