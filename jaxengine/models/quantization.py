"""Quantized checkpoints in compressed-tensors' format (vLLM's `compressed-tensors` method, as llm-compressor writes
it and vLLM's CPU, GPU and TPU builds serve it), two schemes:

- W8A8 int8 (`format: int-quantized`): every decoder layer's linear projection (q/k/v/o, gate/up/down) holds int8
  weights, symmetric, with a float scale per output channel (or one per tensor); its input is quantized per token
  as the step runs: scale = max|x| / 127, x_q = round(x / scale) (half to even), and the product is (x_q @ w_q) in
  int32 times both scales (`int8_matmul`; the native CPU kernel: pallas_kernels/cpu_int8.cc).
- W4A16 (`format: pack-quantized`): the projections' weights symmetric int4 (eight to an int32 word in the
  checkpoint) with a float scale per group of `group_size` inputs (or per output channel), activations in float:
  the weight is dequantized (value times its group's scale) and multiplied as a float one (`Int4Weight`; on CPU the
  native bfloat16 matmul dequantizes it panel by panel).

The embedding, the norms and the output head stay in the checkpoint's float dtype (llm-compressor leaves `lm_head`
out). Other methods (AWQ, GPTQ, FP8, ...) and other compressed-tensors schemes are refused by field.

`write_w8a8_checkpoint` and `write_w4a16_checkpoint` write such checkpoints from a float one (round to nearest, no
calibration data), for tests, benchmarks and users without llm-compressor (`jaxengine quantize`).
"""

import json
import shutil
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

W8A8_INT8 = "w8a8_int8"  # ModelConfig.quantization's values: the schemes served
W4A16 = "w4a16"
QUANTIZED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_HEAD = ("lm_head", "re:.*lm_head")  # how llm-compressor names the output head it leaves out


class Int8Weight(NamedTuple):
    """A quantized projection as the layer's matmul takes it: int8 [in, out] and its float32 scales [out], or
    packed for the native CPU kernel (`comp` given: pallas_kernels.cpu.pack_int8's three arrays)."""
    weight: jax.Array
    scale: jax.Array
    comp: jax.Array | None = None


def parse_quantization(hf: dict) -> tuple[str, int, str] | None:
    """(scheme, group size, method) of a quantized checkpoint's config.json: compressed-tensors' (`W8A8_INT8`, 0) or
    (`W4A16`, the weights' group along the input, 0 for one group per output channel), or GPTQ's symmetric 4-bit
    (`W4A16`, its group); None for an unquantized checkpoint; a ValueError naming the field for any other
    quantization."""
    q = hf.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method == "gptq":
        return W4A16, _gptq_group(q), "gptq"
    if method != "compressed-tensors":
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported; supported: compressed-tensors "
                         f"(W8A8 int8: int8 weights with per-channel or per-tensor scales, dynamic per-token int8 "
                         f"activations; W4A16: symmetric int4 weights in groups or per channel), gptq (4-bit, "
                         f"symmetric, without activation order)")
    formats = {"int-quantized": W8A8_INT8, "pack-quantized": W4A16}
    if q.get("format") not in formats:
        raise ValueError(f"quantization_config.format {q.get('format')!r} is not supported; supported: int-quantized "
                         f"(W8A8 int8), pack-quantized (W4A16)")
    scheme = formats[q["format"]]
    if q.get("quantization_status", "compressed") != "compressed":
        raise ValueError(f"quantization_config.quantization_status {q.get('quantization_status')!r} is not supported; "
                         f"supported: compressed")
    for field in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if q.get(field):
            raise ValueError(f"quantization_config.{field} is not supported")
    groups = q.get("config_groups") or {}
    if not groups:
        raise ValueError("quantization_config.config_groups is empty")
    group_sizes = set()
    for name, group in groups.items():
        where = f"quantization_config.config_groups.{name}"
        targets = group.get("targets") or []
        if list(targets) != ["Linear"]:
            raise ValueError(f"{where}.targets {targets!r} is not supported; supported: ['Linear'] (every linear "
                             f"projection)")
        if scheme == W8A8_INT8:
            _check_args(group.get("weights"), f"{where}.weights", scheme, bits=8, strategies=("channel", "tensor"))
            _check_args(group.get("input_activations"), f"{where}.input_activations", scheme, bits=8,
                        strategies=("token",), dynamic=True)
            group_sizes.add(0)
        else:
            weights = group.get("weights")
            _check_args(weights, f"{where}.weights", scheme, bits=4, strategies=("group", "channel"))
            if group.get("input_activations"):
                raise ValueError(f"{where}.input_activations is not supported with pack-quantized weights (W4A16 "
                                 f"keeps its activations in float)")
            size = weights.get("group_size") if weights["strategy"] == "group" else 0
            if weights["strategy"] == "group" and not (isinstance(size, int) and size > 0):
                raise ValueError(f"{where}.weights.group_size={size!r}: the group strategy needs a positive size")
            group_sizes.add(size)
        if group.get("output_activations"):
            raise ValueError(f"{where}.output_activations is not supported")
    if len(group_sizes) > 1:
        raise ValueError(f"quantization_config.config_groups: groups of different sizes {sorted(group_sizes)} are not "
                         f"supported")
    ignored = [name for name in q.get("ignore") or [] if name not in _HEAD]
    if ignored:
        raise ValueError(f"quantization_config.ignore {ignored!r} is not supported: only the output head (lm_head) may "
                         f"stay unquantized")
    return scheme, group_sizes.pop(), "compressed-tensors"


def _gptq_group(q: dict) -> int:
    """A GPTQ config's group size (0: one group per output channel), once its other fields are ones served:
    4 bits, symmetric, no activation order, the output head unquantized."""
    expected = {"bits": 4, "sym": True, "desc_act": False, "lm_head": False}
    for field, value in expected.items():
        if q.get(field, value if field in ("desc_act", "lm_head") else None) != value:
            raise ValueError(f"quantization_config.{field}={q.get(field)!r} is not supported (gptq takes {value!r})")
    if q.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
        raise ValueError(f"quantization_config.checkpoint_format={q['checkpoint_format']!r} is not supported; "
                         f"supported: gptq, gptq_v2")
    for field in ("dynamic", "modules_in_block_to_quantize"):
        if q.get(field):
            raise ValueError(f"quantization_config.{field} (some modules quantized otherwise) is not supported")
    group = q.get("group_size", 128)
    if group != -1 and not (isinstance(group, int) and group > 0):
        raise ValueError(f"quantization_config.group_size={group!r} must be positive or -1 (per channel)")
    return 0 if group == -1 else group


def _check_args(args: dict | None, where: str, scheme: str, *, bits: int, strategies: tuple[str, ...],
                dynamic: bool = False) -> None:
    if not args:
        raise ValueError(f"{where} is missing: {scheme} quantizes them")
    expected = {"num_bits": bits, "type": "int", "symmetric": True, "dynamic": dynamic}
    for field, value in expected.items():
        if args.get(field, value if field == "type" else None) != value:
            raise ValueError(f"{where}.{field}={args.get(field)!r} is not supported ({scheme} takes {value!r})")
    if args.get("strategy") not in strategies:
        raise ValueError(f"{where}.strategy={args.get('strategy')!r} is not supported; supported: "
                         f"{', '.join(strategies)}")
    if args.get("group_size") and args.get("strategy") != "group":
        raise ValueError(f"{where}.group_size={args['group_size']!r} is not supported with strategy "
                         f"{args.get('strategy')!r}")
    if args.get("block_structure"):
        raise ValueError(f"{where}.block_structure={args['block_structure']!r} is not supported")
    if args.get("actorder") not in (None, "static"):  # "group" and "weight" reorder the input (a g_idx tensor)
        raise ValueError(f"{where}.actorder={args['actorder']!r} is not supported (only None or 'static')")


def projection_shapes(cfg) -> dict[str, tuple[int, int]]:
    """Each quantized projection's (output, input) widths in the checkpoint (Phi-3's fused ones included)."""
    q, kv, I, D = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size, cfg.hidden_size
    return {"q_proj": (q, D), "k_proj": (kv, D), "v_proj": (kv, D), "o_proj": (D, q), "gate_proj": (I, D),
            "up_proj": (I, D), "down_proj": (D, I), "qkv_proj": (q + 2 * kv, D), "gate_up_proj": (2 * I, D)}


def scale_groups(cfg, width: int) -> int:
    """How many groups of scales a W4A16 projection of `width` inputs has (one per output channel: 1)."""
    return width // cfg.quant_group_size if cfg.quant_group_size else 1


def check_group_size(cfg) -> None:
    """A W4A16 checkpoint's group size must divide every quantized projection's input width."""
    size = cfg.quant_group_size
    for name, (_, width) in projection_shapes(cfg).items():
        if size and width % size:
            raise ValueError(f"quantization_config group_size={size} does not divide {name}'s input width {width}")


def unpack_int4(packed, width: int) -> np.ndarray:
    """compressed-tensors' pack-quantized int4 weights, int32 [out, ceil(in / 8)] (each word 8 values offset by 8,
    the first in its low bits), -> int8 [out, in] in [-8, 7]."""
    words = np.asarray(packed).astype(np.uint32)
    nibbles = (words[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF
    return (nibbles.reshape(*words.shape[:-1], -1)[..., :width].astype(np.int16) - 8).astype(np.int8)


def pack_int4(values: np.ndarray) -> np.ndarray:
    """unpack_int4's inverse: int8 [out, in] in [-8, 7] -> int32 [out, ceil(in / 8)]."""
    values = np.asarray(values, np.int16) + 8
    padded = np.pad(values, [(0, 0)] * (values.ndim - 1) + [(0, -values.shape[-1] % 8)]).astype(np.uint32)
    words = (padded.reshape(*padded.shape[:-1], -1, 8) << (4 * np.arange(8, dtype=np.uint32))).sum(-1)
    return words.astype(np.uint32).view(np.int32)


def with_quantized(split_tensor, cfg):
    """`split_tensor` after a quantized checkpoint's tensors become what the split and the weight map take: W8A8's
    `weight_scale` ([out, 1], or [1] / [] per tensor) a float32 vector [out] (a per-tensor scale repeated);
    W4A16's `weight_packed` the int8 `weight` [out, in] it holds, its `weight_scale` [out, in / group] checked,
    its `weight_shape` dropped once checked."""
    if cfg.quantization is None:
        return split_tensor
    shapes = projection_shapes(cfg)

    def projection(name):
        part = name.rsplit(".", 2)[-2]
        if part not in shapes:
            raise ValueError(f"tensor {name}: a quantized {part} is not supported (only the decoder layers' "
                             f"{', '.join(QUANTIZED_LINEARS)})")
        return shapes[part]

    def split(name, array, cfg):
        if cfg.quant_method == "gptq":
            name, array = gptq_tensor(name, array)
            if name is None:
                return []
        if name.endswith((".input_scale", ".input_zero_point", ".weight_zero_point", ".weight_g_idx")):
            raise ValueError(f"tensor {name}: static, asymmetric or reordered quantization is not supported")
        if cfg.quantization == W8A8_INT8 and name.endswith(".weight_scale"):
            width = projection(name)[0]
            scale = np.asarray(array, np.float32).reshape(-1)
            if scale.size == 1:
                scale = np.full(width, scale[0], np.float32)
            elif scale.size != width:
                raise ValueError(f"tensor {name} has {scale.size} scales, expected {width} (one per output channel) "
                                 f"or 1")
            array = scale
        elif cfg.quantization == W4A16 and name.endswith(".weight_shape"):
            if [int(v) for v in np.asarray(array).reshape(-1)] != list(projection(name)):
                raise ValueError(f"tensor {name} is {np.asarray(array).tolist()}, expected {list(projection(name))}")
            return []
        elif cfg.quantization == W4A16 and name.endswith(".weight_packed"):
            out, width = projection(name)
            if tuple(array.shape) != (out, -(-width // 8)):
                raise ValueError(f"tensor {name} has shape {tuple(array.shape)}, expected {(out, -(-width // 8))}")
            name, array = name[: -len("_packed")], unpack_int4(array, width)
        elif cfg.quantization == W4A16 and name.endswith(".weight_scale"):
            out, width = projection(name)
            groups = scale_groups(cfg, width)
            if tuple(array.shape) != (out, groups):
                raise ValueError(f"tensor {name} has shape {tuple(array.shape)}, expected {(out, groups)}")
        return split_tensor(name, array, cfg)

    def gptq_tensor(name, array):
        """A GPTQ tensor as compressed-tensors names and lays it out (qweight [in / 8, out] -> int8 weight [out,
        in]; scales [groups, out] -> weight_scale [out, groups]), or (None, None) for one checked and dropped:
        qzeros (the symmetric zero point, 8: stored 7 by the gptq format, 8 by gptq_v2) and g_idx (no activation
        order: each input's group in turn)."""
        stem, _, kind = name.rpartition(".")
        if kind not in ("qweight", "scales", "qzeros", "g_idx"):
            return name, array
        out, width = projection(name)
        groups = scale_groups(cfg, width)
        array = np.asarray(array)
        shapes = {"qweight": (-(-width // 8), out), "scales": (groups, out), "qzeros": (groups, -(-out // 8)),
                  "g_idx": (width,)}
        if array.shape != shapes[kind]:
            raise ValueError(f"tensor {name} has shape {array.shape}, expected {shapes[kind]}")
        if kind == "qweight":
            return stem + ".weight", unpack_int4(array.T, width)
        if kind == "scales":
            return stem + ".weight_scale", array.T
        if kind == "qzeros":
            zeros = unpack_int4(array, out).astype(np.int16) + 8
            if not (np.all(zeros == 7) or np.all(zeros == 8)):
                raise ValueError(f"tensor {name}: asymmetric zero points are not supported (sym=true checkpoints "
                                 f"store 7, or 8 in gptq_v2)")
        elif not np.array_equal(array, np.arange(width) // (cfg.quant_group_size or width)):
            raise ValueError(f"tensor {name}: a g_idx reordering the inputs (activation order) is not supported")
        return None, None

    return split


class Int4Weight(NamedTuple):
    """A W4A16 projection as the layer's matmul takes it: int4 values in int8 [in, out] and their scales [groups,
    out] (in the checkpoint's float dtype), each group of in / groups consecutive inputs sharing one."""
    weight: jax.Array
    scale: jax.Array

    def dequantized(self) -> jax.Array:
        """The float weight [in, out] in the scales' dtype: value * its group's scale, as vLLM's kernels dequantize."""
        *lead, width, out = self.weight.shape
        groups = self.scale.shape[-2]
        values = self.weight.astype(self.scale.dtype).reshape(*lead, groups, width // groups, out)
        return (values * self.scale[..., :, None, :]).reshape(*lead, width, out)


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


def compressed_tensors_config(strategy: str = "channel", scheme: str = W8A8_INT8, group_size: int = 128) -> dict:
    """The `quantization_config` llm-compressor writes for W8A8 int8 (its weights' scales per output channel or
    per tensor: `strategy`) or W4A16 (symmetric int4 weights in groups of `group_size` inputs, or per channel)."""
    args = dict(num_bits=8, type="int", symmetric=True, group_size=None, block_structure=None, actorder=None,
                observer=None, observer_kwargs={})
    if scheme == W8A8_INT8:
        group = {"weights": args | {"strategy": strategy, "dynamic": False, "observer": "minmax"},
                 "input_activations": args | {"strategy": "token", "dynamic": True}}
    else:
        group = {"weights": args | {"num_bits": 4, "strategy": strategy, "dynamic": False, "observer": "minmax",
                                    "group_size": group_size if strategy == "group" else None},
                 "input_activations": None}
    return {
        "quant_method": "compressed-tensors", "format": "int-quantized" if scheme == W8A8_INT8 else "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "output_activations": None} | group},
        "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {},
    }


def quantize_int4(w: np.ndarray, group_size: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A float weight [out, in] -> (int8 values in [-8, 7] [out, in], float32 scales [out, in / group_size], one
    group per row where group_size is 0): symmetric, scale max|w| / 7.5 (llm-compressor's), round to nearest."""
    w = np.asarray(w, np.float32)
    out, width = w.shape
    size = group_size or width
    if width % size:
        raise ValueError(f"group_size {group_size} does not divide the input width {width}")
    groups = w.reshape(out, width // size, size)
    scale = np.abs(groups).max(axis=-1, keepdims=True) / 7.5
    q = np.clip(np.rint(groups / np.where(scale > 0, scale, 1.0)), -8, 7).astype(np.int8)
    return q.reshape(out, width), scale[..., 0]


def write_w8a8_checkpoint(source: str | Path, output: str | Path, strategy: str = "channel") -> Path:
    """Writes `source` (a float Hugging Face checkpoint directory of a dense model) as a compressed-tensors W8A8
    int8 checkpoint in `output`: every decoder layer's linear projection weight quantized (round to nearest) with
    a scale per output channel (or per tensor: `strategy`), its `weight_scale` beside it; every other tensor and
    file as it was."""
    if strategy not in ("channel", "tensor"):
        raise ValueError(f"strategy must be 'channel' or 'tensor', got {strategy!r}")

    def convert(name, weight):
        q, scale = quantize_weight(weight, strategy)
        return {name: q, name + "_scale": scale}

    return _write_quantized(source, output, convert, compressed_tensors_config(strategy))


def write_w4a16_checkpoint(source: str | Path, output: str | Path, group_size: int = 128) -> Path:
    """Writes `source` (a float Hugging Face checkpoint directory of a dense model) as a compressed-tensors W4A16
    checkpoint (pack-quantized) in `output`: every decoder layer's linear projection weight quantized to symmetric
    int4 (round to nearest) in groups of `group_size` inputs (0: one group per output channel), stored as
    llm-compressor stores it (`weight_packed`, `weight_scale`, `weight_shape`); every other tensor and file as it
    was."""
    if not isinstance(group_size, int) or group_size < 0:
        raise ValueError(f"group_size must be a non-negative integer, got {group_size!r}")

    def convert(name, weight):
        q, scale = quantize_int4(weight, group_size)
        return {name + "_packed": pack_int4(q), name + "_scale": scale,
                name + "_shape": np.asarray(weight.shape, np.int64)}

    return _write_quantized(source, output, convert,
                            compressed_tensors_config("group" if group_size else "channel", W4A16, group_size))


def write_gptq_checkpoint(source: str | Path, output: str | Path, group_size: int = 128) -> Path:
    """Writes `source` (a float Hugging Face checkpoint directory of a dense model) as a GPTQ checkpoint (4-bit,
    symmetric, no activation order, the `gptq` format) in `output`, each projection's int4 values and scales as
    `write_w4a16_checkpoint` computes them (round to nearest, no calibration: not GPTQ's error-correcting
    algorithm): `qweight`, `qzeros` (7: the zero point 8, stored minus one), float16 `scales`, `g_idx`."""
    if not isinstance(group_size, int) or group_size < 0:
        raise ValueError(f"group_size must be a non-negative integer, got {group_size!r}")

    def convert(name, weight):
        q, scale = quantize_int4(weight, group_size)
        out, width = q.shape
        stem = name.removesuffix(".weight")
        groups = scale.shape[1]
        return {stem + ".qweight": np.ascontiguousarray(pack_int4(q).T),
                stem + ".qzeros": pack_int4(np.full((groups, out), -1, np.int8)),
                stem + ".scales": np.ascontiguousarray(scale.T).astype(np.float16),
                stem + ".g_idx": (np.arange(width) // (group_size or width)).astype(np.int32)}

    config = {"quant_method": "gptq", "bits": 4, "group_size": group_size or -1, "desc_act": False, "sym": True,
              "checkpoint_format": "gptq", "damp_percent": 0.01, "true_sequential": True}
    return _write_quantized(source, output, convert, config)


def _write_quantized(source, output, convert, quantization_config: dict) -> Path:
    """Copies `source` to `output` with each decoder layer projection's weight replaced by `convert(name, float32
    weight [out, in])`'s tensors (float32 ones in the weight's dtype) and `quantization_config` in config.json."""
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
                for key, value in convert(name, tensor.float().numpy()).items():
                    value = torch.from_numpy(value)  # float32 ones in the weight's dtype (others as they are)
                    out[key] = value.to(tensor.dtype) if value.dtype == torch.float32 else value
            else:
                out[name] = tensor
        save_file(out, output / file.name, metadata={"format": "pt"})
        index |= {name: file.name for name in out}
    if len(files) > 1:
        (output / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index},
                                                                         indent=2))
    config["quantization_config"] = quantization_config
    (output / "config.json").write_text(json.dumps(config, indent=2))
    return output
