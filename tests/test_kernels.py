"""The Pallas bodies (TPU in TPU interpret mode, GPU with interpret=True) against the reference."""

import functools
import logging
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats
from jax.experimental.pallas import tpu as pltpu

from jaxengine import SamplingParams
from jaxengine.config import EngineConfig
from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.layers.attention import FP8_DTYPES, select_body, to_cache
from pallas_kernels import cpu, gpu, tpu
from pallas_kernels.reference import ragged_paged_attention as reference
from tests import tiny_models
from tests.engine_util import random_prompts, run_to_completion
from tests.ragged import ragged_case

NUM_KV_HEADS, NUM_LAYERS = 2, 2
BODIES = {"tpu": lambda *a, **k: tpu.ragged_paged_attention(*a, interpret=pltpu.InterpretParams(), **k),
          "gpu": lambda *a, **k: gpu.ragged_paged_attention(*a, interpret=True, **k)}
FLOAT32_BODIES = {**BODIES, "native": lambda *a, **k: native()(*a, **k)}


def native():
    if not cpu.available():
        pytest.skip("the native CPU attention could not be built here (no C++ compiler?)")
    return cpu.ragged_paged_attention


# (mode, page size, GQA ratio, head_dim, window, soft cap): every value of each axis appears.
CASES = [
    ("decode", 16, 1, 64, None, None), ("prefill", 16, 4, 128, None, None), ("mixed", 64, 8, 64, None, None),
    ("mixed", 16, 4, 64, 24, None), ("decode", 64, 4, 128, 9, 30.0), ("prefill", 64, 1, 64, None, 30.0),
    ("mixed", 16, 8, 128, 40, 50.0), ("decode", 16, 8, 64, None, None),
]


needs_native_matmul = pytest.mark.skipif(not cpu.matmul_available(),
                                         reason="the native bfloat16 matmul needs a CPU with AVX-512 BF16 or AVX2")


@pytest.mark.parametrize("body", FLOAT32_BODIES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_float32_body_matches_reference(body, case):
    mode, page_size, group, head_dim, window, cap = case
    case = ragged_case(len(mode) + page_size + group, mode, page_size, group, head_dim, max_kv_len=90, max_reqs=4,
                       num_kv_heads=NUM_KV_HEADS, num_layers=NUM_LAYERS)
    args, real = case.args, case.num_real_tokens
    kwargs = dict(sm_scale=head_dim ** -0.5, sliding_window=window, soft_cap=cap)
    want = np.asarray(reference(*args, **kwargs))
    got = np.asarray(FLOAT32_BODIES[body](*args, **kwargs))
    np.testing.assert_allclose(got[:real], want[:real], atol=2e-5, rtol=0)
    assert np.all(got[real:] == 0), "padded tokens must stay untouched (zero)"


@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: "-".join(map(str, c)))
def test_bfloat16_body_matches_reference(body, case):
    """Both compute in float32 from the same bf16 inputs and round the output to bf16 once: they may differ
    by one bf16 ulp of the output (2^-8 relative; outputs are averages of unit-scale values, so <= 2^-7)."""
    mode, page_size, group, head_dim, window, cap = case
    case = ragged_case(7 + page_size, mode, page_size, group, head_dim, dtype=jnp.bfloat16, max_kv_len=90,
                       max_reqs=4, num_kv_heads=NUM_KV_HEADS, num_layers=NUM_LAYERS)
    args, real = case.args, case.num_real_tokens
    kwargs = dict(sm_scale=head_dim ** -0.5, sliding_window=window, soft_cap=cap)
    want = np.asarray(reference(*args, **kwargs).astype(jnp.float32))
    got = np.asarray(BODIES[body](*args, **kwargs).astype(jnp.float32))
    np.testing.assert_allclose(got[:real], want[:real], atol=2 ** -7, rtol=2 ** -7)


def check_native_over_bfloat16_pages(case, dtype=jnp.bfloat16, **kwargs):
    """The native body over `case`'s pool rounded to bfloat16 (or `dtype`: float8, which it computes on as
    bfloat16) against the reference over the same pages widened to float32: within a few 2^-9 (see below), and
    zeros for the padding tokens."""
    q, pool, *rest = case.args
    pool = to_cache(pool, dtype)
    want = np.asarray(reference(q, pool.astype(jnp.float32), *rest, **kwargs))
    got = np.asarray(native()(q, pool, *rest, **kwargs))
    real = case.num_real_tokens
    np.testing.assert_allclose(got[:real], want[:real], atol=2 ** -6, rtol=0)
    assert np.abs(got[:real] - want[:real]).mean() < 2 ** -9
    assert np.all(got[real:] == 0)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_native_body_over_bfloat16_pages_matches_reference(case):
    """float32 queries over a bfloat16 pool (the engine's CPU cache for bfloat16 checkpoints), against the
    reference over the same pages widened to float32. Where the CPU has AVX-512 BF16 the native body scores
    with q rounded to bfloat16 (2^-9 relative), as vLLM's bfloat16 CPU attention does: outputs (averages of
    unit-scale values) may then differ by a few 2^-9."""
    mode, page_size, group, head_dim, window, cap = case
    case = ragged_case(3 * page_size + group, mode, page_size, group, head_dim, max_kv_len=90, max_reqs=4,
                       num_kv_heads=NUM_KV_HEADS, num_layers=NUM_LAYERS)
    check_native_over_bfloat16_pages(case, sm_scale=head_dim ** -0.5, sliding_window=window, soft_cap=cap)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("mode, group", [("prefill", 1), ("mixed", 3), ("decode", 8)])
def test_native_body_scores_many_rows_against_transposed_keys(mode, group, head_dim):
    """A kv head with 8 rows or more (a prefill tile's tokens x its query heads; a decode token of a GQA group
    of 8) is scored against its keys transposed once per block, with 1 (head_dim 256), 2 or 4 rows at a time;
    fewer rows (the mixed case's decode tokens of a group of 3) go the other way. Where AVX-512 is missing, these
    rows run with the rows in the vector lanes instead (head_window_lanes: 2 or 1 registers of 8 rows at a
    time, the last one padded). Several windows a request, over bfloat16 pages."""
    case = ragged_case(head_dim + group, mode, 16, group, head_dim, max_kv_len=300, max_reqs=4,
                       num_kv_heads=NUM_KV_HEADS, num_layers=NUM_LAYERS)
    check_native_over_bfloat16_pages(case, sm_scale=head_dim ** -0.5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("q_lens, kv_lens, window", [
    ([1], [1500], None), ([1, 1], [900, 40], None), ([5], [1300], None), ([1], [1500], 700), ([1], [600], None)])
def test_native_body_splits_long_key_ranges_among_workers(q_lens, kv_lens, window, dtype):
    """A call with fewer items than two a worker (a decode step of one or two long requests, a short chunk after
    a long prefix) splits each item's keys into parts of 256 keys or more that workers run side by side, and
    merges the parts' softmax states at the end. The output must be the reference's."""
    rng = np.random.default_rng(sum(kv_lens) + len(q_lens))
    page_size, group, head_dim, n = 16, 4, 64, len(q_lens)
    pages_per_seq = -(-max(kv_lens) // page_size)
    num_pages = pages_per_seq * n + 1
    pool = rng.standard_normal((NUM_LAYERS, num_pages, page_size, 2 * NUM_KV_HEADS, head_dim)).astype(np.float32)
    q = rng.standard_normal((sum(q_lens) + 2, NUM_KV_HEADS * group, head_dim)).astype(np.float32)
    pages = rng.permutation(num_pages)
    tables = np.stack([pages[i * pages_per_seq:(i + 1) * pages_per_seq] for i in range(n)]).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    args = (jnp.asarray(q), to_cache(jnp.asarray(pool), dtype), jnp.int32(1), jnp.asarray(kv_lens, jnp.int32),
            jnp.asarray(tables), jnp.asarray(cu), jnp.int32(n))
    kwargs = dict(sm_scale=head_dim ** -0.5, sliding_window=window)
    want = np.asarray(reference(args[0], args[1].astype(jnp.float32), *args[2:], **kwargs))
    got = np.asarray(native()(*args, **kwargs))
    real = sum(q_lens)
    tol = 1e-5 if dtype == jnp.float32 else 2 ** -6  # float8 pages computed on as bfloat16 ones
    np.testing.assert_allclose(got[:real], want[:real], atol=tol, rtol=0)
    assert np.all(got[real:] == 0)


@pytest.mark.parametrize("mode, window, dtype", [("decode", None, jnp.bfloat16), ("mixed", None, jnp.bfloat16),
                                                 ("decode", 100, jnp.bfloat16), ("mixed", 150, jnp.float8_e5m2)])
def test_native_body_reads_ahead_across_windows_and_items(mode, window, dtype):
    """Long requests over wide rows (8 kv heads x 128 x bfloat16: 4 KB a key, so the native body reads 16 to 64
    keys a window, an eighth of the core's L2; float8 pages widened a window at a time): each request's keys span
    several windows, each prefetched while the previous one is computed on, and each worker prefetches its next
    item's first window. The output must not depend on any of that."""
    case = ragged_case(11, mode, 16, 2, 128, max_kv_len=400, max_reqs=6, num_kv_heads=8, num_layers=2)
    assert max(case.kv_lens) > 3 * 64
    check_native_over_bfloat16_pages(case, dtype, sm_scale=128 ** -0.5, sliding_window=window)


def dense_attention_with_sinks(case, sinks, sm_scale, sliding_window=None):
    """Each real token's attention as transformers' GPT-OSS computes it: its scores (causal, windowed) and its head's
    sink side by side in one softmax, the sink's weight dropped."""
    q = np.asarray(case.args[0], np.float64)
    out = np.zeros(q.shape)
    heads, group = q.shape[1], q.shape[1] // NUM_KV_HEADS
    start = 0
    for r, (q_len, kv_len) in enumerate(zip(case.q_lens, case.kv_lens)):
        k, v = (np.asarray(x, np.float64) for x in case.contiguous_kv(r))
        for t in range(q_len):
            pos = kv_len - q_len + t
            keys = np.arange(kv_len)
            live = (keys <= pos) & ((keys > pos - sliding_window) if sliding_window else True)
            for h in range(heads):
                scores = np.where(live, k[:, h // group] @ q[start + t, h] * sm_scale, -np.inf)
                logits = np.append(scores, sinks[h])
                p = np.exp(logits - logits.max())
                out[start + t, h] = (p[:-1] / p.sum()) @ v[:, h // group]
        start += q_len
    return out


SINK_CASES = [("mixed", 16, 4, 64, None), ("decode", 16, 2, 48, 9), ("prefill", 64, 1, 128, 24)]


@pytest.mark.parametrize("body, case", [(body, case) for case in SINK_CASES for body in ["reference", *FLOAT32_BODIES]
                                        if body not in BODIES or case[3] != 48],  # Pallas: head_dim 64, 128, 256
                         ids=lambda c: c if isinstance(c, str) else "-".join(map(str, c)))
def test_attention_sinks_every_body_matches_the_dense_softmax(body, case):
    """GPT-OSS's sinks: one logit per query head beside its scores in the softmax, weighting no value. Sinks from
    well below the scores to above them (the native body's store rescales to whichever is larger); head_dim 48
    takes the native body's any-width path. Padding tokens stay zero."""
    mode, page_size, group, head_dim, window = case
    case = ragged_case(head_dim + group, mode, page_size, group, head_dim, max_kv_len=90, max_reqs=4,
                       num_kv_heads=NUM_KV_HEADS, num_layers=NUM_LAYERS)
    sinks = np.random.default_rng(group).uniform(-4.0, 6.0, NUM_KV_HEADS * group).astype(np.float32)
    kwargs = dict(sm_scale=head_dim ** -0.5, sliding_window=window)
    want = dense_attention_with_sinks(case, sinks, **kwargs)
    fn = reference if body == "reference" else FLOAT32_BODIES[body]
    got = np.asarray(fn(*case.args, sinks=jnp.asarray(sinks), **kwargs))
    real = case.num_real_tokens
    np.testing.assert_allclose(got[:real], want[:real], atol=2e-5, rtol=0)
    assert np.all(got[real:] == 0)
    assert np.abs(got[:real] - np.asarray(fn(*case.args, **kwargs))[:real]).max() > 0.05  # the sinks count


def test_attention_sinks_through_split_key_ranges_and_bfloat16_pages():
    """The native body's split items (one long decode row, its keys among workers, merged at the end) add the sink
    once, after the merge; over bfloat16 pages too."""
    case = ragged_case(3, "decode", 16, 4, 64, max_kv_len=1400, max_reqs=2, num_kv_heads=NUM_KV_HEADS,
                       num_layers=NUM_LAYERS)
    assert max(case.kv_lens) > 512
    sinks = jnp.asarray(np.linspace(-2.0, 5.0, NUM_KV_HEADS * 4), jnp.float32)
    want = dense_attention_with_sinks(case, np.asarray(sinks), 64 ** -0.5)
    real = case.num_real_tokens
    got = np.asarray(native()(*case.args, sm_scale=64 ** -0.5, sinks=sinks))
    np.testing.assert_allclose(got[:real], want[:real], atol=2e-5, rtol=0)
    check_native_over_bfloat16_pages(case, sm_scale=64 ** -0.5, sinks=sinks)


def bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(f"u{x.dtype.itemsize}")


def kv_rows(rng, shape, dtype) -> np.ndarray:
    """float32 K/V rows of magnitudes 1e-4 to 1e5 (a float8 pool's subnormals and saturation); for a float8 pool
    the first values are the format's exact ties (halfway between neighbours: rounded to the even one)."""
    rows = rng.standard_normal(shape) * 10.0 ** rng.integers(-4, 6, shape[:1] + (1,) * (len(shape) - 1))
    if jnp.dtype(dtype) in FP8_DTYPES:
        values = np.sort(np.arange(256, dtype=np.uint8).view(jnp.dtype(dtype)).astype(np.float32))
        values = values[np.isfinite(values)]
        ties = (values[1:] + values[:-1]) / 2
        rows.reshape(-1)[:ties.size] = ties[:rows.size]
    return rows.astype(np.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, *FP8_DTYPES], ids=lambda d: jnp.dtype(d).name)
def test_native_kv_writer_matches_the_scatter_in_place(dtype):
    """The native K/V writer (the CPU body's companion: XLA:CPU's scatter converts a whole bfloat16 or float8 pool
    around each write) against `.at[].set` of `to_cache`'s values bit for bit, padding tokens (page id = P)
    skipped, under jit with the pool donated. float8 pools: K and V divided by their scales, rounded to nearest
    even (the format's ties included) and saturated at its largest value."""
    import jax

    native()
    rng = np.random.default_rng(5)
    pool = to_cache(jnp.asarray(rng.standard_normal((2, 6, 16, 4, 64)), jnp.float32), dtype)
    rows = jnp.asarray(kv_rows(rng, (5, 4, 64), dtype))
    pages, offsets = jnp.array([4, 4, 0, 6, 2]), jnp.array([0, 15, 7, 3, 9])  # token 3: padding
    scales = jnp.array([0.5, 3.0]) if jnp.dtype(dtype) in FP8_DTYPES else None
    divided = rows if scales is None else rows / jnp.tile(scales, 2)[None, :, None]  # rows K, V, K, V
    want = pool.at[1, pages, offsets].set(to_cache(divided, dtype), mode="drop")
    write = jax.jit(cpu.write_kv, donate_argnums=0)
    got = write(pool, 1, rows, pages, offsets, scales)
    assert got.dtype == dtype
    np.testing.assert_array_equal(bits(got), bits(want))
    with pytest.raises(ValueError, match="rows"):
        cpu.write_kv(got, 0, rows[:, :2], pages, offsets)
    with pytest.raises(ValueError, match=r"scales must be \[2\]"):
        cpu.write_kv(got, 0, rows, pages, offsets, jnp.ones(3))


# (body, case): the native body over CASES[:3] and its any-width path (head_dim 48); the Pallas kernels (slow in
# interpret mode) over one case
FP8_CASES = [("native", case) for case in CASES[:3] + [("mixed", 16, 2, 48, 30, 20.0)]] + [
    (body, CASES[2]) for body in BODIES]


@pytest.mark.parametrize("dtype", FP8_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("body, case", FP8_CASES, ids=lambda c: c if isinstance(c, str) else "-".join(map(str, c)))
def test_float8_pages_every_body_matches_reference(dtype, body, case):
    """A float8 pool (kv_cache_dtype fp8 / fp8_e5m2) against the reference over the same pages (each value widened
    to float32 exactly, the rest in float32): the Pallas kernels (interpret mode) and the native body's any-width
    path (head_dim 48) compute so too; for head_dim 64/128/256 the native body widens a window of keys to bfloat16
    (exactly) and computes as over bfloat16 pages (check_native_over_bfloat16_pages' bounds)."""
    mode, page_size, group, head_dim, window, cap = case
    case = ragged_case(5 + page_size + group, mode, page_size, group, head_dim, max_kv_len=90, max_reqs=4,
                       num_kv_heads=NUM_KV_HEADS, num_layers=NUM_LAYERS)
    q, pool, *rest = case.args
    kwargs = dict(sm_scale=head_dim ** -0.5, sliding_window=window, soft_cap=cap)
    if body == "native" and head_dim != 48:
        check_native_over_bfloat16_pages(case, dtype, **kwargs)
        return
    pool = to_cache(pool, dtype)
    want = np.asarray(reference(q, pool, *rest, **kwargs))
    np.testing.assert_array_equal(np.asarray(reference(q, pool.astype(jnp.float32), *rest, **kwargs)), want)
    got = np.asarray(FLOAT32_BODIES[body](q, pool, *rest, **kwargs))
    real = case.num_real_tokens
    np.testing.assert_allclose(got[:real], want[:real], atol=2e-5, rtol=1e-5)
    assert np.all(got[real:] == 0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("T", [5, 150])
def test_native_rope_writer_matches_xla_rotation_and_scatter(dtype, T):
    """q and k rotated and K/V written in one native pass from the fused projection [q heads | k heads | v heads]
    against XLA's split, apply_rope and `.at[].set`; a padding token's q is rotated, its K/V not written. 150
    tokens: shared out in items of 64 with XLA's pool. A float8 pool: K and V divided by their scales as they are
    written (`to_cache`'s rounding; the rotations may differ in the last float32 bit, so a value may round to a
    neighbour)."""
    import jax

    from jaxengine.layers.rope import apply_rope, rope_tables

    native()
    rng = np.random.default_rng(11)
    Hq, Hkv, D, P = 6, 2, 64, 6 if T == 5 else 12
    pool = to_cache(jnp.asarray(rng.standard_normal((2, P, 16, 2 * Hkv, D)), jnp.float32), dtype)
    qkv = jnp.asarray(rng.standard_normal((T, (Hq + 2 * Hkv) * D)), jnp.float32)
    scales = jnp.array([0.25, 0.75]) if jnp.dtype(dtype) in FP8_DTYPES else None
    inv_freq = jnp.asarray(1e4 ** -(np.arange(D // 2) / (D // 2)), jnp.float32)
    if T == 5:
        positions = jnp.array([3, 17, 0, 250, 9])
        pages, offsets = jnp.array([4, 4, 0, 6, 2]), jnp.array([0, 15, 7, 3, 9])  # token 3: padding
    else:
        positions = jnp.asarray(rng.integers(0, 1000, T))
        slots = rng.permutation(P * 16)[:T]  # each slot written once
        pages, offsets = jnp.asarray(np.where(np.arange(T) % 50 == 7, P, slots // 16)), jnp.asarray(slots % 16)
    cos, sin = rope_tables(positions, inv_freq, 1.0, jnp.float32)
    q, k, v = jnp.split(qkv, [Hq * D, (Hq + Hkv) * D], -1)
    want_q = apply_rope(q.reshape(T, Hq, D), cos, sin)
    rows = jnp.stack([apply_rope(k.reshape(T, Hkv, D), cos, sin), v.reshape(T, Hkv, D)], axis=2).reshape(T, 2 * Hkv, D)
    if scales is not None:
        rows = rows / jnp.tile(scales, Hkv)[None, :, None]
    want_pool = np.asarray(pool.at[1, pages, offsets].set(to_cache(rows, dtype), mode="drop").astype(jnp.float32))
    got_q, got_pool = jax.jit(cpu.rope_write_kv, donate_argnums=3, static_argnums=7)(qkv, cos, sin, pool, 1, pages,
                                                                                      offsets, Hq, scales)
    np.testing.assert_allclose(np.asarray(got_q), np.asarray(want_q), rtol=1e-6, atol=1e-6)
    assert got_pool.dtype == dtype
    got_pool = np.asarray(got_pool.astype(jnp.float32))
    rtol = {jnp.dtype(jnp.bfloat16): 2 ** -8, jnp.dtype(jnp.float8_e4m3fn): 2 ** -3}.get(jnp.dtype(dtype), 1e-6)
    np.testing.assert_allclose(got_pool, want_pool, rtol=rtol, atol=1e-6)
    if scales is not None:  # the rare value near a float8 tie may round to its neighbour
        assert np.mean(got_pool == want_pool) > 0.999
    with pytest.raises(ValueError, match=r"qkv \[T, 640\]"):
        cpu.rope_write_kv(qkv[:, :-1], cos, sin, got_pool, 0, pages, offsets, Hq)
    with pytest.raises(ValueError, match="cos and sin"):
        cpu.rope_write_kv(qkv, cos[:2], sin, got_pool, 0, pages, offsets, Hq)


def test_unsupported_shape_falls_back_to_the_reference_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        name, _ = select_body("pallas", head_dim=80, page_size=16)
    assert name == "reference"
    assert "does not support head_dim=80" in caplog.text
    assert select_body("pallas", 128, 16)[0] == "tpu"  # on CPU, the TPU body in interpret mode
    assert select_body("auto", 128, 16)[0] == ("cpu" if cpu.available() else "reference")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        select_body("flash", 128, 16)


def test_cpu_bodies_by_setting_and_dtype(caplog):
    if not cpu.available():
        pytest.skip("the native CPU attention could not be built here (no C++ compiler?)")
    assert select_body("native", 64, 16)[0] == "cpu"
    assert select_body("reference", 64, 16)[0] == "reference"
    assert select_body("auto", 64, 16, (jnp.float32, jnp.bfloat16))[0] == "cpu"
    with caplog.at_level(logging.WARNING):
        assert select_body("auto", 64, 16, (jnp.bfloat16, jnp.bfloat16))[0] == "reference"
    assert "float32 queries" in caplog.text


@pytest.mark.slow
def test_full_model_with_the_tpu_body_in_interpret_mode_matches_the_reference(tmp_path_factory, tokenizer_dir):
    model_dir = tiny_models.make_extra_model("llama-hd64", tmp_path_factory.mktemp("hd64"), tokenizer_dir)
    prompts = random_prompts(331, (3, 21), seed=5)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for backend in ("reference", "pallas"):
        engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", max_model_len=128, max_num_seqs=8,
                                        max_num_batched_tokens=32, min_token_bucket=32, kv_cache_gib=0.01,
                                        attention_backend=backend), progress=False)
        finals = run_to_completion(engine, [(f"k{i}", p, params) for i, p in enumerate(prompts)])
        tokens[backend] = [finals[f"k{i}"].outputs[0].token_ids for i in range(len(prompts))]
    assert tokens["pallas"] == tokens["reference"]


def test_tpu_companion_kernel_writes_kv_rows_into_their_pages():
    rng = np.random.default_rng(3)
    pool = rng.standard_normal((2, 6, 16, 4, 64)).astype(np.float32)
    new = rng.standard_normal((5, 4, 64)).astype(np.float32)
    pages, offsets = np.array([4, 4, 0, -1, 2]), np.array([0, 15, 7, 3, 9])  # one padding token
    got = np.asarray(tpu.write_kv(jnp.asarray(pool), 1, jnp.asarray(new), jnp.asarray(pages), jnp.asarray(offsets),
                                  interpret=pltpu.InterpretParams()))
    want = pool.copy()
    for row, (p, o) in enumerate(zip(pages, offsets)):
        if p >= 0:
            want[1, p, o] = new[row]
    np.testing.assert_array_equal(got, want)


@needs_native_matmul
@pytest.mark.parametrize("m,k,n", [(1, 7, 5), (13, 33, 47), (12, 64, 32), (25, 576, 200), (3, 1536, 96),
                                   (64, 96, 40), (64, 64, 32784), (600, 100, 72)])
def test_native_bf16_matmul_matches_xla(m, k, n):
    """Odd K (an unpaired last weight row, zero-padded), partial column panels, row blocks of several sizes
    (M split evenly into blocks of at most 12: 13 -> 7 + 6, 64 -> 11 x 5 + 9), a result over 8 MB (stream
    stores for its full panels, a masked store for its last half panel), and, on tiles, rows shared out in
    row groups (600: 256 + 256 + 88) with K past the last whole chunk of pairs."""
    import jax

    rng = np.random.default_rng(m * k * n)
    x = jnp.asarray(rng.standard_normal((m, k), np.float32))
    w = jnp.asarray(rng.standard_normal((k, n), np.float32)).astype(jnp.bfloat16)
    expected = jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)
    packed = cpu.pack_bf16(w)
    assert packed.shape == (-(-n // 32), -(-k // 2), 64)
    np.testing.assert_array_equal(np.asarray(jax.jit(cpu.pack_bf16)(w)), np.asarray(packed))  # traced: same bits
    got = jax.jit(cpu.matmul_bf16, static_argnums=2)(x, packed, n)
    assert got.shape == (m, n) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5 * np.sqrt(k))


@needs_native_matmul
@pytest.mark.parametrize("prologue", [None, "rms_norm", "gated"])
@pytest.mark.parametrize("m, lives", [(40, (0, 1, 7, 8, 13, 16, 29, 32, 33, 40, 45)), (600, (0, 100, 511, 512, 530))])
def test_native_bf16_matmul_skips_padding_rows(prologue, m, lives):
    """Rows from live_rows on (a bucket's padding) come out zero, residual included; the rows before it are
    exactly what the whole matmul gives them, whatever the count on one path (row blocks are split by the
    live rows; where tiles run, fewer than TILE_MIN_ROWS rows run on registers, close but not equal; on
    tiles, whole blocks of whole panels store straight from the tiles and the others through a buffer, the
    residual summed first either way, and from 512 rows the rows are shared out in row groups). "gated": a
    gated_pairs product feeding a rounded matmul, both given the live rows."""
    import jax

    rng = np.random.default_rng(7)
    k, n, i = 96, 72, 48
    x = jnp.asarray(rng.standard_normal((m, k), np.float32))
    packed = cpu.pack_bf16(jnp.asarray(rng.standard_normal((i if prologue == "gated" else k, n), np.float32)))
    gate_up = cpu.pack_gated(*(jnp.asarray(rng.standard_normal((k, i), np.float32)) for _ in range(2)))
    norm = jnp.asarray(rng.standard_normal(k), np.float32) if prologue else None
    residual = jnp.asarray(rng.standard_normal((m, n), np.float32))

    @jax.jit
    def run(live):
        if prologue != "gated":
            return cpu.matmul_bf16(x, packed, n, prologue=prologue, norm=norm, eps=1e-6, residual=residual,
                                   live_rows=live)
        pairs = cpu.gated_pairs(x, gate_up, prologue="rms_norm", norm=norm, eps=1e-6, live_rows=live)
        return cpu.matmul_bf16(pairs, packed, n, prologue="rounded", residual=residual, live_rows=live)

    whole = np.asarray(run(jnp.int32(m)))
    assert np.abs(whole).min() > 0
    for live in lives:
        got = np.asarray(run(jnp.int32(live)))
        if cpu.matmul_tiles() and live < cpu.TILE_MIN_ROWS:  # these few rows run on registers, the whole on tiles
            np.testing.assert_allclose(got[:live], whole[:live], rtol=1e-3, atol=0.1)  # a rounding may differ
        else:
            np.testing.assert_array_equal(got[:live], whole[:live])
        np.testing.assert_array_equal(got[live:], 0.0)


def test_native_bf16_matmul_refuses_other_shapes_and_dtypes():
    with pytest.raises(ValueError, match=r"x \[M, K\] .* and pack_bf16\(w\) of a \[\(L,\) K, 5\] w"):
        cpu.matmul_bf16(jnp.zeros((2, 7)), cpu.pack_bf16(jnp.zeros((4, 5))), 5)
    with pytest.raises(ValueError, match=r"x \[M, K\]"):
        cpu.matmul_bf16(jnp.zeros(3), cpu.pack_bf16(jnp.zeros((3, 5))), 5)
    with pytest.raises(ValueError, match=r"float32 x \(uint32 when rounded\) and a bfloat16 packed w"):
        cpu.matmul_bf16(jnp.zeros((2, 3), jnp.bfloat16), cpu.pack_bf16(jnp.zeros((3, 5))), 5)
    with pytest.raises(ValueError, match="prologue must be one of"):
        cpu.matmul_bf16(jnp.zeros((2, 3)), cpu.pack_bf16(jnp.zeros((3, 5))), 5, prologue="gelu")
    with pytest.raises(ValueError, match=r"norm weight \[3\] with the rms_norm prologue and only there"):
        cpu.matmul_bf16(jnp.zeros((2, 3)), cpu.pack_bf16(jnp.zeros((3, 5))), 5, norm=jnp.ones(3))
    with pytest.raises(ValueError, match=r"norm weight \[3\]"):
        cpu.matmul_bf16(jnp.zeros((2, 3)), cpu.pack_bf16(jnp.zeros((3, 5))), 5, prologue="rms_norm", norm=jnp.ones(4))
    with pytest.raises(ValueError, match=r"residual must be float32 \[2, 5\]"):
        cpu.matmul_bf16(jnp.zeros((2, 3)), cpu.pack_bf16(jnp.zeros((3, 5))), 5, residual=jnp.zeros((2, 4)))
    with pytest.raises(ValueError, match=r"\[M, rounded_width\(K\)\] when rounded"):
        cpu.matmul_bf16(jnp.zeros((2, 3), jnp.uint32), cpu.pack_bf16(jnp.zeros((3, 5))), 5, prologue="rounded")
    with pytest.raises(ValueError, match=r"float32 x \(uint32 when rounded\)"):
        cpu.matmul_bf16(jnp.zeros((2, 16)), cpu.pack_bf16(jnp.zeros((3, 5))), 5, prologue="rounded")
    gate_up = cpu.pack_gated(jnp.zeros((3, 16)), jnp.zeros((3, 16)))
    with pytest.raises(ValueError, match=r"pack_gated\(gate, up\) of \[\(L,\) K, I\] weights"):
        cpu.gated_pairs(jnp.zeros((2, 5)), gate_up)
    with pytest.raises(ValueError, match="prologue must be None or 'rms_norm'"):
        cpu.gated_pairs(jnp.zeros((2, 3)), gate_up, prologue="rounded")
    with pytest.raises(ValueError, match="I a multiple of 16"):
        cpu.pack_gated(jnp.zeros((3, 24)), jnp.zeros((3, 24)))
    with pytest.raises(ValueError, match="live_rows must be a scalar row count"):
        cpu.matmul_bf16(jnp.zeros((2, 3)), cpu.pack_bf16(jnp.zeros((3, 5))), 5, live_rows=jnp.array([1, 2]))
    stacked = cpu.pack_bf16(jnp.zeros((4, 3, 5)))
    with pytest.raises(ValueError, match=r"layer index with a stacked \[L, P, K2, 64\] weight and only there"):
        cpu.matmul_bf16(jnp.zeros((2, 3)), stacked, 5)
    with pytest.raises(ValueError, match="layer index with a stacked"):
        cpu.matmul_bf16(jnp.zeros((2, 3)), cpu.pack_bf16(jnp.zeros((3, 5))), 5, layer=0)
    with pytest.raises(ValueError, match="layer index with a stacked"):
        cpu.gated_pairs(jnp.zeros((2, 3)), cpu.pack_gated(jnp.zeros((2, 3, 16)), jnp.zeros((2, 3, 16))),
                        layer=jnp.array([0]))


@needs_native_matmul
@pytest.mark.parametrize("m,k,n", [(1, 7, 5), (13, 33, 47), (64, 576, 96), (40, 1536, 64)])
def test_native_bf16_matmul_prologues_match_xla(m, k, n):
    """The RMSNorm prologue (odd K, a zero row) and the residual epilogue (partial column panels included),
    alone and together."""
    import jax

    from jaxengine.layers.norms import rms_norm

    rng = np.random.default_rng(m + k + n)
    w = jnp.asarray(rng.standard_normal((k, n), np.float32)).astype(jnp.bfloat16)
    packed = cpu.pack_bf16(w)
    dot = lambda a: jnp.dot(a.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)  # noqa: E731
    tol = dict(rtol=1e-3, atol=0.1)  # where an input rounds to the other bfloat16 neighbour (rare)

    x = rng.standard_normal((m, k), np.float32) * 5
    x[0] = 0  # rsqrt(eps): finite
    norm = jnp.asarray(rng.standard_normal(k, np.float32)).astype(jnp.bfloat16)
    got = jax.jit(cpu.matmul_bf16, static_argnums=2, static_argnames=("prologue", "eps"))(
        jnp.asarray(x), packed, n, prologue="rms_norm", norm=norm, eps=1e-5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(dot(rms_norm(jnp.asarray(x), norm, 1e-5))), **tol)

    residual = jnp.asarray(rng.standard_normal((m, n), np.float32))  # the epilogue, alone and after a prologue
    got = jax.jit(cpu.matmul_bf16, static_argnums=2)(jnp.asarray(x), packed, n, residual=residual)
    # only the summation order differs (XLA's own may be another per CPU): float32 error over K terms of |x| ~ 5
    np.testing.assert_allclose(np.asarray(got), np.asarray(residual + dot(jnp.asarray(x))), rtol=1e-5,
                               atol=5e-5 * np.sqrt(k))
    got = jax.jit(cpu.matmul_bf16, static_argnums=2, static_argnames=("prologue", "eps"))(
        jnp.asarray(x), packed, n, prologue="rms_norm", norm=norm, eps=1e-5, residual=residual)
    np.testing.assert_allclose(np.asarray(got), np.asarray(residual + dot(rms_norm(jnp.asarray(x), norm, 1e-5))),
                               **tol)


@needs_native_matmul
@pytest.mark.parametrize("m,k,i,n,activation", [(1, 7, 16, 5, "silu"), (13, 33, 48, 47, "silu"),
                                                (64, 576, 1536, 576, "silu"), (40, 96, 80, 64, "silu"),
                                                (13, 33, 48, 47, "gelu_tanh"), (2, 96, 80, 64, "swigluoai")])
def test_native_gated_pairs_feed_a_rounded_matmul(m, k, i, n, activation):
    """The gated MLP: gated_pairs (silu(gate) * up applied to a pack_gated weight's products in registers, with
    and without the RMSNorm prologue; gates far past exp's range) feeding matmul_bf16's rounded prologue, against
    XLA's float32 products, activation and bfloat16 down projection. Widths of half a chunk of pairs (48, 80)
    and row blocks of several sizes; Gemma's tanh GELU and GPT-OSS's clamped SwiGLU in place of silu. unpack_gated
    splits the products of the packed weight back."""
    import jax

    from jaxengine.layers.norms import rms_norm

    rng = np.random.default_rng(m + k + i + n)
    gate, up = (jnp.asarray(rng.standard_normal((k, i), np.float32) / np.sqrt(k)).astype(jnp.bfloat16)
                for _ in range(2))
    down = jnp.asarray(rng.standard_normal((i, n), np.float32)).astype(jnp.bfloat16)
    gate_up, packed = cpu.pack_gated(gate, up), cpu.pack_bf16(down)
    assert gate_up.shape == (i // 16, -(-k // 2), 64)
    norm = jnp.asarray(rng.standard_normal(k, np.float32)).astype(jnp.bfloat16)
    residual = jnp.asarray(rng.standard_normal((m, n), np.float32))
    x = rng.standard_normal((m, k), np.float32) * 4
    x[0] *= 300  # gates of hundreds, both signs: silu's exp saturates either way
    x = jnp.asarray(x)
    dot = lambda a, w: jnp.dot(a.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)  # noqa: E731

    def tolerance(h):
        """0.1, plus two of the largest term h[m, j] * down[j, n] moved by one bfloat16 step of h: the two sides
        sum g and u in their own orders, so a product near a rounding boundary may round the other way."""
        h, w = np.abs(np.asarray(h)), np.abs(np.asarray(down, np.float32))
        return 0.1 + 2 * 2.0 ** -8 * np.stack([(row[:, None] * w).max(0) for row in h])

    @functools.partial(jax.jit, static_argnames="prologue")
    def native(x, prologue):
        pairs = cpu.gated_pairs(x, gate_up, prologue=prologue, norm=norm if prologue else None, eps=1e-5,
                                activation=activation)
        assert pairs.shape == (m, cpu.rounded_width(i)) and pairs.dtype == jnp.uint32
        return cpu.matmul_bf16(pairs, packed, n, prologue="rounded", residual=residual)

    for prologue, rows in ((None, x), ("rms_norm", rms_norm(x, norm, 1e-5))):
        g, u = dot(rows, gate), dot(rows, up)
        assert prologue or float(jnp.abs(g[0]).max()) > 100
        if activation == "swigluoai":
            g, u = jnp.minimum(g, 7.0), jnp.clip(u, -7.0, 7.0) + 1
            h = g * jax.nn.sigmoid(1.702 * g) * u
        else:
            h = (jax.nn.silu(g) if activation == "silu" else jax.nn.gelu(g, approximate=True)) * u
        expected = np.asarray(residual + dot(h, down))
        got = np.asarray(native(x, prologue))
        assert np.isfinite(got).all()
        np.testing.assert_array_less(np.abs(got - expected), tolerance(h) + 1e-3 * np.abs(expected))
    g, u = cpu.unpack_gated(cpu.matmul_bf16(x, gate_up, 2 * i))
    np.testing.assert_allclose(np.asarray(g), np.asarray(dot(x, gate)), rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(np.asarray(u), np.asarray(dot(x, up)), rtol=1e-5, atol=1e-3)


@needs_native_matmul
def test_native_matmuls_read_a_layer_of_stacked_weights_in_place():
    """A scanned layer loop hands the native matmul all layers' packed weights and the layer's index (traced):
    each layer's result is what its own packed weight gives, bit for bit, for the plain matmul and for the
    gated MLP; an index outside the stack is refused when the program runs."""
    import jax

    rng = np.random.default_rng(11)
    L, m, k, i, n = 3, 13, 96, 48, 72
    x = jnp.asarray(rng.standard_normal((m, k), np.float32))
    w, gate, up = (jnp.asarray(rng.standard_normal((L, k, c), np.float32)).astype(jnp.bfloat16) for c in (n, i, i))
    down = jnp.asarray(rng.standard_normal((L, i, n), np.float32)).astype(jnp.bfloat16)
    stacks = cpu.pack_bf16(w), cpu.pack_gated(gate, up), cpu.pack_bf16(down)
    assert stacks[0].shape == (L, -(-n // 32), k // 2, 64) and stacks[1].shape == (L, i // 16, k // 2, 64)
    # Packed on the host (concrete weights) or traced (jax.numpy): the same bits.
    np.testing.assert_array_equal(np.asarray(jax.jit(cpu.pack_bf16)(w)), np.asarray(stacks[0]))
    np.testing.assert_array_equal(np.asarray(jax.jit(cpu.pack_gated)(gate, up)), np.asarray(stacks[1]))

    def layer_of(x, w, gate_up, down, layer):
        pairs = cpu.gated_pairs(x, gate_up, live_rows=9, layer=layer)
        return cpu.matmul_bf16(x, w, n, layer=layer), cpu.matmul_bf16(pairs, down, n, prologue="rounded",
                                                                         residual=x[:, :n], live_rows=9, layer=layer)

    def scanned(x, w, gate_up, down):  # as the model's layer loop: the stacks are the scan's constants
        return jax.lax.scan(lambda c, layer: (c, layer_of(x, w, gate_up, down, layer)), 0,
                            jnp.arange(L, dtype=jnp.int32))[1]

    got = jax.jit(scanned)(x, *stacks)
    for layer in range(L):
        want = jax.jit(lambda x, *ws: layer_of(x, *ws, None))(x, *(s[layer] for s in stacks))
        for g, e in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g[layer]), np.asarray(e))
    with pytest.raises(Exception, match="layer index is outside the stacked weight"):
        jax.block_until_ready(jax.jit(cpu.matmul_bf16, static_argnums=2)(x, stacks[0], n, layer=L))


def test_pack_bf16_on_the_host_in_groups_of_panels_is_the_whole_packing(monkeypatch):
    """Large host weights are packed a group of panels at a time (bounding the temporaries: an output head's were
    ~3.5 GB): the same bits as packing them whole, a partial last panel and a stack's leading axes included; a jax
    array stays a jax array."""
    rng = np.random.default_rng(12)
    for shape in [(3, 100, 7000), (96, 1000), (64, 33)]:
        w = rng.standard_normal(shape).astype(jnp.bfloat16)
        whole = cpu.pack_bf16(w)
        monkeypatch.setattr(cpu, "_HOST_CHUNK", 5000)
        np.testing.assert_array_equal(cpu.pack_bf16(w).view(np.uint16), whole.view(np.uint16))
        packed = cpu.pack_bf16(jnp.asarray(w))
        assert isinstance(packed, jax.Array)
        np.testing.assert_array_equal(np.asarray(packed).view(np.uint16), whole.view(np.uint16))
        monkeypatch.undo()


@pytest.mark.skipif(not cpu.matmul_tiles(), reason="where the matmul runs on registers, the tests above test them")
def test_the_register_path_too_where_tiles_run():
    """On a CPU with AMX-BF16 the native matmul, and the attention's scores and values of many rows over
    bfloat16 pages, run on its tiles; their tests again, in a process with JAXENGINE_CPU_AMX=0, cover the
    AVX-512 register paths that CPUs without AMX run."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
               "matmul or gated or bfloat16_pages or transposed_keys"]
    result = subprocess.run(command, env=os.environ | {"JAXENGINE_CPU_AMX": "0"}, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-4000:]
    passed = re.search(r"(\d+) passed", result.stdout)
    assert passed and int(passed.group(1)) >= 15 and "skipped" not in result.stdout, result.stdout[-2000:]


# Each has every feature of the one before it: SSE4.2; AVX2 and FMA; AVX-512 without BF16; AMX.
OTHER_X86_CPUS = ("x86-64-v2", "x86-64-v3", "x86-64-v4", "sapphirerapids")
_FEATURE_MACRO = re.compile(r"\b__(?:AVX|AMX|FMA|F16C)\w*__")


def feature_macros(source) -> set[str]:
    """The CPU feature macros (__AVX2__, __AMX_TILE__, ...) that a kernel source or the headers it includes test."""
    text = source.read_text()
    found = set(_FEATURE_MACRO.findall(text))
    for header in re.findall(r'#include "(cpu_\w+\.h)"', text):
        found |= feature_macros(source.with_name(header))
    return found


@functools.cache  # each CPU's case asks for the CPUs before it too
def defined_macros(march: str) -> frozenset[str]:
    result = subprocess.run([cpu._compiler(), "-x", "c++", f"-march={march}", "-dM", "-E", "/dev/null"],
                            capture_output=True, text=True, check=True)
    return frozenset(line.split()[1] for line in result.stdout.splitlines() if line.startswith("#define "))


@pytest.mark.skipif(cpu._compiler() is None or os.uname().machine != "x86_64", reason="an x86-64 C++ compiler")
@pytest.mark.parametrize("march", OTHER_X86_CPUS)
def test_the_kernels_compile_for_other_x86_cpus(march):
    """The library builds from the same sources for CPUs with less or more than this one (SSE4.2; AVX2; AVX-512
    without BF16; AMX): the paths this machine does not run still compile (a jaxlib without
    ffi::Error::Unimplemented once left every CPU without AVX-512 BF16 with no native kernel at all). Compiled to
    objects, so that the assembler sees the instructions too (a tile number that is not a constant passes the
    compiler's checks and fails there). A source is compiled for a CPU where the feature macros it tests differ
    from those of every CPU before it in the list and of this machine (whose own build, -march=native, is
    test_the_native_kernels_build_here's): otherwise the same code has already compiled."""
    index = OTHER_X86_CPUS.index(march)
    defined = defined_macros(march)
    tested = {source: feature_macros(source) for source in cpu._SOURCES}
    earlier = [defined_macros(other) for other in OTHER_X86_CPUS[:index]]
    assert not earlier or any(macros & defined != macros & earlier[-1] for macros in tested.values()), \
        f"{march} adds nothing to {OTHER_X86_CPUS[index - 1]}"
    covered = [defined_macros("native"), *earlier]
    sources = [source for source, macros in tested.items()
               if all(macros & defined != macros & seen for seen in covered)]
    if not sources:
        pytest.skip(f"every source's code for {march} is this machine's own or an earlier CPU's in the list")
    with tempfile.TemporaryDirectory() as tmp:
        for source in sources:
            command = [cpu._compiler(), "-std=c++17", f"-march={march}", "-c", f"-I{jax.ffi.include_dir()}",
                       str(source), "-o", os.path.join(tmp, source.stem + ".o")]
            result = subprocess.run(command, capture_output=True, text=True)
            assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.skipif(cpu._compiler() is None or os.uname().machine != "x86_64", reason="an x86-64 C++ compiler")
def test_the_native_kernels_build_here():
    """Where a compiler is, the library builds: a failed build makes every native kernel quietly fall back to
    XLA's ops (cpu.available() is False and their tests skip), so this one fails with the compiler's error."""
    cpu._library()
    assert cpu.available()


@pytest.mark.skipif(not cpu.available(), reason="the native CPU kernels need a C++ compiler")
def test_fusion_barrier_is_the_identity_and_stays_in_the_program():
    import jax

    x = jnp.linspace(-3.0, 3.0, 96, dtype=jnp.float32).reshape(2, 48)
    f = jax.jit(lambda x: cpu.fusion_barrier(jnp.stack([jnp.cos(x), jnp.sin(x)])) * 2.0)
    np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(jnp.stack([jnp.cos(x), jnp.sin(x)]) * 2.0))
    assert "jaxengine_cpu_fusion_barrier" in f.lower(x).compile().as_text()


@pytest.mark.skipif(not cpu.available(), reason="the native CPU kernels need a C++ compiler")
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 50, 1000])
def test_native_first_argmax_matches_jnp_argmax(vocab):
    """Ties (the first wins, across lanes and the tail), rows of -inf, NaNs (the first wins, in the vector
    part or the tail) and a maximum in the tail, for row lengths around the 16-lane vector."""
    from jaxengine.layers.sampler import first_argmax

    rng = np.random.default_rng(vocab)
    x = rng.standard_normal((12, vocab)).astype(np.float32)
    x[1] = 2.0  # all equal
    x[2] = -np.inf
    x[3, -1] = 9.0  # the maximum at the end
    x[4, vocab // 2:] = 7.0  # ties from the middle on
    x[5, [vocab // 3, vocab - 1]] = np.nan
    x[6, -1] = np.nan
    x[7] = rng.integers(0, 3, vocab)  # many ties
    x[8, 0] = np.inf
    x[9, rng.integers(vocab)] = -np.inf
    got = np.asarray(jax.jit(cpu.first_argmax)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    # The XLA path agrees where the row has no NaN (XLA:CPU's max can skip a NaN: the kernel is the one that
    # keeps jnp.argmax's rule there).
    finite = ~np.isnan(x).any(axis=-1)
    np.testing.assert_array_equal(got[finite], np.asarray(first_argmax(jnp.asarray(x)))[finite])


@pytest.mark.skipif(not cpu.available(), reason="the native CPU kernels need a C++ compiler")
def test_native_first_argmax_applies_the_bias_and_bans_as_the_greedy_sampler_does():
    """The greedy sampler's processing (bias added, then bans to -inf; `vocab` marks an unused entry) applied
    by the kernel to the rows that have any, against XLA's scatters and argmax: a bias that makes a new
    maximum, a ban on the maximum, a ban on a biased token, a bias onto a tie, a row with nothing to apply, a
    row whose every token is banned or -inf, the first and last ids."""
    from jaxengine.layers.sampler import SamplingInputs, process_logits

    rng = np.random.default_rng(0)
    rows, vocab, B, N = 8, 70, 3, 4
    x = rng.standard_normal((rows, vocab)).astype(np.float32)
    x[4] = 1.0
    x[6] = -np.inf
    bias_ids = np.full((rows, B), vocab, np.int32)
    bias_values = np.zeros((rows, B), np.float32)
    banned = np.full((rows, N), vocab, np.int32)
    bias_ids[0, :2], bias_values[0, :2] = [5, vocab - 1], [9.0, -2.0]  # 5 becomes the maximum
    banned[1, 0] = int(np.argmax(x[1]))  # the maximum banned: the runner-up wins
    bias_ids[2, 0], bias_values[2, 0], banned[2, :2] = 0, 50.0, [0, 3]  # banned after its bias
    bias_ids[4, 0], bias_values[4, 0] = 40, 0.0  # a tie stays a tie: the first wins
    banned[6, :2] = [0, vocab - 1]  # nothing above -inf: the first token
    banned[7] = [10, 11, 12, 13]
    got = np.asarray(jax.jit(cpu.first_argmax)(jnp.asarray(x), bias_ids, bias_values, banned))
    inputs = SamplingInputs(*(jnp.zeros(rows) for _ in range(6)), jnp.asarray(bias_ids), jnp.asarray(bias_values),
                            jnp.asarray(banned), *(jnp.zeros(rows) for _ in range(5)))
    want = np.argmax(np.asarray(process_logits(jnp.asarray(x), inputs, None)), axis=-1)
    np.testing.assert_array_equal(got, want)
    assert got[0] == 5 and got[1] != np.argmax(x[1]) and got[2] != 0 and got[4] == 0 and got[6] == 0
    np.testing.assert_array_equal(got[[3, 5]], np.argmax(x[[3, 5]], axis=-1))  # nothing to apply


@pytest.mark.skipif(not cpu.available(), reason="the native CPU kernels need a C++ compiler")
def test_native_first_argmax_refuses_other_shapes_and_dtypes():
    with pytest.raises(ValueError, match="float32 x"):
        cpu.first_argmax(jnp.zeros((2, 3), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"\[R, V\]"):
        cpu.first_argmax(jnp.zeros((3,), jnp.float32))
    with pytest.raises(ValueError, match="together"):
        cpu.first_argmax(jnp.zeros((2, 3)), bias_ids=jnp.zeros((2, 1), jnp.int32))
    with pytest.raises(ValueError, match="banned"):
        cpu.first_argmax(jnp.zeros((2, 3)), banned=jnp.zeros((3, 1), jnp.int32))


def sorted_cutoff(x, temperature, top_k, top_p, min_p):
    """Each row's smallest kept scaled logit by the textbook procedure (numpy, float64 masses): scale, drop
    below min_p times the largest probability, sort, keep ranks below top_k and ranks whose mass before them
    (normalised over the top k) is below top_p; values equal to the last kept one stay."""
    out = np.empty(len(x), np.float32)
    for r, row in enumerate(x):
        s = row / temperature[r]
        e = np.exp(s.astype(np.float64) - s.max())
        ordered = -np.sort(-np.where(e >= min_p[r], s, -np.inf))
        k = min(top_k[r] if 0 < top_k[r] < len(row) else len(row), int(np.isfinite(ordered).sum()))
        if top_p[r] < 1:
            w = np.exp(ordered[:k].astype(np.float64) - ordered[0])
            w /= w.sum()
            k = int((np.cumsum(w) - w < top_p[r]).sum())
        out[r] = ordered[k - 1]
    return out


@pytest.mark.skipif(not cpu.available(), reason="the native CPU kernels need a C++ compiler")
@pytest.mark.parametrize("ties", [False, True])
def test_native_sampler_cuts_where_a_sort_would(ties):
    """The kernel finds top-k's and top-p's cutoff without sorting the row (a histogram of the values, then a
    sort of the buckets where the cut falls): against a sort, exactly, over rows of 5000 to 5013 tokens with
    min-p, top-k (beyond the kept count too), top-p and both, with many tied values or none; every drawn
    token is at or above its row's cutoff."""
    rng = np.random.default_rng(int(ties))
    rows, vocab = 48, 5013
    x = (rng.standard_normal((rows, vocab)) * rng.uniform(0.5, 8, (rows, 1))).astype(np.float32)
    if ties:
        x = np.round(x * 2) / 2
    temperature = rng.uniform(0.3, 1.5, rows).astype(np.float32)
    top_k = rng.choice([0, 1, 7, 300, 4000, vocab + 5], rows).astype(np.int32)
    top_p = rng.choice([1.0, 0.3, 0.9, 0.999], rows).astype(np.float32)
    min_p = rng.choice([0.0, 0.0, 0.02, 0.4], rows).astype(np.float32)
    seeds, counters = np.arange(rows, dtype=np.uint32), np.zeros(rows, np.int32)
    tokens, cutoff = map(np.asarray, jax.jit(cpu.sample)(x, temperature, top_k, top_p, min_p, seeds, counters))
    np.testing.assert_array_equal(cutoff, sorted_cutoff(x, temperature, top_k, top_p, min_p))
    assert np.all(x[np.arange(rows), tokens] / temperature >= cutoff)
    assert len(set(cutoff.tolist())) > rows // 2, "the settings cut in many places"


@pytest.mark.skipif(not cpu.available(), reason="the native CPU kernels need a C++ compiler")
def test_native_sampler_rows_greedy_patched_and_seeded():
    """Temperature 0 rows take the greedy argmax; the bias and bans apply before sampling; a row with a NaN
    or nothing finite takes the greedy rule's token; a draw depends on its row's seed and counter only."""
    rng = np.random.default_rng(3)
    rows, vocab = 8, 300
    x = rng.standard_normal((rows, vocab)).astype(np.float32)
    x[5, 17] = np.nan
    x[6] = -np.inf
    temperature = np.array([0, 0, 1, 1, 1, 1, 1, 0.5], np.float32)
    top_k = np.array([0, 0, 1, 0, 0, 0, 0, 0], np.int32)
    bias_ids = np.full((rows, 2), vocab, np.int32)
    bias_values = np.zeros((rows, 2), np.float32)
    banned = np.full((rows, 2), vocab, np.int32)
    bias_ids[1, 0], bias_values[1, 0] = 9, 50.0  # greedy after the bias: 9
    bias_ids[2], bias_values[2] = [3, 4], [40.0, 41.0]  # top-1 after the bias: 4 ...
    banned[2, 0] = 4  # ... then 4 banned: 3
    bias_ids[3, 0], bias_values[3, 0] = 100, 60.0  # all but certain: 100
    args = (np.ones(rows, np.float32), np.zeros(rows, np.float32), np.arange(rows, dtype=np.uint32),
            np.zeros(rows, np.int32), bias_ids, bias_values, banned)
    tokens, cutoff = map(np.asarray, jax.jit(cpu.sample)(x, temperature, top_k, args[0], *args[1:]))
    assert tokens[0] == np.argmax(x[0]) and tokens[1] == 9 and tokens[2] == 3 and tokens[3] == 100
    assert tokens[5] == 17 and tokens[6] == 0  # the first NaN; nothing finite: the first token
    assert np.isnan(cutoff[[0, 1, 5, 6]]).all() and cutoff[2] == 40.0 + x[2, 3]

    # Row 7 drawn with one seed and many counters, then many seeds at one counter: both spread over tokens
    # as its distribution says, and the same (seed, counter) gives the same token.
    draws = 4000
    flat = np.broadcast_to(x[7], (draws, vocab))
    one = np.ones(draws, np.float32)
    sample = jax.jit(cpu.sample)
    by_counter = np.asarray(sample(flat, one * 0.5, np.zeros(draws, np.int32), one, one * 0,
                                   np.full(draws, 7, np.uint32), np.arange(draws, dtype=np.int32))[0])
    by_seed = np.asarray(sample(flat, one * 0.5, np.zeros(draws, np.int32), one, one * 0,
                                np.arange(draws, dtype=np.uint32), np.full(draws, 3, np.int32))[0])
    again = np.asarray(sample(flat, one * 0.5, np.zeros(draws, np.int32), one, one * 0,
                              np.arange(draws, dtype=np.uint32), np.full(draws, 3, np.int32))[0])
    np.testing.assert_array_equal(by_seed, again)
    p = np.exp((x[7].astype(np.float64) - x[7].max()) / 0.5)
    p /= p.sum()
    top = np.argsort(-p)[:20]  # the likeliest tokens, and the rest as one class
    for drawn in (by_counter, by_seed):
        observed = np.append(np.bincount(drawn, minlength=vocab)[top], draws - np.isin(drawn, top).sum())
        expected = np.append(p[top], max(1 - p[top].sum(), 0.0)) * draws
        assert stats.chisquare(observed, expected).pvalue > 1e-3


@pytest.mark.skipif(not cpu.available(), reason="the native CPU kernels need a C++ compiler")
def test_native_sampler_applies_the_slot_state_as_process_logits_does():
    """The full variant's penalties (repetition over prompt and output tokens, frequency, presence) and
    allowed tokens, then the bias and bans, applied by the kernel to rows that hold a slot: greedy rows take the
    argmax of XLA's process_logits, top-k 1 rows its maximum (the cutoff), sampled rows stay in the allowed
    set; a row whose slot is `num_slots` (none) is read as it is."""
    from jaxengine.layers.sampler import SamplingInputs, SlotState, process_logits

    rng = np.random.default_rng(5)
    rows, vocab, slots = 10, 300, 4
    x = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    state = SlotState(jnp.asarray(rng.integers(0, 3, (slots, vocab)) * (rng.random((slots, vocab)) < 0.2), jnp.int32),
                      jnp.asarray(rng.random((slots, vocab)) < 0.1), jnp.ones((slots, vocab), bool))
    state.allowed = state.allowed.at[3].set(jnp.zeros(vocab, bool).at[jnp.array([7, 70, 170])].set(True))
    slot_of = np.array([0, 1, 2, slots, 0, 1, 2, 3, 3, slots], np.int32)
    temperature = np.array([0, 0, 0, 0, 1, 1, 1, 1, 0.7, 1], np.float32)
    top_k = np.array([0, 0, 0, 0, 1, 1, 1, 0, 0, 0], np.int32)
    presence = np.array([0.5, 0, 1.5, 2, 0.5, 0, 1.5, 0, 0, 2], np.float32)
    frequency = np.array([0.3, 0, -1, 1, 0.3, 0, -1, 0, 0, 1], np.float32)
    repetition = np.array([1.3, 0.8, 1, 2, 1.3, 0.8, 1, 1, 1, 2], np.float32)
    bias_ids = np.full((rows, 1), vocab, np.int32)
    bias_values = np.zeros((rows, 1), np.float32)
    banned = np.full((rows, 1), vocab, np.int32)
    bias_ids[1, 0], bias_values[1, 0] = 11, 4.0
    banned[2, 0] = 12
    inputs = SamplingInputs(jnp.asarray(temperature), jnp.asarray(top_k), jnp.ones(rows), jnp.zeros(rows),
                            jnp.arange(rows, dtype=jnp.uint32), jnp.zeros(rows, jnp.int32), jnp.asarray(bias_ids),
                            jnp.asarray(bias_values), jnp.asarray(banned), jnp.asarray(presence),
                            jnp.asarray(frequency), jnp.asarray(repetition), jnp.asarray(slot_of),
                            jnp.full(rows, slots, jnp.int32))
    want = np.asarray(process_logits(jnp.asarray(x), inputs, state))
    penalties = (state.output_counts, state.prompt_mask, state.allowed, slot_of, presence, frequency, repetition)
    tokens, cutoff = map(np.asarray, jax.jit(cpu.sample)(x, temperature, top_k, np.ones(rows, np.float32),
                                                         np.zeros(rows, np.float32), np.arange(rows, dtype=np.uint32),
                                                         np.zeros(rows, np.int32), bias_ids, bias_values, banned,
                                                         penalties))
    np.testing.assert_array_equal(tokens[:4], np.argmax(want[:4], axis=1))
    np.testing.assert_array_equal(tokens[4:7], np.argmax(want[4:7], axis=1))
    np.testing.assert_allclose(cutoff[4:7], want[4:7].max(axis=1), rtol=1e-6)
    assert set(tokens[7:9].tolist()) <= {7, 70, 170}
    assert not np.array_equal(want[:3], x[:3])  # the penalties changed those rows
    np.testing.assert_array_equal(want[3], x[3])  # no slot: nothing applied


@pytest.mark.skipif(not cpu.available(), reason="the native CPU kernels need a C++ compiler")
@pytest.mark.parametrize("vocab,num_top", [(37, 37), (1000, 5), (4099, 20), (300, 0)])
def test_native_token_logprobs_match_xla(vocab, num_top):
    """Against the sampler's XLA token_logprobs: the same top ids in lax.top_k's order (ties: the lower id
    first, rows of many ties), logprobs within float32 rounding, the rank as an exact count of larger logits
    (float64); a row with -inf logits, a token that is its row's maximum, a token outside the vocabulary."""
    from jaxengine.layers.sampler import token_logprobs

    rng = np.random.default_rng(vocab)
    rows = 24
    x = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    x[0] = np.round(x[0])  # many ties
    x[1, 3:] = -np.inf
    x[2, : vocab // 2] = 1.5
    tokens = rng.integers(0, vocab, rows).astype(np.int32)
    tokens[3] = int(np.argmax(x[3]))
    tokens[4] = vocab
    want = [np.asarray(a) for a in jax.jit(lambda x, t: token_logprobs(x, t, num_top))(x, tokens)]
    ids, top, chosen, rank = map(np.asarray, jax.jit(lambda x, t: cpu.token_logprobs(x, t, num_top))(x, tokens))
    np.testing.assert_array_equal(ids, want[0])
    np.testing.assert_allclose(top, want[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(chosen[np.arange(rows) != 4], want[2][np.arange(rows) != 4], rtol=1e-5, atol=1e-5)
    own = x[np.arange(rows), np.minimum(tokens, vocab - 1)]
    exact = (x.astype(np.float64) > own[:, None].astype(np.float64)).sum(axis=1) + 1
    np.testing.assert_array_equal(rank[np.arange(rows) != 4], exact[np.arange(rows) != 4])
    assert rank[3] == 1 and np.isnan(chosen[4]) and rank[4] == 1


@pytest.mark.skipif(not cpu.available(), reason="the native CPU kernels need a C++ compiler")
def test_native_sampler_refuses_other_shapes():
    x = jnp.zeros((2, 5))
    ones, zeros = jnp.ones(2), jnp.zeros(2)
    with pytest.raises(ValueError, match="top_k must be"):
        cpu.sample(x, ones, jnp.zeros(3, jnp.int32), ones, zeros, zeros, zeros)
    with pytest.raises(ValueError, match="float32 x"):
        cpu.sample(x.astype(jnp.bfloat16), ones, zeros, ones, zeros, zeros, zeros)
    with pytest.raises(ValueError, match="num_top"):
        cpu.token_logprobs(x, jnp.zeros(2, jnp.int32), 6)  # more than the vocabulary
    with pytest.raises(ValueError, match="tokens"):
        cpu.token_logprobs(x, jnp.zeros(3, jnp.int32), 2)


@pytest.mark.skipif(not cpu.int8_matmul_available(), reason="the native int8 matmul needs a CPU with AVX-512 VNNI")
@pytest.mark.parametrize("m, k, n", [(1, 64, 32), (5, 100, 70), (13, 576, 960), (64, 130, 33), (200, 96, 64)])
def test_native_int8_matmul_matches_the_w8a8_reference(m, k, n):
    """pack_int8 + matmul_int8 against quantization.int8_matmul (the XLA path's numbers): plain; with the rms_norm
    prologue, a residual and padding rows; a layer of stacked weights read in place."""
    from jaxengine.layers.norms import rms_norm
    from jaxengine.models.quantization import Int8Weight, int8_matmul

    rng = np.random.default_rng(m * 1000 + k + n)
    x = jnp.asarray(rng.standard_normal((m, k)) * 3, jnp.float32).at[0].set(0.0)  # a zero row: scale 0
    w = rng.integers(-128, 128, (3, k, n)).astype(np.int8)
    scale = (rng.random((3, n)) * 0.01).astype(np.float32)
    ref = int8_matmul(x, Int8Weight(jnp.asarray(w[1]), jnp.asarray(scale[1])))
    packed, comp, packed_scale = (jnp.asarray(a) for a in cpu.pack_int8(w[1], scale[1]))
    got = jax.jit(lambda x: cpu.matmul_int8(x, packed, comp, packed_scale, n))(x)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4 * float(jnp.abs(ref).max()))

    norm = jnp.asarray(rng.standard_normal(k), jnp.float32)
    residual = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
    live = max(m - 2, 1)
    stacked = [jnp.asarray(a) for a in cpu.pack_int8(w, scale)]
    got = jax.jit(lambda x, layer: cpu.matmul_int8(x, *stacked, n, prologue="rms_norm", norm=norm, eps=1e-5,
                                                   residual=residual, live_rows=live, layer=layer))(x, jnp.int32(2))
    ref = int8_matmul(rms_norm(x, norm, 1e-5), Int8Weight(jnp.asarray(w[2]), jnp.asarray(scale[2]))) + residual
    np.testing.assert_allclose(got[:live], ref[:live], rtol=1e-5, atol=1e-4 * float(jnp.abs(ref).max()))
    assert not np.any(np.asarray(got[live:]))


def test_native_int8_matmul_refuses_other_shapes():
    packed, comp, scale = (jnp.asarray(a) for a in cpu.pack_int8(np.ones((64, 32), np.int8), np.ones(32, np.float32)))
    with pytest.raises(ValueError, match="int8 matmul needs float32 x"):
        cpu.matmul_int8(jnp.zeros((2, 60), jnp.float32), packed, comp, scale, 32)
    with pytest.raises(ValueError, match="layer index with a stacked weight"):
        cpu.matmul_int8(jnp.zeros((2, 64), jnp.float32), packed, comp, scale, 32, layer=0)


@pytest.mark.skipif(not cpu.int8_matmul_available(), reason="the native int8 matmul needs a CPU with AVX-512 VNNI")
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("m, k, i", [(1, 64, 16), (13, 96, 112), (40, 130, 48)])
def test_native_int8_gated_mlp_matches_the_w8a8_reference(m, k, i, activation):
    """gated_int8 (the activation applied in registers) against act(int8 gate product) * (int8 up product), with
    the rms_norm prologue and padding rows; a plain matmul_int8 of the same packing splits back (unpack_gated)."""
    from jaxengine.layers.activations import ACTIVATIONS
    from jaxengine.models.quantization import Int8Weight, int8_matmul

    rng = np.random.default_rng(m + k + i)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    norm = jnp.asarray(rng.standard_normal(k), jnp.float32)
    gate, up = (rng.integers(-128, 128, (2, k, i)).astype(np.int8) for _ in range(2))
    gate_scale, up_scale = ((rng.random((2, i)) * 0.01).astype(np.float32) for _ in range(2))
    packed = [jnp.asarray(a) for a in cpu.pack_int8(cpu.gated_columns(gate, up),
                                                    cpu.gated_columns(gate_scale, up_scale))]
    live = max(m - 1, 1)
    got = jax.jit(lambda x: cpu.gated_int8(x, *packed, prologue="rms_norm", norm=norm, eps=1e-6, live_rows=live,
                                           layer=jnp.int32(1), activation=activation))(x)
    from jaxengine.layers.norms import rms_norm

    normed = rms_norm(x, norm, 1e-6)
    g = int8_matmul(normed, Int8Weight(jnp.asarray(gate[1]), jnp.asarray(gate_scale[1])))
    u = int8_matmul(normed, Int8Weight(jnp.asarray(up[1]), jnp.asarray(up_scale[1])))
    want = ACTIVATIONS[activation](g) * u
    np.testing.assert_allclose(got[:live], want[:live], rtol=2e-5, atol=2e-5 * float(jnp.abs(want).max()))
    assert not np.any(np.asarray(got[live:]))
    both = cpu.unpack_gated(cpu.matmul_int8(normed, *packed, 2 * i, layer=jnp.int32(1)))
    np.testing.assert_allclose(both[0], g, rtol=1e-5, atol=1e-4 * float(jnp.abs(g).max()))
    np.testing.assert_allclose(both[1], u, rtol=1e-5, atol=1e-4 * float(jnp.abs(u).max()))


def _weight_only(form: str, rng, k: int, n: int, group: int):
    """A stack of 2 weight-only quantized weights [2, k, n] in `form` (int4, int4 with zero points, fp8: every
    e4m3 value but NaN, subnormals and signed zeros included) with scales per group of `group` inputs -> (the
    native kernel's packed weight and scales, pack_bf16 of the weight dequantized in float32 and rounded)."""
    import ml_dtypes

    from jaxengine.models.quantization import WeightOnly

    scale = (rng.random((2, k // group, n)) * 0.1).astype(np.float32)
    if form == "fp8":
        codes = rng.integers(0, 256, (2, k, n)).astype(np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x3C  # no NaNs
        codes.reshape(-1)[:254] = [c for c in range(256) if c & 0x7F != 0x7F]
        values = codes.view(ml_dtypes.float8_e4m3fn)
        packed = cpu.pack_fp8_panels(values, scale)
        dequantized = WeightOnly(jnp.asarray(values), jnp.asarray(scale)).dequantized()
    else:
        values = rng.integers(-8, 8, (2, k, n)).astype(np.int8)
        zero = rng.integers(-8, 8, scale.shape).astype(np.int8) if form == "int4-zeros" else None
        packed = cpu.pack_int4_panels(values, scale, zero)
        dequantized = WeightOnly(jnp.asarray(values), jnp.asarray(scale),
                                 None if zero is None else jnp.asarray(zero)).dequantized()
    return tuple(jnp.asarray(a) for a in packed), cpu.pack_bf16(dequantized.astype(jnp.bfloat16))


@needs_native_matmul
@pytest.mark.parametrize("m, k, n, group, form", [
    (1, 64, 32, 16, "int4"), (5, 96, 70, 32, "int4-zeros"), (13, 112, 48, 112, "int4"), (64, 96, 64, 2, "int4-zeros"),
    (1, 64, 32, 16, "fp8"), (5, 96, 70, 32, "fp8"), (64, 96, 64, 2, "fp8")])
def test_native_dequantizing_matmul_is_the_bf16_matmul_of_the_dequantized_weight(m, k, n, group, form):
    """matmul_dequant (int4 panels, symmetric or with zero points, or fp8 ones, dequantized as taken) against
    matmul_bf16 of the dequantized weight rounded to bfloat16, with a stacked weight's layer, the rms_norm
    prologue, a residual and padding rows; gated_pairs_dequant feeding a rounded matmul_dequant against the
    bfloat16 pair of calls."""
    rng = np.random.default_rng(m + k + n)
    (packed, packed_scale), w = _weight_only(form, rng, k, n, group)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    norm = jnp.asarray(rng.standard_normal(k), jnp.float32)
    residual = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
    settings = dict(prologue="rms_norm", norm=norm, eps=1e-5, residual=residual, live_rows=max(m - 1, 1),
                    layer=jnp.int32(1))
    got = jax.jit(lambda x: cpu.matmul_dequant(x, packed, packed_scale, n, **settings))(x)
    want = jax.jit(lambda x: cpu.matmul_bf16(x, w, n, **settings))(x)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
    if n % 32 == 0:  # as a gate/up weight (pack_gated's order): its gated pairs, then a rounded down projection
        (down, down_s), down_bf16 = _weight_only(form, rng, n // 2, 32, n // 2)
        layer = jnp.int32(0)
        pairs = cpu.gated_pairs_dequant(x, packed, packed_scale, layer=layer)
        # the pairs a row holds (n / 4: the gated columns' pairs; the rest of its chunk is the kernels' padding)
        np.testing.assert_array_equal(pairs[:, :n // 4], cpu.gated_pairs(x, w, layer=layer)[:, :n // 4])
        np.testing.assert_allclose(cpu.matmul_dequant(pairs, down, down_s, 32, prologue="rounded", layer=layer),
                                   cpu.matmul_bf16(pairs, down_bf16, 32, prologue="rounded", layer=layer),
                                   rtol=1e-6, atol=1e-5)


def _mxfp4(rng, experts: int, n: int, k: int, low: int = 118, high: int = 131):
    """Random MXFP4 weights as GPT-OSS checkpoints store them (blocks [experts, n, k / 32, 16], every byte; scales
    [experts, n, k / 32] in [low, high)) -> (blocks, scales, the weights [experts, k, n] dequantized, float32)."""
    from jaxengine.models.quantization import dequantize_mxfp4

    blocks = rng.integers(0, 256, (experts, n, k // 32, 16), dtype=np.uint8)
    scales = rng.integers(low, high, (experts, n, k // 32), dtype=np.uint8)
    return blocks, scales, dequantize_mxfp4(blocks, scales).swapaxes(-1, -2)


@needs_native_matmul
def test_grouped_mxfp4_matmul_dequantizes_every_code_and_scale_exactly():
    """One-hot rows read each weight back: every byte's two float4 codes at every exponent from 2 to 252 (the
    exponent-field path) and at 0, 1, 253 and 254 (the float32 path; codes kept small there so that nothing
    overflows) come out as dequantize_mxfp4's values, bit for bit (signed zeros aside, which a sum of products
    does not keep; float32 subnormal results flush to zero, as bfloat16's conversion treats them), in calls of many
    rows (each panel dequantized once into the cache) and of one register block (in registers as it is multiplied).
    The groups' weights start at `first`; a group without rows reads none; rows past the groups come out zero."""
    rng = np.random.default_rng(21)
    S, n, k = 3, 80, 96  # 80 columns: a partial last panel
    blocks, scales, _ = _mxfp4(rng, S, n, k)
    scales[:] = rng.integers(2, 253, scales.shape, dtype=np.uint8)
    edge = rng.random(scales.shape) < 0.1
    scales[edge] = rng.choice(np.array([0, 1, 253, 254], np.uint8), edge.sum())
    blocks[scales[..., None].repeat(16, -1) >= 253] &= 0x33  # values of at most 1.5
    from jaxengine.models.quantization import dequantize_mxfp4

    w = dequantize_mxfp4(blocks, scales).swapaxes(-1, -2)
    codes, exponents = cpu.pack_mxfp4_panels(blocks, scales)
    assert codes.shape == (S, 3, k // 2, 32) and exponents.shape == (S, 3, k // 32, 32)
    x = jnp.asarray(np.eye(k, dtype=np.float32).repeat(2, 0))  # each one-hot row twice, 2k rows
    for first, sizes in ((0, [0, k, k]), (1, [k, 0])):
        got = np.asarray(cpu.grouped_matmul_mxfp4(x, codes, exponents, None, jnp.asarray(sizes, jnp.int32), first, n))
        row = 0
        for g, size in enumerate(sizes):
            if size:
                want = w[first + g].astype(jnp.bfloat16).astype(np.float32)
                want[np.abs(want) < np.finfo(np.float32).tiny] = 0
                np.testing.assert_array_equal(got[row:row + size], want[row // 2:(row + size) // 2].repeat(2, 0))
            row += size
        assert not got[row:].any()
    # calls of one register block (12 rows at most) dequantize in registers as they multiply
    call = jax.jit(lambda x, first: cpu.grouped_matmul_mxfp4(x, codes, exponents, None, jnp.asarray([12]), first, n))
    for first in range(S):
        want = w[first].astype(jnp.bfloat16).astype(np.float32)
        want[np.abs(want) < np.finfo(np.float32).tiny] = 0
        got = np.concatenate([np.asarray(call(x[start:start + 12], first)) for start in range(0, 2 * k, 12)])
        np.testing.assert_array_equal(got, want.repeat(2, 0))


@needs_native_matmul
@pytest.mark.parametrize("activation", ["swigluoai", "silu"])
def test_grouped_mxfp4_matmul_is_the_bf16_grouped_matmul_of_the_dequantized_weights(activation):
    """Against grouped_matmul_bf16 over pack_bf16 (pack_gated) of the dequantized weights: the stored products
    (plus the bias, which the kernel starts its sums from); the gated pairs (no bias: the same sums in the same
    order) through a down projection reading them rounded, bit for bit; refusals of wrong operands."""
    rng = np.random.default_rng(22)
    S, k, inter, d = 4, 64, 64, 80
    sizes = jnp.asarray([3, 0, 13, 5], jnp.int32)  # 21 of 24 rows: the last 3 a bucket's padding
    x = jnp.asarray(rng.standard_normal((24, k), np.float32) * 4)
    g_blocks, g_scales, gate = _mxfp4(rng, S, inter, k)
    u_blocks, u_scales, up = _mxfp4(rng, S, inter, k)
    d_blocks, d_scales, down = _mxfp4(rng, S, d, inter)
    bias = jnp.asarray(rng.standard_normal((S, inter)), jnp.float32)

    def gated(a, b):  # gate's and up's outputs (axis 1) in pack_gated's order: 16 of each in turn
        return np.concatenate([a, b], 1)[:, cpu.gated_columns(np.arange(inter), inter + np.arange(inter))]

    gu_blocks, gu_scales = gated(g_blocks, u_blocks), gated(g_scales, u_scales)
    gate_up = cpu.pack_mxfp4_panels(gu_blocks, gu_scales)
    order = cpu.gated_columns(np.arange(inter), inter + np.arange(inter))  # the same columns, taken in that order
    for got, want in zip(cpu.pack_mxfp4_panels(np.concatenate([g_blocks, u_blocks], 1),
                                               np.concatenate([g_scales, u_scales], 1), order), gate_up):
        np.testing.assert_array_equal(got, want)
    down_mx = cpu.pack_mxfp4_panels(d_blocks, d_scales)
    bf16 = {name: jnp.asarray(w).astype(jnp.bfloat16) for name, w in (("gate", gate), ("up", up), ("down", down))}
    # stored products: gate's weights alone, with a bias
    gate_mx = cpu.pack_mxfp4_panels(g_blocks, g_scales)
    got = cpu.grouped_matmul_mxfp4(x, *gate_mx, bias, sizes, 0, inter)
    plain = cpu.grouped_matmul_bf16(x, cpu.pack_bf16(bf16["gate"]), sizes, 0, inter)
    rows_bias = np.concatenate([np.repeat(np.asarray(bias)[g:g + 1], s, 0) for g, s in enumerate([3, 0, 13, 5])])
    np.testing.assert_allclose(np.asarray(got[:21]), np.asarray(plain[:21]) + rows_bias, rtol=0,
                               atol=1e-6 * np.abs(np.asarray(plain)).max())
    assert not np.asarray(got[21:]).any()
    # gated pairs, then the down projection over them
    pairs = cpu.grouped_matmul_mxfp4(x, *gate_up, None, sizes, 0, 2 * inter, epilogue="gated_pairs",
                                     activation=activation)
    want_pairs = cpu.grouped_matmul_bf16(x, cpu.pack_gated(bf16["gate"], bf16["up"]), sizes, 0, 2 * inter,
                                         epilogue="gated_pairs", activation=activation)
    out = cpu.grouped_matmul_mxfp4(pairs, *down_mx, None, sizes, 0, d, prologue="rounded")
    want = cpu.grouped_matmul_bf16(want_pairs, cpu.pack_bf16(bf16["down"]), sizes, 0, d, prologue="rounded")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    with pytest.raises(ValueError, match="grouped_matmul_mxfp4 needs"):
        cpu.grouped_matmul_mxfp4(x, *gate_mx, bias[:, :40], sizes, 0, inter)  # a bias short of the panels
    with pytest.raises(ValueError, match="grouped_matmul_mxfp4 needs"):
        cpu.grouped_matmul_mxfp4(x[:, :32], *gate_mx, None, sizes, 0, inter)
    with pytest.raises(ValueError, match="pack_mxfp4_panels needs"):
        cpu.pack_mxfp4_panels(g_blocks, g_scales[..., :1])
    with pytest.raises(ValueError, match="a permutation"):
        cpu.pack_mxfp4_panels(g_blocks, g_scales, np.zeros(inter, np.int64))
