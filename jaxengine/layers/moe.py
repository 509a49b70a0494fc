"""Mixture-of-experts MLP: each token through its top-k experts' (gated) MLPs, weighted by the router."""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxengine.layers.activations import ACTIVATIONS


SWIGLU_OAI = "swigluoai"  # GPT-OSS's experts' activation (vLLM's name for it)


class Mxfp4Experts(NamedTuple):
    """A projection of every expert in MXFP4, as the native CPU grouped matmul takes it
    (pallas_kernels.cpu.grouped_matmul_mxfp4): codes [(L,) E, P, K2, 32] and exponents [(L,) E, P, K2 / 16, 32]
    (pack_mxfp4_panels), and a float32 bias [(L,) E, P * 32] added to the products (or None)."""
    codes: jax.Array
    exponents: jax.Array
    bias: jax.Array | None = None


def swiglu_oai(gate, up, alpha: float, limit: float):
    """GPT-OSS's gating: the gate clamped from above and the up product both ways at `limit`, then
    (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(alpha * gate))


@dataclasses.dataclass(frozen=True)
class Routing:
    """How a router chooses (Phi-3.5-MoE's `sparsemixer` aside: _sparsemixer): by the `softmax` of its logits
    (Mixtral, Qwen MoE, GPT-OSS, DeepSeek V2; ERNIE 4.5's plus a correction bias) or by DeepSeek V3's `sigmoid`
    scores (GLM-4.5's) plus a correction bias; among the `groups` = (n_group, topk_group) groups with the best group
    scores (every group where none): a softmax group's best score (DeepSeek V2's group_limited_greedy), a sigmoid
    group's top two summed; weighted by their scores (renormalised where asked: over their sum plus `renorm_eps`),
    times `scale` (routed_scaling_factor)."""

    scoring: str = "softmax"
    groups: tuple = ()
    scale: float = 1.0
    renorm_eps: float = 1e-20  # DeepSeek V3's (transformers'); LFM2-MoE's 1e-6
    jitter_eps: float = 0.0  # scoring "sparsemixer" (Phi-3.5-MoE): its router_jitter_noise (_sparsemixer)


def route(x, router, top_k: int, renormalize: bool, bias=None, routing: Routing = Routing(), correction=None):
    """(weights f32[T, top_k], experts i32[T, top_k]) for x [T, D] and router [D, E] (and its `bias` [E]): the
    softmax of the router logits (in float32) at its top_k experts, renormalised to sum to 1 where `renormalize`
    (Mixtral, Qwen MoE's `norm_topk_prob`, and GPT-OSS's softmax over the top logits, which is the same); or as
    `routing` says (its sigmoid scoring with the `correction` bias [E], its groups, its scale)."""
    logits = jnp.dot(x.astype(router.dtype), router, preferred_element_type=jnp.float32)
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    if routing.scoring == "sparsemixer":
        return _sparsemixer(logits, top_k, routing.jitter_eps)
    if routing.scoring == "softmax" and not routing.groups and correction is None:
        weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
        if renormalize:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights * routing.scale if routing.scale != 1 else weights, experts
    sigmoid = routing.scoring == "sigmoid"
    scores = jax.nn.sigmoid(logits) if sigmoid else jax.nn.softmax(logits, axis=-1)
    choice = scores if correction is None else scores + correction.astype(jnp.float32)
    if routing.groups:
        n_group, topk_group = routing.groups
        T, E = choice.shape
        grouped = choice.reshape(T, n_group, E // n_group)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1) if sigmoid else jnp.max(grouped, axis=-1)
        _, kept = jax.lax.top_k(group_scores, topk_group)  # [T, topk_group]
        in_kept = jnp.any(jnp.arange(n_group)[None, :, None] == kept[:, None, :], axis=-1)  # [T, n_group]
        choice = jnp.where(jnp.repeat(in_kept, E // n_group, axis=1), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if renormalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + routing.renorm_eps)
    return weights * routing.scale, experts


def _sparsemixer(logits, top_k: int, jitter_eps: float):
    """Phi-3.5-MoE's router at inference (transformers' sparsemixer): top_k rounds, each choosing the best expert not
    yet chosen, weighted by the softmax, over the experts not yet chosen, of the logits within 2 jitter_eps of it
    (relative: (best - logit) / max(|logit|, best)); the others masked out of that softmax."""
    E = logits.shape[-1]
    remaining, weights, experts = logits, [], []
    for _ in range(top_k):
        best = jnp.max(remaining, axis=-1, keepdims=True)
        chosen = jnp.argmax(remaining, axis=-1)[:, None]
        far = (best - logits) / jnp.maximum(jnp.abs(logits), best) > 2 * jitter_eps
        gates = jax.nn.softmax(jnp.where(far, -jnp.inf, remaining), axis=-1)
        weights.append(jnp.take_along_axis(gates, chosen, axis=-1))
        experts.append(chosen)
        remaining = jnp.where(jnp.arange(E)[None, :] == chosen, -jnp.inf, remaining)
    return jnp.concatenate(weights, axis=-1), jnp.concatenate(experts, axis=-1).astype(jnp.int32)


def moe_mlp(
    x: jax.Array,  # [T, D], normed
    router: jax.Array,  # [D, E]
    *,
    down: jax.Array | Mxfp4Experts,  # [E, I, D], or packed
    top_k: int,
    renormalize: bool,
    activation: str,  # a name of jaxengine.layers.activations.ACTIVATIONS
    gate: jax.Array | None = None,  # [E, D, I], or packed; None (and no gate_up): the experts are ungated,
    # act(up) (Nemotron-H's)
    up: jax.Array | None = None,  # [E, D, I], or packed
    gate_up: jax.Array | Mxfp4Experts | None = None,  # packed by pallas_kernels.cpu.pack_gated (or MXFP4 in its
    # column order), in place of gate and up
    layer=None,  # i32[]: the layer whose experts a packed stack of all layers' ([L, E, P, K2, 64]) gives
    live_rows=None,  # i32[]: x's rows from it on are a bucket's padding
    router_bias=None,  # [E]
    gate_bias=None,  # [E, I]: added to each expert's gate products (GPT-OSS)
    up_bias=None,  # [E, I]
    down_bias=None,  # [E, D]: added to each expert's output, before the router's weight
    swiglu=(1.702, 7.0),  # activation "swigluoai": its (alpha, limit)
    folded_bias: bool = False,  # `gate_up` holds the gate/up biases as its last input row: x gets a 1 there
    routing: Routing = Routing(),  # how the router chooses (route)
    router_correction=None,  # [E]: the sigmoid router's correction bias (route)
    scale_inputs: bool = False,  # Llama 4: each pair's input times its router weight (its output unweighted)
    router_input: jax.Array | None = None,  # [T, D]: what the router reads where it is not x (Gemma 4's own norm)
    expert_scale: jax.Array | None = None,  # [E]: each expert's router weight times this (Gemma 4's per-expert scale)
) -> jax.Array:  # [T, D] in x's dtype
    """The tokens' (token, expert) pairs sorted by expert run as one grouped matmul per projection, in the
    weights' dtype with float32 accumulation, then are weighted and summed back per token. Weights packed for
    the native CPU matmul ([E, P, K2, 64], or all layers' [L, E, P, K2, 64]) run its grouped form, which
    multiplies each expert's rows only (with `gate_up`, act(gate) * up is applied in registers and handed to
    the down projection rounded); others run `lax.ragged_dot`, which TPUs group natively and XLA:CPU computes
    densely (every expert over every row). The native form gives a bucket's padding rows (`live_rows`) no
    expert: they are sorted last, outside every group, and never multiplied; `ragged_dot` routes them like the
    others. Their results are never read. `swigluoai` (GPT-OSS) gates as `swiglu_oai`, its biases added to the
    products first: packed together (`gate_up`, GPT-OSS's constants) the kernel gates them in registers, the biases
    folded into the weight (`folded_bias`) or, MXFP4's (`Mxfp4Experts`: native only, gate/up together), added by
    the kernel; packed apart, gate and up are multiplied in turn and gated in XLA."""
    T, E = x.shape[0], router.shape[-1]
    if activation == SWIGLU_OAI:
        def glu(gate, up):
            return swiglu_oai(gate, up, *swiglu)
    else:
        def glu(gate, up):
            return ACTIVATIONS[activation](gate) * up
    weights, experts = route(x if router_input is None else router_input, router, top_k, renormalize, router_bias,
                             routing, router_correction)
    if expert_scale is not None:
        weights = weights * expert_scale.astype(jnp.float32)[experts]
    flat = experts.reshape(-1)  # [T * top_k]
    mxfp4 = isinstance(down, Mxfp4Experts)
    if mxfp4 and not isinstance(gate_up, Mxfp4Experts):
        raise ValueError("MXFP4 experts run their gate and up projections together: gate_up must be Mxfp4Experts too")
    native = mxfp4 or down.ndim >= 4  # packed for the native CPU matmul
    if native and live_rows is not None:
        flat = jnp.where(jnp.arange(T * top_k) // top_k < live_rows, flat, E)  # padding: past the last expert
    order = jnp.argsort(flat, stable=True)
    rows = order // top_k  # the token of each sorted pair
    sizes = jnp.bincount(flat, length=E + 1)[:E].astype(jnp.int32)  # [E] rows per expert
    pair_experts = flat[order]  # each sorted pair's expert (E: a bucket's padding, native)
    pair_weights = jnp.where(pair_experts < E, weights.reshape(-1)[order], 0.0)  # padding's (native): 0, biases too
    xs = (x[rows] * pair_weights[:, None].astype(x.dtype)) if scale_inputs else x[rows]
    sorted_experts = jnp.minimum(pair_experts, E - 1)  # a bias's row for each pair (padding's: any)

    def biased(y, bias):  # y [T * top_k, n] plus each pair's expert's bias (zeros past its width: packed pairs)
        if bias is None:
            return y
        bias = bias.astype(jnp.float32)
        return y + jnp.pad(bias, ((0, 0), (0, y.shape[-1] - bias.shape[-1])))[sorted_experts]

    def mlp(product):  # the experts' hidden activations from `product` (a projection's grouped products)
        if gate is None:  # ungated: act(up)
            return ACTIVATIONS[activation](biased(product(up), up_bias))
        return glu(biased(product(gate), gate_bias), biased(product(up), up_bias))

    if native:
        from pallas_kernels import cpu

        first = 0 if (down.codes if mxfp4 else down).ndim == 4 else layer * E

        def stack(w):  # every layer's experts as one stack [L * E, ...]: `first` names the layer's
            return w.reshape(-1, *w.shape[-3:])

        def grouped(a, w, n, **kwargs):
            if isinstance(w, Mxfp4Experts):
                bias = None if w.bias is None else w.bias.reshape(-1, w.bias.shape[-1])
                return cpu.grouped_matmul_mxfp4(a, stack(w.codes), stack(w.exponents), bias, sizes, first, n,
                                                **kwargs)
            return cpu.grouped_matmul_bf16(a, stack(w), sizes, first, n, **kwargs)

        D, a = x.shape[1], xs.astype(jnp.float32)
        if gate_up is not None:
            if folded_bias:
                a = jnp.concatenate([a, jnp.ones((a.shape[0], 1), jnp.float32)], axis=-1)
            panels = (gate_up.codes if mxfp4 else gate_up).shape[-3]
            pairs = grouped(a, gate_up, 2 * panels * cpu.GATED, epilogue="gated_pairs", activation=activation)
            out = grouped(pairs, down, D, prologue="rounded")
        else:
            n = 2 * down.shape[-2]  # the intermediate width (one more, zero, where it is odd: pack_bf16's pairs)
            hidden = mlp(lambda w: grouped(a, w, n))
            out = grouped(hidden, down, D)
    else:
        def grouped(a, w):
            return jax.lax.ragged_dot(a.astype(w.dtype), w, sizes, preferred_element_type=jnp.float32)

        out = grouped(mlp(lambda w: grouped(xs, w)), down)
    if scale_inputs:  # weighted on the way in (padding's weight 0 too)
        pair_weights = jnp.where(pair_experts < E, 1.0, 0.0)
    out = biased(out, down_bias) * pair_weights[:, None]  # [T * top_k, D] f32
    return jnp.zeros((T, x.shape[1]), jnp.float32).at[rows].add(out).astype(x.dtype)
