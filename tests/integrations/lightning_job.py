"""A real PyTorch Lightning job, run as a fresh process by the Lightning tests.

    python lightning_job.py --run-dir DIR --result FILE [--checkpoint tailor|model] [--policy full|parity]
        [--max-steps 10] [--every 4] [--every-epochs N] [--crash-at STEP] [--resume PATH] [--dump FILE]
        [--devices N] [--dropout P] [--loader lazy|eager]

--checkpoint tailor trains with ``TailorCheckpoint`` saving every --every steps into --run-dir
(--every-epochs N: at the end of every N epochs instead);
--checkpoint model uses Lightning's own ``ModelCheckpoint`` (and imports no llmtailor code, checked
at the end) and --resume is a ``.ckpt`` file. --crash-at SIGKILLs the process right after the
save of that step (when the next step starts). --devices 2 trains with Lightning's
DDP strategy on CPU; launch it with torchrun or ``forked_jobs.rank_launch`` (Lightning then uses
the launcher's processes: it reads torchrun's environment, which both set).
--dropout P sets the model's attention dropout (the only dropout a Llama applies): every training
step then draws from each rank's torch RNG, so a resume that restores it one draw off shows.
Several jobs may share a launch (one process group under torchrun): their command lines
separated by ``--then``, run in turn, each printing ``job N done on rank R`` when it is done (a
job that SIGKILLs itself must come last).

The data is fixed windows of a real corpus (pydoc_data.topics) served by a dataloader that is
resumable in Lightning's sense (``state_dict`` / ``load_state_dict``: the batches it has served),
so a resume mid-epoch continues with the next batch. The torch DataLoader iterator it wraps,
which draws its base seed from torch's RNG when it is made, is made at the first batch of a pass
(--loader lazy: its ``__iter__`` is a generator) or by ``iter()`` (eager, as a plain DataLoader's
is): Lightning calls ``iter()`` when it sets up the data, before ``on_train_start``, and at the
start of each later epoch. --dump writes, when training starts (after any resume), every weight
and optimizer tensor by name, the global step and the LR. The result file holds the loss of every
step (float.hex), a digest of every step's batch and of the final weights.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import lightning as L
import torch
import transformers
from hf_job import SEQ_LEN, corpus_windows, digest, job_lines, leave, params_digest, said_done

WINDOWS, BATCH = 16, 2  # 8 batches an epoch on one device: step 10 is in epoch 2
# What a launch of several jobs (tests/forked_jobs.py) imports once, before it forks each job: the
# model code transformers imports on first use.
PRELOAD = ("transformers.models.llama.modeling_llama",)


class ResumableLoader(torch.utils.data.DataLoader):
    """A DataLoader Lightning can resume mid-epoch: it counts the batches it has served and, once
    loaded, skips that many at the start of its next pass. Its DataLoader iterator is made at the
    first batch (``eager``: when ``iter()`` is called, see the module docstring)."""

    eager = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.served, self.skip = 0, 0

    def __iter__(self):
        skip, self.skip = self.skip, 0
        self.served = skip
        return self._serve(skip, super().__iter__() if self.eager else None)

    def _serve(self, skip, batches):
        for index, batch in enumerate(batches if batches is not None else super().__iter__()):
            if index >= skip:
                self.served += 1
                yield batch

    def state_dict(self):
        return {"served": self.served}

    def load_state_dict(self, state):
        # Saved after the last batch of a pass, the pass is over: the next one starts a new epoch.
        self.skip = state["served"] if state["served"] < len(self) else 0


class EagerLoader(ResumableLoader):
    eager = True


class TinyLM(L.LightningModule):
    def __init__(self, seed: int, dropout: float = 0.0, loader: type = ResumableLoader):
        super().__init__()
        self.loader = loader
        torch.manual_seed(seed)
        self.model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
            vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=SEQ_LEN, bos_token_id=None, eos_token_id=None,
            pad_token_id=None, attention_dropout=dropout,
        ))
        self.batches: dict[int, str] = {}
        self.losses: dict[int, str] = {}

    def training_step(self, batch, batch_idx):
        self.batches[self.global_step + 1] = digest(batch)
        loss = self.model(input_ids=batch, labels=batch).loss
        self.losses[self.global_step + 1] = loss.item().hex()
        return loss

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in self.named_parameters() if p.ndim < 2]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                      lr=3e-3, betas=(0.9, 0.95))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        sampler = None
        if self.trainer.world_size > 1:  # each rank its share, in a fixed order
            sampler = torch.utils.data.DistributedSampler(corpus_windows(WINDOWS), shuffle=False)
        return self.loader(corpus_windows(WINDOWS), batch_size=BATCH, shuffle=False, sampler=sampler)


class Recorder(L.Callback):
    def __init__(self, args):
        self.args = args

    def on_train_start(self, trainer, pl_module):
        if not self.args.dump or not trainer.is_global_zero:
            return
        optimizer = trainer.optimizers[0]
        names = {id(p): n for n, p in pl_module.named_parameters()}
        tensors = {f"weight/{n}": t.detach().clone() for n, t in pl_module.state_dict().items()}
        for param, values in optimizer.state.items():
            for key, value in values.items():
                tensors[f"optim/{names[id(param)]}/{key}"] = value.detach().clone()
        lr = trainer.lr_scheduler_configs[0].scheduler.get_last_lr()
        torch.save({"tensors": tensors, "global_step": trainer.global_step, "lr": lr}, self.args.dump)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        # Lightning runs checkpoint callbacks last: the save of step N is done when step N+1 starts.
        if trainer.global_step == self.args.crash_at:
            os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> tuple:
    """One job (``argv``, else the command line); returns its trainer and model, which the caller
    keeps referenced until it leaves (see ``hf_job.leave``)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--checkpoint", default="tailor", choices=["tailor", "model"])
    parser.add_argument("--policy", default="full", choices=["full", "parity"])
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--every-epochs", type=int)
    parser.add_argument("--crash-at", type=int)
    parser.add_argument("--resume")
    parser.add_argument("--dump")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--loader", default="lazy", choices=["lazy", "eager"])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    loader = {"lazy": ResumableLoader, "eager": EagerLoader}[args.loader]
    model = TinyLM(seed=99 if args.resume else 0, dropout=args.dropout, loader=loader)  # weights from the checkpoint

    if args.checkpoint == "model":
        checkpoint = L.pytorch.callbacks.ModelCheckpoint(dirpath=args.run_dir, every_n_train_steps=args.every, save_top_k=-1)
    else:
        from llmtailor import Full, Parity
        from llmtailor.integrations.lightning import TailorCheckpoint

        policy = {"full": Full(), "parity": Parity()}[args.policy]
        steps = None if args.every_epochs else args.every
        checkpoint = TailorCheckpoint(args.run_dir, policy, every_n_train_steps=steps, every_n_epochs=args.every_epochs)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, strategy="ddp" if args.devices > 1 else "auto",
        max_steps=args.max_steps, callbacks=[checkpoint, Recorder(args)], logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, deterministic=True,
    )
    trainer.fit(model, ckpt_path=args.resume)

    if args.checkpoint == "model":
        assert not [m for m in sys.modules if m.startswith("llmtailor")], "a plain Lightning run imported llmtailor"
    if trainer.is_global_zero:
        Path(args.result).write_text(json.dumps({
            "losses": model.losses, "batches": model.batches, "params": params_digest(model),
            "global_step": trainer.global_step,
        }))
    return trainer, model


def launch() -> None:
    """A launch of this script (``python lightning_job.py ...``, or a rank forked by
    ``forked_jobs.rank_launch``): every job of the command line in turn (``--then``), then exit."""
    made = []
    for number, argv in enumerate(job_lines(sys.argv[1:])):
        made.append(main(argv))
        said_done(number)
    leave()


if __name__ == "__main__":
    launch()
