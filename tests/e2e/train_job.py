"""A training job run as a real process by the end-to-end tests.

Trains the tiny Llama on the real corpus, saving every --save-every steps with llmtailor;
with --kill-at it SIGKILLs itself after that step (a real crash, mid-training); with
--resume it restores the newest composite first. Writes losses by step and a digest of the
final parameters to --out.
"""

import argparse
import hashlib
import json
import os
import signal

import torch

from llmtailor import Tailor, make_policy
from llmtailor.training_example import TinyConfig, build_model, build_optimizer, corpus_tokens, train_steps

parser = argparse.ArgumentParser()
parser.add_argument("--run", required=True)
parser.add_argument("--policy", default="full")
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--save-every", type=int, default=3)
parser.add_argument("--kill-at", type=int)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--out", required=True)
args = parser.parse_args()

torch.set_num_threads(1)
config = TinyConfig(hidden_size=32, layers=4, intermediate_size=64, seq_len=32)
# A resumed process starts from other random weights: everything must come from the checkpoint.
model = build_model(config, seed=99 if args.resume else 0)
optimizer, scheduler = build_optimizer(model, total_steps=args.steps)
tailor = Tailor(args.run, model, optimizer, scheduler, policy=make_policy(args.policy))
start = tailor.restore().extra["next_step"] if args.resume else 1

losses = {}
for step, loss in train_steps(model, optimizer, scheduler, corpus_tokens(), range(start, args.steps + 1), 2, 32):
    losses[step] = loss
    if step % args.save_every == 0:
        tailor.save(step, extra={"next_step": step + 1})
    if step == args.kill_at:
        os.kill(os.getpid(), signal.SIGKILL)

digest = hashlib.sha256()
for name, param in model.named_parameters():
    digest.update(name.encode() + param.detach().numpy().tobytes())
with open(args.out, "w") as out:
    json.dump({"losses": {str(k): v.hex() for k, v in losses.items()}, "params": digest.hexdigest()}, out)
