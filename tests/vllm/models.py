"""Tiny Llama checkpoints for the vLLM tests: transformers' random init (real-scale
weights, seeded), saved as safetensors, so a wrong KV cache changes the tokens."""

import os
import sys


def make_model(path, seed=0, **overrides):
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        architectures=["LlamaForCausalLM"],
        torch_dtype="float32",
    )
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_config_only(path, **overrides):
    """A directory with only config.json (for load_format="dummy")."""
    from transformers import LlamaConfig

    cfg = dict(architectures=["LlamaForCausalLM"], torch_dtype="float32")
    cfg.update(overrides)
    os.makedirs(path, exist_ok=True)
    LlamaConfig(**cfg).save_pretrained(path)
    return path


if __name__ == "__main__":
    print(make_model(sys.argv[1]))
