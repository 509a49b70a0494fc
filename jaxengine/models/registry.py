"""Maps `architectures[0]` of a Hugging Face config to our implementation and its config reading."""

from collections.abc import Callable
import dataclasses
import re

import numpy as np

from jaxengine.models.config import (COHERE_ARCHITECTURES, GEMMA4_ARCHITECTURES, GEMMA_ARCHITECTURES, GLM_ARCHITECTURES,
                                     GRANITE_MOE_ARCHITECTURES, HUNYUAN_ARCHITECTURES, LFM2_ARCHITECTURES,
                                     MAMBA_ARCHITECTURES, PHIMOE_ARCHITECTURES, QWEN3_5_ARCHITECTURES,
                                     QWEN_VL_ARCHITECTURES, ModelConfig, afmoe_config_from_hf, apertus_config_from_hf,
                                     arcee_config_from_hf, bamba_config_from_hf, cohere_config_from_hf,
                                     deepseek_config_from_hf, dots1_config_from_hf, ernie4_5_config_from_hf,
                                     ernie4_5_moe_config_from_hf, exaone4_config_from_hf, exaone_config_from_hf,
                                     exaone_moe_config_from_hf, falcon_config_from_hf, falcon_h1_config_from_hf,
                                     gemma3_language_config_from_hf, gemma4_config_from_hf, gemma_config_from_hf,
                                     glm4_moe_config_from_hf, glm_config_from_hf, gpt2_config_from_hf,
                                     gpt_neox_config_from_hf, gpt_oss_config_from_hf, gptj_config_from_hf,
                                     granite_config_from_hf, granite_moe_config_from_hf,
                                     granite_moe_hybrid_config_from_hf, helium_config_from_hf, hunyuan_config_from_hf,
                                     hy_v3_config_from_hf, hyperclovax_config_from_hf, internlm3_config_from_hf,
                                     iquestcoder_config_from_hf, jais2_config_from_hf, jamba_config_from_hf,
                                     kimi_linear_config_from_hf, lfm2_config_from_hf, llama4_config_from_hf,
                                     mamba2_config_from_hf, mamba_config_from_hf, minimax_m2_config_from_hf,
                                     ministral3_config_from_hf, ministral_config_from_hf,
                                     mistral3_language_config_from_hf, mistral4_config_from_hf, model_config_from_hf,
                                     moe_config_from_hf, nemotron_config_from_hf, nemotron_h_config_from_hf,
                                     olmo2_config_from_hf, olmo_config_from_hf, olmoe_config_from_hf,
                                     opt_config_from_hf, phi_config_from_hf, phimoe_config_from_hf,
                                     qwen3_5_config_from_hf, qwen_vl_language_config_from_hf, seed_oss_config_from_hf,
                                     smollm3_config_from_hf, solar_open_config_from_hf, stablelm_config_from_hf,
                                     starcoder2_config_from_hf, vaultgemma_config_from_hf)
from jaxengine.models.llama import LlamaForCausalLM
from jaxengine.models.quantization import dequantize_mxfp4


def _same_name(name: str) -> str:
    return name


@dataclasses.dataclass(frozen=True)
class Architecture:
    model_class: type
    read_config: Callable[[dict], ModelConfig]
    # a checkpoint tensor's name -> the name the model's weight map knows it by; None: not the model's
    tensor_name: Callable[[str], str | None] = _same_name
    # a (renamed) checkpoint tensor -> the (name, array) pieces the weight map knows (Phi-3's fused projections),
    # or a class whose instances are such functions, one for each load (they may hold a tensor until its pair
    # arrives: MXFP4's blocks and scales)
    split_tensor: Callable[[str, object, ModelConfig], list] = lambda name, array, cfg: [(name, array)]
    embedding_only: bool = False  # a base model (`*Model`): served by the pooling runner only
    classifier: bool = False  # `*ForSequenceClassification`: pooled, then its `score` head (on the host)


def _base_model_tensor(name: str) -> str | None:
    """A base model's tensor (`layers.0...`, as transformers saves `LlamaModel`) under its causal LM's name
    (`model.layers.0...`)."""
    return name if name.startswith("model.") else "model." + name


def _phi3_split(name: str, array, cfg: ModelConfig) -> list:
    """Phi-3's fused q/k/v ([(heads + 2 kv_heads) x head_dim, hidden]) and gate/up ([2 x intermediate, hidden])
    projections as the separate tensors the weight map knows (the loader packs them together again); a quantized
    checkpoint's scales and zero points of them ([out, ...]) split by the same rows, and its g_idx ([in]: the
    inputs' groups) given to each."""
    stem, _, kind = name.rpartition(".")
    if kind not in ("weight", "weight_scale", "weight_zero_point", "weight_g_idx"):
        return [(name, array)]
    inputs = kind == "weight_g_idx"  # along the shared input: each part's the same
    if stem.endswith(".self_attn.qkv_proj"):
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        prefix = stem[: -len("qkv_proj")]
        parts = (array,) * 3 if inputs else (array[:q], array[q:q + kv], array[q + kv:])
        return [(f"{prefix}{p}_proj.{kind}", part) for p, part in zip("qkv", parts)]
    if stem.endswith(".mlp.gate_up_proj"):
        prefix, i = stem[: -len("gate_up_proj")], cfg.intermediate_size
        parts = (array,) * 2 if inputs else (array[:i], array[i:])
        return [(f"{prefix}{p}_proj.{kind}", part) for p, part in zip(("gate", "up"), parts)]
    return [(name, array)]


_RESIDUAL_OUTPUTS = (".self_attn.o_proj.weight", ".self_attn.o_proj.bias", ".mlp.down_proj.weight",
                     ".mlp.down_proj.bias", ".mamba.out_proj.weight", ".mamba.out_proj.bias")


def _granite_scaled(name: str, array, cfg: ModelConfig) -> list:
    """Granite's multipliers folded into its weights: each layer's o_proj and down_proj (and Granite 4.0-H's Mamba2
    mixers' out_proj) times residual_multiplier (their products join the residual scaled by it), the final norm's over
    logits_scaling (`_logits_scaled`)."""
    if name.endswith(_RESIDUAL_OUTPUTS):
        return [(name, np.asarray(array, np.float32) * np.float32(cfg.residual_scale))]
    return _logits_scaled(name, array, cfg)


# HyperCLOVA X's norms under Gemma's names: its MLP's input norm, its post-norms on the attention's and MLP's outputs
_HYPERCLOVAX_NORMS = ((".post_attention_layernorm.", ".pre_feedforward_layernorm."),
                      (".post_norm1.", ".post_attention_layernorm."), (".post_norm2.", ".post_feedforward_layernorm."))


def _hyperclovax_tensors(name: str, array, cfg: ModelConfig) -> list:
    """HyperCLOVA X's multipliers folded as Granite's (`_granite_scaled`), but with its post-norms (ModelConfig
    sandwich_norms) the residual multiplier goes into their weights (their outputs join the residual times it), the
    norms renamed as Gemma's."""
    if not cfg.sandwich_norms:
        return _granite_scaled(name, array, cfg)
    for theirs, ours in _HYPERCLOVAX_NORMS:
        if theirs in name:
            name = name.replace(theirs, ours)
            break
    if name.endswith((".post_attention_layernorm.weight", ".post_feedforward_layernorm.weight")):
        return [(name, np.asarray(array, np.float32) * np.float32(cfg.residual_scale))]
    return _logits_scaled(name, array, cfg)


# GraniteMoe's per-layer tensors (as the hub's checkpoints and transformers name them) -> (ours, what they hold)
_GRANITE_MOE_PARTS = {
    "block_sparse_moe.input_linear.weight": ("block_sparse_moe.experts.", "gate_up"),
    "block_sparse_moe.output_linear.weight": ("block_sparse_moe.experts.", "down"),
    "block_sparse_moe.router.layer.weight": ("block_sparse_moe.router.", "router"),
    "shared_mlp.input_linear.weight": ("mlp.shared_experts.", "gate_up"),
    "shared_mlp.output_linear.weight": ("mlp.shared_experts.", "down"),
}


def _granite_moe_tensors(name: str, array, cfg: ModelConfig) -> list:
    """GraniteMoe's tensors as the weight map knows them: each layer's experts' fused gate/up ([E, 2 x I, hidden]:
    the gate's rows, then up's) as `gate_proj` and `up_proj` [E, hidden, I] and their down projection ([E, hidden, I])
    as `down_proj` [E, I, hidden], times residual_multiplier (as Granite's own down_proj); the shared expert's
    (GraniteMoeShared: [2 x S, hidden], [hidden, S]) as a dense MLP's likewise; the router's weight; the rest as
    Granite's (`_granite_scaled`)."""
    stem, dot, rest = name.rpartition(".layers.")
    index, _, part = rest.partition(".")
    if not dot or part not in _GRANITE_MOE_PARTS:
        return _granite_scaled(name, array, cfg)
    prefix, kind = _GRANITE_MOE_PARTS[part]
    head = f"{stem}.layers.{index}.{prefix}"
    array = np.asarray(array)
    if kind == "router":
        return [(head + "weight", array)]
    experts = prefix.startswith("block_sparse_moe")
    if kind == "gate_up":
        gate, up = np.split(array, 2, axis=-2)
        if experts:  # [E, I, hidden] -> [E, hidden, I]
            return [(head + "gate_proj", gate.swapaxes(-1, -2)), (head + "up_proj", up.swapaxes(-1, -2))]
        return [(head + "gate_proj.weight", gate), (head + "up_proj.weight", up)]
    down = np.asarray(array, np.float32) * np.float32(cfg.residual_scale)
    return [(head + "down_proj", down.swapaxes(-1, -2))] if experts else [(head + "down_proj.weight", down)]


def _granite_moe_hybrid_tensors(name: str, array, cfg: ModelConfig) -> list:
    """Granite 4.0's tensors: GraniteMoe's (`_granite_moe_tensors`: its mixers' output projections scaled as the
    attention's), the shared MLP a dense one where there are no experts."""
    pieces = _granite_moe_tensors(name, array, cfg)
    return pieces if cfg.num_experts else [(n.replace(".mlp.shared_experts.", ".mlp."), a) for n, a in pieces]


def _logits_scaled(name: str, array, cfg: ModelConfig) -> list:
    """The final norm's weight (and bias) over logits_scaling: the norm feeds only the head (no bias on it where
    the scaling is a model's), so the logits come out divided by it (Granite's logits_scaling, Cohere's
    logit_scale)."""
    if name in ("model.norm.weight", "model.norm.bias"):
        return [(name, np.asarray(array, np.float32) / np.float32(cfg.logits_scaling))]
    return [(name, array)]


def _renaming(pairs: tuple[tuple[str, str], ...], dropped: tuple[str, ...] = (),
              prefixes: tuple[tuple[str, str], ...] = ()) -> Callable[[str], str | None]:
    """A tensor_name that drops names ending in `dropped` (buffers some checkpoints hold), replaces each of
    `prefixes`' (checkpoint's, ours) where a name starts with it (in turn: one may make the next's), then each of
    `pairs`' wherever it occurs."""
    def tensor_name(name: str) -> str | None:
        if name.endswith(dropped):
            return None
        for theirs, ours in prefixes:
            if name.startswith(theirs):
                name = ours + name[len(theirs):]
        for theirs, ours in pairs:
            name = name.replace(theirs, ours)
        return name

    return tensor_name


# StarCoder2's MLP; Phi's output projection, MLP, final norm and q/k norms; GPT-NeoX's names (its q/k/v fused per head:
# `_grouped_qkv_split`)
_STARCODER2_NAMES = ((".mlp.c_fc.", ".mlp.up_proj."), (".mlp.c_proj.", ".mlp.down_proj."))
_PHI_NAMES = ((".self_attn.dense.", ".self_attn.o_proj."), (".mlp.fc1.", ".mlp.up_proj."),
              (".mlp.fc2.", ".mlp.down_proj."), ("model.final_layernorm.", "model.norm."),
              (".self_attn.q_layernorm.", ".self_attn.q_norm."), (".self_attn.k_layernorm.", ".self_attn.k_norm."))
_GPT_NEOX_NAMES = (("gpt_neox.embed_in.", "model.embed_tokens."), ("gpt_neox.layers.", "model.layers."),
                   ("gpt_neox.final_layer_norm.", "model.norm."), ("embed_out.", "lm_head."),
                   (".attention.query_key_value.", ".self_attn.qkv_proj."), (".attention.dense.", ".self_attn.o_proj."),
                   (".mlp.dense_h_to_4h.", ".mlp.up_proj."), (".mlp.dense_4h_to_h.", ".mlp.down_proj."))
_GPT_NEOX_BUFFERS = (".attention.bias", ".attention.masked_bias", ".rotary_emb.inv_freq")
_GPT2_BUFFERS = (".attn.bias", ".attn.masked_bias")  # GPT-2's, GPT-BigCode's and GPT-J's causal masks
# GPT-2's (with or without its `transformer.` prefix: the hub's gpt2 has none) and OPT's (with or without `model.`)
_GPT2_PREFIXES = (("transformer.", ""), ("h.", "model.layers."), ("wte.", "model.embed_tokens."),
                  ("wpe.", "model.embed_positions."), ("ln_f.", "model.norm."))
_GPT2_NAMES = ((".ln_1.", ".input_layernorm."), (".ln_2.", ".post_attention_layernorm."),
               (".attn.c_attn.", ".self_attn.qkv_proj."), (".attn.c_proj.", ".self_attn.o_proj."),
               (".mlp.c_fc.", ".mlp.up_proj."), (".mlp.c_proj.", ".mlp.down_proj."))
_GPTJ_NAMES = ((".ln_1.", ".input_layernorm."), (".attn.out_proj.", ".self_attn.o_proj."), (".attn.", ".self_attn."),
               (".mlp.fc_in.", ".mlp.up_proj."), (".mlp.fc_out.", ".mlp.down_proj."))
_FALCON_PREFIXES = (("transformer.", "model."), ("model.word_embeddings.", "model.embed_tokens."),
                    ("model.h.", "model.layers."), ("model.ln_f.", "model.norm."))
_FALCON_NAMES = ((".self_attention.query_key_value.", ".self_attn.qkv_proj."),
                 (".self_attention.dense.", ".self_attn.o_proj."), (".mlp.dense_h_to_4h.", ".mlp.up_proj."),
                 (".mlp.dense_4h_to_h.", ".mlp.down_proj."), (".ln_attn.", ".input_layernorm."),
                 (".ln_mlp.", ".post_attention_layernorm."))
_EXAONE_PREFIXES = (("transformer.wte.", "model.embed_tokens."), ("transformer.h.", "model.layers."),
                    ("transformer.ln_f.", "model.norm."))
_EXAONE_NAMES = ((".attn.attention.out_proj.", ".self_attn.o_proj."), (".attn.attention.", ".self_attn."),
                 (".ln_1.", ".input_layernorm."), (".ln_2.", ".post_attention_layernorm."),
                 (".mlp.c_fc_0.", ".mlp.gate_proj."), (".mlp.c_fc_1.", ".mlp.up_proj."),
                 (".mlp.c_proj.", ".mlp.down_proj."))
_OPT_PREFIXES = (("model.decoder.", "decoder."), ("decoder.final_layer_norm.", "model.norm."), ("decoder.", "model."))
_OPT_NAMES = ((".self_attn.out_proj.", ".self_attn.o_proj."), (".self_attn_layer_norm.", ".input_layernorm."),
              (".final_layer_norm.", ".post_attention_layernorm."), (".fc1.", ".mlp.up_proj."),
              (".fc2.", ".mlp.down_proj."))


def _gpt2_split(name: str, array, cfg: ModelConfig) -> list:
    """GPT-2's Conv1D weights ([in, out]) as the [out, in] ones the weight map knows, its fused q/k/v (weight
    [hidden, 3 x hidden], bias [3 x hidden]: q's columns, then k's, then v's) as q, k and v."""
    stem, _, kind = name.rpartition(".")
    array = np.asarray(array)
    if stem.endswith(".self_attn.qkv_proj"):
        prefix = stem[: -len("qkv_proj")]
        return [(f"{prefix}{p}_proj.{kind}", part.T if kind == "weight" else part)
                for p, part in zip("qkv", np.split(array, 3, axis=-1))]
    if kind == "weight" and stem.endswith((".self_attn.o_proj", ".mlp.up_proj", ".mlp.down_proj")):
        return [(name, array.T)]
    return [(name, array)]


def _grouped_qkv_split(name: str, array, cfg: ModelConfig) -> list:
    """A q/k/v projection fused by KV group ([kv_heads x (queries per KV head + 2) x head_dim, ...]: each group's
    queries, then its key and value) as q, k and v. Falcon's new layout; its old one-KV-head layout and GPT-BigCode's
    multi_query one are one group (q's rows, then k's, then v's); GPT-NeoX's, Falcon's and GPT-BigCode's per-head
    layouts are one query per group (each head's q, k and v in turn)."""
    stem, _, kind = name.rpartition(".")
    if not stem.endswith(".self_attn.qkv_proj"):
        return [(name, array)]
    kv, group = cfg.num_kv_heads, cfg.q_per_kv
    grouped = np.asarray(array).reshape(kv, group + 2, cfg.head_dim, *np.shape(array)[1:])
    parts = (grouped[:, :group], grouped[:, group], grouped[:, group + 1])
    prefix = stem[: -len("qkv_proj")]
    return [(f"{prefix}{p}_proj.{kind}", part.reshape(-1, *grouped.shape[3:])) for p, part in zip("qkv", parts)]


def _nemotron_tensors(name: str, array, cfg: ModelConfig) -> list:
    """Nemotron's LayerNorm1P weights (each norm scales by 1 + weight) with the 1 added, as the LayerNorm takes them."""
    if name.endswith(("layernorm.weight", "model.norm.weight")):
        return [(name, np.asarray(array, np.float32) + np.float32(1.0))]
    return [(name, array)]


def _cohere_tensors(name: str, array, cfg: ModelConfig) -> list:
    """Cohere's tensors as the weight map knows them: R+'s per-head q/k norm weights ([heads, head_dim]) as one row
    over every head, the final norm's weight with the logits' scale folded in (`_logits_scaled`)."""
    if name.endswith((".self_attn.q_norm.weight", ".self_attn.k_norm.weight")):
        return [(name, np.asarray(array).reshape(-1))]
    return _logits_scaled(name, array, cfg)


class _StableLmTensors:
    """StableLM's tensors as the weight map knows them (an instance for each load): its per-head q/k LayerNorms
    (`q_layernorm.norms.{head}.weight`, one [head_dim] tensor each) held until a layer's every head has arrived,
    then one row over every head (`q_norm.weight`, as Cohere's)."""

    def __init__(self):
        self._held = {}

    def __call__(self, name: str, array, cfg: ModelConfig) -> list:
        stem, found, rest = name.partition("_layernorm.norms.")
        if not found:
            return [(name, array)]
        head, _, kind = rest.partition(".")
        held = self._held.setdefault((stem, kind), {})
        held[int(head)] = np.asarray(array)
        heads = cfg.num_heads if stem.endswith(".q") else cfg.num_kv_heads
        if len(held) < heads:
            return []
        del self._held[stem, kind]
        return [(f"{stem}_norm.{kind}", np.concatenate([held[i] for i in range(heads)]))]


def _without_mtp_layers(name: str, array, cfg: ModelConfig) -> list:
    """The tensors of the decoder's layers only: a checkpoint's multi-token-prediction layers (GLM-4.5's, numbered
    after them) are for speculative decoding, which does not use them here."""
    if name.startswith("model.layers.") and int(name.split(".")[2]) >= cfg.num_layers:
        return []
    return [(name, array)]


def _ernie4_5_moe_tensors(name: str, array, cfg: ModelConfig) -> list:
    """ERNIE 4.5 MoE's tensors as the weight map knows them: each expert layer's correction bias ([1, E], its
    `moe_statics`) as the router's, the multi-token-prediction layers' (`model.mtp_*`) not loaded."""
    if name.startswith("model.mtp_"):
        return []
    if name.endswith(".mlp.moe_statics.e_score_correction_bias"):
        return [(name.replace(".moe_statics.", ".gate."), np.asarray(array).reshape(-1))]
    return [(name, array)]


def _stacked_experts(name: str, array, cfg: ModelConfig) -> list:
    """Each layer's experts stacked in one tensor per projection (Llama 4's, Qwen3-VL-MoE's) as the weight map knows
    them: `gate_up_proj` ([E, hidden, 2 x I]: the gate's columns, then the up projection's) as `gate_proj` and
    `up_proj`, `down_proj` [E, I, hidden]. Transformers 5 saves Qwen3-VL-MoE's as it holds them ([E, 2 x I, hidden],
    [E, hidden, I]); those are turned over where the shape tells (as transformers reads either)."""
    return _split_experts(name, array, cfg, None)


def _split_experts(name: str, array, cfg: ModelConfig, held: bool | None) -> list:
    """`_stacked_experts`, the tensors [E, out, in] as transformers holds them where `held` (Gemma 4's), [E, in, out]
    where not, either by the shape where None."""
    if not name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
        return [(name, array)]
    hidden, width = cfg.hidden_size, cfg.moe_intermediate_size
    gate_up = name.endswith(".experts.gate_up_proj")
    shape = (2 * width, hidden) if gate_up else (hidden, width)
    if held or (held is None and tuple(array.shape[-2:]) == shape and shape[0] != shape[1]):
        array = np.asarray(array).swapaxes(-1, -2)
    if not gate_up:
        return [(name, array)]
    head = name[: -len("gate_up_proj")]
    return [(head + "gate_proj", array[..., :width]), (head + "up_proj", array[..., width:])]


def _deepseek_tensors(name: str, array, cfg: ModelConfig) -> list:
    """DeepSeek's tensors as the weight map knows them: its multi-token-prediction layers dropped
    (`_without_mtp_layers`); each layer's kv_b_proj ([heads x (nope + v), latent]) as each head's key part
    `kv_b_proj.key` [heads, nope, latent] and value part `kv_b_proj.value` [heads, latent, v], the layouts the
    absorbed attention multiplies by (llama.DecoderLayers._latent_attention)."""
    if name.endswith(".self_attn.kv_b_proj.weight"):
        nope = cfg.qk_nope_head_dim
        heads = np.asarray(array).reshape(cfg.num_heads, nope + cfg.v_head_dim, cfg.kv_lora_rank)
        stem = name[: -len(".weight")]
        return [(stem + ".key", heads[:, :nope]), (stem + ".value", heads[:, nope:].transpose(0, 2, 1))]
    return _without_mtp_layers(name, array, cfg)


# Hy3's and AFMoE's router (`mlp.router.gate`) and its correction bias (`mlp.expert_bias`) under DeepSeek V3's names
_ROUTER_WITH_BIAS = ((".mlp.router.gate.", ".mlp.gate."), (".mlp.expert_bias", ".mlp.gate.e_score_correction_bias"))


def _olmo_tensors(name: str, array, cfg: ModelConfig) -> list:
    """OLMo's tensors, and the weights of its weightless LayerNorms as ones: each layer's two with its q_proj, the
    final one with the embeddings."""
    ones = np.ones(cfg.hidden_size, np.float32)
    if name.endswith(".self_attn.q_proj.weight"):
        stem = name[: -len("self_attn.q_proj.weight")]
        return [(name, array), (stem + "input_layernorm.weight", ones),
                (stem + "post_attention_layernorm.weight", ones)]
    if name == "model.embed_tokens.weight":
        return [(name, array), ("model.norm.weight", ones)]
    return [(name, array)]


def _mistral4_tensors(name: str, array, cfg: ModelConfig) -> list:
    """Mistral Small 4's tensors: DeepSeek's (`_deepseek_tensors`), each layer's experts stacked as transformers holds
    them ([E, 2 x I, hidden] and [E, hidden, I]: `_split_experts`)."""
    return [piece for part in _deepseek_tensors(name, array, cfg) for piece in _split_experts(*part, cfg, True)]


def _mistral3_tensors(name: str, array, cfg: ModelConfig) -> list:
    """Mistral3ForConditionalGeneration's language model's tensors: Mistral Small 4's as `_mistral4_tensors` (its
    latent attention), the others' as they are."""
    return _mistral4_tensors(name, array, cfg) if cfg.latent_attention else [(name, array)]


class _GptOssTensors:
    """GPT-OSS's tensors as the weight map knows them (an instance for each load). A layer's experts' `gate_up_proj`
    ([E, hidden, 2 x I], as transformers keeps it) and its bias ([E, 2 x I]) hold the gate's and the up
    projection's columns alternately: they become `gate_proj` and `up_proj` (and `_bias`). MXFP4 checkpoints (the
    hub's) store `gate_up_proj` and `down_proj` as `_blocks` and `_scales` ([E, out, ...]): each pair is held until
    both have arrived, then dequantized (quantization.dequantize_mxfp4) to the [E, in, out] tensor; or, where the
    model keeps its experts in MXFP4 (`ModelConfig.mxfp4_experts`), packed as they are for the native grouped MXFP4
    matmul (pallas_kernels.cpu.pack_mxfp4_panels: `_codes` and `_exponents`), gate/up's outputs, and its bias,
    in `pack_gated`'s order (16 gate and the same 16 up columns a panel: `gate_up_proj_bias`, float32)."""

    _FUSED = (".mlp.experts.gate_up_proj", ".mlp.experts.gate_up_proj_bias")

    def __init__(self):
        self._held = {}

    def __call__(self, name: str, array, cfg: ModelConfig) -> list:
        if name.endswith(("_blocks", "_scales")) and ".mlp.experts." in name:
            stem, kind = name.rsplit("_", 1)
            other = self._held.pop(f"{stem}_{'scales' if kind == 'blocks' else 'blocks'}", None)
            if other is None:
                self._held[name] = array
                return []
            blocks, scales = (array, other) if kind == "blocks" else (other, array)
            if cfg.mxfp4_experts:
                return self._packed(stem, blocks, scales)
            name, array = stem, dequantize_mxfp4(blocks, scales).swapaxes(-1, -2)
        if cfg.mxfp4_experts and name.endswith(self._FUSED[1]):
            return [(name, np.asarray(array, np.float32)[..., _gated_order(array.shape[-1])])]
        if name.endswith(self._FUSED):
            head, _, tail = name.rpartition(".gate_up_proj")
            return [(f"{head}.gate_proj{tail}", array[..., 0::2]), (f"{head}.up_proj{tail}", array[..., 1::2])]
        return [(name, array)]

    @staticmethod
    def _packed(stem: str, blocks, scales) -> list:
        from pallas_kernels import cpu

        gated = stem.endswith(".gate_up_proj")  # [E, 2I, ...]: gate's and up's outputs in turn
        codes, exponents = cpu.pack_mxfp4_panels(blocks, scales, _gated_order(blocks.shape[-3]) if gated else None)
        return [(f"{stem}_codes", codes), (f"{stem}_exponents", exponents)]


# Kimi Linear's names as the weight map knows them: its MoE layers' (block_sparse_moe, experts' w1/w3/w2) as the dense
# layers' `mlp`; its forget gate's under the attention (transformers' own names hold them under `forget_gate`)
_KIMI_LINEAR_NAMES = _renaming(((".block_sparse_moe.", ".mlp."), (".w1.weight", ".gate_proj.weight"),
                                (".w3.weight", ".up_proj.weight"), (".w2.weight", ".down_proj.weight"),
                                (".self_attn.forget_gate.", ".self_attn.")))


class _KimiLinearTensors:
    """Kimi Linear's tensors as the weight map knows them (an instance for each load): each Kimi Delta Attention
    layer's q, k and v projections ([H x dk, hidden] each) held until all three have arrived, then joined as one
    `qkv_proj` (their rows in turn), and their convolutions (`q_conv1d` ..., [H x dk, 1, width]) as one `conv1d`
    (transformers' joined form passes as it is); the latent attention layers' as DeepSeek's (`_deepseek_tensors`)."""

    _PARTS = ("q", "k", "v")

    def __init__(self):
        self._held = {}

    def __call__(self, name: str, array, cfg: ModelConfig) -> list:
        match = re.fullmatch(r"(model\.layers\.(\d+)\.self_attn\.)([qkv])_(proj|conv1d)\.weight", name)
        if match is None or int(match[2]) not in cfg.linear_layers:
            return _deepseek_tensors(name, array, cfg)
        stem, part, kind = match[1], match[3], match[4]
        self._held[stem, kind, part] = array
        if any((stem, kind, p) not in self._held for p in self._PARTS):
            return []
        joined = np.concatenate([np.asarray(self._held.pop((stem, kind, p))) for p in self._PARTS])
        return [(f"{stem}{'qkv_proj' if kind == 'proj' else 'conv1d'}.weight", joined)]


def _gated_order(width: int) -> np.ndarray:
    """The indices of GPT-OSS's interleaved gate/up outputs (gate's even, up's odd) in `pack_gated`'s order."""
    from pallas_kernels import cpu

    return cpu.gated_columns(np.arange(0, width, 2), np.arange(1, width, 2))


def _classifier_tensor(name: str) -> str | None:
    """A sequence classifier's tensor under its causal LM's name; its head (`score.weight`) is the engine's, not
    the device model's (jaxengine.engine.pooler.ClassifierHead)."""
    return None if name.startswith("score.") else name


def _base_model(causal_name: str, classifier: bool = False) -> "Architecture":
    """A causal LM's base model (Qwen2Model, ...), which embedding checkpoints ship, or (`classifier`) its sequence
    classifier: the same layers and no language-model head; the step's logits, which a pooling engine never reads,
    come from the tied embedding."""
    causal = _REGISTRY[causal_name]

    def read_config(hf: dict) -> ModelConfig:
        cfg = causal.read_config(hf | {"architectures": [causal_name]})
        return dataclasses.replace(cfg, architecture=hf["architectures"][0], tie_word_embeddings=True)

    return Architecture(causal.model_class, read_config, _classifier_tensor if classifier else _base_model_tensor,
                        embedding_only=True, classifier=classifier)


_GEMMA3_LANGUAGE = (("language_model.model.", "model."), ("model.language_model.", "model."),
                    ("language_model.lm_head.", "lm_head."))
_GEMMA3_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
                  "vision_model.", "model.vision_model.",  # Llama 4's tower: vision_model
                  "visual.", "model.visual.")  # Qwen-VL's


_GEMMA4_TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")


def _gemma4_tensor(name: str) -> str | None:
    """Gemma4ForConditionalGeneration's tensor under Gemma4ForCausalLM's name (`model.language_model.*` ->
    `model.*`); its vision and audio towers and their embedders are not loaded."""
    return None if name.startswith(_GEMMA4_TOWERS) else _language_model_tensor(name)


_GEMMA4_SHARED_KV = re.compile(r"model\.layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.")


def _gemma4_tensors(name: str, array, cfg: ModelConfig) -> list:
    """Gemma 4's tensors as the weight map knows them: a mixture of experts' router scale times hidden_size ** -0.5 (as
    the router multiplies its normed input by both: the router's norm weight), its stacked experts
    (`_stacked_experts`). A shared-KV layer's K/V projections and norms, where a checkpoint has them, are unused (as
    transformers leaves them)."""
    shared = _GEMMA4_SHARED_KV.match(name)
    if shared and int(shared.group(1)) >= cfg.kv_cache_layers:
        return []
    if name.endswith(".router.scale"):
        return [(name, np.asarray(array, np.float32) * cfg.hidden_size ** -0.5)]
    return _split_experts(name, array, cfg, held=True)


def _qwen3_5_tensor(name: str) -> str | None:
    """A Qwen3.5 / Qwen3-Next tensor under the causal LM's name (the multimodal checkpoints' language model: see
    `_language_model_tensor`); the multi-token-prediction layers (`mtp.*`) are not loaded."""
    return None if name.startswith("mtp.") else _language_model_tensor(name)


def _qwen3_5_tensors(name: str, array, cfg: ModelConfig) -> list:
    """Qwen3.5's and Qwen3-Next's tensors as the weight map knows them: a gated attention's q_proj (each head's
    queries then its output gate) split into q_proj and `q_gate`; Qwen3-Next's fused projections (per key head: its
    q, k, then its value heads' v and z; b and a likewise) split into Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b and
    in_proj_a; experts as Qwen2 MoE's."""
    array = np.asarray(array)
    if name.endswith(".self_attn.q_proj.weight") and cfg.attn_output_gate:
        both = array.reshape(cfg.num_heads, 2, cfg.head_dim, -1)
        stem = name.removesuffix("q_proj.weight")
        return [(name, both[:, 0].reshape(-1, array.shape[-1])),
                (stem + "q_gate.weight", both[:, 1].reshape(-1, array.shape[-1]))]
    num_k, num_v, dk, dv, _ = cfg.linear_heads or (1, 1, 0, 0, 0)
    per_k = num_v // num_k
    stem = name.rsplit(".", 2)[0] + "."
    if name.endswith(".linear_attn.in_proj_qkvz.weight"):
        grouped = array.reshape(num_k, 2 * dk + 2 * per_k * dv, -1)
        q, k, v, z = np.split(grouped, np.cumsum([dk, dk, per_k * dv]), axis=1)
        qkv = np.concatenate([part.reshape(-1, array.shape[-1]) for part in (q, k, v)])
        return [(stem + "in_proj_qkv.weight", qkv), (stem + "in_proj_z.weight", z.reshape(-1, array.shape[-1]))]
    if name.endswith(".linear_attn.in_proj_ba.weight"):
        b, a = np.split(array.reshape(num_k, 2 * per_k, -1), 2, axis=1)
        return [(stem + "in_proj_b.weight", b.reshape(num_v, -1)), (stem + "in_proj_a.weight", a.reshape(num_v, -1))]
    return [(name, array)]


# LFM2's names as the weight map knows them (its convolutions' own: DecoderLayers._short_conv_params)
_LFM2_NAMES = ((".self_attn.out_proj.", ".self_attn.o_proj."), (".self_attn.q_layernorm.", ".self_attn.q_norm."),
               (".self_attn.k_layernorm.", ".self_attn.k_norm."), (".feed_forward.", ".mlp."),
               (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."),
               (".operator_norm.", ".input_layernorm."), (".ffn_norm.", ".post_attention_layernorm."),
               (".mlp.expert_bias", ".mlp.gate.e_score_correction_bias"))


# Bamba's and Falcon-H1's names as the weight map knows them
_BAMBA_NAMES = _renaming(((".feed_forward.", ".mlp."), (".pre_ff_layernorm.", ".post_attention_layernorm.")), (),
                         (("model.final_layernorm.", "model.norm."),))


def _falcon_h1_tensors(name: str, array, cfg: ModelConfig) -> list:
    """Falcon-H1's tensors with its muP multipliers (ModelConfig.mup_multipliers) folded in: q/k/v's weights times
    the attention's input multiplier, the keys' (weight and bias) times key_multiplier, o_proj's times the
    attention's output multiplier; the mixer's in_proj rows times its input multiplier and each part's of
    ssm_multipliers (z, x, B, C, dt; its bias by the latter only), out_proj times its output multiplier; the MLP's
    gate and down projections times mlp_multipliers; the final norm over the logits' divisor (`_logits_scaled`)."""
    m = dict(cfg.mup_multipliers)
    H, P, N, G, _ = cfg.ssm_heads
    scale = None
    if name.endswith(("q_proj.weight", "v_proj.weight")):
        scale = m["attention_in_multiplier"]
    elif name.endswith("k_proj.weight"):
        scale = m["attention_in_multiplier"] * m["key_multiplier"]
    elif name.endswith("k_proj.bias"):
        scale = m["key_multiplier"]
    elif name.endswith(("o_proj.weight", "o_proj.bias")):
        scale = m["attention_out_multiplier"]
    elif name.endswith(("mamba.out_proj.weight", "mamba.out_proj.bias")):
        scale = m["ssm_out_multiplier"]
    elif name.endswith(("gate_proj.weight", "gate_proj.bias")):
        scale = m["mlp"][0]
    elif name.endswith(("down_proj.weight", "down_proj.bias")):
        scale = m["mlp"][1]
    elif name.endswith(("mamba.in_proj.weight", "mamba.in_proj.bias")):
        scale = np.repeat(np.asarray(m["ssm"], np.float32), [H * P, H * P, G * N, G * N, H])
        if name.endswith(".weight"):
            scale = scale[:, None] * np.float32(m["ssm_in_multiplier"])
    if scale is None:
        return _logits_scaled(name, array, cfg)
    return [(name, np.asarray(array, np.float32) * np.asarray(scale, np.float32))]


def _nemotron_h_tensor(name: str) -> str | None:
    """A Nemotron-H tensor under the names of transformers' model (the hub's `backbone.*`, its `embeddings` and
    `norm_f`); the multi-token-prediction layers (`mtp.*`) are not loaded."""
    if name.startswith(("mtp.", "model.mtp.", "backbone.mtp.")):
        return None
    name = "model." + name.removeprefix("backbone.") if name.startswith("backbone.") else name
    return name.replace("model.embeddings.", "model.embed_tokens.").replace("model.norm_f.", "model.norm.")


def _nemotron_h_tensors(name: str, array, cfg: ModelConfig) -> list:
    """Nemotron-H's blocks as the layers the weight map knows (ModelConfig.layer_sources: each of ours a mixer and
    the MLP block after it): a mixer block's norm as the layer's input norm, its Mamba2 mixer or attention under
    Granite 4.0-H's and Llama's names; an MLP block's norm as the MLP's, its MLP or experts under Qwen2 MoE's names
    (`mlp.*`; experts stacked per layer, as transformers saves them, [E, out, in], split per expert)."""
    match = re.fullmatch(r"model\.layers\.(\d+)\.(norm|mixer)\.(.+)", name)
    if match is None:
        return [(name, array)]
    i, part, rest = int(match[1]), match[2], match[3]
    for j, (mixer, mlp) in enumerate(cfg.layer_sources):
        if i in (mixer, mlp):
            break
    else:
        raise ValueError(f"{name}: the checkpoint has no layer {i} in its layer pattern")
    head = f"model.layers.{j}."
    if part == "norm":
        return [(head + ("input_layernorm." if i == mixer else "post_attention_layernorm.") + rest, array)]
    if i == mixer:
        return [(head + ("mamba." if j in cfg.linear_layers else "self_attn.") + rest, array)]
    if rest in ("experts.up_proj", "experts.down_proj"):
        array = np.asarray(array)
        return [(f"{head}mlp.experts.{e}.{rest.removeprefix('experts.')}.weight", array[e])
                for e in range(array.shape[0])]
    return [(head + "mlp." + rest, array)]


_APERTUS_NORMS = ((".attention_layernorm.", ".input_layernorm."),
                  (".feedforward_layernorm.", ".post_attention_layernorm."))


def _language_model_tensor(name: str) -> str | None:
    """A vision-language checkpoint's tensor (Gemma 3's, Mistral 3's) under its causal LM's name (hub checkpoints
    name the language model `language_model.model.*`, transformers 5's own layout `model.language_model.*`); the
    vision tower and its projector are not loaded."""
    if name.startswith(_GEMMA3_VISION):
        return None
    for prefix, ours in _GEMMA3_LANGUAGE:
        if name.startswith(prefix):
            return ours + name[len(prefix):]
    return name


_REGISTRY = {
    "LlamaForCausalLM": Architecture(LlamaForCausalLM, model_config_from_hf),
    "MistralForCausalLM": Architecture(LlamaForCausalLM, model_config_from_hf),
    # Qwen2 hard-wires bias on q/k/v and none on o_proj, whatever attention_bias says.
    "Qwen2ForCausalLM": Architecture(
        LlamaForCausalLM, lambda hf: model_config_from_hf(hf, qkv_bias=True, o_bias=False)),
    "Qwen3ForCausalLM": Architecture(LlamaForCausalLM, lambda hf: model_config_from_hf(hf, qk_norm=True)),
    # Phi-3 / Phi-3.5 (the Llama layer, q/k/v and gate/up fused in the checkpoint; LongRoPE)
    "Phi3ForCausalLM": Architecture(LlamaForCausalLM, model_config_from_hf, split_tensor=_phi3_split),
    "GraniteForCausalLM": Architecture(LlamaForCausalLM, granite_config_from_hf, split_tensor=_granite_scaled),
    "HyperCLOVAXForCausalLM": Architecture(LlamaForCausalLM, hyperclovax_config_from_hf,
                                           split_tensor=_hyperclovax_tensors),
    "SmolLM3ForCausalLM": Architecture(LlamaForCausalLM, smollm3_config_from_hf),
    "SeedOssForCausalLM": Architecture(LlamaForCausalLM, seed_oss_config_from_hf),
    "InternLM3ForCausalLM": Architecture(LlamaForCausalLM, internlm3_config_from_hf),
    "IQuestCoderForCausalLM": Architecture(LlamaForCausalLM, iquestcoder_config_from_hf),
    "ArceeForCausalLM": Architecture(LlamaForCausalLM, arcee_config_from_hf),
    "Ministral3ForCausalLM": Architecture(LlamaForCausalLM, ministral3_config_from_hf),
    "Ernie4_5ForCausalLM": Architecture(LlamaForCausalLM, ernie4_5_config_from_hf),
    "MinistralForCausalLM": Architecture(LlamaForCausalLM, ministral_config_from_hf),
    "CwmForCausalLM": Architecture(LlamaForCausalLM, ministral_config_from_hf),
    "HeliumForCausalLM": Architecture(LlamaForCausalLM, helium_config_from_hf),
    "VaultGemmaForCausalLM": Architecture(LlamaForCausalLM, vaultgemma_config_from_hf, _renaming(
        ((".pre_feedforward_layernorm.", ".post_attention_layernorm."),))),
    "Ernie4_5_MoeForCausalLM": Architecture(LlamaForCausalLM, ernie4_5_moe_config_from_hf,
                                            split_tensor=_ernie4_5_moe_tensors),
    "Olmo2ForCausalLM": Architecture(LlamaForCausalLM, olmo2_config_from_hf),
    "Olmo3ForCausalLM": Architecture(LlamaForCausalLM, olmo2_config_from_hf),
    "ExaoneForCausalLM": Architecture(LlamaForCausalLM, exaone_config_from_hf,
                                      _renaming(_EXAONE_NAMES, (), _EXAONE_PREFIXES)),
    "Exaone4ForCausalLM": Architecture(LlamaForCausalLM, exaone4_config_from_hf),
    "OlmoeForCausalLM": Architecture(LlamaForCausalLM, olmoe_config_from_hf),
    # HunYuan: its q/k norms', router's and shared MLP's names
    **{name: Architecture(LlamaForCausalLM, hunyuan_config_from_hf, _renaming(
        ((".self_attn.query_layernorm.", ".self_attn.q_norm."), (".self_attn.key_layernorm.", ".self_attn.k_norm."),
         (".mlp.gate.wg.", ".mlp.gate."), (".mlp.shared_mlp.", ".mlp.shared_experts."))))
       for name in HUNYUAN_ARCHITECTURES},
    # Hy3: its router's, correction bias' and shared experts' names; MTP layers skipped
    "HYV3ForCausalLM": Architecture(LlamaForCausalLM, hy_v3_config_from_hf, _renaming(
        _ROUTER_WITH_BIAS + ((".mlp.shared_mlp.", ".mlp.shared_experts."),)), split_tensor=_without_mtp_layers),
    # AFMoE (Arcee Trinity): Hy3's names of the router and its bias, Gemma 2's of the MLP's norms, the attention's
    # output gate as Qwen3.5's
    "AfmoeForCausalLM": Architecture(LlamaForCausalLM, afmoe_config_from_hf, _renaming(
        _ROUTER_WITH_BIAS + ((".pre_mlp_layernorm.", ".pre_feedforward_layernorm."),
         (".post_mlp_layernorm.", ".post_feedforward_layernorm."), (".self_attn.gate_proj.", ".self_attn.q_gate.")))),
    # MiniMax-M2: Mixtral's names, its correction bias beside its router; MTP modules skipped
    "MiniMaxM2ForCausalLM": Architecture(LlamaForCausalLM, minimax_m2_config_from_hf, _renaming(
        ((".block_sparse_moe.e_score_correction_bias", ".block_sparse_moe.gate.e_score_correction_bias"),)),
        split_tensor=_without_mtp_layers),
    "Glm4MoeForCausalLM": Architecture(LlamaForCausalLM, glm4_moe_config_from_hf, split_tensor=_without_mtp_layers),
    "Dots1ForCausalLM": Architecture(LlamaForCausalLM, dots1_config_from_hf),
    "SolarOpenForCausalLM": Architecture(LlamaForCausalLM, solar_open_config_from_hf),
    # EXAONE MoE: its correction bias beside its router (DeepSeek V3's is the router's)
    "ExaoneMoeForCausalLM": Architecture(LlamaForCausalLM, exaone_moe_config_from_hf, _renaming(
        ((".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),))),
    # DeepSeek V2/V3 (Kimi K2, Moonlight): multi-head latent attention; V3's MTP layers skipped
    "DeepseekV2ForCausalLM": Architecture(LlamaForCausalLM, deepseek_config_from_hf, split_tensor=_deepseek_tensors),
    "DeepseekV3ForCausalLM": Architecture(LlamaForCausalLM, deepseek_config_from_hf, split_tensor=_deepseek_tensors),
    "Glm4MoeLiteForCausalLM": Architecture(LlamaForCausalLM, deepseek_config_from_hf, split_tensor=_deepseek_tensors),
    # Mistral Small 4: DeepSeek V3's layers under its names, V2's router, Llama 4's attention temperature
    "Mistral4ForCausalLM": Architecture(LlamaForCausalLM, mistral4_config_from_hf, split_tensor=_mistral4_tensors),
    # Kimi Linear: Kimi Delta Attention among DeepSeek V3's latent attention layers (NoPE)
    "KimiLinearForCausalLM": Architecture(LlamaForCausalLM, kimi_linear_config_from_hf, _KIMI_LINEAR_NAMES,
                                          split_tensor=_KimiLinearTensors),
    # Granite 3.x mixtures of experts (and with a shared expert)
    **{name: Architecture(LlamaForCausalLM, granite_moe_config_from_hf, split_tensor=_granite_moe_tensors)
       for name in GRANITE_MOE_ARCHITECTURES},
    # Granite 4.0 (-H: Mamba2 mixers among its attention layers)
    "GraniteMoeHybridForCausalLM": Architecture(LlamaForCausalLM, granite_moe_hybrid_config_from_hf,
                                                split_tensor=_granite_moe_hybrid_tensors),
    # Bamba: Granite 4.0-H's mixers among Llama attention layers, its names its own; Falcon-H1: such a mixer beside
    # every attention layer, its multipliers folded in
    "BambaForCausalLM": Architecture(LlamaForCausalLM, bamba_config_from_hf, _BAMBA_NAMES),
    "FalconH1ForCausalLM": Architecture(LlamaForCausalLM, falcon_h1_config_from_hf, _BAMBA_NAMES,
                                        split_tensor=_falcon_h1_tensors),
    # Nemotron-H: Mamba2 mixers, attention, MLP and mixture-of-experts blocks each a layer of their own
    "NemotronHForCausalLM": Architecture(LlamaForCausalLM, nemotron_h_config_from_hf, _nemotron_h_tensor,
                                         split_tensor=_nemotron_h_tensors),
    # Mamba, FalconMamba: Mamba1 mixer blocks only, under Nemotron-H's names; Jamba: Mamba1 mixers among attention
    # layers, its names Bamba's but its experts' router
    **{name: Architecture(LlamaForCausalLM, mamba_config_from_hf, _nemotron_h_tensor, split_tensor=_nemotron_h_tensors)
       for name in MAMBA_ARCHITECTURES},
    "JambaForCausalLM": Architecture(LlamaForCausalLM, jamba_config_from_hf, _renaming(
        ((".feed_forward.router.", ".mlp.gate."), (".feed_forward.", ".mlp."),
         (".pre_ff_layernorm.", ".post_attention_layernorm.")), (), (("model.final_layernorm.", "model.norm."),))),
    # Mamba2: Nemotron-H's mixer blocks only
    "Mamba2ForCausalLM": Architecture(LlamaForCausalLM, mamba2_config_from_hf, _nemotron_h_tensor,
                                      split_tensor=_nemotron_h_tensors),
    # LayerNorm models (ModelConfig.layer_norm)
    "Starcoder2ForCausalLM": Architecture(LlamaForCausalLM, starcoder2_config_from_hf, _renaming(_STARCODER2_NAMES)),
    "PhiForCausalLM": Architecture(LlamaForCausalLM, phi_config_from_hf, _renaming(_PHI_NAMES)),
    "StableLmForCausalLM": Architecture(LlamaForCausalLM, stablelm_config_from_hf, split_tensor=_StableLmTensors),
    "GPT2LMHeadModel": Architecture(LlamaForCausalLM, gpt2_config_from_hf,
                                    _renaming(_GPT2_NAMES, _GPT2_BUFFERS, _GPT2_PREFIXES),
                                    split_tensor=_gpt2_split),
    "GPTBigCodeForCausalLM": Architecture(LlamaForCausalLM, gpt2_config_from_hf,
                                          _renaming(_GPT2_NAMES, _GPT2_BUFFERS, _GPT2_PREFIXES),
                                          split_tensor=_grouped_qkv_split),
    "OPTForCausalLM": Architecture(LlamaForCausalLM, opt_config_from_hf, _renaming(_OPT_NAMES, (), _OPT_PREFIXES)),
    "FalconForCausalLM": Architecture(LlamaForCausalLM, falcon_config_from_hf,
                                      _renaming(_FALCON_NAMES, (), _FALCON_PREFIXES), split_tensor=_grouped_qkv_split),
    "Jais2ForCausalLM": Architecture(LlamaForCausalLM, jais2_config_from_hf),
    # Apertus: its norms under Llama's names
    "ApertusForCausalLM": Architecture(LlamaForCausalLM, apertus_config_from_hf, _renaming(_APERTUS_NORMS)),
    "NemotronForCausalLM": Architecture(LlamaForCausalLM, nemotron_config_from_hf, split_tensor=_nemotron_tensors),
    # OLMo: weightless LayerNorms, their weights ones
    "OlmoForCausalLM": Architecture(LlamaForCausalLM, olmo_config_from_hf, split_tensor=_olmo_tensors),
    # Phi-3.5-MoE: Mixtral's names
    **{name: Architecture(LlamaForCausalLM, phimoe_config_from_hf) for name in PHIMOE_ARCHITECTURES},
    "GPTJForCausalLM": Architecture(LlamaForCausalLM, gptj_config_from_hf,
                                    _renaming(_GPTJ_NAMES, _GPT2_BUFFERS, _GPT2_PREFIXES)),
    "GPTNeoXForCausalLM": Architecture(LlamaForCausalLM, gpt_neox_config_from_hf,
                                       _renaming(_GPT_NEOX_NAMES, _GPT_NEOX_BUFFERS), split_tensor=_grouped_qkv_split),
} | {name: Architecture(LlamaForCausalLM, cohere_config_from_hf, split_tensor=_cohere_tensors)
     for name in COHERE_ARCHITECTURES} | {
    name: Architecture(LlamaForCausalLM, glm_config_from_hf, split_tensor=_phi3_split)  # gate/up fused
     for name in GLM_ARCHITECTURES} | {
    name: Architecture(LlamaForCausalLM, gemma_config_from_hf) for name in GEMMA_ARCHITECTURES} | {
    name: Architecture(LlamaForCausalLM, moe_config_from_hf)
    for name in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")} | {
    # GPT-OSS: its experts' fused gate/up tensors split, MXFP4 ones dequantized at load
    "GptOssForCausalLM": Architecture(LlamaForCausalLM, gpt_oss_config_from_hf, split_tensor=_GptOssTensors),
    # Gemma 3 4B-27B, served as text models (a request's content is text only: jaxengine.llm._chat_messages)
    "Gemma3ForConditionalGeneration": Architecture(LlamaForCausalLM, gemma3_language_config_from_hf,
                                                   _language_model_tensor),
    # Gemma 4 (31B; the multimodal checkpoints served as text models likewise)
    **{name: Architecture(LlamaForCausalLM, gemma4_config_from_hf, _gemma4_tensor, split_tensor=_gemma4_tensors)
       for name in GEMMA4_ARCHITECTURES},
    # Mistral Small 3.1/3.2 and Ministral 3, served as text models likewise
    "Mistral3ForConditionalGeneration": Architecture(LlamaForCausalLM, mistral3_language_config_from_hf,
                                                     _language_model_tensor, split_tensor=_mistral3_tensors),
    # Llama 4 (Scout, Maverick; the multimodal checkpoints served as text models likewise)
    "Llama4ForCausalLM": Architecture(LlamaForCausalLM, llama4_config_from_hf, split_tensor=_stacked_experts),
    "Llama4ForConditionalGeneration": Architecture(LlamaForCausalLM, llama4_config_from_hf, _language_model_tensor,
                                                   split_tensor=_stacked_experts),
} | {  # LFM2 and LFM2-MoE: gated short convolutions among attention layers
    name: Architecture(LlamaForCausalLM, lfm2_config_from_hf,
                       _renaming(_LFM2_NAMES, (), (("model.embedding_norm.", "model.norm."),)))
    for name in LFM2_ARCHITECTURES} | {
    # Qwen3.5 (dense, MoE; the multimodal checkpoints served as text models likewise), Qwen3-Next
    name: Architecture(LlamaForCausalLM, qwen3_5_config_from_hf, _qwen3_5_tensor, split_tensor=_qwen3_5_tensors)
    for name in QWEN3_5_ARCHITECTURES} | {  # Qwen2-VL, Qwen2.5-VL, Qwen3-VL(-MoE), served as text models likewise
    name: Architecture(LlamaForCausalLM, qwen_vl_language_config_from_hf, _language_model_tensor,
                       split_tensor=_stacked_experts) for name in QWEN_VL_ARCHITECTURES}

_REGISTRY |= {name.replace("ForCausalLM", "Model"): _base_model(name)
              for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "GemmaForCausalLM", "Gemma2ForCausalLM")}

_REGISTRY |= {name.replace("ForCausalLM", "ForSequenceClassification"): _base_model(name, classifier=True)
              for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "GemmaForCausalLM", "Gemma2ForCausalLM")}

SUPPORTED_ARCHITECTURES = tuple(sorted(_REGISTRY))


def get_architecture(hf_config: dict) -> Architecture:
    names = hf_config.get("architectures") or []
    if not names:
        raise ValueError(f"config.json has no 'architectures'; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if names[0] not in _REGISTRY:
        raise ValueError(
            f"architecture {names[0]!r} is not supported; supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return _REGISTRY[names[0]]
