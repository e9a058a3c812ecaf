"""A tiny real training job: a Llama-style model built from a config, trained on real text.

Used by ``llmtailor demo``, the end-to-end tests and the benchmarks. The corpus is the
Python standard library's ``pydoc_data.topics`` (about 1 MB of English reference text),
tokenized as bytes so no tokenizer is downloaded. Batches are a pure function of the step,
so the data position is the step itself and a resumed run sees exactly the batches an
uninterrupted one would.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

VOCAB = 256  # byte-level


def corpus_tokens() -> torch.Tensor:
    """The corpus as a 1-D int64 tensor of byte values."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.int64)


def batch_at(tokens: torch.Tensor, step: int, batch_size: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """The batch of ``step``: ``batch_size`` windows of ``seq_len`` tokens, at positions drawn
    from a generator seeded by (seed, step) — reproducible, and independent of global RNG."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, tokens.numel() - seq_len - 1, (batch_size,), generator=generator)
    return torch.stack([tokens[s : s + seq_len] for s in starts.tolist()])


@dataclass(frozen=True)
class TinyConfig:
    hidden_size: int = 64
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate_size: int = 128
    seq_len: int = 64
    tie_embeddings: bool = False
    family: str = "llama"
    vocab_size: int = VOCAB


def build_model(config: TinyConfig = TinyConfig(), seed: int = 0) -> torch.nn.Module:
    """A freshly initialised causal LM of the given family (``llama`` or ``qwen2``)."""
    import transformers

    classes = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}
    hf_config = classes[config.family](
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.layers,
        num_attention_heads=config.heads,
        num_key_value_heads=config.kv_heads,
        max_position_embeddings=config.seq_len,
        tie_word_embeddings=config.tie_embeddings,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(hf_config)


def hf_param_groups(model: torch.nn.Module, weight_decay: float = 0.01) -> list[dict]:
    """AdamW groups the way HF Trainer builds them: decay for weights of linear layers,
    no decay for biases and norm weights."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if name.endswith("bias") or "norm" in name else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, lr: float = 3e-3, total_steps: int = 100):
    """AdamW with HF-style groups and a linear warmup/decay schedule."""
    optimizer = torch.optim.AdamW(hf_param_groups(model), lr=lr, betas=(0.9, 0.95))
    warmup = max(1, total_steps // 10)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def train_steps(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    tokens: torch.Tensor,
    steps: range,
    batch_size: int = 8,
    seq_len: int = 64,
) -> Iterator[tuple[int, float]]:
    """Run the training steps in ``steps`` (1-based step numbers); yield ``(step, loss)``
    after each optimizer step."""
    model.train()
    for step in steps:
        batch = batch_at(tokens, step, batch_size, seq_len)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        yield step, loss.item()
