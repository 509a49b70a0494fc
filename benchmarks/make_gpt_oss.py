#!/usr/bin/env python3
"""A GPT-OSS checkpoint scaled to this 2-core CPU, for benchmarks/gpt_oss.sh: gpt-oss-20b's layer (64-wide heads,
8 query heads to a KV head, sinks, q/k/v/o biases, alternate 128-token windows, untruncated YaRN; 32 experts, top 4,
biases, the clamped SwiGLU) at width 640 and 12 layers (~0.5 B parameters, ~0.1 B active), random bfloat16 weights
(seed 0), with the shared model's tokenizer (its vocabulary of 49152), so that the shared workload's prompts
(random token ids) run on it.

  python benchmarks/make_gpt_oss.py MODELS_DIR   # writes MODELS_DIR/gpt-oss-mini from MODELS_DIR/llama-135m

and `gpt-oss-mini-mxfp4`, the same with its experts in MXFP4 as the hub ships gpt-oss (`_blocks` and `_scales`, a
power-of-two scale per 32 inputs, the smallest that keeps the block's largest value within float4 e2m1's 6, each
value rounded to the nearest e2m1 one).
"""

import json
import shutil
from pathlib import Path

from scaled_checkpoint import save_random, target  # before transformers (see there)

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)  # float4 e2m1's magnitudes, by code


def mxfp4(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(blocks uint8 [..., out, in / 32, 16], scales uint8 [..., out, in / 32]) of a [..., in, out] weight."""
    w = np.swapaxes(weight, -1, -2)
    groups = w.reshape(*w.shape[:-1], -1, 32)
    exponent = np.ceil(np.log2(np.maximum(np.abs(groups).max(-1), 2.0 ** -126) / 6.0)).astype(np.int32)
    exponent = np.clip(exponent, -127, 127)
    scaled = groups / np.ldexp(np.float32(1.0), exponent)[..., None]
    codes = np.abs(np.abs(scaled)[..., None] - E2M1).argmin(-1).astype(np.uint8) | (scaled < 0).astype(np.uint8) << 3
    return (np.ascontiguousarray(codes[..., 0::2] | codes[..., 1::2] << 4, np.uint8),
            np.ascontiguousarray(exponent + 127, np.uint8))


def write_mxfp4(source: Path, out: Path) -> None:
    out.mkdir(exist_ok=True)
    for f in source.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    tensors = {}
    for name, value in load_file(source / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4(value.float().numpy())
            tensors[name + "_blocks"], tensors[name + "_scales"] = torch.from_numpy(blocks), torch.from_numpy(scales)
        else:
            tensors[name] = value
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config, indent=2))


def _spread(name: str, p) -> float | None:
    """Biases and sinks spread; the experts' weights ([experts, in, out]) fan-in scaled by their middle axis."""
    if "norm" in name:
        return None
    if name.endswith(("bias", "sinks")):
        return 0.1
    return p.shape[-2] ** -0.5 if name.endswith(("experts.down_proj", "experts.gate_up_proj")) else None


def main() -> None:
    models, out, tokenizer, token_fields = target("gpt-oss-mini")
    config = transformers.GptOssConfig(
        **token_fields, hidden_size=640, intermediate_size=640, num_hidden_layers=12, head_dim=64,
        num_attention_heads=16, num_key_value_heads=2, num_local_experts=32, num_experts_per_tok=4,
        sliding_window=128, max_position_embeddings=4096, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                             truncate=False, original_max_position_embeddings=4096))
    save_random(transformers.GptOssForCausalLM, config, out, tokenizer, _spread)
    write_mxfp4(out, models / "gpt-oss-mini-mxfp4")
    print(out)


if __name__ == "__main__":
    main()
