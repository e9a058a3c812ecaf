"""File names, schema versions and state keys of the llmtailor on-disk format, in one place."""

import re

SCHEMA_VERSION = 7
READABLE_SCHEMAS = (2, 3, 4, 5, 6, 7)
"""Schema 3 adds frozen tensors kept from an older snapshot or a base model directory; schema 4,
page checksums of large chunks (a reader of part of a chunk checks only the pages it reads);
schema 5, pack files (a rank's small units written together into one file, ``PACKS_DIR``) and
the sampled checksum of a whole weight's values (``Chunk.sample_xxh3``, ``BaseRef.sample_xxh3``),
against which a restore checks a frozen tensor the live model already holds; schema 6, the unit
indexes of a snapshot in one file (``INDEXES_FILE``, a line per unit) instead of a file each
(``unit_index_path``): one durable file per save, not one per unit; schema 7, a frozen whole
weight's sampled checksum over its covering sample (``Chunk.cover_xxh3``: an element of every
row and column, ``store.samples.covering``) in place of ``sample_xxh3``'s 1024 elements, which
a tensor differing in whole rows could pass; a restore checks each record by its own sample."""
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
PACKS_DIR = "packs"
PACK_UNIT_BYTES = 16 << 20
"""A unit of which a rank writes fewer bytes than this goes into the rank's pack file (one file,
made durable once, for all its small units) rather than a file of its own."""
PACK_FILE_BYTES = 256 << 20
"""A pack file is closed once it holds this many bytes (the small units waiting for it are held
in memory until it is written) and the next small unit starts another."""
GLOBAL_JSON = "global.json"
GLOBAL_TENSORS = "global.safetensors"
RANKS_DIR = "ranks"
INDEX_DIR = "index"
INDEXES_FILE = "indexes.json"
"""A snapshot's unit indexes (schema 6 on): one compact JSON line per unit saved there, in layout
order; the manifest names each unit's line by its first byte, size and checksum
(``UnitRef.index_at``), and lists the file itself with the global state's."""

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

# Async saves.
MOST_IN_FLIGHT = 2
"""The most async saves in flight at once (``TailorConfig.async_in_flight``, ``AsyncStager``)."""


def snapshot_dirname(step: int) -> str:
    return f"{SNAPSHOT_PREFIX}{step:08d}"


def parse_snapshot_name(name: str) -> int | None:
    """The step of a snapshot directory name (``step-00000100``), or None for any other name."""
    match = re.fullmatch(re.escape(SNAPSHOT_PREFIX) + r"([0-9]+)", name)
    return int(match.group(1)) if match else None


def rank_state_files(rank: int) -> tuple[str, str]:
    """The JSON and tensor files of rank ``rank``'s own global state (RNG, user extras) for
    ranks >= 1; rank 0's live in ``global.json`` / ``global.safetensors`` with the shared state."""
    stem = f"{RANKS_DIR}/rank-{rank:05d}"
    return f"{stem}.json", f"{stem}.safetensors"


def unit_filename(unit: str, rank: int, world_size: int) -> str:
    """Path of the tensor file rank ``rank`` writes for ``unit`` (one file per unit in a
    single-process save)."""
    return f"{UNITS_DIR}/{unit}.safetensors" if world_size == 1 else f"{UNITS_DIR}/{unit}.rank-{rank:05d}.safetensors"


def pack_filename(rank: int, number: int) -> str:
    """Path of the ``number``-th pack file rank ``rank`` writes: its small units' tensors,
    together (each unit's index names it; a tensor's key in it is unique across units)."""
    return f"{PACKS_DIR}/rank-{rank:05d}.{number}.safetensors"


def is_pack(relpath: str) -> bool:
    """Whether a unit's file is a pack file (holding other units' tensors too)."""
    return relpath.startswith(f"{PACKS_DIR}/")


_RANK_FILE = re.compile(r"rank-(\d+)(?:\.\d+)?\.(?:safetensors|json)$")  # a unit file, pack or rank state


def writer_rank(relpath: str) -> int | None:
    """The rank whose part a snapshot file is (a unit file or pack it wrote, its own rank
    state), or None for a file of no rank's part: the shared global state, the manifest, the
    unit indexes, and a single-process save's unit files."""
    if relpath.startswith(f"{INDEX_DIR}/") or relpath in (GLOBAL_JSON, GLOBAL_TENSORS, MANIFEST_FILE, INDEXES_FILE):
        return None
    found = _RANK_FILE.search(relpath)
    return int(found.group(1)) if found else None


def unit_index_path(unit: str) -> str:
    """Path of a unit's index (its files, tensors and chunks) inside a snapshot of schema 5 or
    before (from schema 6, a line of ``INDEXES_FILE``)."""
    return f"{INDEX_DIR}/{unit}.json"


def layer_unit(index: int) -> str:
    return f"{LAYER_PREFIX}{index}"
