"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 1-3, their mixtures of experts, GPT-OSS,
DeepSeek's latent attention; the LayerNorm models Cohere, StarCoder2, Phi, StableLM, GPT-NeoX) in Flax NNX over a
paged KV cache.

Layer weights are loaded stacked on a leading `num_layers` axis (one array per parameter: one transfer, one
sharding, one Orbax entry) and the layers run under `lax.scan`, which compiles an order of magnitude faster than
an unrolled Python loop where XLA's ops make up the layer. Packed for the native CPU matmul, the stacked weights
stay whole and the kernel reads the step's layer in place (XLA:CPU would convert every stacked bfloat16 weight
to float32 and back at each step to slice it). `unstack_layers()` gives each layer its own arrays and an
unrolled loop (the CPU default where XLA's dots take the weights: its steps run faster there).
Linear weights are stored `[in, out]` (transposed from Hugging Face's `[out, in]`).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.layers import linear_attention
from jaxengine.layers.activations import ACTIVATIONS, xielu
from jaxengine.layers.attention import (FP8_DTYPES, attention, kv_writer, latent_attention, reference_body,
                                        select_body, token_slots, write_kv, write_latent)
from jaxengine.layers.moe import SWIGLU_OAI, Mxfp4Experts, Routing, moe_mlp
from jaxengine.layers.norms import gemma_scale, layer_norm, rms_norm
from jaxengine.layers.rope import apply_rope, rope_tables
from jaxengine.models.config import (GRANITE_MOE_ARCHITECTURES, LLAMA4_ARCHITECTURES, MIXTRAL_NAMED_ARCHITECTURES,
                                     ModelConfig, rope_inv_freq)
from jaxengine.models.quantization import (QUANTIZED_LINEARS, W4A16, W8A8_INT8, W8A16_FP8, WEIGHT_ONLY, Int8Weight,
                                           WeightOnly, int8_matmul, projection_shapes, scale_groups)
from jaxengine.runner.batch import RaggedBatch

# Architectures whose checkpoints stack each layer's experts in one tensor per projection ([E, in, out]: gate/up split
# apart at load, registry._stacked_experts, registry._granite_moe_tensors): their experts' module and router tensor
_STACKED_EXPERTS = {name: ("feed_forward", "feed_forward.router.weight") for name in LLAMA4_ARCHITECTURES} | {
    name: ("block_sparse_moe", "block_sparse_moe.router.weight")
    for name in GRANITE_MOE_ARCHITECTURES + ("GraniteMoeHybridForCausalLM",)} | {
    name: ("mlp", "mlp.gate.weight") for name in ("Qwen3VLMoeForConditionalGeneration", "Mistral4ForCausalLM",
                                                  "Mistral3ForConditionalGeneration")}  # the last's: Mistral Small 4's


XIELU_PARAMS = ("act_alpha_p", "act_alpha_n", "act_beta", "act_eps")  # xIELU's, a layer's (checkpoint: mlp.act_fn.*)


def _param(shape, dtype, axes: tuple[str, ...]) -> nnx.Param:
    """A parameter named by logical axes (mapped to mesh axes in jaxengine/parallel/sharding.py). Models are
    built abstractly (nnx.eval_shape) and filled from checkpoints; zeros only give the shape."""
    return nnx.Param(jnp.zeros(shape, dtype), logical_axes=axes)


def _stack_index(w, layer):
    """The layer index the native matmul takes with `w`: a stacked packed weight [L, P, K2, 64] (the scanned
    layer loop's, read in place) needs it, one layer's [P, K2, 64] does not."""
    if isinstance(w, (Int8Weight, WeightOnly)):
        w = w.weight
    return layer if w.ndim == 4 else None


def _native(w) -> bool:
    """Whether `w` is packed for a native CPU matmul (bfloat16's, the int8 one's, or int4 or fp8 panels)."""
    if isinstance(w, WeightOnly):  # packed: pallas_kernels.cpu.pack_int4_panels' or pack_fp8_panels' uint8 panels
        return w.weight.dtype == jnp.uint8
    return w.comp is not None if isinstance(w, Int8Weight) else w.ndim >= 3


def _native_quantized(x, w, n: int, layer, **kwargs):
    """The native CPU matmul of float32 x and a packed quantized weight: W8A8's int8 kernel (pallas_kernels/
    cpu_int8.cc), or a weight-only one's int4 or fp8 panels dequantized as the bfloat16 kernel takes them."""
    from pallas_kernels import cpu

    if isinstance(w, Int8Weight):
        return cpu.matmul_int8(x, w.weight, w.comp, w.scale, n, layer=_stack_index(w, layer), **kwargs)
    return cpu.matmul_dequant(x, w.weight, w.scale, n, layer=_stack_index(w, layer), **kwargs)


def _in_order(x, w, norm=None):
    """(x, w, norm) as the matmul takes them: a packed W4A16 weight in activation order (WeightOnly.perm) takes
    x's columns in its order, and a norm weight over them likewise."""
    if not isinstance(w, WeightOnly) or w.perm is None:
        return x, w, norm
    return jnp.take(x, w.perm, -1), w._replace(perm=None), None if norm is None else jnp.take(norm, w.perm, -1)


def _dot(x, w, n: int, residual=None, live_rows=None, layer=None):
    """x @ w (+ residual) -> [.., n] in the weight's dtype, accumulated in float32 (a bf16 x bf16 -> bf16 dot is far
    slower on CPU), returned in x's dtype. A quantized weight (Int8Weight) quantizes x per row and multiplies in int8
    (jaxengine/models/quantization.py); a weight-only one (WeightOnly: W4A16, FP8) is dequantized first. A packed
    weight (`pack_for_native_matmul`: 3 dimensions, or 4 for all layers' stacked, of which `layer` is used) runs the
    native CPU kernel: same numbers up to summation order (pallas_kernels/cpu_matmul.cc), the residual added as the
    result is stored (packed quantized weights: `_native_quantized`). `live_rows` (i32[]): x's rows from it on are a
    bucket's padding, which the native kernel skips (they come out zero); XLA's dot computes them like the others."""
    x, w, _ = _in_order(x, w)
    if isinstance(w, WeightOnly) and not _native(w):
        w = w.dequantized()
    if isinstance(w, (Int8Weight, WeightOnly)) and _native(w):
        if residual is not None and x.dtype == jnp.float32:
            return _native_quantized(x, w, n, layer, residual=residual, live_rows=live_rows)
        out = _native_quantized(x.astype(jnp.float32), w, n, layer, live_rows=live_rows).astype(x.dtype)
    elif isinstance(w, Int8Weight):
        out = int8_matmul(x, w).astype(x.dtype)
    elif w.ndim >= 3:
        from pallas_kernels import cpu

        layer = _stack_index(w, layer)
        if residual is not None and x.dtype == jnp.float32:
            return cpu.matmul_bf16(x, w, n, residual=residual, live_rows=live_rows, layer=layer)
        out = cpu.matmul_bf16(x.astype(jnp.float32), w, n, live_rows=live_rows, layer=layer).astype(x.dtype)
    else:
        out = jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32).astype(x.dtype)
    return out if residual is None else residual + out


def _pre_norm(h, norm, eps: float):
    """rms_norm(h, norm, eps), or h where the layer has no norm there (`norm` None: OLMo 2's inputs)."""
    return h if norm is None else rms_norm(h, norm, eps)


def _normed_dot(h, norm, eps: float, w, n: int, live_rows=None, layer=None):
    """rms_norm(h, norm, eps) @ w (h @ w where `norm` is None); the native CPU matmul normalises the rows on its way
    in (no separate pass)."""
    if norm is None:
        return _dot(h, w, n, live_rows=live_rows, layer=layer)
    h, w, norm = _in_order(h, w, norm)
    if isinstance(w, (Int8Weight, WeightOnly)) and _native(w) and h.dtype == jnp.float32:
        return _native_quantized(h, w, n, layer, prologue="rms_norm", norm=norm, eps=eps, live_rows=live_rows)
    if _native(w) and h.dtype == jnp.float32:
        from pallas_kernels import cpu

        return cpu.matmul_bf16(h, w, n, prologue="rms_norm", norm=norm, eps=eps, live_rows=live_rows,
                               layer=_stack_index(w, layer))
    return _dot(rms_norm(h, norm, eps), w, n, live_rows=live_rows, layer=layer)


def _unpacked_gate_up(h, norm, eps: float, gate_up, live_rows=None, layer=None):
    """The gate and up products of a `pack_gated` weight over rms_norm(h), split back apart (for XLA's
    activation, or updates to add to each)."""
    from pallas_kernels import cpu

    width = (gate_up.weight if isinstance(gate_up, (Int8Weight, WeightOnly)) else gate_up).shape[-3] * cpu.PANEL
    return cpu.unpack_gated(_normed_dot(h, norm, eps, gate_up, width, live_rows, layer))


def _gated_mlp(h, norm, eps: float, gate_up, down, n: int, live_rows=None, layer=None, activation="silu",
               out_norm=None, x=None):
    """h + (act(gate) * up) @ down over rms_norm(h) for a gate/up projection packed by `pallas_kernels.cpu.
    pack_gated` (or quantized in its column order: `_pack_quantized_layer`; `out_norm`: h + rms_norm of that
    product, Gemma 2/3's post-MLP norm). `x`: the MLP's input where it is not h (a LayerNorm model's, normed
    before: `norm` None), h then the residual only. With float32 rows the native CPU matmul applies the activation to
    the gate/up products in registers and hands the down projection its input already rounded (W8A8: in float32, which
    the down projection quantizes; no [T, 2I] float32 intermediate either way), and adds the residual as it
    stores; otherwise the products are split back into gate and up for XLA's activation."""
    from pallas_kernels import cpu

    src = h if x is None else x
    if h.dtype == jnp.float32:
        settings = dict(live_rows=live_rows, layer=_stack_index(gate_up, layer),
                        prologue=None if norm is None else "rms_norm")
        if isinstance(gate_up, Int8Weight):  # W8A8: act(gate) * up in float32, quantized by the down projection
            gated = cpu.gated_int8(src, gate_up.weight, gate_up.comp, gate_up.scale, norm=norm, eps=eps,
                                   activation=activation, **settings)
            down_projection = functools.partial(_dot, gated, down, n, live_rows=live_rows, layer=layer)
        elif isinstance(gate_up, WeightOnly):  # weight-only (int4 or fp8 panels), dequantized panel by panel; in
            # activation order, the down projection's folded into gate/up's columns (_pack_quantized_layer)
            rows, gate_up, x_norm = _in_order(src, gate_up, norm)
            pairs = cpu.gated_pairs_dequant(rows, gate_up.weight, gate_up.scale, norm=x_norm, eps=eps,
                                            activation=activation, **settings)
            down_projection = functools.partial(cpu.matmul_dequant, pairs, down.weight, down.scale, n,
                                                **settings | {"prologue": "rounded"})
        else:
            pairs = cpu.gated_pairs(src, gate_up, norm=norm, eps=eps, activation=activation, **settings)
            down_projection = functools.partial(cpu.matmul_bf16, pairs, down, n, **settings | {"prologue": "rounded"})
        if out_norm is None:
            return down_projection(residual=h)
        return h + rms_norm(down_projection(), out_norm, eps)
    gate, up = _unpacked_gate_up(src, norm, eps, gate_up, live_rows, layer)
    gated = ACTIVATIONS[activation](gate) * up
    if out_norm is None:
        return _dot(gated, down, n, h, live_rows, layer)
    return h + rms_norm(_dot(gated, down, n, live_rows=live_rows, layer=layer), out_norm, eps)


def _per_head(x, w, n: int, layer):
    """x [T, heads, K] times each head's weight (w [heads, K, n]) -> float32 [T, heads, n]. Packed for the native CPU
    matmul ([heads, P, K2, 64], or all layers' [L, heads, P, K2, 64] read in place at `layer`): its grouped form, one
    group of T rows per head; otherwise XLA's batched dot (in float32 on CPU, whose batched dot takes no bfloat16
    operands)."""
    if w.ndim < 4:
        if jax.default_backend() == "cpu":
            w = w.astype(jnp.float32)
        return jnp.einsum("thk,hkn->thn", x.astype(w.dtype), w, preferred_element_type=jnp.float32)
    from pallas_kernels import cpu

    T, H, K = x.shape
    rows = x.astype(jnp.float32).transpose(1, 0, 2).reshape(H * T, K)
    out = cpu.grouped_matmul_bf16(rows, w.reshape(-1, *w.shape[-3:]), jnp.full((H,), T, jnp.int32),
                                  layer * H if w.ndim == 5 else 0, n)
    return out.reshape(H, T, n).transpose(1, 0, 2)


def _where_rotating(cfg: ModelConfig, layer, rotating, other):
    """`rotating` in a layer with rotary embedding, `other` in one without (every layer rotates where rope_layers is
    empty)."""
    return jnp.where(jnp.asarray(cfg.rope_layers)[layer], rotating, other) if cfg.rope_layers else rotating


def _position_scaled(cfg: ModelConfig, layer, batch: RaggedBatch, q):
    """q [T, heads, d] scaled up with each token's position where `q_position_scale` says (Ministral 3, Llama 4,
    Mistral Small 4: Llama 4's attention temperature, 1 + beta log(1 + floor((position + offset) / length))), in
    every layer or only those without rotary embedding."""
    if not cfg.q_position_scale:
        return q
    beta, length, offset, nope_only = cfg.q_position_scale
    scale = 1 + beta * jnp.log1p(jnp.floor((batch.positions.astype(jnp.float32) + offset) / length))
    scaled = q * scale.reshape(-1, *(1,) * (q.ndim - 1)).astype(q.dtype)
    return _where_rotating(cfg, layer, q, scaled) if nope_only else scaled


def _lora_delta(x, lora, name: str):
    """The LoRA adapters' update to projection `name` of x [T, in] (None where no adapter targets it): `lora` is
    (this layer's {name: (A f32[slots, in, rank], B f32[slots, rank, out])}, the tokens' slots one-hot f32[T,
    slots], whether any token has one); each token's update is its slot's (x A) B, all slots in two matmuls
    (jaxengine/lora.py), computed only in steps where a token has an adapter."""
    if lora is None or name not in lora[0]:
        return None
    width = lora[0][name][1].shape[-1]
    return jax.lax.cond(lora[2], lambda: _lora_update(x, lora, name),
                        lambda: jnp.zeros((x.shape[0], width), jnp.float32))


def _lora_update(x, lora, name: str):
    """`_lora_delta`'s update, computed whatever the step holds."""
    (a, b), onehot = lora[0][name], lora[1]
    xa = jnp.einsum("ti,sir->tsr", x.astype(jnp.float32), a) * onehot[:, :, None]
    return jnp.einsum("tsr,sro->to", xa, b)


def _plus(y, delta):
    return y if delta is None else y + delta.astype(y.dtype)


_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "expert_gate", "expert_up",
           "expert_down", "q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_k", "kv_b_v", "ple_gate", "ple_proj", "o_gate",
           "lin_out", "conv_in", "ssm_in", "moe_latent_in", "moe_latent_out", "lin_fb", "lin_gb", "ssm_x", "ssm_dt")


def _linear_inputs(cfg: ModelConfig) -> tuple[str, ...]:
    """A Gated DeltaNet layer's projections of its normed input, in the order they are fused at packing (`lin_in`):
    q/k/v, the output gate, the update rate's logits, the decay's (Kimi Delta Attention: q/k/v, the gate's and the
    decay's first low-rank halves, the rate's logits)."""
    return ("lin_qkv", "lin_ga", "lin_b", "lin_fa") if cfg.linear_kda else ("lin_qkv", "lin_z", "lin_b", "lin_a")


def _linear_input_widths(cfg: ModelConfig) -> tuple[int, ...]:
    """`_linear_inputs`' widths."""
    num_k, num_v, dk, dv, _ = cfg.linear_heads
    if cfg.linear_kda:
        return 2 * num_k * dk + num_v * dv, dv, num_v, dk
    return 2 * num_k * dk + num_v * dv, num_v * dv, num_v, num_v


def _norm_scale(cfg: ModelConfig, weight: jax.Array) -> jax.Array:
    """A norm's scale as the kernels take it (Gemma's 1 + weight in float32)."""
    return gemma_scale(weight) if cfg.norm_offset else weight


def _packed_axes(lead: tuple[str, ...]) -> tuple[str, ...]:
    """A packed weight's axes: the [in, out] weight's leading ones ("layers", "experts"), then the packing's."""
    return lead + ("packed",) * 3


def _packed(path, value) -> bool:
    """nnx filter: a weight packed for the native CPU matmul."""
    return isinstance(value, nnx.Variable) and "packed" in value.get_metadata().get("logical_axes", ())


def _pack(var: nnx.Variable) -> None:
    from pallas_kernels import cpu

    lead = var.get_metadata()["logical_axes"][:-2]  # ("layers",) of stacked weights, ("experts",) ...
    var.set_value(jax.device_put(cpu.pack_bf16(np.asarray(var.get_value()))))  # packed on the host
    var.set_metadata("logical_axes", _packed_axes(lead))


def _pack_layer(layer) -> None:
    """Packs a layer's matmul weights. q/k/v, where their widths are whole panels (32 columns), become one
    packed weight (their panels side by side): one native call instead of three, with enough panels to share
    between threads (k/v of a small model have 6 each). gate/up, where the width is a multiple of 16, become
    one `pack_gated` weight (16 columns of each to a panel) for `_gated_mlp`, whose kernel applies the
    activation (silu or tanh-GELU: not the exact GELU; nor for a mixture of experts' shared expert, which is
    scaled before the residual). A mixture of experts' gate/up weights of such activations and widths become
    one `pack_gated` weight per expert (layers.moe's grouped native matmul; GPT-OSS's clamped SwiGLU where its
    constants are gpt-oss's, its gate/up biases as one more input row); each of its projections is otherwise
    packed on its own. MXFP4 experts (`ModelConfig.mxfp4_experts`) were packed at load."""
    from pallas_kernels import cpu

    def take(name):  # on the host: packing there compiles nothing (cpu.pack_bf16)
        value = np.asarray(getattr(layer, name).get_value())
        delattr(layer, name)
        return value

    cfg = layer.cfg
    lead = (layer.lin_out if cfg.linear_attention else layer.o_proj).get_metadata()["logical_axes"][:-2]  # ("layers",)
    # when stacked
    parts = tuple(part for part in ("q_proj", "k_proj", "v_proj") if hasattr(layer, part))  # k_eq_v: no v_proj
    gated = cfg.hidden_act in cpu.GATED_ACTIVATIONS
    if cfg.quantization is not None:  # its projections; a mixture of experts' experts are float (dequantized at load)
        _pack_quantized_layer(layer, lead)
    else:
        if not cfg.latent_attention and len(parts) > 1 and all(
                getattr(layer, part).get_value().shape[-1] % cpu.PANEL == 0 for part in parts):
            value = np.concatenate([cpu.pack_bf16(take(part)) for part in parts], axis=-3)
            layer.qkv_proj = nnx.Param(jax.device_put(value), logical_axes=_packed_axes(lead))
        if cfg.linear_attention and cfg.linear_heads:  # Gated DeltaNet's four input projections as one
            # (DecoderLayers._linear_attention)
            value = cpu.pack_bf16(np.concatenate([take(name) for name in _linear_inputs(cfg)], -1))
            layer.lin_in = nnx.Param(jax.device_put(value), logical_axes=_packed_axes(lead))
        if (gated and cfg.gated_mlp and not (cfg.num_experts or cfg.mlp_bias) and cfg.intermediate_size
                and layer.gate_proj.get_value().shape[-1] % cpu.GATED == 0):
            layer.gate_up_proj = nnx.Param(jax.device_put(cpu.pack_gated(take("gate_proj"), take("up_proj"))),
                                           logical_axes=_packed_axes(lead))
    if (cfg.num_experts and gated and cfg.moe_intermediate_size % cpu.GATED == 0 and not cfg.mxfp4_experts
            and (cfg.hidden_act != SWIGLU_OAI or (cfg.swiglu_alpha, cfg.swiglu_limit) == cpu.SWIGLU_OAI_CONSTANTS)):
        gate, up = take("expert_gate"), take("expert_up")
        if cfg.moe_bias:  # GPT-OSS: each bias as one more input row, which x meets with a 1 (moe_mlp's folded_bias)
            gate = np.concatenate([gate, take("expert_gate_bias")[..., None, :]], axis=-2)
            up = np.concatenate([up, take("expert_up_bias")[..., None, :]], axis=-2)
        layer.expert_gate_up = nnx.Param(jax.device_put(cpu.pack_gated(gate, up)),
                                         logical_axes=_packed_axes(lead + ("experts",)))
    for name in _LINEAR if cfg.quantization is None else ("expert_gate", "expert_up", "expert_down"):
        if hasattr(layer, name) and not (cfg.mxfp4_experts and name.startswith("expert_")):  # MXFP4's: at load
            _pack(getattr(layer, name))


def _pack_quantized_layer(layer, lead) -> None:
    """Packs a quantized layer's projections for the native CPU matmuls, fused as `_pack_layer` fuses bfloat16 ones:
    q/k/v side by side as one `qkv_proj`; gate/up, where the width is a multiple of 16 and the activation one the
    kernels apply, as one `gate_up_proj` in `pack_gated`'s column order (for `_gated_mlp`); each with its scales (and
    W8A8's `_comp`). W8A8: `pallas_kernels.cpu.pack_int8` where the CPU has AVX-512 VNNI; W4A16: `pack_int4_panels`
    (dequantized to bfloat16 panel by panel; zero points become biases beside the scales) and FP8: `pack_fp8_panels`
    (likewise), for groups of an even size. In activation order (g_idx), each projection's inputs are sorted by group
    (its rows permuted, the step permuting x's columns likewise: `_perm`), q/k/v's and gate/up's alike where fused,
    and the down projection's order is folded into gate/up's output columns (its x then comes in that order).
    Otherwise they stay as they are (XLA's int8 dots; weight-only ones dequantized whole at each step)."""
    from pallas_kernels import cpu

    cfg = layer.cfg
    int8 = cfg.quantization == W8A8_INT8
    even_groups = all(width // scale_groups(cfg, width) % 2 == 0 for _, width in projection_shapes(cfg).values())
    if not (cpu.int8_matmul_available() if int8 else even_groups):
        return
    plan = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",)}
    if cfg.intermediate_size:
        # a mixture of experts' shared expert stays two projections (mlp() adds the experts' output to it)
        together = (cfg.hidden_act in cpu.GATED_ACTIVATIONS and cfg.intermediate_size % cpu.GATED == 0
                    and not cfg.num_experts)
        plan |= ({"gate_up_proj": ("gate_proj", "up_proj")} if together else
                 {"gate_proj": ("gate_proj",), "up_proj": ("up_proj",)}) | {"down_proj": ("down_proj",)}
    names = [name for names in plan.values() for name in names]
    perms = {}
    if cfg.quant_act_order:  # each projection's inputs sorted by group (a stable sort: groups in turn)
        perms = {name: np.argsort(np.asarray(getattr(layer, name + "_g_idx").get_value()), -1, kind="stable")
                 for name in names}
        if any(not np.array_equal(perms[names[0]], perms[name]) for names in plan.values() for name in names):
            return  # fused projections in different orders: XLA's path
    parts = {"", "_scale"} | ({"_zero"} if cfg.quant_zero_point else set())
    values = {name + part: np.asarray(getattr(layer, name + part).get_value()) for name in names for part in parts}
    for name in names:
        for part in parts | ({"_g_idx"} if perms else set()):
            delattr(layer, name + part)
    for name, perm in perms.items():
        values[name] = np.take_along_axis(values[name], perm[..., :, None], -2)
    if "down_proj" in perms:  # gate/up's columns in the down projection's order: its x comes in it
        down = perms.pop("down_proj")
        for key in [name + part for name in ("gate_proj", "up_proj") for part in parts]:
            values[key] = np.take_along_axis(values[key], down[..., None, :], -1)

    def take(names):  # the projections' values, scales (and zero points) side by side (gate/up: in pack_gated's
        # column order)
        join = cpu.gated_columns if names == ("gate_proj", "up_proj") else lambda *a: np.concatenate(a, -1)
        return [join(*(values[name + part] for name in names)) for part in ("", "_scale", "_zero") if part in parts]

    pack = {W8A8_INT8: cpu.pack_int8, W4A16: cpu.pack_int4_panels, W8A16_FP8: cpu.pack_fp8_panels}[cfg.quantization]
    for fused, names in plan.items():
        arrays = pack(*take(names))
        for suffix, array in zip(("", "_comp", "_scale") if int8 else ("", "_scale"), arrays):
            axes = lead + ("packed",) * (array.ndim - len(lead))
            setattr(layer, fused + suffix, nnx.Param(jax.device_put(array), logical_axes=axes))
        perm = perms.get(names[0])
        if perm is not None and not np.array_equal(perm, np.broadcast_to(np.arange(perm.shape[-1]), perm.shape)):
            axis = "heads" if fused == "o_proj" else "embed"
            setattr(layer, fused + "_perm", nnx.Param(jax.device_put(perm.astype(np.int32)),
                                                      logical_axes=lead + (axis,)))


# The epsilon of multi-head latent attention's norms over its latents: DeepSeek's own (its reference code's and
# transformers'), whatever rms_norm_eps says (the hub's configs give 1e-6 too)
LATENT_NORM_EPS = 1e-6


class DecoderLayers(nnx.Module):
    """All decoder layers; every parameter has a leading `num_layers` axis. Calling it runs one layer's slice."""

    def __init__(self, cfg: ModelConfig, dtype, attention_backend: str = "auto", first_layer: int = 0,
                 one_device: bool = True):
        """`cfg`: the layers' (layer_groups': `num_layers` of them, the model's from `first_layer` on). `one_device`:
        the model runs on one device (the KV writer's choice: layers.attention.kv_writer)."""
        L, D, I = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
        self.attention_backend = attention_backend
        self.one_device = one_device
        self.first_layer = first_layer  # the KV cache's layer of this stack's first
        q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.cfg = cfg
        # the projections' weights
        linear = {None: dtype, W8A16_FP8: jnp.float8_e4m3fn}.get(cfg.quantization, jnp.int8)
        if cfg.pre_norms:
            self.attn_norm = _param((L, D), dtype, ("layers", "embed"))
            if cfg.norm_bias:
                self.attn_norm_bias = _param((L, D), dtype, ("layers", "embed"))
        if cfg.linear_attention and cfg.short_conv_width:
            self._short_conv_params(dtype)
        elif cfg.linear_attention and cfg.ssm_heads:
            self._mamba_params(dtype)
        elif cfg.linear_attention and cfg.mamba1:
            self._mamba1_params(dtype)
        elif cfg.linear_attention:
            self._linear_attention_params(dtype)
        elif cfg.latent_attention:
            self._latent_attention_params(dtype)
        else:
            self.q_proj = _param((L, D, q_width), linear, ("layers", "embed", "heads"))
            if cfg.kv_source < 0:  # a shared-KV layer projects queries only
                self.k_proj = _param((L, D, kv_width), linear, ("layers", "embed", "kv_heads"))
            if not cfg.k_eq_v and cfg.kv_source < 0:
                self.v_proj = _param((L, D, kv_width), linear, ("layers", "embed", "kv_heads"))
            self.o_proj = _param((L, q_width, D), linear, ("layers", "heads", "embed"))
        if cfg.ssm_parallel:  # Falcon-H1: a Mamba2 mixer beside the attention
            self._mamba_params(dtype)
        if cfg.attn_output_gate:  # Qwen3.5: each head's output gate (its half of the checkpoint's q_proj)
            self.o_gate = _param((L, D, q_width), linear, ("layers", "embed", "heads"))
        if cfg.qkv_bias:
            self.q_bias = _param((L, q_width), dtype, ("layers", "heads"))
            if cfg.kv_source < 0:
                self.k_bias = _param((L, kv_width), dtype, ("layers", "kv_heads"))
            if not cfg.k_eq_v and cfg.kv_source < 0:
                self.v_bias = _param((L, kv_width), dtype, ("layers", "kv_heads"))
        if cfg.o_bias:
            self.o_bias = _param((L, D), dtype, ("layers", "embed"))
        if cfg.qk_norm and (cfg.qk_norm_whole or cfg.qk_norm_per_head):  # weights over every head's dimensions
            self.q_norm = _param((L, q_width), dtype, ("layers", "heads"))
            self.k_norm = _param((L, kv_width), dtype, ("layers", "kv_heads"))
        elif cfg.qk_norm:
            self.q_norm = _param((L, cfg.head_dim), dtype, ("layers", "head_dim"))
            if cfg.kv_source < 0:
                self.k_norm = _param((L, cfg.head_dim), dtype, ("layers", "head_dim"))
        if cfg.qk_norm_bias:
            self.q_norm_bias = _param((L, cfg.head_dim), dtype, ("layers", "head_dim"))
            self.k_norm_bias = _param((L, cfg.head_dim), dtype, ("layers", "head_dim"))
        if cfg.mlp_input_norm:
            self.mlp_norm = _param((L, D), dtype, ("layers", "embed"))
            if cfg.norm_bias:
                self.mlp_norm_bias = _param((L, D), dtype, ("layers", "embed"))
        if cfg.sandwich_norms:
            self.post_attn_norm = _param((L, D), dtype, ("layers", "embed"))
            self.post_mlp_norm = _param((L, D), dtype, ("layers", "embed"))
        if I:  # the dense MLP, or a mixture of experts' shared expert
            if cfg.gated_mlp:
                self.gate_proj = _param((L, D, I), linear, ("layers", "embed", "mlp"))
            self.up_proj = _param((L, D, I), linear, ("layers", "embed", "mlp"))
            self.down_proj = _param((L, I, D), linear, ("layers", "mlp", "embed"))
            if cfg.mlp_bias:
                if cfg.gated_mlp:
                    self.gate_bias = _param((L, I), dtype, ("layers", "mlp"))
                self.up_bias = _param((L, I), dtype, ("layers", "mlp"))
                self.down_bias = _param((L, D), dtype, ("layers", "embed"))
        if cfg.num_experts:
            E, M = cfg.num_experts, cfg.moe_intermediate_size
            # DeepSeek's routers' logits in float32 (transformers' DeepSeek V2/V3 and GLM-4.5 routers compute them so)
            router_dtype = jnp.float32 if cfg.router_float32 else dtype
            self.router = _param((L, D, E), router_dtype, ("layers", "embed", "experts"))
            if cfg.router_correction:
                self.router_correction = _param((L, E), jnp.float32, ("layers", "experts"))
            if cfg.experts_beside_mlp:  # Gemma 4: the router's norm (its scale by hidden_size ** -0.5: registry.
                # _gemma4_tensors), each expert's scale; the experts' input and output norms, the dense MLP's output's
                self.router_norm = _param((L, D), dtype, ("layers", "embed"))
                self.expert_scale = _param((L, E), dtype, ("layers", "experts"))
                for name in ("expert_norm", "post_expert_norm", "post_dense_norm"):
                    setattr(self, name, _param((L, D), dtype, ("layers", "embed")))
            if cfg.mxfp4_experts:  # as pallas_kernels.cpu.pack_mxfp4_panels packs them (registry._GptOssTensors)
                from pallas_kernels.cpu import PANEL

                for name, (n, k) in (("expert_gate_up", (2 * M, D)), ("expert_down", (D, M))):
                    axes = _packed_axes(("layers", "experts"))
                    setattr(self, name, _param((L, E, -(-n // PANEL), k // 2, PANEL), jnp.uint8, axes))
                    setattr(self, name + "_exponents", _param((L, E, -(-n // PANEL), k // 32, PANEL), jnp.uint8, axes))
            else:  # ungated where the model's MLPs are (Nemotron-H's); over a latent where moe_latent_size
                X = cfg.moe_latent_size or D
                if cfg.gated_mlp:
                    self.expert_gate = _param((L, E, X, M), dtype, ("layers", "experts", "embed", "mlp"))
                self.expert_up = _param((L, E, X, M), dtype, ("layers", "experts", "embed", "mlp"))
                self.expert_down = _param((L, E, M, X), dtype, ("layers", "experts", "mlp", "embed"))
            if cfg.moe_latent_size:
                self.moe_latent_in = _param((L, D, cfg.moe_latent_size), dtype, ("layers", "embed", "latent"))
                self.moe_latent_out = _param((L, cfg.moe_latent_size, D), dtype, ("layers", "latent", "embed"))
        if cfg.moe_bias:
            self.router_bias = _param((L, E), dtype, ("layers", "experts"))
            if cfg.mxfp4_experts:  # gate's and up's in pack_gated's column order, in float32 as the kernel adds them
                self.expert_gate_up_bias = _param((L, E, 2 * M), jnp.float32, ("layers", "experts", "packed"))
            else:
                self.expert_gate_bias = _param((L, E, M), dtype, ("layers", "experts", "mlp"))
                self.expert_up_bias = _param((L, E, M), dtype, ("layers", "experts", "mlp"))
            self.expert_down_bias = _param((L, E, D), dtype, ("layers", "experts", "embed"))
        if cfg.attn_sinks:  # each query head's sink logit, in float32 as the attention takes it
            self.sinks = _param((L, cfg.num_heads), jnp.float32, ("layers", "heads"))
        if cfg.shared_expert_gate:
            self.shared_expert_gate = _param((L, D, 1), dtype, ("layers", "embed", "unit"))
        if cfg.layer_scale:
            self.layer_scale = _param((L,), dtype, ("layers",))
        if cfg.hidden_act == "xielu":  # its parameters (layers.activations.xielu), float32 as it computes
            for name in XIELU_PARAMS:
                setattr(self, name, _param((L,), jnp.float32, ("layers",)))
        if cfg.per_layer_input_size:  # Gemma 4's per-layer input branch: its gate, its projection, the output's norm
            P = cfg.per_layer_input_size
            self.ple_gate = _param((L, D, P), dtype, ("layers", "embed", "per_layer"))
            self.ple_proj = _param((L, P, D), dtype, ("layers", "per_layer", "embed"))
            self.ple_norm = _param((L, D), dtype, ("layers", "embed"))
        if cfg.quant_kv_scales:  # the checkpoint's KV cache scales (kv_scales)
            self.k_scale = _param((L,), jnp.float32, ("layers",))
            self.v_scale = _param((L,), jnp.float32, ("layers",))
        for name in QUANTIZED_LINEARS if cfg.quantization is not None else ():
            if hasattr(self, name):  # W8A8: its scales per output channel; W4A16 and FP8: per group of inputs too
                # (and W4A16's zero points)
                axes = getattr(self, name).get_metadata()["logical_axes"]
                _, width, out = getattr(self, name).get_value().shape
                if cfg.quantization == W8A8_INT8:
                    setattr(self, name + "_scale", _param((L, out), jnp.float32, (axes[0], axes[-1])))
                    continue
                scale_dtype = jnp.float32 if cfg.quantization == W8A16_FP8 else dtype
                setattr(self, name + "_scale", _param((L, scale_groups(cfg, width), out), scale_dtype, axes))
                if cfg.quant_zero_point:
                    setattr(self, name + "_zero", _param((L, scale_groups(cfg, width), out), jnp.int8, axes))
                if cfg.quant_act_order:  # each input's group
                    setattr(self, name + "_g_idx", _param((L, width), jnp.int32, axes[:2]))

    def _linear_attention_params(self, dtype) -> None:
        """Gated DeltaNet's (ModelConfig.linear_heads; jaxengine/layers/linear_attention.py): the input's projections
        to the convolved q/k/v (`lin_qkv`), the output gate (`lin_z`), the update rate's and the decay's logits
        (`lin_b`, `lin_a`); the depthwise convolution [width, channels]; each value head's decay parameters (A_log,
        dt_bias: float32, as the decay is computed); the output's gated norm [value head_dim]; `lin_out`. Kimi Delta
        Attention's (`linear_kda`): the decay and the output gate each through a rank of head_dim (`lin_fa` then
        `lin_fb`, `lin_ga` then `lin_gb`), the time-step bias per key channel."""
        cfg = self.cfg
        L, D = cfg.num_layers, cfg.hidden_size
        num_k, num_v, dk, dv, width = cfg.linear_heads
        channels = 2 * num_k * dk + num_v * dv
        for name, n in zip(_linear_inputs(cfg), _linear_input_widths(cfg)):
            setattr(self, name, _param((L, D, n), dtype, ("layers", "embed", "linear")))
        if cfg.linear_kda:  # the decay's and the output gate's low-rank second halves
            self.lin_fb = _param((L, dk, num_v * dk), dtype, ("layers", "head_dim", "linear"))
            self.lin_gb = _param((L, dv, num_v * dv), dtype, ("layers", "head_dim", "linear"))
        self.lin_conv = _param((L, width, channels), dtype, ("layers", "conv", "linear"))
        self.lin_a_log = _param((L, num_v), jnp.float32, ("layers", "linear"))
        # the decay's time-step bias: each value head's (Kimi Delta Attention: each key channel's)
        self.lin_dt_bias = _param((L, num_v * dk if cfg.linear_kda else num_v), jnp.float32, ("layers", "linear"))
        self.lin_norm = _param((L, dv), dtype, ("layers", "head_dim"))
        self.lin_out = _param((L, num_v * dv, D), dtype, ("layers", "linear", "embed"))

    def _short_conv_params(self, dtype) -> None:
        """LFM2's gated short convolution (ModelConfig.short_conv_width): the input's projection to B, C and x
        (`conv_in`, [D, 3 D]), the depthwise convolution [width, D], `lin_out`; their biases where `conv_bias`."""
        cfg = self.cfg
        L, D = cfg.num_layers, cfg.hidden_size
        self.conv_in = _param((L, D, 3 * D), dtype, ("layers", "embed", "linear"))
        self.conv_w = _param((L, cfg.short_conv_width, D), dtype, ("layers", "conv", "embed"))
        self.lin_out = _param((L, D, D), dtype, ("layers", "linear", "embed"))
        if cfg.conv_bias:
            self.conv_in_bias = _param((L, 3 * D), dtype, ("layers", "linear"))
            self.conv_w_bias = _param((L, D), dtype, ("layers", "embed"))
            self.lin_out_bias = _param((L, D), dtype, ("layers", "embed"))

    def _mamba_params(self, dtype) -> None:
        """A Mamba2 mixer's (ModelConfig.ssm_heads): the input's projection to the gate z, the convolved x, B and C and
        the time steps (`ssm_in`), the depthwise convolution [width, channels] and its bias, each head's time-step
        bias, A_log and skip D (float32, as they are computed), the gated norm's weight, `lin_out`; the projections'
        biases where `ssm_proj_bias`."""
        cfg = self.cfg
        L, D = cfg.num_layers, cfg.hidden_size
        H, P, N, G, width = cfg.ssm_heads
        channels = H * P + 2 * G * N
        self.ssm_in = _param((L, D, H * P + channels + H), dtype, ("layers", "embed", "linear"))
        self.ssm_conv = _param((L, width, channels), dtype, ("layers", "conv", "linear"))
        if cfg.ssm_conv_bias:
            self.ssm_conv_bias = _param((L, channels), dtype, ("layers", "linear"))
        for name in ("ssm_dt_bias", "ssm_a_log", "ssm_d"):
            setattr(self, name, _param((L, H), jnp.float32, ("layers", "linear")))
        if cfg.ssm_norm:
            self.ssm_norm = _param((L, H * P), dtype, ("layers", "linear"))
        self.lin_out = _param((L, H * P, D), dtype, ("layers", "linear", "embed"))
        if cfg.ssm_proj_bias:
            self.ssm_in_bias = _param((L, H * P + channels + H), dtype, ("layers", "linear"))
            self.lin_out_bias = _param((L, D), dtype, ("layers", "embed"))

    def _mamba1_params(self, dtype) -> None:
        """A Mamba1 mixer's (ModelConfig.mamba1): the input's projection to x and the gate z (`ssm_in`), the depthwise
        convolution [width, inner] and its bias, x's projection to dt's input, B and C (`ssm_x`), dt's projection
        (`ssm_dt`) and bias, A_log [inner, state size] and the skip D (float32, as they are computed), `lin_out`; the
        norms on dt's, B's and C's inputs where weighted (Jamba's); the in/out projections' biases where
        `ssm_proj_bias`."""
        cfg = self.cfg
        L, D = cfg.num_layers, cfg.hidden_size
        inner, N, rank, width = cfg.mamba1
        self.ssm_in = _param((L, D, 2 * inner), dtype, ("layers", "embed", "linear"))
        self.ssm_conv = _param((L, width, inner), dtype, ("layers", "conv", "linear"))
        if cfg.ssm_conv_bias:
            self.ssm_conv_bias = _param((L, inner), dtype, ("layers", "linear"))
        self.ssm_x = _param((L, inner, rank + 2 * N), dtype, ("layers", "linear", "state"))
        self.ssm_dt = _param((L, rank, inner), dtype, ("layers", "state", "linear"))
        self.ssm_dt_bias = _param((L, inner), jnp.float32, ("layers", "linear"))
        self.ssm_a_log = _param((L, inner, N), jnp.float32, ("layers", "linear", "state"))
        self.ssm_d = _param((L, inner), jnp.float32, ("layers", "linear"))
        self.lin_out = _param((L, inner, D), dtype, ("layers", "linear", "embed"))
        if cfg.ssm_bcdt_norm and cfg.ssm_bcdt_norm[0]:
            for name, n in (("ssm_dt_norm", rank), ("ssm_b_norm", N), ("ssm_c_norm", N)):
                setattr(self, name, _param((L, n), dtype, ("layers", "state")))
        if cfg.ssm_proj_bias:
            self.ssm_in_bias = _param((L, 2 * inner), dtype, ("layers", "linear"))
            self.lin_out_bias = _param((L, D), dtype, ("layers", "embed"))

    def _latent_attention_params(self, dtype) -> None:
        """Multi-head latent attention's projections (DeepSeek V2/V3; ModelConfig.kv_lora_rank): the queries from the
        hidden state (`q_proj`) or through a normed latent (`q_a_proj`, `q_a_norm`, `q_b_proj`), each head's
        unrotated then rotated dimensions; the KV latent and the rotary key (`kv_a_proj`), the latent's norm; the
        latent's up-projection to each head's unrotated key and its value (the checkpoint's kv_b_proj as each head's
        key part `kv_b_k` [heads, nope, latent] and value part `kv_b_v` [heads, latent, v], registry._deepseek_tensors:
        absorbed into the queries and the attention's output, `_latent_attention`); `o_proj`."""
        cfg = self.cfg
        L, D, H, R = cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.q_lora_rank:
            self.q_a_proj = _param((L, D, cfg.q_lora_rank), dtype, ("layers", "embed", "latent"))
            self.q_a_norm = _param((L, cfg.q_lora_rank), dtype, ("layers", "latent"))
            self.q_b_proj = _param((L, cfg.q_lora_rank, H * qk), dtype, ("layers", "latent", "heads"))
        else:
            self.q_proj = _param((L, D, H * qk), dtype, ("layers", "embed", "heads"))
        self.kv_a_proj = _param((L, D, R + cfg.qk_rope_head_dim), dtype, ("layers", "embed", "latent"))
        self.kv_a_norm = _param((L, R), dtype, ("layers", "latent"))
        self.kv_b_k = _param((L, H, cfg.qk_nope_head_dim, R), dtype, ("layers", "heads", "head_dim", "latent"))
        self.kv_b_v = _param((L, H, R, cfg.v_head_dim), dtype, ("layers", "heads", "latent", "head_dim"))
        self.o_proj = _param((L, H * cfg.v_head_dim, D), dtype, ("layers", "heads", "embed"))

    def norm(self, name: str) -> jax.Array | None:
        """RMSNorm `name`'s scale, as the matmuls take it on their way in; None for the inputs' norms of a layer
        without them (`pre_norms` false, a parallel block's MLP: `mlp_input_norm`) or with LayerNorms, which are
        applied before (`input_norm`)."""
        if name in ("attn_norm", "mlp_norm") and (self.cfg.layer_norm or not self.cfg.pre_norms or (
                name == "mlp_norm" and not self.cfg.mlp_input_norm)):
            return None
        return _norm_scale(self.cfg, getattr(self, name)[...])

    def input_norm(self, h, name: str):
        """A LayerNorm model's input norm `name` (attn_norm, mlp_norm) over h, with its bias where it has one."""
        bias = getattr(self, name + "_bias")[...] if self.cfg.norm_bias else None
        return layer_norm(h, getattr(self, name)[...], bias, self.cfg.rms_norm_eps)

    def head_norm(self, x, name: str):
        """x [T, heads, head_dim] through q/k norm `name` head by head: one weight for every head, or each head's own
        (`qk_norm_per_head`); a LayerNorm (with Phi's bias: `qk_norm_bias`) in a LayerNorm model."""
        cfg = self.cfg
        weight = getattr(self, name)[...]
        if cfg.qk_norm_per_head:
            weight = weight.reshape(x.shape[1], cfg.head_dim)
        if cfg.layer_norm:
            bias = getattr(self, name + "_bias")[...] if cfg.qk_norm_bias else None
            return layer_norm(x, weight, bias, cfg.rms_norm_eps)
        return rms_norm(x, _norm_scale(cfg, weight), cfg.rms_norm_eps)

    def linear(self, name: str):
        """Projection `name`'s weight as the matmuls take it: the array, or an int8 one with its scales (packed
        for the native int8 matmul: with its comp)."""
        w = getattr(self, name)[...]
        if self.cfg.quantization is None:
            return w
        if self.cfg.quantization in WEIGHT_ONLY:
            zero, g_idx, perm = (getattr(self, name + part)[...] if hasattr(self, name + part) else None
                                 for part in ("_zero", "_g_idx", "_perm"))
            return WeightOnly(w, getattr(self, name + "_scale")[...], zero, g_idx, perm)
        comp = getattr(self, name + "_comp")[...] if hasattr(self, name + "_comp") else None
        return Int8Weight(w, getattr(self, name + "_scale")[...], comp)

    def kv_scales(self, cache_dtype) -> jax.Array | None:
        """This layer's KV cache scales f32[2] (K's, V's: K/V are stored divided by them) where the cache is float8
        and the checkpoint has them; None (1) otherwise, as vLLM leaves a float cache unscaled."""
        if jnp.dtype(cache_dtype) not in FP8_DTYPES or not hasattr(self, "k_scale"):
            return None
        return jnp.stack([self.k_scale[...], self.v_scale[...]]).astype(jnp.float32)

    def __call__(self, h, kv_cache, layer, window, batch: RaggedBatch, slots, ropes, lora=None, per_layer_input=None):
        """`ropes`: the rotary tables (cos, sin) of full-attention layers and those of sliding-window layers
        (None: the same). `lora`: the LoRA adapters' weights of this layer, the tokens' slots and whether any token
        has one (`_lora_delta`). `per_layer_input`: this layer's per-layer input [T, per_layer_input_size] (Gemma 4's
        per-layer embeddings; LlamaForCausalLM.per_layer_inputs)."""
        cfg = self.cfg
        # this stack's layer, and the model's (the KV cache's); the same in a model of one stack, whose programs are
        # then what they were before stacks (persistent compilation caches stay valid)
        weights_layer, layer = layer, layer + self.first_layer if self.first_layer else layer
        rope, local_rope = ropes
        if local_rope is not None:
            rope = tuple(jnp.where(window > 0, local, full) for local, full in zip(local_rope, rope))
        if not all(cfg.rope_layers):  # SmolLM3's NoPE layers rotate by angle 0: cosines 1, sines 0
            rotates = jnp.asarray(cfg.rope_layers)[layer]
            rope = (jnp.where(rotates, rope[0], jnp.ones_like(rope[0])), jnp.where(rotates, rope[1],
                                                                                  jnp.zeros_like(rope[1])))
        eps = cfg.rms_norm_eps
        live = batch.cu_q_lens[batch.num_seqs]  # tokens from here on are the bucket's padding
        layer_input = h
        x = self.input_norm(h, "attn_norm") if cfg.layer_norm else h  # RMSNorms: the projections' prologues
        D = cfg.hidden_size
        if cfg.ssm_parallel:  # Falcon-H1: the mixer beside the attention, over the same normed input, its output
            # into the residual first (the attention's joins it below)
            kv_cache, state = kv_cache
            y, state = self._mamba(x, state, layer, weights_layer, batch, live)
            h = self._state_output(y, h, live, weights_layer)
        if cfg.linear_attention and cfg.short_conv_width:
            o, kv_cache = self._short_conv(x, kv_cache, layer, weights_layer, batch, live)
        elif cfg.linear_attention and cfg.ssm_heads:
            o, kv_cache = self._mamba(x, kv_cache, layer, weights_layer, batch, live)
        elif cfg.linear_attention and cfg.mamba1:
            o, kv_cache = self._mamba1(x, kv_cache, layer, weights_layer, batch, live)
        elif cfg.linear_attention:
            o, kv_cache = self._linear_attention(x, kv_cache, layer, weights_layer, batch, live)
        elif cfg.latent_attention:
            o, kv_cache = self._latent_attention(x, kv_cache, layer, weights_layer, batch, slots, rope, live)
        else:
            o, kv_cache = self._attention(x, kv_cache, layer, weights_layer, window, batch, slots, rope, live, lora)
        if cfg.attn_output_gate:
            gate = _normed_dot(x, self.norm("attn_norm"), eps, self.linear("o_gate"), o.shape[-1], live, weights_layer)
            o = o * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(o.dtype)
        o_delta = _lora_delta(o, lora, "o_proj")
        if cfg.linear_attention:
            h = self._state_output(o, h, live, weights_layer)
        elif cfg.sandwich_norms:
            out = _plus(_dot(o, self.linear("o_proj"), D, live_rows=live, layer=weights_layer), o_delta)
            if cfg.o_bias:
                out = out + self.o_bias[...]
            h = h + rms_norm(out, self.norm("post_attn_norm"), eps)
        else:
            if cfg.o_bias:
                h = h + self.o_bias[...]
            h = _plus(_dot(o, self.linear("o_proj"), D, residual=h, live_rows=live, layer=weights_layer), o_delta)
        if lora is not None and any(p in lora[0] for p in ("gate_proj", "up_proj", "down_proj")):
            # the unfused MLP only in steps where a token has an adapter: the others keep the fused kernels (LoRA
            # is refused on LayerNorm models: jaxengine.lora.check_supported)
            h = jax.lax.cond(lora[2], lambda h: self._adapted_mlp(h, live, weights_layer, lora),
                             lambda h: self.mlp(h, live, weights_layer), h)
        else:
            mlp_input = None  # a LayerNorm model's MLP input: the layer's normed input, or its own norm's
            if cfg.parallel_block == 1:
                mlp_input = x
            elif cfg.layer_norm:
                mlp_input = self.input_norm(layer_input if cfg.parallel_block else h, "mlp_norm")
            h = self.mlp(h, live, weights_layer, mlp_input)
        if cfg.per_layer_input_size:  # Gemma 4: a residual branch gated by this layer's own input
            gated = ACTIVATIONS[cfg.hidden_act](_dot(h, self.ple_gate[...], cfg.per_layer_input_size, live_rows=live,
                                                     layer=weights_layer)) * per_layer_input.astype(h.dtype)
            h = h + rms_norm(_dot(gated, self.ple_proj[...], D, live_rows=live, layer=weights_layer),
                             self.norm("ple_norm"), eps)
        if cfg.layer_scale:  # Gemma 4: the whole residual stream
            h = h * self.layer_scale[...].astype(h.dtype)
        return h, (kv_cache, state) if cfg.ssm_parallel else kv_cache

    def _state_output(self, o, h, live, layer):
        """h + o @ lin_out (+ its bias where it has one): a state layer's (or Falcon-H1's mixer's) output into the
        residual."""
        residual = h + self.lin_out_bias[...] if hasattr(self, "lin_out_bias") else h
        return _dot(o, self.lin_out[...], self.cfg.hidden_size, residual=residual, live_rows=live, layer=layer)

    def _attention(self, h, kv_cache, layer, weights_layer, window, batch, slots, rope, live, lora):
        """(the attention's output [T, heads x head_dim] before o_proj, the KV cache with this step's K/V written) over
        the normed h."""
        cfg = self.cfg
        eps, T = cfg.rms_norm_eps, h.shape[0]
        q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        v_width = 0 if cfg.k_eq_v else kv_width
        scales = self.kv_scales(kv_cache.dtype)
        if cfg.kv_source >= 0:  # Gemma 4's shared-KV layers: queries over an earlier layer's K/V, nothing written
            q = _normed_dot(h, self.norm("attn_norm"), eps, self.linear("q_proj"), q_width, live, weights_layer)
            q = (q + self.q_bias[...] if cfg.qkv_bias else q).reshape(T, cfg.num_heads, cfg.head_dim)
            q = self.head_norm(q, "q_norm") if cfg.qk_norm and not cfg.qk_norm_after_rope else q
            q = apply_rope(q, *rope)
            q = self.head_norm(q, "q_norm") if cfg.qk_norm and cfg.qk_norm_after_rope else q
            o = attention(q, kv_cache, jnp.int32(cfg.kv_source), batch, sm_scale=cfg.sm_scale, sliding_window=window,
                          soft_cap=cfg.attn_logit_softcap, backend=self.attention_backend)
            return o.reshape(T, -1), kv_cache
        qkv = None
        if hasattr(self, "qkv_proj"):  # fused at packing (pack_for_native_matmul)
            qkv = _normed_dot(h, self.norm("attn_norm"), eps, self.linear("qkv_proj"), q_width + kv_width + v_width,
                              live, weights_layer)
            if lora is not None and any(p in lora[0] for p in ("q_proj", "k_proj", "v_proj")):
                def qkv_update():  # the fused projection's three updates side by side
                    x = _pre_norm(h, self.norm("attn_norm"), eps)
                    return jnp.concatenate([_lora_update(x, lora, p) if p in lora[0] else jnp.zeros((T, w))
                                            for p, w in zip(("q_proj", "k_proj", "v_proj"),
                                                            (q_width, kv_width, kv_width))], -1)

                qkv = qkv + jax.lax.cond(lora[2], qkv_update, lambda: jnp.zeros((T, q_width + 2 * kv_width))
                                         ).astype(qkv.dtype)
        backend = "reference" if cfg.chunked_attention else self.attention_backend  # chunked: its only body
        if (qkv is not None and not (cfg.qkv_bias or cfg.qk_norm or cfg.qk_l2_norm or cfg.k_eq_v or cfg.v_norm)
                and kv_writer(kv_cache, qkv.dtype, backend, self.one_device) == "cpu"):
            # The native writer rotates q and k on the way: one pass from the fused projection instead of
            # XLA's split, rotations and K/V interleave.
            from pallas_kernels import cpu

            q, kv_cache = cpu.rope_write_kv(qkv, *rope, kv_cache, layer, *slots, cfg.num_heads, scales)
        else:
            if qkv is not None:
                q, k, v = jnp.split(qkv, [q_width, q_width + kv_width], -1)
            else:
                x = _pre_norm(h, self.norm("attn_norm"), eps)
                q, k, v = (_plus(_dot(x, self.linear(name), width, live_rows=live, layer=weights_layer),
                                 _lora_delta(x, lora, name)) if width else None
                           for name, width in (("q_proj", q_width), ("k_proj", kv_width), ("v_proj", v_width)))
            if cfg.qkv_bias:
                q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...] if v_width else v
            if cfg.k_eq_v:  # the values are the keys as projected
                v = k
            if cfg.qk_norm_whole:  # over every head's dimensions together
                q, k = rms_norm(q, self.norm("q_norm"), eps), rms_norm(k, self.norm("k_norm"), eps)
            q = q.reshape(T, cfg.num_heads, cfg.head_dim)
            k = k.reshape(T, cfg.num_kv_heads, cfg.head_dim)
            v = v.reshape(T, cfg.num_kv_heads, cfg.head_dim)
            head_norms = cfg.qk_norm and not cfg.qk_norm_whole
            if head_norms and not cfg.qk_norm_after_rope:
                q, k = self.head_norm(q, "q_norm"), self.head_norm(k, "k_norm")
            if cfg.v_norm:
                v = rms_norm(v, None, eps)
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
            if head_norms and cfg.qk_norm_after_rope:  # HunYuan: on the rotated q and k
                q, k = self.head_norm(q, "q_norm"), self.head_norm(k, "k_norm")
            if cfg.qk_l2_norm:  # Llama 4: after the rotation, in the rotating layers
                q, k = (_where_rotating(cfg, layer, rms_norm(x, None, eps), x) for x in (q, k))
            kv_cache = write_kv(kv_cache, layer, k, v, slots, backend=backend, scales=scales,
                                one_device=self.one_device)
        q = _position_scaled(cfg, layer, batch, q)
        o = attention(q, kv_cache, layer, batch, sm_scale=cfg.sm_scale, sliding_window=window,
                      soft_cap=cfg.attn_logit_softcap, backend=backend, scales=scales,
                      sinks=self.sinks[...] if cfg.attn_sinks else None).reshape(T, -1)
        return o, kv_cache

    def _linear_attention(self, h, state, layer, weights_layer, batch, live):
        """Gated DeltaNet over the normed h (jaxengine/layers/linear_attention.py): (its gated, normed output [T, value
        heads x dv] before lin_out, the (convolution, recurrent) state with each request's row updated)."""
        cfg = self.cfg
        num_k, num_v, dk, dv, _ = cfg.linear_heads
        T = h.shape[0]
        widths = _linear_input_widths(cfg)  # q/k/v, z, b, a (Kimi Delta Attention: q/k/v, the decay's and the
        # gate's first halves, b)
        if hasattr(self, "lin_in"):  # the four fused at packing, the input norm the matmul's prologue
            both = _normed_dot(h, self.norm("attn_norm"), cfg.rms_norm_eps, self.lin_in[...], sum(widths), live,
                               weights_layer)
            mixed, z, b, a = jnp.split(both, np.cumsum(widths)[:-1].tolist(), -1)
        else:
            x = _pre_norm(h, self.norm("attn_norm"), cfg.rms_norm_eps)
            mixed, z, b, a = (_dot(x, getattr(self, name)[...], n, live_rows=live, layer=weights_layer)
                              for name, n in zip(_linear_inputs(cfg), widths))
        if cfg.linear_kda:  # the low-rank halves' second ones
            a = _dot(a, self.lin_fb[...], num_v * dk, live_rows=live, layer=weights_layer).reshape(T, num_v, dk)
            z = _dot(z, self.lin_gb[...], num_v * dv, live_rows=live, layer=weights_layer)
        conv_state, rec_state = state
        fresh = linear_attention.starts_sequence(batch)
        rows = batch.state_slots
        mixed, conv_state = linear_attention.causal_conv(mixed, self.lin_conv[...], conv_state, layer, rows, fresh,
                                                         batch, ACTIVATIONS[cfg.hidden_act])
        q, k, v = jnp.split(mixed, [num_k * dk, 2 * num_k * dk], -1)
        beta = jax.nn.sigmoid(b.astype(jnp.float32))
        a_log, dt_bias = self.lin_a_log[...], self.lin_dt_bias[...]
        if cfg.linear_kda:  # each head's rate over each key channel's softplus: a decay per key row
            a_log, dt_bias = a_log[:, None], dt_bias.reshape(num_v, dk)
        g = -jnp.exp(a_log) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias)
        o, rec_state = linear_attention.gated_delta_rule(
            q.reshape(T, num_k, dk), k.reshape(T, num_k, dk), v.reshape(T, num_v, dv), g, beta, rec_state, layer,
            rows, fresh, batch, native=linear_attention.native(self.attention_backend, self.one_device))
        o = linear_attention.gated_rms_norm(o.astype(h.dtype), z.reshape(T, num_v, dv), self.lin_norm[...],
                                            cfg.rms_norm_eps, jax.nn.sigmoid if cfg.linear_kda else jax.nn.silu)
        return o.reshape(T, num_v * dv), (conv_state, rec_state)

    def _short_conv(self, h, state, layer, weights_layer, batch, live):
        """LFM2's gated short convolution over the normed h: (C * conv(B * x) [T, D] before lin_out, the convolution's
        state (a one-array tuple) with each request's row updated; layers.linear_attention.causal_conv)."""
        cfg = self.cfg
        bcx = _normed_dot(h, self.norm("attn_norm"), cfg.rms_norm_eps, self.linear("conv_in"), 3 * cfg.hidden_size,
                          live, weights_layer)
        if cfg.conv_bias:
            bcx = bcx + self.conv_in_bias[...]
        b, c, x = jnp.split(bcx, 3, -1)
        (conv_state,) = state
        fresh = linear_attention.starts_sequence(batch)
        y, conv_state = linear_attention.causal_conv(b * x, self.conv_w[...], conv_state, layer, batch.state_slots,
                                                     fresh, batch, lambda v: v)
        if cfg.conv_bias:
            y = y + self.conv_w_bias[...]
        return c * y, (conv_state,)

    def _mamba(self, h, state, layer, weights_layer, batch, live):
        """A Mamba2 mixer over the normed h (Granite 4.0-H, Nemotron-H; transformers' GraniteMoeHybridMambaLayer): the
        convolved x, B and C (through `ssm_activation`), each head's state [state size, head_dim] decayed by exp(dt A)
        and written dt x along B, read along C (layers.linear_attention.recurrence), plus D x; then times silu(z),
        RMS-normed per group. Returns (that [T, heads x head_dim] before lin_out, the (convolution, recurrent) state
        with each request's row updated)."""
        cfg = self.cfg
        H, P, N, G, _ = cfg.ssm_heads
        T, inner = h.shape[0], H * P
        channels = inner + 2 * G * N
        proj = _normed_dot(h, self.norm("attn_norm"), cfg.rms_norm_eps, self.linear("ssm_in"), inner + channels + H,
                           live, weights_layer)
        if cfg.ssm_proj_bias:
            proj = proj + self.ssm_in_bias[...]
        z, xbc, dt = jnp.split(proj, [inner, inner + channels], -1)
        conv_state, ssm_state = state
        fresh = linear_attention.starts_sequence(batch)
        xbc, conv_state = linear_attention.causal_conv(
            xbc, self.ssm_conv[...], conv_state, layer, batch.state_slots, fresh, batch,
            ACTIVATIONS[cfg.ssm_activation], self.ssm_conv_bias[...] if cfg.ssm_conv_bias else None)
        x, b, c = jnp.split(xbc, [inner, inner + G * N], -1)
        dt = jax.nn.softplus(dt.astype(jnp.float32) + self.ssm_dt_bias[...])
        if cfg.ssm_dt_limit:
            dt = jnp.clip(dt, *cfg.ssm_dt_limit)
        x = x.reshape(T, H, P)
        y, ssm_state = linear_attention.recurrence(
            c.reshape(T, G, N), b.reshape(T, G, N), x, dt * -jnp.exp(self.ssm_a_log[...]), dt, ssm_state, layer,
            batch.state_slots, fresh, batch, linear_attention.native(self.attention_backend, self.one_device),
            delta=False)
        y = (y + self.ssm_d[...][:, None] * x.astype(jnp.float32)).reshape(T, G, inner // G)
        gate = jax.nn.silu(z.astype(jnp.float32)).reshape(T, G, inner // G)
        if cfg.ssm_norm != "before_gate":
            y = y * gate
        if cfg.ssm_norm:
            y = y * jax.lax.rsqrt(jnp.mean(y * y, -1, keepdims=True) + cfg.rms_norm_eps)
            y = self.ssm_norm[...].astype(jnp.float32).reshape(G, inner // G) * y
        if cfg.ssm_norm == "before_gate":
            y = y * gate
        return y.reshape(T, inner).astype(h.dtype), (conv_state, ssm_state)

    def _mamba1(self, h, state, layer, weights_layer, batch, live):
        """A Mamba1 mixer over the normed h (transformers' MambaMixer; FalconMamba's and Jamba's with norms on dt's, B's
        and C's inputs): x convolved (through `ssm_activation`), then per inner channel a [state size] state decayed
        by exp(dt A) (each state its own rate: layers.linear_attention.recurrence's decay per key row, a channel a
        value head of one column), written dt x along B, read along C, plus D x; times silu(z). Returns (that [T,
        inner] before lin_out, the (convolution, recurrent) state with each request's row updated)."""
        cfg = self.cfg
        inner, N, rank, _ = cfg.mamba1
        T = h.shape[0]
        xz = _normed_dot(h, self.norm("attn_norm"), cfg.rms_norm_eps, self.linear("ssm_in"), 2 * inner, live,
                         weights_layer)
        if cfg.ssm_proj_bias:
            xz = xz + self.ssm_in_bias[...]
        x, z = jnp.split(xz, 2, -1)
        conv_state, ssm_state = state
        fresh = linear_attention.starts_sequence(batch)
        x, conv_state = linear_attention.causal_conv(
            x, self.ssm_conv[...], conv_state, layer, batch.state_slots, fresh, batch,
            ACTIVATIONS[cfg.ssm_activation], self.ssm_conv_bias[...] if cfg.ssm_conv_bias else None)
        dt, b, c = jnp.split(_dot(x, self.ssm_x[...], rank + 2 * N, live_rows=live, layer=weights_layer),
                             [rank, rank + N], -1)
        if cfg.ssm_bcdt_norm:  # Jamba's weighted norms, FalconMamba's weightless ones
            weighted, eps = cfg.ssm_bcdt_norm
            dt, b, c = (rms_norm(v, self.norm(name) if weighted else jnp.ones(v.shape[-1], v.dtype), eps)
                        for v, name in ((dt, "ssm_dt_norm"), (b, "ssm_b_norm"), (c, "ssm_c_norm")))
        dt = jax.nn.softplus(_dot(dt, self.ssm_dt[...], inner, live_rows=live, layer=weights_layer).astype(jnp.float32)
                             + self.ssm_dt_bias[...])
        decay = dt[:, :, None] * -jnp.exp(self.ssm_a_log[...])  # [T, inner, state size]
        y, ssm_state = linear_attention.recurrence(
            c.reshape(T, 1, N), b.reshape(T, 1, N), x.reshape(T, inner, 1), decay, dt, ssm_state, layer,
            batch.state_slots, fresh, batch, linear_attention.native(self.attention_backend, self.one_device),
            delta=False)
        y = (y[..., 0] + self.ssm_d[...] * x.astype(jnp.float32)) * jax.nn.silu(z.astype(jnp.float32))
        return y.astype(h.dtype), (conv_state, ssm_state)

    def _latent_attention(self, h, kv_cache, layer, weights_layer, batch, slots, rope, live):
        """Multi-head latent attention (`_latent_attention_params`) absorbed, as vLLM's MLA decodes: each head's
        unrotated query is taken into the latent's space through kv_b_proj's key part (q_nope . (W_k c) = (q_nope W_k)
        . c), the cache keeps each token's normed latent and rotated key only (one row: the key, its latent the
        value), and each head's attention-weighted latent comes out through kv_b_proj's value part. Returns (the
        heads' values [T, heads x v_head_dim] before o_proj, the KV cache)."""
        cfg = self.cfg
        eps, T = cfg.rms_norm_eps, h.shape[0]
        H, R, nope, rope_dim = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        norm = self.norm("attn_norm")
        if cfg.q_lora_rank:
            q = _normed_dot(h, norm, eps, self.linear("q_a_proj"), cfg.q_lora_rank, live, weights_layer)
            q = _normed_dot(q, self.norm("q_a_norm"), LATENT_NORM_EPS, self.linear("q_b_proj"), H * (nope + rope_dim),
                            live, weights_layer)
        else:
            q = _normed_dot(h, norm, eps, self.linear("q_proj"), H * (nope + rope_dim), live, weights_layer)
        q_nope, q_rope = jnp.split(q.reshape(T, H, nope + rope_dim), [nope], -1)
        latent, k_rope = jnp.split(_normed_dot(h, norm, eps, self.linear("kv_a_proj"), R + rope_dim, live,
                                               weights_layer), [R], -1)
        latent = rms_norm(latent, self.norm("kv_a_norm"), LATENT_NORM_EPS)
        q_rope, k_rope = apply_rope(q_rope, *rope), apply_rope(k_rope[:, None, :], *rope)
        q_latent = _per_head(q_nope, self.kv_b_k[...], R, weights_layer).astype(q.dtype)
        kv_cache = write_latent(kv_cache, layer, jnp.concatenate([latent[:, None, :], k_rope], -1), slots,
                                self.one_device)
        q = _position_scaled(cfg, layer, batch, jnp.concatenate([q_latent, q_rope], -1))  # Mistral Small 4
        values = latent_attention(q, kv_cache, layer, batch,
                                  sm_scale=cfg.sm_scale, value_dim=R)
        o = _per_head(values, self.kv_b_v[...], cfg.v_head_dim, weights_layer)
        return o.reshape(T, H * cfg.v_head_dim).astype(h.dtype), kv_cache

    def _adapted_mlp(self, h, live, layer, lora):
        """The dense MLP with LoRA updates to its gate, up and down projections (the native kernel's fused
        gate/up/down cannot take them: the packed gate/up products are split back instead)."""
        cfg = self.cfg
        eps, D = cfg.rms_norm_eps, cfg.hidden_size
        norm = self.norm("mlp_norm")
        x = _pre_norm(h, norm, eps)
        gate, up = self._gate_up(h, norm, live, layer)
        gate, up = _plus(gate, _lora_delta(x, lora, "gate_proj")), _plus(up, _lora_delta(x, lora, "up_proj"))
        gated = ACTIVATIONS[cfg.hidden_act](gate) * up
        out = _plus(_dot(gated, self.linear("down_proj"), D, live_rows=live, layer=layer),
                    _lora_delta(gated, lora, "down_proj"))
        if cfg.sandwich_norms:
            out = rms_norm(out, self.norm("post_mlp_norm"), eps)
        return h + out

    def _gate_up(self, h, norm, live, layer):
        """The dense MLP's gate and up products over rms_norm(h, norm), from the packed gate/up weight or the two."""
        cfg = self.cfg
        if hasattr(self, "gate_up_proj"):
            return _unpacked_gate_up(h, norm, cfg.rms_norm_eps, self.linear("gate_up_proj"), live, layer)
        return tuple(_normed_dot(h, norm, cfg.rms_norm_eps, self.linear(name), cfg.intermediate_size, live, layer)
                     for name in ("gate_proj", "up_proj"))

    def mlp(self, h, live, layer, x=None):
        """h + the MLP's output (dense, or a mixture of experts with its shared expert) over the normed h, or over
        `x` where given (a LayerNorm model's MLP input, normed before: h is then the residual only)."""
        cfg = self.cfg
        eps, D, I = cfg.rms_norm_eps, cfg.hidden_size, cfg.intermediate_size
        mlp_norm = self.norm("mlp_norm")
        if hasattr(self, "gate_up_proj"):  # fused at packing (pack_for_native_matmul)
            out_norm = self.norm("post_mlp_norm") if cfg.sandwich_norms else None
            return _gated_mlp(h, mlp_norm, eps, self.linear("gate_up_proj"), self.linear("down_proj"), D,
                              live, layer, cfg.hidden_act, out_norm, x)
        src = h if x is None else x
        out = None
        if not (I or cfg.num_experts):  # a layer without an MLP (Nemotron-H's mixer before another)
            return h
        if I:
            if cfg.gated_mlp:
                gate, up = self._gate_up(src, mlp_norm, live, layer)
                if cfg.mlp_bias:
                    gate, up = gate + self.gate_bias[...], up + self.up_bias[...]
                hidden = ACTIVATIONS[cfg.hidden_act](gate) * up
            else:  # down(act(up(x)))
                up = _normed_dot(src, mlp_norm, eps, self.linear("up_proj"), I, live, layer)
                up = up + self.up_bias[...] if cfg.mlp_bias else up
                hidden = (xielu(up, *(getattr(self, name)[...] for name in XIELU_PARAMS)) if cfg.hidden_act == "xielu"
                          else ACTIVATIONS[cfg.hidden_act](up))
            down_bias = self.down_bias[...] if cfg.mlp_bias else None
            if not (cfg.sandwich_norms or cfg.num_experts):
                return _dot(hidden, self.linear("down_proj"), D, residual=_plus(h, down_bias), live_rows=live,
                            layer=layer)
            out = _plus(_dot(hidden, self.linear("down_proj"), D, live_rows=live, layer=layer), down_bias)
        if cfg.num_experts:
            router_input = expert_scale = None
            if cfg.experts_beside_mlp:  # Gemma 4: the experts and their router read the residual through norms of
                # their own
                out = rms_norm(out, self.norm("post_dense_norm"), eps)
                x = rms_norm(src, self.norm("expert_norm"), eps)
                router_input, expert_scale = rms_norm(src, self.router_norm[...], eps), self.expert_scale[...]
            else:
                x = _pre_norm(src, mlp_norm, eps)
            if cfg.shared_expert_gate:
                shared_gate = self.shared_expert_gate[...]
                out = out * jax.nn.sigmoid(jnp.dot(x.astype(shared_gate.dtype), shared_gate,
                                                   preferred_element_type=jnp.float32)).astype(out.dtype)
            if cfg.moe_latent_size:  # Nemotron 3 Super: the router reads x, the experts its latent
                router_input = x
                x = _dot(x, self.moe_latent_in[...], cfg.moe_latent_size, live_rows=live, layer=layer)
            projections = {name: getattr(self, name)[...] for name in ("expert_gate", "expert_up", "expert_gate_up",
                                                                        "expert_gate_bias", "expert_up_bias",
                                                                        "expert_down_bias", "router_bias")
                           if hasattr(self, name)}
            down = self.expert_down[...]
            if cfg.mxfp4_experts:  # gate/up's biases go with its weight (the kernel adds them)
                projections["expert_gate_up"] = Mxfp4Experts(projections["expert_gate_up"],
                                                             self.expert_gate_up_exponents[...],
                                                             self.expert_gate_up_bias[...])
                down = Mxfp4Experts(down, self.expert_down_exponents[...])
            correction = self.router_correction[...] if hasattr(self, "router_correction") else None
            experts = moe_mlp(x, self.router[...], down=down, top_k=cfg.experts_per_token,
                              routing=Routing(cfg.router_scoring, cfg.router_groups, cfg.routed_scaling,
                                              cfg.router_renorm_eps, cfg.router_jitter_eps),
                              router_correction=correction,
                              renormalize=cfg.norm_topk_prob, activation=cfg.hidden_act, layer=layer, live_rows=live,
                              swiglu=(cfg.swiglu_alpha, cfg.swiglu_limit),
                              folded_bias=cfg.moe_bias and "expert_gate_up" in projections and not cfg.mxfp4_experts,
                              scale_inputs=cfg.moe_input_scaled, router_input=router_input,
                              expert_scale=expert_scale,
                              **{name.removeprefix("expert_"): w for name, w in projections.items()})
            if cfg.experts_beside_mlp:
                experts = rms_norm(experts, self.norm("post_expert_norm"), eps)
            if cfg.moe_latent_size:
                experts = _dot(experts, self.moe_latent_out[...], D, live_rows=live, layer=layer)
            out = experts if out is None else out + experts
        if cfg.sandwich_norms:
            out = rms_norm(out, self.norm("post_mlp_norm"), eps)
        return h + out


def kv_cache_kinds(cfg: ModelConfig) -> tuple[tuple[int, int, int], ...]:
    """Gemma 4's KV caches (`full_attention_heads`): (layers, KV heads, head_dim) of its sliding-window layers' and of
    its full-attention layers' (those before its shared-KV layers). Each kind its own: their K/V differ in shape."""
    full = sum(w == 0 for w in cfg.sliding_windows[:cfg.kv_cache_layers])
    head_dim, kv_heads, _ = cfg.full_attention_heads
    return (cfg.kv_cache_layers - full, cfg.num_kv_heads, cfg.head_dim), (full, kv_heads, head_dim)


@functools.cache
def layer_groups(cfg: ModelConfig) -> tuple[tuple[str, int, ModelConfig], ...]:
    """(attribute, first layer, the layers' config) of each run of alike layers, which the model holds as one stack
    (DecoderLayers) and runs as one loop: all layers (`layers`), or each run of dense or of expert layers in a mixture
    of experts with dense layers among its expert ones (`dense_mlp_layers`), of sliding-window or full-attention
    layers where the latter have a shape and KV cache of their own (Gemma 4's `full_attention_heads`, their rope the
    model's, the sliding ones' `local_rope`: `kv_cache_kinds`), of shared-KV layers (`kv_shared_layers`), and of
    linear-attention or attention layers (`linear_layers`: the former's state is the model's second cache), and of
    layers with or without an MLP (`no_mlp_layers`): `layers`, `layers1`, ..."""
    if not (cfg.dense_mlp_layers or cfg.full_attention_heads or cfg.kv_shared_layers or cfg.linear_layers
            or cfg.no_mlp_layers):
        return (("layers", 0, cfg),)
    runs = []  # [first, count, (its MLP: "" the model's, "dense" or "none"; its cache; the cache layer it reads or
    # -1), its cache's first layer]
    cached = {}  # each cache's layers so far
    sources = {}  # Gemma 4's shared-KV layers: each kind's last layer before them, in its cache
    shared_from = cfg.num_layers - cfg.kv_shared_layers
    for i in range(cfg.num_layers):
        full = cfg.sliding_windows[i] == 0
        # Gemma 4: each kind of attention its own cache; linear attention: its state
        cache = 1 if i in cfg.linear_layers and not cfg.ssm_parallel else int(full and bool(cfg.full_attention_heads))
        if i < shared_from:
            sources[full] = cached[cache] = cached.get(cache, -1) + 1
        mlp = "none" if i in cfg.no_mlp_layers else "dense" if i in cfg.dense_mlp_layers else ""
        kind = (mlp, cache, -1 if i < shared_from else sources[full])
        if runs and runs[-1][2] == kind:
            runs[-1][1] += 1
        else:
            runs.append([i, 1, kind, cached[cache] if kind[2] < 0 else -1])
    groups = []
    for n, (first, count, (mlp, cache, source), kv_first) in enumerate(runs):
        group = dataclasses.replace(cfg, num_layers=count, dense_mlp_layers=(), full_attention_heads=(),
                                    kv_shared_layers=0, kv_source=source, kv_cache_index=cache, kv_first=kv_first,
                                    linear_layers=(), no_mlp_layers=(), layer_sources=())
        if source >= 0 and cfg.double_wide_mlp:
            group = dataclasses.replace(group, intermediate_size=2 * cfg.intermediate_size)
        if cfg.linear_layers:  # no attention parameters in a linear-attention stack
            if cache == 1:
                group = dataclasses.replace(group, linear_attention=True, qkv_bias=False, o_bias=False, qk_norm=False,
                                            attn_output_gate=False, kv_lora_rank=0, q_lora_rank=0)
        elif cache == 1:
            head_dim, kv_heads, k_eq_v = cfg.full_attention_heads
            group = dataclasses.replace(group, head_dim=head_dim, num_kv_heads=kv_heads, k_eq_v=k_eq_v,
                                        local_rope=None)
        elif cfg.full_attention_heads:
            group = dataclasses.replace(group, rope=cfg.local_rope or cfg.rope, local_rope=None)
        if mlp:  # a dense MLP (of dense_intermediate_size), or none
            group = dataclasses.replace(group, num_experts=0, experts_per_token=0, moe_intermediate_size=0,
                                        intermediate_size=cfg.dense_intermediate_size if mlp == "dense" else 0,
                                        shared_expert_gate=False, moe_bias=False, router_scoring="softmax",
                                        router_groups=(), routed_scaling=1.0, router_float32=False,
                                        router_correction=False, moe_input_scaled=False, experts_beside_mlp=False,
                                        moe_latent_size=0, mlp_bias=cfg.mlp_bias and mlp == "dense")
        groups.append(("layers" if n == 0 else f"layers{n}", first, group))
    return tuple(groups)


class LlamaForCausalLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, attention_backend: str = "auto", param_dtype=None,
                 one_device: bool = True):
        """`dtype`: activations (and the KV cache's default, `kv_dtype`); `param_dtype` (default: `dtype`): the
        weights. `one_device`: the model runs on one device, not over a mesh (DecoderLayers)."""
        self.cfg = cfg
        self.dtype = dtype
        self.kv_dtype = dtype  # the KV cache's; the engine may choose another (LLMEngine._kv_cache_dtype)
        # the state layers' recurrent state's (float32; the engine's mamba_ssm_cache_dtype may make it bfloat16)
        self.state_dtype = jnp.float32
        self.param_dtype = param_dtype = param_dtype or dtype
        self.attention_backend = attention_backend
        self.embed = _param((cfg.vocab_size, cfg.hidden_size), param_dtype, ("vocab", "embed"))
        if cfg.learned_positions:
            self.pos_embed = _param((cfg.max_position_embeddings + cfg.position_offset, cfg.hidden_size), param_dtype,
                                    ("positions", "embed"))
        if cfg.per_layer_input_size:  # Gemma 4's per-layer embeddings (per_layer_inputs)
            width = cfg.num_layers * cfg.per_layer_input_size
            self.ple_embed = _param((cfg.per_layer_vocab_size, width), param_dtype, ("vocab", "per_layer"))
            self.ple_model_proj = _param((cfg.hidden_size, width), param_dtype, ("embed", "per_layer"))
            self.ple_model_norm = _param((cfg.per_layer_input_size,), param_dtype, ("per_layer",))
        for name, first, group in layer_groups(cfg):  # each stack's first layer in its KV cache
            setattr(self, name, DecoderLayers(group, param_dtype, attention_backend,
                                              first if group.kv_first < 0 else group.kv_first, one_device))
        self.final_norm = _param((cfg.hidden_size,), param_dtype, ("embed",))
        if cfg.norm_bias:
            self.final_norm_bias = _param((cfg.hidden_size,), param_dtype, ("embed",))
        if not cfg.tie_word_embeddings:
            self.lm_head = _param((cfg.hidden_size, cfg.vocab_size), param_dtype, ("embed", "vocab"))
        if cfg.lm_head_bias:
            self.lm_head_bias = _param((cfg.vocab_size,), param_dtype, ("vocab",))

    def __call__(
        self,
        kv_cache: jax.Array,  # [num_layers, num_pages, page_size, 2 * num_kv_heads, head_dim] (kv_cache_shape), donated
        batch: RaggedBatch,
        lora=None,
    ) -> tuple[jax.Array, jax.Array]:  # logits f32[len(logits_indices), vocab], updated kv_cache
        hidden, kv_cache = self.hidden_states(kv_cache, batch, lora)
        return self.logits(hidden[batch.logits_indices]), kv_cache

    def hidden_states(
        self,
        kv_cache: jax.Array,  # [num_layers, num_pages, page_size, 2 * num_kv_heads, head_dim] (kv_cache_shape), donated
        batch: RaggedBatch,
        lora=None,
    ) -> tuple[jax.Array, jax.Array]:  # final-normed hidden states [T, hidden] of every token, kv_cache
        """`lora`: ({projection: (A f32[layers, slots, in, rank], B f32[layers, slots, rank, out])}, each token's
        adapter slot i32[T], `slots` for none): the LoRA adapters' updates (jaxengine/lora.py)."""
        cfg = self.cfg
        onehot = None
        if lora is not None:
            weights, adapter_slots = lora
            num_slots = next(iter(weights.values()))[0].shape[1]
            onehot = (adapter_slots[:, None] == jnp.arange(num_slots)[None, :]).astype(jnp.float32)
            active = jnp.any(adapter_slots < num_slots)
        else:
            weights = {}
        pages = kv_cache[0] if isinstance(kv_cache, tuple) else kv_cache  # Gemma 4: a cache per kind of layer
        slots = token_slots(batch, pages.shape[2], pages.shape[1])

        @functools.cache  # each stack's rotary tables, computed once for the stacks that share them
        def tables(rope_cfg, head_dim):
            inv_freq, scaling = rope_inv_freq(rope_cfg, head_dim, cfg.max_position_embeddings)
            return rope_tables(batch.positions, jnp.asarray(inv_freq), scaling, self.dtype, head_dim)

        def ropes(group):  # a stack's full-attention tables, and its sliding-window layers' (None: the same)
            return (tables(group.rope, group.rope_head_dim),
                    None if group.local_rope is None else tables(group.local_rope, group.rope_head_dim))
        h = self.embed[...][batch.input_ids]  # [T, hidden]
        if cfg.embed_scale is not None:  # in the embedding's dtype, as transformers scales it
            h = h * jnp.asarray(cfg.embed_scale, h.dtype)
        if cfg.learned_positions:  # in the embeddings' dtype, as transformers adds them
            h = h + self.pos_embed[...][batch.positions + cfg.position_offset]
        layer_inputs = self.per_layer_inputs(h, batch.input_ids) if cfg.per_layer_input_size else None
        h = h.astype(self.dtype)
        for name, first, group in layer_groups(cfg):  # each stack's layers in turn
            h, kv_cache = self._run_layers(getattr(self, name), first, group.num_layers, h, kv_cache, batch, slots,
                                           ropes(group), weights, onehot, active if onehot is not None else None,
                                           layer_inputs)
        if cfg.layer_norm:
            return layer_norm(h, self.final_norm[...], self.final_norm_bias[...] if cfg.norm_bias else None,
                              cfg.rms_norm_eps), kv_cache
        return rms_norm(h, _norm_scale(cfg, self.final_norm[...]), cfg.rms_norm_eps), kv_cache

    def per_layer_inputs(self, embedded, input_ids):
        """Gemma 4's per-layer embeddings: each token's input to every layer [layers, T, per_layer_input_size], the
        sum of its row of the per-layer table (times sqrt(width)) and the normed projection of its embedding (times
        hidden_size ** -0.5), times 2 ** -0.5, as transformers combines them."""
        cfg = self.cfg
        L, P = cfg.num_layers, cfg.per_layer_input_size
        table = self.ple_embed[...]
        tokens = (table[input_ids] * jnp.asarray(P ** 0.5, table.dtype)).reshape(-1, L, P)
        proj = _dot(embedded.astype(jnp.float32), self.ple_model_proj[...], L * P).astype(embedded.dtype)
        proj = rms_norm((proj * jnp.asarray(cfg.hidden_size ** -0.5, proj.dtype)).reshape(-1, L, P),
                        self.ple_model_norm[...], cfg.rms_norm_eps)
        return jnp.moveaxis((proj + tokens) * jnp.asarray(2 ** -0.5, proj.dtype), 1, 0).astype(self.dtype)

    def _run_layers(self, layers, first: int, count: int, h, kv_cache, batch, slots, ropes, weights, onehot, active,
                    layer_inputs=None):
        """One stack's layers (the model's `first` to `first + count`) over h: unrolled where unstacked, else a
        scan. `weights`: every layer's LoRA weights ({} for none), sliced to this stack's here; `layer_inputs`: every
        layer's per-layer input (per_layer_inputs) or None, likewise."""
        group = (layers[0] if self.layers_unstacked else layers).cfg
        if isinstance(kv_cache, tuple) and not group.ssm_parallel:  # Gemma 4: the stack's kind's cache, the others
            # passed through (a linear-attention model: the KV cache, the linear layers' state; Falcon-H1's layers
            # read and write both)
            index = group.kv_cache_index
            h, cache = self._run_stack(layers, first, count, h, kv_cache[index], batch, slots, ropes, weights,
                                       onehot, active, layer_inputs)
            return h, kv_cache[:index] + (cache,) + kv_cache[index + 1:]
        return self._run_stack(layers, first, count, h, kv_cache, batch, slots, ropes, weights, onehot, active,
                               layer_inputs)

    def _run_stack(self, layers, first: int, count: int, h, kv_cache, batch, slots, ropes, weights, onehot, active,
                   layer_inputs):
        """`_run_layers` over the stack's own cache."""
        windows = jnp.asarray(self.cfg.sliding_windows[first:first + count], jnp.int32)
        weights = {p: (a[first:first + count], b[first:first + count]) for p, (a, b) in weights.items()}
        inputs = None if layer_inputs is None else layer_inputs[first:first + count]
        if self.layers_unstacked:
            for i, layer_module in enumerate(layers):
                layer_lora = None if onehot is None else (
                    {p: (a[i], b[i]) for p, (a, b) in weights.items()}, onehot, active)
                h, kv_cache = layer_module(h, kv_cache, jnp.int32(i), windows[i], batch, slots, ropes, layer_lora,
                                           None if inputs is None else inputs[i])
            return h, kv_cache
        # Packed weights (the native CPU matmul's) stay whole: the kernel reads the step's layer in place, as the
        # attention reads the KV cache's. Sliced per step instead, XLA:CPU converted every stacked bfloat16 weight to
        # float32 and back at each model step (steps ~2.7x slower than unrolled).
        graphdef, in_place, stacked = nnx.split(layers, _packed, ...)

        def one_layer(carry, xs):
            h, kv_cache = carry
            state, layer, window, layer_weights, layer_input = xs
            layer_module = nnx.merge(graphdef, in_place, state)
            layer_lora = None if onehot is None else (layer_weights, onehot, active)
            return layer_module(h, kv_cache, layer, window, batch, slots, ropes, layer_lora, layer_input), None

        layer_ids = jnp.arange(count, dtype=jnp.int32)
        (h, kv_cache), _ = jax.lax.scan(one_layer, (h, kv_cache), (stacked, layer_ids, windows, weights, inputs))
        return h, kv_cache

    def logits(self, hidden: jax.Array, live_rows=None) -> jax.Array:  # hidden [N, hidden] -> logits f32[N, vocab]
        """`live_rows` (i32[]): rows from it on are padding; the native CPU matmul leaves their logits zero."""
        head = self.lm_head[...] if hasattr(self, "lm_head") else self.embed[...].T
        if head.ndim == 3:  # packed for the native CPU matmul
            logits = _dot(hidden.astype(jnp.float32), head, self.cfg.vocab_size, live_rows=live_rows)
        else:
            logits = jnp.dot(hidden.astype(head.dtype), head, preferred_element_type=jnp.float32)
        if self.cfg.lm_head_bias:
            logits = logits + self.lm_head_bias[...].astype(jnp.float32)
        cap = self.cfg.final_logit_softcap
        return logits if cap is None else cap * jnp.tanh(logits / cap)

    @property
    def native_matmul(self) -> bool:
        return hasattr(self, "lm_head") and self.lm_head.get_value().ndim == 3

    def pack_for_native_matmul(self) -> None:
        """Packs every bfloat16 matmul weight for the native CPU kernel (`pallas_kernels.cpu.pack_bf16`: panels
        of 32 output columns, each one contiguous stream); a tied model gets a packed copy of its embedding as
        the output head (the embedding itself stays for the token lookup). For a single-device CPU engine: the
        packed layout is not sharded, and checkpoints are written from unpacked models."""
        if self.native_matmul:
            return
        if self.param_dtype != jnp.bfloat16:
            raise ValueError(f"the native CPU matmul takes bfloat16 weights, not {jnp.dtype(self.param_dtype).name}")
        for name, _, _ in layer_groups(self.cfg):
            layers = getattr(self, name)
            for layer in (layers if self.layers_unstacked else [layers]):
                _pack_layer(layer)
        if not hasattr(self, "lm_head"):
            self.lm_head = nnx.Param(np.asarray(self.embed[...]).T, logical_axes=("embed", "vocab"))
        _pack(self.lm_head)
        if hasattr(self, "ple_model_proj"):  # Gemma 4's per-layer embeddings' projection
            _pack(self.ple_model_proj)

    def attention_body(self, page_size: int) -> str:
        """The attention body the layers run (building and registering the native CPU kernel if it is that)."""
        if self.cfg.latent_attention:
            return reference_body(self.attention_backend, "multi-head latent attention (DeepSeek V2/V3)")
        if self.cfg.chunked_attention:
            return reference_body(self.attention_backend, "chunked attention (Llama 4)")
        name, _ = select_body(self.attention_backend, self.cfg.head_dim, page_size, (self.dtype, self.kv_dtype))
        return name

    @property
    def layers_unstacked(self) -> bool:
        return not isinstance(self.layers, DecoderLayers)

    def unstack_layers(self) -> None:
        """Gives each layer its own parameter arrays (slices of the stacked ones, which are then freed; each
        keeps its sharding) and so an unrolled layer loop (see the module docstring for when it pays).
        Checkpoints are written from the stacked layout."""
        if self.layers_unstacked:
            return

        def layer_slice(var: nnx.Variable, i: int) -> nnx.Variable:
            return var.replace(var.get_value()[i], logical_axes=var.get_metadata()["logical_axes"][1:])

        for name, _, group in layer_groups(self.cfg):
            graphdef, stacked = nnx.split(getattr(self, name))
            setattr(self, name, nnx.List([
                nnx.merge(graphdef, jax.tree.map(lambda v, i=i: layer_slice(v, i), stacked,
                                                 is_leaf=lambda x: isinstance(x, nnx.Variable)))
                for i in range(group.num_layers)]))

    KV_CACHE_AXES = ("layers", "pages", "page", "kv_heads", "head_dim")  # K/V interleaved on kv_heads

    def state_shapes(self, num_rows: int) -> tuple | None:
        """A linear-attention model's per-sequence state (layers.linear_attention.state_shapes: (shape, dtype) of the
        convolution's and of the recurrent state, `num_rows` rows each); None for the others."""
        cfg = self.cfg
        if not cfg.linear_layers:
            return None
        if cfg.short_conv_width:  # LFM2: the convolutions' only
            return (((len(cfg.linear_layers), num_rows, cfg.short_conv_width - 1, cfg.hidden_size), self.dtype),)
        if cfg.ssm_heads:  # Mamba2: its convolution's, each head's [state size, head_dim]
            H, P, N, G, width = cfg.ssm_heads
            return linear_attention.state_shapes(len(cfg.linear_layers), num_rows, (G, H, N, P, width), self.dtype,
                                                 self.state_dtype)
        if cfg.mamba1:  # Mamba1: its convolution's over x, each inner channel's [state size, 1]
            inner, N, _, width = cfg.mamba1
            return ((len(cfg.linear_layers), num_rows, width - 1, inner), self.dtype), (
                (len(cfg.linear_layers), num_rows, inner, N, 1), self.state_dtype)
        return linear_attention.state_shapes(len(cfg.linear_layers), num_rows, cfg.linear_heads, self.dtype,
                                             self.state_dtype)

    def kv_cache_shape(self, num_pages: int, page_size: int) -> tuple:
        """K/V interleaved on the fourth axis; multi-head latent attention's one row per token there (its latent and
        rotary key: layers.attention.write_latent). Gemma 4: a tuple of such shapes, one per kind of layer
        (`kv_cache_kinds`), all over the same pages."""
        cfg = self.cfg
        if cfg.full_attention_heads:
            return tuple((n, num_pages, page_size, 2 * kv_heads, head_dim)
                         for n, kv_heads, head_dim in kv_cache_kinds(cfg))
        rows = 1 if cfg.latent_attention else 2 * cfg.num_kv_heads
        return (cfg.kv_cache_layers, num_pages, page_size, rows, cfg.head_dim)


def hf_weight_map(cfg: ModelConfig) -> dict[str, tuple[tuple[str, ...], int | None, bool, int | None]]:
    """HF tensor name -> (our parameter path, layer index or None, transpose from [out, in], expert index or
    None: the tensor is that expert's slice of a parameter stacking all experts)."""
    names = {
        "model.embed_tokens.weight": (("embed",), None, False, None),
        "model.norm.weight": (("final_norm",), None, False, None),
    }
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = (("lm_head",), None, True, None)
    if cfg.norm_bias:
        names["model.norm.bias"] = (("final_norm_bias",), None, False, None)
    if cfg.learned_positions:
        names["model.embed_positions.weight"] = (("pos_embed",), None, False, None)
    if cfg.lm_head_bias:
        names["lm_head.bias"] = (("lm_head_bias",), None, False, None)
    if cfg.per_layer_input_size:  # Gemma 4's per-layer embeddings (LlamaForCausalLM.per_layer_inputs)
        names |= {"model.embed_tokens_per_layer.weight": (("ple_embed",), None, False, None),
                  "model.per_layer_model_projection.weight": (("ple_model_proj",), None, True, None),
                  "model.per_layer_projection_norm.weight": (("ple_model_norm",), None, False, None)}
    for stack, first, group in layer_groups(cfg):
        per_layer, experts = _layer_weight_map(group)
        for i in range(first, first + group.num_layers):
            for hf_name, (ours, transpose) in per_layer.items():
                names[f"model.layers.{i}.{hf_name}"] = ((stack, ours), i - first, transpose, None)
            for hf_name, ours in experts.items():
                for j in range(group.num_experts):
                    names[f"model.layers.{i}.{hf_name.format(j)}"] = ((stack, ours), i - first, True, j)
    return names


def _mamba_weight_map(cfg: ModelConfig) -> dict:
    """A Mamba mixer's tensors under `mamba.*`, as `_layer_weight_map` gives them: Mamba2's (DecoderLayers.
    _mamba_params: each head's time-step bias, the gated norm where it has one) or Mamba1's (`_mamba1_params`: x's
    and dt's projections, dt's bias, the norms on dt, B and C where weighted)."""
    names = (("in_proj.weight", ("ssm_in", True)), ("conv1d.weight", ("ssm_conv", True)),
             ("A_log", ("ssm_a_log", False)), ("D", ("ssm_d", False)), ("out_proj.weight", ("lin_out", True)))
    if cfg.mamba1:
        names += (("x_proj.weight", ("ssm_x", True)), ("dt_proj.weight", ("ssm_dt", True)),
                  ("dt_proj.bias", ("ssm_dt_bias", False)))
        if cfg.ssm_bcdt_norm and cfg.ssm_bcdt_norm[0]:
            names += tuple((f"{p}_layernorm.weight", (f"ssm_{p}_norm", False)) for p in ("dt", "b", "c"))
    else:
        names += (("dt_bias", ("ssm_dt_bias", False)),)
        if cfg.ssm_norm:
            names += (("norm.weight", ("ssm_norm", False)),)
    per_layer = {f"mamba.{name}": ours for name, ours in names}
    if cfg.ssm_conv_bias:
        per_layer["mamba.conv1d.bias"] = ("ssm_conv_bias", False)
    if cfg.ssm_proj_bias:
        per_layer |= {"mamba.in_proj.bias": ("ssm_in_bias", False), "mamba.out_proj.bias": ("lin_out_bias", False)}
    return per_layer


def _layer_weight_map(cfg: ModelConfig) -> tuple[dict, dict]:
    """A stack's layer's tensors: ({HF name within the layer: (our parameter, transpose)}, {an expert's HF name
    pattern: our stacked parameter})."""
    per_layer = {
        "self_attn.q_proj.weight": ("q_proj", True),
        "self_attn.k_proj.weight": ("k_proj", True),
        "self_attn.v_proj.weight": ("v_proj", True),
        "self_attn.o_proj.weight": ("o_proj", True),
    }
    if cfg.linear_attention and cfg.short_conv_width:  # LFM2's (the convolutions' [D, 1, width] as [width, D]: the
        # loader drops the axis of 1)
        parts = (("in_proj", "conv_in", True), ("conv", "conv_w", True), ("out_proj", "lin_out", True))
        per_layer = {f"conv.{name}.weight": (ours, t) for name, ours, t in parts}
        if cfg.conv_bias:
            per_layer |= {f"conv.{name}.bias": (ours + "_bias", False) for name, ours, _ in parts}
    elif cfg.linear_attention and (cfg.ssm_heads or cfg.mamba1):  # Granite 4.0-H's Mamba2 mixers, Mamba1 mixers
        # (their convolutions likewise)
        per_layer = _mamba_weight_map(cfg)
    elif cfg.linear_attention and cfg.linear_kda:  # Kimi Delta Attention (its q/k/v and their convolutions joined
        # at load: registry._KimiLinearTensors)
        per_layer = {f"self_attn.{name}": ours for name, ours in (
            ("qkv_proj.weight", ("lin_qkv", True)), ("conv1d.weight", ("lin_conv", True)),
            ("f_a_proj.weight", ("lin_fa", True)), ("f_b_proj.weight", ("lin_fb", True)),
            ("g_a_proj.weight", ("lin_ga", True)), ("g_b_proj.weight", ("lin_gb", True)),
            ("b_proj.weight", ("lin_b", True)), ("A_log", ("lin_a_log", False)), ("dt_bias", ("lin_dt_bias", False)),
            ("o_norm.weight", ("lin_norm", False)), ("o_proj.weight", ("lin_out", True)))}
    elif cfg.linear_attention:  # Gated DeltaNet (DecoderLayers._linear_attention_params; its convolution likewise)
        per_layer = {f"linear_attn.{name}": ours for name, ours in (
            ("in_proj_qkv.weight", ("lin_qkv", True)), ("in_proj_z.weight", ("lin_z", True)),
            ("in_proj_b.weight", ("lin_b", True)), ("in_proj_a.weight", ("lin_a", True)),
            ("conv1d.weight", ("lin_conv", True)), ("A_log", ("lin_a_log", False)), ("dt_bias", ("lin_dt_bias", False)),
            ("norm.weight", ("lin_norm", False)), ("out_proj.weight", ("lin_out", True)))}
    if cfg.ssm_parallel:  # Falcon-H1's mixers beside the attention
        per_layer |= _mamba_weight_map(cfg)
    if cfg.attn_output_gate:  # its half of the checkpoint's q_proj (registry._qwen3_5_tensors)
        per_layer["self_attn.q_gate.weight"] = ("o_gate", True)
    if cfg.k_eq_v or cfg.kv_source >= 0:  # the keys' projection gives the values too, or neither is the layer's
        del per_layer["self_attn.v_proj.weight"]
    if cfg.kv_source >= 0:
        del per_layer["self_attn.k_proj.weight"]
    if cfg.per_layer_input_size:  # Gemma 4's per-layer input branch
        per_layer |= {"per_layer_input_gate.weight": ("ple_gate", True),
                      "per_layer_projection.weight": ("ple_proj", True),
                      "post_per_layer_input_norm.weight": ("ple_norm", False)}
    if cfg.layer_scale:  # Gemma 4's buffer of one value (the loader takes it as the layer's scalar)
        per_layer["layer_scalar"] = ("layer_scale", False)
    if cfg.hidden_act == "xielu":  # Apertus's activation's parameters (one value each: the layer's scalars)
        per_layer |= {f"mlp.act_fn.{name.removeprefix('act_')}": (name, False) for name in XIELU_PARAMS}
    if cfg.latent_attention:  # DeepSeek V2/V3 (DecoderLayers._latent_attention_params)
        query = ({"q_a_proj.weight": ("q_a_proj", True), "q_a_layernorm.weight": ("q_a_norm", False),
                  "q_b_proj.weight": ("q_b_proj", True)} if cfg.q_lora_rank else {"q_proj.weight": ("q_proj", True)})
        per_layer = {f"self_attn.{name}": ours for name, ours in (query | {
            "kv_a_proj_with_mqa.weight": ("kv_a_proj", True), "kv_a_layernorm.weight": ("kv_a_norm", False),
            "kv_b_proj.key": ("kv_b_k", False), "kv_b_proj.value": ("kv_b_v", False),  # registry._deepseek_tensors
            "o_proj.weight": ("o_proj", True)}).items()}
    norms = {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"} if cfg.pre_norms else {}
    if not cfg.mlp_input_norm:
        norms.pop("post_attention_layernorm", None)
    per_layer |= {f"{hf_name}.{part}": (ours + suffix, False) for hf_name, ours in norms.items()
                  for part, suffix in (("weight", ""), ("bias", "_bias"))[:1 + cfg.norm_bias]}
    # a mixture of experts' dense MLP: Qwen2 MoE's shared expert, DeepSeek V3's shared experts (GLM-4.5's, dots'), Llama
    # 4's shared expert (its MLPs are `feed_forward`s)
    mlp = "feed_forward" if cfg.architecture in LLAMA4_ARCHITECTURES else "mlp"
    dense = (f"{mlp}.shared_expert" if cfg.shared_expert_gate or mlp == "feed_forward" else "mlp.shared_experts") \
        if cfg.num_experts and not cfg.experts_beside_mlp else mlp
    if cfg.intermediate_size:
        projections = ("gate", "up", "down") if cfg.gated_mlp else ("up", "down")
        per_layer |= {f"{dense}.{p}_proj.weight": (f"{p}_proj", True) for p in projections}
        if cfg.mlp_bias:
            per_layer |= {f"{dense}.{p}_proj.bias": (f"{p}_bias", False) for p in projections}
    if cfg.shared_expert_gate:
        per_layer["mlp.shared_expert_gate.weight"] = ("shared_expert_gate", True)
    experts = {}  # a per-expert tensor's name within the layer's experts -> our stacked parameter
    if cfg.architecture == "GptOssForCausalLM":  # each layer's experts stacked in one tensor (registry._GptOssTensors)
        per_layer |= {"mlp.router.weight": ("router", True), "mlp.router.bias": ("router_bias", False),
                      "self_attn.sinks": ("sinks", False)}
        if cfg.mxfp4_experts:  # packed at load as they are
            per_layer |= {f"mlp.experts.{p}_proj{part}": (f"expert_{p}{part.replace('_codes', '')}", False)
                          for p in ("gate_up", "down") for part in ("_codes", "_exponents", "_bias")}
        else:
            per_layer |= {f"mlp.experts.{p}_proj{bias}": (f"expert_{p}{bias}", False)
                          for p in ("gate", "up", "down") for bias in ("", "_bias")}
    elif cfg.experts_beside_mlp:  # Gemma 4: each layer's experts stacked (registry._gemma4_tensors)
        per_layer |= {"router.proj.weight": ("router", True), "router.scale": ("router_norm", False),
                      "router.per_expert_scale": ("expert_scale", False),
                      "pre_feedforward_layernorm_2.weight": ("expert_norm", False),
                      "post_feedforward_layernorm_1.weight": ("post_dense_norm", False),
                      "post_feedforward_layernorm_2.weight": ("post_expert_norm", False)} | {
            f"experts.{p}_proj": (f"expert_{p}", False) for p in ("gate", "up", "down")}
    elif cfg.num_experts and cfg.architecture in _STACKED_EXPERTS:
        moe, router = _STACKED_EXPERTS[cfg.architecture]
        per_layer |= {router: ("router", True)} | {
            f"{moe}.experts.{p}_proj": (f"expert_{p}", False) for p in ("gate", "up", "down")}
    elif cfg.num_experts:
        mixtral = cfg.architecture in MIXTRAL_NAMED_ARCHITECTURES  # experts' w1, w3, w2
        moe = "block_sparse_moe" if mixtral else "mlp"
        per_layer[f"{moe}.gate.weight"] = ("router", True)
        if cfg.router_correction:
            per_layer[f"{moe}.gate.e_score_correction_bias"] = ("router_correction", False)
        projections = (("w1", "gate"), ("w3", "up"), ("w2", "down")) if mixtral else (
            (f"{p}_proj", p) for p in (("gate", "up", "down") if cfg.gated_mlp else ("up", "down")))
        experts = {f"{moe}.experts.{{}}.{hf}.weight": f"expert_{ours}" for hf, ours in projections}
        if cfg.moe_latent_size:  # Nemotron 3 Super's
            per_layer |= {f"{moe}.fc1_latent_proj.weight": ("moe_latent_in", True),
                          f"{moe}.fc2_latent_proj.weight": ("moe_latent_out", True)}
    if cfg.qkv_bias:
        per_layer |= {f"self_attn.{p}_proj.bias": (f"{p}_bias", False)
                      for p in ("q" if cfg.kv_source >= 0 else "qk" if cfg.k_eq_v else "qkv")}
    if cfg.o_bias:
        per_layer["self_attn.o_proj.bias"] = ("o_bias", False)
    if cfg.qk_norm:
        per_layer |= {f"self_attn.{p}_norm.weight": (f"{p}_norm", False) for p in ("q" if cfg.kv_source >= 0 else "qk")}
    if cfg.qk_norm_bias:
        per_layer |= {f"self_attn.{p}_norm.bias": (f"{p}_norm_bias", False) for p in "qk"}
    if cfg.sandwich_norms and cfg.architecture == "Glm4ForCausalLM":  # post_attention_layernorm is the MLP's input's
        per_layer |= {"post_self_attn_layernorm.weight": ("post_attn_norm", False),
                      "post_mlp_layernorm.weight": ("post_mlp_norm", False)}
    elif cfg.sandwich_norms:  # Gemma 2/3, OLMo 2: post_attention_layernorm normalises the attention's output
        per_layer |= {"post_attention_layernorm.weight": ("post_attn_norm", False),
                      "post_feedforward_layernorm.weight": ("post_mlp_norm", False)}
        if cfg.pre_norms:
            per_layer["pre_feedforward_layernorm.weight"] = ("mlp_norm", False)
    if cfg.quant_kv_scales:  # quantization.kv_scale_tensor's names
        per_layer |= {"self_attn.k_scale": ("k_scale", False), "self_attn.v_scale": ("v_scale", False)}
    if cfg.quantization is not None:  # each projection's scales (quantization.with_quantized: W8A8's [out], W4A16's
        # and FP8's [out, groups], transposed) and zero points (W4A16's [out, groups], transposed)
        projections = [(hf_name, ours) for hf_name, (ours, _) in per_layer.items() if ours in QUANTIZED_LINEARS]
        per_layer |= {hf_name + "_scale": (ours + "_scale", cfg.quantization in WEIGHT_ONLY)
                      for hf_name, ours in projections}
        if cfg.quant_zero_point:
            per_layer |= {hf_name + "_zero_point": (ours + "_zero", True) for hf_name, ours in projections}
        if cfg.quant_act_order:
            per_layer |= {hf_name + "_g_idx": (ours + "_g_idx", False) for hf_name, ours in projections}
    return per_layer, experts
