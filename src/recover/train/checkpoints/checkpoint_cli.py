"""``recover sample`` and ``recover export``: a trained checkpoint as text, or as files other tools load."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser(
        "sample", help="generate text from a checkpoint",
        description="Continue --prompt with a trained model. RUN_DIR means its newest intact checkpoint; the "
                    "model config and the tokenizer come from the checkpoint. Prints the prompt and its continuation.",
    )
    s.add_argument("path", metavar="RUN_DIR|CHECKPOINT")
    s.add_argument("--prompt", required=True, help="the text to continue")
    s.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    s.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 is greedy (default 0.8)")
    s.add_argument("--top-k", type=int, default=None, help="draw only among the K most likely tokens")
    s.add_argument("--seed", type=int, default=0, help="seed of the draws (default 0)")
    s.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda or cuda:N")
    s.add_argument("--tokenizer", default=None, metavar="SPEC",
                   help="'byte' or a tokenizer.json, for a checkpoint that does not record its tokenizer")
    s.set_defaults(func=run_sample)

    e = sub.add_parser(
        "export", help="write a checkpoint as a Hugging Face Llama directory or a torch state dict",
        description="--format hf: config.json, model.safetensors and tokenizer files that transformers' "
                    "LlamaForCausalLM and AutoTokenizer load. --format torch: model.pt with the state dict and "
                    "the config. RUN_DIR means its newest intact checkpoint.",
    )
    e.add_argument("path", metavar="RUN_DIR|CHECKPOINT")
    e.add_argument("--format", required=True, choices=("hf", "torch"))
    e.add_argument("--out", required=True, help="directory to write (must be empty or absent)")
    e.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    e.add_argument("--tokenizer", default=None, metavar="SPEC",
                   help="'byte' or a tokenizer.json, for a checkpoint that does not record its tokenizer")
    e.set_defaults(func=run_export)


def run_sample(args: argparse.Namespace) -> int:
    import torch

    from recover.train.checkpoints.sample import check_options, generate, load_checkpoint_model, resolve_device

    check_options(args.max_new_tokens, args.temperature, args.top_k)
    model, desc = load_checkpoint_model(args.path, resolve_device(args.device))
    tok = desc.tokenizer(args.tokenizer)
    prompt = [int(i) for i in tok.encode(args.prompt)]
    generator = torch.Generator().manual_seed(args.seed)
    ids = generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k, generator, tok.eot_id)
    print(f"{desc.checkpoint} (step {desc.step}): {len(prompt)} prompt tokens, {len(ids)} generated",
          file=sys.stderr, flush=True)
    print(tok.decode(prompt + ids), flush=True)
    return 0


def run_export(args: argparse.Namespace) -> int:
    from recover.train.checkpoints.export import export

    ckpt = export(args.path, args.format, args.out, args.overwrite, args.tokenizer)
    print(f"exported {ckpt} as {args.format} to {args.out}", flush=True)
    return 0
