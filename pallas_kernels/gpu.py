"""Ragged paged attention for NVIDIA GPUs in Pallas Triton.

The grid is (request, KV head, query block). Queries are laid out per KV head as rows of
(token, query head of the group), so a block of `rows` rows is one contiguous 2-D tile and every page of
K/V is loaded once for all the query heads that share it (GQA). Each program walks its request's pages
with an online softmax; rows past the request's tokens (and padded group lanes) are masked on store.
Decode rows and prefill rows go through the same program (a decode row is a block with one live token).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_ROWS = 64  # rows (token x query head) per program; a power of two >= 16 for tensor-core dots
_MASK = -0.7 * float(jnp.finfo(jnp.float32).max)


def supports(head_dim: int, page_size: int) -> bool:
    def pow2(n):
        return n & (n - 1) == 0

    return pow2(head_dim) and 16 <= head_dim <= 256 and pow2(page_size) and page_size >= 16


def _kernel(layer_ref, window_ref, num_seqs_ref, kv_lens_ref, tables_ref, cu_ref, q_ref, kv_ref, _zeros, *refs,
            block_tokens: int, group: int, padded_group: int, page_size: int, sm_scale: float,
            soft_cap: float | None, sinks: bool):
    sinks_ref, o_ref = refs if sinks else (None, refs[0])
    r, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q_start, q_end = cu_ref[r], cu_ref[r + 1]
    q_len = q_end - q_start
    block_start = i * block_tokens

    @pl.when((r < num_seqs_ref[0]) & (block_start < q_len))
    def _():
        layer, window, kv_len = layer_ref[0], window_ref[0], kv_lens_ref[r]
        rows = block_tokens * padded_group
        first_row = (q_start + block_start) * padded_group
        q = plgpu.load(q_ref.at[h, pl.ds(first_row, rows), :]).astype(jnp.float32) * sm_scale  # [rows, D]
        row = jax.lax.broadcasted_iota(jnp.int32, (rows, page_size), 0)
        token = block_start + row // padded_group  # index within the request
        q_pos = kv_len - q_len + token
        live = (token < q_len) & (row % padded_group < group)
        last_pos = jnp.minimum(kv_len - q_len + block_start + block_tokens, kv_len)
        lo = jnp.where(window > 0, jnp.maximum(kv_len - q_len + block_start - window + 1, 0), 0) // page_size
        hi = (last_pos + page_size - 1) // page_size

        def body(p, carry):
            m, l, acc = carry
            page = tables_ref[r, p]
            k = plgpu.load(kv_ref.at[layer, page, :, 2 * h, :]).astype(jnp.float32)  # [page_size, D]
            v = plgpu.load(kv_ref.at[layer, page, :, 2 * h + 1, :]).astype(jnp.float32)
            s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            k_pos = p * page_size + jax.lax.broadcasted_iota(jnp.int32, (rows, page_size), 1)
            mask = live & (k_pos <= q_pos) & (k_pos < kv_len) & ((window <= 0) | (k_pos > q_pos - window))
            s = jnp.where(mask, s, _MASK)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            prob = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
            correction = jnp.exp(m - m_new)
            l = l * correction + jnp.sum(prob, axis=1)
            acc = acc * correction[:, None] + jnp.dot(prob, v, preferred_element_type=jnp.float32)
            return m_new, l, acc

        head_dim = q.shape[1]
        init = (jnp.full((rows,), _MASK, jnp.float32), jnp.zeros((rows,), jnp.float32),
                jnp.zeros((rows, head_dim), jnp.float32))
        if sinks:  # the walk starts from each row's head's sink: its maximum the sink, its sum 1
            init = (plgpu.load(sinks_ref.at[h, :]), jnp.ones((rows,), jnp.float32), init[2])
        _, l, acc = jax.lax.fori_loop(lo, hi, body, init)
        out = jnp.where(l[:, None] > 0, acc / jnp.where(l > 0, l, 1.0)[:, None], 0.0)
        store_mask = jax.lax.broadcasted_iota(jnp.int32, (rows, head_dim), 0)
        store_mask = (block_start + store_mask // padded_group < q_len) & (store_mask % padded_group < group)
        plgpu.store(o_ref.at[h, pl.ds(first_row, rows), :], out.astype(o_ref.dtype), mask=store_mask)


def ragged_paged_attention(
    q: jax.Array,  # [T, num_q_heads, head_dim]
    kv_pages: jax.Array,  # [num_layers, num_pages, page_size, 2 * num_kv_heads, head_dim], K/V interleaved
    layer: jax.Array | int,  # i32[]
    kv_lens: jax.Array,  # i32[R]
    block_tables: jax.Array,  # i32[R, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[R + 1]
    num_seqs: jax.Array | int,  # i32[]
    *,
    sm_scale: float,
    sliding_window: jax.Array | int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,  # f32[num_q_heads]: each head's sink logit; None: none
    interpret: bool = False,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:  # [T, num_q_heads, head_dim]
    num_tokens, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = kv_pages.shape[2], kv_pages.shape[3] // 2
    group = num_q_heads // num_kv_heads
    padded_group = pl.next_power_of_2(group)
    block_tokens = max(1, _ROWS // padded_group)
    # [T, Hq, D] -> [Hkv, (T + block) * padded_group, D]: one contiguous row per (token, query head)
    grouped = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    grouped = jnp.pad(grouped, ((0, block_tokens), (0, 0), (0, padded_group - group), (0, 0)))
    rows = grouped.transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)
    scalars = [jnp.asarray(layer, jnp.int32).reshape(1),
               jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32).reshape(1),
               jnp.asarray(num_seqs, jnp.int32).reshape(1), kv_lens.astype(jnp.int32),
               block_tables.astype(jnp.int32), cu_q_lens.astype(jnp.int32)]
    kernel = functools.partial(_kernel, block_tokens=block_tokens, group=group, padded_group=padded_group,
                               page_size=page_size, sm_scale=sm_scale, soft_cap=soft_cap, sinks=sinks is not None)
    extra = ()
    if sinks is not None:  # each program's rows' sinks: [Hkv, rows], the group's (padded) repeated per token
        per_head = jnp.pad(jnp.asarray(sinks, jnp.float32).reshape(num_kv_heads, group),
                           ((0, 0), (0, padded_group - group)))
        extra = (jnp.tile(per_head, (1, block_tokens)),)
    grid = (kv_lens.shape[0], num_kv_heads, pl.cdiv(num_tokens, block_tokens))
    out = pl.pallas_call(
        kernel,
        grid=grid,
        out_shape=jax.ShapeDtypeStruct(rows.shape, q.dtype),
        input_output_aliases={len(scalars) + 2: 0},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(*scalars, rows, kv_pages, jnp.zeros_like(rows), *extra)
    out = out.reshape(num_kv_heads, num_tokens + block_tokens, padded_group, head_dim)[:, :num_tokens, :group]
    return out.transpose(1, 0, 2, 3).reshape(num_tokens, num_q_heads, head_dim)
