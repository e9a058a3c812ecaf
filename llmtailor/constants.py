"""File names, schema versions and state keys of the llmtailor on-disk format, in one place."""

SCHEMA_VERSION = 1
SNAPSHOT_FORMAT = "llmtailor.snapshot"

SNAPSHOTS_DIR = "snapshots"
TMP_DIR = ".tmp"
TRASH_DIR = ".trash"
LOCK_FILE = ".lock"
LATEST_FILE = "latest"
MANIFEST_FILE = "manifest.json"
UNITS_DIR = "units"
GLOBAL_JSON = "global.json"
GLOBAL_TENSORS = "global.safetensors"

SNAPSHOT_PREFIX = "step-"

# Tensor keys inside a unit file: "<kind>/<parameter name>[/<optimizer state key>]".
KIND_WEIGHT = "weight"
KIND_OPTIM = "optim"
KIND_MASTER = "master"

# Unit names.
EMBED = "embed"
NORM = "norm"
HEAD = "head"
OTHER = "other"
LAYER_PREFIX = "layer."


def snapshot_dirname(step: int) -> str:
    return f"{SNAPSHOT_PREFIX}{step:08d}"


def layer_unit(index: int) -> str:
    return f"{LAYER_PREFIX}{index}"
