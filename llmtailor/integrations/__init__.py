"""Integrations with training frameworks (Hugging Face Trainer: ``llmtailor.integrations.hf``).

Each integration imports its framework, so import the submodule you need; this package
imports nothing heavy."""
