"""Run merge plans through mergekit's own ``run_merge``, all in one process (its imports cost
seconds per process). Executed by the python of the mergekit venv (``make mergekit``), never
imported by the tests: our venv has no mergekit.

    python mergekit_driver.py JOBS.json RESULTS.json

JOBS.json is a list of ``[plan file, output directory]``; RESULTS.json maps each plan file to
null (merged) or the error mergekit raised (``TypeName: message``).
"""

import json
import sys

import yaml
from mergekit.config import MergeConfiguration
from mergekit.merge import run_merge
from mergekit.options import MergeOptions


def main(jobs_file: str, results_file: str) -> None:
    with open(jobs_file, encoding="utf-8") as f:
        jobs = json.load(f)
    results = {}
    for plan_file, out in jobs:
        with open(plan_file, encoding="utf-8") as f:
            text = f.read()
        try:
            # What mergekit-yaml does with a plan file, with its default options.
            config = MergeConfiguration.model_validate(yaml.safe_load(text))
            run_merge(config, out, options=MergeOptions(quiet=True), config_source=text)
            results[plan_file] = None
        except Exception as err:  # reported to the test, which decides
            results[plan_file] = f"{type(err).__name__}: {err}"
    with open(results_file, "w", encoding="utf-8") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
