"""``accelerate launch`` with its ranks forked from one interpreter that imported the job script.

    python accelerate_launch.py [accelerate launch flags] SCRIPT ARGS...

This is accelerate's own launch command (``accelerate.commands.launch.main``): its parser, its
checks of the flags and the environment it hands the ranks (``ACCELERATE_MIXED_PRECISION``,
``ACCELERATE_DYNAMO_*``; with ``--use_deepspeed`` its ``ACCELERATE_USE_DEEPSPEED`` and
``ACCELERATE_DEEPSPEED_*``). Only the agent it hands the ranks to, ``torch.distributed.run.run``
(torchrun's, which starts each rank as a fresh interpreter), is replaced by
``forked_jobs.launch_ranks``: the ranks are forked, with torchrun's environment on top of
accelerate's, from this interpreter once it imported SCRIPT (and its ``PRELOAD``), so the
imports of torch, transformers and accelerate (DeepSpeed's too, which accelerate's DeepSpeed
launcher imports) are paid once a launch, not once a rank and once more in the agent. A rank
that fails ends the others and the launch exits 1, as under ``accelerate launch``. For tests of
what the ranks do (TailorAccelerator), not of torchrun."""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed.run

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # forked_jobs.py, in tests/

from forked_jobs import launch_ranks  # noqa: E402


def forked_run(args) -> None:
    """In place of ``torch.distributed.run.run(args)`` (torchrun's parsed arguments, as
    accelerate's launchers call it, inside the environment they prepared): one node's ranks."""
    assert str(args.nnodes) in ("1", "1:1") and not args.rdzv_endpoint, "one node only"
    launch_ranks(int(args.nproc_per_node), int(args.master_port), None, args.training_script,
                 list(args.training_script_args))


if __name__ == "__main__":
    from accelerate.commands import launch

    torch.distributed.run.run = forked_run
    sys.argv = ["accelerate launch", *sys.argv[1:]]
    launch.main()
