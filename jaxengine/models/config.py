"""Model hyper-parameters read from a Hugging Face `config.json`."""

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    params: tuple = ()  # sorted (key, value) pairs of the HF rope dict, hashable
    # LongRoPE: the long factors at every position (vLLM's rule where max_model_len exceeds the original length:
    # one set of factors for the whole KV cache), else the short ones
    long: bool = False

    def param(self, name, default=None):
        return dict(self.params).get(name, default)

    def rotary_dim(self, head_dim: int) -> int:
        """How many of a head's dimensions rotate (the first ones, in transformers' layout): all, or the
        `partial_rotary_factor` of them (Phi-4-mini's 0.75). Proportional rope (Gemma 4) spans the whole head: its
        factor zeroes the higher frequencies instead (`rope_inv_freq`)."""
        if self.rope_type == "proportional":
            return head_dim
        return int(head_dim * self.param("partial_rotary_factor", 1.0))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    sliding_windows: tuple  # per layer; 0 = full attention; -n: chunked attention in chunks of n (Llama 4)
    torch_dtype: str | None = None
    eos_token_ids: tuple = ()
    bos_token_id: int | None = None
    hidden_act: str = "silu"  # the MLP's gate activation: silu, gelu or gelu_tanh (tanh approximation)
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size), in the weights' dtype
    norm_offset: bool = False  # Gemma: every RMSNorm scales by 1 + weight, in float32
    sandwich_norms: bool = False  # Gemma 2/3: norms on the attention's and the MLP's outputs too
    # OLMo 2/3, EXAONE 4: no norms on the attention's and MLP's inputs (sandwich_norms' output norms only)
    pre_norms: bool = True
    qk_norm_whole: bool = False  # OLMo 2/3: the q and k norms over the whole projection (every head), not per head
    qk_norm_per_head: bool = False  # Cohere, StableLM: each head's q/k norm has weights of its own ([heads x head_dim])
    qk_norm_after_rope: bool = False  # HunYuan: the per-head q/k norms on the rotated q and k
    # LayerNorm models (Cohere, StarCoder2, Phi, StableLM, GPT-NeoX): every norm takes the mean out too
    # (layers.norms.layer_norm; its epsilon in rms_norm_eps), the input and final norms with biases where norm_bias
    # (q/k norms where qk_norm_bias: Phi's)
    layer_norm: bool = False
    norm_bias: bool = False
    qk_norm_bias: bool = False
    # The attention and the MLP both read the layer's input, their outputs added to it together: 1, through one norm
    # (Cohere, Phi, StableLM's use_parallel_residual), 2: each through its own (GPT-NeoX); 0: in turn
    parallel_block: int = 0
    gated_mlp: bool = True  # False: the MLP is down(act(up(x))), no gate (StarCoder2, Phi, GPT-NeoX)
    mlp_bias: bool = False  # biases on the MLP's projections (gate, up and down)
    lm_head_bias: bool = False  # Phi: a bias on the logits
    # Learned absolute positions (GPT-2, OPT): position p's row p + position_offset of `pos_embed` joins the token's
    # embedding; such models have no rotary embedding (rope_layers all false)
    learned_positions: bool = False
    position_offset: int = 0
    attn_scale: float | None = None  # the scores' scale; None: head_dim ** -0.5
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) before the softmax
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    local_rope: RopeConfig | None = None  # Gemma 3: the sliding-window layers' own rotary settings
    rope_layers: tuple = ()  # SmolLM3: per layer, whether it rotates q and k (its NoPE layers do not); (): all do
    rope_interleaved: bool = False  # GLM: rotary pairs (2i, 2i + 1), laid out at load as the half-split ones
    # Ministral 3, Llama 4 (its attention temperature): (beta, length, offset, nope_only): each query times 1 + beta *
    # log(1 + floor((position + offset) / length)), in every layer or (nope_only) in those without rotary embedding;
    # (): none
    q_position_scale: tuple = ()
    qk_l2_norm: bool = False  # Llama 4: q and k RMS-normalised without a weight after the rotation, in rotating layers
    # Granite: each layer's attention and MLP outputs join the residual times this, and the logits are divided by
    # logits_scaling; both folded into the weights at load (o_proj and down_proj, the final norm)
    residual_scale: float = 1.0
    logits_scaling: float = 1.0
    # Mixture of experts (every layer): a token's MLP is the router's top `experts_per_token` of `num_experts`
    # gated MLPs of `moe_intermediate_size`; `intermediate_size` is then a shared expert's (Qwen2 MoE), 0 if none
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top experts' router probabilities to sum to 1
    shared_expert_gate: bool = False  # Qwen2 MoE: the shared expert's output times sigmoid(x @ gate)
    moe_bias: bool = False  # GPT-OSS: biases on the router's logits and on each expert's gate, up and down products
    # DeepSeek V3's router (GLM-4.5's): sigmoid scores, a correction bias for the choice, groups (n_group,
    # topk_group), the weights times routed_scaling_factor (layers.moe.Routing); softmax: the others'
    router_scoring: str = "softmax"
    router_groups: tuple = ()
    routed_scaling: float = 1.0
    router_float32: bool = False  # DeepSeek's routers (GLM-4.5's, dots'): the logits from float32 weights
    router_correction: bool = False  # DeepSeek V3's and ERNIE 4.5's routers: a correction bias on the scores for the
    # choice
    router_renorm_eps: float = 1e-20  # added to the top experts' weights' sum where renormalised (LFM2-MoE: 1e-6)
    router_jitter_eps: float = 0.0  # router_scoring "sparsemixer" (Phi-3.5-MoE): its router_jitter_noise
    moe_input_scaled: bool = False  # Llama 4: each routed token's input times its router weight, not the output
    # Gemma 4 (26B-A4B): the experts beside the dense MLP, each reading the residual through a norm of its own (the
    # router too: a scaled norm; its weights times a scale per expert), their outputs normed apart, then summed
    experts_beside_mlp: bool = False
    # A mixture of experts with dense layers among its expert ones (GLM-4.5's first_k_dense_replace): those layers'
    # dense MLP, of dense_intermediate_size (each run of alike layers is its own stack: llama.layer_groups)
    dense_mlp_layers: tuple = ()
    dense_intermediate_size: int = 0
    swiglu_alpha: float = 1.702  # hidden_act "swigluoai" (GPT-OSS's experts): layers.moe.swiglu_oai's alpha
    swiglu_limit: float = 7.0  # and its clamp
    attn_sinks: bool = False  # GPT-OSS: a learned logit per query head in the attention's softmax (layers.attention)
    # None, "w8a8_int8", "w4a16" or "w8a16_fp8": the decoder layers' projections quantized (jaxengine/models/
    # quantization.py); W4A16's weights in groups of quant_group_size inputs (0: one group per output channel), with
    # a zero point per group where quant_zero_point (asymmetric); FP8's scales in blocks of quant_block_out outputs
    # x quant_group_size inputs
    quantization: str | None = None
    quant_group_size: int = 0
    quant_method: str | None = None  # the checkpoint's format: compressed-tensors, gptq, awq, fp8 or mxfp4 (GPT-OSS's
    # experts: `quantization` None; dequantized at load unless mxfp4_experts)
    # MXFP4 experts kept as they are (the loader's choice where the native CPU matmul runs them: the model then holds
    # each layer's experts as pallas_kernels.cpu.pack_mxfp4_panels' codes and exponents, registry._GptOssTensors)
    mxfp4_experts: bool = False
    quant_zero_point: bool = False
    quant_format: str = ""  # the method's own format (quantization.Quantized.format): GPTQ's gptq or gptq_v2, ...
    quant_act_order: bool = False  # W4A16: each input's group given by a g_idx (activation order)
    quant_block_out: int = 1  # FP8: the weights' scale blocks along the output (1: per channel, 0: one per tensor)
    # Each layer's K and V cache scales stored (kv_cache_scheme): applied where the KV cache is fp8
    quant_kv_scales: bool = False
    # Multi-head latent attention (DeepSeek V2/V3) where kv_lora_rank > 0: each token's keys and values come from one
    # latent of kv_lora_rank (normed) and a shared rotary key of qk_rope_head_dim, which the KV cache holds as its one
    # KV head (head_dim = kv_lora_rank + qk_rope_head_dim); each query head's qk_nope_head_dim unrotated and
    # qk_rope_head_dim rotated dimensions come from the hidden state (q_lora_rank 0) or through a q_lora_rank latent;
    # its values have v_head_dim
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Gemma 4: the full-attention layers' (sliding_windows 0) own (head_dim, num_kv_heads, k_eq_v); () where they are
    # the model's. Each kind keeps its own layer stacks (llama.layer_groups) and KV cache (llama.kv_cache_kinds)
    full_attention_heads: tuple = ()
    k_eq_v: bool = False  # the values are the key projection's output, before its norm and rotation (no v_proj)
    v_norm: bool = False  # Gemma 4: the values RMS-normalised without a weight
    layer_scale: bool = False  # Gemma 4: each layer's output (residual included) times a scalar of its own
    # Gemma 4 E2B/E4B: per-layer embeddings (PLE): each layer takes an input of this width of its own (from a
    # per-layer table of `per_layer_vocab_size` tokens and a projection of the embeddings), gating a residual branch
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    # Gemma 4 E2B/E4B: the last this many layers compute no K/V: each reads the KV cache of the last earlier layer of
    # its kind (the cache has num_layers - kv_shared_layers layers); their MLPs twice as wide where double_wide_mlp
    kv_shared_layers: int = 0
    double_wide_mlp: bool = False
    kv_source: int = -1  # a stack of such layers (llama.layer_groups): the cache layer its layers read
    # A stack's KV cache where the model has one per kind of layer (Gemma 4: 0 sliding-window, 1 full attention) and
    # its first layer's there (-1: the model's one cache, the stack's first layer's own index)
    kv_cache_index: int = 0
    kv_first: int = -1
    # Gated DeltaNet linear attention (Qwen3.5, Qwen3-Next): these layers mix tokens through a recurrent state per
    # sequence and a short causal convolution (jaxengine/layers/linear_attention.py), not attention over the KV cache;
    # `linear_heads`: (key heads, value heads, key head_dim, value head_dim, convolution width). A stack of them
    # (llama.layer_groups) has `linear_attention`; its state is the model's second cache (kv_cache_index 1)
    linear_layers: tuple = ()
    linear_heads: tuple = ()
    linear_attention: bool = False
    attn_output_gate: bool = False  # Qwen3.5, Qwen3-Next: the attention's output times sigmoid(x @ its gate), per head
    # Kimi Linear: the linear layers are Kimi Delta Attention: the decay each key row's own (from a low-rank
    # projection, a time-step bias per channel), the output gate low-rank and through a sigmoid
    linear_kda: bool = False
    # LFM2: the state layers (`linear_layers`) are gated short convolutions of this width instead (C * conv(B * x),
    # B, C and x from one projection; their state the convolution's only), with biases where `conv_bias`
    short_conv_width: int = 0
    conv_bias: bool = False
    # Granite 4.0-H: the state layers are Mamba2 mixers instead: (heads, head_dim, state size, groups, convolution
    # width); biases on the convolution and on the in/out projections where given; the time step's clamp (min, max)
    # where not (0, inf)
    ssm_heads: tuple = ()
    ssm_conv_bias: bool = False
    ssm_proj_bias: bool = False
    ssm_dt_limit: tuple = ()
    ssm_activation: str = "silu"  # the Mamba2 convolution's (Granite's hidden_act, Nemotron-H's mamba_hidden_act)
    # Mamba (1: MambaForCausalLM, FalconMamba, Jamba): the state layers are Mamba1 mixers instead: (inner width, state
    # size, time-step rank, convolution width): each inner channel its own [state size] state, decayed by exp(dt A)
    # per state (A [inner, state size]), written dt x along B, read along C (B, C and dt from the convolved x);
    # `ssm_bcdt_norm`: (weighted, eps) RMS norms on dt's, B's and C's inputs (Jamba's with weights, FalconMamba's
    # without), () none. Biases on the convolution (`ssm_conv_bias`) and the in/out projections (`ssm_proj_bias`)
    mamba1: tuple = ()
    ssm_bcdt_norm: tuple = ()
    # The Mamba2 output's norm (per group, with a weight): "gated" over y x silu(z) (Granite's, Nemotron-H's),
    # "before_gate" over y, then times silu(z), or "" none (Falcon-H1's mamba_rms_norm false: y x silu(z))
    ssm_norm: str = "gated"
    # Falcon-H1: every layer is an attention layer with a Mamba2 mixer beside it, both over its normed input, their
    # outputs summed into the residual (linear_layers: all of them, for the state; their stacks read and write both
    # caches); its muP multipliers ((name, value) pairs) folded into the weights at load (registry._falcon_h1_tensors)
    ssm_parallel: bool = False
    mup_multipliers: tuple = ()
    # Nemotron-H: layers without an MLP (a stack of them has intermediate_size 0 and no experts: llama.layer_groups);
    # and where a checkpoint's layers are single blocks, each of our layers' (its mixer's, its MLP's or -1)
    no_mlp_layers: tuple = ()
    layer_sources: tuple = ()
    # Nemotron 3 Super: the experts read and write a latent of this width, projected from and back to the hidden
    # state (the router and shared expert read the hidden state itself)
    moe_latent_size: int = 0

    @property
    def kv_cache_layers(self) -> int:
        """The KV cache's layers: one per layer but those that share an earlier one's (`kv_shared_layers`) and the
        linear-attention ones (`linear_layers`: a state instead, unless beside the attention: `ssm_parallel`)."""
        return self.num_layers - self.kv_shared_layers - (0 if self.ssm_parallel else len(self.linear_layers))

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def sm_scale(self) -> float:
        return self.head_dim ** -0.5 if self.attn_scale is None else self.attn_scale

    @property
    def mlp_input_norm(self) -> bool:
        """The MLP's input has a norm of its own (`mlp_norm`): not in a model with output norms only, nor where a
        parallel block's attention and MLP share one, nor in a layer without an MLP."""
        return self.pre_norms and self.parallel_block != 1 and bool(self.intermediate_size or self.num_experts)

    @property
    def latent_attention(self) -> bool:
        """Multi-head latent attention (`kv_lora_rank`)."""
        return self.kv_lora_rank > 0

    @property
    def chunked_attention(self) -> bool:
        """Some layer attends in chunks (Llama 4: a negative `sliding_windows` entry)."""
        return min(self.sliding_windows, default=0) < 0

    @property
    def rope_head_dim(self) -> int:
        """The width the rotary embedding's tables span: a head's (latent attention's: its rotated part's)."""
        return self.qk_rope_head_dim if self.latent_attention else self.head_dim


def read_hf_config(model_dir: Path, overrides: dict | None = None) -> dict:
    """config.json, with `overrides` (vLLM's --hf-overrides) over its keys: a key's value replaces the file's,
    except in a nested config (`text_config`, ...: a dict on both sides), whose keys are overridden one by one."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json: not a Hugging Face model directory")
    return _overridden(json.loads(path.read_text()), overrides or {})


def _overridden(config: dict, overrides: dict) -> dict:
    out = dict(config)
    for key, value in overrides.items():
        nested = key.endswith("_config") and isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _overridden(out[key], value) if nested else value
    return out


def parse_rope(hf: dict) -> RopeConfig:
    """Reads `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (older configs)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported; supported rope types: {', '.join(SUPPORTED_ROPE_TYPES)}")
    partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor"))
    partial = 1.0 if partial is None else partial
    if not (isinstance(partial, (int, float)) and 0 < partial <= 1):
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {partial!r}")
    if partial != 1:
        params["partial_rotary_factor"] = float(partial)
    if rope_type in ("longrope", "su"):  # Phi-3's; its original length may sit beside the rope dict
        rope_type = "longrope"
        params.setdefault("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
        params = {k: tuple(v) if isinstance(v, list) else v for k, v in params.items()}
    return RopeConfig(theta=float(theta), rope_type=rope_type, params=tuple(sorted(params.items())))


def rope_inv_freq(rope: RopeConfig, head_dim: int, max_position_embeddings: int):
    """Returns (inv_freq f32[rotary_dim // 2], attention_scaling) as transformers computes them (a partial rotary
    embedding's over its rotary dimensions: `rope_tables` pads them to the head)."""
    head_dim = rope.rotary_dim(head_dim)
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    scaling = 1.0
    if rope.rope_type == "proportional":  # Gemma 4's: the first partial_rotary_factor of the pairs (i, i + head_dim
        # / 2) rotate at the full head's frequencies, the others by angle 0; then divided by `factor`
        rotating = int(rope.param("partial_rotary_factor", 1.0) * head_dim // 2)
        inv_freq = np.where(np.arange(head_dim // 2) < rotating, inv_freq, 0.0) / rope.param("factor", 1.0)
    elif rope.rope_type == "linear":
        inv_freq = inv_freq / rope.param("factor")
    elif rope.rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope)
    elif rope.rope_type == "yarn":
        inv_freq, scaling = _yarn_inv_freq(rope, head_dim, max_position_embeddings)
    elif rope.rope_type == "longrope":
        inv_freq, scaling = _longrope_inv_freq(rope, head_dim, max_position_embeddings)
    return inv_freq.astype(np.float32), float(scaling)


def _longrope_inv_freq(rope, head_dim, max_position_embeddings):
    """LongRoPE (Phi-3) with its short factors, which transformers uses while a sequence is within
    original_max_position_embeddings, or (`rope.long`) its long ones, which it uses past that length and vLLM at
    every position once max_model_len exceeds it (LLMEngine._long_rope); the attention factor from the ratio of the
    two lengths, as transformers computes it (for either set)."""
    original = rope.param("original_max_position_embeddings")
    name = "long_factor" if rope.long else "short_factor"
    factors = np.asarray(rope.param(name), np.float64)
    if original is None or factors.shape != (head_dim // 2,):
        raise ValueError(f"longrope needs original_max_position_embeddings and {head_dim // 2} {name} values")
    factor = rope.param("factor") or max_position_embeddings / original
    attention = rope.param("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return 1.0 / (factors * rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)), attention


def _llama3_inv_freq(inv_freq, rope):
    factor = rope.param("factor")
    low, high = rope.param("low_freq_factor"), rope.param("high_freq_factor")
    old_len = rope.param("original_max_position_embeddings")
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, smoothed, scaled)


def _yarn_inv_freq(rope, head_dim, max_position_embeddings):
    base, dim = rope.theta, head_dim
    original = rope.param("original_max_position_embeddings") or max_position_embeddings
    factor = rope.param("factor") or max_position_embeddings / original

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.param("attention_factor")
    if attention_factor is None:
        m, m_all = rope.param("mscale"), rope.param("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = rope.param("beta_fast") or 32
    beta_slow = rope.param("beta_slow") or 1

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.param("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # share of the extrapolated (unscaled) frequency
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor


def _sliding_windows(hf: dict, num_layers: int) -> tuple:
    window = hf.get("sliding_window") or 0
    layer_types = hf.get("layer_types")
    if layer_types is not None:
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"layer_types {unknown} are not supported; only full_attention and sliding_attention")
        if "sliding_attention" in layer_types and not window:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        return tuple(window if t == "sliding_attention" else 0 for t in layer_types)
    if "use_sliding_window" in hf:  # Qwen2 / Qwen3 configs without layer_types
        if not hf["use_sliding_window"] or not window:
            return (0,) * num_layers
        first = hf.get("max_window_layers", num_layers)
        return tuple(window if i >= first else 0 for i in range(num_layers))
    return (window,) * num_layers


def _as_tuple(ids) -> tuple:
    if ids is None:
        return ()
    return tuple(ids) if isinstance(ids, (list, tuple)) else (ids,)


# transformers' activation names -> ours (gelu_new is the same tanh approximation as gelu_pytorch_tanh)
ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
               "relu": "relu", "relu2": "relu2"}


def check_rotary_dim(rope: RopeConfig, head_dim: int) -> None:
    rotary = rope.rotary_dim(head_dim)
    if rotary < 2 or rotary % 2:
        raise ValueError(f"partial_rotary_factor={rope.param('partial_rotary_factor')} of head_dim={head_dim} "
                         f"rotates {rotary} dimensions; it must rotate an even number, at least 2")


def model_config_from_hf(hf: dict, *, qkv_bias=None, o_bias=None, qk_norm=False) -> ModelConfig:
    """`qkv_bias`/`o_bias` default to HF's `attention_bias`; architectures override what they hard-wire."""
    act = hf.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise ValueError(f"hidden_act {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    num_heads = hf["num_attention_heads"]
    num_kv_heads = hf.get("num_key_value_heads") or num_heads
    if num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
    num_layers = hf["num_hidden_layers"]
    attention_bias = bool(hf.get("attention_bias", False))
    head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
    rope = parse_rope(hf)
    check_rotary_dim(rope, head_dim)
    return ModelConfig(
        architecture=hf["architectures"][0],
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope=rope,
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias if qkv_bias is None else qkv_bias,
        o_bias=attention_bias if o_bias is None else o_bias,
        qk_norm=qk_norm,
        sliding_windows=_sliding_windows(hf, num_layers),
        torch_dtype=hf.get("dtype") or hf.get("torch_dtype"),
        eos_token_ids=_as_tuple(hf.get("eos_token_id")),
        bos_token_id=hf.get("bos_token_id"),
        hidden_act=ACTIVATIONS[act],
        mlp_bias=bool(hf.get("mlp_bias", False)),
    )


def _completed(hf: dict, config_class: str) -> dict:
    """`hf` read through transformers' `config_class` (its defaults filled in, its older keys converted), with the
    checkpoint's own architectures."""
    import transformers

    given = {k: v for k, v in hf.items() if k not in ("architectures", "model_type")}
    return getattr(transformers, config_class)(**given).to_dict() | {"architectures": hf["architectures"]}


def _positive(hf: dict, name: str, default: float) -> float:
    """Config key `name` (`default` where absent) as a float; a ValueError unless it is a positive number."""
    value = hf.get(name, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return float(value)


def _every_nth_full(num_layers: int, n: int) -> list[str]:
    """layer_types with every n-th layer full attention, the others sliding-window ones (as transformers derives
    them from Gemma's and EXAONE 4's patterns)."""
    return ["sliding_attention" if (i + 1) % n else "full_attention" for i in range(num_layers)]


def _language_model_config(hf: dict, text: dict, architecture: str, top_level: tuple[str, ...]) -> dict:
    """A vision-language config's text model config `text` (transformers' defaults filled in) as `architecture`'s,
    with the top level's `top_level` keys where it gives them."""
    return text | {"architectures": [architecture]} | {key: hf[key] for key in top_level if hf.get(key) is not None}


def granite_config_from_hf(hf: dict) -> ModelConfig:
    """Granite (3.x dense): the Llama layer with four multipliers: the embeddings' (`embedding_multiplier`), the
    scores' scale (`attention_multiplier`, for head_dim ** -0.5), the attention's and MLP's outputs' before they
    join the residual (`residual_multiplier`) and the logits' divisor (`logits_scaling`)."""
    multipliers = {name: _positive(hf, name, 1.0) for name in ("embedding_multiplier", "attention_multiplier",
                                                                "residual_multiplier", "logits_scaling")}
    if hf.get("quantization_config"):
        raise ValueError("quantized Granite checkpoints are not supported (its residual_multiplier and logits_scaling "
                         "are folded into float weights at load)")
    cfg = model_config_from_hf(hf)
    return dataclasses.replace(cfg, embed_scale=multipliers["embedding_multiplier"],
                               attn_scale=multipliers["attention_multiplier"],
                               residual_scale=multipliers["residual_multiplier"],
                               logits_scaling=multipliers["logits_scaling"])


def hyperclovax_config_from_hf(hf: dict) -> ModelConfig:
    """HyperCLOVA X SEED (`HyperCLOVAXForCausalLM`): Granite's multipliers (but the logits *times* `logits_scaling`, and
    `attention_multiplier` by default head_dim ** -0.5) and, with `use_post_norm` (the default), a norm on each of the
    attention's and MLP's outputs before they join the residual (Peri-LN: sandwich norms; the residual multiplier is
    then folded into those norms' weights at load, registry._hyperclovax_tensors)."""
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    cfg = granite_config_from_hf(hf | {"attention_multiplier": hf.get("attention_multiplier") or head_dim ** -0.5,
                                       "logits_scaling": 1 / _positive(hf, "logits_scaling", 1.0)})
    return dataclasses.replace(cfg, sandwich_norms=bool(hf.get("use_post_norm", True)))


GRANITE_MOE_ARCHITECTURES = ("GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM")


def granite_moe_config_from_hf(hf: dict) -> ModelConfig:
    """Granite 3.0/3.1 mixtures of experts (`GraniteMoeForCausalLM`: granite-3.1-3b-a800m, ...) and those with a
    shared expert beside them (`GraniteMoeSharedForCausalLM`, of `shared_intermediate_size`): Granite's four
    multipliers over a mixture of experts in every layer, each of `intermediate_size`, weighted by the softmax over the
    top `num_experts_per_tok` logits (the softmax over all, renormalised)."""
    cfg = granite_config_from_hf(hf)
    shared = hf.get("shared_intermediate_size") or 0 if hf["architectures"][0] == "GraniteMoeSharedForCausalLM" else 0
    return dataclasses.replace(cfg, num_experts=hf["num_local_experts"], experts_per_token=hf["num_experts_per_tok"],
                               moe_intermediate_size=cfg.intermediate_size, intermediate_size=shared,
                               norm_topk_prob=True)


def granite_moe_hybrid_config_from_hf(hf: dict) -> ModelConfig:
    """Granite 4.0 (`GraniteMoeHybridForCausalLM`: granite-4.0-h-micro, -h-tiny, -h-small; granite-4.0-micro, whose
    layers are all attention): by `layer_types` (the hub's mamba / attention, transformers' linear_attention /
    full_attention), Mamba2 mixers (`ssm_heads`: mamba_n_heads of mamba_d_head (by default mamba_expand x hidden_size
    split among them), mamba_d_state, mamba_n_groups, mamba_d_conv) among Granite's attention layers (its four
    multipliers, the residual one folded into the mixers' output projections too; no rotary embedding where
    `position_embedding_type` is nope, 4.0-H's), each layer's MLP GraniteMoe's experts (`num_local_experts`; 0: none)
    beside a shared MLP of `shared_intermediate_size`."""
    arch = hf["architectures"][0]
    if hf.get("quantization_config"):
        raise ValueError(f"quantized {arch} checkpoints are not supported yet (their Mamba2 layers' projections are "
                         f"float only)")
    num_layers = hf["num_hidden_layers"]
    types = hf.get("layer_types") or hf.get("layers_block_type") or ["mamba"] * num_layers
    kinds = {"mamba": True, "linear_attention": True, "attention": False, "full_attention": False}
    if len(types) != num_layers or not set(types) <= set(kinds):
        raise ValueError(f"layer_types must give each of the {num_layers} layers mamba or attention, got {types!r}")
    position = hf.get("position_embedding_type") or "rope"
    if position not in ("rope", "nope"):
        raise ValueError(f"position_embedding_type must be rope or nope, got {position!r}")
    experts, shared = hf.get("num_local_experts") or 0, hf.get("shared_intermediate_size") or 0
    text = {k: v for k, v in hf.items() if k not in ("layer_types", "layers_block_type")}
    cfg = granite_config_from_hf(text | {"intermediate_size": hf.get("intermediate_size") if experts else shared})
    if experts:
        cfg = dataclasses.replace(cfg, num_experts=experts, experts_per_token=hf["num_experts_per_tok"],
                                  moe_intermediate_size=cfg.intermediate_size, intermediate_size=shared,
                                  norm_topk_prob=True)
    return dataclasses.replace(_with_mamba2_mixers(hf, cfg, types, kinds), architecture=arch,
                               rope_layers=(False,) * num_layers if position == "nope" else ())


def _with_mamba2_mixers(hf: dict, cfg: ModelConfig, types: list[str], kinds: dict[str, bool]) -> ModelConfig:
    """`cfg` with Mamba2 mixers in the layers whose `types` are state ones by `kinds`, as Granite 4.0-H's and Bamba's
    configs give them: mamba_n_heads of mamba_d_head (by default mamba_expand x hidden_size split among them),
    mamba_d_state, mamba_n_groups, mamba_d_conv; biases by mamba_conv_bias and mamba_proj_bias; time_step_limit; the
    convolution through the model's hidden_act."""
    heads = hf.get("mamba_n_heads", 128)
    head_dim = hf.get("mamba_d_head", "auto")
    if head_dim in (None, "auto"):
        head_dim = hf.get("mamba_expand", 2) * cfg.hidden_size // heads
    groups = hf.get("mamba_n_groups", 1)
    if heads % groups:
        raise ValueError(f"mamba_n_heads={heads} is not a multiple of mamba_n_groups={groups}")
    return dataclasses.replace(
        cfg, linear_layers=tuple(i for i, t in enumerate(types) if kinds[t]),
        ssm_heads=(heads, head_dim, hf.get("mamba_d_state", 256), groups, hf.get("mamba_d_conv", 4)),
        ssm_conv_bias=bool(hf.get("mamba_conv_bias", True)), ssm_proj_bias=bool(hf.get("mamba_proj_bias", False)),
        ssm_dt_limit=_dt_limit(hf.get("time_step_limit")), ssm_activation=cfg.hidden_act)


def _time_step_rank(hf: dict, key: str) -> int:
    """A Mamba1 config's time-step rank (`key`): "auto" is ceil(hidden_size / 16), as transformers reads it."""
    rank = hf.get(key, "auto")
    rank = -(-hf["hidden_size"] // 16) if rank in (None, "auto") else rank
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{key} must be a positive integer or auto, got {rank!r}")
    return rank


MAMBA_ARCHITECTURES = ("MambaForCausalLM", "FalconMambaForCausalLM")


def mamba_config_from_hf(hf: dict) -> ModelConfig:
    """Mamba (`MambaForCausalLM`: state-spaces/mamba-130m to 2.8b) and FalconMamba (`FalconMambaForCausalLM`:
    falcon-mamba-7b): a Mamba1 mixer (ModelConfig.mamba1: intermediate_size (by default expand x hidden_size) inner
    channels, state_size, time_step_rank, conv_kernel) under a norm in every layer, no attention and no MLP (read as
    a Nemotron-H of mixer blocks: its tensors have their names); FalconMamba's weightless RMS norms (`mixer_rms_eps`)
    on dt's, B's and C's inputs. No attention layer: no KV cache, and a length limit of max_position_embeddings where
    given, else 2048 (as `mamba2_config_from_hf`)."""
    arch = hf["architectures"][0]
    if hf.get("quantization_config"):
        raise ValueError(f"quantized {arch} checkpoints are not supported yet (their Mamba layers' projections are "
                         f"float only)")
    act = hf.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise ValueError(f"hidden_act {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    layers = hf.get("num_hidden_layers", 32)
    same = ("architectures", "vocab_size", "hidden_size", "layer_norm_epsilon", "tie_word_embeddings", "dtype",
            "torch_dtype", "eos_token_id", "bos_token_id")
    cfg = nemotron_h_config_from_hf({key: hf[key] for key in same if key in hf} | {
        "hybrid_override_pattern": "M" * layers, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 64,
        "intermediate_size": 0, "mamba_num_heads": 1, "mamba_head_dim": 1, "n_groups": 1,
        "max_position_embeddings": hf.get("max_position_embeddings", 2048)})
    falcon = arch == "FalconMambaForCausalLM"
    return dataclasses.replace(
        cfg, ssm_heads=(), ssm_activation=ACTIVATIONS[act], ssm_conv_bias=bool(hf.get("use_conv_bias", True)),
        ssm_proj_bias=bool(hf.get("use_bias", False)),
        mamba1=(hf.get("intermediate_size") or hf.get("expand", 2) * hf["hidden_size"], hf.get("state_size", 16),
                _time_step_rank(hf, "time_step_rank"), hf.get("conv_kernel", 4)),
        ssm_bcdt_norm=(False, float(hf.get("mixer_rms_eps", 1e-6))) if falcon else ())


def jamba_config_from_hf(hf: dict) -> ModelConfig:
    """Jamba (`JambaForCausalLM`: Jamba v0.1, 1.5/1.6/1.7 Mini and Large): Mamba1 mixers (ModelConfig.mamba1, with
    weighted RMS norms on dt's, B's and C's inputs) in every layer but each `attn_layer_period`-th (from
    `attn_layer_offset`), attention layers without rotary embedding; each `expert_layer_period`-th layer's MLP (from
    `expert_layer_offset`) a mixture of `num_experts` (softmax top `num_experts_per_tok`, not renormalised), the others
    a dense MLP, all of intermediate_size."""
    if hf.get("quantization_config"):
        raise ValueError("quantized JambaForCausalLM checkpoints are not supported yet (their Mamba layers' "
                         "projections are float only)")
    num_layers = hf["num_hidden_layers"]
    periods = {name: hf.get(name, default) for name, default in (
        ("attn_layer_period", 8), ("attn_layer_offset", 4), ("expert_layer_period", 2), ("expert_layer_offset", 1))}
    if not (0 <= periods["attn_layer_offset"] < periods["attn_layer_period"]
            and 0 <= periods["expert_layer_offset"] < periods["expert_layer_period"]):
        raise ValueError(f"each layer offset must be below its period, got {periods}")
    attention = [i % periods["attn_layer_period"] == periods["attn_layer_offset"] for i in range(num_layers)]
    experts = hf.get("num_experts", 16)
    expert_layers = [experts > 1 and i % periods["expert_layer_period"] == periods["expert_layer_offset"]
                     for i in range(num_layers)]
    cfg = model_config_from_hf(hf | {"sliding_window": None, "layer_types": None})
    if any(expert_layers):
        cfg = dataclasses.replace(
            cfg, num_experts=experts, experts_per_token=hf.get("num_experts_per_tok", 2),
            moe_intermediate_size=cfg.intermediate_size, dense_intermediate_size=cfg.intermediate_size,
            intermediate_size=0, dense_mlp_layers=tuple(i for i, moe in enumerate(expert_layers) if not moe))
    return dataclasses.replace(
        cfg, rope_layers=(False,) * num_layers, linear_layers=tuple(i for i, a in enumerate(attention) if not a),
        mamba1=(hf.get("mamba_expand", 2) * cfg.hidden_size, hf.get("mamba_d_state", 16),
                _time_step_rank(hf, "mamba_dt_rank"), hf.get("mamba_d_conv", 4)),
        ssm_conv_bias=bool(hf.get("mamba_conv_bias", True)), ssm_proj_bias=bool(hf.get("mamba_proj_bias", False)),
        ssm_activation=cfg.hidden_act, ssm_bcdt_norm=(True, cfg.rms_norm_eps))


def falcon_h1_config_from_hf(hf: dict) -> ModelConfig:
    """Falcon-H1 (`FalconH1ForCausalLM`: 0.5B to 34B, Falcon-H1R): in every layer a Mamba2 mixer beside the attention,
    both over the layer's normed input and their outputs summed into the residual (`ssm_parallel`), then a gated MLP;
    the mixers as `_with_mamba2_mixers` reads them (their inner width mamba_d_ssm where given), their output
    projection's bias by `projectors_bias`, their output norm none (`mamba_rms_norm` false, the default) or per group
    before or after the gate (`mamba_norm_before_gate`). Its muP multipliers are folded into the weights at load
    (`mup_multipliers`: the attention's input and output, the keys, the mixer's input, each part of its input
    projection (z, x, B, C, dt: `ssm_multipliers`) and its output, the MLP's gate and down projection); the
    embeddings' is `embed_scale`, the logits' (`lm_head_multiplier`) folded into the final norm."""
    if hf.get("quantization_config"):
        raise ValueError("quantized FalconH1ForCausalLM checkpoints are not supported yet (their Mamba2 layers' "
                         "projections are float only)")
    if bool(hf.get("mamba_proj_bias", False)) != bool(hf.get("projectors_bias", False)):
        raise ValueError(f"mamba_proj_bias={hf.get('mamba_proj_bias')} and projectors_bias={hf.get('projectors_bias')}"
                         f" differ: biases on the mixers' input projection but not their output one (or the reverse) "
                         f"are not supported")
    num_layers = hf["num_hidden_layers"]
    inner = hf.get("mamba_d_ssm") or hf.get("mamba_expand", 2) * hf["hidden_size"]
    heads = hf.get("mamba_n_heads", 128)
    head_dim = hf.get("mamba_d_head", "auto")
    head_dim = inner // heads if head_dim in (None, "auto") else head_dim
    if head_dim * heads != inner:
        raise ValueError(f"mamba_n_heads x mamba_d_head must be the mixers' width {inner}, got {heads} x {head_dim}")
    multipliers = {name: _positive(hf, name, 1.0) for name in (
        "attention_in_multiplier", "attention_out_multiplier", "key_multiplier", "ssm_in_multiplier",
        "ssm_out_multiplier", "embedding_multiplier", "lm_head_multiplier")}
    mlp, ssm = hf.get("mlp_multipliers") or [1.0, 1.0], hf.get("ssm_multipliers") or [1.0] * 5
    if len(mlp) != 2 or len(ssm) != 5:
        raise ValueError(f"mlp_multipliers must give 2 values (gate, down) and ssm_multipliers 5 (z, x, B, C, dt), got "
                         f"{mlp!r} and {ssm!r}")
    cfg = model_config_from_hf(hf)
    cfg = _with_mamba2_mixers(hf | {"mamba_d_head": head_dim}, cfg, ["hybrid"] * num_layers, {"hybrid": True})
    norm = ("before_gate" if hf.get("mamba_norm_before_gate", True) else "gated") if hf.get("mamba_rms_norm") else ""
    embedding = multipliers.pop("embedding_multiplier")
    return dataclasses.replace(
        cfg, ssm_parallel=True, ssm_norm=norm, embed_scale=None if embedding == 1 else embedding,
        logits_scaling=1 / multipliers.pop("lm_head_multiplier"),
        mup_multipliers=tuple(sorted(multipliers.items())) + (("mlp", tuple(map(float, mlp))),
                                                              ("ssm", tuple(map(float, ssm)))))


def bamba_config_from_hf(hf: dict) -> ModelConfig:
    """Bamba (`BambaForCausalLM`: Bamba-9B v1/v2): Granite 4.0-H's Mamba2 mixers (`_with_mamba2_mixers`) in every layer
    but `attn_layer_indices`, which are Llama attention layers rotating half of each head (transformers hard-wires
    partial_rotary_factor 0.5), a gated MLP in every layer."""
    num_layers = hf["num_hidden_layers"]
    attention = hf.get("attn_layer_indices") or []
    if not all(isinstance(i, int) and 0 <= i < num_layers for i in attention):
        raise ValueError(f"attn_layer_indices must be layers of the {num_layers}, got {attention!r}")
    if hf.get("quantization_config"):
        raise ValueError("quantized BambaForCausalLM checkpoints are not supported yet (their Mamba2 layers' "
                         "projections are float only)")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {}) | {"partial_rotary_factor": 0.5}
    cfg = model_config_from_hf(hf | {"rope_parameters": rope, "rope_scaling": None})
    types = ["attention" if i in attention else "mamba" for i in range(num_layers)]
    return _with_mamba2_mixers(hf, cfg, types, {"mamba": True, "attention": False})


def _dt_limit(limit) -> tuple:
    """A Mamba2 config's time_step_limit as ModelConfig.ssm_dt_limit: () where it clamps nothing."""
    # transformers 5 writes an infinite float as {"__float__": "Infinity"}
    limit = tuple(float(v["__float__"]) if isinstance(v, dict) else float(v) for v in limit or (0.0, float("inf")))
    if len(limit) != 2 or not limit[0] <= limit[1]:
        raise ValueError(f"time_step_limit must be (min, max), got {limit!r}")
    return () if limit == (0.0, float("inf")) else limit


def mamba2_config_from_hf(hf: dict) -> ModelConfig:
    """Mamba2 (`Mamba2ForCausalLM`: Mamba-Codestral-7B, mamba2-130m to 2.7b): a Mamba2 mixer under a norm in every
    layer, no attention and no MLP; read as a Nemotron-H whose blocks are all mixers (its tensors have their names).
    Its `num_heads` and `head_dim` are the mixers'; the model has no attention layer (nor KV cache) to give the
    attention shape it is read with (one head of 64) any use. Its length limit is its config's max_position_embeddings
    where given, else 2048 (vLLM's default where a config gives none)."""
    layers = hf.get("num_hidden_layers", 64)
    keys = {"hidden_act": "mamba_hidden_act", "num_heads": "mamba_num_heads", "head_dim": "mamba_head_dim",
            "state_size": "ssm_state_size"}
    same = ("architectures", "vocab_size", "hidden_size", "n_groups", "conv_kernel", "use_conv_bias", "use_bias",
            "time_step_limit", "layer_norm_epsilon", "tie_word_embeddings", "max_position_embeddings", "dtype",
            "torch_dtype", "eos_token_id", "bos_token_id", "quantization_config")
    heads = hf.get("num_heads", 128)
    if hf.get("head_dim", 64) * heads != hf.get("expand", 2) * hf.get("hidden_size", 4096):
        raise ValueError(f"num_heads x head_dim must be expand x hidden_size, got {heads} x {hf.get('head_dim', 64)} "
                         f"and {hf.get('expand', 2)} x {hf.get('hidden_size', 4096)}")
    nemotron = {ours: hf[theirs] for theirs, ours in keys.items() if theirs in hf} | {
        key: hf[key] for key in same if key in hf} | {
        "hybrid_override_pattern": "M" * layers, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 64,
        "intermediate_size": 0,
        "n_groups": hf.get("n_groups", 8), "max_position_embeddings": hf.get("max_position_embeddings", 2048)}
    return nemotron_h_config_from_hf(nemotron)


# Nemotron-H's blocks: the hub's hybrid_override_pattern letters, transformers' layers_block_type names (and their
# older ones) -> mixer (M: Mamba2, *: attention) or MLP (-: dense, E: mixture of experts)
_NEMOTRON_H_BLOCKS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe", "mamba": "mamba",
                      "linear_attention": "mamba", "attention": "attention", "full_attention": "attention",
                      "mlp": "mlp", "moe": "moe"}


def nemotron_h_config_from_hf(hf: dict) -> ModelConfig:
    """Nemotron-H (`NemotronHForCausalLM`: Nemotron-H 4B-56B, NVIDIA Nemotron Nano 2 9B/12B, Nemotron 3 Nano 30B-A3B
    and Super): each checkpoint layer is one block under its own RMSNorm (`layers_block_type`, or the hub's
    `hybrid_override_pattern`): a Mamba2 mixer (M; Granite 4.0-H's, `ssm_heads`: mamba_num_heads of
    mamba_head_dim, ssm_state_size, n_groups, conv_kernel), attention without rotary embedding or biases (*), an
    ungated MLP (-: `mlp_hidden_act`, ReLU^2) or a mixture of experts (E: DeepSeek V3's sigmoid router over ungated
    experts, a shared expert of `moe_shared_expert_intermediate_size`; through a latent of `moe_latent_size` where
    given). Each of our layers is a mixer and the MLP block after it (`layer_sources`; none where another mixer
    follows: `no_mlp_layers`); an MLP block that follows no mixer is refused. The multi-token-prediction layers are
    not loaded."""
    arch = hf["architectures"][0]
    if hf.get("quantization_config"):
        raise ValueError(f"quantized {arch} checkpoints are not supported yet (their Mamba2 layers' projections are "
                         f"float only)")
    types = hf.get("layers_block_type") or hf.get("layer_types") or hf.get("hybrid_override_pattern")
    if not types or not isinstance(types, (str, list)) or not set(types) <= set(_NEMOTRON_H_BLOCKS):
        raise ValueError(f"layers_block_type (or hybrid_override_pattern) must name each layer's block (M, *, -, E; "
                         f"mamba, attention, mlp, moe), got {types!r}")
    types = [_NEMOTRON_H_BLOCKS[t] for t in types]
    sources = []  # each of our layers' [mixer, MLP block or -1]
    for i, kind in enumerate(types):
        if kind in ("mamba", "attention"):
            sources.append([i, -1])
        elif sources and sources[-1][1] < 0:
            sources[-1][1] = i
        else:
            raise ValueError(f"layer {i}'s {kind} block follows {'another MLP block' if sources else 'no mixer'}; "
                             f"only an MLP block after a Mamba2 or attention block is supported")
    act = hf.get("mamba_hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise ValueError(f"mamba_hidden_act {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    mlp_act = hf.get("mlp_hidden_act", "relu2")
    heads = hf.get("mamba_num_heads", 128)
    groups = hf.get("n_groups", hf.get("mamba_n_groups", 8))
    if heads % groups:
        raise ValueError(f"mamba_num_heads={heads} is not a multiple of n_groups={groups}")
    num_heads = hf.get("num_attention_heads", 32)
    text = hf | {"num_hidden_layers": len(sources), "hidden_act": mlp_act, "sliding_window": None,
                 "layer_types": None, "num_attention_heads": num_heads,
                 "intermediate_size": hf.get("intermediate_size", 21504),
                 "head_dim": hf.get("head_dim") or hf.get("attention_head_dim") or hf["hidden_size"] // num_heads,
                 "rms_norm_eps": hf.get("layer_norm_epsilon", 1e-5), "attention_bias": False,
                 "partial_rotary_factor": None, "rope_parameters": None, "rope_scaling": None}
    cfg = dataclasses.replace(
        model_config_from_hf(text), gated_mlp=False, rope_layers=(False,) * len(sources),
        linear_layers=tuple(j for j, (mixer, _) in enumerate(sources) if types[mixer] == "mamba"),
        no_mlp_layers=tuple(j for j, (_, mlp) in enumerate(sources) if mlp < 0),
        layer_sources=tuple(tuple(pair) for pair in sources),
        ssm_heads=(heads, hf.get("mamba_head_dim", 64), hf.get("ssm_state_size", 128), groups,
                   hf.get("conv_kernel", hf.get("mamba_d_conv", 4))),
        ssm_conv_bias=bool(hf.get("use_conv_bias", hf.get("mamba_conv_bias", True))),
        ssm_proj_bias=bool(hf.get("use_bias", False)),
        ssm_dt_limit=_dt_limit(hf.get("time_step_limit", hf.get("mamba_dt_limit"))), ssm_activation=ACTIVATIONS[act])
    if "moe" not in types:
        return cfg
    latent = hf.get("moe_latent_size") or 0
    if not isinstance(latent, int) or latent < 0:
        raise ValueError(f"moe_latent_size must be a positive integer or null, got {latent!r}")
    moe = {"n_routed_experts": hf.get("n_routed_experts", hf.get("num_local_experts", 8)), "n_shared_experts": 1,
           "moe_intermediate_size": hf.get("moe_intermediate_size", 7688), "first_k_dense_replace": 0,
           "mlp_layer_types": None, "topk_method": None, "scoring_func": None}
    cfg = _deepseek_experts(hf | moe, cfg, first_dense=0, renormalize=True)
    return dataclasses.replace(
        cfg, intermediate_size=hf.get("moe_shared_expert_intermediate_size", 7688), moe_latent_size=latent,
        dense_mlp_layers=tuple(j for j, (_, mlp) in enumerate(sources) if mlp >= 0 and types[mlp] == "mlp"))


def smollm3_config_from_hf(hf: dict) -> ModelConfig:
    """SmolLM3: the Llama layer, some layers without rotary embedding (`no_rope_layers`: 1 where a layer rotates;
    by default every `no_rope_layer_interval`-th does not), sliding windows only with `use_sliding_window`."""
    layers = hf["num_hidden_layers"]
    rope_layers = hf.get("no_rope_layers")
    if rope_layers is None:
        interval = hf.get("no_rope_layer_interval", 4)
        rope_layers = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(rope_layers) != layers or not all(v in (0, 1) for v in rope_layers):
        raise ValueError(f"no_rope_layers must hold a 0 or 1 for each of the {layers} layers, got {rope_layers!r}")
    cfg = model_config_from_hf(hf if hf.get("use_sliding_window") else hf | {"sliding_window": None,
                                                                               "layer_types": None})
    return dataclasses.replace(cfg, rope_layers=tuple(bool(v) for v in rope_layers))


def ministral3_config_from_hf(hf: dict) -> ModelConfig:
    """Ministral 3: the Mistral layer whose queries grow with the position past the rope's original length, by its
    `llama_4_scaling_beta` (Llama 4's attention temperature; none where the rope dict has no beta)."""
    cfg = model_config_from_hf(hf)
    return _with_attention_temperature(cfg, cfg.rope.param("llama_4_scaling_beta"),
                                       cfg.rope.param("original_max_position_embeddings"))


def _with_attention_temperature(cfg: ModelConfig, beta, length) -> ModelConfig:
    """`cfg` with Llama 4's attention temperature in every layer (`q_position_scale`) by the rope's
    `llama_4_scaling_beta` and original length (Ministral 3, Mistral Small 4); as it is where beta is None."""
    if beta is None:
        return cfg
    if not isinstance(beta, (int, float)) or isinstance(beta, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"llama_4_scaling_beta needs a number and a positive original_max_position_embeddings in the "
                         f"rope parameters, got {beta!r} and {length!r}")
    return dataclasses.replace(cfg, q_position_scale=(float(beta), length, 0, False))


def mistral3_language_config_from_hf(hf: dict) -> ModelConfig:
    """Mistral3ForConditionalGeneration's language model (Mistral Small 3.1/3.2: Mistral; Ministral 3: Ministral 3;
    Mistral Small 4: Mistral 4):
    its `text_config` completed with its transformers config's defaults, with the top level's dtype and (where
    given) tie_word_embeddings."""
    import transformers

    from jaxengine.models.registry import get_architecture

    given = dict(hf.get("text_config") or {})
    model_type = given.pop("model_type", "mistral")
    causal = {"mistral": "MistralForCausalLM", "ministral3": "Ministral3ForCausalLM", "mistral4": "Mistral4ForCausalLM"}
    if model_type not in causal:
        raise ValueError(f"Mistral3ForConditionalGeneration with a {model_type!r} text model is not supported "
                         f"({', '.join(causal)} are)")
    text = _language_model_config(hf, transformers.AutoConfig.for_model(model_type, **given).to_dict(),
                                  causal[model_type], ("dtype", "torch_dtype"))
    cfg = get_architecture(text).read_config(text)
    # the top level's tie_word_embeddings, where it has one, is the one transformers 5 follows
    tied = bool(hf.get("tie_word_embeddings", cfg.tie_word_embeddings))
    return dataclasses.replace(cfg, architecture=hf["architectures"][0], tie_word_embeddings=tied)


# Qwen's vision-language models served as their language models: architecture -> (its transformers config, the
# language model's causal LM)
QWEN_VL_ARCHITECTURES = {
    "Qwen2VLForConditionalGeneration": ("Qwen2VLConfig", "Qwen2ForCausalLM"),
    "Qwen2_5_VLForConditionalGeneration": ("Qwen2_5_VLConfig", "Qwen2ForCausalLM"),
    "Qwen3VLForConditionalGeneration": ("Qwen3VLConfig", "Qwen3ForCausalLM"),
    "Qwen3VLMoeForConditionalGeneration": ("Qwen3VLMoeConfig", "Qwen3MoeForCausalLM"),
}
_MROPE_KEYS = ("type", "mrope_section", "mrope_interleaved")


def qwen_vl_language_config_from_hf(hf: dict) -> ModelConfig:
    """Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE's language model (Qwen2's, Qwen3's and Qwen3 MoE's layers;
    Qwen3-VL-MoE's experts always renormalised, each layer's stacked in the checkpoint): its text config as transformers
    completes it (from `text_config`, or from the top level's keys as Qwen2-VL's and Qwen2.5-VL's hub configs give
    them), with the top level's tie_word_embeddings and token ids. Its multimodal rotary embedding (M-RoPE: each of
    `mrope_section`'s parts of a head rotated by the token's temporal, height or width position) is the plain one on
    text, whose three positions are all the token's own."""
    import transformers

    from jaxengine.models.registry import get_architecture

    config_class, causal = QWEN_VL_ARCHITECTURES[hf["architectures"][0]]
    config = getattr(transformers, config_class)(**{k: v for k, v in hf.items() if k != "architectures"})
    text = config.text_config.to_dict()
    text["rope_parameters"] = {k: v for k, v in (text.get("rope_parameters") or {}).items() if k not in _MROPE_KEYS}
    text = _language_model_config(hf, text | {"rope_scaling": None}, causal,
                                  ("eos_token_id", "bos_token_id", "dtype", "torch_dtype"))
    if causal == "Qwen3MoeForCausalLM":
        text["norm_topk_prob"] = True
    cfg = get_architecture(text).read_config(text)
    return dataclasses.replace(cfg, architecture=hf["architectures"][0],
                               tie_word_embeddings=bool(config.tie_word_embeddings))


def arcee_config_from_hf(hf: dict) -> ModelConfig:
    """Arcee (`ArceeForCausalLM`: AFM-4.5B): the Llama layer with an ungated MLP, down(relu(up(x))^2) by default
    (`hidden_act` relu2), biases on it where `mlp_bias`."""
    return dataclasses.replace(model_config_from_hf(hf | {"hidden_act": hf.get("hidden_act", "relu2")}),
                               gated_mlp=False)


def internlm3_config_from_hf(hf: dict) -> ModelConfig:
    """InternLM3 (`InternLM3ForCausalLM`: internlm3-8b-instruct): the Llama layer under its own config keys, biases on
    q/k/v by `qkv_bias` and on o_proj and the MLP by `bias` (vLLM's reading; transformers runs it as Llama where
    the two agree)."""
    qkv = bool(hf.get("qkv_bias", hf.get("attention_bias", False)))
    bias = bool(hf.get("bias", hf.get("mlp_bias", False)))
    return dataclasses.replace(model_config_from_hf(hf, qkv_bias=qkv, o_bias=bias), mlp_bias=bias)


def iquestcoder_config_from_hf(hf: dict) -> ModelConfig:
    """IQuest-Coder (`IQuestCoderForCausalLM`): the Llama layer; transformers' clamped q/k/v (`clip_qkv`) and sliding
    windows are refused, as transformers refuses them."""
    if hf.get("clip_qkv") is not None or hf.get("use_sliding_window"):
        raise ValueError("clip_qkv and use_sliding_window are not supported for IQuestCoderForCausalLM")
    return model_config_from_hf(hf)


def seed_oss_config_from_hf(hf: dict) -> ModelConfig:
    """Seed-OSS: the Llama layer, q/k/v biases by `attention_bias` (default on), o_proj's by `attention_out_bias`."""
    hf = hf | {"attention_bias": hf.get("attention_bias", True)}
    return model_config_from_hf(hf, o_bias=bool(hf.get("attention_out_bias", False)))


def ministral_config_from_hf(hf: dict) -> ModelConfig:
    """Ministral (`MinistralForCausalLM`: Ministral-8B) and CWM (`CwmForCausalLM`: Meta's Code World Model): the
    Llama layer without biases, sliding-window layers by `layer_types` (CWM's default as transformers derives it: every
    fourth layer from the first full attention, the others 8192-token windows; its rope by default llama3's, 16 times
    an original 8192 positions, at base 1,000,000)."""
    if hf["architectures"][0] == "CwmForCausalLM":
        hf = {"sliding_window": 8192, "rope_parameters": dict(
            rope_type="llama3", rope_theta=1_000_000.0, factor=16.0, high_freq_factor=4.0, low_freq_factor=1.0,
            original_max_position_embeddings=8192)} | {k: v for k, v in hf.items() if v is not None}
        hf.setdefault("layer_types", ["sliding_attention" if i % 4 else "full_attention"
                                      for i in range(hf["num_hidden_layers"])])
    return model_config_from_hf(hf, qkv_bias=False, o_bias=False)


def helium_config_from_hf(hf: dict) -> ModelConfig:
    """Helium (`HeliumForCausalLM`, Kyutai's): the Llama layer rotating interleaved pairs over the whole head (GLM's
    rotation), q/k/v biases by `attention_bias`, none on o_proj."""
    return dataclasses.replace(model_config_from_hf(hf, o_bias=False), rope_interleaved=True)


def ernie4_5_config_from_hf(hf: dict) -> ModelConfig:
    """ERNIE 4.5 (dense): the Llama layer rotating interleaved pairs over the whole head (GLM's rotation)."""
    if hf.get("use_bias"):
        raise ValueError("use_bias=true (biases on every projection, the MLP's included) is not supported")
    return dataclasses.replace(model_config_from_hf(hf), rope_interleaved=True)


def ernie4_5_moe_config_from_hf(hf: dict) -> ModelConfig:
    """ERNIE 4.5 MoE (`Ernie4_5_MoeForCausalLM`: ERNIE-4.5-21B-A3B, -300B-A47B): ERNIE 4.5's layer with a mixture of
    experts in every `moe_layer_interval`-th layer from `moe_layer_start_index` to `moe_layer_end_index` (its config
    read through transformers' Ernie4_5_MoeConfig): the softmax of the router's float32 logits, the top `moe_k`
    chosen with a correction bias added (`moe_statics`), their weights renormalised, `moe_num_shared_experts` shared
    experts beside them; dense MLPs in the other layers. `use_bias` is refused; the MTP layers are not loaded."""
    if hf.get("use_bias"):
        raise ValueError("use_bias=true (biases on every projection, the MLP's included) is not supported")
    full = _completed(hf, "Ernie4_5_MoeConfig")
    layers, interval = full["num_hidden_layers"], full["moe_layer_interval"]
    start, end = full["moe_layer_start_index"], full["moe_layer_end_index"]
    if not (isinstance(interval, int) and interval >= 1):
        raise ValueError(f"moe_layer_interval must be a positive integer, got {interval!r}")
    dense = tuple(i for i in range(layers) if not ((i + 1) % interval == 0 and start <= i <= end))
    cfg = ernie4_5_config_from_hf(hf)
    width = full["moe_intermediate_size"]
    return dataclasses.replace(
        cfg, num_experts=full["moe_num_experts"], experts_per_token=full["moe_k"], moe_intermediate_size=width,
        intermediate_size=(full["moe_num_shared_experts"] or 0) * width, dense_intermediate_size=cfg.intermediate_size,
        dense_mlp_layers=dense, norm_topk_prob=True, router_float32=True, router_correction=True)


GLM_ARCHITECTURES = ("GlmForCausalLM", "Glm4ForCausalLM")


def glm_config_from_hf(hf: dict) -> ModelConfig:
    """GLM-4 (`GlmForCausalLM`: GLM-4-9B) and GLM-4-0414 (`Glm4ForCausalLM`, which adds norms on the attention's and
    the MLP's outputs): the Llama layer with q/k/v biases (`attention_bias`) and none on o_proj, gate/up fused in
    the checkpoint, and a partial rotary embedding (by default half the head) over interleaved pairs."""
    hf = hf | {"partial_rotary_factor": hf.get("partial_rotary_factor", 0.5),
               "attention_bias": hf.get("attention_bias", True)}
    cfg = model_config_from_hf(hf, o_bias=False)
    return dataclasses.replace(cfg, rope_interleaved=True,
                               sandwich_norms=hf["architectures"][0] == "Glm4ForCausalLM")


def _layer_type_ropes(hf: dict) -> tuple[dict, RopeConfig | None]:
    """A config whose `rope_parameters` hold one rope dict per layer type (transformers 5's Gemma 3, OLMo 3): the
    config with the full-attention layers' as its own, and the sliding-window layers' (None where the config has
    one rope dict)."""
    nested = hf.get("rope_parameters") or {}
    if "full_attention" not in nested:
        return hf, None
    return hf | {"rope_parameters": nested["full_attention"]}, parse_rope(
        {"rope_parameters": nested.get("sliding_attention") or nested["full_attention"]})


def olmo2_config_from_hf(hf: dict) -> ModelConfig:
    """OLMo 2 and OLMo 3: the Llama layer with norms on the attention's and MLP's outputs instead of their inputs,
    and q/k norms over the whole projections (OLMo 3: sliding-window layers, `layer_types`, with their own rope:
    its config read through transformers' Olmo3Config, whose older `rope_scaling` applies to the full-attention
    layers only)."""
    if hf["architectures"][0] == "Olmo3ForCausalLM":
        import transformers

        hf = transformers.Olmo3Config(**hf).to_dict() | {"architectures": hf["architectures"]}
    hf, local_rope = _layer_type_ropes(hf)
    cfg = model_config_from_hf(hf, qk_norm=True)
    return dataclasses.replace(cfg, pre_norms=False, sandwich_norms=True, qk_norm_whole=True, local_rope=local_rope)


def exaone_config_from_hf(hf: dict) -> ModelConfig:
    """EXAONE 3.0 / 3.5 (`ExaoneForCausalLM`): the Llama layer under names of its own (its checkpoint's
    transformer.h.*, registry._EXAONE_NAMES; its config's num_layers, layer_norm_epsilon and activation_function), a
    rotary base of 500,000 where the config gives none (transformers' ExaoneConfig's)."""
    renamed = {"num_layers": "num_hidden_layers", "layer_norm_epsilon": "rms_norm_eps",
               "activation_function": "hidden_act"}
    given = {renamed.get(k, k): v for k, v in hf.items()}
    if not (given.get("rope_parameters") or {}).get("rope_theta"):
        given.setdefault("rope_theta", 500_000.0)
    return model_config_from_hf(given)


def exaone4_config_from_hf(hf: dict) -> ModelConfig:
    """EXAONE 4: the Llama layer with norms on the attention's and MLP's outputs instead of their inputs, per-head
    q/k norms, and (with a sliding window) sliding-window layers by `layer_types` or `sliding_window_pattern`, the
    full-attention ones then without rotary embedding."""
    hf = dict(hf)
    window = hf.get("sliding_window")
    if window and hf.get("layer_types") is None:
        pattern = hf.get("sliding_window_pattern") or 4
        if isinstance(pattern, str):  # "LLLG": local (sliding) and global layers in turn
            hf["layer_types"] = ["sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention"
                                 for i in range(hf["num_hidden_layers"])]
        else:  # every pattern-th layer global, as transformers reads it
            hf["layer_types"] = _every_nth_full(hf["num_hidden_layers"], pattern)
    if not window:
        hf["layer_types"] = None
    cfg = model_config_from_hf(hf, qk_norm=True)
    rope_layers = tuple(w > 0 for w in cfg.sliding_windows) if window else ()
    return dataclasses.replace(cfg, pre_norms=False, sandwich_norms=True, rope_layers=rope_layers)


def _layer_norm_config(hf: dict, eps_key: str, partial_rotary: float = 1.0, **fields) -> ModelConfig:
    """A LayerNorm model's config (ModelConfig.layer_norm): model_config_from_hf over `hf` with its norms' epsilon
    from `eps_key`, its partial rotary factor by default `partial_rotary` (where neither its rope dict nor its top
    level gives one), and `fields` (q/k/v and o biases by `qkv_bias`, `o_bias`; the others ModelConfig's)."""
    biases = {name: fields.pop(name) for name in ("qkv_bias", "o_bias", "qk_norm") if name in fields}
    if hf.get("quantization_config"):
        raise ValueError(f"quantized {hf['architectures'][0]} checkpoints are not supported yet (LayerNorm models load "
                         f"float weights only)")
    hf = {key: value for key, value in hf.items() if key != "mlp_bias"} | {
        "rms_norm_eps": _positive(hf, eps_key, 1e-5),
        "partial_rotary_factor": hf.get("partial_rotary_factor", partial_rotary)}
    return dataclasses.replace(model_config_from_hf(hf, **biases), layer_norm=True, **fields)


def _learned_positions(cfg: ModelConfig, offset: int = 0) -> ModelConfig:
    """`cfg` with learned absolute positions (ModelConfig.learned_positions) and no layer rotating."""
    return dataclasses.replace(cfg, learned_positions=True, position_offset=offset,
                               rope_layers=(False,) * cfg.num_layers)


def _gpt2_keys(hf: dict, tied: bool) -> dict:
    """A GPT-2-style config (GPT-2's, GPT-BigCode's, GPT-J's: n_embd, n_head, n_layer, n_positions, n_inner,
    activation_function) in the keys model_config_from_hf reads; the head tied to the embedding by default where
    `tied`."""
    width = hf["n_embd"]
    return {key: hf[key] for key in ("architectures", "vocab_size", "bos_token_id", "eos_token_id", "dtype",
                                     "torch_dtype", "layer_norm_epsilon") if key in hf} | {
        "hidden_size": width, "intermediate_size": hf.get("n_inner") or 4 * width, "num_hidden_layers": hf["n_layer"],
        "num_attention_heads": hf["n_head"], "max_position_embeddings": hf["n_positions"],
        "hidden_act": hf.get("activation_function", "gelu_new"),
        "tie_word_embeddings": hf.get("tie_word_embeddings", tied)}


def gpt2_config_from_hf(hf: dict) -> ModelConfig:
    """GPT-2 (`GPT2LMHeadModel`: gpt2 to gpt2-xl, DistilGPT2, ...): learned absolute positions, LayerNorms with biases,
    projections with biases (Conv1D's [in, out] weights, q/k/v fused: laid out at load), an ungated MLP (`n_inner`, by
    default 4 x n_embd; tanh-GELU, `activation_function`), the head tied to the embedding. Unscaled scores
    (`scale_attn_weights` false) are taken; `scale_attn_by_inverse_layer_idx` is refused. GPT-BigCode
    (`GPTBigCodeForCausalLM`: StarCoder, SantaCoder, Granite 20B/34B Code): GPT-2's layer with Linear weights and,
    where `multi_query` (the default), one KV head."""
    if hf.get("scale_attn_by_inverse_layer_idx"):
        raise ValueError("scale_attn_by_inverse_layer_idx=true (scores scaled by each layer's index) is not supported")
    multi_query = hf["architectures"][0] == "GPTBigCodeForCausalLM" and hf.get("multi_query", True)
    mapped = _gpt2_keys(hf, tied=True) | {"num_key_value_heads": 1 if multi_query else hf["n_head"]}
    cfg = _layer_norm_config(mapped, "layer_norm_epsilon", qkv_bias=True, o_bias=True, norm_bias=True,
                             gated_mlp=False, mlp_bias=True, attn_scale=None if hf.get("scale_attn_weights", True)
                             else 1.0)
    return _learned_positions(cfg)


def gptj_config_from_hf(hf: dict) -> ModelConfig:
    """GPT-J (`GPTJForCausalLM`: GPT-J-6B, ...): one LayerNorm with a bias before the attention and the ungated MLP
    side by side (`n_inner`, by default 4 x n_embd), q/k/v and output projections without biases and the MLP's and
    the head's with them, rotary embedding in interleaved pairs over each head's first `rotary_dim` dimensions
    (laid out at load as half-split ones). A config without rotary_dim (its tables then as wide as the model, not a
    head) is refused."""
    width, heads = hf["n_embd"], hf["n_head"]
    rotary = hf.get("rotary_dim")
    if not isinstance(rotary, int) or not 0 < rotary <= width // heads:
        raise ValueError(f"rotary_dim must be a positive number of each head's {width // heads} dimensions, got "
                         f"{rotary!r}")
    mapped = _gpt2_keys(hf, tied=False) | {"partial_rotary_factor": rotary / (width // heads)}
    return _layer_norm_config(mapped, "layer_norm_epsilon", qkv_bias=False, o_bias=False, norm_bias=True,
                              parallel_block=1, gated_mlp=False, mlp_bias=True, lm_head_bias=True,
                              rope_interleaved=True)


def falcon_config_from_hf(hf: dict) -> ModelConfig:
    """Falcon (`FalconForCausalLM`: Falcon-7B/40B/180B, Falcon 2 11B; its config read through transformers'
    FalconConfig, the older RefinedWeb configs' n_head / n_layer / n_head_kv too): LayerNorms with biases, q/k/v fused
    per KV group (`new_decoder_architecture`: `num_kv_heads` groups; otherwise one KV head where `multi_query`, or a K
    and V per query head), the attention and the exact-GELU MLP side by side after one norm (`parallel_attn`), or each
    after its own (the new architecture's `num_ln_in_parallel_attn` 2, its default), or in turn; biases on every
    projection where `bias`. ALiBi (Falcon-RW) is refused."""
    import transformers

    if hf.get("alibi"):
        raise ValueError("alibi=true (ALiBi position biases: Falcon-RW) is not supported")
    older = {"n_head": "num_attention_heads", "n_layer": "num_hidden_layers", "n_head_kv": "num_kv_heads"}
    given = {older.get(k, k): v for k, v in hf.items() if k != "architectures"}  # RefinedWeb's keys too
    full = transformers.FalconConfig(**given).to_dict()
    heads, new = full["num_attention_heads"], bool(full["new_decoder_architecture"])
    kv_heads = (full["num_kv_heads"] or heads) if new else 1 if full["multi_query"] else heads
    if new:
        parallel = 2 if (full["num_ln_in_parallel_attn"] or 2) == 2 else 1
    else:
        parallel = 1 if full["parallel_attn"] else 0
    bias = bool(full["bias"])
    mapped = full | {"architectures": hf["architectures"], "num_key_value_heads": kv_heads,
                     "intermediate_size": full["ffn_hidden_size"] or 4 * full["hidden_size"],
                     "hidden_act": full["activation"]}
    return _layer_norm_config(mapped, "layer_norm_epsilon", qkv_bias=bias, o_bias=bias, norm_bias=True,
                              parallel_block=parallel, gated_mlp=False, mlp_bias=bias)


def opt_config_from_hf(hf: dict) -> ModelConfig:
    """OPT (`OPTForCausalLM`: facebook/opt-125m to -66b, vLLM's quickstart model): learned absolute positions (OPT's
    offset of 2 rows), LayerNorms with biases before the attention and the ungated MLP (`ffn_dim`; ReLU,
    `activation_function`), biases on every projection (`enable_bias`), the head tied to the embedding. Refused:
    OPT-350m's layout (norms after each block, `do_layer_norm_before` false; an embedding narrower than the model,
    `word_embed_proj_dim`) and norms without weights."""
    width = hf["hidden_size"]
    if not hf.get("do_layer_norm_before", True):
        raise ValueError("do_layer_norm_before=false (norms after each block: OPT-350m) is not supported")
    if hf.get("word_embed_proj_dim", width) != width:
        raise ValueError(f"word_embed_proj_dim={hf['word_embed_proj_dim']} (an embedding projected in and out of the "
                         f"hidden size {width}) is not supported")
    if not hf.get("layer_norm_elementwise_affine", True) or hf.get("_remove_final_layer_norm"):
        raise ValueError("OPT without the norms' weights or its final norm is not supported")
    bias = bool(hf.get("enable_bias", True))
    mapped = hf | {"intermediate_size": hf["ffn_dim"], "hidden_act": hf.get("activation_function", "relu"),
                   "tie_word_embeddings": hf.get("tie_word_embeddings", True)}
    cfg = _layer_norm_config(mapped, "layer_norm_eps", qkv_bias=bias, o_bias=bias, norm_bias=True, gated_mlp=False,
                             mlp_bias=bias)
    return _learned_positions(cfg, offset=2)


COHERE_ARCHITECTURES = ("CohereForCausalLM", "Cohere2ForCausalLM")


def cohere_config_from_hf(hf: dict) -> ModelConfig:
    """Command R / R+ (`CohereForCausalLM`) and Command R7B / A (`Cohere2ForCausalLM`): one LayerNorm without a bias
    before the attention and the gated MLP side by side, rotary embedding in interleaved pairs, the logits times
    `logit_scale` (folded into the final norm at load, as Granite's logits_scaling), R+'s q/k norms with weights per
    head (`use_qk_norm`). Cohere2: sliding-window layers by `layer_types` (or every `sliding_window_pattern`-th
    layer full attention: by default the 4th), its full-attention layers without rotary embedding."""
    hf = dict(hf)
    cohere2 = hf["architectures"][0] == "Cohere2ForCausalLM"
    if cohere2 and hf.get("layer_types") is None:
        hf["layer_types"] = _every_nth_full(hf["num_hidden_layers"], hf.get("sliding_window_pattern") or 4)
    qk_norm = bool(hf.get("use_qk_norm"))
    cfg = _layer_norm_config(hf, "layer_norm_eps", parallel_block=1, rope_interleaved=True, qk_norm=qk_norm,
                             qk_norm_per_head=qk_norm, logits_scaling=1 / _positive(hf, "logit_scale", 0.0625))
    rope_layers = tuple(w > 0 for w in cfg.sliding_windows) if cohere2 else ()
    return dataclasses.replace(cfg, rope_layers=rope_layers if not all(rope_layers) else ())


def starcoder2_config_from_hf(hf: dict) -> ModelConfig:
    """StarCoder2: LayerNorms with biases, biases on every projection (`use_bias`, default on), an MLP without a
    gate (c_fc, c_proj: tanh-GELU), a sliding window over every layer (`sliding_window`)."""
    bias = bool(hf.get("use_bias", True))
    return _layer_norm_config(hf, "norm_epsilon", qkv_bias=bias, o_bias=bias, norm_bias=True, gated_mlp=False,
                              mlp_bias=bias)


def nemotron_config_from_hf(hf: dict) -> ModelConfig:
    """Nemotron (`NemotronForCausalLM`: Nemotron-4, Minitron): LayerNorms of 1 + weight with biases (the 1 added to
    the weights at load: registry._nemotron_tensors), an ungated MLP (ReLU^2 by default), biases where
    `attention_bias` / `mlp_bias`, by default half of each head rotated."""
    return _layer_norm_config(hf | {"hidden_act": hf.get("hidden_act", "relu2")}, "norm_eps", 0.5, norm_bias=True,
                              gated_mlp=False, mlp_bias=bool(hf.get("mlp_bias")))


def apertus_config_from_hf(hf: dict) -> ModelConfig:
    """Apertus (`ApertusForCausalLM`): the Llama layer with per-head q/k norms and an ungated MLP whose activation is
    xIELU (`hidden_act: xielu`, its parameters each layer's own: layers.activations.xielu), or another transformers
    activation; its norms' names its own (registry's renaming)."""
    act = hf.get("hidden_act", "xielu")
    cfg = model_config_from_hf(hf | {"hidden_act": "silu" if act == "xielu" else act}, qk_norm=True)
    if hf.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported for Apertus")
    return dataclasses.replace(cfg, gated_mlp=False, hidden_act="xielu" if act == "xielu" else cfg.hidden_act)


def jais2_config_from_hf(hf: dict) -> ModelConfig:
    """Jais 2 (`Jais2ForCausalLM`): the Llama layer under LayerNorms with biases, an ungated MLP (ReLU^2 by default),
    biases on the projections where `attention_bias` / `mlp_bias` (both by default, as transformers' Jais2Config)."""
    bias = bool(hf.get("attention_bias", True))
    return _layer_norm_config(hf | {"hidden_act": hf.get("hidden_act", "relu2")}, "layer_norm_eps", qkv_bias=bias,
                              o_bias=bias, norm_bias=True, gated_mlp=False, mlp_bias=bool(hf.get("mlp_bias", True)))


def phi_config_from_hf(hf: dict) -> ModelConfig:
    """Phi-1, Phi-1.5, Phi-2 (`PhiForCausalLM`): one LayerNorm with a bias before the attention and the MLP side by
    side, biases on every projection and on the logits, an MLP without a gate (fc1, fc2), a partial rotary embedding
    (by default half of each head; Phi-2's 0.4), optional q/k LayerNorms shared by the heads, with biases
    (`qk_layernorm`)."""
    qk_norm = bool(hf.get("qk_layernorm"))
    return _layer_norm_config(hf, "layer_norm_eps", 0.5, qkv_bias=True, o_bias=True, qk_norm=qk_norm, norm_bias=True,
                              qk_norm_bias=qk_norm, parallel_block=1, gated_mlp=False, mlp_bias=True,
                              lm_head_bias=True)


def olmo_config_from_hf(hf: dict) -> ModelConfig:
    """OLMo (`OlmoForCausalLM`: OLMo-1B/7B-hf, OLMo-7B-0424/0724-hf): the Llama layer under LayerNorms without weights
    or biases (eps 1e-5, as transformers hard-wires it; their weights are ones at load: registry._olmo_tensors),
    biases on q/k/v/o by `attention_bias`. `clip_qkv` (clamping q, k and v) is refused."""
    if hf.get("clip_qkv") is not None:
        raise ValueError(f"clip_qkv={hf['clip_qkv']!r} is not supported (only null: no clamping of q, k and v)")
    bias = bool(hf.get("attention_bias", False))
    return _layer_norm_config(hf | {"olmo_layer_norm_eps": 1e-5}, "olmo_layer_norm_eps", qkv_bias=bias, o_bias=bias)


PHIMOE_ARCHITECTURES = ("PhimoeForCausalLM", "PhiMoEForCausalLM")  # transformers' name, the hub's
# Checkpoints whose experts are Mixtral's `block_sparse_moe.experts.N.w1/w3/w2` (their router `block_sparse_moe.gate`)
MIXTRAL_NAMED_ARCHITECTURES = ("MixtralForCausalLM", "MiniMaxM2ForCausalLM") + PHIMOE_ARCHITECTURES


def phimoe_config_from_hf(hf: dict) -> ModelConfig:
    """Phi-3.5-MoE (`PhimoeForCausalLM`, the hub's `PhiMoEForCausalLM`): the Llama layer under LayerNorms with biases,
    biases on q/k/v/o by `attention_bias` and on the logits by `lm_head_bias`, LongRoPE, and Mixtral's experts in
    every layer chosen by the sparsemixer router (two rounds, each the best remaining expert weighted by a softmax
    over the logits within 2 `router_jitter_noise` of it). Its config read through transformers' PhimoeConfig; a top
    k other than 2 is refused (the router is defined for two)."""
    full = _completed(hf, "PhimoeConfig")
    if full["num_experts_per_tok"] != 2:
        raise ValueError(f"num_experts_per_tok={full['num_experts_per_tok']} is not supported for Phi-3.5-MoE (its "
                         f"sparsemixer router chooses 2)")
    bias = bool(full.get("attention_bias", False))
    cfg = _layer_norm_config(full, "rms_norm_eps", qkv_bias=bias, o_bias=bias, norm_bias=True,
                             lm_head_bias=bool(full.get("lm_head_bias", False)))
    return dataclasses.replace(cfg, num_experts=full["num_local_experts"], experts_per_token=2,
                               moe_intermediate_size=cfg.intermediate_size, intermediate_size=0,
                               router_scoring="sparsemixer", router_jitter_eps=float(full["router_jitter_noise"]))


def stablelm_config_from_hf(hf: dict) -> ModelConfig:
    """StableLM (2, Zephyr, 3B-4E1T): LayerNorms with biases, the gated MLP, q/k/v biases by `use_qkv_bias`, a partial
    rotary embedding (by default a quarter of each head), q/k LayerNorms with weights per head (`qk_layernorm`),
    the attention and MLP side by side after one norm where `use_parallel_residual`."""
    qk_norm = bool(hf.get("qk_layernorm"))
    return _layer_norm_config(hf, "layer_norm_eps", 0.25, qkv_bias=bool(hf.get("use_qkv_bias")), o_bias=False,
                              qk_norm=qk_norm, qk_norm_per_head=qk_norm, norm_bias=True,
                              parallel_block=1 if hf.get("use_parallel_residual") else 0)


def gpt_neox_config_from_hf(hf: dict) -> ModelConfig:
    """GPT-NeoX (Pythia, GPT-NeoX-20B, ...): LayerNorms with biases, attention biases (`attention_bias`, default on;
    q/k/v fused per head in the checkpoint), an MLP without a gate with biases, a partial rotary embedding
    (`rotary_pct`, default a quarter, of base `rotary_emb_base` in older configs), and where `use_parallel_residual`
    (the default) the attention and MLP side by side, each after its own norm."""
    hf = hf | {"rope_theta": hf.get("rope_theta", hf.get("rotary_emb_base", 10000.0)),
               "partial_rotary_factor": hf.get("partial_rotary_factor", hf.get("rotary_pct", 0.25))}
    bias = bool(hf.get("attention_bias", True))
    return _layer_norm_config(hf, "layer_norm_eps", qkv_bias=bias, o_bias=bias, norm_bias=True, gated_mlp=False,
                              mlp_bias=True, parallel_block=2 if hf.get("use_parallel_residual", True) else 0)


GEMMA_ARCHITECTURES = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")


def gemma_config_from_hf(hf: dict) -> ModelConfig:
    """Gemma, Gemma 2 and Gemma 3 (text): the Llama layer with scaled embeddings, norms of 1 + weight, a
    tanh-approximated GELU gate and, from Gemma 2 on, norms after attention and MLP, a query scale of its own,
    logit soft-capping and sliding-window layers (Gemma 3: with their own rotary base). Read as transformers
    reads these configs, older keys included (`hidden_act: gelu` meaning the tanh approximation,
    `sliding_window_pattern`, `rope_local_base_freq`)."""
    arch = hf["architectures"][0]
    generation = GEMMA_ARCHITECTURES.index(arch) + 1
    hf = dict(hf)
    if hf.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=true (an encoder's attention) is not supported")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    hf["hidden_act"] = "gelu_pytorch_tanh" if act == "gelu" else act
    if generation > 1 and hf.get("layer_types") is None:
        pattern = 2 if generation == 2 else hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
        hf["layer_types"] = _every_nth_full(hf["num_hidden_layers"], pattern)
    local_rope = None
    if generation == 3:
        hf, local_rope = _layer_type_ropes(hf)
        if local_rope is None:
            hf.setdefault("rope_theta", 1_000_000.0)
            local_rope = RopeConfig(theta=float(hf.get("rope_local_base_freq", 10_000.0)))
    cfg = model_config_from_hf(hf, qk_norm=generation == 3)
    scalar = hf.get("query_pre_attn_scalar", 256) if generation > 1 else None
    return dataclasses.replace(
        cfg, embed_scale=cfg.hidden_size ** 0.5, norm_offset=True, sandwich_norms=generation > 1,
        attn_scale=None if scalar is None else scalar ** -0.5,
        attn_logit_softcap=hf.get("attn_logit_softcapping") if generation == 2 else None,
        final_logit_softcap=hf.get("final_logit_softcapping") if generation > 1 else None,
        local_rope=local_rope)


def vaultgemma_config_from_hf(hf: dict) -> ModelConfig:
    """VaultGemma (`VaultGemmaForCausalLM`): Gemma 2's layer without the norms on the attention's and MLP's outputs
    (its MLP's input norm is `pre_feedforward_layernorm`: registry's renaming)."""
    cfg = gemma_config_from_hf(hf | {"architectures": ["Gemma2ForCausalLM"]})
    return dataclasses.replace(cfg, architecture=hf["architectures"][0], sandwich_norms=False)


GEMMA4_ARCHITECTURES = ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration")

# transformers' Gemma4TextConfig defaults (the hub's text configs list only what differs from them)
_GEMMA4_DEFAULTS = dict(
    vocab_size=262_144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072,
    rms_norm_eps=1e-6, tie_word_embeddings=True, sliding_window=512, hidden_size_per_layer_input=256,
    vocab_size_per_layer_input=262_144,
    global_head_dim=512, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}})


def gemma4_config_from_hf(hf: dict) -> ModelConfig:
    """Gemma 4's language model (`Gemma4ForCausalLM`; `Gemma4ForConditionalGeneration`'s `text_config`, served on
    text): Gemma 3's layer (sandwich norms, q/k norms, scaled embeddings, final logit soft-capping, sliding-window
    layers with a rope of their own) with plain-weight norms, unscaled scores (the q/k norms set their scale), values
    RMS-normalised without a weight, a scalar on each layer's output, and full-attention layers of their own shape
    (`global_head_dim`; with `attention_k_eq_v`, `num_global_key_value_heads` and values from the key projection),
    rotated by proportional rope; with `enable_moe_block` (26B-A4B), a mixture of experts beside each layer's dense MLP
    (ModelConfig.experts_beside_mlp); E2B/E4B's per-layer embeddings (`hidden_size_per_layer_input`) and last
    `num_kv_shared_layers` layers reading earlier layers' K/V (with MLPs twice as wide: `use_double_wide_mlp`)."""
    arch = hf["architectures"][0]
    if arch == "Gemma4ForConditionalGeneration":
        hf = _language_model_config(hf, dict(hf.get("text_config") or {}), arch,
                                    ("eos_token_id", "bos_token_id", "dtype", "torch_dtype", "quantization_config"))
    hf = _GEMMA4_DEFAULTS | {key: value for key, value in hf.items()
                             if value is not None or key not in ("global_head_dim", "rope_parameters",
                                                                 "vocab_size_per_layer_input")}
    for key, what in (("use_bidirectional_attention", "bidirectional attention"),
                      ("quantization_config", "quantized checkpoints")):
        if hf.get(key):
            raise ValueError(f"{key}={hf[key]!r}: {what} of Gemma 4 are not supported yet")
    num_layers = hf["num_hidden_layers"]
    layer_types = list(hf.get("layer_types") or _every_nth_full(num_layers, 6))
    layer_types[-1] = "full_attention"  # as transformers forces it
    shared = hf.get("num_kv_shared_layers") or 0
    if not 0 <= shared < num_layers or set(layer_types[num_layers - shared:]) - set(layer_types[:num_layers - shared]):
        raise ValueError(f"num_kv_shared_layers={shared}: the layers before the shared ones must include one of each "
                         f"kind among them (of {num_layers} layers: {layer_types})")
    full = [i for i, kind in enumerate(layer_types) if kind == "full_attention"]
    k_eq_v = bool(hf.get("attention_k_eq_v", False))
    overrides = hf.get("per_layer_config")  # transformers 5's saved form: {layer: {head_dim, num_key_value_heads}}
    if overrides is not None:
        overrides = {int(layer): dict(o) for layer, o in overrides.items()}
        shapes = {tuple(sorted(o.items())) for o in overrides.values()}
        if set(overrides) != set(full) or len(shapes) != 1 or not set(dict(*shapes)) <= {"head_dim",
                                                                                         "num_key_value_heads"}:
            raise ValueError(f"per_layer_config must give every full-attention layer ({full}) the same head_dim / "
                             f"num_key_value_heads and no other layer anything, got {hf['per_layer_config']}")
        global_shape = dict(*shapes)
    else:
        global_shape = {"head_dim": hf["global_head_dim"]}
        if k_eq_v and hf.get("num_global_key_value_heads"):
            global_shape["num_key_value_heads"] = hf["num_global_key_value_heads"]
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    hf = hf | {"layer_types": layer_types, "hidden_act": "gelu_pytorch_tanh" if act == "gelu" else act}
    hf, local_rope = _layer_type_ropes(hf)
    cfg = model_config_from_hf(hf, qk_norm=True)
    global_dim = global_shape.get("head_dim", cfg.head_dim)
    global_kv = global_shape.get("num_key_value_heads", cfg.num_kv_heads)
    if cfg.num_heads % global_kv:
        raise ValueError(f"num_attention_heads={cfg.num_heads} is not a multiple of the full-attention layers' "
                         f"{global_kv} KV heads")
    check_rotary_dim(cfg.rope, global_dim)
    experts = {}
    if hf.get("enable_moe_block"):
        experts = dict(num_experts=hf["num_experts"], experts_per_token=hf["top_k_experts"],
                       moe_intermediate_size=hf["moe_intermediate_size"], norm_topk_prob=True, experts_beside_mlp=True)
    return dataclasses.replace(
        cfg, **experts, architecture=arch, embed_scale=cfg.hidden_size ** 0.5, sandwich_norms=True, attn_scale=1.0,
        final_logit_softcap=hf.get("final_logit_softcapping"), local_rope=local_rope, v_norm=True, layer_scale=True,
        full_attention_heads=(global_dim, global_kv, k_eq_v),
        per_layer_input_size=hf.get("hidden_size_per_layer_input") or 0,
        per_layer_vocab_size=hf["vocab_size_per_layer_input"] if hf.get("hidden_size_per_layer_input") else 0,
        kv_shared_layers=shared, double_wide_mlp=bool(shared and hf.get("use_double_wide_mlp")))


# Qwen's hybrid models (Gated DeltaNet linear-attention layers among gated full-attention ones): architecture -> its
# text config's transformers model_type (the multimodal checkpoints served on text, as Qwen-VL's are)
QWEN3_5_ARCHITECTURES = {
    "Qwen3_5ForCausalLM": "qwen3_5_text", "Qwen3_5ForConditionalGeneration": "qwen3_5_text",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text", "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe_text",
    "Qwen3NextForCausalLM": "qwen3_next",
}


def qwen3_5_config_from_hf(hf: dict) -> ModelConfig:
    """Qwen3.5 (dense and MoE; `*ForConditionalGeneration`: its language model, from `text_config`) and Qwen3-Next: by
    `layer_types`, Gated DeltaNet linear-attention layers (`linear_layers`, `linear_heads`) among full-attention ones
    whose q_proj also gives a gate on their output per head (`attn_output_gate`), q/k norms, a partial rotary
    embedding (M-RoPE in Qwen3.5: the plain one on text, as Qwen3-VL's); RMSNorms scaling by 1 + weight; MoE: Qwen2
    MoE's experts with a gated shared expert (renormalised top k; Qwen3-Next's dense layers by `mlp_only_layers` /
    `decoder_sparse_step`). The checkpoints' multi-token-prediction layers (`mtp.*`) are not loaded."""
    import transformers

    arch = hf["architectures"][0]
    if hf.get("quantization_config"):
        raise ValueError(f"quantized {arch} checkpoints are not supported yet (their linear-attention layers' "
                         f"projections are float only)")
    text = hf.get("text_config") or {} if arch.endswith("ForConditionalGeneration") else hf
    given = {k: v for k, v in text.items() if k not in ("architectures", "model_type", "transformers_version")}
    text = transformers.AutoConfig.for_model(QWEN3_5_ARCHITECTURES[arch], **given).to_dict()
    text["rope_parameters"] = {k: v for k, v in (text.get("rope_parameters") or {}).items() if k not in _MROPE_KEYS}
    text = _language_model_config(hf, text, arch, ("eos_token_id", "bos_token_id", "dtype", "torch_dtype"))
    layer_types = text.pop("layer_types")
    unknown = sorted(set(layer_types) - {"linear_attention", "full_attention"})
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported; only linear_attention and full_attention")
    if text.get("sliding_window"):
        raise ValueError(f"sliding_window={text['sliding_window']!r} is not supported for {arch} (its full-attention "
                         f"layers attend to the whole context)")
    cfg = model_config_from_hf(text | {"intermediate_size": text.get("intermediate_size") or 0}, qk_norm=True)
    heads = tuple(int(text[f"linear_{name}"]) for name in ("num_key_heads", "num_value_heads", "key_head_dim",
                                                             "value_head_dim", "conv_kernel_dim"))
    if heads[1] % heads[0]:
        raise ValueError(f"linear_num_value_heads={heads[1]} is not a multiple of linear_num_key_heads={heads[0]}")
    experts = {}
    if text.get("num_experts"):
        only, step = set(text.get("mlp_only_layers") or ()), text.get("decoder_sparse_step", 1)
        dense = tuple(i for i in range(cfg.num_layers) if i in only or (i + 1) % step)
        shared = text.get("shared_expert_intermediate_size") or 0
        experts = dict(num_experts=text["num_experts"], experts_per_token=text["num_experts_per_tok"],
                       moe_intermediate_size=text["moe_intermediate_size"], intermediate_size=shared,
                       shared_expert_gate=shared > 0, norm_topk_prob=bool(text.get("norm_topk_prob", True)),
                       dense_mlp_layers=dense, dense_intermediate_size=cfg.intermediate_size if dense else 0)
    tied = bool(hf.get("tie_word_embeddings", cfg.tie_word_embeddings))
    return dataclasses.replace(
        cfg, **experts, architecture=arch, tie_word_embeddings=tied, norm_offset=True,
        attn_output_gate=bool(text.get("attn_output_gate", True)),
        linear_layers=tuple(i for i, kind in enumerate(layer_types) if kind == "linear_attention"), linear_heads=heads)


LFM2_ARCHITECTURES = ("Lfm2ForCausalLM", "Lfm2MoeForCausalLM")


def lfm2_config_from_hf(hf: dict) -> ModelConfig:
    """LFM2 (`Lfm2ForCausalLM`: LFM2-350M to 2.6B) and LFM2-MoE (`Lfm2MoeForCausalLM`: LFM2-8B-A1B): by `layer_types`
    (or `full_attn_idxs`), gated short convolutions (`short_conv_width`: conv_L_cache; biases by `conv_bias`) among
    attention layers with per-head q/k norms; SwiGLU MLPs, LFM2's width adjusted as transformers adjusts it
    (`block_auto_adjust_ff_dim`: two thirds, times `block_ffn_dim_multiplier`, rounded up to `block_multiple_of`);
    LFM2-MoE's first `num_dense_layers` dense (intermediate_size), the others the top `num_experts_per_tok` experts by
    sigmoid scores (chosen with its `expert_bias` where `use_expert_bias`), renormalised, times
    `routed_scaling_factor`."""
    arch = hf["architectures"][0]
    if hf.get("quantization_config"):
        raise ValueError(f"quantized {arch} checkpoints are not supported yet (their convolution layers' projections "
                         f"are float only)")
    num_layers = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types")
    if layer_types is None:
        full = hf.get("full_attn_idxs")
        full = range(num_layers) if full is None else full
        layer_types = ["full_attention" if i in full else "conv" for i in range(num_layers)]
    unknown = sorted(set(layer_types) - {"conv", "full_attention"})
    if unknown or len(layer_types) != num_layers:
        raise ValueError(f"layer_types must give each of the {num_layers} layers conv or full_attention, got "
                         f"{layer_types!r}")
    width = hf.get("intermediate_size", 12288)
    if arch == "Lfm2ForCausalLM" and hf.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        multiplier = hf.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            multiple = hf.get("block_multiple_of", 256)
            width = multiple * ((int(multiplier * width) + multiple - 1) // multiple)
    text = {k: v for k, v in hf.items() if k != "layer_types"} | {
        "intermediate_size": width, "rms_norm_eps": hf.get("norm_eps", 1e-5),
        "rope_theta": hf.get("rope_theta", 1000000.0)}
    cfg = dataclasses.replace(
        model_config_from_hf(text, qk_norm=True), architecture=arch,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        linear_layers=tuple(i for i, kind in enumerate(layer_types) if kind == "conv"),
        short_conv_width=int(hf.get("conv_L_cache", 3)), conv_bias=bool(hf.get("conv_bias", False)))
    if arch == "Lfm2MoeForCausalLM":
        cfg = _deepseek_experts(hf | {"n_routed_experts": hf.get("num_experts", 32), "n_shared_experts": 0,
                                      "first_k_dense_replace": hf.get("num_dense_layers", 2), "n_group": 1,
                                      "topk_group": 1, "num_experts_per_tok": hf.get("num_experts_per_tok", 4),
                                      "moe_intermediate_size": hf.get("moe_intermediate_size", 1792)},
                                cfg, first_dense=2, renormalize=True)
        cfg = dataclasses.replace(cfg, router_float32=False, router_renorm_eps=1e-6,
                                  router_correction=bool(hf.get("use_expert_bias", True)))
    return cfg


def moe_config_from_hf(hf: dict) -> ModelConfig:
    """Mixtral, Qwen2 MoE and Qwen3 MoE: the Llama/Qwen layer with a mixture-of-experts MLP (Qwen2 MoE with its
    gated shared expert); in Qwen MoE, the layers that `mlp_only_layers` or `decoder_sparse_step` leave dense have a
    dense MLP of `intermediate_size` (as transformers builds them)."""
    arch = hf["architectures"][0]
    experts = dict(num_experts=hf.get("num_local_experts") or hf.get("num_experts"),  # transformers 5 / the hub's
                   experts_per_token=hf["num_experts_per_tok"])
    if arch == "MixtralForCausalLM":
        cfg = model_config_from_hf(hf)
        return dataclasses.replace(cfg, **experts, moe_intermediate_size=cfg.intermediate_size, intermediate_size=0,
                                   norm_topk_prob=True)
    step, only = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"decoder_sparse_step must be a positive integer, got {step!r}")
    dense = tuple(i for i in range(hf["num_hidden_layers"]) if i in only or (i + 1) % step)
    qwen2 = arch == "Qwen2MoeForCausalLM"
    shared = hf.get("shared_expert_intermediate_size", 0) if qwen2 else 0
    cfg = model_config_from_hf(hf, qkv_bias=True, o_bias=False) if qwen2 else model_config_from_hf(hf, qk_norm=True)
    return dataclasses.replace(cfg, **experts, moe_intermediate_size=hf["moe_intermediate_size"],
                               intermediate_size=shared, norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                               shared_expert_gate=shared > 0, dense_mlp_layers=dense,
                               dense_intermediate_size=cfg.intermediate_size if dense else 0)


def olmoe_config_from_hf(hf: dict) -> ModelConfig:
    """OLMoE: the Llama layer with q/k norms over the whole projections and a mixture of experts in every layer
    (softmax over all experts' logits, the top `num_experts_per_tok`, renormalised by `norm_topk_prob`; each expert
    of `intermediate_size`, no shared one). `clip_qkv` (clamping q, k and v) is refused."""
    if hf.get("clip_qkv") is not None:
        raise ValueError(f"clip_qkv={hf['clip_qkv']!r} is not supported (only null: no clamping of q, k and v)")
    cfg = model_config_from_hf(hf, qk_norm=True)
    return dataclasses.replace(cfg, qk_norm_whole=True, num_experts=hf["num_experts"],
                               experts_per_token=hf["num_experts_per_tok"], moe_intermediate_size=cfg.intermediate_size,
                               intermediate_size=0, norm_topk_prob=bool(hf.get("norm_topk_prob", False)))


def minimax_m2_config_from_hf(hf: dict) -> ModelConfig:
    """MiniMax-M2 (`MiniMaxM2ForCausalLM`: M2, M2.1, M2.5): the Llama layer with q/k norms over the whole projections
    (`qk_norm_type` per_layer), a partial rotary embedding (`rotary_dim` of each head), and a mixture of experts in
    every layer: sigmoid scores of a float32 router, the top `num_experts_per_tok` chosen with a correction bias
    (`use_routing_bias`), their weights renormalised; no shared expert. Its config is read through transformers'
    MiniMaxM2Config (the hub's rotary_dim as the rope's partial_rotary_factor). MiniMax-Text-01's lightning attention
    (`attn_type_list` 0), sliding windows, shared experts and other scorers are refused; the MTP modules (layers
    past num_hidden_layers) are not loaded."""
    full = _completed(hf, "MiniMaxM2Config")
    layers = full["num_hidden_layers"]
    kinds = full.get("attn_type_list")
    if kinds is not None and list(kinds) != [1] * layers:
        raise ValueError(f"attn_type_list={kinds!r} is not supported: every layer full attention (1); lightning "
                         f"attention (0, MiniMax-Text-01's) is not served")
    refused = {"qk_norm_type": (full.get("qk_norm_type", "per_layer"), ("per_layer",)),
               "scoring_func": (full.get("scoring_func", "sigmoid"), ("sigmoid",)),
               "shared_intermediate_size": (full.get("shared_intermediate_size") or 0, (0,)),
               "routed_scaling_factor": (full.get("routed_scaling_factor", 1.0), (1, 1.0)),
               "sliding_window": (full.get("sliding_window"), (None,)),
               "attn_window_size": (full.get("attn_window_size"), (None,))}
    refused |= {name: (full.get(name, 1.0), (1, 1.0)) for name in (
        "layernorm_full_attention_beta", "layernorm_linear_attention_beta", "layernorm_mlp_beta")}
    for name, (value, served) in refused.items():
        if value not in served:
            raise ValueError(f"{name}={value!r} is not supported for MiniMaxM2ForCausalLM; supported: "
                             f"{', '.join(map(repr, served))}")
    qk_norm = bool(full.get("use_qk_norm", True))
    cfg = model_config_from_hf(full, qk_norm=qk_norm)
    return dataclasses.replace(
        cfg, qk_norm_whole=qk_norm, num_experts=full["num_local_experts"],
        experts_per_token=full["num_experts_per_tok"], moe_intermediate_size=cfg.intermediate_size,
        intermediate_size=0, norm_topk_prob=True, router_scoring="sigmoid", router_float32=True,
        router_correction=bool(full.get("use_routing_bias", True)))


HUNYUAN_ARCHITECTURES = ("HunYuanDenseV1ForCausalLM", "HunYuanMoEV1ForCausalLM")


def _uniform(hf: dict, name: str, layers: int):
    """Config key `name` given as one value or as one per layer (HunYuan's lists): the value, which every layer must
    share."""
    value = hf[name]
    if isinstance(value, list):
        if len(value) != layers or len(set(value)) != 1:
            raise ValueError(f"{name}={value!r}: a value per layer that differs between layers is not supported")
        value = value[0]
    return value


def hunyuan_config_from_hf(hf: dict) -> ModelConfig:
    """HunYuan (`HunYuanDenseV1ForCausalLM`: Hunyuan-0.5B..7B; `HunYuanMoEV1ForCausalLM`: Hunyuan-A13B): the Llama
    layer with per-head q/k norms on the rotated q and k (`query_layernorm`, `key_layernorm`), its rope's base
    stretched by a fixed NTK `alpha` (the hub's rope type "dynamic" with an alpha: theta alpha^(d / (d - 2)) for
    head_dim d, as transformers computes it; "dynamic" without one is refused). MoE: in every layer the top `moe_topk`
    of `num_experts` experts by the softmax of a float32 router, renormalised, beside one shared MLP (its config's
    per-layer lists must hold one value; experts and the shared MLP of `intermediate_size`, as transformers builds
    them). Cross-layer attention (`use_cla`), skipped MoE layers and other shared-expert counts are refused."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = params.get("rope_type") or params.get("type")
    if kind == "dynamic" and params.get("alpha"):
        head_dim = hf.get("head_dim") or hf.get("attention_head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        theta = params.get("rope_theta") or hf.get("rope_theta") or 10000.0
        hf = hf | {"rope_parameters": {"rope_type": "default",
                                       "rope_theta": theta * params["alpha"] ** (head_dim / (head_dim - 2))},
                   "rope_scaling": None}
    if hf.get("use_cla"):
        raise ValueError("use_cla=true (cross-layer attention: K/V shared between layers) is not supported")
    if hf.get("head_dim") is None and hf.get("attention_head_dim"):
        hf = hf | {"head_dim": hf["attention_head_dim"]}
    cfg = dataclasses.replace(model_config_from_hf(hf, qk_norm=bool(hf.get("use_qk_norm", True))),
                              qk_norm_after_rope=True)
    if hf["architectures"][0] == "HunYuanDenseV1ForCausalLM":
        return cfg
    layers = cfg.num_layers
    checks = {"num_shared_expert": (1,), "use_mixed_mlp_moe": (True,), "moe_layer_num_skipped": (0,)}
    for name, served in checks.items():
        if name in hf and _uniform(hf, name, layers) not in served:
            raise ValueError(f"{name}={hf[name]!r} is not supported; supported: {served[0]!r}")
    if "moe_intermediate_size" in hf and _uniform(hf, "moe_intermediate_size", layers) != cfg.intermediate_size:
        raise ValueError(f"moe_intermediate_size={hf['moe_intermediate_size']!r} is not supported: the experts are "
                         f"intermediate_size={cfg.intermediate_size} wide (as transformers builds them)")
    return dataclasses.replace(
        cfg, num_experts=_uniform(hf, "num_experts", layers), experts_per_token=_uniform(hf, "moe_topk", layers),
        moe_intermediate_size=cfg.intermediate_size, norm_topk_prob=True, router_float32=True)


def glm4_moe_config_from_hf(hf: dict) -> ModelConfig:
    """GLM-4.5 / 4.6 (Glm4MoeForCausalLM): GLM's attention (q/k/v biases, half of each head rotated; here in
    half-split pairs, and q/k norms where `use_qk_norm`), dense MLPs in the first `first_k_dense_replace` layers and
    in the others a mixture of `n_routed_experts` with `n_shared_experts` shared ones (one dense MLP of their
    combined width), routed as DeepSeek V3 routes (sigmoid scores, a correction bias, `n_group` / `topk_group`,
    `routed_scaling_factor`). The checkpoint's multi-token-prediction layers (past num_hidden_layers) are not
    loaded."""
    hf = hf | {"partial_rotary_factor": hf.get("partial_rotary_factor", 0.5)}
    cfg = model_config_from_hf(hf, qk_norm=bool(hf.get("use_qk_norm", False)), o_bias=False)
    return _deepseek_experts(hf, cfg, first_dense=1, renormalize=True)


def dots1_config_from_hf(hf: dict) -> ModelConfig:
    """dots.llm1 (Dots1ForCausalLM): Qwen3's attention (per-head q/k norms; biases by `attention_bias`; sliding-window
    layers by `layer_types`) over GLM-4.5's mixture of experts (DeepSeek V3's router, shared experts, dense first
    layers), with its own defaults (no dense layers, no renormalisation)."""
    return _deepseek_experts(hf, model_config_from_hf(hf, qk_norm=True), first_dense=0, renormalize=False)


def solar_open_config_from_hf(hf: dict) -> ModelConfig:
    """Solar Open (`SolarOpenForCausalLM`, Upstage's): Llama's attention (q/k/v biases by `attention_bias`, none on
    o_proj) over GLM-4.5's mixture of experts in every layer (DeepSeek V3's router, shared experts)."""
    return _deepseek_experts(hf, model_config_from_hf(hf, o_bias=False), first_dense=0, renormalize=True)


def hy_v3_config_from_hf(hf: dict) -> ModelConfig:
    """Hy3 (`HYV3ForCausalLM`: tencent/Hy3-preview): the Llama layer with per-head q/k norms (Apertus's attention),
    dense MLPs in the layers `mlp_layer_types` calls dense (by default the first) and in the others DeepSeek V3's
    mixture of experts without groups: sigmoid scores of a float32 router, the top `num_experts_per_tok` chosen with
    a correction bias (`expert_bias`), renormalised, times `router_scaling_factor`, beside `num_shared_experts`
    shared ones. Its config is read through transformers' HYV3Config; the MTP layers (past num_hidden_layers) are
    not loaded."""
    full = _completed(hf, "HYV3Config")
    cfg = model_config_from_hf(full, qk_norm=True)
    return _deepseek_experts(full | {"n_routed_experts": full["num_experts"], "n_group": 1, "topk_group": 1,
                                     "n_shared_experts": full["num_shared_experts"], "norm_topk_prob": True,
                                     "routed_scaling_factor": full["router_scaling_factor"]},
                             cfg, first_dense=1, renormalize=True)


def afmoe_config_from_hf(hf: dict) -> ModelConfig:
    """AFMoE (`AfmoeForCausalLM`: Arcee's Trinity): per-head q/k norms, each head's output gated elementwise by
    sigmoid(x @ its gate_proj), rotation in the sliding-window layers only (`layer_types`, by default every
    `global_attn_every_n_layers`-th layer full attention, without rotation), norms on the attention's and the MLP's
    inputs and outputs, the embeddings times sqrt(hidden_size) where `mup_enabled`; dense MLPs in the first
    `num_dense_layers` layers, then DeepSeek V3's ungrouped router (sigmoid scores chosen with a correction bias,
    renormalised, times `route_scale`) beside `num_shared_experts` shared experts. Read through transformers'
    AfmoeConfig."""
    full = _completed(hf, "AfmoeConfig")
    cfg = model_config_from_hf(full, qk_norm=True)
    rotating = tuple(w > 0 for w in cfg.sliding_windows)
    cfg = dataclasses.replace(cfg, sandwich_norms=True, attn_output_gate=True,
                              rope_layers=() if all(rotating) else rotating,
                              embed_scale=cfg.hidden_size ** 0.5 if full.get("mup_enabled") else None)
    return _deepseek_experts(full | {"n_routed_experts": full["num_experts"], "n_group": 1, "topk_group": 1,
                                     "n_shared_experts": full["num_shared_experts"], "norm_topk_prob": True,
                                     "routed_scaling_factor": full["route_scale"],
                                     "first_k_dense_replace": full["num_dense_layers"]},
                             cfg, first_dense=1, renormalize=True)


def exaone_moe_config_from_hf(hf: dict) -> ModelConfig:
    """EXAONE MoE (`ExaoneMoeForCausalLM`: K-EXAONE): EXAONE 4's attention (per-head q/k norms; sliding-window layers by
    `layer_types` or `sliding_window_pattern`, the full-attention ones then without rotary embedding) under norms on
    the attention's and MLP's inputs, over DeepSeek V3's mixture of experts (`num_experts` routed by sigmoid scores with
    a correction bias, groups, `routed_scaling_factor` (2.5 by default), renormalised; `num_shared_experts` shared;
    dense layers by `mlp_layer_types` or `first_k_dense_replace`)."""
    cfg = dataclasses.replace(exaone4_config_from_hf(hf), pre_norms=True, sandwich_norms=False)
    hf = hf | {"n_routed_experts": hf.get("num_experts") or 64, "n_shared_experts": hf.get("num_shared_experts", 1)}
    return _deepseek_experts(hf, cfg, first_dense=1, renormalize=True, scaling=2.5)


def _deepseek_experts(hf: dict, cfg: ModelConfig, first_dense: int, renormalize: bool, scoring: str = "sigmoid",
                      scaling: float = 1.0) -> ModelConfig:
    """`cfg` with DeepSeek's mixture of experts as its config gives it (`first_dense`, `renormalize` and `scaling`:
    the defaults of first_k_dense_replace, norm_topk_prob and routed_scaling_factor). `scoring` sigmoid: DeepSeek
    V3's router (GLM-4.5's: `noaux_tc`, a correction bias, groups); softmax: DeepSeek V2's (`greedy`, or
    `group_limited_greedy`: within the `topk_group` groups of the best single scores)."""
    methods = {"sigmoid": ("noaux_tc",), "softmax": ("greedy", "group_limited_greedy")}[scoring]
    method = hf.get("topk_method") or methods[0]
    if method not in methods or (hf.get("scoring_func") or scoring) != scoring:
        raise ValueError(f"only the {scoring} router ({' or '.join(methods)}) is supported for "
                         f"{hf['architectures'][0]}, got topk_method={hf.get('topk_method')!r}, "
                         f"scoring_func={hf.get('scoring_func')!r}")
    experts, dense = hf["n_routed_experts"], hf.get("first_k_dense_replace", first_dense) or 0
    dense_layers = tuple(range(dense)) if 0 <= dense <= cfg.num_layers else None
    types = hf.get("mlp_layer_types")  # GLM-4.7-Flash's: each layer's "dense" or "sparse"
    if types is not None:
        if len(types) != cfg.num_layers or not set(types) <= {"dense", "sparse"}:
            raise ValueError(f"mlp_layer_types must give each of the {cfg.num_layers} layers 'dense' or 'sparse', got "
                             f"{types!r}")
        dense_layers = tuple(i for i, kind in enumerate(types) if kind == "dense")
    n_group, topk_group = hf.get("n_group", 1) or 1, hf.get("topk_group", 1) or 1
    if method == "greedy":
        n_group = 1
    if not (n_group >= 1 and experts % n_group == 0 and 1 <= topk_group <= n_group):
        raise ValueError(f"n_group={n_group} must divide n_routed_experts={experts}, topk_group={topk_group} within it")
    if dense_layers is None:
        raise ValueError(f"first_k_dense_replace={dense} must be within the {cfg.num_layers} layers")
    shared = hf.get("n_shared_experts", 1) or 0
    return dataclasses.replace(
        cfg, num_experts=experts, experts_per_token=hf["num_experts_per_tok"],
        moe_intermediate_size=hf["moe_intermediate_size"], intermediate_size=shared * hf["moe_intermediate_size"],
        dense_intermediate_size=cfg.intermediate_size, dense_mlp_layers=dense_layers,
        norm_topk_prob=bool(hf.get("norm_topk_prob", renormalize)), router_scoring=scoring, router_float32=True,
        router_correction=scoring == "sigmoid",
        router_groups=(n_group, topk_group) if n_group > 1 else (),
        routed_scaling=float(hf.get("routed_scaling_factor", scaling)))


def deepseek_config_from_hf(hf: dict) -> ModelConfig:
    """DeepSeek V2 (`DeepseekV2ForCausalLM`: V2, V2-Lite, V2.5) and V3 (`DeepseekV3ForCausalLM`: V3, R1, Kimi K2,
    Moonlight): multi-head latent attention (ModelConfig.kv_lora_rank), its rotary dimensions in interleaved pairs
    (V2's always, V3's where `rope_interleave`, the default; laid out at load as half-split ones) and its scores
    scaled by YaRN's mscale_all_dim twice over (as transformers' yarn_apply_mscale); dense MLPs in the first
    `first_k_dense_replace` layers and a mixture of experts with shared experts in the others: V2's softmax router,
    V3's sigmoid one (`_deepseek_experts`). The checkpoint's multi-token-prediction layers are not loaded. GLM-4.7-Flash
    (`Glm4MoeLiteForCausalLM`): V3's layers, its dense ones by `mlp_layer_types` (by default the first)."""
    lite = hf["architectures"][0] == "Glm4MoeLiteForCausalLM"
    v3 = hf["architectures"][0] == "DeepseekV3ForCausalLM" or lite
    if hf.get("attention_bias"):
        raise ValueError("attention_bias=true is not supported for multi-head latent attention")
    dims = {name: hf.get(name) for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
    for name, value in dims.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    q_lora_rank = hf.get("q_lora_rank") or 0
    if not isinstance(q_lora_rank, int) or q_lora_rank < 0:
        raise ValueError(f"q_lora_rank must be a positive integer or null, got {q_lora_rank!r}")
    if dims["qk_rope_head_dim"] % 2:
        raise ValueError(f"qk_rope_head_dim must be even, got {dims['qk_rope_head_dim']}")
    # the KV cache's one head: the latent and the rotary key
    cfg = model_config_from_hf(hf | {"head_dim": dims["kv_lora_rank"] + dims["qk_rope_head_dim"],
                                     "num_key_value_heads": 1, "partial_rotary_factor": None})
    rope = cfg.rope
    scale = (dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"]) ** -0.5
    mscale_all_dim, factor = rope.param("mscale_all_dim"), rope.param("factor")
    if rope.rope_type != "default" and mscale_all_dim and factor and factor > 1:
        scale *= (0.1 * mscale_all_dim * math.log(factor) + 1.0) ** 2
    cfg = dataclasses.replace(cfg, q_lora_rank=q_lora_rank, **dims, attn_scale=scale,
                              rope_interleaved=bool(hf.get("rope_interleave", True)) if v3 else True)
    if v3:
        return _deepseek_experts(hf, cfg, first_dense=1 if lite else 3, renormalize=True, scaling=1.8 if lite else 2.5)
    return _deepseek_experts(hf, cfg, first_dense=0, renormalize=False, scoring="softmax")


def mistral4_config_from_hf(hf: dict) -> ModelConfig:
    """Mistral Small 4 (`Mistral4ForCausalLM`): DeepSeek V3's latent attention (interleaved rotary pairs where
    `rope_interleave`, YaRN's mscale on the scores) with Llama 4's attention temperature (the rope's
    `llama_4_scaling_beta`, every layer), and DeepSeek V2's softmax router over all experts (the top
    `num_experts_per_tok`, renormalised where `norm_topk_prob`, times `routed_scaling_factor`) beside shared experts,
    dense MLPs in the first `first_k_dense_replace` layers. Read through transformers' Mistral4Config; expert groups
    that select (n_group > topk_group) are refused."""
    full = _completed(hf, "Mistral4Config")
    n_group, topk_group = full.get("n_group") or 1, full.get("topk_group") or 1
    if n_group != topk_group:
        raise ValueError(f"n_group={n_group} with topk_group={topk_group} (expert groups that select) is not supported "
                         f"for Mistral4ForCausalLM")
    rope = dict(full["rope_parameters"])  # the rotary dimensions are qk_rope_head_dim's (the partial factor's)
    beta, length = rope.pop("llama_4_scaling_beta", None), rope.get("original_max_position_embeddings")
    for key in ("partial_rotary_factor", "max_position_embeddings"):
        rope.pop(key, None)
    cfg = deepseek_config_from_hf(full | {"architectures": ["DeepseekV2ForCausalLM"], "rope_parameters": rope,
                                          "rope_scaling": None, "topk_method": "greedy", "n_group": 1,
                                          "topk_group": 1})
    cfg = dataclasses.replace(cfg, architecture=hf["architectures"][0],
                              rope_interleaved=bool(full.get("rope_interleave", True)))
    return _with_attention_temperature(cfg, beta, length)


def kimi_linear_config_from_hf(hf: dict) -> ModelConfig:
    """Kimi Linear (`KimiLinearForCausalLM`: Kimi-Linear-48B-A3B): its config read through transformers'
    KimiLinearConfig (which derives layer_types from the hub's `linear_attn_config` and mlp_layer_types from
    first_k_dense_replace); Kimi Delta Attention layers (`linear_kda`: Gated DeltaNet's recurrence with a decay per
    key row, over q/k/v convolved 4 wide, heads of linear_head_dim) among DeepSeek V3's latent attention layers
    without rotary embedding (NoPE: their rotary part unrotated, the scores scaled by the whole query head's width);
    DeepSeek V3's experts (sigmoid router, correction bias, shared experts) but in the dense MLP layers."""
    if hf.get("quantization_config"):
        raise ValueError("quantized KimiLinearForCausalLM checkpoints are not supported yet (their linear layers' "
                         "projections are float only)")
    if (hf.get("moe_router_activation_func") or "sigmoid") != "sigmoid":
        raise ValueError(f"only the sigmoid router is supported for KimiLinearForCausalLM, got "
                         f"moe_router_activation_func={hf.get('moe_router_activation_func')!r}")
    if hf.get("mla_use_nope") is False:
        raise ValueError("mla_use_nope=false (rotary latent attention) is not supported for KimiLinearForCausalLM: "
                         "transformers' Kimi Linear attention has no rotary embedding")
    full = _completed(hf, "KimiLinearConfig")
    types = full["layer_types"]
    if not set(types) <= {"linear_attention", "full_attention"}:
        raise ValueError(f"layer_types must give each layer linear_attention or full_attention, got {types!r}")
    deepseek = full | {"architectures": ["DeepseekV3ForCausalLM"], "n_routed_experts": full["num_experts"],
                       "num_experts_per_tok": full["num_experts_per_token"],
                       "n_shared_experts": full["num_shared_experts"], "norm_topk_prob": full["moe_renormalize"],
                       "n_group": full["num_expert_group"], "max_position_embeddings": full["model_max_length"],
                       "rope_parameters": None, "rope_scaling": None, "rope_interleave": False, "topk_method": None,
                       "scoring_func": None, "dtype": hf.get("dtype") or hf.get("torch_dtype"), "layer_types": None,
                       "sliding_window": None}
    cfg = deepseek_config_from_hf(deepseek)
    heads, head_dim = full["linear_num_heads"], full["linear_head_dim"]
    return dataclasses.replace(
        cfg, architecture=hf["architectures"][0], rope_layers=(False,) * cfg.num_layers, linear_kda=True,
        linear_layers=tuple(i for i, kind in enumerate(types) if kind == "linear_attention"),
        linear_heads=(heads, heads, head_dim, head_dim, full["linear_conv_kernel_dim"]))


LLAMA4_ARCHITECTURES = ("Llama4ForCausalLM", "Llama4ForConditionalGeneration")


def llama4_config_from_hf(hf: dict) -> ModelConfig:
    """Llama 4 (Scout, Maverick; `Llama4ForConditionalGeneration` served as its text model, as Gemma 3): its text config
    read through transformers' Llama4TextConfig (which derives no_rope_layers, moe_layers and layer_types); rotary
    embedding in interleaved pairs (laid out at load as half-split ones) on all layers but every
    `no_rope_layer_interval`-th, whose queries take the attention temperature (`attn_temperature_tuning`:
    q_position_scale) and whose attention is full; the rotating layers' q and k RMS-normalised without weights after
    the rotation (`use_qk_norm`) and their attention chunked (`attention_chunk_size`: each query attends to the keys of
    its chunk only); in `moe_layers` a mixture of `num_local_experts` (the top `num_experts_per_tok` by sigmoid of the
    router's logits, each token's input times its weight) beside a shared expert, both of `intermediate_size`, the
    other layers dense of `intermediate_size_mlp`."""
    import transformers

    arch = hf["architectures"][0]
    if arch == "Llama4ForConditionalGeneration":
        text = hf.get("text_config") or {}
        hf = _language_model_config(hf, text, arch, ("eos_token_id", "bos_token_id", "dtype", "torch_dtype"))
    fields = {k: v for k, v in hf.items() if k not in ("architectures", "model_type", "transformers_version")}
    hf = transformers.Llama4TextConfig(**fields).to_dict() | {"architectures": [arch]}
    layers = hf["num_hidden_layers"]
    types = hf["layer_types"]
    unknown = sorted(set(types) - {"full_attention", "chunked_attention"})
    if unknown or len(types) != layers:
        raise ValueError(f"layer_types must give each of the {layers} layers full_attention or chunked_attention, "
                         f"got {types!r}")
    chunk = hf.get("attention_chunk_size")
    if "chunked_attention" in types and not (isinstance(chunk, int) and chunk > 0):
        raise ValueError(f"attention_chunk_size must be a positive integer for chunked_attention layers, got {chunk!r}")
    rope_layers = tuple(bool(v) for v in hf["no_rope_layers"])
    moe_layers = set(hf["moe_layers"])
    if len(rope_layers) != layers or not moe_layers <= set(range(layers)):
        raise ValueError(f"no_rope_layers must give each of the {layers} layers 0 or 1 and moe_layers be among them")
    cfg = model_config_from_hf(hf | {"layer_types": None, "sliding_window": None, "intermediate_size":
                                     hf["intermediate_size_mlp"]})
    temperature = ()
    if hf.get("attn_temperature_tuning"):
        temperature = (_positive(hf, "attn_scale", 0.1), int(_positive(hf, "floor_scale", 8192)), 1, True)
    return dataclasses.replace(
        cfg, rope_interleaved=True, rope_layers=rope_layers if not all(rope_layers) else (),
        sliding_windows=tuple(-chunk if t == "chunked_attention" else 0 for t in types),
        qk_l2_norm=bool(hf.get("use_qk_norm")), q_position_scale=temperature,
        num_experts=hf["num_local_experts"], experts_per_token=hf["num_experts_per_tok"],
        moe_intermediate_size=hf["intermediate_size"], intermediate_size=hf["intermediate_size"],
        router_scoring="sigmoid", moe_input_scaled=True, dense_intermediate_size=hf["intermediate_size_mlp"],
        dense_mlp_layers=tuple(i for i in range(layers) if i not in moe_layers))


def gpt_oss_config_from_hf(hf: dict) -> ModelConfig:
    """GPT-OSS: attention with q/k/v/o biases and a sink logit per query head, alternate sliding-window layers
    (`layer_types`), YaRN, and a mixture of experts in every layer with biases on the router and on each expert's
    projections, softmax over the top experts' logits and the clamped SwiGLU (`swigluoai`). `hidden_act` in its
    config (silu) is not what the experts apply and is not read."""
    cfg = model_config_from_hf(hf | {"hidden_act": "silu"})
    if (hf.get("quantization_config") or {}).get("quant_method") == "mxfp4":  # experts dequantized at load
        cfg = dataclasses.replace(cfg, quant_method="mxfp4",  # the hub's other tensors are bfloat16
                                  torch_dtype=cfg.torch_dtype or "bfloat16")
    limit, alpha = _positive(hf, "swiglu_limit", 7.0), _positive(hf, "swiglu_alpha", 1.702)
    return dataclasses.replace(
        cfg, num_experts=hf["num_local_experts"], experts_per_token=hf.get("num_experts_per_tok") or
        hf["experts_per_token"], moe_intermediate_size=cfg.intermediate_size, intermediate_size=0,
        norm_topk_prob=True, moe_bias=True, hidden_act="swigluoai", swiglu_alpha=alpha, swiglu_limit=limit,
        attn_sinks=True)


def gemma3_language_config_from_hf(hf: dict) -> ModelConfig:
    """Gemma3ForConditionalGeneration's language model: its `text_config` completed with transformers'
    Gemma3TextConfig defaults (the hub's text configs list only what differs from them), with the top level's
    token ids and dtype."""
    import transformers

    text = _language_model_config(hf, transformers.Gemma3TextConfig(**(hf.get("text_config") or {})).to_dict(),
                                  "Gemma3ForCausalLM", ("eos_token_id", "bos_token_id", "dtype", "torch_dtype"))
    return dataclasses.replace(gemma_config_from_hf(text), architecture=hf["architectures"][0])
