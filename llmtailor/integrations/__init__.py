"""Integrations with training frameworks: Hugging Face Trainer (``integrations.hf``:
``TailorTrainer``), PyTorch Lightning (``integrations.lightning``: ``TailorCheckpoint``) and
accelerate (``integrations.accelerate``: ``TailorAccelerator``).

Each integration imports its framework, so import the submodule you need; this package
imports nothing heavy."""
