"""A LoRA fine-tune's checkpoint: ours vs HF Trainer's own PEFT checkpoint of the same state.

One process, every contender side by side, medians over ``--repeats``. The model is a Llama
at Llama-3.1-8B's proportions scaled down as in ``bench_save.py`` (hidden 1024, 32 layers,
intermediate 3584, vocab 32000; built from ``transformers.LlamaConfig``, never downloaded,
fp32), with a real peft LoRA of rank 16 on q, k, v and o; AdamW over the adapters in the
groups HF Trainer builds (``Trainer.create_optimizer``), moments from one real training step.

- ``HF Trainer``  a real ``transformers.Trainer`` given that PeftModel, optimizer and scheduler,
  calling its own ``_save_checkpoint`` (adapter_model.safetensors, adapter_config.json,
  optimizer.pt, scheduler.pt, rng_state.pth, trainer_state.json, training_args.bin, README);
- ``ours Full / Parity``  ``Tailor.save``: a Tailor's first save writes the frozen base weights
  once; the measured save is its second (only what trains, plus the global state);
- ``ours base= (1st)`` / ``ours base=``  ``Tailor(..., base=DIR)`` over the base model's
  ``save_pretrained`` directory: even the first save copies no base weight (measured, with
  the one-off checksum of the base files), and the second.

Per contender: bytes, durable seconds (the call plus ``os.sync()``; ours fsync inside the
call). Restore: ``Tailor.restore`` of the Full run into a fresh PeftModel (its base loaded
with ``from_pretrained``, as a user builds it; frozen tensors it already holds are checked by
checksum, not read) vs Trainer's own resume path of its checkpoint (``_load_from_checkpoint``,
``_load_optimizer_and_scheduler``, ``_load_rng_state``) into the same, both from files just
written. Then the targets of PRODUCT.md: bytes <=
Trainer's + 2%, time <= Trainer's, restore <= Trainer's resume.

    .venv/bin/python bench/bench_peft.py --repeats 3
    .venv/bin/python bench/bench_peft.py --layers 4 --hidden 256 --intermediate 896 --vocab 4096 --repeats 1  # quick
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import statistics
import time
from pathlib import Path

import peft
import torch
import transformers

from llmtailor import Full, Parity, Tailor
from llmtailor.training_example import batch_at, corpus_tokens

MB = 1e6


def base_model(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    return transformers.AutoModelForCausalLM.from_config(config)


def lora_setup(args: argparse.Namespace, out: Path):
    """The PeftModel, a Trainer around it, its AdamW and scheduler (moments from one step)."""
    model = peft.get_peft_model(base_model(args), peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank,
                                                                   target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    trainer_args = transformers.TrainingArguments(output_dir=str(out / "trainer"), report_to=[], use_cpu=True,
                                                  save_strategy="no", learning_rate=1e-4)
    trainer = transformers.Trainer(model=model, args=trainer_args)
    trainer.create_optimizer_and_scheduler(num_training_steps=1000)
    batch = batch_at(corpus_tokens(), step=1, batch_size=1, seq_len=16)
    model(input_ids=batch, labels=batch).loss.backward()
    trainer.optimizer.step()
    trainer.lr_scheduler.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    return model, trainer


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def durable(call) -> tuple[float, object]:
    os.sync()
    start = time.perf_counter()
    value = call()
    os.sync()
    return time.perf_counter() - start, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sizes = {"layers": 32, "hidden": 1024, "intermediate": 3584, "heads": 16, "kv-heads": 8, "vocab": 32000, "rank": 16}
    for flag, default in sizes.items():
        parser.add_argument(f"--{flag}", type=int, default=default, help=f"(default {default})")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = parser.parse_args()
    transformers.utils.logging.set_verbosity_error()
    print(f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"peft {peft.__version__}, {os.cpu_count()} CPUs")
    out = args.out / f"bench_peft.{os.getpid()}"
    out.mkdir(parents=True)
    try:
        model, trainer = lora_setup(args, out)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        print(f"model: {total / 1e6:.1f}M params fp32, {args.layers} layers; LoRA r={args.rank} on q,k,v,o: "
              f"{trainable / 1e6:.2f}M trainable ({trainable * 12 / MB:.1f} MB with AdamW's moments)")
        base_dir = out / "base"
        base_model(args).save_pretrained(base_dir)  # the live base carries LoRA modules: save it as built
        opt, sched = trainer.optimizer, trainer.lr_scheduler
        results: dict[str, list[tuple[float, int]]] = {k: [] for k in
                                                       ("HF Trainer", "ours Full", "ours Parity", "ours base= (1st)", "ours base=")}
        restore: dict[str, list[float]] = {"HF Trainer resume": [], "ours restore": []}
        for repeat in range(args.repeats):
            trainer.state.global_step = 100 + repeat
            folder = Path(trainer.args.output_dir) / f"checkpoint-{100 + repeat}"
            seconds, _ = durable(lambda: trainer._save_checkpoint(model, trial=None))
            results["HF Trainer"].append((seconds, dir_bytes(folder)))
            for name, policy, base in (("ours Full", Full(), None), ("ours Parity", Parity(), None),
                                       ("ours base=", Full(), base_dir)):
                run = out / f"{name.split()[-1].strip('=')}-{repeat}"
                tailor = Tailor(run, model, opt, sched, policy=policy, base=base)
                seconds, report = durable(lambda: tailor.save(1))
                if base is not None:
                    results["ours base= (1st)"].append((seconds, report.bytes))
                seconds, report = durable(lambda: tailor.save(2))
                results[name].append((seconds, report.bytes))
                tailor.close()
            # Restores, from the files just written (warm page cache for both).
            # Both resume into the PeftModel a user builds: the base loaded with from_pretrained.
            loaded = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
            fresh = peft.get_peft_model(loaded, peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank,
                                                                target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
            vanilla = transformers.Trainer(model=fresh, args=trainer.args)
            vanilla.create_optimizer_and_scheduler(num_training_steps=1000)

            def trainer_resume():
                vanilla._load_from_checkpoint(str(folder))
                vanilla._load_optimizer_and_scheduler(str(folder))
                vanilla._load_rng_state(str(folder))

            start = time.perf_counter()
            trainer_resume()
            restore["HF Trainer resume"].append(time.perf_counter() - start)
            start = time.perf_counter()
            Tailor(out / f"Full-{repeat}", fresh, vanilla.optimizer, vanilla.lr_scheduler, read_only=True).restore()
            restore["ours restore"].append(time.perf_counter() - start)
            for name, values in results.items():
                print(f"  repeat {repeat + 1} {name:<18} {values[-1][1] / MB:8.2f} MB  durable {values[-1][0]:6.3f} s")
            print(f"  repeat {repeat + 1} restore: Trainer {restore['HF Trainer resume'][-1]:.3f} s, "
                  f"ours {restore['ours restore'][-1]:.3f} s", flush=True)
            shutil.rmtree(folder)
        hf_seconds = statistics.median(s for s, _ in results["HF Trainer"])
        hf_bytes = statistics.median(b for _, b in results["HF Trainer"])
        print(f"\n{'contender':<20}{'MB':>9}{'bytes/HF':>10}{'durable s':>11}{'time/HF':>9}")
        for name, values in results.items():
            seconds, size = statistics.median(s for s, _ in values), statistics.median(b for _, b in values)
            print(f"{name:<20}{size / MB:>9.2f}{size / hf_bytes:>10.3f}{seconds:>11.3f}{seconds / hf_seconds:>9.3f}")
        hf_restore, ours_restore = (statistics.median(restore[k]) for k in ("HF Trainer resume", "ours restore"))
        print(f"restore: HF Trainer resume {hf_restore:.3f} s, ours {ours_restore:.3f} s ({ours_restore / hf_restore:.3f}x)")
        print("\nPRODUCT.md targets (LoRA / PEFT save: bytes <= Trainer's + 2%; time <= Trainer's; restore <= Trainer's resume)")
        for name in ("ours Full", "ours Parity", "ours base=", "ours base= (1st)"):
            seconds = statistics.median(s for s, _ in results[name])
            size = statistics.median(b for _, b in results[name])
            print(f"  {name:<18} bytes {size / hf_bytes:.3f}x: {'PASS' if size <= 1.02 * hf_bytes else 'FAIL'}; "
                  f"time {seconds / hf_seconds:.3f}x: {'PASS' if seconds <= hf_seconds else 'FAIL'}")
        print(f"  restore {ours_restore / hf_restore:.3f}x: {'PASS' if ours_restore <= hf_restore else 'FAIL'}")
    finally:
        shutil.rmtree(out, ignore_errors=True)
        with contextlib.suppress(OSError):
            args.out.rmdir()


if __name__ == "__main__":
    main()
