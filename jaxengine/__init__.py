"""jaxengine: LLM inference and serving on JAX/XLA."""

__version__ = "0.1.0"
