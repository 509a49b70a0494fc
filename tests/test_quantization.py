"""Quantized checkpoints (compressed-tensors W8A8 int8 and W4A16, GPTQ, AWQ): the oracle is transformers' float
model with each quantized projection's weight replaced by the checkpoint's int8 values and scales and its input
quantized per token, as vLLM's W8A8 kernels compute it, or by the checkpoint's 4-bit weights dequantized."""

import functools
import json
import shutil
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.torch import load_file

from jaxengine import LLMEngine
from jaxengine.cli import main as cli_main
from jaxengine.config import EngineConfig
from jaxengine.models.loader import load_config
from jaxengine.models.quantization import (W4A16, compressed_tensors_config, fp8_config, kv_scale_tensor,
                                           parse_quantization, write_fp8_checkpoint, write_gptq_checkpoint,
                                           write_w4a16_checkpoint, write_w8a8_checkpoint)
from jaxengine.sampling_params import SamplingParams
from pallas_kernels import cpu
from tests import tiny_models
from tests.engine_util import run_to_completion
from tests.lora_util import LORA

ARCHS = ("llama", "qwen3", "phi3", "gemma2")


@pytest.fixture(scope="session")
def quantized(model_dirs, tmp_path_factory):
    """arch -> its W8A8 checkpoint (written by `jaxengine quantize`), "llama-tensor": per-tensor scales, arch + "-w4":
    W4A16 checkpoints (`jaxengine quantize --scheme w4a16`), arch + "-gptq": GPTQ's; ZERO_POINTS' names: 4-bit
    checkpoints with zero points."""
    root = tmp_path_factory.mktemp("w8a8")
    out = {}
    for arch in ARCHS:
        cli_main(["quantize", "--model", str(model_dirs[arch]), "--output", str(root / arch)])
        out[arch] = root / arch
    out["llama-tensor"] = write_w8a8_checkpoint(model_dirs["llama"], root / "llama-tensor", strategy="tensor")
    for arch, group in W4_GROUPS.items():
        cli_main(["quantize", "--model", str(model_dirs[arch]), "--output", str(root / (arch + "-w4")), "--scheme",
                  "w4a16", "--group-size", str(group)])
        out[arch + "-w4"] = root / (arch + "-w4")
    for arch in ("llama", "phi3"):
        out[arch + "-gptq"] = write_gptq_checkpoint(model_dirs[arch], root / (arch + "-gptq"), W4_GROUPS[arch])
    for name, (arch, scheme, group) in ZERO_POINTS.items():
        if name == "llama-gptq-v1":  # the gptq format's zero points minus one (gptq_v2: as they are)
            write_gptq_checkpoint(model_dirs[arch], root / name, group, symmetric=False, checkpoint_format="gptq")
        else:
            cli_main(["quantize", "--model", str(model_dirs[arch]), "--output", str(root / name), "--scheme", scheme,
                      "--group-size", str(group), "--zero-point"])
        out[name] = root / name
    for name, (arch, method, block) in FP8.items():
        out[name] = write_fp8_checkpoint(model_dirs[arch], root / name, block, method)
    with_input_scales(out["phi3-fp8-tensor"])
    for name, (source, style) in KV_SCALED.items():
        out[name] = with_kv_scales(out[source], root / name, style)
    out["qwen2moe-gptq"] = write_gptq_checkpoint(model_dirs["qwen2moe"], root / "qwen2moe-gptq", 16, symmetric=False,
                                                 checkpoint_format="gptq_v2", act_order=True)
    out["mixtral-fp8-block"] = write_fp8_checkpoint(model_dirs["mixtral"], root / "mixtral-fp8-block", (16, 32))
    for name, (arch, kind, symmetric, group) in ACT_ORDER.items():
        out[name] = (write_gptq_checkpoint(model_dirs[arch], root / name, group, symmetric,
                                           "gptq" if symmetric else "gptq_v2", act_order=True) if kind == "gptq" else
                     write_w4a16_checkpoint(model_dirs[arch], root / name, group, symmetric, act_order=True))
    return out


W4_GROUPS = {"llama": 16, "phi3": 8, "qwen3": 0}  # W4A16 checkpoints' group sizes (0: one group per channel)
ZERO_POINTS = {"llama-awq": ("llama", "awq", 16), "phi3-awq": ("phi3", "awq", 8), "qwen3-w4-zp": ("qwen3", "w4a16", 0),
               "phi3-gptq-v2": ("phi3", "gptq", 16), "llama-gptq-v1": ("llama", "gptq", 0)}
# (arch, method, block [out, in]: None per tensor (fp8) or per channel (compressed-tensors)) of FP8 checkpoints;
# Phi-3's with static input scales
FP8 = {"llama-fp8-block": ("llama", "fp8", (32, 48)), "phi3-fp8-tensor": ("phi3", "fp8", None),
       "qwen3-fp8-channel": ("qwen3", "compressed-tensors", None),
       "gemma2-fp8-block": ("gemma2", "compressed-tensors", (16, 32))}
# (arch, format, symmetric, group) of checkpoints in activation order
ACT_ORDER = {"llama-gptq-act": ("llama", "gptq", True, 16), "phi3-gptq-act": ("phi3", "gptq", False, 8),
             "qwen3-w4-act": ("qwen3", "w4a16", False, 16)}


# FP8 checkpoints with each layer's K and V cache scales: (the checkpoint they copy, how they are stored: compressed-
# tensors' kv_cache_scheme and self_attn.k_scale / v_scale, or AutoFP8's "static" and the projections' output_scale)
KV_SCALED = {"qwen3-fp8-kv": ("qwen3-fp8-channel", "compressed-tensors"), "llama-fp8-kv": ("llama-fp8-block", "fp8")}


def kv_scales(layer: int) -> tuple[float, float]:
    """Layer `layer`'s (K, V) cache scales in KV_SCALED's checkpoints: about max|K| / 448 for these models."""
    return 0.01 + 0.0025 * layer, 0.012 - 0.002 * layer


def with_kv_scales(checkpoint, output, style: str):
    """A copy of `checkpoint` with a K and a V cache scale per layer (`kv_scales`), as `style` stores them."""
    from safetensors.torch import save_file

    shutil.copytree(checkpoint, output)
    config = json.loads((output / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = KV_SCHEME if style == "compressed-tensors" else "static"
    (output / "config.json").write_text(json.dumps(config))
    names = ("self_attn.k_scale", "self_attn.v_scale") if style == "compressed-tensors" else (
        "self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale")
    f = sorted(output.glob("*.safetensors"))[0]
    scales = {f"model.layers.{i}.{name}": torch.tensor([scale]) for i in range(config["num_hidden_layers"])
              for name, scale in zip(names, kv_scales(i))}
    save_file(load_file(f) | scales, f, metadata={"format": "pt"})
    return output


def with_fp8_attention(model, kv_cache_dtype: str, scaled: bool = False):
    """transformers' `model` attending over its keys and values as a float8 KV cache holds them: divided by the
    layer's scales (`kv_scales`; 1 unless `scaled`), saturated, rounded to the format (`kv_cache_dtype`) and
    multiplied back."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    dtype = torch.float8_e5m2 if kv_cache_dtype == "fp8_e5m2" else torch.float8_e4m3fn
    limit = torch.finfo(dtype).max

    def rounded(x, scale):
        return (x / scale).clamp(-limit, limit).to(dtype).to(x.dtype) * scale

    def attention(module, query, key, value, attention_mask, **kwargs):
        k_scale, v_scale = kv_scales(module.layer_idx) if scaled else (1.0, 1.0)
        return sdpa_attention_forward(module, query, rounded(key, k_scale), rounded(value, v_scale), attention_mask,
                                      **kwargs)

    name = f"jaxengine-{kv_cache_dtype}{'-scaled' if scaled else ''}"
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)  # sdpa's masks (sliding windows included)
    model.set_attn_implementation(name)
    return model


def with_input_scales(checkpoint):
    """An fp8 checkpoint per tensor made AutoFP8's static form: an `input_scale` per projection (as calibration
    writes them; weights-only FP8 checks them and does not apply them)."""
    from safetensors.torch import save_file

    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"]["activation_scheme"] = "static"
    (checkpoint / "config.json").write_text(json.dumps(config))
    for f in checkpoint.glob("*.safetensors"):
        tensors = load_file(f)
        scales = {name.replace(".weight_scale", ".input_scale"): torch.tensor(0.02) for name in tensors
                  if name.endswith(".weight_scale")}
        save_file(tensors | scales, f, metadata={"format": "pt"})


def nibbles(words, order=range(8)) -> np.ndarray:
    """int32 words [..., n] -> their unsigned 4-bit values [..., 8 n], word j's nibble i value 8 j + order[i]."""
    words = np.asarray(words).astype(np.int64) & 0xFFFFFFFF
    values = np.zeros((*words.shape[:-1], words.shape[-1] * 8), np.int64)
    for i, column in enumerate(order):
        values[..., column::8] = (words >> (4 * i)) & 0xF
    return values


def quantized_tensors(quantized_dir) -> tuple[dict, dict, dict]:
    """A quantized checkpoint's (tensors as float32 or integer numpy arrays, their torch dtypes, its
    quantization_config)."""
    config = json.loads((quantized_dir / "config.json").read_text())["quantization_config"]
    tensors, dtypes = {}, {}
    for f in quantized_dir.glob("*.safetensors"):
        loaded = load_file(f)
        dtypes |= {name: t.dtype for name, t in loaded.items()}
        tensors |= {name: t.float().numpy() if t.is_floating_point() else t.numpy() for name, t in loaded.items()}
    return tensors, dtypes, config


def dequantized_weight(quantized, name: str, out: int, width: int) -> np.ndarray | None:
    """Projection `name`'s float32 weight [out, in] as the checkpoint (`quantized_tensors`) dequantizes it, (value -
    zero point) x its group's scale: compressed-tensors' weight_packed, weight_scale and weight_zero_point (packed
    along the output; none: 8), GPTQ's qweight (packed along the input), scales and qzeros (stored minus one in the
    gptq format) with g_idx's groups where desc_act, AWQ's qweight and qzeros (packed along the output in AWQ's
    order) and scales, or FP8's e4m3 weight and its scales; None for a projection it does not quantize."""
    tensors, dtypes, config = quantized
    if config["quant_method"] == "awq" and name + ".qweight" in tensors:
        order = (0, 2, 4, 6, 1, 3, 5, 7)
        q = nibbles(tensors[name + ".qweight"], order)[:, :out].T
        zero = nibbles(tensors[name + ".qzeros"], order)[:, :out].T
        scale = tensors[name + ".scales"].T
    elif name + ".qweight" in tensors:  # GPTQ
        q = nibbles(tensors[name + ".qweight"].T)[:, :width]
        zero = nibbles(tensors[name + ".qzeros"])[:, :out].T + (config["checkpoint_format"] == "gptq")
        scale = tensors[name + ".scales"].T
    elif name + ".weight" in tensors and dtypes.get(name + ".weight") == torch.float8_e4m3fn:
        block = config.get("weight_block_size") or (config.get("config_groups") or {}).get(
            "group_0", {}).get("weights", {}).get("block_structure")
        scale = tensors.get(name + ".weight_scale_inv", tensors.get(name + ".weight_scale"))
        scale = np.asarray(scale, np.float32).reshape(-1, 1) if block is None else scale
        if block is not None:  # each block's scale over its rows and inputs
            scale = np.repeat(np.repeat(scale, block[0], 0), block[1], 1)[:out, :width]
        return (tensors[name + ".weight"] * scale).astype(np.float32)
    elif name + ".weight_packed" in tensors:
        q = nibbles(tensors[name + ".weight_packed"])[:, :width]
        zero = (nibbles(tensors[name + ".weight_zero_point"].T)[:, :out].T
                if name + ".weight_zero_point" in tensors else np.full((out, 1), 8))
        scale = tensors[name + ".weight_scale"]
    else:
        return None
    gptq = config["quant_method"] == "gptq"
    g_idx = name + (".g_idx" if gptq else ".weight_g_idx")  # activation order: each input's group
    in_order = config["desc_act"] if gptq else g_idx in tensors
    group = tensors[g_idx] if in_order else np.arange(width) // (width // scale.shape[1])
    zero = np.broadcast_to(zero, scale.shape)
    return ((q - zero[:, group]) * scale[:, group]).astype(np.float32)


def dequantized(float_dir, quantized_dir):
    """transformers' model of `float_dir` with each quantized projection's weight as the checkpoint dequantizes it
    (`dequantized_weight`)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    quantized = quantized_tensors(quantized_dir)
    with torch.no_grad():
        for name, module in model.named_modules():
            out, width = getattr(module, "out_features", 0), getattr(module, "in_features", 0)
            values = dequantized_weight(quantized, name, out, width)
            if values is not None:
                module.weight.copy_(torch.from_numpy(values))
    return model


def dequantized_checkpoint(float_dir, quantized_dir, out_dir):
    """transformers' model of a float checkpoint written from `float_dir` with every projection the checkpoint in
    `quantized_dir` quantizes (a mixture of experts' experts too, which transformers holds stacked) dequantized by
    `dequantized_weight`."""
    from safetensors.torch import save_file

    shutil.copytree(float_dir, out_dir)
    quantized, count = quantized_tensors(quantized_dir), 0
    for f in out_dir.glob("*.safetensors"):
        tensors = load_file(f)
        for name, tensor in tensors.items():
            if name.endswith(".weight") and tensor.ndim == 2:
                values = dequantized_weight(quantized, name[:-len(".weight")], *tensor.shape)
                if values is not None:
                    tensors[name], count = torch.from_numpy(values).to(tensor.dtype), count + 1
        save_file(tensors, f, metadata={"format": "pt"})
    assert count
    return transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()


def emulated(float_dir, quantized_dir):
    """transformers' model of `float_dir` computing every projection the checkpoint quantized in W8A8 int8."""
    model = transformers.AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    tensors = {}
    for f in quantized_dir.glob("*.safetensors"):
        tensors |= load_file(f)
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name + ".weight_scale" in tensors:
            weight = tensors[name + ".weight"].double()
            scale = tensors[name + ".weight_scale"].float().reshape(-1)

            def forward(x, weight=weight, scale=scale, bias=module.bias):
                x = x.float()
                x_scale = x.abs().amax(-1, keepdim=True) / 127
                xq = torch.round(x / torch.where(x_scale > 0, x_scale, torch.ones_like(x_scale))).clamp(-128, 127)
                y = (xq.double() @ weight.T).float() * x_scale * scale
                return y if bias is None else y + bias

            module.forward = forward
            count += 1
    assert count == 7 * model.config.num_hidden_layers or model.config.architectures[0] == "Phi3ForCausalLM"
    return model


def prompt_logprobs(engine, prompt):
    out = run_to_completion(engine, [("q", prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))])
    return np.array([entry[token].logprob for entry, token in zip(out["q"].prompt_logprobs[1:], prompt[1:])])


def reference_logprobs(model, prompt):
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1).numpy()
    return ref[np.arange(len(prompt) - 1), prompt[1:]]


PROMPT = list(np.random.default_rng(5).integers(3, tiny_models.VOCAB_SIZE, 70))


@functools.cache
def float_logprobs(float_dir) -> np.ndarray:
    """transformers' float model of `float_dir` on PROMPT: what a quantized model's numbers must measurably differ
    from (its quantized path ran)."""
    return reference_logprobs(
        transformers.AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval(), PROMPT)


def matches_oracle(engine, oracle, float_dir, tolerance: float, off_float: float = 1e-2):
    """Every PROMPT position's log-probability of `engine` within `tolerance` of `oracle`'s (transformers computing
    each quantized projection as the checkpoint says), and more than `off_float` off the float model's at some
    position -> (ours, the oracle's)."""
    ours = prompt_logprobs(engine, PROMPT)
    ref = reference_logprobs(oracle, PROMPT)
    assert np.abs(ours - ref).max() < tolerance
    assert np.abs(ours - float_logprobs(float_dir)).max() > off_float
    return ours, ref


@pytest.mark.parametrize("arch", ARCHS)
def test_w8a8_matches_transformers_with_int8_projections(engines, model_dirs, quantized, arch):
    """Every prompt position's log-probability (a 70-token prompt in three chunks) as the emulated W8A8 model's,
    and measurably off the float model's: the int8 path runs (fused Phi-3 projections split with their scales,
    its partial rotary layout applied to q/k scales; Gemma 2's sandwich norms; Qwen3's one KV head)."""
    engine = engines(arch, model=str(quantized[arch]), max_num_batched_tokens=32, num_kv_blocks=30)
    assert engine.model_config.quantization == "w8a8_int8"
    matches_oracle(engine, emulated(model_dirs[arch], quantized[arch]), model_dirs[arch], 2e-3)


# the 4-bit checkpoints' (arch, method, group, zero points): compressed-tensors' symmetric W4A16 (groups of 16 or 8
# inputs, or one per channel), GPTQ's symmetric ones, and ZERO_POINTS'
FOUR_BIT = ({arch + "-w4": (arch, "compressed-tensors", group, False) for arch, group in W4_GROUPS.items()}
            | {arch + "-gptq": (arch, "gptq", W4_GROUPS[arch], False) for arch in ("llama", "phi3")}
            | {name: (arch, {"w4a16": "compressed-tensors"}.get(scheme, scheme), group, True)
               for name, (arch, scheme, group) in ZERO_POINTS.items()})


@pytest.mark.parametrize("name", list(FOUR_BIT))
def test_4bit_checkpoints_match_transformers_with_dequantized_weights(engines, model_dirs, quantized, name):
    """4-bit weights: compressed-tensors' pack-quantized W4A16 (symmetric; with zero points packed along the
    output), GPTQ's (qweight packed along the input, float16 scales; symmetric with the stored zero point 7 and a
    plain g_idx, or sym=false in gptq_v2 and in the gptq format's zero points stored minus one), AWQ's (its packing
    order along the output); Phi-3's fused projections split with their scales and zero points, Qwen3's one KV
    head: every prompt position's log-probability as transformers' with the weights dequantized, and off the float
    model's."""
    arch, method, group, zero_point = FOUR_BIT[name]
    engine = engines(arch, model=str(quantized[name]), max_num_batched_tokens=32, num_kv_blocks=30)
    cfg = engine.model_config
    assert (cfg.quantization, cfg.quant_method, cfg.quant_group_size, cfg.quant_zero_point) == (
        "w4a16", method, group, zero_point)
    ours, _ = matches_oracle(engine, dequantized(model_dirs[arch], quantized[name]), model_dirs[arch], 1e-4)
    if name == "qwen3-w4-zp":  # its one KV head repeated over tp=2, with its zero points: the same numbers
        two = engines(arch, model=str(quantized[name]), max_num_batched_tokens=32, num_kv_blocks=30,
                      tensor_parallel_size=2)
        np.testing.assert_allclose(prompt_logprobs(two, PROMPT), ours, atol=2e-4)


@pytest.mark.parametrize("name", list(FP8))
def test_fp8_checkpoints_match_transformers_with_dequantized_weights(engines, model_dirs, quantized, name):
    """FP8 weights (e4m3, weights-only: activations in float, as vLLM's CPU build runs them): the fp8 method's blocks
    (weight_scale_inv; blocks straddling the groups of a width they do not divide, a partial last block) and
    per-tensor scales (Phi-3's fused projections; static input scales, not applied), compressed-tensors' per-channel
    and block scales (Qwen3's one KV head, also over tp=2; Gemma 2). float32 (XLA's dequantization) as transformers'
    with the weights dequantized, and off the float model's; bfloat16 on the native matmul's fp8 panels to
    bfloat16's precision."""
    arch, method, block = FP8[name]
    settings = dict(model=str(quantized[name]), max_num_batched_tokens=32, num_kv_blocks=30)
    engine = engines(arch, **settings)
    cfg = engine.model_config
    assert (cfg.quantization, cfg.quant_method) == ("w8a16_fp8", method)
    ours, ref = matches_oracle(engine, dequantized(model_dirs[arch], quantized[name]), model_dirs[arch], 1e-4, 2e-3)
    engine = engines(arch, dtype="bfloat16", **settings)
    dtypes = {path[-1]: v.get_value().dtype for path, v in nnx.to_flat_state(engine.runner.state)}
    if cpu.matmul_available():
        assert dtypes["qkv_proj"] == np.uint8 and dtypes["o_proj_scale"] == np.float32
    error = np.abs(prompt_logprobs(engine, PROMPT) - ref)  # Qwen3's bfloat16 noise: median ~0.025
    assert np.median(error) < 0.04 and error.max() < 0.3, error
    if name == "qwen3-fp8-channel":  # its one KV head repeated over tp=2 with its scales: the same numbers
        two = engines(arch, tensor_parallel_size=2, **settings)
        np.testing.assert_allclose(prompt_logprobs(two, PROMPT), ours, atol=2e-4)


# quantized mixtures of experts: (arch, method); Qwen2 MoE's in GPTQ with zero points and activation order (its shared
# expert a quantized dense MLP), Mixtral's experts (w1/w2/w3) in FP8 blocks straddling their width (48 inputs)
MOE = {"qwen2moe-gptq": ("qwen2moe", "gptq"), "mixtral-fp8-block": ("mixtral", "fp8")}


@pytest.mark.parametrize("name", list(MOE))
def test_quantized_mixtures_of_experts_dequantize_their_experts_at_load(engines, model_dirs, quantized, tmp_path,
                                                                         name):
    """A weight-only quantized mixture of experts: its attention's and shared expert's projections stay quantized,
    its experts are dequantized as they load (held in float); every prompt position's log-probability as
    transformers' with all the checkpoint's weights dequantized, and off the float model's. In bfloat16 the native
    matmul takes the quantized projections' panels and the experts packed for its grouped matmul."""
    arch, method = MOE[name]
    settings = dict(model=str(quantized[name]), max_num_batched_tokens=32, num_kv_blocks=30)
    engine = engines(arch, **settings)
    cfg = engine.model_config
    assert cfg.quant_method == method and cfg.num_experts
    dtypes = {path[-1]: v.get_value().dtype for path, v in nnx.to_flat_state(engine.runner.state)}
    assert dtypes["expert_down"] == np.float32 and dtypes["q_proj"] in (np.int8, jnp.float8_e4m3fn)
    oracle = dequantized_checkpoint(model_dirs[arch], quantized[name], tmp_path / "oracle")
    _, ref = matches_oracle(engine, oracle, model_dirs[arch], 1e-4)
    if name == "mixtral-fp8-block":
        engine = engines(arch, dtype="bfloat16", **settings)
        dtypes = {path[-1]: v.get_value().dtype for path, v in nnx.to_flat_state(engine.runner.state)}
        if cpu.matmul_available():
            assert dtypes["qkv_proj"] == np.uint8 and "expert_gate_up" in dtypes and "expert_gate" not in dtypes
        error = np.abs(prompt_logprobs(engine, PROMPT) - ref)
        assert np.median(error) < 0.04 and error.max() < 0.3, error


def test_w8a8_mixture_of_experts_is_refused(model_dirs, tmp_path):
    """W8A8 int8 experts would need their activations quantized too: refused before loading, naming the schemes that
    load."""
    out = write_w8a8_checkpoint(model_dirs["qwen2moe"], tmp_path / "w8a8-moe")
    with pytest.raises(ValueError, match="a mixture of experts quantized in w8a8_int8 is not supported"):
        load_config(out)


@pytest.mark.parametrize("name", list(ACT_ORDER))
def test_activation_order(engines, model_dirs, quantized, name):
    """GPTQ's desc_act and compressed-tensors' actorder "group": each input's group from g_idx (the inputs grouped in an
    order of their own; Phi-3's fused projections share theirs; with zero points or not). float32 (XLA's
    dequantization, scales and zero points taken by g_idx) as transformers' with the weights dequantized; bfloat16
    on the native matmul (the inputs sorted by group: x's columns taken in that order, the down projection's folded
    into gate/up's columns) to bfloat16's precision."""
    arch, kind, symmetric, group = ACT_ORDER[name]
    settings = dict(model=str(quantized[name]), max_num_batched_tokens=32, num_kv_blocks=30)
    engine = engines(arch, **settings)
    assert engine.model_config.quant_act_order
    ref = reference_logprobs(dequantized(model_dirs[arch], quantized[name]), PROMPT)
    assert np.abs(prompt_logprobs(engine, PROMPT) - ref).max() < 1e-4
    # the same rounding without the order: other numbers
    in_turn = write_w4a16_checkpoint(model_dirs[arch], quantized[name].parent / (name + "-in-turn"), group, symmetric)
    assert np.abs(reference_logprobs(dequantized(model_dirs[arch], in_turn), PROMPT) - ref).max() > 1e-2
    engine = engines(arch, dtype="bfloat16", **settings)
    names = {path[-1] for path, _ in nnx.to_flat_state(engine.runner.state)}
    if cpu.matmul_available():
        assert {"qkv_proj_perm", "o_proj_perm"} <= names and not any(n.endswith(("g_idx", "down_proj_perm"))
                                                                     for n in names), names
    error = np.abs(prompt_logprobs(engine, PROMPT) - ref)  # Qwen3's bfloat16 noise: median ~0.025 in any order
    assert np.median(error) < 0.04 and error.max() < 0.3, error


def test_w4a16_bfloat16_and_tensor_parallel(engines, model_dirs, quantized):
    """bfloat16 (scales in bfloat16, the scanned layer loop, the native matmul's int4 panels where the CPU has AVX-512
    BF16 or AVX2; with AWQ's zero points too) to bfloat16's precision; Qwen3's
    one KV head repeated over tp=2 with its per-channel scales: the single device's numbers."""
    settings = dict(model=str(quantized["qwen3-w4"]), max_num_batched_tokens=32, num_kv_blocks=30)
    one = prompt_logprobs(engines("qwen3", **settings), PROMPT)
    two = prompt_logprobs(engines("qwen3", tensor_parallel_size=2, **settings), PROMPT)
    np.testing.assert_allclose(two, one, atol=2e-4)
    engine = engines("llama", model=str(quantized["llama-w4"]), dtype="bfloat16", max_num_batched_tokens=32,
                     num_kv_blocks=30)
    dtypes = {path[-1]: v.get_value().dtype for path, v in nnx.to_flat_state(engine.runner.state)}
    if cpu.matmul_available():  # packed for the native matmul: q/k/v and gate/up fused, dequantized panel by panel
        assert dtypes["qkv_proj"] == np.uint8 and dtypes["gate_up_proj"] == np.uint8
    ours = prompt_logprobs(engine, PROMPT)
    error = np.abs(ours - reference_logprobs(dequantized(model_dirs["llama"], quantized["llama-w4"]), PROMPT))
    assert np.median(error) < 0.02 and error.max() < 0.1, error
    # zero points (AWQ's): biases beside the panels' scales
    engine = engines("llama", model=str(quantized["llama-awq"]), dtype="bfloat16", max_num_batched_tokens=32,
                     num_kv_blocks=30)
    names = {path[-1] for path, _ in nnx.to_flat_state(engine.runner.state)}
    if cpu.matmul_available():
        assert {"qkv_proj", "gate_up_proj"} <= names and not any(name.endswith("_zero") for name in names)
    ours = prompt_logprobs(engine, PROMPT)
    error = np.abs(ours - reference_logprobs(dequantized(model_dirs["llama"], quantized["llama-awq"]), PROMPT))
    assert np.median(error) < 0.02 and error.max() < 0.1, error


def test_per_tensor_scales_and_the_scanned_layer_loop(engines, model_dirs, quantized):
    engine = engines("llama", model=str(quantized["llama-tensor"]), layer_loop="scan", max_num_batched_tokens=32,
                     num_kv_blocks=30)
    ours = prompt_logprobs(engine, PROMPT)
    ref = reference_logprobs(emulated(model_dirs["llama"], quantized["llama-tensor"]), PROMPT)
    assert np.abs(ours - ref).max() < 2e-3


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_bfloat16_embedding_and_head_around_int8_layers(engines, model_dirs, quantized, arch):
    """dtype bfloat16 on CPU: the layers stay int8 (packed for the native int8 matmul where the CPU has AVX-512
    VNNI: q/k/v and gate/up fused), the embedding and output head bfloat16; greedy tokens as the emulation's."""
    engine = engines(arch, model=str(quantized[arch]), dtype="bfloat16")
    names = {path[-1] for path, _ in nnx.to_flat_state(engine.runner.state)}
    assert ("qkv_proj_comp" in names and "gate_up_proj_comp" in names) == cpu.int8_matmul_available()
    model = emulated(model_dirs[arch], quantized[arch])
    prompt = PROMPT[:20]
    out = run_to_completion(engine, [("g", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                                  logprobs=0))])["g"].outputs[0]
    tokens = list(prompt)
    with torch.no_grad():
        for token, entry in zip(out.token_ids, out.logprobs):
            ref = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1], -1)
            assert abs(entry[token].logprob - float(ref[token])) < 0.05
            assert float(ref[token]) > float(ref.max()) - 0.05  # ours is the emulation's top token (up to bf16)
            tokens.append(token)


def test_tensor_parallel_w8a8_with_repeated_kv_heads(engines, quantized):
    """Qwen3's one KV head repeated over tp=2 with its scales: the single device's log-probabilities."""
    settings = dict(model=str(quantized["qwen3"]), max_num_batched_tokens=32, num_kv_blocks=30)
    one = prompt_logprobs(engines("qwen3", **settings), PROMPT)
    two = prompt_logprobs(engines("qwen3", tensor_parallel_size=2, **settings), PROMPT)
    np.testing.assert_allclose(two, one, atol=2e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lora_adapter_over_int8_layers(engines, model_dirs, quantized, lora_adapters, dtype):
    """A LoRA adapter of all seven projections on the W8A8 Llama (XLA's int8 dots in float32; the native int8
    kernels' fused q/k/v and gate/up in bfloat16): each projection is the W8A8 product plus the adapter's update
    of its unquantized input, as vLLM adds it."""
    from safetensors.numpy import load_file as load_numpy

    lora = lora_adapters["all"][0]
    tensors = load_numpy(f"{lora.lora_path}/adapter_model.safetensors")
    model = emulated(model_dirs["llama"], quantized["llama"])
    for name, module in model.named_modules():
        key = f"base_model.model.{name}.lora_A.weight"
        if key in tensors:
            a, b = torch.tensor(tensors[key]), torch.tensor(tensors[key.replace("lora_A", "lora_B")])
            module.forward = lambda x, base=module.forward, a=a, b=b: base(x) + (16.0 / 8) * (x.float() @ a.T @ b.T)
    engine = engines("llama", model=str(quantized["llama"]), dtype=dtype, max_num_batched_tokens=32,
                     num_kv_blocks=30, **LORA)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    engine.add_request("lq", PROMPT, params, lora_request=lora)
    out = run_to_completion(engine, [])["lq"]
    ours = np.array([entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], PROMPT[1:])])
    ref = reference_logprobs(model, PROMPT)
    error = np.abs(ours - ref)
    if dtype == "float32":  # most positions exact; an activation's int8 rounding may flip at a near tie where the
        # float32 sums before it run in another order (seen on an AVX2 CPU: three positions 4e-3 to 1.3e-2 off)
        assert np.median(error) < 1e-4 and error.max() < 0.03, error
    else:  # bfloat16's precision, as tests/test_lora.py's native bfloat16 test bounds it
        assert np.median(error) < 0.05 and error.max() < 0.3, error
    effect = np.abs(ref - reference_logprobs(emulated(model_dirs["llama"], quantized["llama"]), PROMPT))
    assert np.median(effect) > 0.5


# float8 KV caches: name -> (arch, kv_cache_dtype, the checkpoint: None for the float one, else a KV_SCALED one)
KV_CACHES = {"llama-fp8": ("llama", "fp8", None), "llama-e5m2": ("llama", "fp8_e5m2", None),
             "qwen3-fp8-kv": ("qwen3", "fp8_e4m3", "qwen3-fp8-kv"), "llama-fp8-kv": ("llama", "fp8", "llama-fp8-kv")}


@pytest.mark.parametrize("name", KV_CACHES)
def test_fp8_kv_cache_matches_transformers_over_float8_keys_and_values(engines, model_dirs, quantized, name):
    """`kv_cache_dtype` fp8 / fp8_e4m3 (float8 e4m3fn) and fp8_e5m2, as vLLM's: K and V stored in float8 (divided by
    the checkpoint's scales where it has them: compressed-tensors' kv_cache_scheme, AutoFP8's output scales) and
    widened as they are read. Every prompt position's log-probability as transformers' (with the checkpoint's
    weights) attending over keys and values rounded the same way, and off the same model's over float ones. Llama:
    the fused rotary writer; Qwen3: q/k norms and the plain writer."""
    arch, kv_cache_dtype, checkpoint = KV_CACHES[name]
    source = model_dirs[arch] if checkpoint is None else quantized[checkpoint]
    engine = engines(arch, model=str(source), kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=32,
                     kv_cache_gib=0.01)
    assert engine.runner.kv_cache.dtype == (jnp.float8_e5m2 if kv_cache_dtype == "fp8_e5m2" else jnp.float8_e4m3fn)
    assert engine.model_config.quant_kv_scales == (checkpoint is not None)

    def oracle():
        if checkpoint is None:
            return transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
        return dequantized(model_dirs[arch], source)

    ours = prompt_logprobs(engine, PROMPT)
    want = reference_logprobs(with_fp8_attention(oracle(), kv_cache_dtype, scaled=checkpoint is not None), PROMPT)
    over_float = reference_logprobs(oracle(), PROMPT)
    assert np.abs(ours - want).max() < 1e-3
    assert np.abs(ours - over_float).max() > 2e-2
    if checkpoint is not None:  # the scales applied: rounding without them is measurably off
        unscaled = reference_logprobs(with_fp8_attention(oracle(), kv_cache_dtype), PROMPT)
        assert np.abs(ours - unscaled).max() > 5 * np.abs(ours - want).max()


def test_kv_cache_scales_apply_only_to_a_float8_cache(engines, quantized):
    """A checkpoint's KV cache scales with a float cache (kv_cache_dtype auto) are unused, as vLLM leaves them: the
    same numbers as the checkpoint without them. The float8 cache holds four times the float32 one's blocks in the
    same memory."""
    settings = dict(model=str(quantized["qwen3-fp8-kv"]), max_num_batched_tokens=32, kv_cache_gib=0.01)
    float_cache = engines("qwen3", **settings)
    np.testing.assert_array_equal(
        prompt_logprobs(float_cache, PROMPT),
        prompt_logprobs(engines("qwen3", **(settings | dict(model=str(quantized["qwen3-fp8-channel"])))), PROMPT))
    fp8 = engines("qwen3", kv_cache_dtype="fp8_e4m3", **settings)  # test_fp8_kv_cache_matches_transformers...'s
    assert fp8.block_manager.num_blocks // 4 == float_cache.block_manager.num_blocks


def test_kv_cache_scale_tensors_are_checked_by_name():
    """Each producer's names of a layer's KV cache scales become self_attn.k_scale / v_scale (the older kv_scale:
    both); a query scale (for attention in float8) is checked and dropped; per-head, non-positive or undeclared
    scales are refused naming the tensor."""
    declared, undeclared = SimpleNamespace(quant_kv_scales=True), SimpleNamespace(quant_kv_scales=False)
    stem = "model.layers.3.self_attn"
    for name, kinds in (("k_scale", "k"), ("v_proj.output_scale", "v"), ("k_proj.k_scale", "k"), ("kv_scale", "kv"),
                        ("q_scale", "")):
        pieces = kv_scale_tensor(f"{stem}.{name}", np.array([0.5], np.float32), declared)
        assert [(n, float(a), a.shape) for n, a in pieces] == [(f"{stem}.{k}_scale", 0.5, ()) for k in kinds]
    assert kv_scale_tensor(f"{stem}.k_proj.weight_scale", np.ones(4), declared) is None
    with pytest.raises(ValueError, match=rf"tensor {stem}.k_scale: a KV cache scale must be one positive value "
                                         r"\(per tensor; per-head scales are not supported\), got shape \(2,\)"):
        kv_scale_tensor(f"{stem}.k_scale", np.ones(2, np.float32), declared)
    with pytest.raises(ValueError, match="must be one positive value"):
        kv_scale_tensor(f"{stem}.v_scale", np.zeros(1, np.float32), declared)
    with pytest.raises(ValueError, match=rf"tensor {stem}.k_scale: a KV cache scale, but the checkpoint's "
                                         r"quantization_config has no kv_cache_scheme"):
        kv_scale_tensor(f"{stem}.k_scale", np.ones(1, np.float32), undeclared)


def test_orbax_conversion_keeps_the_int8_layers(engines, quantized, tmp_path):
    """`jaxengine convert` of a W8A8 checkpoint: the Orbax one holds the int8 weights and their scales, and serves
    the same log-probabilities."""
    cli_main(["convert", "--model", str(quantized["qwen3"]), "--output", str(tmp_path / "orbax")])
    settings = dict(max_num_batched_tokens=32, num_kv_blocks=30)
    converted = engines("qwen3", model=str(tmp_path / "orbax"), **settings)
    dtypes = {path[-1]: v.get_value().dtype for path, v in nnx.to_flat_state(converted.runner.state)}
    assert dtypes["q_proj"] == np.int8 and dtypes["q_proj_scale"] == np.float32
    np.testing.assert_allclose(prompt_logprobs(converted, PROMPT),
                               prompt_logprobs(engines("qwen3", model=str(quantized["qwen3"]), **settings), PROMPT),
                               atol=1e-5)


def _config_with(quantization_config: dict) -> dict:
    return {"quantization_config": quantization_config}


def _fp8_args(**changes) -> dict:
    """compressed-tensors' FP8_DYNAMIC config with `changes` (as _group_args)."""
    config = fp8_config(None, "compressed-tensors")
    group = config["config_groups"]["group_0"]
    for path, value in changes.items():
        part, field = path.split("__")
        group[part][field] = value
    return config


def _group_args(scheme="w8a8_int8", **changes) -> dict:
    config = compressed_tensors_config("group", scheme) if scheme == W4A16 else compressed_tensors_config()
    group = config["config_groups"]["group_0"]
    for path, value in changes.items():
        part, field = path.split("__")
        group[part][field] = value
    return config


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
# llm-compressor's float8 KV cache scheme (a K and a V scale per layer)
KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True,
             "group_size": None, "observer": "minmax"}
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
       "modules_to_not_convert": None}


@pytest.mark.parametrize("config, message", [
    (GPTQ | {"bits": 8}, r"bits=8 is not supported \(gptq takes 4\)"),
    ({k: v for k, v in GPTQ.items() if k != "sym"}, r"sym=None must be true or false"),
    (GPTQ | {"desc_act": "yes"}, r"desc_act='yes' must be true or false"),
    (GPTQ | {"checkpoint_format": "marlin"}, r"checkpoint_format='marlin' is not supported"),
    (GPTQ | {"group_size": 0}, r"group_size=0 must be positive or -1"),
    (AWQ | {"bits": 8}, r"bits=8 is not supported \(awq takes 4\)"),
    ({"quant_method": "awq", "w_bit": 3, "q_group_size": 128, "zero_point": True}, r"w_bit=3 is not supported"),
    (AWQ | {"zero_point": False}, r"zero_point=False is not supported \(awq takes true\)"),
    ({k: v for k, v in AWQ.items() if k != "group_size"}, r"group_size is missing \(awq needs it\)"),
    (AWQ | {"version": "gemv"}, r"version='gemv' is not supported; supported: gemm"),
    (AWQ | {"modules_to_not_convert": ["visual", "layers.1.mlp"]},
     r"modules_to_not_convert \['layers.1.mlp'\] is not supported"),
    (FP8_CONFIG | {"fmt": "e5m2"}, r"fmt='e5m2' is not supported \(fp8 takes e4m3\)"),
    (FP8_CONFIG | {"activation_scheme": None}, r"activation_scheme=None must be 'dynamic' or 'static'"),
    (FP8_CONFIG | {"activation_scheme": "static"}, r"block-wise FP8 takes the dynamic activation scheme"),
    (FP8_CONFIG | {"weight_block_size": [128]}, r"weight_block_size=\[128\] must be two positive sizes"),
    (FP8_CONFIG | {"ignored_layers": ["model.layers.0.self_attn.q_proj"]}, r"ignored_layers .* is not supported"),
    (FP8_CONFIG | {"scale_fmt": "ue8m0"}, r"scale_fmt='ue8m0' is not supported"),
])
def test_unsupported_gptq_awq_and_fp8_are_refused_by_field(config, message):
    with pytest.raises(ValueError, match=message):
        parse_quantization(_config_with(config) | {"num_hidden_layers": 2})


def test_gptq_and_awq_configs():
    assert parse_quantization(_config_with(GPTQ)) == ("w4a16", 128, "gptq", False, "gptq", False, 1, False)
    assert parse_quantization(_config_with(GPTQ | {"group_size": -1, "sym": False, "checkpoint_format": "gptq_v2",
                                                   "desc_act": True})) == (
        "w4a16", 0, "gptq", True, "gptq_v2", True, 1, False)
    # AutoAWQ's own names of the fields; modules_to_not_convert naming no decoder projection (a vision tower's)
    awq = {"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": True, "version": "GEMM",
           "modules_to_not_convert": ["visual"]}
    assert parse_quantization(_config_with(awq) | {"num_hidden_layers": 2}) == (
        "w4a16", 64, "awq", True, "gemm", False, 1, False)
    fp8 = ("w8a16_fp8", 128, "fp8", False, "e4m3", False, 64, False)  # blocks of 64 outputs x 128 inputs
    assert parse_quantization(_config_with(FP8_CONFIG | {"weight_block_size": [64, 128]})) == fp8
    # per tensor, static activation scales (checked, not applied: weights-only), ignored layers that are no
    # projection
    assert parse_quantization(_config_with(FP8_CONFIG | {"weight_block_size": None, "activation_scheme": "static",
                                                         "ignored_layers": ["lm_head"]}))[:7:6] == ("w8a16_fp8", 0)
    # AutoFP8's static KV cache scheme: K/V scales stored (applied where the KV cache is fp8)
    assert parse_quantization(_config_with(FP8_CONFIG | {"kv_cache_scheme": "static"})).kv_scales
    # MiniMax-M2's (the hub's): e4m3 under its torch name; "gate" leaves its routers in float, which is no projection
    # under its (Mixtral's) names, but would be a Llama's gate_proj
    minimax = FP8_CONFIG | {"fmt": "float8_e4m3fn", "modules_to_not_convert": ["gate", "e_score_correction_bias",
                                                                           "lm_head"]}
    assert parse_quantization(_config_with(minimax) | {"num_hidden_layers": 2,
                                                       "architectures": ["MiniMaxM2ForCausalLM"]})[:3] == (
        "w8a16_fp8", 128, "fp8")
    with pytest.raises(ValueError, match=r"modules_to_not_convert \['gate'\] is not supported"):
        parse_quantization(_config_with(minimax) | {"num_hidden_layers": 2, "architectures": ["LlamaForCausalLM"]})


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "bitsandbytes"}, r"quant_method 'bitsandbytes' is not supported"),
    (compressed_tensors_config() | {"format": "nvfp4-pack-quantized"},
     r"format 'nvfp4-pack-quantized' is not supported"),
    (compressed_tensors_config() | {"format": "float-quantized"}, r"weights.type='int' is not supported \(w8a16_fp8"),
    (_group_args(input_activations__dynamic=False), r"input_activations.dynamic=False is not supported"),
    (_group_args(weights__symmetric=False), r"weights.symmetric=False is not supported \(w8a8_int8 takes true\)"),
    (_group_args(weights__num_bits=4), r"weights.num_bits=4 is not supported"),
    (_group_args(weights__strategy="group", weights__group_size=128), r"weights.strategy='group' is not supported"),
    (_group_args(input_activations__strategy="tensor"), r"input_activations.strategy='tensor' is not supported"),
    (compressed_tensors_config() | {"ignore": ["lm_head", "model.layers.0.mlp.down_proj"]},
     r"ignore \['model.layers.0.mlp.down_proj'\] is not supported"),
    (compressed_tensors_config() | {"kv_cache_scheme": KV_SCHEME | {"strategy": "attn_head"}},
     r"kv_cache_scheme.strategy='attn_head' is not supported; supported: a static float8 scheme"),
    (compressed_tensors_config() | {"kv_cache_scheme": KV_SCHEME | {"type": "int"}}, r"kv_cache_scheme.type='int'"),
    (compressed_tensors_config() | {"kv_cache_scheme": KV_SCHEME | {"dynamic": True}},
     r"kv_cache_scheme.dynamic=True"),
    (FP8_CONFIG | {"kv_cache_scheme": "dynamic"}, r"kv_cache_scheme='dynamic' is not supported; supported: 'static'"),
    (_group_args(W4A16, weights__symmetric=None), r"weights.symmetric=None is not supported \(w4a16 takes true or"),
    (_group_args(W4A16, weights__num_bits=8), r"weights.num_bits=8 is not supported \(w4a16 takes 4\)"),
    (_group_args(W4A16, weights__actorder="dynamic"), r"weights.actorder='dynamic' is not supported"),
    (_group_args(weights__actorder="group"),
     r"weights.actorder='group' is not supported; supported: None, static, weight$"),
    (_fp8_args(weights__strategy="group", weights__group_size=128), r"weights.strategy='group' is not supported"),
    (_fp8_args(weights__strategy="block", weights__block_structure=[128]), r"block_structure=\[128\] must be two"),
    (_fp8_args(input_activations__type="int"), r"8-bit int activations with FP8 weights are not supported"),
    (_fp8_args(input_activations__dynamic=False), r"strategy='token' \(dynamic=False\) is not supported"),
    (_fp8_args(weights__symmetric=False), r"weights.symmetric=False is not supported \(w8a16_fp8 takes true\)"),
    (_group_args(W4A16, weights__group_size=None), r"weights.group_size=None: the group strategy needs a positive"),
    (compressed_tensors_config("group", W4A16) | {"config_groups": {"group_0": {
        "targets": ["Linear"], "weights": compressed_tensors_config("group", W4A16)["config_groups"]["group_0"][
            "weights"], "input_activations": {"num_bits": 8}}}}, r"input_activations is not supported with pack"),
])
def test_unsupported_quantization_is_refused_by_field(config, message):
    with pytest.raises(ValueError, match=message):
        parse_quantization(_config_with(config))
    assert parse_quantization({}) is None
    ct, packed = "compressed-tensors", "pack-quantized"
    assert parse_quantization(_config_with(compressed_tensors_config("tensor"))) == (
        "w8a8_int8", 0, ct, False, "int-quantized", False, 1, False)
    assert parse_quantization(_config_with(compressed_tensors_config("group", W4A16, 64))) == (
        "w4a16", 64, ct, False, packed, False, 1, False)
    assert parse_quantization(_config_with(compressed_tensors_config("channel", W4A16))) == (
        "w4a16", 0, ct, False, packed, False, 1, False)
    assert parse_quantization(_config_with(_group_args(W4A16, weights__symmetric=False))) == (
        "w4a16", 128, ct, True, packed, False, 1, False)
    assert parse_quantization(_config_with(_group_args(W4A16, weights__actorder="group"))) == (
        "w4a16", 128, ct, False, packed, True, 1, False)
    assert parse_quantization(_config_with(_group_args(W4A16, weights__actorder="weight")))[5] is False


def test_quantization_setting_must_be_the_checkpoints(model_dirs, quantized, tmp_path):
    with pytest.raises(ValueError, match="quantization must be one of compressed-tensors, gptq, awq, fp8"):
        EngineConfig(quantization="bitsandbytes")
    with pytest.raises(ValueError, match="quantization='gptq' does not match the checkpoint's quant_method "
                                         "'compressed-tensors'"):
        LLMEngine(EngineConfig(model=str(quantized["llama"]), quantization="gptq"), progress=False)
    with pytest.raises(ValueError, match="not a quantized checkpoint"):
        LLMEngine(EngineConfig(model=str(model_dirs["llama"]), quantization="compressed-tensors"), progress=False)
    moe = tmp_path / "moe"
    shutil.copytree(model_dirs["mixtral"], moe)
    config = json.loads((moe / "config.json").read_text()) | {"quantization_config": compressed_tensors_config()}
    (moe / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="a mixture of experts quantized in w8a8_int8 is not supported"):
        load_config(moe)
    with pytest.raises(ValueError, match="already quantized"):
        write_w8a8_checkpoint(quantized["llama"], tmp_path / "twice")
