"""The MLP gates' activations, by the names jaxengine.models.config.ACTIVATIONS gives transformers' ones."""

import functools

import jax
import jax.numpy as jnp

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),  # transformers' gelu_pytorch_tanh
    "relu": jax.nn.relu,
    "relu2": lambda x: jax.numpy.square(jax.nn.relu(x)),  # transformers' ReLUSquaredActivation
}


def xielu(x, alpha_p, alpha_n, beta, eps):
    """xIELU (Apertus's MLP activation; its parameters a layer's own scalars, as the checkpoint holds them:
    alpha_p and alpha_n before their softplus): a x^2 + beta x above 0, (expm1(min(x, eps)) - x) b + beta x below,
    a = softplus(alpha_p), b = beta + softplus(alpha_n); in float32."""
    y = x.astype(jnp.float32)
    a, b = jax.nn.softplus(alpha_p), beta + jax.nn.softplus(alpha_n)
    return jnp.where(y > 0, a * y * y + beta * y, (jnp.expm1(jnp.minimum(y, eps)) - y) * b + beta * y).astype(x.dtype)
