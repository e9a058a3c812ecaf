"""``python waiting_job.py STEPS JOB-ARGS...``: the job of ``llmtailor.training_example`` (run
with JOB-ARGS) with a handshake for the tier crash tests: right after its save of each step in
STEPS (comma-separated), it waits until that save is committed and every promotion the save
made due has committed in the slower tier (``Tailor.wait(promoted=True)``). A test that kills
the job later knows what the slower tier holds at least, instead of guessing how far a
background promoter got by the kill."""

import sys

from llmtailor import training_example


def main(steps: str, *job_args: str) -> None:
    waits = {int(step) for step in steps.split(",")}

    class WaitingTailor(training_example.Tailor):
        def save(self, step, *args, **kwargs):
            report = super().save(step, *args, **kwargs)
            if step in waits:
                self.wait(promoted=True)
            return report

    training_example.Tailor = WaitingTailor  # the name job_main builds its Tailor by
    training_example.job_main(list(job_args))


if __name__ == "__main__":
    main(*sys.argv[1:])
