"""Times one mixture-of-experts MLP (jaxengine.layers.moe.moe_mlp) on an OLMoE-class layer (64 experts, top 8,
hidden 2048, expert width 1024, bfloat16 weights; or `--shape gpt-oss-20b`: 32 experts, top 4, 2880 and 2880, biases
and the clamped SwiGLU) at several token counts, through each grouped matmul that runs here, and prints one JSON
object: median milliseconds per call and the weight bandwidth they imply.

    python benchmarks/moe_layer.py [--shape olmoe] [--tokens 1,16,64,256] [--repeats 5] [--paths ragged_dot,native]

`ragged_dot`: XLA's grouped dot (XLA:CPU computes it densely); `native`: the grouped native CPU matmul over
packed experts (CPUs with AVX-512 BF16 only); `native-mxfp4` (gpt-oss-20b's shape): the same over MXFP4 experts
(random codes and powers of two), dequantized panel by panel.
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

SHAPES = {"olmoe": (64, 8, 2048, 1024), "gpt-oss-20b": (32, 4, 2880, 2880)}  # experts, top k, hidden, width


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
    parser.add_argument("--shape", choices=list(SHAPES), default="olmoe")
    parser.add_argument("--tokens", default="1,16,64,256")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--paths", default="ragged_dot,native,native-mxfp4", help="those of them that apply")
    args = parser.parse_args()
    experts, top_k, hidden, width = SHAPES[args.shape]
    oai = args.shape == "gpt-oss-20b"
    wanted = args.paths.split(",")
    rng = np.random.default_rng(0)

    def weight(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32) / np.sqrt(shape[-2])).astype(jnp.bfloat16)

    router = weight(hidden, experts)
    gate, up, down = weight(experts, hidden, width), weight(experts, hidden, width), weight(experts, width, hidden)
    common = dict(top_k=top_k, renormalize=True, activation="swigluoai" if oai else "silu")
    biases = {}
    if oai:
        common |= dict(router_bias=weight(2, experts)[0], down_bias=weight(experts, 2, hidden)[:, 0])
        biases = dict(gate_bias=weight(experts, 2, width)[:, 0], up_bias=weight(experts, 2, width)[:, 0])
    paths = {"ragged_dot": lambda: jax.jit(lambda x: moe_mlp(x, router, gate=gate, up=up, down=down, **biases,
                                                             **common))}
    bytes_per_value = {"ragged_dot": 2, "native": 2, "native-mxfp4": 17 / 32}
    if jax.default_backend() == "cpu":
        from pallas_kernels import cpu

        if cpu.matmul_available():
            def native():
                if not oai:
                    gate_up = cpu.pack_gated(gate, up)
                    return jax.jit(lambda x: moe_mlp(x, router, gate_up=gate_up, down=cpu.pack_bf16(down), **common))
                gate_up = cpu.pack_gated(*(jnp.concatenate([w, biases[f"{name}_bias"][:, None]], 1)
                                           for name, w in (("gate", gate), ("up", up))))  # the loader's packing
                return jax.jit(lambda x: moe_mlp(x, router, gate_up=gate_up, down=cpu.pack_bf16(down),
                                                 folded_bias=True, **common))

            def native_mxfp4():
                from jaxengine.layers.moe import Mxfp4Experts

                def mxfp4(n, k):  # packed random codes, powers of two 2^-7 .. 2^-5
                    return cpu.pack_mxfp4_panels(rng.integers(0, 256, (experts, n, k // 32, 16), dtype=np.uint8),
                                                 rng.integers(120, 123, (experts, n, k // 32), dtype=np.uint8))

                bias = jnp.asarray(cpu.gated_columns(np.asarray(biases["gate_bias"], np.float32),
                                                     np.asarray(biases["up_bias"], np.float32)))
                gate_up = Mxfp4Experts(*mxfp4(2 * width, hidden), bias)
                packed_down = Mxfp4Experts(*mxfp4(hidden, width))
                return jax.jit(lambda x: moe_mlp(x, router, gate_up=gate_up, down=packed_down, **common))

            paths["native"] = native
            if oai:
                paths["native-mxfp4"] = native_mxfp4
    paths = {name: build() for name, build in paths.items() if name in wanted}
    results = []
    for tokens in map(int, args.tokens.split(",")):
        x = jnp.asarray(rng.standard_normal((tokens, hidden), np.float32))
        weights, routed = jax.jit(lambda x: jax.lax.top_k(x @ router.astype(jnp.float32), top_k))(x)
        touched = len(np.unique(np.asarray(routed)))
        for name, fn in paths.items():
            bytes_read = touched * 3 * hidden * width * bytes_per_value[name]  # the routed experts' weights
            ms = median_ms(fn, x, args.repeats)
            results.append(dict(path=name, tokens=tokens, experts_touched=touched, ms=round(ms, 2),
                                weight_gb_per_s=round(bytes_read / ms / 1e6, 1)))
            print(f"{name:>12} {tokens:>4} tokens ({touched} experts): {ms:8.2f} ms", flush=True)
    print(json.dumps(dict(benchmark="moe_layer", commit=source_commit(), machine=platform.processor() or
                          platform.machine(), backend=jax.default_backend(), shape=args.shape, experts=experts,
                          top_k=top_k, hidden=hidden, width=width, results=results)))


if __name__ == "__main__":
    main()
