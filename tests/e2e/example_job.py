"""``llmtailor.training_example``'s job (``python -m llmtailor.training_example ARGS``) as a job
script of tests/forked_jobs.py: the launch imports torch and transformers' model code once
(``PRELOAD``), each job forked from it imports llmtailor and runs ``job_main`` with its command line."""

from __future__ import annotations

PRELOAD = ("transformers.models.llama.modeling_llama",)


def main() -> None:
    from llmtailor.training_example import job_main

    job_main()
