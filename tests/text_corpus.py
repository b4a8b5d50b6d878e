"""Small text corpora for the tests of ``recover prepare`` (the in-process unit tests and the multi-process
ones: worker pools, a run killed with SIGKILL)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def make_corpus(root: Path, names: list[str]) -> dict[str, str]:
    """Write one small text file per name, in the given order (text depends on the name only)."""
    texts = {}
    for rel in names:
        text = f"# document {rel}\n" + f"a line of {rel}: héllo wörld\n" * (3 + sum(map(ord, rel)) % 5)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
        texts[rel] = text
    return texts


NAMES = [
    f"{d}/file{i:02d}.{ext}"
    for i, (d, ext) in enumerate(zip("ab" * 12, ["txt", "md", "py"] * 8, strict=True))
]


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    root = tmp_path / "corpus"
    texts = make_corpus(root, NAMES)
    (root / "a" / "ignored.bin").write_bytes(b"\x00\x01")  # not a text suffix
    (root / ".hidden.txt").write_text("hidden")  # hidden entries are skipped
    return root, texts


def shard_files(out: Path) -> dict[str, bytes]:
    """Every file of an output directory but the journal, by name."""
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


def big_text(lines: int) -> str:
    return "".join(f"def f{i}(x):\n    return x * {i}  # ünïcode\n" for i in range(lines))


def write_jsonl(path: Path, rows: list) -> list[str]:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows))
    return [r["text"] for r in rows if isinstance(r, dict) and r.get("text")]
