"""Their data as it is: nanoGPT and llm.c directories with only --data.path, the vocabulary from the data,
errors that name the options, `prepare --format nanogpt`, llm.c's flavour and shard sizes, and the
torchrun replicas rule."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from recover.cli import main
from recover.config import ParallelConfig
from recover.data.layout import detect_split
from recover.data.prepare import prepare_files
from recover.data.sampler import open_samplers
from recover.data.shards import GPT2_MAGIC, LLAMA3_MAGIC, read_shard
from recover.data.verify import check_data
from recover.errors import ConfigError, DataError
from recover.launch.cli import LaunchRequest, check_launch
from recover.train.processes.cli import torchrun_replicas, train_config

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 400


def nanogpt_char_dir(root: Path) -> Path:
    """A directory as nanoGPT's data/shakespeare_char/prepare.py leaves it (its steps, not its code)."""
    chars = sorted(set(TEXT))
    stoi, itos = {ch: i for i, ch in enumerate(chars)}, dict(enumerate(chars))
    cut = int(len(TEXT) * 0.9)
    root.mkdir(parents=True)
    np.array([stoi[c] for c in TEXT[:cut]], dtype=np.uint16).tofile(root / "train.bin")
    np.array([stoi[c] for c in TEXT[cut:]], dtype=np.uint16).tofile(root / "val.bin")
    with open(root / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": itos, "stoi": stoi}, f)
    return root


def llmc_shard(path: Path, tokens: np.ndarray, magic: int) -> None:
    """A shard as llm.c's write_datafile writes it: 256 int32 (magic, version, count), then the tokens."""
    header = np.zeros(256, dtype=np.int32)
    header[:3] = (magic, 1 if magic == GPT2_MAGIC else 7, len(tokens))
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(np.uint16 if magic == GPT2_MAGIC else np.uint32).tobytes())


def test_a_nanogpt_directory_samples_with_only_data_path_and_its_vocabulary_from_meta_pkl(tmp_path: Path) -> None:
    data = nanogpt_char_dir(tmp_path / "shakespeare_char")
    vocab = len(set(TEXT))
    cfg = train_config("debug", ["--data.path", str(data)], 1)
    assert cfg.model.vocab_size == 64 * -(-vocab // 64)  # meta.pkl's vocab_size, padded to a multiple of 64
    train, _ = open_samplers(cfg.data, data, cfg.model.vocab_size, 8, 0)
    x, y = train.microbatch(0, 3)
    assert x.shape == (cfg.data.microbatch_size, cfg.data.seq_len) and int(x.max()) < vocab
    raw = np.fromfile(data / "train.bin", dtype=np.uint16)
    start = int(train.window_ids(0, 3)[0]) * cfg.data.seq_len
    assert x[0].tolist() == raw[start:start + cfg.data.seq_len].tolist() and y[0, :-1].tolist() == x[0, 1:].tolist()
    assert train_config("debug", ["--data.path", str(data), "--model.vocab_size", "100"], 1).model.vocab_size == 100


def test_recover_train_runs_on_a_nanogpt_directory_with_only_data_path(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's acceptance line: a few debug steps, one process, `--data.path` to nanoGPT's output."""
    data = nanogpt_char_dir(tmp_path / "shakespeare_char")
    out = tmp_path / "run"
    assert main(["train", "--config", "debug", "--out", str(out), "--no-progress", "--data.path", str(data),
                 "--training.steps=3", "--training.warmup_steps=1", "--training.threads=1"]) == 0
    assert "done: 3 steps" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["model"]["vocab_size"] == 64  # its characters, padded
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3


@pytest.mark.parametrize(("magic", "vocab", "names"), [
    (GPT2_MAGIC, 50304, ("tiny_shakespeare_train.bin", "tiny_shakespeare_val.bin")),
    (LLAMA3_MAGIC, 128256, ("fineweb_train_000001.bin", "fineweb_val_000000.bin")),
])
def test_llmc_directories_of_both_flavours(tmp_path: Path, magic: int, vocab: int, names: tuple[str, str]) -> None:
    rng = np.random.default_rng(0)
    high = 50257 if magic == GPT2_MAGIC else 128256
    for name, n in zip(names, (5000, 1000), strict=True):
        llmc_shard(tmp_path / name, rng.integers(0, high, n), magic)
    assert detect_split(tmp_path, "train").name == "llmc"
    cfg = train_config("debug", ["--data.path", str(tmp_path)], 1)
    assert cfg.model.vocab_size == vocab  # the tokenizer the header's magic names, padded to 64
    train, val = check_data(cfg.data, tmp_path, cfg.model.vocab_size)
    assert [p.name for p in train.paths + val.paths] == list(names)
    assert train.shard(0).dtype == (np.uint16 if magic == GPT2_MAGIC else np.uint32) and train.num_tokens == 5000


def test_a_model_vocabulary_smaller_than_the_datas_is_refused(tmp_path: Path) -> None:
    (tmp_path / "input.txt").write_text(TEXT)
    prepare_files([tmp_path / "input.txt"], tmp_path / "x", quiet=True)
    meta = json.loads((tmp_path / "x" / "meta.json").read_text())
    meta["vocab_size"] = 2004  # as a 2,004-token tokenizer records it
    (tmp_path / "x" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError) as info:
        train_config("debug", ["--data.path", str(tmp_path / "x"), "--model.vocab_size", "2000"], 1)
    line = str(info.value)
    assert "model.vocab_size = 2000" in line and "vocabulary of 2004" in line and "--model.vocab_size 2004" in line
    assert train_config("debug", ["--data.path", str(tmp_path / "x")], 1).model.vocab_size == 2048
    cfg = train_config("debug", ["--data.path", str(tmp_path / "x"), "--model.vocab_size=2004"], 1)
    with pytest.raises(DataError, match="vocabulary of 2004"):  # whoever builds the config: the shards say so too
        check_data(cfg.data, tmp_path / "x", 2000)
    req = LaunchRequest(out=tmp_path / "run", config="debug", overrides=("--data.path", str(tmp_path / "x")))
    opts = check_launch(req)  # the launcher resolves it once; every worker reads it from the run's config.json
    assert opts.config.model.vocab_size == 2048


def test_missing_shards_name_what_was_looked_for_and_the_options(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("no shards here")
    with pytest.raises(DataError) as info:
        train_config("debug", ["--data.path", str(tmp_path)], 1)
    line = str(info.value)
    for text in ("train_*.bin", "train.bin", "*_train*.bin", "--data.train_pattern", "recover prepare"):
        assert text in line, line
    assert "\n" not in line and "re-create" not in line
    np.zeros(200, dtype=np.uint16).tofile(tmp_path / "train.bin")  # nanoGPT's train.bin (3 windows), no val.bin
    assert train_config("debug", ["--data.path", str(tmp_path)], 1).model.vocab_size == 50304  # no meta.pkl: GPT-2
    with pytest.raises(DataError, match=r"no validation shards .*val\.bin .*--data\.val_pattern"):
        check_data(train_config("debug", ["--data.path", str(tmp_path)], 1).data, tmp_path, 50304)
    np.zeros(100, dtype=np.uint16).tofile(tmp_path / "my.heldout")
    given = train_config("debug", ["--data.path", str(tmp_path), "--data.val_pattern", "*.heldout"], 1)
    _, val = check_data(given.data, tmp_path, given.model.vocab_size)  # a given pattern wins
    assert [p.name for p in val.paths] == ["my.heldout"]
    wrong = train_config("debug", ["--data.path", str(tmp_path), "--data.val_pattern", "*.nothing"], 1)
    with pytest.raises(DataError, match=r"data.val_pattern = '\*.nothing' matches no file .*fix --data.val_pattern"):
        check_data(wrong.data, tmp_path, 50304)


def test_prepare_format_nanogpt_writes_what_nanogpt_reads_and_reads_it_back(tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"doc{i}.txt").write_text(f"document {i}\n" * 50)
    out = tmp_path / "out"
    assert main(["prepare", str(corpus), "--out", str(out), "--format", "nanogpt", "--quiet"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "meta.pkl", "train.bin", "val.bin"]
    with open(out / "meta.pkl", "rb") as f:
        assert pickle.load(f) == {"vocab_size": 257}  # what nanoGPT's train.py reads
    train = np.memmap(out / "train.bin", dtype=np.uint16, mode="r")  # as nanoGPT's get_batch reads it
    head = np.frombuffer(b"\xc8\xd4\x34\x01", dtype=np.uint16)  # tokens that spell llm.c's GPT-2 magic
    np.concatenate([head, train]).astype(np.uint16).tofile(out / "val.bin")  # still raw tokens: no sniffing
    meta = json.loads((out / "meta.json").read_text())
    (out / "meta.json").unlink()  # a val.bin not from prepare (its shard_info would refuse it): nanoGPT's own layout
    assert len(train) == meta["train"]["tokens"] and bytes(train[1:11].astype(np.uint8)) == b"document 0"
    cfg = train_config("debug", ["--data.path", str(out)], 1)
    assert cfg.model.vocab_size == 320
    sets = check_data(cfg.data, out, 65536)
    assert sets[0].num_tokens == len(train) and sets[1].shard(0)[:2].tolist() == [54472, 308]
    assert main(["prepare", str(corpus), "--out", str(out), "--format", "nanogpt", "--shard-tokens", "9"]) == 2
    assert "--shard-tokens 9 applies to --format llmc" in capsys.readouterr().err


class WideTokenizer:
    """A 100,000-entry tokenizer: bytes, except that a '~' becomes id 70,000."""

    spec, vocab_size, eot_id = "wide", 100_000, 1000

    def encode(self, text: bytes) -> np.ndarray:
        ids = np.frombuffer(bytes(text), dtype=np.uint8).astype(np.uint32)
        return np.where(ids == ord("~"), 70_000, ids).astype(np.uint32)


@pytest.mark.parametrize("wide_id", [False, True])
def test_llmc_flavour_follows_the_largest_id_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     wide_id: bool) -> None:
    monkeypatch.setattr("recover.data.prepare.load_tokenizer", lambda spec: WideTokenizer())
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(8):
        (corpus / f"doc{i}.txt").write_text(f"text {i}\n" * 40 + ("~" if wide_id and i == 3 else ""))
    meta = prepare_files([corpus], tmp_path / "out", tokenizer="wide", shard_tokens=300, quiet=True)
    shards = sorted((tmp_path / "out").glob("*.bin"))
    assert len(shards) > 3 and meta["vocab_size"] == 100_000
    magics = {int(np.fromfile(p, dtype="<i4", count=1)[0]) for p in shards}
    assert magics == ({LLAMA3_MAGIC} if wide_id else {GPT2_MAGIC})  # by the ids written, one flavour for all
    tokens = np.concatenate([read_shard(p) for p in shards])
    assert (70_000 in tokens.tolist()) == wide_id and len(tokens) == meta["train"]["tokens"] + meta["val"]["tokens"]


def test_no_trailing_shard_is_shorter_than_the_others(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(10):
        (corpus / f"doc{i}.txt").write_text(f"line {i}\n" * (30 + 7 * i))
    meta = prepare_files([corpus], tmp_path / "out", shard_tokens=500, val_fraction=0.2, quiet=True)
    sizes = [len(read_shard(tmp_path / "out" / name)) for name in meta["train"]["shards"]]
    assert len(sizes) >= 2 and sum(sizes) == meta["train"]["tokens"]
    assert sizes[:-1] == [500] * (len(sizes) - 1) and 500 <= sizes[-1] < 1000  # llm.c needs B*T+1 per shard
    assert meta["train"]["tokens"] % 500 != 0  # there was a tail to place


def test_worker_is_listed_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "\n    worker " in capsys.readouterr().out


def test_parallel_replicas_under_torchrun_is_honoured_or_refused() -> None:
    cfg = train_config("tiny", [], 4)  # tiny's preset says 2; torchrun's 4 processes are 4 replicas
    assert cfg.parallel.replicas == 4
    assert train_config("tiny", ["--parallel.replicas", "4"], 4).parallel.replicas == 4
    assert train_config("tiny", [], 1).parallel.replicas == 1
    with pytest.raises(ConfigError, match="does not match torchrun's 4 processes.*--nproc-per-node 2"):
        train_config("tiny", ["--parallel.replicas=2"], 4)
    with pytest.raises(ConfigError, match=r"in one process.*torchrun --nproc-per-node 4.*recover launch --replicas 4"):
        train_config("tiny", ["--parallel.replicas", "4"], 1)
    pp2 = ParallelConfig(replicas=2, pp=2)
    assert torchrun_replicas(pp2, 2, explicit=False) == 1
    with pytest.raises(ConfigError, match="one replica whose ranks are the 2 processes.*recover launch --replicas 2"):
        torchrun_replicas(pp2, 2, explicit=True)

