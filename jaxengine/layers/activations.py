"""The MLP gates' activations, by the names jaxengine.models.config.ACTIVATIONS gives transformers' ones."""

import functools

import jax

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),  # transformers' gelu_pytorch_tanh
    "relu": jax.nn.relu,
    "relu2": lambda x: jax.numpy.square(jax.nn.relu(x)),  # transformers' ReLUSquaredActivation
}
