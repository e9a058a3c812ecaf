"""TailorTrainer under Trainer's FSDP2 (accelerate's ``fsdp_version: 2``) on a CUDA device: run
by ``tests/test_cuda.py`` under ``torchrun`` (NCCL). Trainer applies FSDP on a GPU only (on the
CPU, accelerate ignores the FSDP plugin), so the CPU-only CI machine never runs it.

    torchrun --standalone --nproc_per_node 1 hf_fsdp_job.py --out DIR --result FILE

Three Trainers in turn, each on a fresh model of the same config:
1. ``straight``: 4 steps, a tailored save after steps 2 and 4 (its own run directory);
2. ``crashed``: the same 4 steps, stopped by an exception right after the save of step 2
   (a crash after the save; TailorTrainer's ``train`` closes its Tailor on the way out);
3. ``resumed``: a model built from another seed, ``train(resume_from_checkpoint=True)`` on
   the crashed run's directory: it must restore step 2 and train steps 3 and 4.

Rank 0 writes the result file: each run's logged losses (float.hex) by step, the resumed run's
first step, whether it was under FSDP2, and a digest of each run's final weights and optimizer
state (the full tensors, gathered from the shards).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch
import transformers

SEQ_LEN = 32


class Windows(torch.utils.data.Dataset):
    """16 fixed windows of the real corpus (pydoc_data.topics as bytes)."""

    def __init__(self):
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8")
        tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(torch.int64)
        stride = (tokens.numel() - SEQ_LEN) // 16
        self.windows = torch.stack([tokens[i * stride: i * stride + SEQ_LEN] for i in range(16)])

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, index):
        return {"input_ids": self.windows[index], "labels": self.windows[index]}


class Crash(Exception):
    pass


class CrashAfterSave(transformers.TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_save(self, args, state, control, **kw):
        if state.global_step == self.step:
            raise Crash(f"stopped after the save of step {self.step}")


def full(value):
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def state_digest(model, optimizer) -> str:
    """Every parameter's full tensor and its optimizer state, by name, in one digest."""
    h = hashlib.sha256()
    for name, param in model.named_parameters():
        h.update(name.encode() + full(param.detach()).float().cpu().numpy().tobytes())
        for key, value in sorted(optimizer.state.get(param, {}).items()):
            h.update(key.encode() + full(value).float().cpu().reshape(-1).numpy().tobytes())
    return h.hexdigest()[:16]


def run(out: Path, seed: int, resume: bool, crash_at: int | None) -> dict:
    from llmtailor import Full
    from llmtailor.integrations.hf import TailorTrainer

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ_LEN,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=2, max_steps=4, save_steps=2, logging_steps=1,
        report_to=[], seed=0, dataloader_num_workers=0, learning_rate=3e-3, warmup_steps=1, disable_tqdm=True,
        # (Without a GPU, Trainer refuses fsdp at one process: the job then runs unsharded, which
        # checks only the job itself.)
        **(dict(fsdp=True, fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                                        "reshard_after_forward": True}) if torch.cuda.is_available() else {}),
    )
    callbacks = [CrashAfterSave(crash_at)] if crash_at else []
    trainer = TailorTrainer(model=model, args=args, train_dataset=Windows(), callbacks=callbacks, tailor_policy=Full())
    try:
        trainer.train(resume_from_checkpoint=True if resume else None)
    except Crash:
        pass
    from torch.distributed.fsdp import FSDPModule

    losses = {e["step"]: e["loss"].hex() for e in trainer.state.log_history if "loss" in e}
    return {"losses": losses, "global_step": trainer.state.global_step,
            "fsdp2": isinstance(trainer.model, FSDPModule) or any(isinstance(m, FSDPModule) for m in trainer.model.modules()),
            "state": state_digest(trainer.model, trainer.optimizer)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--result", type=Path, required=True)
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    results = {"straight": run(args.out / "straight", seed=0, resume=False, crash_at=None),
               "crashed": run(args.out / "crashed", seed=0, resume=False, crash_at=2),
               "resumed": run(args.out / "crashed", seed=99, resume=True, crash_at=None)}
    if torch.distributed.get_rank() == 0:
        args.result.write_text(json.dumps(results))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
