"""A tiny real training job: a Llama-style model built from a config, trained on real text.

Used by ``llmtailor demo``, the end-to-end tests and the benchmarks; ``python -m
llmtailor.training_example`` runs it as a checkpointed process (``job_main``) for the crash
and resume tests. The corpus is the Python standard library's ``pydoc_data.topics`` (about
1 MB of English reference text), tokenized as bytes so no tokenizer is downloaded. Batches
are a pure function of the step, so the data position is the step itself and a resumed run
sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from llmtailor.policies import make_policy
from llmtailor.store.tiers import Tier
from llmtailor.tailor import Tailor

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


def job_config(hidden: int = 32, layers: int = 4) -> TinyConfig:
    """The model of ``job_main``: ``layers`` Llama layers of width ``hidden`` on 32-token windows."""
    return TinyConfig(hidden_size=hidden, layers=layers, intermediate_size=2 * hidden, seq_len=32)


def params_digest(model: torch.nn.Module) -> str:
    """sha256 over every parameter's name and bytes: equal digests, bitwise equal weights."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(name.encode() + param.detach().numpy().tobytes())
    return digest.hexdigest()


def job_main(argv: list[str] | None = None) -> None:
    """A checkpointed training job, run as a real process by the crash and resume tests::

        python -m llmtailor.training_example --run DIR --out FILE [--policy full|parity|filter]
            [--steps 12] [--save-every 3] [--kill-at STEP] [--resume] [--hidden 32] [--layers 4]
            [--async] [--tier DIR --promote-every N]

    Trains ``job_config(hidden, layers)`` with batches of 2, saving with a ``Tailor`` every
    --save-every steps. --resume first restores the newest composite into weights from another
    seed (so everything must come from the checkpoint) and continues at its ``next_step``;
    --kill-at SIGKILLs the process after that step. Prints one JSON line per step, flushed, so a
    killer knows how far it got: ``{"step", "loss", "train_s"}`` after the optimizer step and
    ``{"saved", "save_s"}`` after a save (``save_s``: how long ``save`` blocked). --async saves
    with ``async_save=True``: a save returns at once and is written in the background, and the
    last one is waited for before the job ends. --tier saves to that faster tier (host memory,
    ``/dev/shm/...``) in front of --run, promoting a composite there every --promote-every steps;
    the restore prints ``{"restored", "tier"}``. At the end, writes the losses of the steps it
    ran (``float.hex``) and ``params_digest`` of the final weights to --out.
    """
    parser = argparse.ArgumentParser(prog="python -m llmtailor.training_example", description=job_main.__doc__)
    parser.add_argument("--run", required=True, help="run directory of the checkpoints")
    parser.add_argument("--out", required=True, help="JSON file for the losses and the final digest")
    parser.add_argument("--policy", default="full", choices=["full", "parity", "filter"])
    parser.add_argument("--steps", type=int, default=12, help="last step of the run (also sets the LR schedule)")
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--kill-at", type=int, help="SIGKILL this process after this step (and its save)")
    parser.add_argument("--resume", action="store_true", help="restore the newest composite first")
    parser.add_argument("--hidden", type=int, default=32, help="model width (a multiple of 4)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--async", dest="async_save", action="store_true", help="save asynchronously")
    parser.add_argument("--tier", help="a faster tier in front of --run (e.g. /dev/shm/exp1)")
    parser.add_argument("--promote-every", type=int, default=1, help="steps between promotions from --tier to --run")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    # A resumed process starts from other random weights: everything must come from the checkpoint.
    model = build_model(job_config(args.hidden, args.layers), seed=99 if args.resume else 0)
    optimizer, scheduler = build_optimizer(model, total_steps=args.steps)
    tiers = [Tier(args.tier, promote_every=args.promote_every)] if args.tier else []
    tailor = Tailor(args.run, model, optimizer, scheduler, policy=make_policy(args.policy), async_save=args.async_save,
                    tiers=tiers)
    start = 1
    if args.resume:
        report = tailor.restore()
        print(json.dumps({"restored": report.step, "tier": report.tier}), flush=True)
        start = report.extra["next_step"]

    losses = {}
    clock = time.perf_counter()
    for step, loss in train_steps(model, optimizer, scheduler, corpus_tokens(), range(start, args.steps + 1), 2, 32):
        losses[step] = loss
        print(json.dumps({"step": step, "loss": loss.hex(), "train_s": time.perf_counter() - clock}), flush=True)
        if step % args.save_every == 0:
            started = time.perf_counter()
            tailor.save(step, extra={"next_step": step + 1})
            print(json.dumps({"saved": step, "save_s": time.perf_counter() - started}), flush=True)
        if step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        clock = time.perf_counter()

    tailor.close()  # an async save still in flight is committed before the job reports
    with open(args.out, "w") as out:
        json.dump({"losses": {str(k): v.hex() for k, v in losses.items()}, "params": params_digest(model)}, out)


if __name__ == "__main__":
    job_main()
