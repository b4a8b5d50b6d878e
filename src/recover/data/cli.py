"""``recover prepare``: tokenise text, JSONL, Parquet (or the built-in stdlib corpus) into token shards.

Contract: exactly one source, positional inputs or ``--builtin``; writes shards and ``meta.json``
under ``--out`` (see :mod:`recover.data.prepare`) and prints a one-paragraph summary. A re-run with
the same inputs and options skips the work. ``--verify DIR`` (no inputs) instead checks every token of
a prepared directory once (:mod:`recover.data.verify`): one line per problem, a summary line, exit
status 1 when anything is bad. Heavy imports happen only when the command runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from recover.errors import DataError

BUILTINS = ("stdlib",)  # mirrors recover.data.prepare.BUILTIN_CORPORA without importing numpy


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``prepare`` sub-command to ``sub``."""
    p = sub.add_parser(
        "prepare",
        help="tokenise text files (or a built-in corpus) into train/val token shards",
        description="Tokenise text files or directories (or --builtin stdlib, which needs no network) into "
        "train/val token shards plus meta.json, in llm.c's or nanoGPT's format; `recover train --data.path OUT` "
        "reads either. Files are split into train/val by a stable hash of their relative path.",
    )
    p.add_argument("inputs", nargs="*", type=Path,
                   help="text, .jsonl or .parquet files, or directories (searched recursively)")
    p.add_argument("--builtin", choices=BUILTINS, help="an embedded corpus instead of inputs")
    p.add_argument("--out", type=Path, help="output directory for shards and meta.json")
    p.add_argument("--tokenizer", default="byte", help="'byte' (default) or a HuggingFace tokenizer.json")
    p.add_argument("--val-fraction", type=float, default=0.05, help="share of files for validation (0.05)")
    p.add_argument("--format", dest="fmt", choices=("llmc", "nanogpt"), default="llmc",
                   help="llmc (default): train_NNNNNN.bin/val_NNNNNN.bin with llm.c's header, uint16 when every "
                        "id < 65536, else uint32; nanogpt: train.bin, val.bin (raw uint16) and meta.pkl, as "
                        "nanoGPT's train.py reads them")
    p.add_argument("--shard-tokens", type=int, default=None,
                   help="llmc: tokens per shard (50000000); the last shard takes the remainder, so none is shorter")
    p.add_argument("--max-bytes", type=int, default=None, help="read at most this many bytes of text")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--verify", type=Path, metavar="DIR",
                   help="instead of preparing: check every token of every shard in DIR once (headers, sizes, ids "
                        "against the vocabulary, meta.json's checksums), in parallel; the result is cached in "
                        "DIR/.recover-verified.json, which launch then trusts instead of scanning")
    p.add_argument("--vocab-size", type=int, default=None, metavar="N",
                   help="with --verify: ids must be below N (default: the data's recorded vocabulary)")
    p.add_argument("--workers", type=int, default=None,
                   help="tokenising processes (default: the cores this process may use; 1 for the byte tokenizer, "
                        "faster alone); the output is the same for any number")
    p.add_argument("--field", default="text", help="JSONL inputs: the field that holds each document's text (text)")
    p.add_argument("--column", default="text", help="Parquet inputs: the column that holds each document's text "
                   "(text); needs pip install 'recover-llm[parquet]'")
    p.set_defaults(func=run)


def summary(meta: dict, out_dir: Path) -> str:
    """One paragraph describing what ``meta`` (from prepare) holds."""
    train, val = meta["train"], meta["val"]
    head = "Already prepared (meta.json matches, nothing redone)" if meta.get("skipped") else "Prepared"
    if meta.get("resumed_shards"):
        head += f" (resumed: {meta['resumed_shards']} complete shard(s) kept from an interrupted run)"
    return (
        f"{head}: {train['tokens']:,} train tokens from {train['files']} file(s) in {len(train['shards'])} "
        f"shard(s) and {val['tokens']:,} val tokens from {val['files']} file(s) in {len(val['shards'])} "
        f"shard(s), tokenizer {meta['tokenizer']} (vocab {meta['vocab_size']}), {meta['format']} format, "
        f"source {meta['source']}, written to {out_dir}/."
    )


def verify(args: argparse.Namespace) -> int:
    """``recover prepare --verify DIR``: one line per problem, a summary line; 1 when anything is bad."""
    if args.inputs or args.builtin or args.out:
        raise DataError("recover prepare --verify DIR checks prepared shards and takes no inputs, --builtin or "
                        "--out; run it on its own (e.g. `recover prepare --verify data/mine`)")
    if not args.verify.is_dir():
        raise DataError(f"--verify {args.verify}: no such directory; give a directory of token shards")
    if args.vocab_size is not None and args.vocab_size < 1:
        raise DataError(f"--vocab-size {args.vocab_size} is not allowed: a positive number of token ids")
    from recover.data.verify import verify as scan

    result = scan(args.verify, args.vocab_size, workers=getattr(args, "workers", None), progress=not args.quiet)
    print(result.summary())
    return 0 if result.ok else 1


def run(args: argparse.Namespace) -> int:
    if args.verify is not None:
        return verify(args)
    if args.out is None:
        raise DataError("recover prepare needs --out DIR (where the shards go), or --verify DIR to check shards "
                        "already prepared")
    if bool(args.inputs) == bool(args.builtin):
        which = "both inputs and --builtin" if args.inputs else "neither inputs nor --builtin"
        raise DataError(
            f"recover prepare got {which}; give text files/directories, or --builtin stdlib "
            "(e.g. `recover prepare --builtin stdlib --out data/stdlib`)"
        )
    from recover.data.prepare import prepare_builtin, prepare_files

    options = dict(
        tokenizer=args.tokenizer,
        val_fraction=args.val_fraction,
        fmt=args.fmt,
        shard_tokens=args.shard_tokens,
        max_bytes=args.max_bytes,
        quiet=args.quiet,
        workers=args.workers,
    )
    if args.builtin:
        meta = prepare_builtin(args.builtin, args.out, **options)
    else:
        meta = prepare_files(args.inputs, args.out, field=args.field, column=args.column, **options)
    print(summary(meta, args.out))
    return 0
