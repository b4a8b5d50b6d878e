"""torchtitan's own Llama 3 (its model registry's "debugmodel" flavour, random weights) trained by a user loop on
recover.api, built the way torchtitan's trainer builds it: on the meta device, materialised with ``to_empty``
and initialised by the model's ``init_states`` (torchtitan's initialisers and its RoPE cache).

    python train_titan.py

Two changes to the stock flavour, both torchtitan's own options: the inner attention is its
``ScaledDotProductAttention`` (the flavour's FlexAttention has no CPU backward; SDPA is causal over the whole
sequence, and a sample here is one document), and the RoPE cache is cut to the sequence length (torchtitan's
trainer does the same from ``training.seq_len``). The loss is torchtitan's ``cross_entropy_loss`` (a sum)
divided by the microbatch's tokens.
"""
import dataclasses
import importlib.util
import sys
import types

import torch

import recover

T, B, M, STEPS = 16, 2, 4, 5

if importlib.util.find_spec("triton") is None:  # torchtitan imports its expert-parallel Triton kernels eagerly;
    kernels = types.ModuleType("torchtitan.distributed.minimal_async_ep.kernels")  # a dense Llama never runs them
    for name in ("copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel", "expand_topk_grad_kernel",
                 "fill_combine_metadata_kernel", "fill_dispatch_metadata_kernel", "invert_flat_indices_kernel",
                 "reduce_topk_slots_kernel", "topk_scores_grad_kernel"):
        setattr(kernels, name, None)
    sys.modules[kernels.__name__] = kernels

from torchtitan.components.loss import cross_entropy_loss  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.llama3 import model_registry  # noqa: E402

CONFIG = model_registry("debugmodel").model
for layer in CONFIG.layers:
    layer.attention.inner_attention = ScaledDotProductAttention.Config()
    layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=T)
V = CONFIG.vocab_size


def build(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = CONFIG.build()
    model.to_empty(device=device)
    model.init_states(buffer_device=device)
    return model.train()


def sample(step: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, V, (B, T + 1), generator=torch.Generator().manual_seed(step * 1000 + i))
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return cross_entropy_loss(model(x), y) / y.numel()


def main() -> None:
    rt = recover.init()
    model = build(rt.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=8e-4, weight_decay=0.1)
    job = recover.Job(model, optimizer, samples=sample, microbatches=M, lr=lambda s: 8e-4 * min(1.0, (s + 1) / 2),
                      clip=1.0, tokens_per_microbatch=B * T)
    for step in job.steps(STEPS):
        for mb in step:
            mb.backward(loss_of(model, *mb.batch))
        print(f"step {step.index}: loss {step.loss:.6f}", flush=True)


if __name__ == "__main__":
    main()
