"""Ragged paged attention for TPU in Pallas Mosaic.

One kernel call covers the whole mixed batch. The grid is (request, KV head): each program walks its
request's queries in blocks and, for each block, the request's pages with an online softmax. Pages are
fetched by manual DMA from the pool in HBM with double buffering (the next page's copy is in flight while
the current one is used); the query heads that share a KV head (GQA) are processed together, so each page
is fetched once per KV head. Decode rows (one query token) take a specialised path with a one-row block.

Block tables, lengths, the layer index and the sliding window arrive by scalar prefetch (SMEM). Rows of
the output beyond the real tokens stay zero. Output blocks of a request may spill up to `block_q - 1`
rows past its last token; requests run in order on an 'arbitrary' grid axis, so the next request's
blocks overwrite that spill, and the output is padded by one block for the last one.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# Scoped VMEM the kernel may use, per TPU generation (bytes); the block size is chosen to fit.
VMEM_BUDGET = {"v4": 16 << 20, "v5e": 16 << 20, "v5p": 16 << 20, "v6e": 32 << 20, "default": 16 << 20}
SUPPORTED_HEAD_DIMS = (64, 128, 256)
_MAX_BLOCK_Q = 128


def supports(head_dim: int, page_size: int) -> bool:
    return head_dim in SUPPORTED_HEAD_DIMS and page_size % 8 == 0


def block_q_for(head_dim: int, page_size: int, group: int, generation: str = "default") -> int:
    """The largest power-of-two query block whose working set fits the generation's VMEM budget."""
    budget = VMEM_BUDGET.get(generation, VMEM_BUDGET["default"])
    kv_bytes = 2 * page_size * 2 * head_dim * 4  # double-buffered K/V page
    block = _MAX_BLOCK_Q
    while block > 8 and kv_bytes + 4 * block * group * (3 * head_dim + page_size) > budget:
        block //= 2
    return block


def _kernel(layer_ref, kv_lens_ref, tables_ref, cu_ref, num_seqs_ref, window_ref,  # scalar prefetch (SMEM)
            q_hbm, kv_hbm, _zeros, *refs,  # HBM refs (the sinks in SMEM where given), then scratch
            block_q: int, page_size: int, group: int, sm_scale: float, soft_cap: float | None, sinks: bool):
    sinks_ref = refs[0] if sinks else None
    o_hbm, q_dec, o_dec, q_pre, o_pre, kv_buf, sems = refs[1:] if sinks else refs
    r, h = pl.program_id(0), pl.program_id(1)
    layer, window = layer_ref[0], window_ref[0]

    @pl.when(r < num_seqs_ref[0])
    def _():
        q_start = cu_ref[r]
        q_len = cu_ref[r + 1] - q_start
        kv_len = kv_lens_ref[r]
        first_pos = kv_len - q_len

        def page_copy(p, slot):
            page = tables_ref[r, p]
            return pltpu.make_async_copy(kv_hbm.at[layer, page, :, pl.ds(2 * h, 2), :], kv_buf.at[slot],
                                         sems.at[slot])

        def attend(q_vmem, o_vmem, rows, block_start):
            """Queries block_start .. block_start + rows of the request against its pages."""
            start = q_start + block_start
            copy_q = pltpu.make_async_copy(q_hbm.at[pl.ds(start, rows), pl.ds(h * group, group), :], q_vmem,
                                           sems.at[2])
            copy_q.start()
            copy_q.wait()
            head_dim = q_vmem.shape[-1]
            q = q_vmem[...].astype(jnp.float32).reshape(rows * group, head_dim) * sm_scale
            row_token = jax.lax.broadcasted_iota(jnp.int32, (rows * group, page_size), 0) // group
            q_pos = first_pos + block_start + row_token  # [rows * group, page_size]
            row_valid = block_start + row_token < q_len
            last_pos = jnp.minimum(first_pos + block_start + rows, kv_len)  # exclusive
            lo = jnp.where(window > 0, jnp.maximum(first_pos + block_start - window + 1, 0), 0) // page_size
            hi = (last_pos + page_size - 1) // page_size

            @pl.when(lo < hi)
            def _():
                page_copy(lo, 0).start()

            def body(p, carry):
                m, l, acc = carry
                slot = (p - lo) % 2
                page_copy(p, slot).wait()

                @pl.when(p + 1 < hi)
                def _():
                    page_copy(p + 1, 1 - slot).start()

                kv = kv_buf[slot].astype(jnp.float32)  # [page_size, 2, head_dim]
                k, v = kv[:, 0, :], kv[:, 1, :]
                s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                if soft_cap is not None:
                    s = soft_cap * jnp.tanh(s / soft_cap)
                k_pos = p * page_size + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
                mask = (k_pos <= q_pos) & (k_pos < kv_len) & row_valid
                mask &= (window <= 0) | (k_pos > q_pos - window)
                s = jnp.where(mask, s, -jnp.inf)
                m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                prob = jnp.exp(s - m_safe)
                correction = jnp.exp(jnp.where(m == -jnp.inf, -jnp.inf, m - m_safe))
                l = l * correction + jnp.sum(prob, axis=1, keepdims=True)
                acc = acc * correction + jnp.dot(prob, v, preferred_element_type=jnp.float32)
                return m_new, l, acc

            n = rows * group
            init = (jnp.full((n, 1), -jnp.inf, jnp.float32), jnp.zeros((n, 1), jnp.float32),
                    jnp.zeros((n, head_dim), jnp.float32))
            if sinks:  # the walk starts from each head's sink: its maximum the sink, its sum 1
                lane = jax.lax.broadcasted_iota(jnp.int32, (n, 1), 0) % group
                m0 = init[0]
                for g in range(group):
                    m0 = jnp.where(lane == g, sinks_ref[h * group + g], m0)
                init = (m0, jnp.ones((n, 1), jnp.float32), init[2])
            _, l, acc = jax.lax.fori_loop(lo, hi, body, init)
            out = jnp.where(l > 0, acc / jnp.where(l > 0, l, 1.0), 0.0)
            o_vmem[...] = out.reshape(rows, group, head_dim).astype(o_vmem.dtype)
            copy_o = pltpu.make_async_copy(o_vmem, o_hbm.at[pl.ds(start, rows), pl.ds(h * group, group), :],
                                           sems.at[3])
            copy_o.start()
            copy_o.wait()

        @pl.when(q_len == 1)
        def _decode():
            attend(q_dec, o_dec, 1, 0)

        @pl.when(q_len > 1)
        def _prefill():
            def one_block(i, _):
                attend(q_pre, o_pre, block_q, i * block_q)
                return 0

            jax.lax.fori_loop(0, (q_len + block_q - 1) // block_q, one_block, 0)


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
    interpret=False,  # False on TPU; pltpu.InterpretParams() to run on CPU
    generation: str = "default",
) -> jax.Array:  # [T, num_q_heads, head_dim]
    num_tokens, num_q_heads, head_dim = q.shape
    page_size, kv_width = kv_pages.shape[2], kv_pages.shape[3]
    num_kv_heads = kv_width // 2
    group = num_q_heads // num_kv_heads
    num_reqs = kv_lens.shape[0]
    block_q = block_q_for(head_dim, page_size, group, generation)
    padded = jnp.pad(q, ((0, block_q), (0, 0), (0, 0)))  # DMAs of the last block stay in bounds
    scalars = (jnp.asarray(layer, jnp.int32).reshape(1), kv_lens.astype(jnp.int32), block_tables.astype(jnp.int32),
               cu_q_lens.astype(jnp.int32), jnp.asarray(num_seqs, jnp.int32).reshape(1),
               jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32).reshape(1))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(_kernel, block_q=block_q, page_size=page_size, group=group, sm_scale=sm_scale,
                               soft_cap=soft_cap, sinks=sinks is not None)
    extra = () if sinks is None else (jnp.asarray(sinks, jnp.float32).reshape(num_q_heads),)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars),
            grid=(num_reqs, num_kv_heads),
            in_specs=[any_spec, any_spec, any_spec] + [pl.BlockSpec(memory_space=pltpu.SMEM)] * len(extra),
            out_specs=any_spec,
            scratch_shapes=[
                pltpu.VMEM((1, group, head_dim), q.dtype), pltpu.VMEM((1, group, head_dim), q.dtype),
                pltpu.VMEM((block_q, group, head_dim), q.dtype), pltpu.VMEM((block_q, group, head_dim), q.dtype),
                pltpu.VMEM((2, page_size, 2, head_dim), kv_pages.dtype), pltpu.SemaphoreType.DMA((4,)),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(padded.shape, q.dtype),
        input_output_aliases={len(scalars) + 2: 0},  # the zeros below become the output
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        interpret=interpret,
    )(*scalars, padded, kv_pages, jnp.zeros_like(padded), *extra)
    return out[:num_tokens]


def _write_kernel(layer_ref, pages_ref, offsets_ref, new_ref, _pool_in, pool_hbm, sem):
    t = pl.program_id(0)
    page = pages_ref[t]

    @pl.when(page >= 0)
    def _():
        copy = pltpu.make_async_copy(new_ref.at[0], pool_hbm.at[layer_ref[0], page, offsets_ref[t]], sem)
        copy.start()
        copy.wait()


def write_kv(
    kv_pages: jax.Array,  # [num_layers, num_pages, page_size, 2 * num_kv_heads, head_dim], updated in place
    layer: jax.Array | int,  # i32[]
    new_kv: jax.Array,  # [T, 2 * num_kv_heads, head_dim], K/V interleaved
    pages: jax.Array,  # i32[T]: destination page; -1 = padding, not written
    offsets: jax.Array,  # i32[T]: slot within the page
    *,
    interpret=False,
) -> jax.Array:
    """The companion kernel: each token's K/V row goes by DMA straight into its page (the pool is aliased,
    so nothing else is copied)."""
    num_tokens, kv_width, head_dim = new_kv.shape
    scalars = (jnp.asarray(layer, jnp.int32).reshape(1), pages.astype(jnp.int32), offsets.astype(jnp.int32))
    return pl.pallas_call(
        _write_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars),
            grid=(num_tokens,),
            in_specs=[pl.BlockSpec((1, kv_width, head_dim), lambda t, *_: (t, 0, 0)),
                      pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.SemaphoreType.DMA(())],
        ),
        out_shape=jax.ShapeDtypeStruct(kv_pages.shape, kv_pages.dtype),
        input_output_aliases={len(scalars) + 1: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
    )(*scalars, new_kv.astype(kv_pages.dtype), kv_pages)
