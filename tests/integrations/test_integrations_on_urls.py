"""Each integration (Lightning's ``TailorCheckpoint``, ``TailorAccelerator``, ``TailorTrainer``)
takes its run as ``Tailor`` does: a local path or a URL, with the storage options of
``TailorConfig``. Against moto's S3 server on loopback (real HTTP; boto3 looks at the bucket as an
operator would): the saves land in the bucket, no local directory named after the URL appears
(each test runs in an empty working directory), and a second trainer resumes from the bucket.
A ``file://`` URL and the plain path of the same directory are one run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

L = pytest.importorskip("lightning")
pytest.importorskip("accelerate")
pytest.importorskip("obstore")
pytest.importorskip("moto")

from objectstore import keys, moto_process, new_bucket, set_environment  # noqa: E402

from llmtailor import Parity, TailorConfig  # noqa: E402
from llmtailor.errors import ConfigError  # noqa: E402
from llmtailor.integrations.accelerate import TailorAccelerator  # noqa: E402
from llmtailor.integrations.lightning import TailorCheckpoint  # noqa: E402
from llmtailor.store.run import Run  # noqa: E402

PREFIX = "runs/exp"


@pytest.fixture(scope="module")
def endpoint():
    with moto_process() as url:
        yield url


@pytest.fixture(autouse=True)
def cwd(tmp_path, monkeypatch):
    """Each test runs in an empty working directory, where a URL taken for a path would become
    a directory (``nothing_local``)."""
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)


@pytest.fixture
def bucket(endpoint):
    return new_bucket(endpoint)


def options(endpoint: str) -> dict[str, str]:
    """Storage options that reach the server with no AWS variables set."""
    return {"endpoint": endpoint, "access_key_id": "testing", "secret_access_key": "testing", "region": "us-east-1"}


def nothing_local() -> None:
    assert list(Path.cwd().iterdir()) == [], "a URL was written to as a local directory"


# -- Lightning -------------------------------------------------------------------------------


class _Regression(L.LightningModule):
    """A linear model on fixed data (4 batches an epoch): the same in every fit."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.layer = torch.nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(8, 4, generator=torch.Generator().manual_seed(1)), batch_size=2)


def _fit(callback: TailorCheckpoint | None, max_steps: int, ckpt_path: str | None = None, seed: int = 0):
    module = _Regression(seed)
    trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, callbacks=[callback] if callback else [],
                        enable_checkpointing=callback is not None, logger=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer, {name: value.detach().clone() for name, value in module.state_dict().items()}


def test_lightning_saves_to_the_bucket_and_a_second_fit_resumes_from_it(endpoint, bucket, monkeypatch, capsys):
    set_environment(monkeypatch, endpoint)
    url = f"s3://{bucket}/{PREFIX}"
    _, uninterrupted = _fit(None, 6)
    first = TailorCheckpoint(url, every_n_train_steps=2)
    assert first.resume_path() is None
    _fit(first, 4)
    stored = keys(endpoint, bucket, f"{PREFIX}/")
    assert f"{PREFIX}/snapshots/step-00000004/manifest.json" in stored and f"{PREFIX}/latest" in stored
    nothing_local()
    second = TailorCheckpoint(url, every_n_train_steps=2)
    assert second.resume_path() == url
    trainer, weights = _fit(second, 6, second.resume_path(), seed=1)
    assert f"llmtailor: resumed from the composite of step 4 in {url}" in capsys.readouterr().out
    assert trainer.global_step == 6 and Run(url).steps() == [2, 4, 6]
    assert all(torch.equal(weights[name], value) for name, value in uninterrupted.items())
    nothing_local()


def test_lightning_run_given_as_a_file_url_is_the_run_its_path_names(tmp_path, capsys):
    run_dir = tmp_path / "run"
    _fit(TailorCheckpoint(f"file://{run_dir}", every_n_train_steps=2), 4)
    assert Run(run_dir).steps() == [2, 4]
    callback = TailorCheckpoint(f"file://{run_dir}", every_n_train_steps=2)
    trainer, _ = _fit(callback, 6, str(run_dir))  # the plain path: this callback's own run (its lineage goes on)
    assert f"resumed from the composite of step 4 in {run_dir}" in capsys.readouterr().out
    assert Run(run_dir).steps() == [2, 4, 6] and Run(run_dir).manifest(6).parent == 4
    nothing_local()


# -- accelerate ------------------------------------------------------------------------------


def _prepared(accelerator: TailorAccelerator, seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    return accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.01))


def _step(model, optimizer) -> None:
    model(torch.randn(2, 4)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_accelerate_saves_to_the_bucket_with_storage_options_and_loads_from_it(endpoint, bucket):
    url = f"s3://{bucket}/{PREFIX}"
    config = TailorConfig(storage_options=options(endpoint))  # no AWS variables: every client gets these
    accelerator = TailorAccelerator(cpu=True, tailor_run_dir=url, tailor_config=config)
    assert f"{PREFIX}/.lock" in keys(endpoint, bucket, f"{PREFIX}/")  # the run's lock, taken when built
    model, optimizer = _prepared(accelerator)
    _step(model, optimizer)
    accelerator.save_state(step=1, extra={"batch": 1})
    _step(model, optimizer)
    accelerator.save_state(url)  # the run's own URL: a tailored save (the newest + 1), not accelerate's own
    saved = {name: value.detach().clone() for name, value in model.state_dict().items()}
    accelerator.end_training()
    stored = keys(endpoint, bucket, f"{PREFIX}/")
    assert f"{PREFIX}/snapshots/step-00000002/manifest.json" in stored and f"{PREFIX}/.lock" not in stored
    nothing_local()

    again = TailorAccelerator(cpu=True, tailor_run_dir=url, tailor_config=config)
    model, _ = _prepared(again, seed=1)
    assert again.tailor_resumable()
    report = again.load_state(url)
    assert report.step == 2 and all(torch.equal(model.state_dict()[name], value) for name, value in saved.items())
    assert again.load_state(step=1).extra == {"batch": 1}
    again.end_training()
    assert Run(url, options(endpoint)).steps() == [1, 2]
    nothing_local()


def test_accelerate_run_given_as_a_file_url_is_the_run_its_path_names(tmp_path):
    run_dir = tmp_path / "run"
    accelerator = TailorAccelerator(cpu=True, tailor_run_dir=f"file://{run_dir}")
    model, optimizer = _prepared(accelerator)
    _step(model, optimizer)
    accelerator.save_state(str(run_dir), step=3)  # the plain path of the run: tailored, not accelerate's own
    assert Run(run_dir).steps() == [3] and not (run_dir / "optimizer.bin").exists()
    assert accelerator.load_state(str(run_dir)).step == 3
    accelerator.end_training()
    nothing_local()


# -- Hugging Face Trainer --------------------------------------------------------------------


def _hf_trainer(output_dir: Path, max_steps: int, **tailor):
    import importlib.util

    import transformers

    from llmtailor.integrations.hf import TailorTrainer

    spec = importlib.util.spec_from_file_location("hf_job", Path(__file__).with_name("hf_job.py"))
    hf_job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hf_job)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_job.model_config("llama", False))
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), per_device_train_batch_size=2, max_steps=max_steps, save_steps=2, report_to=[],
        use_cpu=True, seed=0, disable_tqdm=True,
    )
    return TailorTrainer(model=model, args=args, train_dataset=hf_job.Windows(), tailor_policy=Parity(), **tailor)


def test_trainer_with_a_url_run_saves_to_the_bucket_and_resumes_from_it(endpoint, bucket, tmp_path, capsys):
    url = f"s3://{bucket}/{PREFIX}"
    config = TailorConfig(storage_options=options(endpoint))
    first = _hf_trainer(tmp_path / "out", 4, tailor_run_dir=url, tailor_config=config)
    assert first.tailor_run_dir == url
    first.train(resume_from_checkpoint=True)  # nothing saved yet: starts fresh
    assert f"{PREFIX}/snapshots/step-00000004/manifest.json" in keys(endpoint, bucket, f"{PREFIX}/")
    assert not (tmp_path / "out" / "tailored").exists()
    nothing_local()
    resumed = _hf_trainer(tmp_path / "out", 6, tailor_run_dir=url, tailor_config=config)
    resumed.train(resume_from_checkpoint=url)  # the run named: read with its storage options
    assert f"llmtailor: resumed from the composite of step 4 in {url}" in capsys.readouterr().out
    assert resumed.state.global_step == 6 and Run(url, options(endpoint)).steps() == [2, 4, 6]
    nothing_local()


def test_storage_options_for_a_local_run_are_refused_when_each_integration_is_built(tmp_path):
    """Refused before any training, not at the first save."""
    config = TailorConfig(storage_options={"region": "us-east-1"})
    refused = "storage options \\['region'\\] were given for .*, a local path; they apply to object-store URLs"
    with pytest.raises(ConfigError, match=refused):
        TailorCheckpoint(tmp_path / "run", config=config)
    with pytest.raises(ConfigError, match=refused):
        TailorAccelerator(cpu=True, tailor_run_dir=tmp_path / "run", tailor_config=config)
    with pytest.raises(ConfigError, match=refused):
        _hf_trainer(tmp_path / "out", 4, tailor_config=config)
    assert not (tmp_path / "run").exists() and not (tmp_path / "out" / "tailored").exists()


@pytest.mark.parametrize("url", ["https://example.com/runs/exp1", "s4://bucket/runs/exp1"])
def test_a_url_of_a_scheme_llmtailor_does_not_open_is_refused_when_each_integration_is_built(tmp_path, url):
    """As ``Tailor`` refuses it (``open_storage``), not taken for the local path its folded ``//``
    names. BEFORE: each integration built, on a local directory ``https:/example.com/runs/exp1``
    (the accelerator's writer lock made it at once)."""
    refused = f"{url}: {url.split('://')[0]}:// is not a storage llmtailor opens"
    with pytest.raises(ConfigError, match=refused):
        TailorCheckpoint(url)
    with pytest.raises(ConfigError, match=refused):
        TailorAccelerator(cpu=True, tailor_run_dir=url)
    with pytest.raises(ConfigError, match=refused):
        _hf_trainer(tmp_path / "out", 4, tailor_run_dir=url)
    nothing_local()
