"""Quantized checkpoints: compressed-tensors' W8A8 int8 (vLLM's `compressed-tensors` method, as llm-compressor
writes it and vLLM's CPU, GPU and TPU builds serve it).

Every decoder layer's linear projection (q/k/v/o, gate/up/down) holds int8 weights, symmetric, with a float scale
per output channel (or one per tensor); its input is quantized per token as the step runs: scale = max|x| / 127,
x_q = round(x / scale) (half to even), and the product is (x_q @ w_q) in int32 times both scales. The embedding,
the norms and the output head stay in the checkpoint's float dtype (llm-compressor leaves `lm_head` out).
Other methods (AWQ, GPTQ, FP8, ...) and other compressed-tensors schemes are refused by name.

`write_w8a8_checkpoint` writes such a checkpoint from a float one (round-to-nearest, a scale per output channel:
no calibration data), for tests, benchmarks and users without llm-compressor.
"""

import json
import shutil
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

W8A8_INT8 = "w8a8_int8"  # ModelConfig.quantization's value for the one scheme served
QUANTIZED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_HEAD = ("lm_head", "re:.*lm_head")  # how llm-compressor names the output head it leaves out


class Int8Weight(NamedTuple):
    """A quantized projection as the layer's matmul takes it: int8 [in, out] and its float32 scales [out], or
    packed for the native CPU kernel (`comp` given: pallas_kernels.cpu.pack_int8's three arrays)."""
    weight: jax.Array
    scale: jax.Array
    comp: jax.Array | None = None


def parse_quantization(hf: dict) -> str | None:
    """`W8A8_INT8` for a compressed-tensors W8A8 int8 checkpoint's config.json, None for an unquantized one; a
    ValueError naming the field for any other quantization."""
    q = hf.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method != "compressed-tensors":
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported; supported: compressed-tensors "
                         f"(W8A8 int8: int8 weights with per-channel or per-tensor scales, dynamic per-token int8 "
                         f"activations)")
    if q.get("format") != "int-quantized":
        raise ValueError(f"quantization_config.format {q.get('format')!r} is not supported; supported: int-quantized "
                         f"(W8A8 int8)")
    if q.get("quantization_status", "compressed") != "compressed":
        raise ValueError(f"quantization_config.quantization_status {q.get('quantization_status')!r} is not supported; "
                         f"supported: compressed")
    for field in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if q.get(field):
            raise ValueError(f"quantization_config.{field} is not supported")
    groups = q.get("config_groups") or {}
    if not groups:
        raise ValueError("quantization_config.config_groups is empty")
    for name, group in groups.items():
        where = f"quantization_config.config_groups.{name}"
        targets = group.get("targets") or []
        if list(targets) != ["Linear"]:
            raise ValueError(f"{where}.targets {targets!r} is not supported; supported: ['Linear'] (every linear "
                             f"projection)")
        _check_args(group.get("weights"), f"{where}.weights", strategies=("channel", "tensor"), dynamic=False)
        _check_args(group.get("input_activations"), f"{where}.input_activations", strategies=("token",),
                    dynamic=True)
        if group.get("output_activations"):
            raise ValueError(f"{where}.output_activations is not supported")
    ignored = [name for name in q.get("ignore") or [] if name not in _HEAD]
    if ignored:
        raise ValueError(f"quantization_config.ignore {ignored!r} is not supported: only the output head (lm_head) may "
                         f"stay unquantized")
    return W8A8_INT8


def _check_args(args: dict | None, where: str, *, strategies: tuple[str, ...], dynamic: bool) -> None:
    if not args:
        raise ValueError(f"{where} is missing: W8A8 int8 quantizes both weights and input activations")
    expected = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": dynamic}
    for field, value in expected.items():
        if args.get(field, value if field == "type" else None) != value:
            raise ValueError(f"{where}.{field}={args.get(field)!r} is not supported (W8A8 int8 takes {value!r})")
    if args.get("strategy") not in strategies:
        raise ValueError(f"{where}.strategy={args.get('strategy')!r} is not supported; supported: "
                         f"{', '.join(strategies)}")
    for field in ("group_size", "block_structure", "actorder"):
        if args.get(field):
            raise ValueError(f"{where}.{field}={args[field]!r} is not supported")


def output_widths(cfg) -> dict[str, int]:
    """Each quantized projection's output width in the checkpoint (Phi-3's fused ones included)."""
    q, kv, I = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": cfg.hidden_size, "gate_proj": I, "up_proj": I,
            "down_proj": cfg.hidden_size, "qkv_proj": q + 2 * kv, "gate_up_proj": 2 * I}


def with_scales(split_tensor, cfg):
    """`split_tensor` after a quantized projection's `weight_scale` ([out, 1], or [1] / [] per tensor) becomes a
    float32 vector [out] (a per-tensor scale repeated), as the split and the weight map take it."""
    if cfg.quantization is None:
        return split_tensor
    widths = output_widths(cfg)

    def split(name, array, cfg):
        if name.endswith(".weight_scale"):
            projection = name.rsplit(".", 2)[-2]
            if projection not in widths:
                raise ValueError(f"tensor {name}: a quantized {projection} is not supported (only the decoder layers' "
                                 f"{', '.join(QUANTIZED_LINEARS)})")
            scale = np.asarray(array, np.float32).reshape(-1)
            width = widths[projection]
            if scale.size == 1:
                scale = np.full(width, scale[0], np.float32)
            elif scale.size != width:
                raise ValueError(f"tensor {name} has {scale.size} scales, expected {width} (one per output channel) "
                                 f"or 1")
            array = scale
        elif name.endswith((".input_scale", ".input_zero_point", ".weight_zero_point")):
            raise ValueError(f"tensor {name}: static or asymmetric quantization is not supported")
        return split_tensor(name, array, cfg)

    return split


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [T, K] -> (int8 [T, K], float32 [T, 1]): each row's symmetric int8 quantization, scale max|x| / 127 (a zero
    row: scale 0, all zeros)."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127.0
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(x / safe), -128, 127).astype(jnp.int8)
    return q, scale


def int8_matmul(x: jax.Array, w: Int8Weight) -> jax.Array:
    """x [T, in] @ the quantized w -> float32 [T, out]: x quantized per row, an int8 x int8 dot into int32, scaled."""
    xq, x_scale = quantize_rows(x)
    acc = jax.lax.dot_general(xq, w.weight, (((xq.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
    return acc.astype(jnp.float32) * x_scale * w.scale


def quantize_weight(w: np.ndarray, strategy: str = "channel") -> tuple[np.ndarray, np.ndarray]:
    """A float weight [out, in] (Hugging Face's layout) -> (int8 [out, in], float32 scales [out, 1], or [1] for the
    "tensor" strategy): symmetric, round to nearest (half to even)."""
    w = np.asarray(w, np.float32)
    scale = np.abs(w).max(axis=1 if strategy == "channel" else None, keepdims=True) / 127.0
    q = np.clip(np.rint(w / np.where(scale > 0, scale, 1.0)), -128, 127).astype(np.int8)
    return q, (scale if strategy == "channel" else scale.reshape(1)).astype(np.float32)


def compressed_tensors_config(strategy: str = "channel") -> dict:
    """The `quantization_config` of a W8A8 int8 checkpoint (llm-compressor's for its W8A8 scheme), its weights'
    scales per output channel or per tensor (`strategy`)."""
    args = dict(num_bits=8, type="int", symmetric=True, group_size=None, block_structure=None, actorder=None,
                observer=None, observer_kwargs={})
    return {
        "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"], "output_activations": None,
            "weights": args | {"strategy": strategy, "dynamic": False, "observer": "minmax"},
            "input_activations": args | {"strategy": "token", "dynamic": True}}},
        "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {},
    }


def write_w8a8_checkpoint(source: str | Path, output: str | Path, strategy: str = "channel") -> Path:
    """Writes `source` (a float Hugging Face checkpoint directory of a dense model) as a compressed-tensors W8A8
    int8 checkpoint in `output`: every decoder layer's linear projection weight quantized (round to nearest) with
    a scale per output channel (or per tensor: `strategy`), its `weight_scale` beside it; every other tensor and
    file as it was."""
    if strategy not in ("channel", "tensor"):
        raise ValueError(f"strategy must be 'channel' or 'tensor', got {strategy!r}")
    import torch  # the torch reader and writer keep bfloat16 tensors as they are
    from safetensors.torch import load_file, save_file

    source, output = Path(source), Path(output)
    config = json.loads((source / "config.json").read_text())
    if config.get("quantization_config"):
        raise ValueError(f"{source} is already quantized")
    output.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in ("config.json",
                                                                                 "model.safetensors.index.json"):
            shutil.copy2(path, output / path.name)
    index = {}
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{source} holds no .safetensors files")
    for file in files:
        tensors = load_file(file)
        out = {}
        for name, tensor in tensors.items():
            projection = name.rsplit(".", 2)[-2] if name.endswith(".weight") else None
            if ".layers." in name and projection in QUANTIZED_LINEARS + ("qkv_proj", "gate_up_proj"):
                if ".experts." in name:
                    raise ValueError("a mixture of experts' quantization is not supported")
                q, scale = quantize_weight(tensor.float().numpy(), strategy)
                out[name] = torch.from_numpy(q)
                out[name + "_scale"] = torch.from_numpy(scale).to(tensor.dtype)
            else:
                out[name] = tensor
        save_file(out, output / file.name, metadata={"format": "pt"})
        index |= {name: file.name for name in out}
    if len(files) > 1:
        (output / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index},
                                                                         indent=2))
    config["quantization_config"] = compressed_tensors_config(strategy)
    (output / "config.json").write_text(json.dumps(config, indent=2))
    return output
