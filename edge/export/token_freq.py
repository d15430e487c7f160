"""Token frequencies that rank a partial LM head's rows (``edge.export.exporter.head_rows``).

``TABLE`` (shipped beside this module) holds, for one tokenizer, the ids seen in a corpus in
order of falling count (ties by id) with their counts, and that tokenizer's
``shared.tokenizer_fingerprint``: ``ranking(tokenizer_json)`` returns the ids for a tokenizer
with that fingerprint and None for any other (the exporter then ranks by id).

The shipped table was computed by ``python -m specsplit.edge.export.token_freq`` with the
Qwen2.5 tokenizer over the source and documentation of the packages installed in this
repository's .venv (``*.py``, ``*.md``, ``*.rst``, ``*.txt``; at most ``FILE_BYTES`` of each
file, about ``CORPUS_BYTES`` in all: every n-th file in sorted path order, n as needed), code
and prose as the drafts meet them. Build-step code: numpy and tokenizers.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import numpy as np

from specsplit.shared.tokenizer_fingerprint import tokenizer_fingerprint

log = logging.getLogger(__name__)

TABLE = Path(__file__).with_name("token_freq_qwen2.npz")
SUFFIXES = (".py", ".md", ".rst", ".txt")
FILE_BYTES = 64 << 10  # of one file: no single large file (a vendored table, a changelog) rules
CORPUS_BYTES = 32 << 20


def ranking(tokenizer_json: Path, table: Path = TABLE) -> np.ndarray | None:
    """Ids by falling corpus frequency (int64 [seen ids]) for the tokenizer ``table`` was
    computed with, else None."""
    if not table.exists() or not tokenizer_json.exists():
        return None
    with np.load(table) as data:
        if str(data["fingerprint"]) != tokenizer_fingerprint(tokenizer_json):
            return None
        return data["ids"].astype(np.int64)


def corpus_files(root: Path, corpus_bytes: int) -> list[Path]:
    """The corpus: every n-th file under ``root`` with a ``SUFFIXES`` suffix, in sorted order,
    n the smallest that keeps it near ``corpus_bytes`` (each file read up to ``FILE_BYTES``)."""
    files = sorted(p for p in root.rglob("*") if p.suffix in SUFFIXES and p.is_file())
    total = sum(min(p.stat().st_size, FILE_BYTES) for p in files)
    return files[:: max(1, -(-total // corpus_bytes))]


def count(tokenizer_json: Path, root: Path, corpus_bytes: int = CORPUS_BYTES) -> np.ndarray:
    """Counts of every id over the corpus under ``root`` (int64 [vocab])."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    counts = np.zeros(tokenizer.get_vocab_size(with_added_tokens=True), np.int64)
    files = corpus_files(root, corpus_bytes)
    read = 0
    for start in range(0, len(files), 256):
        batch = []
        for path in files[start : start + 256]:
            with path.open("rb") as f:
                batch.append(f.read(FILE_BYTES).decode("utf-8", errors="ignore"))
        read += sum(map(len, batch))
        for encoding in tokenizer.encode_batch(batch, add_special_tokens=False):
            counts += np.bincount(encoding.ids, minlength=len(counts))[: len(counts)]
        log.info("%d of %d files, %d MB", min(start + 256, len(files)), len(files), read >> 20)
    return counts


def write_table(counts: np.ndarray, tokenizer_json: Path, out: Path) -> None:
    seen = np.flatnonzero(counts)
    ids = seen[np.lexsort((seen, -counts[seen]))]  # falling count, then rising id
    np.savez_compressed(
        out,
        ids=ids.astype(np.int32),
        counts=counts[ids].astype(np.int64),
        fingerprint=np.array(tokenizer_fingerprint(tokenizer_json)),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m specsplit.edge.export.token_freq", description=__doc__
    )
    p.add_argument("--tokenizer", type=Path, required=True, help="a Qwen2.5 tokenizer.json")
    p.add_argument(
        "--corpus", type=Path, required=True, help="e.g. .venv/lib/python3.11/site-packages"
    )
    p.add_argument("--out", type=Path, default=TABLE)
    p.add_argument("--bytes", type=int, default=CORPUS_BYTES)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    counts = count(args.tokenizer, args.corpus, args.bytes)
    write_table(counts, args.tokenizer, args.out)
    print(f"{args.out}: {np.count_nonzero(counts)} ids seen, {counts.sum()} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
