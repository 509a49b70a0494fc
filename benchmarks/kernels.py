"""Times each ragged paged-attention body on 8B-class shapes (32 query heads, 8 KV heads, head_dim 128)
and prints one JSON object: achieved HBM bandwidth for decode, FLOP/s for prefill.

    python benchmarks/kernels.py [--bodies reference,gpu] [--dtype bfloat16] [--repeats 10]

Bodies default to what the backend runs natively (tpu on TPU, gpu on GPU, reference everywhere).
"""

import argparse
import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.bench import source_commit
from pallas_kernels import gpu, tpu
from pallas_kernels.reference import ragged_paged_attention as reference

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
BODIES = {"reference": reference, "tpu": tpu.ragged_paged_attention, "gpu": gpu.ragged_paged_attention}


def make_inputs(rng, num_seqs, context, q_len, page_size, dtype):
    pages_per_seq = -(-context // page_size)
    num_pages = pages_per_seq * num_seqs
    kv = jnp.asarray(rng.standard_normal((1, num_pages, page_size, 2 * KV_HEADS, HEAD_DIM)), dtype)
    tables = jnp.asarray(rng.permutation(num_pages).reshape(num_seqs, pages_per_seq), jnp.int32)
    q = jnp.asarray(rng.standard_normal((num_seqs * q_len, Q_HEADS, HEAD_DIM)), dtype)
    cu = jnp.arange(num_seqs + 1, dtype=jnp.int32) * q_len
    lens = jnp.full((num_seqs,), context, jnp.int32)
    return q, kv, jnp.int32(0), lens, tables, cu, jnp.int32(num_seqs)


def time_body(fn, args, repeats):
    run = jax.jit(lambda *a: fn(*a, sm_scale=HEAD_DIM ** -0.5))
    run(*args).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser()
    native = {"tpu": "tpu", "gpu": "gpu"}.get(jax.default_backend())
    parser.add_argument("--bodies", default=",".join(["reference"] + ([native] if native else [])))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--page-sizes", default="16,64,128")
    parser.add_argument("--contexts", default="1024,4096,8192")
    parser.add_argument("--decode-batch", type=int, default=32)
    parser.add_argument("--prefill-len", type=int, default=1024)
    args = parser.parse_args()
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)
    results = []
    for body in args.bodies.split(","):
        for page_size in map(int, args.page_sizes.split(",")):
            for context in map(int, args.contexts.split(",")):
                decode = make_inputs(rng, args.decode_batch, context, 1, page_size, dtype)
                t = time_body(BODIES[body], decode, args.repeats)
                kv_bytes = args.decode_batch * context * 2 * KV_HEADS * HEAD_DIM * dtype.itemsize
                results.append({"body": body, "kind": "decode", "page_size": page_size, "context": context,
                                "batch": args.decode_batch, "seconds": t, "hbm_gb_per_s": kv_bytes / t / 1e9})
                prefill_len = min(args.prefill_len, context)
                prefill = make_inputs(rng, 1, context, prefill_len, page_size, dtype)
                t = time_body(BODIES[body], prefill, args.repeats)
                # causal attention over the last prefill_len positions of the context: QK^T and PV
                pairs = prefill_len * (context - prefill_len) + prefill_len * (prefill_len + 1) / 2
                flops = 4 * pairs * Q_HEADS * HEAD_DIM
                results.append({"body": body, "kind": "prefill", "page_size": page_size, "context": context,
                                "q_len": prefill_len, "seconds": t, "tflop_per_s": flops / t / 1e12})
    print(json.dumps({"benchmark": "kernels", "commit": source_commit(), "backend": jax.default_backend(),
                      "devices": [d.device_kind for d in jax.devices()], "machine": platform.node(),
                      "dtype": dtype.name, "results": results}))


if __name__ == "__main__":
    main()
