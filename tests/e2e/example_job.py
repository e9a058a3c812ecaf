"""``python example_job.py [--promoted-at STEPS] JOB-ARGS...``: the job of
``llmtailor.training_example`` (``python -m llmtailor.training_example JOB-ARGS``), as a script or as
a job of tests/forked_jobs.py: the launch imports torch and transformers' model code once
(``PRELOAD``), each job forked from it imports llmtailor and runs ``job_main``.

With ``--promoted-at STEPS`` (comma-separated), a handshake for the tier crash tests: right after
its save of each of those steps, the job waits until that save is committed and every promotion
the save made due has committed in the slower tier (``Tailor.wait(promoted=True)``). A test that
kills the job later knows what the slower tier holds at least, instead of guessing how far a
background promoter got by the kill."""

from __future__ import annotations

import sys

PRELOAD = ("transformers.models.llama.modeling_llama",)


def main() -> None:
    from llmtailor import training_example

    args = sys.argv[1:]
    if args[:1] == ["--promoted-at"]:
        waits, args = {int(step) for step in args[1].split(",")}, args[2:]

        class WaitingTailor(training_example.Tailor):
            def save(self, step, *args, **kwargs):
                report = super().save(step, *args, **kwargs)
                if step in waits:
                    self.wait(promoted=True)
                return report

        training_example.Tailor = WaitingTailor  # the name job_main builds its Tailor by
    training_example.job_main(args)


if __name__ == "__main__":
    main()
