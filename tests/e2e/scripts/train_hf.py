"""A Hugging Face causal LM, built from a config with random weights, trained by a user loop on recover.api.

    python train_hf.py ARCH        # ARCH: llama, qwen2 or gpt2 (gpt2 has dropout: each microbatch's RNG
                                   # is seeded from (seed, step, id), so it follows the sample)
"""
import sys

import torch
import transformers as tf

import recover

V, T, B, M, STEPS = 128, 16, 2, 6, 8
SMALL = {"vocab_size": V, "max_position_embeddings": 64}
CONFIGS = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                                   "num_attention_heads": 4, "num_key_value_heads": 2}),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                                   "num_attention_heads": 4, "num_key_value_heads": 2}),
    "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel, {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64,
                                                 "bos_token_id": 0, "eos_token_id": 0}),
}


def sample(step: int, i: int) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(step * 1000 + i))


config_class, model_class, shape = CONFIGS[sys.argv[1]]
rt = recover.init()
torch.manual_seed(0)
model = model_class(config_class(**SMALL, **shape)).to(rt.device).train()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
job = recover.Job(model, optimizer, samples=sample, microbatches=M, clip=1.0, tokens_per_microbatch=B * T)
for step in job.steps(STEPS):
    for mb in step:
        mb.backward(model(input_ids=mb.batch, labels=mb.batch).loss)
