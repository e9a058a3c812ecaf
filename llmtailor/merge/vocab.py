"""``tokenizer_source``: the output's vocabulary, and the embedding rows it keeps, as mergekit
decides them.

mergekit, given a ``tokenizer_source``, rebuilds every vocabulary tensor (the embeddings and the
LM head: rows indexed by token) for the output tokenizer: output row ``i`` is the row its source
model's tokenizer gives the token of id ``i``, a zero row where that tokenizer lacks the token;
the output has one row per token of the output tokenizer, and the config's ``vocab_size`` says
so. The output tokenizer is the named source's, or with ``base`` the base model's (the first
slice's model without ``base_model``) less its tokens beyond the model's ``vocab_size``. So a
tokenizer smaller than the embedding (Qwen2.5's checkpoints pad theirs) cuts the embedding.

Tokenizers are read with transformers' ``AutoTokenizer``, as mergekit reads them, only when a
plan names a ``tokenizer_source``; a source without tokenizer files is taken to share the base
model's tokenizer (mergekit's fallback too). Where the base model has none (tailored runs and
most Trainer checkpoints), mergekit refuses the plan; llmtailor keeps the tensors as they are,
copies the named tokenizer's files and warns.

Not supported, refused naming the feature: ``union`` (a new vocabulary built from every
source's), a base tokenizer with tokens beyond its model's embedding (mergekit rewrites the
tokenizer without them; llmtailor copies tokenizer files as they are), and token ids beyond the
tokenizer's size or its model's embedding (where mergekit itself fails).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmtailor.constants import EMBED, HEAD
from llmtailor.errors import ConfigError

if TYPE_CHECKING:
    from llmtailor.interop.source import Source, TensorInfo

VOCAB_UNITS = (EMBED, HEAD)


@dataclass(frozen=True)
class Vocabulary:
    """The output's vocabulary: its size and, for each source label whose rows are taken, the
    source row of every output row (-1: a zero row)."""

    size: int
    rows: dict[str, tuple[int, ...]]

    def rows_of(self, label: str, unit: str, info: TensorInfo, vocab_size: int | None) -> tuple[int, ...] | None:
        """The rows ``label``'s tensor ``info`` of ``unit`` keeps (None: the tensor is no
        vocabulary tensor, or keeps every row in order)."""
        if unit not in VOCAB_UNITS or not info.shape or info.shape[0] != vocab_size:
            return None
        rows = self.rows[label]
        return None if rows == tuple(range(info.shape[0])) else rows


def vocab_size_of(source: Source) -> int | None:
    value = (source.config or {}).get("vocab_size")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def build_vocabulary(tokenizer_label: str, base_label: str, labels: list[str], sources: dict[str, Source],
                     problems: list[str], warnings: list[str]) -> Vocabulary | None:
    """The vocabulary of a plan whose ``tokenizer_source`` is ``tokenizer_label`` (``base``:
    the base model ``base_label``'s) for the vocabulary tensors of ``labels``. None: the base
    model has no tokenizer (mergekit refuses such a plan; here the tensors stay as they are,
    with a warning), or a problem says why it cannot be built as mergekit builds it."""
    try:
        return _build(tokenizer_label, base_label, labels, sources, problems, warnings)
    except ConfigError as err:
        problems.append(str(err))
        return None


def _build(tokenizer_label: str, base_label: str, labels: list[str], sources: dict[str, Source],
           problems: list[str], warnings: list[str]) -> Vocabulary | None:
    full = _vocab(sources[base_label])
    if full is None:
        warnings.append(f"tokenizer_source: the base model {base_label!r} has no tokenizer files, so the embeddings are "
                        "kept as they are (mergekit refuses such a plan)")
        return None
    # mergekit's base tokenizer, less its tokens beyond the model's embedding.
    limit = vocab_size_of(sources[base_label])
    base_vocab = {t: i for t, i in full.items() if limit is None or i < limit}
    if tokenizer_label == "base":
        if len(base_vocab) != len(full):
            beyond = sorted(set(full) - set(base_vocab))
            problems.append(
                f"tokenizer_source: base: the tokenizer of {base_label!r} has {len(beyond)} tokens beyond its embedding's "
                f"{limit} rows (e.g. {beyond[0]!r}); mergekit rewrites the tokenizer without them, llmtailor copies "
                "tokenizer files as they are: not supported"
            )
            return None
        out_vocab = base_vocab
    else:
        out_vocab = _vocab(sources[tokenizer_label])
        if out_vocab is None:
            problems.append(f"tokenizer_source: {tokenizer_label!r} has no tokenizer files (tokenizer.json, ...)")
            return None
    size = len(out_vocab)
    if sorted(out_vocab.values()) != list(range(size)):
        problems.append(f"tokenizer_source: the token ids of {tokenizer_label!r}'s tokenizer are not 0..{size - 1}, "
                        "where mergekit fails: not supported")
        return None
    by_id = {i: token for token, i in out_vocab.items()}
    rows: dict[str, tuple[int, ...]] = {}
    for label in dict.fromkeys(labels):
        own = base_vocab if label == base_label else _vocab(sources[label])
        model_vocab = own if own is not None else base_vocab  # mergekit: "assuming same as the base"
        rows_limit = vocab_size_of(sources[label]) or len(model_vocab)
        source_rows = tuple(model_vocab.get(by_id[i], -1) for i in range(size))
        past = [by_id[i] for i, row in enumerate(source_rows) if row >= rows_limit]
        if past:
            problems.append(f"tokenizer_source: {len(past)} tokens (e.g. {past[0]!r}) have ids beyond the {rows_limit} rows "
                            f"of {label!r}'s embedding, where mergekit fails: not supported")
            continue
        rows[label] = source_rows
    return Vocabulary(size, rows)


def _vocab(source: Source) -> dict[str, int] | None:
    """Token -> id of the source's tokenizer, loaded as mergekit loads it; None: it has none."""
    files = source.tokenizer_files()
    if not files:
        return None
    import transformers

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(files[0].parent))
    except Exception as err:  # transformers raises many kinds for a damaged or partial tokenizer
        raise ConfigError(f"tokenizer_source: the tokenizer of {source.label!r} cannot be loaded "
                          f"({type(err).__name__}: {str(err)[:200]})") from None
    return dict(tokenizer.get_vocab())
