"""Exports of a composite into other checkpoint formats (Hugging Face Trainer today)."""

from llmtailor.interop.hf_export import export_hf

__all__ = ["export_hf"]
