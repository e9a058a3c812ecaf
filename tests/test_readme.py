"""The documentation's examples run as written: README's training-loop snippet (a first run, then a
resume), the storage tiers snippet of docs/storage-and-tiers.md and every line of the block of
docs/command-line.md, placeholders filled in with real inputs; every other snippet parses; README
stays a short entry that opens with the two commands and links every page of docs/, and every
relative link resolves."""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest
import torch
import yaml
from helpers import tiny, train
from typer.testing import CliRunner

from llmtailor.cli import app

ROOT = Path(__file__).resolve().parent.parent


def block(page: str, after: str, language: str = "") -> str:
    """The first fenced block (of ``language``) after the line ``after`` of ``page`` (a path from
    the repository root: ``README.md``, ``docs/command-line.md``)."""
    text = (ROOT / page).read_text(encoding="utf-8")
    start = text.index(after)
    match = re.compile(rf"^```{language}\n(.*?)^```", re.S | re.M).search(text, start)
    assert match, f"no ```{language} block after {after!r} in {page}"
    return match.group(1)


# The manual's pages, one per topic, each linked from README's map of the docs.
DOCS = ("training-loops.md", "distributed.md", "deepspeed.md", "storage-and-tiers.md", "integrations.md",
        "merge.md", "command-line.md", "format.md", "failures.md", "benchmarks.md")
PAGES = ("README.md", *(f"docs/{name}" for name in DOCS))
FENCED = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^()\s]+)\)")


def test_readme_opens_with_the_two_commands_and_stays_short():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) < 200, f"README.md has {len(lines)} lines"
    assert lines[:3] == ["# llmtailor", "", "```"]
    assert [line.split("#")[0].strip() for line in lines[3:6]] == ["make demo", "make test", "```"]


def test_every_docs_page_exists_and_is_linked_from_readme():
    assert sorted(p.name for p in (ROOT / "docs").glob("*.md")) == sorted(DOCS)  # no page left out of the map
    linked = set(LINK.findall((ROOT / "README.md").read_text(encoding="utf-8")))
    assert [page for page in PAGES[1:] if page not in linked] == []


def anchor(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCED.sub("", page.read_text(encoding="utf-8"))
    return {anchor(m.group(1)) for m in re.finditer(r"^#+ (.*)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_resolves(page):
    source = ROOT / page
    broken = []
    for target in LINK.findall(FENCED.sub("", source.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, fragment = target.partition("#")
        resolved = (source.parent / path).resolve() if path else source
        if not resolved.exists():
            broken.append(f"{target}: no file {resolved}")
        elif fragment and fragment not in anchors(resolved):
            broken.append(f"{target}: no heading #{fragment} in {resolved.name}")
    assert broken == []


@pytest.mark.parametrize("page", PAGES)
def test_every_python_and_yaml_snippet_parses(page):
    for language, code in FENCED.findall((ROOT / page).read_text(encoding="utf-8")):
        if language == "python":
            ast.parse(code)
        elif language == "yaml":
            yaml.safe_load(code)


def test_the_training_loop_snippet_saves_then_resumes(tmp_path, tokens, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = block("README.md", "## Use it in a training loop", "python")
    model, optimizer, lr_scheduler = tiny()
    trained = []

    def train_one_step(step):
        train(model, optimizer, lr_scheduler, tokens, [step])
        trained.append(step)

    exec(code, {"model": model, "optimizer": optimizer, "lr_scheduler": lr_scheduler,
                "train_one_step": train_one_step, "total_steps": 100})
    # A new process after a crash: fresh objects, the same code, a longer horizon.
    model, optimizer, lr_scheduler = tiny(seed=3)
    exec(code, {"model": model, "optimizer": optimizer, "lr_scheduler": lr_scheduler,
                "train_one_step": train_one_step, "total_steps": 200})
    assert trained == list(range(1, 201))  # resumed at 101, where the save of step 100 said
    assert sorted(p.name for p in (tmp_path / "runs/exp1/snapshots").iterdir()) == ["step-00000100", "step-00000200"]


def test_the_tiers_snippet_saves_to_memory_promotes_and_resumes_after_losing_it(tmp_path, tokens):
    import shutil

    from llmtailor import Run

    places = {"s3://ckpt/exp1": tmp_path / "home", "/dev/shm/exp1": tmp_path / "memory",
              "/local/nvme/exp1": tmp_path / "nvme"}
    code = block("docs/storage-and-tiers.md", "## Storage tiers", "python")
    for shown, used in places.items():
        assert shown in code
        code = code.replace(shown, str(used))
    trained = []

    def run(seed, total_steps):
        model, optimizer, lr_scheduler = tiny(seed=seed)

        def train_one_step(step):
            train(model, optimizer, lr_scheduler, tokens, [step])
            trained.append(step)

        exec(code, {"model": model, "optimizer": optimizer, "lr_scheduler": lr_scheduler,
                    "train_one_step": train_one_step, "total_steps": total_steps})

    run(0, 30)
    assert [Run(places[p]).latest_step() for p in places] == [30, 30, 30]  # close() promoted the last save
    assert len(Run(places["/local/nvme/exp1"]).steps()) < 30
    shutil.rmtree(places["/dev/shm/exp1"])
    shutil.rmtree(places["/local/nvme/exp1"])
    run(3, 35)
    assert trained == [*range(1, 31), *range(31, 36)]


def save_lora_run(path: Path, tokens) -> None:
    peft = pytest.importorskip("peft")
    from llmtailor import Parity, Tailor

    model, _, _ = tiny()
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    with Tailor(path, model, optimizer, policy=Parity()) as tailor:
        for step in (1, 2):
            train(model, optimizer, None, tokens, [step])
            tailor.save(step)


def save_lightning_run(path: Path, tokens) -> None:
    L = pytest.importorskip("lightning")
    from llmtailor.integrations.lightning import TailorCheckpoint

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model, self.optimizer, _ = tiny()

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return self.optimizer

        def train_dataloader(self):
            return torch.utils.data.DataLoader(tokens[: 4 * 32].view(4, 32), batch_size=2)

    trainer = L.Trainer(accelerator="cpu", max_steps=2, callbacks=[TailorCheckpoint(path, every_n_train_steps=1)],
                        logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Module())


# Lines not run here, and where they are tested: the demo (tests/test_demo.py) and the
# DeepSpeed import, which needs a checkpoint written by real DeepSpeed processes
# (tests/distributed/test_deepspeed.py).
ELSEWHERE = ("llmtailor demo", "llmtailor import-deepspeed")


@pytest.mark.slow
def test_every_command_line_runs_as_written(tmp_path, tokens):
    from llmtailor import Parity, Tailor

    run = tmp_path / "run"
    model, optimizer, scheduler = tiny()
    with Tailor(run, model, optimizer, scheduler, policy=Parity()) as tailor:
        for step in range(1, 7):
            train(model, optimizer, scheduler, tokens, [step])
            if step % 2 == 0:
                tailor.save(step)
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump({"models": [{"model": str(run)}]}))
    values = {"RUN": str(run), "N": "4", "K": "2", "PLAN.yaml": str(tmp_path / "plan.yaml"),
              "FILE.png": str(tmp_path / "drift.png"), "CHECKPOINT_DIR": str(tmp_path / "hf" / "checkpoint-6")}
    lines = [line.split("#")[0].strip() for line in block("docs/command-line.md", "# Command line").splitlines() if line.strip()]
    peft_run, lightning_run = tmp_path / "peft-run", tmp_path / "lightning-run"
    ran = 0
    for number, line in enumerate(lines):
        if line.startswith(ELSEWHERE):
            continue
        assert line.startswith("llmtailor "), line
        for optional in (False, True):  # without the [options], then with them
            text = line
            while "[" in text:  # the innermost first: [--dry-run [--verbose]]
                text = re.sub(r"\[([^\[\]]*)\]", (lambda m: m.group(1).split("|")[0]) if optional else "", text)
            text = text.replace("hf|model", "hf")
            args = [values.get(word, word) for word in shlex.split(text)[1:]]
            for fmt, other, save in (("peft", peft_run, save_lora_run), ("lightning", lightning_run, save_lightning_run)):
                if fmt in args:  # these export runs saved from a peft model / by TailorCheckpoint
                    if not other.exists():
                        save(other, tokens)
                    args = [str(other) if a == str(run) else a for a in args]
            # Fresh outputs each time: OUT for writers; import-hf writes a new RUN.
            args = [str(tmp_path / f"out-{number}-{optional}") if a == "OUT" else a for a in args]
            if args[0] == "import-hf":
                args[args.index("-o") + 1] = str(tmp_path / f"imported-{optional}")
            if args[:1] == ["assemble"] and "hf" in args and not (tmp_path / "hf").exists():
                assert CliRunner().invoke(app, ["assemble", str(run), "--format", "hf", "-o", str(tmp_path / "hf")]).exit_code == 0
            result = CliRunner().invoke(app, args, env={"COLUMNS": "100"})
            assert result.exit_code == 0, f"{text}\n{result.output}"
            ran += 1
    assert ran == 2 * (len(lines) - len(ELSEWHERE))
