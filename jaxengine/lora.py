"""LoRA adapters, as vLLM serves them (`enable_lora`, `LoRARequest`, `--lora-modules`).

An adapter is a PEFT directory (`adapter_config.json`, `adapter_model.safetensors`) of low-rank updates to a base
model's linear layers: W x + scale * B (A x). The engine keeps `max_loras` adapter slots on the device, every slot's
A and B stacked per projection ([layers, slots, in, max_lora_rank] and [layers, slots, max_lora_rank, out], zero
padded, the scale folded into B). A token carries its sequence's slot; each projection adds the masked update of
every slot in two small matmuls (x A_all, masked to the token's slot, then B_all), so a batch mixes the base model
and up to `max_loras` adapters in one compiled program, and loading an adapter into a slot compiles nothing.
A sequence takes a slot when it is scheduled (one holding its adapter, else a free one, loaded from the host) and
gives it back when it finishes or is preempted; a sequence whose adapter finds no slot waits.

Supported: adapters of q/k/v/o and gate/up/down projections of the dense models (Phi-3's fused qkv_proj and
gate_up_proj too: one A, B split by rows; not a mixture of experts), `lora_alpha` / `r` scaling or rsLoRA's `lora_alpha / sqrt(r)`. Refused with their
field: DoRA, biases, `modules_to_save` (whole replaced embeddings or heads), per-module rank or alpha patterns,
`layers_to_transform`.
"""

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from jaxengine.validation import is_integer

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp", "qkv_proj": "self_attn", "gate_up_proj": "mlp"}
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}  # Phi-3's


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """vLLM's: an adapter by name, a positive integer id (the engine's key for it) and its local directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not is_integer(self.lora_int_id) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")


@dataclasses.dataclass
class LoRAAdapter:
    request: LoRARequest
    rank: int
    # projection -> (A f32[layers, in, rank], B f32[layers, rank, out] times the scale), in our layouts
    weights: dict[str, tuple[np.ndarray, np.ndarray]]


def projection_shapes(cfg) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection an adapter may target."""
    D, I = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q_proj": (D, q), "k_proj": (D, kv), "v_proj": (D, kv), "o_proj": (q, D), "gate_proj": (D, I),
            "up_proj": (D, I), "down_proj": (I, D)}


def check_supported(cfg) -> None:
    """LoRA on this model, or a ValueError saying why not."""
    if cfg.latent_attention:
        raise ValueError("enable_lora: LoRA adapters on multi-head latent attention (DeepSeek V2/V3) are not supported "
                         "yet")
    if cfg.num_experts:
        raise ValueError("enable_lora: LoRA adapters on a mixture of experts are not supported yet")
    if cfg.full_attention_heads or cfg.linear_layers:
        kind = "linear-attention layers" if cfg.linear_layers else "layers of two shapes"
        raise ValueError(f"enable_lora: LoRA adapters on {cfg.architecture} ({kind}) are not supported yet")
    if cfg.layer_norm or cfg.mlp_bias or not cfg.gated_mlp:
        kind = ("a LayerNorm model" if cfg.layer_norm else "a model with MLP biases (mlp_bias)" if cfg.mlp_bias
                else "a model with an ungated MLP")
        raise ValueError(f"enable_lora: LoRA adapters on {kind} ({cfg.architecture}) are not supported yet")
    if cfg.quant_act_order:
        raise ValueError("enable_lora: LoRA adapters on a quantized checkpoint in activation order (g_idx) are not "
                         "supported yet")


def load_adapter(request: LoRARequest, cfg, max_rank: int, head_order=None, kv_repeats: int = 1) -> LoRAAdapter:
    """The adapter at request.lora_path for the model `cfg` (the engine's, its KV heads repeated `kv_repeats` times
    for tensor parallelism; `head_order`: the loader's order of each head's q/k dimensions, for a partial rotary
    embedding). A ValueError names what does not fit."""
    from jaxengine.models.safetensors_io import read_safetensors

    where = Path(request.lora_path)
    config_file, tensors_file = where / "adapter_config.json", where / "adapter_model.safetensors"
    if not config_file.is_file():
        raise ValueError(f"lora_path: {request.lora_path!r} has no adapter_config.json (a PEFT LoRA adapter)")
    if not tensors_file.is_file():
        raise ValueError(f"lora_path: {request.lora_path!r} has no adapter_model.safetensors")
    config = json.loads(config_file.read_text())
    name = request.lora_name
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"lora adapter {name!r}: peft_type {config['peft_type']!r} is not LoRA")
    for field, off in (("use_dora", False), ("modules_to_save", None), ("layers_to_transform", None)):
        if config.get(field) not in (off, None, [], {}):
            raise ValueError(f"lora adapter {name!r}: {field}={config[field]!r} is not supported")
    for field in ("rank_pattern", "alpha_pattern"):
        if config.get(field):
            raise ValueError(f"lora adapter {name!r}: {field} (per-module ranks or alphas) is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"lora adapter {name!r}: bias={config['bias']!r} is not supported (only 'none')")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not is_integer(rank) or rank < 1:
        raise ValueError(f"lora adapter {name!r}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"lora adapter {name!r}: rank {rank} is above max_lora_rank={max_rank}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    shapes = projection_shapes(cfg)
    pieces: dict[str, dict[int, dict[str, np.ndarray]]] = {}
    for tensor_name, array in read_safetensors(tensors_file).items():
        parts = tensor_name.split(".")
        # base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}.weight
        try:
            i = parts.index("layers")
            layer, module, proj, which = int(parts[i + 1]), parts[i + 2], parts[i + 3], parts[i + 4]
        except (ValueError, IndexError):
            raise ValueError(f"lora adapter {name!r}: tensor {tensor_name!r} is not a layer's LoRA weight "
                             f"(only {', '.join(TARGETS)} may be adapted)") from None
        if _MODULE.get(proj) != module or which not in ("lora_A", "lora_B"):
            raise ValueError(f"lora adapter {name!r}: tensor {tensor_name!r}: only the LoRA A and B of "
                             f"{', '.join(TARGETS)} are supported")
        if not 0 <= layer < cfg.num_layers:
            raise ValueError(f"lora adapter {name!r}: tensor {tensor_name!r} names layer {layer}; the model has "
                             f"{cfg.num_layers}")
        pieces.setdefault(proj, {}).setdefault(layer, {})[which] = np.asarray(array, np.float32)
    for fused, parts in _FUSED.items():  # one A for the parts, their B's rows one after the other
        if fused not in pieces:
            continue
        if any(part in pieces for part in parts):
            raise ValueError(f"lora adapter {name!r}: both {fused} and its parts {', '.join(parts)} are adapted")
        widths = [shapes[part][1] // (kv_repeats if part in ("k_proj", "v_proj") else 1) for part in parts]
        for layer, ab in pieces.pop(fused).items():
            b = ab.get("lora_B")
            if b is None or b.shape[0] != sum(widths):
                raise ValueError(f"lora adapter {name!r}: layer {layer} {fused} needs lora_B [{sum(widths)}, {rank}], "
                                 f"got {None if b is None else b.shape}")
            for part, rows in zip(parts, np.split(b, np.cumsum(widths)[:-1])):
                pieces.setdefault(part, {})[layer] = {"lora_A": ab.get("lora_A"), "lora_B": rows}
    weights = {}
    for proj, layers in pieces.items():
        n_in, n_out = shapes[proj]
        repeats = kv_repeats if proj in ("k_proj", "v_proj") else 1
        a_all = np.zeros((cfg.num_layers, n_in, rank), np.float32)
        b_all = np.zeros((cfg.num_layers, rank, n_out), np.float32)
        for layer, ab in layers.items():
            a, b = ab.get("lora_A"), ab.get("lora_B")
            checkpoint_out = n_out // repeats
            if a is None or b is None or a.shape != (rank, n_in) or b.shape != (checkpoint_out, rank):
                raise ValueError(f"lora adapter {name!r}: layer {layer} {proj} needs lora_A [{rank}, {n_in}] and "
                                 f"lora_B [{checkpoint_out}, {rank}], got {None if a is None else a.shape} and "
                                 f"{None if b is None else b.shape}")
            if head_order is not None and proj in ("q_proj", "k_proj"):
                heads = b.reshape(-1, len(head_order), rank)
                b = heads[:, head_order].reshape(b.shape)
            if repeats > 1:
                b = np.repeat(b.reshape(-1, cfg.head_dim, rank), repeats, axis=0).reshape(n_out, rank)
            # Granite's residual multiplier, folded into o_proj and down_proj at load: their updates too
            residual = cfg.residual_scale if proj in ("o_proj", "down_proj") else 1.0
            a_all[layer], b_all[layer] = a.T, b.T * (scale * residual)
        weights[proj] = (a_all, b_all)
    if not weights:
        raise ValueError(f"lora adapter {name!r}: adapter_model.safetensors holds no LoRA weights")
    return LoRAAdapter(request, rank, weights)


class LoRASlots:
    """Which adapter each device slot holds and how many running sequences use it. `load(slot, adapter)` puts an
    adapter's weights into a slot (the model runner's)."""

    def __init__(self, num_slots: int, load):
        self.adapters: list[int | None] = [None] * num_slots  # lora_int_id per slot
        self.users = [0] * num_slots
        self.last_used = [0] * num_slots
        self._clock = 0
        self._load = load

    def acquire(self, seq) -> bool:
        """Gives a sequence with an adapter a slot holding it (loading it into a free one), or False where every
        slot is held by other adapters' running sequences."""
        if seq.lora is None or seq.lora_slot is not None:
            return True
        lora_id = seq.lora.request.lora_int_id
        if lora_id in self.adapters:
            slot = self.adapters.index(lora_id)
        else:
            free = [s for s in range(len(self.adapters)) if self.users[s] == 0]
            if not free:
                return False
            slot = min(free, key=lambda s: (self.adapters[s] is not None, self.last_used[s]))  # empty, else LRU
            self._load(slot, seq.lora)
            self.adapters[slot] = lora_id
        self.users[slot] += 1
        self._clock += 1
        self.last_used[slot] = self._clock
        seq.lora_slot = slot
        return True

    def forget(self, lora_int_id: int) -> None:
        """An adapter removed from the engine leaves its slot (a later adapter of the id is loaded anew)."""
        for slot, held in enumerate(self.adapters):
            if held == lora_int_id and self.users[slot] == 0:
                self.adapters[slot] = None

    def release(self, seq) -> None:
        if seq.lora_slot is not None:
            self.users[seq.lora_slot] -= 1
            seq.lora_slot = None
