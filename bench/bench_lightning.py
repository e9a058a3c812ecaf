"""A Lightning run's checkpoints: ours (``TailorCheckpoint``, Full and Parity) vs Lightning's own
``ModelCheckpoint``, saving the same state at the same steps, side by side in one training run.

One process, one real ``lightning.Trainer`` (CPU, single device) training a Llama at
Llama-3.1-8B's proportions scaled down as in ``bench_save.py`` (hidden 1024, 32 layers,
intermediate 3584, vocab 32000; built from ``transformers.LlamaConfig``, never downloaded,
fp32) with AdamW in HF Trainer's decay / no-decay groups and a LambdaLR, on 1x16-token batches
of the real corpus. Three checkpoint callbacks save at every step, each into its own directory:

- ``Lightning``  ``ModelCheckpoint(every_n_train_steps=1, save_top_k=1)``: its
  ``_save_none_monitor_checkpoint`` (``trainer.save_checkpoint``: one ``torch.save``d dict, no
  fsync; then the previous ``.ckpt`` removed, as ours removes what retention drops);
- ``ours Full`` / ``ours Parity``  ``TailorCheckpoint(policy, every_n_train_steps=1,
  save_top_k=1)``: each save a tailored snapshot, durable when it returns.

Each save is timed as the callback runs it, between two ``os.sync()`` calls (the durable time;
the first flushes what came before). The first step's saves are not counted (a Tailor's first
save is always full); steps 2 .. ``--repeats`` + 1 are, and their medians reported with ratios
to Lightning's, then issue 25's targets: Full <= 1.0x and Parity <= 0.6x Lightning's time.

    .venv/bin/python bench/bench_lightning.py --repeats 3
    .venv/bin/python bench/bench_lightning.py --layers 4 --hidden 256 --intermediate 896 --vocab 4096 --repeats 2  # quick
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import time
from pathlib import Path

import lightning as L
import torch
import transformers
from lightning.pytorch.callbacks import ModelCheckpoint

from common import MB, dir_bytes, model_arguments, print_ratios, scratch

from llmtailor import Full, Parity
from llmtailor.integrations.lightning import TailorCheckpoint
from llmtailor.store.run import Run
from llmtailor.training_example import TinyConfig, batch_at, build_model, corpus_tokens, hf_param_groups



class Module(L.LightningModule):
    def __init__(self, args: argparse.Namespace):
        super().__init__()
        self.model = build_model(TinyConfig(
            hidden_size=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
            intermediate_size=args.intermediate, seq_len=2048, vocab_size=args.vocab,
        ), seed=0)
        self.steps = args.repeats + 1

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(hf_param_groups(self.model), lr=1e-4)
        return {"optimizer": optimizer, "lr_scheduler": {
            "scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0), "interval": "step"}}

    def train_dataloader(self):
        tokens = corpus_tokens()
        batches = torch.cat([batch_at(tokens, step=s, batch_size=1, seq_len=16) for s in range(1, self.steps + 1)])
        return torch.utils.data.DataLoader(batches, batch_size=1)


def timed(save, record: list[tuple[int, float, int]], size_of):
    """``save`` (a callback's own save method) timed durable, with the bytes it wrote."""

    @functools.wraps(save)
    def wrapper(trainer, *rest):
        os.sync()
        start = time.perf_counter()
        save(trainer, *rest)
        os.sync()
        record.append((trainer.global_step, time.perf_counter() - start, size_of(trainer, *rest)))

    return wrapper


def main() -> None:
    args = model_arguments(__doc__)
    transformers.utils.logging.set_verbosity_error()
    print(f"python {platform.python_version()}, torch {torch.__version__}, lightning {L.__version__}, "
          f"{os.cpu_count()} CPUs")
    with scratch(args.out, "bench_lightning") as out:
        lightning = ModelCheckpoint(dirpath=out / "lightning", every_n_train_steps=1, save_top_k=1)
        ours = {name: TailorCheckpoint(out / name, policy, every_n_train_steps=1, save_top_k=1)
                for name, policy in (("Full", Full()), ("Parity", Parity()))}
        records: dict[str, list[tuple[int, float, int]]] = {"Lightning": [], "ours Full": [], "ours Parity": []}
        # Lightning's save and its removal of the checkpoint before (save_top_k=1), as its callback
        # runs them one after the other on each step, as ours saves and retains (session 48).
        lightning._save_none_monitor_checkpoint = timed(lightning._save_none_monitor_checkpoint, records["Lightning"],
                                                        lambda trainer, _: dir_bytes(Path(lightning.best_model_path)))
        for name, callback in ours.items():
            callback._save = timed(callback._save, records[f"ours {name}"],
                                   lambda trainer, run=out / name: dir_bytes(Run(run).snapshot_dir(trainer.global_step)))
        module = Module(args)
        params = sum(p.numel() for p in module.parameters())
        print(f"model: {params / 1e6:.1f}M params fp32, {args.layers} layers; AdamW; saves at steps 1..{args.repeats + 1}")
        trainer = L.Trainer(accelerator="cpu", max_steps=args.repeats + 1, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[lightning, *ours.values()])
        trainer.fit(module)
        for name, values in records.items():
            for step, seconds, size in values:
                print(f"  step {step} {name:<12} {size / MB:9.1f} MB  durable {seconds:6.2f} s")
        measured = {name: [(s, b) for step, s, b in values if step > 1] for name, values in records.items()}
        print_ratios(measured, "Lightning", "L", {"ours Full": 1.0, "ours Parity": 0.6},
                     "issue 25 targets (time vs Lightning's ModelCheckpoint: Full <= 1.0x, Parity <= 0.6x)")


if __name__ == "__main__":
    main()
