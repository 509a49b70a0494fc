"""The one table from logical axes (named by the models) to mesh axes, and the mesh itself.

Mesh axes are ('data', 'model'). Tensor parallelism splits attention heads, KV heads, the MLP's
intermediate dimension and the vocabulary over 'model'; everything else is replicated. A dimension that
does not divide evenly by the 'model' size stays replicated (e.g. an odd vocabulary): correct, just less
memory-efficient. When a model has fewer KV heads than the TP degree, the loader repeats each KV head so
that every device holds exactly the one its query heads read (see `kv_head_repeats`): the attention maths
is unchanged because query head h still meets the copy of its original KV head h // (heads / kv_heads).
"""

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxengine.models.config import ModelConfig

LOGICAL_TO_MESH = {
    "heads": "model",
    "kv_heads": "model",
    "mlp": "model",
    "vocab": "model",
    "embed": None,
    "experts": None,  # every device holds every expert, its share of their intermediate dimension ('mlp')
    "unit": None,  # a projection to one value (Qwen2 MoE's shared expert gate)
    "layers": None,
    "head_dim": None,
    "pages": None,
    "page": None,
    "packed": None,  # the native CPU matmul's packed weight layout (single device only)
    "positions": None,  # learned absolute positions' table (GPT-2, OPT)
    "latent": None,  # multi-head latent attention's latents (replicated, as its KV cache's one row per token)
    "per_layer": None,  # Gemma 4's per-layer inputs' width (replicated; their table is split by vocab)
    "linear": None,  # Gated DeltaNet's projections and convolution (linear attention: one device only)
    "conv": None,  # its convolution's width
    "state": None,  # Mamba1's state size and time-step rank
}


def make_mesh(tensor_parallel_size: int, devices: list | None = None) -> Mesh:
    """A ('data', 'model') mesh over `devices` (one data-parallel replica: data size 1)."""
    devices = devices if devices is not None else jax.devices()[:tensor_parallel_size]
    grid = np.asarray(devices, dtype=object).reshape(1, tensor_parallel_size)
    return Mesh(grid, ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))


def check_layout(cfg: ModelConfig, tensor_parallel_size: int, data_parallel_size: int, num_devices: int) -> None:
    tp, dp = tensor_parallel_size, data_parallel_size
    if tp < 1 or dp < 1:
        raise ValueError(f"tensor_parallel_size ({tp}) and data_parallel_size ({dp}) must be >= 1")
    if tp * dp > num_devices:
        raise ValueError(f"tensor_parallel_size x data_parallel_size = {tp * dp} devices, but only {num_devices} "
                         f"exist; use tp x dp <= {num_devices}")
    if tp > 1 and cfg.linear_layers:
        raise ValueError(f"tensor_parallel_size={tp}: {cfg.architecture}'s linear-attention layers run on one device "
                         f"(tensor parallelism over their state is not supported yet); use tensor_parallel_size=1 "
                         f"(data_parallel_size may be larger)")
    valid = [t for t in range(1, num_devices + 1) if _fits(cfg, t)]
    if not _fits(cfg, tp):
        raise ValueError(f"tensor_parallel_size={tp} does not fit the model: num_attention_heads="
                         f"{cfg.num_heads} and num_key_value_heads={cfg.num_kv_heads} must split evenly "
                         f"(or the KV heads be repeated evenly); sizes that work here: {valid}")


def _fits(cfg: ModelConfig, tp: int) -> bool:
    kv = cfg.num_kv_heads
    # repeated KV heads are the model's one count's (Gemma 4's full-attention layers have their own: not repeated)
    kv_ok = kv % tp == 0 or (tp % kv == 0 and cfg.num_heads % tp == 0 and not cfg.full_attention_heads)
    return cfg.num_heads % tp == 0 and kv_ok


def kv_head_repeats(cfg: ModelConfig, tensor_parallel_size: int) -> int:
    """How many copies of each KV head the sharded model holds (1 unless kv_heads < tp; multi-head latent attention's
    cache row is replicated instead, its query heads split)."""
    kv = cfg.num_kv_heads
    if cfg.latent_attention:
        return 1
    return tensor_parallel_size // kv if kv < tensor_parallel_size else 1


def spec_for(logical_axes: tuple, shape: tuple, mesh: Mesh) -> PartitionSpec:
    axes = []
    for name, size in zip(logical_axes, shape):
        mesh_axis = LOGICAL_TO_MESH[name]
        axes.append(mesh_axis if mesh_axis is not None and size % mesh.shape[mesh_axis] == 0 else None)
    return PartitionSpec(*axes)


def named_sharding(logical_axes: tuple, shape: tuple, mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, spec_for(logical_axes, shape, mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
