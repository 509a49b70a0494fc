"""jaxengine: LLM inference and serving on JAX/XLA."""

from jaxengine.config import EngineConfig
from jaxengine.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.llm import LLM
from jaxengine.lora import LoRARequest
from jaxengine.outputs import (ClassificationOutput, ClassificationRequestOutput, CompletionOutput, EmbeddingOutput,
                               EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput, RequestOutput,
                               ScoringOutput, ScoringRequestOutput)
from jaxengine.pooling_params import PoolingParams
from jaxengine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
           "CompletionOutput", "RequestOutputKind", "PoolingParams", "PoolingOutput", "PoolingRequestOutput",
           "EmbeddingOutput", "EmbeddingRequestOutput", "ScoringOutput", "ScoringRequestOutput", "ClassificationOutput",
           "ClassificationRequestOutput", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "LoRARequest"]
