"""Tiny checkpoints for the vLLM tests: transformers' random init (real-scale
weights, seeded), saved as safetensors, so a wrong KV cache changes the tokens.
``make_model``: a Llama (full attention); ``make_hybrid``: hybrid models (a Gemma 3
with sliding-window layers, a Nemotron-H with Mamba2 layers)."""

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


def _mamba_state_carries_the_context(model):
    """transformers' init gives a Mamba2 layer small inputs (convolution weights
    of std 0.02), short steps (~0.01) and a skip term (``D`` = 1) that passes the
    current token through, so zeroing its state moves the log-probabilities by
    ~2e-3 and changes no greedy token. Here each Mamba layer's output is its
    state alone (``D`` = 0), its inputs are larger (the causal convolution's
    weights x25), each token is written with a step of 0.5 and the state decays
    slowly (``A`` = -0.002: it holds the whole prompt), so a wrong state changes
    the tokens."""
    import math

    import torch

    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "A_log") and hasattr(m, "D") and hasattr(m, "dt_bias"):
                m.A_log.fill_(math.log(0.002))
                m.D.zero_()
                m.dt_bias.fill_(math.log(math.expm1(0.5)))  # softplus(dt_bias) = 0.5
                m.conv1d.weight.mul_(25.0)


#: ``make_hybrid`` kinds: (transformers config class, model class, config fields,
#: a change of the random weights or None).
HYBRID = {
    # Gemma 3 text: sliding-window layers (window 128 tokens) beside one
    # full-attention layer.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        query_pre_attn_scalar=64,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        num_hidden_layers=4,
        sliding_window=128,
        max_position_embeddings=4096,
        architectures=["Gemma3ForCausalLM"],
    ), None),
    # Nemotron-H: Mamba2 layers (transformers calls them "linear_attention") beside
    # one attention layer and MLP layers.
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        layers_block_type=["linear_attention", "mlp", "full_attention", "mlp", "linear_attention", "mlp"],
        mamba_num_heads=8,
        mamba_head_dim=32,
        n_groups=1,
        # small enough that a float32 state page fits in the 32-token attention
        # page: vLLM pads every state dtype's page to it, the block size stays 32
        ssm_state_size=16,
        conv_kernel=4,
        chunk_size=64,
        max_position_embeddings=4096,
        architectures=["NemotronHForCausalLM"],
    ), _mamba_state_carries_the_context),
}


def make_hybrid(path, kind, seed=0, **overrides):
    """A tiny hybrid checkpoint of ``kind`` (a key of ``HYBRID``) in ``path``,
    seeded random weights in float32, saved as safetensors; ``overrides`` replace
    config fields."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    import transformers

    config_cls, model_cls, fields, tune = HYBRID[kind]
    cfg = dict(fields, torch_dtype="float32")
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**cfg))
    model = model.to(torch.float32)
    if tune is not None:
        tune(model)
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
    print(make_hybrid(sys.argv[1], sys.argv[2]) if len(sys.argv) > 2 else make_model(sys.argv[1]))
