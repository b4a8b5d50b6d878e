"""Text from a trained model: autoregressive sampling, the context cropped to ``max_seq_len``.

Contract:
- :func:`generate` appends up to ``max_new_tokens`` ids to a prompt, one full forward pass per
  token (no KV cache: correctness first; the models recover trains in tests are tiny). The model
  sees at most its last ``max_seq_len`` ids (its rotary table ends there), so a prompt and a
  continuation of any length work.
- ``temperature == 0`` is greedy (argmax, the lowest id on ties, as ``torch.argmax``); otherwise the
  logits are divided by it, cut to the ``top_k`` largest when given, and one id is drawn with
  ``generator`` (on the CPU, so a seed gives the same text on any device).
- Generation stops after ``stop_id`` (the tokenizer's end-of-text) when given; it is part of the
  output, as in Hugging Face's ``generate``.
- :func:`load_checkpoint_model` builds the model of a complete checkpoint (or a run directory's
  newest intact one) from the checkpoint alone, in eval mode, as its ``model.arch``'s spec builds it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from recover.errors import ConfigError
from recover.model.build import construct

if TYPE_CHECKING:
    from recover.train.checkpoints.describe import Description


def next_token(logits: torch.Tensor, temperature: float, top_k: int | None,
               generator: torch.Generator | None) -> int:
    """One id from the logits ``(V,)`` of the last position."""
    if temperature == 0:
        return int(torch.argmax(logits))
    scaled = logits.float().cpu() / temperature
    if top_k is not None and top_k < scaled.numel():
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(model: nn.Module, prompt: list[int], max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, generator: torch.Generator | None = None,
             stop_id: int | None = None) -> list[int]:
    """The ids that follow ``prompt`` (see the module contract).

    Raises:
        ConfigError: an empty prompt, an id the model has no embedding for, or bad sampling options.
    """
    check_options(max_new_tokens, temperature, top_k)
    vocab = model.cfg.vocab_size
    if not prompt:
        raise ConfigError("the prompt is empty: give --prompt some text")
    if max(prompt) >= vocab or min(prompt) < 0:
        raise ConfigError(f"the prompt holds token id {max(prompt)}, beyond the model's vocabulary of {vocab}: "
                          "use the tokenizer the model was trained with")
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], dtype=torch.long, device=device)  # (1, T)
    out: list[int] = []
    for _ in range(max_new_tokens):
        context = ids[:, -model.cfg.max_seq_len:]  # the model knows max_seq_len positions (Llama: its rotary table)
        logits = model(context)[0, -1]  # (V,)
        token = next_token(logits, temperature, top_k, generator)
        out.append(token)
        if token == stop_id:
            break
        ids = torch.cat([ids, torch.tensor([[token]], device=device)], dim=1)
    return out


def check_options(max_new_tokens: int, temperature: float, top_k: int | None) -> None:
    if max_new_tokens < 0:
        raise ConfigError(f"--max-new-tokens {max_new_tokens} is not allowed: a number >= 0")
    if not temperature >= 0:
        raise ConfigError(f"--temperature {temperature} is not allowed: a number >= 0 (0: greedy)")
    if top_k is not None and top_k < 1:
        raise ConfigError(f"--top-k {top_k} is not allowed: a positive number of candidates")


def load_checkpoint_model(path: str | Path, device: str | torch.device = "cpu") -> tuple[nn.Module, Description]:
    """The model of the checkpoint ``path`` names (RUN_DIR or CHECKPOINT) and its description.

    Raises:
        CheckpointError: no intact checkpoint there, or it cannot describe itself.
    """
    from recover.train.checkpoints.describe import read_description, resolve_checkpoint
    from recover.train.checkpoints.weights import read_checkpoint_state

    ckpt = resolve_checkpoint(path)
    desc = read_description(ckpt)
    model = construct(desc.model, device)
    state = read_checkpoint_state(ckpt)
    model.load_state_dict({k: state[k] for k in model.state_dict()}, strict=True)
    return model.eval(), desc


def resolve_device(name: str) -> torch.device:
    """``auto``: the first CUDA device when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name!r} is not a device: auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: no CUDA device is available here; use --device cpu")
    return device
