"""Loads a Hugging Face checkpoint (local directory or hub id) into an abstractly built NNX model."""

import dataclasses
import functools
import json
import logging
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from jaxengine.layers.moe import SWIGLU_OAI
from jaxengine.layers.rope import rotary_layout
from jaxengine.models.config import ModelConfig, read_hf_config
from jaxengine.models.llama import hf_weight_map
from jaxengine.models.registry import Architecture, get_architecture
from jaxengine.models import orbax_io
from jaxengine.models.quantization import WEIGHT_ONLY, check_group_size, parse_quantization, with_quantized
from jaxengine.models.safetensors_io import read_safetensors
from jaxengine.parallel import multihost
from jaxengine.parallel.sharding import kv_head_repeats, named_sharding
from jaxengine.runner.executables import signature

logger = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model", "*.jinja"]
# Buffers some checkpoints carry that the model recomputes.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def resolve_model_dir(model: str | Path, trust_remote_code: bool = False, revision: str | None = None,
                      download_dir: str | None = None) -> Path:
    """A local directory as is; otherwise a hub id (`org/name`) fetched through huggingface_hub: at `revision` (a
    branch, tag or commit; default: main), into `download_dir` (default: the Hugging Face cache), with its Python
    files where `trust_remote_code` (a tokenizer's own class)."""
    path = Path(model).expanduser()
    if path.is_dir():
        if revision is not None or download_dir is not None:
            raise ValueError(f"revision and download_dir apply to a hub id; {str(model)!r} is a local directory")
        return path
    if path.exists() or not re.fullmatch(r"[\w.\-]+/[\w.\-]+", str(model)):
        raise FileNotFoundError(f"model {str(model)!r} is neither a local directory nor a hub id like 'org/name'")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(model), allow_patterns=_HUB_FILES + ["*.py"] * trust_remote_code,
                                      revision=revision, cache_dir=download_dir))
    except Exception as e:
        raise FileNotFoundError(f"could not fetch model {str(model)!r} from the Hugging Face hub: {e}") from e


def resolve_dtypes(dtype: str, cfg: ModelConfig, backend: str | None = None, native_bf16: bool = False):
    """(compute dtype, weight dtype) for a `dtype` setting.

    On accelerators both are the setting, and `auto` is the checkpoint's dtype. On CPU activations are
    always float32: XLA:CPU's bfloat16 element-wise and attention paths measured far slower (the paged
    attention ~45x; the KV cache's own dtype is the engine's choice, `LLMEngine._kv_cache_dtype`). Weights
    there follow an explicit setting (a bfloat16 matmul casts its input and accumulates in float32). `auto`
    keeps a bfloat16 checkpoint's weights in bfloat16 where the native bfloat16 matmul runs (`native_bf16`: a
    CPU with AVX-512 BF16, see pallas_kernels/cpu_matmul.cc; ~1.5-2x XLA's float32 matmuls at decode row
    counts, half the weight bytes per step; or with AVX2, where a one-row step reads half the bytes and 512-row
    calls run ~1.1-1.2x slower than XLA's float32 dots), and is float32 otherwise, because XLA:CPU's own
    bfloat16 matmuls measured 2-4x slower than float32 ones below ~256 rows."""
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of auto, {', '.join(DTYPES)}")
    if (backend or jax.default_backend()) == "cpu":
        if dtype == "auto":
            return jnp.float32, DTYPES["bfloat16" if cfg.torch_dtype == "bfloat16" and native_bf16 else "float32"]
        return jnp.float32, DTYPES[dtype]
    setting = {"float16": "float16", "bfloat16": "bfloat16"}.get(cfg.torch_dtype, "float32") if dtype == "auto" else dtype
    return DTYPES[setting], DTYPES[setting]


def load_config(model_dir: Path, hf_overrides: dict | None = None) -> tuple[Architecture, ModelConfig]:
    hf = read_hf_config(model_dir, hf_overrides)
    arch = get_architecture(hf)
    cfg = arch.read_config(hf)
    quantization = parse_quantization(hf)
    if quantization is None:
        return arch, cfg
    if cfg.num_experts and quantization.scheme not in WEIGHT_ONLY:
        raise ValueError(f"quantization_config: a mixture of experts quantized in {quantization.scheme} is not "
                         f"supported (weight-only schemes are: W4A16, GPTQ, AWQ, FP8; their experts are dequantized "
                         f"at load)")
    if cfg.latent_attention:
        raise ValueError("quantization_config: quantized multi-head latent attention is not supported")
    # ModelConfig's quantization (the scheme) and quant_* fields (the others)
    cfg = dataclasses.replace(cfg, quantization=quantization.scheme, **{
        f"quant_{field}": value for field, value in quantization._asdict().items() if field != "scheme"})
    check_group_size(cfg)
    return arch, cfg


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / f for f in dict.fromkeys(weight_map.values())]
    elif (model_dir / "model.safetensors").is_file():
        files = [model_dir / "model.safetensors"]
    else:
        raise FileNotFoundError(f"{model_dir} has neither model.safetensors nor model.safetensors.index.json")
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"checkpoint file {f.name} listed in the index is missing from {model_dir}")
    return files


def native_matmul_applies(mesh=None) -> bool:
    """Whether float32 x bfloat16 matmuls can run the native CPU kernel: the CPU backend, one device (the FFI
    call is not partitioned over a mesh) and a CPU with AVX-512 BF16 or AVX2 (cpu.matmul_available)."""
    if jax.default_backend() != "cpu" or (mesh is not None and mesh.devices.size > 1):
        return False
    from pallas_kernels import cpu

    return cpu.matmul_available()


def weight_dtypes(model_dir: Path, cfg: ModelConfig, dtype: str, mesh=None, native_matmul: bool = False):
    """(compute dtype, weight dtype, whether the native CPU matmul takes the weights) of a checkpoint loaded
    with the `dtype` setting (load_model's `native_matmul`: where it may)."""
    if dtype == "auto" and orbax_io.is_orbax_checkpoint(model_dir):
        dtype = orbax_io.checkpoint_dtype(model_dir)
    native = native_matmul and native_matmul_applies(mesh)
    jdtype, param_dtype = resolve_dtypes(dtype, cfg, native_bf16=native)
    return jdtype, param_dtype, native and param_dtype == jnp.bfloat16  # not with an explicit float32


def mxfp4_experts_apply(cfg: ModelConfig) -> bool:
    """Whether an MXFP4 checkpoint's experts can stay MXFP4 on the native CPU matmul (where it runs: the caller's
    to know): its grouped MXFP4 matmul takes gate/up packed together with GPT-OSS's clamped SwiGLU in its epilogue,
    so gpt-oss's constants and an expert width of whole 16-column halves of panels. Otherwise they are dequantized
    at load (registry._GptOssTensors)."""
    from pallas_kernels import cpu

    return (cfg.quant_method == "mxfp4" and cfg.hidden_act == SWIGLU_OAI and cfg.moe_intermediate_size % cpu.GATED == 0
            and (cfg.swiglu_alpha, cfg.swiglu_limit) == cpu.SWIGLU_OAI_CONSTANTS)


def load_model(model: str | Path, dtype: str = "auto", progress: bool = True, mesh=None,
               attention_backend: str = "auto", unstacked: bool = False, native_matmul: bool = False,
               executables=None, hf_overrides: dict | None = None, long_rope: bool = False):
    """Returns (model, ModelConfig). Weights go from memory-mapped safetensors to the device one parameter
    at a time (on a mesh, each device receives only its shard); the model is never initialised with real
    arrays. On a mesh with more devices on 'model' than the model has KV heads, each KV head is repeated
    (the returned config says how many KV heads the sharded model holds). `unstacked`: each layer gets its
    own arrays (`LlamaForCausalLM.unstack_layers`), filled straight from the checkpoint's tensors.
    `native_matmul`: where `native_matmul_applies`, bfloat16 weights are packed for the native CPU matmul
    (and `auto` keeps a bfloat16 checkpoint in bfloat16; `LlamaForCausalLM.pack_for_native_matmul`). For
    serving; a model to convert and save keeps the checkpoint's layout. `executables`: an ExecutableCache
    (jaxengine.runner.executables) that keeps the programs filling stacked layers across starts. `hf_overrides`:
    over config.json's keys (read_hf_config). `long_rope`: a LongRoPE model's long factors at every position
    (RopeConfig.long)."""
    start = time.perf_counter()
    model_dir = resolve_model_dir(model)
    arch, cfg = load_config(model_dir, hf_overrides)
    if long_rope:
        if cfg.rope.rope_type != "longrope":
            raise ValueError(f"long_rope applies to a LongRoPE model, not rope type {cfg.rope.rope_type!r}")
        cfg = dataclasses.replace(cfg, rope=dataclasses.replace(cfg.rope, long=True))
    orbax = orbax_io.is_orbax_checkpoint(model_dir)
    jdtype, param_dtype, native_matmul = weight_dtypes(model_dir, cfg, dtype, mesh, native_matmul)
    if native_matmul and not orbax and mxfp4_experts_apply(cfg):
        cfg = dataclasses.replace(cfg, mxfp4_experts=True)
    repeats = kv_head_repeats(cfg, mesh.shape["model"]) if mesh is not None else 1
    checkpoint_cfg = cfg
    cfg = dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * repeats)

    def build():
        built = arch.model_class(cfg, jdtype, attention_backend, param_dtype=param_dtype,
                                 one_device=mesh is None or mesh.devices.size == 1)
        if unstacked and not orbax:
            built.unstack_layers()
        return built

    abstract = nnx.eval_shape(build)
    graphdef, abstract_state = nnx.split(abstract)
    flat = nnx.to_flat_state(abstract_state)
    targets = {path: var.get_value() for path, var in flat}  # path -> ShapeDtypeStruct
    shardings = {path: named_sharding(var.get_metadata()["logical_axes"], var.get_value().shape, mesh)
                 for path, var in flat} if mesh is not None else {}
    if orbax:
        loaded = orbax_io.restore(model_dir, flat, targets, shardings, _kv_params(cfg), repeats,
                                  checkpoint_cfg.num_kv_heads)
    else:
        # the checkpoint's tensors split by its own shapes (KV heads are repeated after)
        split = arch.split_tensor() if isinstance(arch.split_tensor, type) else arch.split_tensor  # this load's
        split = _with_rotary_layout(with_quantized(split, checkpoint_cfg), checkpoint_cfg)
        loaded = _fill(checkpoint_files(model_dir), hf_weight_map(cfg), targets, shardings, cfg, progress,
                       kv_repeat=(checkpoint_cfg.num_kv_heads, repeats), executables=executables,
                       tensor_name=arch.tensor_name,
                       split_tensor=lambda name, array, _: split(name, array, checkpoint_cfg))
    state = nnx.from_flat_state([(path, var.replace(loaded[path])) for path, var in flat])
    loaded_model = nnx.merge(graphdef, state)
    if unstacked:
        loaded_model.unstack_layers()  # an Orbax checkpoint holds stacked layers; no-op otherwise
    if native_matmul:
        loaded_model.pack_for_native_matmul()
    logger.info("loaded %s (weights %s, compute %s%s%s) from %s (%s) in %.2f s", cfg.architecture,
                jnp.dtype(param_dtype).name, jnp.dtype(jdtype).name,
                ", native bfloat16 matmul" if native_matmul else "", ", MXFP4 experts" if cfg.mxfp4_experts else "",
                model_dir, "orbax" if orbax else "safetensors", time.perf_counter() - start)
    return loaded_model, cfg


_KV_PARAMS = {"k_proj", "v_proj", "k_bias", "v_bias", "k_proj_scale", "v_proj_scale", "k_proj_zero", "v_proj_zero"}


def _kv_params(cfg: ModelConfig) -> set[str]:
    """The parameters laid out by KV head, whose heads are repeated where tensor parallelism repeats them (a whole
    k projection's norm too: OLMo 2's, and one with weights per head: Cohere's, StableLM's)."""
    return _KV_PARAMS | ({"k_norm"} if cfg.qk_norm_whole or cfg.qk_norm_per_head else set())
_ROTATED = re.compile(r".*\.self_attn\.(q_proj|k_proj)\.(weight|weight_scale|weight_zero_point|bias)$"
                      r"|.*\.self_attn\.(q_norm|k_norm)\.(weight|bias)$")


def _with_rotary_layout(split_tensor, cfg: ModelConfig):
    """`split_tensor`, then the layout of each head's q and k dimensions for a partial or interleaved rotary
    embedding (layers.rope.rotary_layout) on the projections, their biases and their norms' weights (a Phi-4-mini
    checkpoint's, in transformers' order: the converted Orbax checkpoint keeps ours)."""
    if cfg.latent_attention:
        return _with_latent_rotary_layout(split_tensor, cfg)
    order = rotary_layout(cfg.head_dim, cfg.rope.rotary_dim(cfg.head_dim), cfg.rope_interleaved)
    if order is None:
        return split_tensor

    def split(name, array, cfg):
        pieces = split_tensor(name, array, cfg)
        return [(n, _reorder_heads(a, order) if _ROTATED.match(n) else a) for n, a in pieces]

    return split


_LATENT_ROTATED = {"q_proj", "q_b_proj", "kv_a_proj_with_mqa"}


def _with_latent_rotary_layout(split_tensor, cfg: ModelConfig):
    """`split_tensor`, then multi-head latent attention's interleaved rotary pairs laid out as half-split ones: the
    rotated dimensions after each head's unrotated ones in the query projection (q_proj or q_b_proj) and after the
    latent in kv_a_proj_with_mqa."""
    rotated = rotary_layout(cfg.qk_rope_head_dim, cfg.qk_rope_head_dim, cfg.rope_interleaved)
    if rotated is None:
        return split_tensor
    orders = {"kv_a_proj_with_mqa": np.concatenate([np.arange(cfg.kv_lora_rank), cfg.kv_lora_rank + rotated])}
    orders["q_proj"] = orders["q_b_proj"] = np.concatenate([np.arange(cfg.qk_nope_head_dim),
                                                            cfg.qk_nope_head_dim + rotated])

    def split(name, array, cfg):
        pieces = []
        for n, a in split_tensor(name, array, cfg):
            projection = n.split(".")[-2] if ".self_attn." in n and n.endswith(".weight") else None
            pieces.append((n, _reorder_heads(a, orders[projection]) if projection in _LATENT_ROTATED else a))
        return pieces

    return split


def _reorder_heads(array, order: np.ndarray) -> np.ndarray:
    """Each head's dimensions of a [heads * head_dim, ...] projection (or a [head_dim] norm) in `order`."""
    array = np.asarray(array)
    head_dim = len(order)
    heads = array.reshape(-1, head_dim, *array.shape[1:])
    return heads[:, order].reshape(array.shape)


def _without_ones(shape: tuple) -> tuple:
    return tuple(d for d in shape if d != 1)


def _repeat_kv_heads(array: np.ndarray, kv_heads: int, repeats: int) -> np.ndarray:
    """[..., kv_heads * head_dim] -> [..., kv_heads * repeats * head_dim], each head copied `repeats` times."""
    *lead, width = array.shape
    heads = array.reshape(*lead, kv_heads, width // kv_heads)
    return np.repeat(heads, repeats, axis=-2).reshape(*lead, width * repeats)


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer(stacked: jax.Array, piece: jax.Array, layer) -> jax.Array:
    """Writes one layer's tensor into the stacked parameter (donated: in place), keeping its sharding."""
    return jax.lax.dynamic_update_index_in_dim(stacked, piece, layer, axis=0)


def _new_stack(piece: jax.Array, layer, *, layers: int) -> jax.Array:
    """A stacked parameter of `layers` layers holding `piece` at `layer`, zeros elsewhere."""
    return jax.lax.dynamic_update_index_in_dim(jnp.zeros((layers, *piece.shape), piece.dtype), piece, layer, 0)


@functools.cache
def _new_stack_program(layers: int, sharding):
    """_new_stack for `layers` layers, its result placed by `sharding` (None: the default device)."""
    return jax.jit(functools.partial(_new_stack, layers=layers), out_shardings=sharding)


class _Stacker:
    """Runs the two small programs that fill stacked parameters layer by layer (a layer's index is traced: one
    program of each per weight shape). Each compiles well under the persistent cache's floor, so JAX's cache
    would not keep them, and at every start: with an executable cache they are stored there and loaded on the
    next start, as the runner's programs are."""

    def __init__(self, executables=None):
        self.executables = executables  # an ExecutableCache (jaxengine.runner.executables), or None
        self._programs = {}

    def new(self, piece: jax.Array, layer: int, layers: int, sharding) -> jax.Array:
        return self._run(f"loader.new_stack[{layers}, {sharding}]", _new_stack_program(layers, sharding), (piece,),
                         layer)

    def set(self, stacked: jax.Array, piece: jax.Array, layer: int) -> jax.Array:
        return self._run("loader.set_layer", _set_layer, (stacked, piece), layer)

    def _run(self, name: str, jitted, arrays: tuple, layer: int):
        layer = np.int32(layer)
        if self.executables is None:
            return jitted(*arrays, layer)
        key = (name, signature(arrays))
        if key not in self._programs:
            self._programs[key] = self.executables.get(f"{name} with a layer i32[]", key[1],
                                                       lambda: jitted.lower(*arrays, layer))
        return self._programs[key](*arrays, layer)


def _layer_sharding(sharding, layer):
    """The sharding of one layer's slice of a stacked parameter (its spec without the leading axis)."""
    if sharding is None or layer is None:
        return sharding
    return NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))


def _fill(files, weight_map, targets, shardings, cfg, progress, kv_repeat, *, tensor_name, executables=None,
          split_tensor=lambda name, array, cfg: [(name, array)]) -> dict:
    """Streams tensors file by file: each goes from the memory map straight to its devices (only its shard
    to each), and per-layer tensors are written into their stacked parameter on device (or become the
    layer's own parameter when the targets are unstacked), so host memory peaks near one tensor (a mixture of
    experts' per-expert tensors gather on the host into the layer's [experts, ...] piece first).
    `tensor_name`: a checkpoint tensor's name in `weight_map` (None: a tensor the model does not use);
    `split_tensor`: the (name, array) pieces of a renamed tensor that `weight_map` knows (a fused projection's)."""
    done, seen, stacker = {}, set(), _Stacker(executables)
    kv_params = _kv_params(cfg)
    expert_slices = {}  # (path, layer) -> {expert: array} until the layer's every expert has arrived
    headers = [read_safetensors(f) for f in files]
    bar = tqdm(total=sum(len(h) for h in headers), desc="Loading weights", unit="tensor", disable=not progress)
    for file, tensors in zip(files, headers):
        for stored_name, stored in tensors.items():
            bar.update(1)
            renamed = tensor_name(stored_name)
            for name, array in split_tensor(renamed, stored, cfg) if renamed is not None else ():
                if name not in weight_map:
                    if _IGNORED.match(name) or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                        continue
                    raise ValueError(f"unexpected tensor {stored_name} in {file.name}: the {cfg.architecture} model "
                                     f"has no such weight")
                if name in seen:
                    raise ValueError(f"tensor {stored_name} appears twice in the checkpoint ({file.name})")
                seen.add(name)
                path, layer, transpose, expert = weight_map[name]
                if layer is not None and path not in targets:  # unstacked: ("layers", n) -> ("layers", i, n)
                    path, layer = (path[0], layer, *path[1:]), None
                target = targets[path]
                expected = tuple(target.shape[1:] if layer is not None else target.shape)
                num_experts, expected = (expected[0], expected[1:]) if expert is not None else (0, expected)
                source = array.T if transpose else array
                kv_heads, repeats = kv_repeat
                if repeats > 1 and path[-1] in kv_params:
                    expected = expected[:-1] + (expected[-1] // repeats,)
                    if source.shape == expected:
                        source = _repeat_kv_heads(np.asarray(source), kv_heads, repeats)
                        expected = source.shape
                if source.shape != expected and _without_ones(source.shape) == _without_ones(expected):
                    # the same values but for axes of size 1: a one-value tensor (transformers' scalar parameters and
                    # buffers: Gemma 4's layer_scalar, Apertus's xIELU alphas) into a per-layer scalar, a depthwise
                    # convolution's [channels, 1, width] (Qwen3.5's, LFM2's, Mamba2's) into [width, channels]
                    source = np.asarray(source).reshape(expected)
                if source.shape != tuple(expected):
                    hf_shape = tuple(reversed(expected)) if transpose else tuple(expected)
                    raise ValueError(f"tensor {stored_name} has shape {tuple(array.shape)}, expected {hf_shape}")
                if expert is not None:
                    slices = expert_slices.setdefault((path, layer), {})
                    slices[expert] = np.asarray(source, dtype=target.dtype)
                    if len(slices) < num_experts:
                        continue
                    source = np.stack([slices.pop(j) for j in range(num_experts)])
                    del expert_slices[(path, layer)]
                sharding = shardings.get(path)
                piece = multihost.put(np.asarray(source, dtype=target.dtype), _layer_sharding(sharding, layer))
                if layer is None:
                    done[path] = piece
                elif path not in done:
                    done[path] = stacker.new(piece, layer, target.shape[0], sharding)
                else:
                    done[path] = stacker.set(done[path], piece, layer)
    bar.close()
    missing = sorted(set(weight_map) - seen)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint is missing tensors: {shown}")
    return done
