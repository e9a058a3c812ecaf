"""A job for test_tier_crashes: ``tier_crash_job.py HOME MEMORY POINT [HOME MEMORY POINT ...]``,
each in turn in this process (the tests of several runs share its start-up; a POINT at which it
dies is the last).

POINT ``file`` / ``carrier`` / ``manifest``: save Parity composites at steps 1..4 to the memory
tier (``promote_every=3``: step 1 is promoted, then step 4 with step 3 as its carrier) and
SIGKILL this process inside the promotion of step 4 — while the carrier's first file is being
written, once the carrier is committed, or just before the manifest of step 4.
POINT ``resume``: restore the newest composite of any tier, close (promoting it), and print
``{"restored", "tier", "promoted_to_disk"}``.
POINT ``retrain``: a writer starts (noting the run directory's snapshots then), restores the
newest composite of any tier, trains and saves on to step 7 (each promotion settled before the
next save), closes, and prints ``{"at_start", "restored", "tier", "promoted", "on_disk"}``.

The crashes may also run as jobs forked from one launch (tests/forked_jobs.py, which calls
``main()`` in each): llmtailor is imported by the job itself, torch and transformers' model code
by the launch (``PRELOAD``).
"""

import json
import os
import signal
import sys
import threading

import torch

# What a launch of several jobs (tests/forked_jobs.py) imports once, before it forks each job.
PRELOAD = ("transformers.models.llama.modeling_llama",)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm(point: str) -> None:
    from llmtailor.store.lock import WriterLock
    from llmtailor.store.tiers import promote

    copy_file, copy_snapshot, check_held = promote.copy_file, promote._copy_snapshot, WriterLock.check_held
    if point == "file":
        def killing_copy_file(source, key, sink, entry):
            if "step-00000003" in key:
                sink.write(b"part of a file")
                die()
            copy_file(source, key, sink, entry)
        promote.copy_file = killing_copy_file
    elif point == "carrier":
        def killing_copy_snapshot(source, target, step, composite, parent):
            copy_snapshot(source, target, step, composite, parent)
            if step == 3:
                die()
        promote._copy_snapshot = killing_copy_snapshot
    elif point == "manifest":
        calls = []

        def killing_check_held(lock):
            if threading.current_thread().name == "llmtailor-promote":
                calls.append(1)
                if len(calls) == 3:  # step 1's commit, the carrier's, then step 4's
                    die()
            check_held(lock)
        WriterLock.check_held = killing_check_held


def run(home: str, memory: str, point: str) -> None:
    from llmtailor import Parity, Run, Tailor, Tier
    from llmtailor.training_example import batch_at, build_model, build_optimizer, corpus_tokens, job_config

    torch.manual_seed(0)
    model = build_model(job_config(), seed=0)
    optimizer, scheduler = build_optimizer(model, total_steps=10)
    tailor = Tailor(home, model, optimizer, scheduler, policy=Parity(), tiers=[Tier(memory, keep=3, promote_every=3)])
    if point == "resume":
        report = tailor.restore()
        tailor.close()
        print(json.dumps({"restored": report.step, "tier": report.tier, "promoted_to_disk": Run(home).latest_step()}))
        return
    tokens = corpus_tokens()

    def train_and_save(step: int) -> None:
        batch = batch_at(tokens, step, 2, 32)
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        tailor.save(step)

    if point == "retrain":
        at_start = Run(home).steps()
        report = tailor.restore()
        for step in range(report.step + 1, 8):
            train_and_save(step)
            tailor.wait(promoted=True)  # a known cadence: each promotion settled before the next save
        tailor.close()
        print(json.dumps({"at_start": at_start, "restored": report.step, "tier": report.tier,
                          "promoted": [p.step for p in tailor.tiers.promotions], "on_disk": Run(home).steps()}))
        return
    arm(point)
    for step in range(1, 5):
        train_and_save(step)
        if step == 1:
            tailor.wait(promoted=True)  # step 1 reaches the disk before step 2 is saved: a known start
    tailor.close()  # the promotion of step 4 is in flight, or starts here: the process dies in it
    sys.exit("the job was meant to die during the promotion")


def main() -> None:
    if len(sys.argv) < 4 or len(sys.argv) % 3 != 1:
        sys.exit(f"expected HOME MEMORY POINT [HOME MEMORY POINT ...], got {sys.argv[1:]}")
    for at in range(1, len(sys.argv), 3):
        run(*sys.argv[at:at + 3])


if __name__ == "__main__":
    main()
