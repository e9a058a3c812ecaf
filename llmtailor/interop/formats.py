"""What a directory of another format is, from its file names alone (torch-free): told to the
store's run detection (``store.storage.local_detect.recognise_other_formats``; the package
wires it in, ``llmtailor/__init__.py``), so a writer refused in one, or a command given one,
names what it found and the command that takes it."""

from __future__ import annotations

from pathlib import Path

from llmtailor.interop.deepspeed.files import is_deepspeed_checkpoint
from llmtailor.interop.hf.files import CONFIG_FILE, TRAINER_STATE_FILE


def describe_other_format(path: Path) -> str | None:
    """What the directory ``path`` is (a phrase that follows "is"), or None when it is none of
    the formats interop knows."""
    if (path / TRAINER_STATE_FILE).is_file():
        return (f"a Hugging Face Trainer checkpoint ({TRAINER_STATE_FILE}; import it with `llmtailor import-hf` to "
                f"inspect, verify or assemble it, or name it as a source of a `llmtailor merge` plan)")
    if is_deepspeed_checkpoint(path):
        return ("a DeepSpeed checkpoint (import it with `llmtailor import-deepspeed` to inspect, verify or assemble "
                "it, or name it as a source of a `llmtailor merge` plan)")
    if (path / CONFIG_FILE).is_file() and any(path.glob("*.safetensors")):
        return "a model directory (config.json and safetensors weights; a source for a `llmtailor merge` plan)"
    return None
