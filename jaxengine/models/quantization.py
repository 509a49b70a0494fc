"""Quantized checkpoints, as vLLM's CPU, GPU and TPU builds serve them:

- compressed-tensors (vLLM's `compressed-tensors` method, as llm-compressor writes it), three schemes:
  - W8A8 int8 (`format: int-quantized`): every decoder layer's linear projection (q/k/v/o, gate/up/down) holds int8
    weights, symmetric, with a float scale per output channel (or one per tensor); its input is quantized per
    token as the step runs: scale = max|x| / 127, x_q = round(x / scale) (half to even), and the product is
    (x_q @ w_q) in int32 times both scales (`int8_matmul`; the native CPU kernel: pallas_kernels/cpu_int8.cc).
  - W4A16 (`format: pack-quantized`): the projections' weights int4 (eight to an int32 word in the checkpoint)
    with a float scale per group of `group_size` inputs (or per output channel), symmetric or with a zero point
    per group, in activation order or not, activations in float: the weight is dequantized ((value - zero point)
    times its group's scale) and multiplied as a float one (`WeightOnly`; on CPU the native bfloat16 matmul
    dequantizes it panel by panel).
  - FP8 (`format: float-quantized`, FP8_DYNAMIC and FP8_BLOCK): float8 e4m3 weights with a float32 scale per output
    channel, per tensor or per block; served weights-only (the activations stay in float, as vLLM's CPU build runs
    such checkpoints): dequantized as W4A16's are.
- GPTQ (`gptq`: 4-bit, symmetric or with zero points, in activation order or not) and AWQ (`awq`: AutoAWQ's gemm
  version, 4-bit with zero points): their tensors laid out as compressed-tensors' W4A16 at load (`with_quantized`),
  the same numbers and kernels after.
- FP8 (`fp8`: transformers' fine-grained FP8, as DeepSeek's and Qwen's FP8 checkpoints, scales per block; AutoFP8's,
  per tensor): as compressed-tensors' FP8.

The embedding, the norms and the output head stay in the checkpoint's float dtype (llm-compressor leaves `lm_head`
out). Other methods and other schemes are refused by field.

A checkpoint may also hold each layer's KV cache scales (compressed-tensors' `kv_cache_scheme`, the `fp8` method's
`kv_cache_scheme: static`; `kv_scale_tensor` reads each producer's names): they apply where the engine's KV cache is
float8 (`kv_cache_dtype fp8`, `LLMEngine._kv_cache_dtype`), as vLLM applies them.

`write_w8a8_checkpoint`, `write_w4a16_checkpoint`, `write_gptq_checkpoint`, `write_awq_checkpoint` and
`write_fp8_checkpoint` write such checkpoints from a float one (round to nearest, no calibration data), for tests,
benchmarks and users without llm-compressor (`jaxengine quantize`).
"""

import dataclasses
import json
import math
import shutil
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxengine.models.config import MIXTRAL_NAMED_ARCHITECTURES

W8A8_INT8 = "w8a8_int8"  # ModelConfig.quantization's values: the schemes served
W4A16 = "w4a16"
W8A16_FP8 = "w8a16_fp8"
WEIGHT_ONLY = (W4A16, W8A16_FP8)  # the schemes whose weights are dequantized to multiply (WeightOnly)
QUANTIZED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_HEAD = ("lm_head", "re:.*lm_head")  # how llm-compressor names the output head it leaves out


class Int8Weight(NamedTuple):
    """A quantized projection as the layer's matmul takes it: int8 [in, out] and its float32 scales [out], or
    packed for the native CPU kernel (`comp` given: pallas_kernels.cpu.pack_int8's three arrays)."""
    weight: jax.Array
    scale: jax.Array
    comp: jax.Array | None = None


class Quantized(NamedTuple):
    """What a quantized checkpoint's config.json says (ModelConfig's quantization, quant_group_size, quant_method,
    quant_zero_point, quant_format, quant_act_order, quant_block_out)."""
    scheme: str  # W8A8_INT8, W4A16 or W8A16_FP8
    group_size: int  # W4A16, FP8: the weights' group (block) along the input (0: the whole input)
    method: str  # compressed-tensors, gptq, awq or fp8
    zero_point: bool = False  # W4A16: asymmetric, a zero point per group
    format: str = ""  # the method's own: compressed-tensors' format, GPTQ's checkpoint_format, AWQ's version
    act_order: bool = False  # W4A16: each input's group given by a g_idx (GPTQ's desc_act, actorder "group")
    block_out: int = 1  # FP8: the weights' block along the output (1: per channel, 0: one for the whole tensor)
    kv_scales: bool = False  # each layer's K and V cache scales stored (kv_cache_scheme; see `kv_scale_tensor`)


# An MXFP4 (OCP microscaling) element: float4 e2m1, sign in the top bit of its 4
MXFP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                        np.float32)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 weights as GPT-OSS checkpoints store them: `blocks` uint8 [..., out, in / 32, 16], two float4 e2m1
    values a byte (the low 4 bits first), and `scales` uint8 [..., out, in / 32], each block of 32 values' power of
    two (E8M0: 2^(s - 127)). Returns float32 [..., out, in] (exact: every value is a float32 one)."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.ndim < 2 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} disagree: blocks must be "
                         f"[..., groups, 16] and scales [..., groups]")
    values = np.empty(blocks.shape[:-1] + (32,), np.float32)
    values[..., 0::2] = MXFP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = MXFP4_VALUES[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return values.reshape(*scales.shape[:-1], scales.shape[-1] * 32)


def parse_quantization(hf: dict) -> Quantized | None:
    """A quantized checkpoint's config.json: compressed-tensors' W8A8 int8, W4A16 (symmetric or with zero points)
    or FP8 weights, GPTQ's or AWQ's 4-bit weights (as W4A16), FP8 weights (`fp8`); None for an unquantized
    checkpoint; a ValueError naming the field for any other quantization."""
    q = hf.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method == "mxfp4":
        if (hf.get("architectures") or [None])[0] != "GptOssForCausalLM":
            raise ValueError("quantization_config.quant_method 'mxfp4' is supported for GPT-OSS checkpoints only "
                             "(their experts' weights, dequantized at load: dequantize_mxfp4)")
        return None
    if method == "gptq":
        return _gptq(q)
    if method == "awq":
        return _awq(q, hf)
    if method == "fp8":
        return _fp8(q, hf)
    if method != "compressed-tensors":
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported; supported: compressed-tensors "
                         f"(W8A8 int8: int8 weights with per-channel or per-tensor scales, dynamic per-token int8 "
                         f"activations; W4A16: int4 weights in groups or per channel, symmetric or with zero "
                         f"points; FP8 weights), gptq (4-bit), awq (4-bit, the gemm version), fp8 (e4m3 weights per "
                         f"tensor or in blocks)")
    formats = {"int-quantized": W8A8_INT8, "pack-quantized": W4A16, "float-quantized": W8A16_FP8}
    if q.get("format") not in formats:
        raise ValueError(f"quantization_config.format {q.get('format')!r} is not supported; supported: int-quantized "
                         f"(W8A8 int8), pack-quantized (W4A16), float-quantized (FP8)")
    scheme = formats[q["format"]]
    if q.get("quantization_status", "compressed") != "compressed":
        raise ValueError(f"quantization_config.quantization_status {q.get('quantization_status')!r} is not supported; "
                         f"supported: compressed")
    for field in ("sparsity_config", "transform_config"):
        if q.get(field):
            raise ValueError(f"quantization_config.{field} is not supported")
    kv_scales = _kv_cache_scheme(q.get("kv_cache_scheme"))
    groups = q.get("config_groups") or {}
    if not groups:
        raise ValueError("quantization_config.config_groups is empty")
    forms = set()  # (group size, zero points, activation order, output block) of each group
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
            forms.add((0, False, False, 1))
        elif scheme == W8A16_FP8:
            weights = group.get("weights")
            _check_args(weights, f"{where}.weights", scheme, bits=8, strategies=("channel", "tensor", "block"),
                        kind="float")
            _check_fp8_activations(group.get("input_activations"), f"{where}.input_activations")
            block_out, size = {"channel": (1, 0), "tensor": (0, 0)}.get(weights["strategy"]) or _block(
                weights.get("block_structure"), f"{where}.weights.block_structure")
            forms.add((size, False, False, block_out))
        else:
            weights = group.get("weights")
            _check_args(weights, f"{where}.weights", scheme, bits=4, strategies=("group", "channel"),
                        weight_only=True)
            if group.get("input_activations"):
                raise ValueError(f"{where}.input_activations is not supported with pack-quantized weights (W4A16 "
                                 f"keeps its activations in float)")
            size = weights.get("group_size") if weights["strategy"] == "group" else 0
            if weights["strategy"] == "group" and not (isinstance(size, int) and size > 0):
                raise ValueError(f"{where}.weights.group_size={size!r}: the group strategy needs a positive size")
            forms.add((size, not weights["symmetric"], weights.get("actorder") == "group", 1))
        if group.get("output_activations"):
            raise ValueError(f"{where}.output_activations is not supported")
    if len(forms) > 1:
        raise ValueError(f"quantization_config.config_groups: groups of different sizes, symmetries or orders "
                         f"{sorted(forms)} are not supported")
    ignored = [name for name in q.get("ignore") or [] if name not in _HEAD]
    if ignored:
        raise ValueError(f"quantization_config.ignore {ignored!r} is not supported: only the output head (lm_head) may "
                         f"stay unquantized")
    size, zero_point, act_order, block_out = forms.pop()
    return Quantized(scheme, size, "compressed-tensors", zero_point, q["format"], act_order, block_out, kv_scales)


def _kv_cache_scheme(scheme) -> bool:
    """Whether a compressed-tensors `kv_cache_scheme` stores K and V cache scales: llm-compressor's static float8
    one (8-bit float, symmetric, one scale per tensor: each layer's `k_scale` and `v_scale`); None: none. Served
    as vLLM serves them: applied where the KV cache is fp8 (`kv_cache_dtype`), unused otherwise."""
    if not scheme:
        return False
    where = "quantization_config.kv_cache_scheme"
    if not isinstance(scheme, dict):
        raise ValueError(f"{where} must be an object, got {scheme!r}")
    for field, served in (("num_bits", 8), ("type", "float"), ("strategy", "tensor"), ("dynamic", False),
                          ("symmetric", True)):
        if scheme.get(field, served) != served:
            raise ValueError(f"{where}.{field}={scheme.get(field)!r} is not supported; supported: a static float8 "
                             f"scheme with one scale per tensor ({field}={served!r})")
    return True


def _gptq(q: dict) -> Quantized:
    """A GPTQ config, once its fields are ones served: 4 bits, symmetric or with zero points, in activation order
    or not (desc_act: the g_idx tensors say each input's group), the output head unquantized, every projection
    quantized."""
    expected = {"bits": 4, "lm_head": False}
    for field, value in expected.items():
        if q.get(field, value if field == "lm_head" else None) != value:
            raise ValueError(f"quantization_config.{field}={q.get(field)!r} is not supported (gptq takes {value!r})")
    for field in ("sym", "desc_act"):
        if not isinstance(q.get(field, False if field == "desc_act" else None), bool):
            raise ValueError(f"quantization_config.{field}={q.get(field)!r} must be true or false")
    if q.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
        raise ValueError(f"quantization_config.checkpoint_format={q['checkpoint_format']!r} is not supported; "
                         f"supported: gptq, gptq_v2")
    for field in ("dynamic", "modules_in_block_to_quantize"):
        if q.get(field):
            raise ValueError(f"quantization_config.{field} (some modules quantized otherwise) is not supported")
    return Quantized(W4A16, _group_size(q.get("group_size", 128), "group_size"), "gptq", not q["sym"],
                     q.get("checkpoint_format", "gptq"), q.get("desc_act", False))


def _awq(q: dict, hf: dict) -> Quantized:
    """An AWQ config (AutoAWQ's, as vLLM reads it: `bits` or `w_bit`, `group_size` or `q_group_size`,
    `zero_point`), once its fields are ones served: 4 bits with zero points, the gemm version's packing, every
    decoder projection quantized."""
    def field(*names):
        for name in names:
            if name in q:
                return name, q[name]
        raise ValueError(f"quantization_config.{names[0]} is missing (awq needs it)")

    name, bits = field("bits", "w_bit")
    if bits != 4:
        raise ValueError(f"quantization_config.{name}={bits!r} is not supported (awq takes 4)")
    if field("zero_point")[1] is not True:
        raise ValueError(f"quantization_config.zero_point={q['zero_point']!r} is not supported (awq takes true)")
    if str(q.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"quantization_config.version={q['version']!r} is not supported; supported: gemm (GEMV and "
                         f"other versions pack their weights otherwise)")
    if q.get("lm_head", False):
        raise ValueError("quantization_config.lm_head=true is not supported (the output head stays in float)")
    _check_converted(q.get("modules_to_not_convert"), "modules_to_not_convert", hf)
    name, group = field("group_size", "q_group_size")
    return Quantized(W4A16, _group_size(group, name), "awq", True, "gemm")


def _fp8(q: dict, hf: dict) -> Quantized:
    """An FP8 config (vLLM's `fp8`: transformers' fine-grained FP8, DeepSeek's and Qwen's FP8 checkpoints,
    AutoFP8's), once its fields are ones served: e4m3 weights with one scale per tensor (`weight_scale`) or per
    block of `weight_block_size` [out, in] (`weight_scale_inv`), every decoder projection quantized. The
    activations stay in float (weights-only FP8, as vLLM's CPU build runs such checkpoints): a dynamic activation
    scheme computes nothing else; a static one's `input_scale`s are checked and not applied."""
    if q.get("fmt", "e4m3") not in ("e4m3", "float8_e4m3fn"):  # DeepSeek's name for it; MiniMax-M2's
        raise ValueError(f"quantization_config.fmt={q['fmt']!r} is not supported (fp8 takes e4m3)")
    scheme = q.get("activation_scheme")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"quantization_config.activation_scheme={scheme!r} must be 'dynamic' or 'static'")
    block = q.get("weight_block_size")
    if block is not None and scheme != "dynamic":
        raise ValueError("quantization_config.weight_block_size: block-wise FP8 takes the dynamic activation scheme")
    for field in ("ignored_layers", "modules_to_not_convert"):
        _check_converted(q.get(field), field, hf)
    if q.get("scale_fmt") not in (None, "float32", "fp32"):
        raise ValueError(f"quantization_config.scale_fmt={q['scale_fmt']!r} is not supported (float32 scales)")
    block_out, size = (0, 0) if block is None else _block(block, "quantization_config.weight_block_size")
    kv_scheme = q.get("kv_cache_scheme")  # AutoFP8's: "static", K/V scales as k_proj's and v_proj's output_scale
    if kv_scheme not in (None, "static"):
        raise ValueError(f"quantization_config.kv_cache_scheme={kv_scheme!r} is not supported; supported: 'static'")
    return Quantized(W8A16_FP8, size, "fp8", format="e4m3", block_out=block_out, kv_scales=kv_scheme == "static")


def _block(block, where: str) -> tuple[int, int]:
    """An FP8 weight block [out, in] -> (its rows, its inputs)."""
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"{where}={block!r} must be two positive sizes [output, input]")
    return block[0], block[1]


def _check_fp8_activations(args: dict | None, where: str) -> None:
    """FP8 weights' input_activations as compressed-tensors writes them (FP8_DYNAMIC's dynamic per token, FP8_BLOCK's
    dynamic per group, a per-tensor scale, dynamic or static; or none): served weights-only, the activations
    staying in float as vLLM's CPU build runs them."""
    if not args:
        return
    if args.get("num_bits") != 8 or args.get("type") != "float":
        raise ValueError(f"{where}: {args.get('num_bits')}-bit {args.get('type')} activations with FP8 weights are "
                         f"not supported (8-bit float, or none)")
    if args.get("strategy") not in ("token", "group", "tensor") or (
            args.get("strategy") != "tensor" and args.get("dynamic") is not True):
        raise ValueError(f"{where}.strategy={args.get('strategy')!r} (dynamic={args.get('dynamic')!r}) is not "
                         f"supported; supported: token or group (dynamic), tensor")


def _check_converted(modules, field: str, hf: dict) -> None:
    """A config's list of modules left in float (AWQ's modules_to_not_convert, FP8's ignored_layers: names matched
    as substrings of a layer's, as vLLM matches them) may name none of the decoder layers' projections (under the
    checkpoint's names: MIXTRAL_NAMED_ARCHITECTURES' experts are `block_sparse_moe.experts.N.w1`, ..., so that
    MiniMax-M2's "gate" names its router only)."""
    mlp = (("block_sparse_moe.experts.0", ("w1", "w2", "w3"))
           if (hf.get("architectures") or [None])[0] in MIXTRAL_NAMED_ARCHITECTURES
           else ("mlp", ("gate_proj", "up_proj", "down_proj", "gate_up_proj")))
    projections = [f"model.layers.{i}.{block}.{p}" for i in range(hf.get("num_hidden_layers", 0))
                   for block, parts in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")), mlp)
                   for p in parts]
    left = [module for module in modules or [] if any(module in projection for projection in projections)]
    if left:
        raise ValueError(f"quantization_config.{field} {left!r} is not supported: every decoder layer's projection "
                         f"must be quantized")


def _group_size(group, name: str) -> int:
    """A GPTQ or AWQ config's group size (-1: one group per output channel, 0 here)."""
    if group != -1 and not (isinstance(group, int) and group > 0):
        raise ValueError(f"quantization_config.{name}={group!r} must be positive or -1 (per channel)")
    return 0 if group == -1 else group


def _check_args(args: dict | None, where: str, scheme: str, *, bits: int, strategies: tuple[str, ...],
                dynamic: bool = False, weight_only: bool = False, kind: str = "int") -> None:
    """`weight_only` (W4A16): zero points and a g_idx's activation order allowed; `kind`: int or float values."""
    if not args:
        raise ValueError(f"{where} is missing: {scheme} quantizes them")
    expected = {"num_bits": bits, "type": kind, "dynamic": dynamic}
    for field, value in expected.items():
        if args.get(field, value if field == "type" else None) != value:
            raise ValueError(f"{where}.{field}={args.get(field)!r} is not supported ({scheme} takes {value!r})")
    if args.get("symmetric") not in ((True, False) if weight_only else (True,)):
        raise ValueError(f"{where}.symmetric={args.get('symmetric')!r} is not supported ({scheme} takes "
                         f"{'true or false' if weight_only else 'true'})")
    if args.get("strategy") not in strategies:
        raise ValueError(f"{where}.strategy={args.get('strategy')!r} is not supported; supported: "
                         f"{', '.join(strategies)}")
    if args.get("group_size") and args.get("strategy") != "group":
        raise ValueError(f"{where}.group_size={args['group_size']!r} is not supported with strategy "
                         f"{args.get('strategy')!r}")
    if args.get("block_structure") and args.get("strategy") != "block":
        raise ValueError(f"{where}.block_structure={args['block_structure']!r} is not supported with strategy "
                         f"{args.get('strategy')!r}")
    # "group": each input's group in a g_idx tensor; "weight" and "static": groups of consecutive inputs
    orders = (None, "static", "weight", "group") if weight_only else (None, "static", "weight")
    if args.get("actorder") not in orders:
        raise ValueError(f"{where}.actorder={args['actorder']!r} is not supported; supported: "
                         f"{', '.join(str(order) for order in orders)}")


def projection_shapes(cfg) -> dict[str, tuple[int, int]]:
    """Each quantized projection's (output, input) widths in the checkpoint (Phi-3's fused ones included; the dense
    MLP's where the layers have one: a mixture of experts' shared expert)."""
    q, kv, I, D = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size, cfg.hidden_size
    shapes = {"q_proj": (q, D), "k_proj": (kv, D), "v_proj": (kv, D), "o_proj": (D, q), "qkv_proj": (q + 2 * kv, D)}
    if I:
        shapes |= {"gate_proj": (I, D), "up_proj": (I, D), "down_proj": (D, I), "gate_up_proj": (2 * I, D)}
    return shapes


def expert_shapes(cfg) -> dict[str, tuple[int, int]]:
    """A mixture of experts' experts' projections' (output, input) widths, by their checkpoint names (Mixtral's w1,
    w3, w2 too)."""
    M, D = cfg.moe_intermediate_size, cfg.hidden_size
    if not cfg.num_experts:
        return {}
    return {"gate_proj": (M, D), "up_proj": (M, D), "down_proj": (D, M), "w1": (M, D), "w3": (M, D), "w2": (D, M)}


def _layer_shapes(cfg, name: str) -> dict[str, tuple[int, int]]:
    """The quantized projections' (output, input) widths in tensor `name`'s place: an expert's, a dense layer's among
    expert ones (`dense_mlp_layers`, of `dense_intermediate_size`), or the layers' own."""
    if ".experts." in name:
        return expert_shapes(cfg)
    if cfg.dense_mlp_layers and name.startswith("model.layers."):
        if int(name.split(".")[2]) in cfg.dense_mlp_layers:
            return projection_shapes(dataclasses.replace(cfg, intermediate_size=cfg.dense_intermediate_size))
    return projection_shapes(cfg)


def scale_groups(cfg, width: int) -> int:
    """How many groups of scales a weight-only quantized projection of `width` inputs has along them (one for the
    whole input: 1): W4A16's groups; FP8's blocks, split where a block straddles two groups' widths (groups of
    gcd(width, block) inputs, the last block of a width it does not divide included)."""
    size = cfg.quant_group_size
    if not size:
        return 1
    return width // (math.gcd(width, size) if cfg.quantization == W8A16_FP8 else size)


def check_group_size(cfg) -> None:
    """A W4A16 checkpoint's group size must divide every quantized projection's input width."""
    size = cfg.quant_group_size
    dense = dataclasses.replace(cfg, intermediate_size=cfg.dense_intermediate_size) if cfg.dense_mlp_layers else cfg
    for name, (_, width) in (projection_shapes(cfg) | projection_shapes(dense) | expert_shapes(cfg)).items():
        if cfg.quantization == W4A16 and size and width % size:
            raise ValueError(f"quantization_config group_size={size} does not divide {name}'s input width {width}")


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's gemm packing: a word's nibble i holds its eight columns' AWQ_ORDER[i]


def unpack_int4(packed, width: int, order=None) -> np.ndarray:
    """Int4 values packed eight to an int32 word along the last axis ([..., ceil(width / 8)], each word's first
    value in its low bits, or its nibble i holding value order[i]: AWQ's), offset by 8 (their unsigned values) ->
    int8 [..., width] in [-8, 7] (the unsigned value minus 8)."""
    words = np.asarray(packed).astype(np.uint32)
    nibbles = (words[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF
    if order is not None:
        nibbles = nibbles[..., np.argsort(order)]
    return (nibbles.reshape(*words.shape[:-1], -1)[..., :width].astype(np.int16) - 8).astype(np.int8)


def pack_int4(values: np.ndarray, order=None) -> np.ndarray:
    """unpack_int4's inverse: int8 [..., width] in [-8, 7] -> int32 [..., ceil(width / 8)]."""
    values = np.asarray(values, np.int16) + 8
    padded = np.pad(values, [(0, 0)] * (values.ndim - 1) + [(0, -values.shape[-1] % 8)]).astype(np.uint32)
    eights = padded.reshape(*padded.shape[:-1], -1, 8)
    if order is not None:
        eights = eights[..., list(order)]
    words = (eights << (4 * np.arange(8, dtype=np.uint32))).sum(-1)
    return words.astype(np.uint32).view(np.int32)


def with_quantized(split_tensor, cfg):
    """`split_tensor` after a quantized checkpoint's tensors become what the split and the weight map take, in
    compressed-tensors' names and layouts: W8A8's `weight_scale` ([out, 1], or [1] / [] per tensor) a float32
    vector [out] (a per-tensor scale repeated); W4A16's int8 `weight` [out, in] (from compressed-tensors'
    `weight_packed`, GPTQ's or AWQ's `qweight`), its `weight_scale` [out, groups] (GPTQ's and AWQ's `scales`
    transposed) and, with zero points, its int8 `weight_zero_point` [out, groups] (offset as the values are:
    compressed-tensors' packed ones unpacked, GPTQ's and AWQ's `qzeros`), in activation order its int32
    `weight_g_idx` [in] (GPTQ's `g_idx`), each checked; compressed-tensors' `weight_shape`, GPTQ's `g_idx` where
    inputs are grouped in turn (and a symmetric GPTQ's `qzeros`) dropped once checked. FP8's float8 `weight` as it
    is, its scales as W4A16's (`fp8_tensor`). A mixture of experts' experts, weight-only quantized, are dequantized
    as they load (`_ExpertDequantizer`): the model holds them in its float dtype."""
    if cfg.quantization is None:
        return split_tensor
    experts = _ExpertDequantizer(cfg) if cfg.num_experts else None

    def projection(name):
        part = name.rsplit(".", 2)[-2]
        shapes = _layer_shapes(cfg, name)
        if part not in shapes:
            raise ValueError(f"tensor {name}: a quantized {part} is not supported (only the decoder layers' "
                             f"{', '.join(QUANTIZED_LINEARS)} and experts' projections)")
        return shapes[part]

    def split(name, array, cfg):
        if (kv_scales := kv_scale_tensor(name, array, cfg)) is not None:
            return [piece for kv_name, scale in kv_scales for piece in split_tensor(kv_name, scale, cfg)]
        # each format's tensors in compressed-tensors' names and layouts (W8A8's are already)
        convert = {"gptq": gptq_tensor, "awq": awq_tensor}.get(cfg.quant_method) or {
            W4A16: packed_tensor, W8A16_FP8: fp8_tensor}.get(cfg.quantization)
        if convert is not None:
            name, array = convert(name, array)
            if name is None:
                return []
        if name.endswith((".input_scale", ".input_zero_point")) or (
                name.endswith(".weight_zero_point") and not cfg.quant_zero_point) or (
                name.endswith(".weight_g_idx") and not cfg.quant_act_order):
            raise ValueError(f"tensor {name}: static, asymmetric or reordered quantization is not supported here "
                             f"(the checkpoint's config does not say so)")
        if cfg.quantization == W8A8_INT8 and name.endswith(".weight_scale"):
            width = projection(name)[0]
            scale = np.asarray(array, np.float32).reshape(-1)
            if scale.size == 1:
                scale = np.full(width, scale[0], np.float32)
            elif scale.size != width:
                raise ValueError(f"tensor {name} has {scale.size} scales, expected {width} (one per output channel) "
                                 f"or 1")
            array = scale
        elif cfg.quantization in WEIGHT_ONLY and name.endswith((".weight_scale", ".weight_zero_point")):
            out, width = projection(name)
            if tuple(array.shape) != (out, scale_groups(cfg, width)):
                raise ValueError(f"tensor {name} has shape {tuple(array.shape)}, expected "
                                 f"{(out, scale_groups(cfg, width))}")
        elif name.endswith(".weight_g_idx"):
            array = checked_g_idx(name, array)
        if ".experts." in name and ".layers." in name:
            return [piece for expert_name, weight in experts.add(name, array, projection(name)[1])
                    for piece in split_tensor(expert_name, weight, cfg)]
        return split_tensor(name, array, cfg)

    def fp8_tensor(name, array):
        """An FP8 projection's scales (`weight_scale`: one, one per output channel [out, 1], or per block [ceil(out /
        rows), ceil(in / inputs)]; the fp8 method's block ones are `weight_scale_inv`) as weight_scale [out,
        groups] float32, each row's and group's its block's; a static activation scheme's `input_scale` (not
        applied: weights-only) checked and dropped; the e4m3 weight as it is."""
        stem, _, kind = name.rpartition(".")
        if kind == "input_scale":
            scale = np.asarray(array, np.float32)
            if scale.size != 1 or not scale.reshape(-1)[0] > 0:
                raise ValueError(f"tensor {name}: an input scale must be one positive value, got shape {scale.shape}")
            return None, None
        fp8 = np.asarray(array).dtype == ml_dtypes.float8_e4m3fn
        projection_weight = kind == "weight" and ".layers." in name and stem.rsplit(".", 1)[-1] in _layer_shapes(
            cfg, name)
        if projection_weight != fp8:
            raise ValueError(f"tensor {name} is {np.asarray(array).dtype}: an FP8 checkpoint's decoder projections "
                             f"(and only they) are float8_e4m3fn")
        if kind not in ("weight_scale", "weight_scale_inv"):
            return name, array
        out, width = projection(name)
        rows, inputs = cfg.quant_block_out, cfg.quant_group_size
        scale = np.asarray(array, np.float32)
        if not inputs:  # per tensor or per output channel
            if scale.size not in (1, out if rows == 1 else 1):
                raise ValueError(f"tensor {name} has {scale.size} scales, expected {out if rows == 1 else 1}")
            return stem + ".weight_scale", np.broadcast_to(scale.reshape(-1, 1), (out, 1)).copy()
        expected = (-(-out // rows), -(-width // inputs))
        if scale.shape != expected:
            raise ValueError(f"tensor {name} has shape {scale.shape}, expected {expected} (blocks of {rows} x "
                             f"{inputs})")
        groups = scale_groups(cfg, width)
        return stem + ".weight_scale", scale[np.arange(out) // rows][:, np.arange(groups) * (width // groups) // inputs]

    def packed_tensor(name, array):
        """compressed-tensors' pack-quantized tensors: `weight_packed` [out, ceil(in / 8)] (packed along the input)
        and `weight_zero_point` [ceil(out / 8), groups] (packed along the output) unpacked; `weight_shape`
        checked and dropped."""
        if name.endswith(".weight_shape"):
            if [int(v) for v in np.asarray(array).reshape(-1)] != list(projection(name)):
                raise ValueError(f"tensor {name} is {np.asarray(array).tolist()}, expected {list(projection(name))}")
            return None, None
        if name.endswith(".weight_packed"):
            out, width = projection(name)
            if tuple(array.shape) != (out, -(-width // 8)):
                raise ValueError(f"tensor {name} has shape {tuple(array.shape)}, expected {(out, -(-width // 8))}")
            return name[: -len("_packed")], unpack_int4(array, width)
        if name.endswith(".weight_zero_point") and cfg.quant_zero_point:
            out, width = projection(name)
            expected = (-(-out // 8), scale_groups(cfg, width))
            if tuple(array.shape) != expected:
                raise ValueError(f"tensor {name} has shape {tuple(array.shape)}, expected {expected}")
            return name, unpack_int4(np.asarray(array).T, out).T
        return name, array

    def gptq_tensor(name, array):
        """A GPTQ tensor as compressed-tensors names and lays it out (qweight [in / 8, out] -> int8 weight [out,
        in]; scales [groups, out] -> weight_scale [out, groups]; qzeros [groups, out / 8] -> weight_zero_point
        [out, groups], stored minus one by the gptq format, as they are by gptq_v2; g_idx -> weight_g_idx in
        activation order), or (None, None) for one checked and dropped: a symmetric checkpoint's qzeros (its zero
        point 8: stored 7 or 8) and g_idx without activation order (each input's group in turn)."""
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
            stored = unpack_int4(array, out)  # zero point - 8, minus one more in the gptq format
            if cfg.quant_zero_point:
                v1 = cfg.quant_format == "gptq"
                return stem + ".weight_zero_point", np.ascontiguousarray((stored + v1).astype(np.int8).T)
            if not (np.all(stored == -1) or np.all(stored == 0)):
                raise ValueError(f"tensor {name}: zero points other than 8 in a sym=true checkpoint (stored 7, or 8 "
                                 f"in gptq_v2)")
        elif cfg.quant_act_order:
            return stem + ".weight_g_idx", array
        elif not np.array_equal(array, np.arange(width) // (cfg.quant_group_size or width)):
            raise ValueError(f"tensor {name}: a g_idx reordering the inputs, but the config says desc_act=false")
        return None, None

    def checked_g_idx(name, array):
        """An activation order's g_idx: each input's group, every group `group_size` inputs."""
        width = projection(name)[1]
        size = cfg.quant_group_size or width
        array = np.asarray(array)
        if array.shape != (width,) or not np.array_equal(np.sort(array), np.arange(width) // size):
            raise ValueError(f"tensor {name}: a g_idx must give each of the {width} inputs a group, {size} inputs to "
                             f"each group")
        return array.astype(np.int32)

    def awq_tensor(name, array):
        """An AWQ (gemm) tensor as compressed-tensors names and lays it out: qweight [in, out / 8] and qzeros
        [groups, out / 8], each word eight columns in AWQ_ORDER, unsigned -> int8 weight [out, in] and
        weight_zero_point [out, groups]; scales [groups, out] -> weight_scale [out, groups]."""
        stem, _, kind = name.rpartition(".")
        if kind not in ("qweight", "scales", "qzeros"):
            return name, array
        out, width = projection(name)
        rows = {"qweight": width, "scales": scale_groups(cfg, width), "qzeros": scale_groups(cfg, width)}[kind]
        expected = (rows, out if kind == "scales" else -(-out // 8))
        array = np.asarray(array)
        if array.shape != expected:
            raise ValueError(f"tensor {name} has shape {array.shape}, expected {expected}")
        if kind == "scales":
            return stem + ".weight_scale", array.T
        values = np.ascontiguousarray(unpack_int4(array, out, AWQ_ORDER).T)
        return stem + (".weight" if kind == "qweight" else ".weight_zero_point"), values

    return split


class _ExpertDequantizer:
    """A mixture of experts' weight-only quantized expert projections (W4A16, GPTQ, AWQ, FP8), dequantized as they
    load: each projection's tensors (in compressed-tensors' layout: `weight` [out, in], `weight_scale` [out, groups],
    W4A16's `weight_zero_point` [out, groups] and, in activation order, `weight_g_idx` [in]) are held until all have
    arrived, then become its float32 `weight`, (value - zero point) x its group's scale, as WeightOnly.dequantized
    computes a dense projection's. One instance per load."""

    def __init__(self, cfg):
        if cfg.quantization not in WEIGHT_ONLY:
            raise ValueError(f"a mixture of experts quantized in {cfg.quantization} is not supported (weight-only "
                             f"schemes are: W4A16, GPTQ, AWQ, FP8)")
        self.parts = {"weight", "weight_scale"} | ({"weight_zero_point"} if cfg.quant_zero_point else set()) | (
            {"weight_g_idx"} if cfg.quant_act_order else set())
        self.held = {}  # stem -> {part: array}

    def add(self, name: str, array, width: int) -> list[tuple[str, np.ndarray]]:
        stem, _, part = name.rpartition(".")
        if part not in self.parts:
            raise ValueError(f"tensor {name}: an expert's {part} is not supported")
        held = self.held.setdefault(stem, {})
        held[part] = np.asarray(array)
        if len(held) < len(self.parts):
            return []
        del self.held[stem]
        scale = held["weight_scale"].astype(np.float32)
        groups = scale.shape[1]
        group = held["weight_g_idx"] if "weight_g_idx" in held else np.arange(width) // (width // groups)
        values = held["weight"].astype(np.float32)
        if "weight_zero_point" in held:
            values = values - held["weight_zero_point"].astype(np.float32)[:, group]
        return [(stem + ".weight", values * scale[:, group])]


# A layer's KV cache scale tensors after `self_attn.`, as each producer names them -> which of K and V they scale:
# compressed-tensors' (llm-compressor), AutoFP8's and Quark's (the projections' output scales), ModelOpt's, and
# the older single `kv_scale` of both. A query scale (for attention computed in float8) has no use here.
_KV_SCALE_NAMES = {"k_scale": "k", "v_scale": "v", "k_proj.output_scale": "k", "v_proj.output_scale": "v",
                   "k_proj.k_scale": "k", "v_proj.v_scale": "v", "kv_scale": "kv", "q_scale": ""}


def kv_scale_tensor(name: str, array, cfg) -> list[tuple[str, np.ndarray]] | None:
    """A KV cache scale tensor (`_KV_SCALE_NAMES`) as the layer's `self_attn.k_scale` and/or `self_attn.v_scale`
    (float32 []), checked: one positive value per tensor; a query scale checked and dropped (attention runs in
    float here, as on vLLM's CPU build). None: not such a tensor."""
    stem, found, rest = name.partition(".self_attn.")
    if not found or rest not in _KV_SCALE_NAMES:
        return None
    if not cfg.quant_kv_scales:
        raise ValueError(f"tensor {name}: a KV cache scale, but the checkpoint's quantization_config has no "
                         f"kv_cache_scheme")
    scale = np.asarray(array, np.float32)
    if scale.size != 1 or not (np.isfinite(scale).all() and scale.reshape(-1)[0] > 0):
        raise ValueError(f"tensor {name}: a KV cache scale must be one positive value (per tensor; per-head scales "
                         f"are not supported), got shape {scale.shape}")
    return [(f"{stem}.self_attn.{kind}_scale", scale.reshape(())) for kind in _KV_SCALE_NAMES[rest]]


class WeightOnly(NamedTuple):
    """A weight-only quantized projection as the layer's matmul takes it: W4A16's int4 values in int8 [in, out] (the
    unsigned value minus 8) or FP8's float8 e4m3 ones, their scales [groups, out] (W4A16's in the checkpoint's
    float dtype, FP8's in float32), W4A16's zero points (None: symmetric; else int8 [groups, out], offset as the
    values are) and, in activation order, each input's group `g_idx` [in] (None: groups of in / groups consecutive
    inputs); or packed for the native CPU matmul (uint8 `weight`: pallas_kernels.cpu.pack_int4_panels' or
    pack_fp8_panels' panels of the inputs in `perm`'s order (None: as they are), its scales and biases in
    `scale`)."""
    weight: jax.Array
    scale: jax.Array
    zero: jax.Array | None = None
    g_idx: jax.Array | None = None
    perm: jax.Array | None = None

    def dequantized(self) -> jax.Array:
        """The float weight [in, out] in the scales' dtype: (value - zero point) x its group's scale, as vLLM's
        kernels dequantize."""
        *lead, width, out = self.weight.shape
        groups = self.scale.shape[-2]
        if self.g_idx is not None:  # each input's group's scale and zero point
            def rows(a):
                return jnp.take_along_axis(a, self.g_idx[..., :, None], axis=-2)

            values = self.weight.astype(jnp.int16)
            if self.zero is not None:
                values = values - rows(self.zero).astype(jnp.int16)
            return values.astype(self.scale.dtype) * rows(self.scale)
        values = self.weight.reshape(*lead, groups, width // groups, out)
        if self.zero is not None:
            values = values.astype(jnp.int16) - self.zero[..., :, None, :].astype(jnp.int16)
        values = values.astype(self.scale.dtype)
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


def quantize_int4(w: np.ndarray, group_size: int = 0, symmetric: bool = True):
    """A float weight [out, in] -> (int8 values in [-8, 7] [out, in] (the unsigned value minus 8), float32 scales
    [out, in / group_size] (one group per row where group_size is 0), int8 zero points [out, groups] offset as the
    values are, or None where `symmetric`), round to nearest: symmetric, scale max|w| / 7.5 (llm-compressor's),
    zero point 8; asymmetric (compressed-tensors' and GPTQ's rule), the group's range widened to hold 0 split in
    15 steps, zero point round(-min / scale)."""
    w = np.asarray(w, np.float32)
    out, width = w.shape
    size = group_size or width
    if width % size:
        raise ValueError(f"group_size {group_size} does not divide the input width {width}")
    groups = w.reshape(out, width // size, size)
    if symmetric:
        scale = np.abs(groups).max(axis=-1, keepdims=True) / 7.5
        q = np.clip(np.rint(groups / np.where(scale > 0, scale, 1.0)), -8, 7).astype(np.int8)
        return q.reshape(out, width), scale[..., 0], None
    low, high = np.minimum(groups.min(-1, keepdims=True), 0), np.maximum(groups.max(-1, keepdims=True), 0)
    scale = (high - low) / 15
    safe = np.where(scale > 0, scale, 1.0)
    zero = np.clip(np.rint(-low / safe), 0, 15)
    q = (np.clip(np.rint(groups / safe) + zero, 0, 15) - 8).astype(np.int8)
    return q.reshape(out, width), scale[..., 0], (zero[..., 0] - 8).astype(np.int8)


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


def write_w4a16_checkpoint(source: str | Path, output: str | Path, group_size: int = 128,
                           symmetric: bool = True, act_order: bool = False) -> Path:
    """Writes `source` (a float Hugging Face checkpoint directory of a dense model) as a compressed-tensors W4A16
    checkpoint (pack-quantized) in `output`: every decoder layer's linear projection weight quantized to int4
    (`quantize_int4`: symmetric, or with zero points) in groups of `group_size` inputs (0: one group per output
    channel), stored as llm-compressor stores it (`weight_packed`, `weight_scale`, `weight_shape`, and
    `weight_zero_point` packed along the output); every other tensor and file as it was. `act_order` (actorder
    "group"): the inputs grouped in an order of their own (`_quantize_in_order`), each input's group in
    `weight_g_idx`."""
    _check_group_size(group_size)

    def convert(name, weight):
        q, scale, zero, g_idx = _quantize_in_order(name, weight, group_size, symmetric, act_order)
        out = {name + "_packed": pack_int4(q), name + "_scale": scale,
               name + "_shape": np.asarray(weight.shape, np.int64)}
        if not symmetric:
            out[name + "_zero_point"] = np.ascontiguousarray(pack_int4(zero.T).T)
        return out | {name + "_g_idx": g_idx} if act_order else out

    config = compressed_tensors_config("group" if group_size else "channel", W4A16, group_size)
    config["config_groups"]["group_0"]["weights"] |= {"symmetric": symmetric,
                                                      "actorder": "group" if act_order else None}
    return _write_quantized(source, output, convert, config)


def write_gptq_checkpoint(source: str | Path, output: str | Path, group_size: int = 128, symmetric: bool = True,
                          checkpoint_format: str = "gptq", act_order: bool = False) -> Path:
    """Writes `source` (a float Hugging Face checkpoint directory of a dense model) as a GPTQ checkpoint (4-bit;
    `checkpoint_format` gptq, whose qzeros hold the zero points minus one, or gptq_v2) in `output`, each
    projection's int4 values, scales and zero points as `quantize_int4` computes them (round to nearest, no
    calibration: not GPTQ's error-correcting algorithm): `qweight`, `qzeros` (symmetric: 8), float16 `scales`,
    `g_idx`. `act_order` (desc_act): the inputs grouped in an order of their own instead of in turn
    (`_quantize_in_order`), each input's group in `g_idx`."""
    _check_group_size(group_size)
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"checkpoint_format must be 'gptq' or 'gptq_v2', got {checkpoint_format!r}")
    v1 = checkpoint_format == "gptq"

    def convert(name, weight):
        q, scale, zero, g_idx = _quantize_in_order(name, weight, group_size, symmetric, act_order)
        zero = np.zeros(scale.shape, np.int8) if zero is None else zero
        if v1 and zero.min() == -8:
            raise ValueError(f"{name}: a zero point 0, which the gptq format (zero points minus one) cannot store; "
                             f"write gptq_v2")
        stem = name.removesuffix(".weight")
        return {stem + ".qweight": np.ascontiguousarray(pack_int4(q).T),
                stem + ".qzeros": pack_int4(np.ascontiguousarray(zero.T) - v1),
                stem + ".scales": np.ascontiguousarray(scale.T).astype(np.float16),
                stem + ".g_idx": g_idx}

    config = {"quant_method": "gptq", "bits": 4, "group_size": group_size or -1, "desc_act": act_order,
              "sym": symmetric, "checkpoint_format": checkpoint_format, "damp_percent": 0.01, "true_sequential": True}
    return _write_quantized(source, output, convert, config)


def write_awq_checkpoint(source: str | Path, output: str | Path, group_size: int = 128) -> Path:
    """Writes `source` (a float Hugging Face checkpoint directory of a dense model) as an AWQ checkpoint (AutoAWQ's
    gemm version: 4-bit with zero points) in `output`, each projection's int4 values, scales and zero points as
    `quantize_int4` computes them with zero points (round to nearest, no calibration: not AWQ's activation-aware
    scaling): `qweight` [in, out / 8] and `qzeros` [groups, out / 8] packed in AWQ_ORDER, float16 `scales`."""
    _check_group_size(group_size)

    def convert(name, weight):
        q, scale, zero = quantize_int4(weight, group_size, symmetric=False)
        stem = name.removesuffix(".weight")
        return {stem + ".qweight": pack_int4(np.ascontiguousarray(q.T), AWQ_ORDER),
                stem + ".qzeros": pack_int4(np.ascontiguousarray(zero.T), AWQ_ORDER),
                stem + ".scales": np.ascontiguousarray(scale.T).astype(np.float16)}

    config = {"quant_method": "awq", "bits": 4, "group_size": group_size or -1, "zero_point": True,
              "version": "gemm", "modules_to_not_convert": None}
    return _write_quantized(source, output, convert, config)


def _quantize_in_order(name: str, weight, group_size: int, symmetric: bool, act_order: bool):
    """`quantize_int4` of projection `name`'s weight [out, in], its inputs grouped in turn or (`act_order`) in an
    order of their own: a seeded shuffle standing in for GPTQ's order of the calibration inputs' Hessian, one per
    layer and input as GPTQ's (q/k/v share theirs, gate/up theirs) -> (values, scales, zero points, each input's
    group int32 [in])."""
    width = weight.shape[1]
    order = np.arange(width)
    if act_order:
        inputs = {"k_proj": "q_proj", "v_proj": "q_proj", "qkv_proj": "q_proj", "up_proj": "gate_proj",
                  "gate_up_proj": "gate_proj"}
        layer, projection = name.split(".layers.")[1].split(".")[0], name.rsplit(".", 2)[-2]
        key = f"{layer}.{inputs.get(projection, projection)}".encode()
        order = np.random.default_rng(list(key)).permutation(width)
    q, scale, zero = quantize_int4(weight[:, order], group_size, symmetric)  # groups of consecutive inputs in order
    position = np.argsort(order)  # each input's place in the order
    return q[:, position], scale, zero, (position // (group_size or width)).astype(np.int32)


def _check_group_size(group_size) -> None:
    if not isinstance(group_size, int) or group_size < 0:
        raise ValueError(f"group_size must be a non-negative integer, got {group_size!r}")


def fp8_config(block: tuple[int, int] | None = (128, 128), method: str = "fp8") -> dict:
    """The `quantization_config` of FP8 weights in blocks of `block` [out, in] (None: per tensor for the fp8 method,
    per output channel for compressed-tensors) as `method` writes it: transformers' fine-grained FP8 (`fp8`) or
    llm-compressor's FP8_DYNAMIC / FP8_BLOCK (`compressed-tensors`)."""
    if method == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": None if block is None else list(block)}
    args = dict(num_bits=8, type="float", symmetric=True, group_size=None, actorder=None, observer=None,
                observer_kwargs={})
    weights = args | {"strategy": "block" if block else "channel", "dynamic": False, "observer": "minmax",
                      "block_structure": list(block) if block else None}
    # FP8_DYNAMIC's activations: dynamic per token; FP8_BLOCK's: dynamic per group of 128 inputs
    activations = args | ({"strategy": "group", "group_size": 128} if block else {"strategy": "token"}) | {
        "dynamic": True}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "output_activations": None, "weights": weights,
                                          "input_activations": activations}},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}}


def write_fp8_checkpoint(source: str | Path, output: str | Path, block: tuple[int, int] | None = (128, 128),
                         method: str = "fp8") -> Path:
    """Writes `source` (a float Hugging Face checkpoint directory of a dense model) as an FP8 checkpoint in
    `output`: every decoder layer's projection weight in float8 e4m3 (round to nearest) with float32 scales,
    amax / 448 of each `block` [out, in] (None: per tensor for the fp8 method, per output channel for
    compressed-tensors), in `method`'s format: `fp8` (transformers' fine-grained FP8, as DeepSeek's and Qwen's FP8
    checkpoints: `weight_scale_inv` per block, dynamic activations) or `compressed-tensors` (float-quantized, as
    llm-compressor's FP8_DYNAMIC and FP8_BLOCK: `weight_scale`, dynamic per-token activations)."""
    if method not in ("fp8", "compressed-tensors"):
        raise ValueError(f"method must be 'fp8' or 'compressed-tensors', got {method!r}")
    rows, inputs = _block(list(block), "block") if block is not None else (0 if method == "fp8" else 1, 0)

    def convert(name, weight):
        out, width = weight.shape
        if inputs:
            padded = np.pad(np.abs(weight), ((0, -out % rows), (0, -width % inputs)))
            amax = padded.reshape(-(-out // rows), rows, -(-width // inputs), inputs).max(axis=(1, 3))
            scale = (amax / 448).astype(np.float32)
            full = np.repeat(np.repeat(scale, rows, 0), inputs, 1)[:out, :width]
        else:
            scale = (np.abs(weight).max(axis=1 if rows else None, keepdims=bool(rows)) / 448).astype(np.float32)
            full = scale
        q = (weight / np.where(full > 0, full, 1)).astype(ml_dtypes.float8_e4m3fn)
        suffix = "_scale_inv" if method == "fp8" and inputs else "_scale"
        return {name: q, name + suffix: scale}

    config = fp8_config(block, method)
    return _write_quantized(source, output, convert, config, keep_float32=True)


def _write_quantized(source, output, convert, quantization_config: dict, keep_float32: bool = False) -> Path:
    """Copies `source` to `output` with each decoder layer projection's weight replaced by `convert(name, float32
    weight [out, in])`'s tensors (float32 ones in the weight's dtype unless `keep_float32`) and
    `quantization_config` in config.json."""
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
            experts = ".experts." in name and projection in ("w1", "w2", "w3")  # Mixtral's experts' names
            if ".layers." in name and (projection in QUANTIZED_LINEARS + ("qkv_proj", "gate_up_proj") or experts):
                for key, value in convert(name, tensor.float().numpy()).items():
                    value = np.ascontiguousarray(value)
                    if value.dtype == ml_dtypes.float8_e4m3fn:
                        value = torch.from_numpy(value.view(np.uint8)).view(torch.float8_e4m3fn)
                    else:
                        value = torch.from_numpy(value)
                    float32 = value.dtype == torch.float32 and not keep_float32
                    out[key] = value.to(tensor.dtype) if float32 else value
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
