"""A real accelerate custom training loop, run as a fresh process by the accelerate tests.

    python accelerate_job.py --run-dir DIR --result FILE [--policy full|parity] [--max-steps 10]
        [--every 4] [--crash-at STEP] [--resume] [--dump FILE] [--deepspeed STAGE] [--dropout P]

Under ``accelerate launch --multi_gpu --num_processes 2`` it trains as 2 CPU processes (DDP,
gloo); with --deepspeed STAGE (launch with ``--use_deepspeed`` and DS_ACCELERATOR=cpu) the model
is a DeepSpeed ZeRO engine. It saves with ``TailorAccelerator.save_state(step=...)`` every
--every steps, and --crash-at SIGKILLs the process right after the save of that step. --resume
restores with ``load_state()`` and skips the batches of the epoch already trained
(``skip_first_batches``: the DataLoader iterator it makes draws its base seed from torch's RNG).
--dropout P sets the model's attention dropout (the only dropout a Llama applies): every step
then draws from each process's torch RNG, seeded with python's and numpy's by ``set_seed(0)``.
An object registered for checkpointing counts the tokens seen.
--dump writes, after any resume, every weight and optimizer tensor by name (rank 0). The result
file holds the loss of every step (float.hex), a digest of every step's batch and of the final
weights, and the token count.
Several jobs may share a launch (one process group): their command lines separated by ``--then``,
run in turn, each printing ``job N done on rank R`` when it is done (a job that SIGKILLs itself
must come last); accelerate's ``end_training`` destroys the process group only in the last.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
from pathlib import Path
from unittest import mock

import torch
import transformers
from hf_job import SEQ_LEN, corpus_windows, digest, job_lines, leave, said_done

WINDOWS, BATCH = 16, 2
# What a launch of several jobs (tests/forked_jobs.py) imports once, before it forks each job: the
# model code transformers imports on first use, and accelerate.
PRELOAD = ("transformers.models.llama.modeling_llama", "accelerate", "accelerate.utils")


class TokenCounter:
    """A user object registered with ``register_for_checkpointing``."""

    def __init__(self):
        self.seen = torch.zeros((), dtype=torch.int64)

    def state_dict(self):
        return {"seen": self.seen.clone()}

    def load_state_dict(self, state):
        self.seen = state["seen"].clone()


def build(seed: int, dropout: float = 0.0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ_LEN, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        attention_dropout=dropout,
    ))
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=3e-3, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
    return model, optimizer, scheduler


def dump(path: str, accelerator, model, optimizer) -> None:
    live = accelerator.unwrap_model(model)
    names = {id(p): n for n, p in live.named_parameters()}
    tensors = {f"weight/{n}": t.detach().clone() for n, t in live.state_dict().items()}
    for param, values in optimizer.state.items():
        for key, value in values.items():
            tensors[f"optim/{names[id(param)]}/{key}"] = value.detach().clone()
    torch.save({"tensors": tensors}, path)


def main(argv: list[str] | None = None, last: bool = True):
    """One job (``argv``, else the command line); ``last``: no job of this launch comes after it.
    Returns what the caller keeps referenced until it leaves (see ``hf_job.leave``)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--policy", default="full", choices=["full", "parity"])
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--crash-at", type=int)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--dump")
    parser.add_argument("--deepspeed", type=int, choices=[1, 2, 3])
    parser.add_argument("--dropout", type=float, default=0.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from accelerate.utils import set_seed

    set_seed(0)  # python's, numpy's and torch's RNG: each process's streams are in the snapshots
    from llmtailor import Full, Parity
    from llmtailor.integrations.accelerate import TailorAccelerator

    kwargs = {"cpu": True}
    if args.deepspeed:
        import importlib

        from accelerate.utils import DeepSpeedPlugin

        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # skip its start-up compile
        world = int(os.environ.get("WORLD_SIZE", "1"))
        kwargs = {"deepspeed_plugin": DeepSpeedPlugin(hf_ds_config={
            "zero_optimization": {"stage": args.deepspeed}, "train_micro_batch_size_per_gpu": BATCH,
            "train_batch_size": BATCH * world, "gradient_accumulation_steps": 1, "steps_per_print": 10**9})}
    policy = {"full": Full(), "parity": Parity()}[args.policy]
    accelerator = TailorAccelerator(tailor_run_dir=args.run_dir, tailor_policy=policy, **kwargs)
    model, optimizer, scheduler = build(99 if args.resume else 0, args.dropout)  # a resume: every weight from the run
    data = torch.utils.data.DataLoader(corpus_windows(WINDOWS), batch_size=BATCH, shuffle=False)
    counter = TokenCounter()
    accelerator.register_for_checkpointing(counter)
    model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, data, scheduler)

    step = accelerator.load_state().step if args.resume else 0
    if args.dump and accelerator.is_main_process:
        dump(args.dump, accelerator, model, optimizer)
    losses, batches = {}, {}
    while step < args.max_steps:
        skip = step % len(data)  # the batches of this epoch already trained
        for batch in accelerator.skip_first_batches(data, skip) if skip else data:
            step += 1
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            counter.seen += batch.numel()
            losses[step], batches[step] = loss.item().hex(), digest(batch)
            if step % args.every == 0:
                accelerator.save_state(step=step)
            if step == args.crash_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if step == args.max_steps:
                break
    if last:
        accelerator.end_training()
    else:  # the launch's next job trains in this process group
        with mock.patch("accelerate.state.PartialState.destroy_process_group"):
            accelerator.end_training()
    if not accelerator.is_main_process:
        return accelerator, model
    weights = accelerator.get_state_dict(model)  # gathered from the ranks' partitions under ZeRO-3
    h = hashlib.sha256()
    for name in sorted(weights):
        h.update(name.encode() + weights[name].detach().numpy().tobytes())
    Path(args.result).write_text(json.dumps({
        "losses": losses, "batches": batches, "params": h.hexdigest(), "global_step": step,
        "tokens": int(counter.seen),
    }))
    return accelerator, model


if __name__ == "__main__":
    lines, made = job_lines(sys.argv[1:]), []
    for number, argv in enumerate(lines):
        made.append(main(argv, last=number == len(lines) - 1))
        said_done(number)
    leave()  # the DDP models still referenced: freeing one can deadlock (hf_job.leave)
