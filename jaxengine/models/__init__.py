from jaxengine.models.config import ModelConfig
from jaxengine.models.loader import load_model
from jaxengine.models.registry import SUPPORTED_ARCHITECTURES

__all__ = ["ModelConfig", "load_model", "SUPPORTED_ARCHITECTURES"]
