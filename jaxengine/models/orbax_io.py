"""Orbax checkpoints of converted parameters (`jaxengine convert`), restored straight into a mesh."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.parallel import multihost

MARKER = "jaxengine_checkpoint.json"
_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model")


def is_orbax_checkpoint(model_dir: Path) -> bool:
    return (Path(model_dir) / MARKER).is_file()


def checkpoint_dtype(model_dir: Path) -> str:
    return json.loads((Path(model_dir) / MARKER).read_text())["dtype"]


def save_converted(model, model_dir: Path, output: Path) -> None:
    """Writes the model's parameters (our layout: stacked layers, [in, out] weights) with Orbax, next to the
    config and tokenizer files, so that `--model output` loads it."""
    import orbax.checkpoint as ocp

    if model.layers_unstacked:
        raise ValueError("save_converted writes the stacked layer layout; convert a model from load_model "
                         "before unstack_layers()")
    output = Path(output).absolute()
    if (output / "params").exists():
        raise FileExistsError(f"{output} already holds a converted checkpoint; choose an empty directory")
    output.mkdir(parents=True, exist_ok=True)
    _, state = nnx.split(model)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(output / "params", nnx.to_pure_dict(state))
    checkpointer.wait_until_finished()
    for name in _SIDE_FILES:
        if (Path(model_dir) / name).is_file():
            shutil.copy(Path(model_dir) / name, output / name)
    (output / MARKER).write_text(json.dumps({"format": 1, "dtype": jnp.dtype(model.param_dtype).name}))


def restore(model_dir: Path, flat, targets: dict, shardings: dict, kv_params: set, repeats: int,
            kv_heads: int) -> dict:
    """Restores each parameter into its sharding (KV parameters are read as stored and repeated on device)."""
    import orbax.checkpoint as ocp

    from jaxengine.models.loader import _repeat_kv_heads

    def target(path, var):
        shape = targets[path].shape
        if repeats > 1 and path[-1] in kv_params:
            shape = shape[:-1] + (shape[-1] // repeats,)
            return jax.ShapeDtypeStruct(shape, targets[path].dtype)
        return jax.ShapeDtypeStruct(shape, targets[path].dtype, sharding=shardings.get(path))

    abstract = nnx.to_pure_dict(nnx.from_flat_state([(path, var.replace(target(path, var))) for path, var in flat]))
    restored = ocp.StandardCheckpointer().restore(Path(model_dir).absolute() / "params", abstract)
    out = {}
    for path, _ in flat:
        value = restored
        for key in path:
            value = value[key]
        if repeats > 1 and path[-1] in kv_params:
            value = multihost.put(_repeat_kv_heads(np.asarray(value), kv_heads, repeats), shardings.get(path))
        out[path] = value
    return out
