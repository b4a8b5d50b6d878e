"""A trained checkpoint, used: self-describing checkpoints, `recover sample`, `recover export --format
hf|torch` (loaded back by transformers), and `--init-from`.

One checkpoint is trained once for the module (debug preset, 3 steps). Its model is chosen to make
the comparisons strict: untied embeddings (an ``lm_head`` to export), grouped-query attention (the
q and k rows are permuted with different head counts), a non-default rope theta, a larger init and
a tiny learning rate, so that greedy decoding still walks through many different ids instead of
the one most frequent byte a briefly trained model repeats.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import losses, run_recover
from recover.cli import main
from recover.config import ModelConfig, load_config
from recover.data.tokenizer import ByteTokenizer
from recover.errors import CheckpointError, ConfigError
from recover.model import build_model, construct, hf
from recover.train.checkpoints.describe import read_description, resolve_checkpoint
from recover.train.checkpoints.integrity import verify, write_manifest
from recover.train.checkpoints.sample import generate, load_checkpoint_model
from recover.train.checkpoints.weights import check_init_from, load_initial_weights, read_checkpoint_state

MODEL = ["--model.n_kv_heads=2", "--model.tie_embeddings=false", "--model.init_std=0.1", "--model.rope_theta=500"]
PROMPT = "    def __init__(self, name):\n"  # 30 bytes: 30 + 30 new tokens stay inside max_seq_len = 64


def train_args(out: Path, corpus: Path, *extra: str) -> list[str]:
    return ["train", "--config", "debug", "--out", str(out), "--no-progress", "--data.path", str(corpus),
            "--training.eval_every=0", "--training.threads=1", "--training.lr=1e-5", "--training.min_lr=0",
            *MODEL, *extra]


def first_step(out: Path, corpus: Path, source: Path, *extra: str) -> list[str]:
    """One step of training that starts from the weights at ``source``."""
    return train_args(out, corpus, "--training.steps=1", "--training.warmup_steps=0", "--init-from", str(source),
                      *extra)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    out = tmp_path_factory.mktemp("trained")
    assert main(train_args(out, corpus, "--training.steps=3", "--training.checkpoint_every=3")) == 0
    return out


def sample_cli(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    capsys.readouterr()
    assert main(["sample", *args]) == 0
    return capsys.readouterr().out.rstrip("\n")


def test_a_checkpoint_describes_itself_and_older_ones_fall_back(run: Path, tmp_path: Path) -> None:
    ckpt = resolve_checkpoint(run)
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["config"]["model"]["n_kv_heads"] == 2 and meta["config"]["training"]["lr"] == 1e-5
    assert meta["tokenizer"] == {"spec": "byte", "vocab_size": 257, "eot_id": 256}
    assert "meta.json" in json.loads((ckpt / "manifest.json").read_text())["files"] and verify(ckpt)
    assert isinstance(read_description(ckpt).tokenizer(), ByteTokenizer)
    # an older checkpoint (no config, no tokenizer record) inside its run directory: both from the run
    old_run = tmp_path / "old"
    shutil.copytree(run, old_run)
    old = resolve_checkpoint(old_run)
    meta = json.loads((old / "meta.json").read_text())
    del meta["config"], meta["tokenizer"]
    (old / "meta.json").write_text(json.dumps(meta))
    write_manifest(old)
    desc = read_description(old)
    assert desc.config is not None and desc.model.n_kv_heads == 2 and isinstance(desc.tokenizer(), ByteTokenizer)
    # ... and on its own: the model config still, the tokenizer named in one line with the fix
    alone = tmp_path / "alone" / "step_000003"
    shutil.copytree(old, alone)
    desc = read_description(resolve_checkpoint(alone))
    assert desc.model.n_kv_heads == 2 and desc.config is None
    with pytest.raises(CheckpointError, match="--tokenizer byte"):
        desc.tokenizer()
    assert isinstance(desc.tokenizer("byte"), ByteTokenizer)


def test_a_huggingface_tokenizer_travels_inside_the_checkpoint(tmp_path: Path) -> None:
    """A run on a tokenizer.json: the checkpoint holds a copy (under the manifest) and reads it back."""
    pytest.importorskip("tokenizers", reason="the HF tokenizer path needs the 'tokenizers' package")
    from recover.train.checkpoints.checkpoint import save_checkpoint
    from recover.train.checkpoints.describe import describe_run
    from recover.train.replicas.optim import build_optimizer

    tok_file = tmp_path / "tok" / "tokenizer.json"
    tok_file.parent.mkdir()
    tok_file.write_text(json.dumps(hf.byte_tokenizer_json()))
    data = tmp_path / "data"
    data.mkdir()
    (data / "meta.json").write_text(json.dumps({"tokenizer": str(tok_file), "vocab_size": 257, "eot_id": 256}))
    cfg = load_config("debug", [f"--data.path={data}"])
    run_desc = describe_run(cfg)
    model = build_model(cfg.model, 0)
    ckpt = save_checkpoint(tmp_path / "ckpts", 1, model, build_optimizer(model, cfg.training), run_desc.meta,
                           cfg.model, files=run_desc.files)
    assert "tokenizer.json" in json.loads((ckpt / "manifest.json").read_text())["files"] and verify(ckpt)
    tok_file.unlink()  # the original is gone: the checkpoint's copy is used
    tok = read_description(ckpt).tokenizer()
    assert tok.path == ckpt / "tokenizer.json" and tok.decode(tok.encode("héllo\n")) == "héllo\n"
    transformers = pytest.importorskip("transformers", reason="needs transformers: pip install 'recover-llm[export]'")
    assert main(["export", str(ckpt), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")  # the run's own tokenizer.json
    text = "x = 'ü' <|endoftext|>"
    assert auto(text)["input_ids"] == tok.encode(text).tolist() and auto.eos_token_id == 256


def test_sample_greedy_is_deterministic_and_crops_past_max_seq_len(run: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    model, desc = load_checkpoint_model(run)
    assert model.cfg.max_seq_len == 64
    long = ["--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "100"]  # 30 + 100 > 64 positions
    first = sample_cli(capsys, str(run), *long)
    assert sample_cli(capsys, str(run), *long) == first
    prompt = desc.tokenizer().encode(PROMPT).tolist()
    ids = generate(model, prompt, 100, 0.0, stop_id=256)
    assert first == desc.tokenizer().decode(prompt + ids) and len(ids) == 100  # (no end-of-text drawn here)
    with pytest.raises(Exception, match="size"):  # what a loop without cropping runs into
        model(torch.tensor([prompt + ids]))
    # top-k 1 is greedy at any temperature; a seed fixes a draw
    assert sample_cli(capsys, str(run), *long, "--temperature", "1.5", "--top-k", "1") == first
    drawn = ["--prompt", PROMPT, "--temperature", "1", "--max-new-tokens", "40"]
    assert sample_cli(capsys, str(run), *drawn, "--seed", "3") == sample_cli(capsys, str(run), *drawn, "--seed", "3")
    assert sample_cli(capsys, str(run), *drawn, "--seed", "3") != sample_cli(capsys, str(run), *drawn, "--seed", "4")
    assert main(["sample", str(run), "--prompt", "x", "--temperature", "-1"]) == 2
    assert "--temperature -1.0 is not allowed" in capsys.readouterr().err


def test_export_torch_round_trips_and_refuses_a_non_empty_out(run: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "pt"
    assert main(["export", str(run), "--format", "torch", "--out", str(out)]) == 0
    payload = torch.load(out / "model.pt", weights_only=True)
    model = construct(ModelConfig(**payload["model_config"]))
    model.load_state_dict(payload["state_dict"], strict=True)
    ours, _ = load_checkpoint_model(run)
    tokens = torch.randint(0, 257, (2, 40))
    assert torch.equal(model(tokens), ours(tokens))
    assert payload["step"] == 3 and payload["tokenizer"]["spec"] == "byte" and payload["config"]["name"] == "debug"
    assert main(["export", str(run), "--format", "torch", "--out", str(out)]) == 2
    assert "is not empty" in capsys.readouterr().err and sorted(p.name for p in out.iterdir()) == ["model.pt"]
    assert main(["export", str(run), "--format", "torch", "--out", str(out), "--overwrite"]) == 0
    assert not list(tmp_path.glob(".pt.*"))  # no temporary or replaced directory left behind


def test_export_hf_loads_in_transformers_and_generates_what_recover_samples(
        run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's acceptance: an exported checkpoint generates the same greedy text in transformers."""
    transformers = pytest.importorskip("transformers", reason="needs transformers: pip install 'recover-llm[export]'")
    out = tmp_path / "hf"
    assert main(["export", str(run), "--format", "hf", "--out", str(out)]) == 0
    capsys.readouterr()
    model = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ours, desc = load_checkpoint_model(run)
    byte = desc.tokenizer()
    for text in (PROMPT, "héllo ✓ 日本語 🎉\t\r\n", "a literal <|endoftext|> stays bytes"):
        ids = byte.encode(text).tolist()
        assert tok(text)["input_ids"] == ids and tok.decode(ids) == byte.decode(ids) == text
    prompt = byte.encode(PROMPT).tolist()
    x = torch.tensor([prompt + list(range(100, 130))])  # 60 positions
    with torch.no_grad():
        diff = (model(x).logits - ours(x)).abs().max().item()
    assert diff < 1e-4
    with torch.no_grad():
        generated = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=30)[0, len(prompt):].tolist()
    ids = generate(ours, prompt, 30, 0.0, stop_id=byte.eot_id)
    assert generated == ids and len(set(ids)) > 10  # token for token, through many different ids
    text = sample_cli(capsys, str(run), "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "30")
    assert text == PROMPT + tok.decode(generated, skip_special_tokens=True)
    # without the q/k permutation the logits are silently wrong
    state = read_checkpoint_state(resolve_checkpoint(run))
    with torch.no_grad():
        for i in range(ours.cfg.n_layers):
            attn = model.model.layers[i].self_attn
            attn.q_proj.weight.copy_(state[f"layers.{i}.attention.wq.weight"])
            attn.k_proj.weight.copy_(state[f"layers.{i}.attention.wk.weight"])
        unpermuted = (model(x).logits - ours(x)).abs().max().item()
    assert unpermuted > 1e-2
    print(f"max |logit difference| transformers vs recover: {diff:.2e} (without the q/k permutation: {unpermuted:.2f})")


def test_init_from_hf_torch_and_checkpoint_start_from_the_same_parameters(
        run: Path, corpus: Path, tmp_path: Path) -> None:
    assert main(["export", str(run), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    assert main(["export", str(run), "--format", "torch", "--out", str(tmp_path / "pt")]) == 0
    cfg = load_config("debug", MODEL).model
    trained = read_checkpoint_state(resolve_checkpoint(run))
    for source in (run, tmp_path / "hf", tmp_path / "pt" / "model.pt"):
        model = build_model(cfg, 99)
        load_initial_weights(model, source)
        for name, p in model.state_dict().items():
            assert torch.equal(p, trained[name]), (source, name)
    first = {}
    for source in (resolve_checkpoint(run), tmp_path / "hf"):
        out = tmp_path / f"from_{source.name}"
        assert main(first_step(out, corpus, source)) == 0
        first[source.name] = losses(out)[0]
        assert json.loads((out / "config.json").read_text())["training"]["init_from"] == str(source.resolve())
    trained_loss = losses(run)[0]  # the seeded model's loss at step 0 (same data: a pure function of the step)
    assert first["hf"] == first["step_000003"] != trained_loss


def test_init_from_a_mismatched_model_is_one_line_naming_the_tensor(
        run: Path, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bad"
    assert main(train_args(out, corpus, "--init-from", str(run), "--model.dim=32")) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "tensor tok_embeddings.weight has shape [320, 64] there and [320, 32]" in err
    assert "--model.dim 64" in err and not out.exists()  # refused before anything started
    assert main(train_args(out, corpus, "--init-from", str(run), "--model.n_layers=3")) == 2
    err = capsys.readouterr().err
    assert "tensor layers.2.attention_norm.weight (shape [64] in this model) is missing there" in err
    assert main(train_args(out, corpus, "--init-from", str(run), "--model.n_kv_heads=4")) == 2
    assert "tensor layers.0.attention.wk.weight has shape [32, 64] there and [64, 64]" in capsys.readouterr().err
    assert main(train_args(out, corpus, "--init-from", str(tmp_path / "nowhere"))) == 2
    assert "--init-from: " in capsys.readouterr().err
    check_init_from(run, load_config("debug", [*MODEL, "--model.rope_theta=10000"]).model)  # fits: a warning
    assert "model.rope_theta is 500.0 there and 10000.0 here" in capsys.readouterr().err
    from recover.launch.cli import LaunchRequest, check_launch  # launch refuses it before starting anything

    with pytest.raises(ConfigError, match=r"tok_embeddings.weight has shape \[320, 64\] there and \[320, 32\]"):
        check_launch(LaunchRequest(out=out, config="debug", overrides=("--model.dim=32",), init_from=str(run)))
    opts = check_launch(LaunchRequest(out=out, config="debug", overrides=tuple(MODEL), init_from=str(run)))
    assert opts.config.training.init_from == str(run.resolve())  # every worker reads it from the run's config.json


@pytest.mark.slow
def test_init_from_under_tensor_parallelism_starts_every_rank_from_the_same_weights(
        run: Path, corpus: Path, tmp_path: Path) -> None:
    """A replica of 2 TP ranks (DTensor shards) loads the whole tensors on each rank before sharding them:
    its step-0 loss is the single process's. Its checkpoint, saved in shards, is read whole by sample/export."""
    single, tp = tmp_path / "single", tmp_path / "tp2"
    assert main(first_step(single, corpus, run, "--training.checkpoint_every=1")) == 0
    run_recover(first_step(tp, corpus, run, "--parallel.tp=2", "--training.checkpoint_every=1"), nproc=2)
    assert abs(losses(tp)[0] - losses(single)[0]) <= 1e-6 * losses(single)[0]
    sharded, whole = (read_checkpoint_state(resolve_checkpoint(r)) for r in (tp, single))
    assert sharded.keys() == whole.keys()
    for name, t in whole.items():
        torch.testing.assert_close(sharded[name], t, rtol=1e-5, atol=1e-6, msg=name)
    assert read_description(resolve_checkpoint(tp)).tokenizer_record["spec"] == "byte"
