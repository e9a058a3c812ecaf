"""File names, schema versions and state keys of the llmtailor on-disk format, in one place."""

SCHEMA_VERSION = 4
READABLE_SCHEMAS = (2, 3, 4)
"""Schema 3 adds frozen tensors kept from an older snapshot or a base model directory; schema 4,
page checksums of large chunks (a reader of part of a chunk checks only the pages it reads)."""
SNAPSHOT_FORMAT = "llmtailor.snapshot"

SNAPSHOTS_DIR = "snapshots"
TMP_DIR = ".tmp"
TRASH_DIR = ".trash"
LOCK_FILE = ".lock"
LATEST_FILE = "latest"
TIERS_FILE = "tiers.json"
CARRIED_FOR = "carried_for"
"""A manifest note of a snapshot promoted to a tier only for what a newer composite there needs
(``store/tiers/promote.py``): its own composite is not meant to restore there."""
MANIFEST_FILE = "manifest.json"
UNITS_DIR = "units"
GLOBAL_JSON = "global.json"
GLOBAL_TENSORS = "global.safetensors"
RANKS_DIR = "ranks"
INDEX_DIR = "index"

SNAPSHOT_PREFIX = "step-"

STATEFUL_KEY = "stateful"
"""The key of a rank's global state (``global.json``, ``ranks/``) under which the states of a
``Tailor``'s stateful objects are kept, by name (``providers/stateful.py``)."""

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


def rank_state_files(rank: int) -> tuple[str, str]:
    """The JSON and tensor files of rank ``rank``'s own global state (RNG, user extras) for
    ranks >= 1; rank 0's live in ``global.json`` / ``global.safetensors`` with the shared state."""
    stem = f"{RANKS_DIR}/rank-{rank:05d}"
    return f"{stem}.json", f"{stem}.safetensors"


def unit_filename(unit: str, rank: int, world_size: int) -> str:
    """Path of the tensor file rank ``rank`` writes for ``unit`` (one file per unit in a
    single-process save)."""
    return f"{UNITS_DIR}/{unit}.safetensors" if world_size == 1 else f"{UNITS_DIR}/{unit}.rank-{rank:05d}.safetensors"


def unit_index_path(unit: str) -> str:
    """Path of a unit's index (its files, tensors and chunks) inside a snapshot."""
    return f"{INDEX_DIR}/{unit}.json"


def layer_unit(index: int) -> str:
    return f"{LAYER_PREFIX}{index}"
