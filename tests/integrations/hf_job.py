"""A real Hugging Face Trainer job, run as a fresh process by the integration and export tests.

    python hf_job.py --out DIR --result FILE [--trainer tailor|vanilla] [--policy full|parity]
        [--family llama|qwen2] [--tie] [--max-steps 12] [--save-steps 4] [--crash-at STEP]
        [--resume true|PATH] [--dump FILE] [--async] [--deepspeed STAGE] [--import-deepspeed CHECKPOINT]

Under ``torchrun --nproc_per_node N`` it is a DDP job (gloo, CPU): each process trains on its
share of the batches, and only rank 0 writes the result file. --deepspeed STAGE runs Trainer
with DeepSpeed ZeRO (CPU: launch with DS_ACCELERATOR=cpu under torchrun). --import-deepspeed
CHECKPOINT: before training, rank 0 imports that DeepSpeed checkpoint (``import_deepspeed``) into
the --resume PATH this job then resumes from.

Several jobs may share a launch (one process group under torchrun): their command lines
separated by ``--then``, run in turn, each printing ``job N done on rank R`` when it is done (a
job that SIGKILLs itself must come last).

--trainer vanilla imports no llmtailor code at all (checked at the end): the model is built from
the checkpoint's config.json. --crash-at SIGKILLs the process right after the save of that step.
--dump writes, when training begins (after any resume), every weight and optimizer tensor by
parameter name, the global step and the LR. The result file holds the logged loss of every step
(float.hex), the LR after every step, a digest of every step's batch, a digest of every process's
torch RNG state as each step begins (one list per rank; each process then draws rank + 1
numbers, so that the processes' RNGs differ), and a digest of the final weights.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
from pathlib import Path

import torch
import transformers

SEQ_LEN, WINDOWS = 32, 20  # 20 windows in batches of 2: 10 steps an epoch, so step 12 is in epoch 2
# What a launch of several jobs (tests/forked_jobs.py) imports once, before it forks each job: the
# model code and the Trainer transformers imports on first use.
PRELOAD = ("transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2", "transformers.trainer")


def corpus_windows(windows: int = WINDOWS) -> torch.Tensor:
    """``windows`` fixed windows of the real corpus (pydoc_data.topics as bytes), as in
    llmtailor.training_example."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8")
    tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(torch.int64)
    stride = (tokens.numel() - SEQ_LEN) // windows
    return torch.stack([tokens[i * stride : i * stride + SEQ_LEN] for i in range(windows)])


class Windows(torch.utils.data.Dataset):
    def __init__(self):
        self.windows = corpus_windows()

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, index):
        return {"input_ids": self.windows[index], "labels": self.windows[index]}


def model_config(family: str, tie: bool):
    classes = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}
    return classes[family](
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ_LEN, tie_word_embeddings=tie,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().contiguous().numpy().tobytes()).hexdigest()[:16]


def params_digest(model) -> str:
    h = hashlib.sha256()
    for name, param in model.named_parameters():
        h.update(name.encode() + param.detach().numpy().tobytes())
    return h.hexdigest()


class Recorder(transformers.TrainerCallback):
    def __init__(self, args):
        self.args, self.lrs = args, {}

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kw):
        if self.args.dump:
            names = {id(p): n for n, p in model.named_parameters()}
            tensors = {f"weight/{n}": t.detach().clone() for n, t in model.state_dict().items()}
            for param, values in optimizer.state.items():
                for key, value in values.items():
                    tensors[f"optim/{names[id(param)]}/{key}"] = value.detach().clone()
            torch.save(
                {"tensors": tensors, "global_step": state.global_step, "lr": lr_scheduler.get_last_lr()},
                self.args.dump,
            )

    def on_step_end(self, args, state, control, lr_scheduler=None, **kw):
        self.lrs[state.global_step] = lr_scheduler.get_last_lr()[0]

    def on_save(self, args, state, control, **kw):
        if state.global_step == self.args.crash_at:
            os.kill(os.getpid(), signal.SIGKILL)


def recording(base):
    class Recording(base):
        batches: dict[int, str] = {}
        rngs: dict[int, str] = {}

        def training_step(self, model, inputs, *rest, **kw):
            self.batches[self.state.global_step + 1] = digest(inputs["input_ids"])
            self.rngs[self.state.global_step + 1] = digest(torch.random.get_rng_state())
            torch.rand(self.args.process_index + 1)  # the processes' RNGs differ, as dropout would make them
            return super().training_step(model, inputs, *rest, **kw)

    return Recording


def job_lines(argv: list[str]) -> list[list[str]]:
    """The command lines of the jobs of one launch: ``argv`` split at each ``--then``."""
    lines: list[list[str]] = [[]]
    for arg in argv:
        if arg == "--then":
            lines.append([])
        else:
            lines[-1].append(arg)
    return lines


def said_done(number: int) -> None:
    """Job ``number`` of this launch is done on this rank (``forked_jobs.run_in_turn`` reads it):
    under DDP the ranks first wait for one another (the next job's messages never meet this
    one's), then the line goes out as one write of its own (a pipe's writes that small are never
    split or mixed with another rank's)."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"job {number} done on rank {os.environ.get('RANK', '0')}\n".encode())


def leave() -> None:
    """Exit at once (for jobs under DDP on gloo, called from inside ``main`` while the model is
    still referenced): torch 2.13 can deadlock when a DDP model is freed (its reducer's process
    group joins a gloo worker thread that waits for the GIL while the freeing thread holds it),
    at main's return or at interpreter teardown. Everything the tests read is written and
    flushed before this."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None):
    """One job (``argv``, else the command line); returns its trainer, which the caller keeps
    referenced until it leaves (see ``leave``)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--trainer", default="tailor", choices=["tailor", "vanilla"])
    parser.add_argument("--policy", default="full", choices=["full", "parity"])
    parser.add_argument("--family", default="llama")
    parser.add_argument("--tie", action="store_true")
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--save-steps", type=int, default=4)
    parser.add_argument("--crash-at", type=int)
    parser.add_argument("--resume")
    parser.add_argument("--dump")
    parser.add_argument("--async", dest="async_save", action="store_true")
    parser.add_argument("--deepspeed", type=int, choices=[1, 2, 3])
    parser.add_argument("--import-deepspeed")
    args = parser.parse_args(argv)
    deepspeed_config = None
    if args.deepspeed:
        import importlib

        # The shared-memory collective DeepSpeed compiles at start-up (~90 s) serves inference only.
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        deepspeed_config = {"zero_optimization": {"stage": args.deepspeed}, "train_micro_batch_size_per_gpu": "auto",
                            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 10**9}

    torch.set_num_threads(1)
    resume = {"true": True, None: None}.get(args.resume, args.resume)
    if args.trainer == "vanilla" and resume:
        config = transformers.AutoConfig.from_pretrained(resume)  # the exported checkpoint's config.json
    else:
        config = model_config(args.family, args.tie)
    torch.manual_seed(99 if resume else 0)  # a resumed run must get every weight from the checkpoint
    model = transformers.AutoModelForCausalLM.from_config(config)

    training_args = transformers.TrainingArguments(
        output_dir=args.out, per_device_train_batch_size=2, max_steps=args.max_steps, save_steps=args.save_steps,
        logging_steps=1, report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0, learning_rate=3e-3,
        weight_decay=0.01, warmup_steps=2, disable_tqdm=True, save_total_limit=None, deepspeed=deepspeed_config,
    )
    if args.import_deepspeed:  # the run this job resumes from, imported inside the launch
        from llmtailor.interop.deepspeed.importer import import_deepspeed

        if training_args.process_index == 0:
            import_deepspeed(Path(args.import_deepspeed), Path(resume))
        torch.distributed.barrier()
    recorder = Recorder(args)
    common = dict(model=model, args=training_args, train_dataset=Windows(), callbacks=[recorder])
    if args.trainer == "vanilla":
        trainer = recording(transformers.Trainer)(**common)
    else:
        from llmtailor import Full, Parity
        from llmtailor.integrations.hf import TailorTrainer

        policy = {"full": Full(), "parity": Parity()}[args.policy]
        trainer = recording(TailorTrainer)(**common, tailor_policy=policy, tailor_async=args.async_save)
    trainer.train(resume_from_checkpoint=resume)

    if args.trainer == "vanilla":
        assert not [m for m in sys.modules if m.startswith("llmtailor")], "vanilla run imported llmtailor"
    losses = {e["step"]: e["loss"].hex() for e in trainer.state.log_history if "loss" in e}
    rngs = [trainer.rngs]
    if torch.distributed.is_initialized():
        rngs = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(rngs, trainer.rngs)
    if trainer.args.process_index == 0:
        Path(args.result).write_text(json.dumps({
            "losses": losses, "lrs": recorder.lrs, "batches": trainer.batches, "params": params_digest(model),
            "global_step": trainer.state.global_step, "rngs": rngs,
        }))
    return trainer


def launch() -> None:
    """A launch of this script (``python hf_job.py ...``, a rank of torchrun's, or one forked by
    ``forked_jobs.rank_launch``): every job of the command line in turn (``--then``), then exit."""
    made = []
    for number, argv in enumerate(job_lines(sys.argv[1:])):
        made.append(main(argv))
        said_done(number)
    if torch.distributed.is_initialized():  # leave together: without it gloo can abort at exit (pytorch#190489)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    leave()  # the Trainers still hold their DDP models: freeing one after destroy_process_group can deadlock


if __name__ == "__main__":
    launch()
