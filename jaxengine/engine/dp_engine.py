"""Data parallelism as independent engine replicas.

Each replica is an LLMEngine on its own `tensor_parallel_size` devices with its own KV pool and scheduler;
a new request goes to the replica with the fewest unfinished sequences. Steps are launched on every busy
replica before any is waited for, so the replicas' devices work at the same time.

Why replicas rather than one SPMD program with the batch sharded on 'data': an SPMD step forces every
replica to run the same bucket shapes in lockstep and would need the KV pool partitioned by replica inside
one array; replicas schedule independently (as vLLM's data-parallel engine cores do) and run exactly the
tensor-parallel step program.
"""

import jax

from jaxengine.config import EngineConfig
from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.outputs import RequestOutput


class DataParallelEngine:
    def __init__(self, config: EngineConfig, progress: bool = True):
        tp, dp = config.tensor_parallel_size, config.data_parallel_size
        if jax.process_count() > 1:
            raise ValueError("data_parallel_size > 1 is not supported across processes yet; use "
                             "tensor_parallel_size over all devices of the slice")
        devices = jax.devices()
        if tp * dp > len(devices):
            raise ValueError(f"tensor_parallel_size x data_parallel_size = {tp * dp} devices, but only "
                             f"{len(devices)} exist; use tp x dp <= {len(devices)}")
        self.replicas = [LLMEngine(config, progress, devices=devices[i * tp:(i + 1) * tp]) for i in range(dp)]
        first = self.replicas[0]
        self.config, self.tokenizer, self.model_config = config, first.tokenizer, first.model_config
        self.max_model_len, self.default_sampling = first.max_model_len, first.default_sampling
        self.validate, self.tokenize_prompt = first.validate, first.tokenize_prompt
        self.truncate_prompt = first.truncate_prompt
        self.runner_type, self.pooler, self.pooling_task = first.runner_type, first.pooler, first.pooling_task
        self.classifier, self.reasoning = first.classifier, first.reasoning
        self._owner: dict[str, LLMEngine] = {}

    @staticmethod
    def _load(engine: LLMEngine) -> int:
        return len(engine.scheduler.running) + len(engine.scheduler.waiting)

    def add_request(self, request_id: str, prompt, params=None, **kwargs) -> None:
        if request_id in self._owner:
            raise ValueError(f"request_id {request_id!r} is already in use")
        replica = min(self.replicas, key=self._load)
        replica.add_request(request_id, prompt, params, **kwargs)
        self._owner[request_id] = replica

    def abort_request(self, request_ids: str | list[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            if rid in self._owner:
                self._owner[rid].abort_request(rid)

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    def add_lora(self, lora_request) -> bool:
        return all([r.add_lora(lora_request) for r in self.replicas])

    def remove_lora(self, lora_int_id: int) -> bool:
        return all([r.remove_lora(lora_int_id) for r in self.replicas])

    def list_loras(self) -> set[int]:
        return self.replicas[0].list_loras()

    def reset_prefix_cache(self) -> bool:
        return not self.has_unfinished_requests() and all([r.reset_prefix_cache() for r in self.replicas])

    def step(self) -> list[RequestOutput]:
        busy = [r for r in self.replicas if r.has_unfinished_requests()]
        for replica in busy:
            replica.launch()
        outputs = [out for replica in busy for out in replica.land()]
        for out in outputs:
            if out.finished:
                self._owner.pop(out.request_id, None)
        return outputs


def create_engine(config: EngineConfig, progress: bool = True):
    """An LLMEngine, or data-parallel replicas of it when data_parallel_size > 1."""
    return DataParallelEngine(config, progress) if config.data_parallel_size > 1 else LLMEngine(config, progress)
