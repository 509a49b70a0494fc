"""Times one mixture-of-experts MLP (jaxengine.layers.moe.moe_mlp) on an OLMoE-class layer (64 experts, top 8,
hidden 2048, expert width 1024, bfloat16 weights) at several token counts, through each grouped matmul that
runs here, and prints one JSON object: median milliseconds per call and the weight bandwidth they imply.

    python benchmarks/moe_layer.py [--tokens 1,16,64,256] [--repeats 5]

`ragged_dot`: XLA's grouped dot (XLA:CPU computes it densely); `native`: the grouped native CPU matmul over
packed experts (CPUs with AVX-512 BF16 only).
"""

import argparse
import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.bench import source_commit
from jaxengine.layers.moe import moe_mlp

EXPERTS, TOP_K, HIDDEN, WIDTH = 64, 8, 2048, 1024


def median_ms(fn, x, repeats):
    fn(x).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,16,64,256")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)

    def weight(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32) / np.sqrt(shape[-2])).astype(jnp.bfloat16)

    router = weight(HIDDEN, EXPERTS)
    gate, up, down = weight(EXPERTS, HIDDEN, WIDTH), weight(EXPERTS, HIDDEN, WIDTH), weight(EXPERTS, WIDTH, HIDDEN)
    common = dict(top_k=TOP_K, renormalize=True, activation="silu")
    paths = {"ragged_dot": jax.jit(lambda x: moe_mlp(x, router, gate=gate, up=up, down=down, **common))}
    if jax.default_backend() == "cpu":
        from pallas_kernels import cpu

        if cpu.matmul_available():
            gate_up, packed_down = cpu.pack_gated(gate, up), cpu.pack_bf16(down)
            paths["native"] = jax.jit(lambda x: moe_mlp(x, router, gate_up=gate_up, down=packed_down, **common))
    results = []
    for tokens in map(int, args.tokens.split(",")):
        x = jnp.asarray(rng.standard_normal((tokens, HIDDEN), np.float32))
        weights, experts = jax.jit(lambda x: jax.lax.top_k(x @ router.astype(jnp.float32), TOP_K))(x)
        touched = len(np.unique(np.asarray(experts)))
        bytes_read = touched * 3 * HIDDEN * WIDTH * 2  # the routed experts' bfloat16 weights
        for name, fn in paths.items():
            ms = median_ms(fn, x, args.repeats)
            results.append(dict(path=name, tokens=tokens, experts_touched=touched, ms=round(ms, 2),
                                weight_gb_per_s=round(bytes_read / ms / 1e6, 1)))
            print(f"{name:>10} {tokens:>4} tokens ({touched} experts): {ms:8.2f} ms", flush=True)
    print(json.dumps(dict(benchmark="moe_layer", commit=source_commit(), machine=platform.processor() or
                          platform.machine(), backend=jax.default_backend(), experts=EXPERTS, top_k=TOP_K,
                          hidden=HIDDEN, width=WIDTH, results=results)))


if __name__ == "__main__":
    main()
