"""Paged KV writes and the attention dispatch used by every model."""

import functools
import logging

import jax
import jax.numpy as jnp

from jaxengine.config import ATTENTION_BACKENDS
from jaxengine.runner.batch import RaggedBatch
from pallas_kernels.reference import ragged_paged_attention

logger = logging.getLogger(__name__)


def token_slots(batch: RaggedBatch, page_size: int, num_pages: int) -> tuple[jax.Array, jax.Array]:
    """(page, offset) where each token's K/V goes; padded tokens get page `num_pages` (dropped on write)."""
    num_tokens = batch.input_ids.shape[0]
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    req = jnp.minimum(jnp.searchsorted(batch.cu_q_lens[1:], token, side="right"), batch.kv_lens.shape[0] - 1)
    valid = token < batch.cu_q_lens[batch.num_seqs]
    page = batch.block_tables[req, batch.positions // page_size]
    return jnp.where(valid, page, num_pages), batch.positions % page_size  # i32[T], i32[T]


def kv_writer(kv_cache: jax.Array, dtype, backend: str = "auto", one_device: bool = False) -> str:
    """Which body writes K/V of `dtype` into this cache: that of the attention body that reads it ("cpu",
    "tpu"), or an XLA scatter (any other name). On one CPU device (`one_device`: the cache is not sharded, which the
    native writer's one custom call could not be) the native writer also writes for the reference body where it
    builds (every body reads the same layout): inside the layer loop XLA:CPU's scatter of a one-token step copied the
    whole cache around each layer's write (measured: a 16-token batch-1 decode of the shared model over a 0.25 GiB
    float32 cache, 47 s)."""
    name = select_body(backend, kv_cache.shape[-1], kv_cache.shape[2], (dtype, kv_cache.dtype))[0]
    if name == "reference" and one_device and jax.default_backend() == "cpu":
        from pallas_kernels import cpu

        if cpu.available() and cpu.supports(jnp.float32, kv_cache.dtype):
            return "cpu"
    return name


FP8_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)  # the float8 KV caches (kv_cache_dtype fp8, fp8_e5m2)


def to_cache(x: jax.Array, dtype) -> jax.Array:
    """x in the cache's dtype: rounded to nearest even; a float8 cache saturates at its largest finite value (as
    vLLM's fp8 cache writes do: a large K/V value never becomes NaN or infinite)."""
    if jnp.dtype(dtype) in FP8_DTYPES:
        limit = float(jnp.finfo(dtype).max)
        x = jnp.clip(x.astype(jnp.float32), -limit, limit)
    return x.astype(dtype)


def write_kv(
    kv_cache: jax.Array,  # [num_layers, num_pages, page_size, 2 * num_kv_heads, head_dim]
    layer: jax.Array,  # i32[]
    k: jax.Array,  # [T, num_kv_heads, head_dim]
    v: jax.Array,  # [T, num_kv_heads, head_dim]
    slots: tuple[jax.Array, jax.Array],
    backend: str = "auto",
    scales: jax.Array | None = None,  # f32[2]: the KV cache's scales (K's, V's); None: 1
    one_device: bool = False,  # the cache is on one device (kv_writer)
) -> jax.Array:
    """Writes this step's K/V (divided by their scales) into their pages in place (the cache is donated): the
    TPU companion kernel where the TPU attention body runs, the native writer where the native CPU body runs
    (XLA:CPU's scatter converts a whole bfloat16 or float8 cache around each write), otherwise an XLA scatter."""
    num_tokens, num_kv_heads, head_dim = k.shape
    page, offset = slots
    name = kv_writer(kv_cache, k.dtype, backend, one_device)
    if name == "cpu":
        from pallas_kernels import cpu

        interleaved = jnp.stack([k, v], axis=2).reshape(num_tokens, 2 * num_kv_heads, head_dim)
        return cpu.write_kv(kv_cache, layer, interleaved, page, offset, scales)
    if scales is not None:
        k, v = k.astype(jnp.float32) / scales[0], v.astype(jnp.float32) / scales[1]
    interleaved = to_cache(jnp.stack([k, v], axis=2).reshape(num_tokens, 2 * num_kv_heads, head_dim), kv_cache.dtype)
    if name == "tpu":
        from pallas_kernels import tpu

        interpret = {} if jax.default_backend() == "tpu" else {"interpret": _tpu_interpret()}
        pages = jnp.where(page < kv_cache.shape[1], page, -1)
        return tpu.write_kv(kv_cache, layer, interleaved, pages, offset, **interpret)
    return kv_cache.at[layer, page, offset].set(interleaved, mode="drop")


def write_latent(
    kv_cache: jax.Array,  # [num_layers, num_pages, page_size, 1, head_dim]: multi-head latent attention's
    layer: jax.Array,  # i32[]
    rows: jax.Array,  # [T, 1, head_dim]: each token's latent and rotary key
    slots: tuple[jax.Array, jax.Array],
    one_device: bool = False,  # the cache is on one device (kv_writer)
) -> jax.Array:
    """Writes this step's latent KV rows into their pages in place (the cache is donated): on one CPU device the
    native writer where it builds (each row as write_kv writes a K/V row: `kv_writer`), otherwise an XLA scatter."""
    page, offset = slots
    if kv_writer(kv_cache, rows.dtype, "reference", one_device) == "cpu":
        from pallas_kernels import cpu

        return cpu.write_kv(kv_cache, layer, rows.astype(jnp.float32), page, offset)
    return kv_cache.at[layer, page, offset].set(to_cache(rows, kv_cache.dtype), mode="drop")


def latent_attention(
    q: jax.Array,  # [T, num_q_heads, head_dim]: each head's query in the latent's space and its rotary part
    kv_cache: jax.Array,  # [num_layers, num_pages, page_size, 1, head_dim]
    layer: jax.Array,
    batch: RaggedBatch,
    *,
    sm_scale: float,
    value_dim: int,
) -> jax.Array:  # [T, num_q_heads, value_dim]: the attention-weighted latents
    """Multi-head latent attention (DeepSeek V2/V3) in its absorbed form: every query head attends to the one
    cached row per token, which is the key, and whose first `value_dim` dimensions (the latent) are the value.
    The reference body runs it (the native, TPU and GPU bodies read K/V pairs; `reference_body` refuses them)."""
    return ragged_paged_attention(q, kv_cache, layer, batch.kv_lens, batch.block_tables, batch.cu_q_lens,
                                  batch.num_seqs, sm_scale=sm_scale, shared_values=value_dim)


def reference_body(setting: str, what: str) -> str:
    """The attention body of `what` (multi-head latent attention, chunked attention), which only the reference body
    runs, under an attention_backend setting: the reference (an explicit `native` or `pallas` is refused)."""
    if setting not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {setting!r}")
    if setting in ("native", "pallas"):
        raise ValueError(f"attention_backend {setting!r} does not run {what}; use auto or reference")
    return "reference"


def _tpu_interpret():
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams()


def select_body(setting: str, head_dim: int, page_size: int, dtypes=(jnp.float32, jnp.float32)):
    """(name, function) of the attention body for this backend, shape and (q, cache) dtypes.

    `auto`: the Pallas kernel on TPU and GPU; on CPU the native body (pallas_kernels/cpu.py) where it
    builds, else the reference. `native`: the native CPU body, or an error. `pallas`: the kernel for the
    backend; on CPU the TPU body in TPU interpret mode (for testing). A shape or dtype a kernel does not
    support falls back to the reference with a warning."""
    if setting not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {setting!r}")
    backend = jax.default_backend()
    if setting == "native" or (setting == "auto" and backend not in ("tpu", "gpu")):
        from pallas_kernels import cpu

        if setting == "native" and (backend != "cpu" or not cpu.available()):
            raise ValueError("attention_backend 'native' needs the CPU backend and a C++ compiler to build "
                             "pallas_kernels/cpu_attention.cc (see the log for the build error)")
        if backend == "cpu" and cpu.available():
            if cpu.supports(*dtypes):
                return "cpu", cpu.ragged_paged_attention
            _warn_once(f"the native CPU attention takes float32 queries over float32, bfloat16 or float8 pages, not "
                       f"{jnp.dtype(dtypes[0]).name} over {jnp.dtype(dtypes[1]).name}; using the reference "
                       f"attention instead")
        return "reference", ragged_paged_attention
    if setting == "reference":
        return "reference", ragged_paged_attention
    if backend == "gpu":
        from pallas_kernels import gpu as body

        name, kwargs = "gpu", {}
    else:
        from pallas_kernels import tpu as body

        name, kwargs = "tpu", {} if backend == "tpu" else {"interpret": _tpu_interpret()}
    if not body.supports(head_dim, page_size):
        _warn_once(f"the {name} attention kernel does not support head_dim={head_dim}, page_size={page_size}; "
                   f"using the reference attention instead")
        return "reference", ragged_paged_attention
    return name, functools.partial(body.ragged_paged_attention, **kwargs)


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning(message)


def attention(
    q: jax.Array,  # [T, num_q_heads, head_dim]
    kv_cache: jax.Array,
    layer: jax.Array,
    batch: RaggedBatch,
    *,
    sm_scale: float,
    sliding_window: jax.Array | int | None = None,
    soft_cap: float | None = None,
    backend: str = "auto",
    scales: jax.Array | None = None,  # f32[2]: the KV cache's scales (K's, V's) as write_kv took them; None: 1
    sinks: jax.Array | None = None,  # f32[num_q_heads]: each head's sink logit (GPT-OSS); None: none
) -> jax.Array:  # [T, num_q_heads, head_dim]
    """Every body reads the cache's values as they are (a float8 cache's widened exactly: to float32, or to
    bfloat16 in the native body); a scaled cache's K scale is folded into q (q . (k_stored x s_k) = (q x s_k) .
    k_stored, soft cap and mask unchanged) and its V scale into the output (a weighted sum of V rows). A head's
    sink is a logit that joins its scores in the softmax's denominator and weights no value (attention to
    nothing)."""
    _, body = select_body(backend, q.shape[-1], kv_cache.shape[2], (q.dtype, kv_cache.dtype))
    if scales is not None:
        q = (q * scales[0]).astype(q.dtype)
    out = body(q, kv_cache, layer, batch.kv_lens, batch.block_tables, batch.cu_q_lens, batch.num_seqs,
               sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
               **({} if sinks is None else {"sinks": sinks}))
    return out if scales is None else (out * scales[1]).astype(out.dtype)
