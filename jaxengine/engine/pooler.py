"""A pooling sequence's embedding (or a classifier's probabilities), made on the host from the final hidden states
of its prompt's chunks."""

from pathlib import Path

import numpy as np

from jaxengine.pooling_params import PoolerConfig, PoolingParams


def _checkpoint_tensor(model_dir: Path, name: str) -> np.ndarray | None:
    """A tensor of the model directory's safetensors (memory-mapped), or None."""
    from jaxengine.models.loader import checkpoint_files
    from jaxengine.models.safetensors_io import read_safetensors

    return next((tensors[name] for tensors in map(read_safetensors, checkpoint_files(model_dir)) if name in tensors),
                None)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


class ClassifierHead:
    """A sequence classifier's `score` head ([labels, hidden], no bias) and its activation, applied on the host to
    the pooled hidden state: as transformers' loss (and vLLM) reads the config, `problem_type` regression none,
    multi-label sigmoid, otherwise softmax over two or more labels and sigmoid over one; a Sentence Transformers
    cross-encoder's own activation (Identity, Sigmoid or Softmax) where its config names one."""

    ACTIVATIONS = {"none": lambda x: x, "sigmoid": _sigmoid, "softmax": _softmax}

    def __init__(self, weight: np.ndarray, activation: str, labels: list[str]):
        self.weight, self.activation, self.labels = np.asarray(weight, np.float32), activation, labels

    @classmethod
    def load(cls, model_dir: Path, hf: dict, tokenizer) -> "ClassifierHead":
        """The checkpoint's `score.weight`; or, for a causal LM's checkpoint that the config (through
        hf_overrides, as vLLM's) makes a classifier by `classifier_from_token`, its output head's rows of those
        tokens: each token a label, or with `is_original_qwen3_reranker` (two tokens, "no" and "yes") one label,
        the difference of their rows, whose sigmoid is the two-way softmax's "yes" (vLLM's conversion)."""
        tokens = hf.get("classifier_from_token")
        if tokens is not None:
            return cls._from_tokens(model_dir, hf, tokenizer, tokens)
        weight = _checkpoint_tensor(model_dir, "score.weight")
        if weight is None:
            raise ValueError(f"{model_dir}: a sequence classifier's checkpoint needs its head, score.weight")
        num_labels = weight.shape[0]
        names = hf.get("id2label") or {}
        labels = [str(names.get(str(i), names.get(i, f"LABEL_{i}"))) for i in range(num_labels)]
        return cls(np.asarray(weight, np.float32), cls._activation(hf, num_labels), labels)

    @classmethod
    def _from_tokens(cls, model_dir: Path, hf: dict, tokenizer, tokens) -> "ClassifierHead":
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
            raise ValueError(f"classifier_from_token must be a list of tokens, got {tokens!r}")
        ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
        unknown = [t for t, i in zip(tokens, ids) if i is None or i == tokenizer.unk_token_id]
        if unknown:
            raise ValueError(f"classifier_from_token: {unknown} are not tokens of the model's vocabulary")
        head = _checkpoint_tensor(model_dir, "lm_head.weight")
        head = _checkpoint_tensor(model_dir, "model.embed_tokens.weight") if head is None else head
        if head is None:
            raise ValueError(f"{model_dir}: classifier_from_token needs the checkpoint's lm_head.weight (or tied "
                             f"model.embed_tokens.weight)")
        rows = np.asarray(head[ids], np.float32)
        if hf.get("is_original_qwen3_reranker"):
            if len(tokens) != 2:
                raise ValueError(f"is_original_qwen3_reranker takes two tokens (no, yes), got {tokens}")
            return cls(rows[1:] - rows[:1], "sigmoid", [tokens[1]])
        return cls(rows, cls._activation(hf, len(tokens)), list(tokens))

    @staticmethod
    def _activation(hf: dict, num_labels: int) -> str:
        problem = hf.get("problem_type")
        if problem == "regression":
            return "none"
        if problem == "multi_label_classification":
            return "sigmoid"
        named = (hf.get("sentence_transformers") or {}).get("activation_fn") or hf.get(
            "sbert_ce_default_activation_function")
        if named is not None and problem is None:
            known = {"torch.nn.modules.linear.Identity": "none", "torch.nn.modules.activation.Sigmoid": None,
                     "torch.nn.modules.activation.Softmax": None}
            if named not in known:
                raise ValueError(f"the classifier's activation {named!r} is not supported; supported: {sorted(known)}")
            if known[named] is not None:
                return known[named]
        return "softmax" if num_labels >= 2 else "sigmoid"

    def __call__(self, pooled: np.ndarray, activate: bool) -> np.ndarray:
        logits = self.weight @ np.asarray(pooled, np.float32)
        return self.ACTIVATIONS[self.activation](logits) if activate else logits


class PoolState:
    """The pooled state of one prompt as its chunks land (in order; a recomputation after preemption starts again
    at position 0). LAST keeps the last position's row, CLS the first's, MEAN a running sum; once the prompt's
    last position has landed, `data` holds the result: the first `dimensions` values, normalised to unit
    length where `use_activation` (each the request's, else the pooler's)."""

    def __init__(self, pooler: PoolerConfig, params: PoolingParams, prompt_len: int,
                 head: ClassifierHead | None = None):
        """`head`: a classifier's, which takes the pooled state (use_activation: its activation, not a norm)."""
        self.kind, self.head = pooler.pooling_type, head
        self.activate = pooler.use_activation if params.use_activation is None else params.use_activation
        self.dimensions = pooler.dimensions if params.dimensions is None else params.dimensions
        self.prompt_len = prompt_len
        self.pooled: np.ndarray | None = None  # CLS's row or MEAN's sum so far
        self.next = 0  # the position the next chunk starts at (CLS, MEAN)
        self.data: np.ndarray | None = None

    @property
    def reads_prefix_cache(self) -> bool:
        """LAST needs only the last position's state, which is always computed; MEAN and CLS need every
        position's (or the first's), which a cached prefix skips."""
        return self.kind == "LAST"

    def add(self, rows: np.ndarray, start: int) -> None:
        """`rows`: the final hidden states of prompt positions [start, start + len(rows))."""
        end = start + len(rows)
        if self.kind != "LAST":
            if start == 0:
                self.pooled, self.next = None, 0
            if start != self.next:
                raise AssertionError(f"a pooled prompt's chunk starts at {start}, expected {self.next}")
            self.next = end
            if self.kind == "CLS" and start == 0:
                self.pooled = np.asarray(rows[0], np.float32)
            elif self.kind == "MEAN":
                total = rows.sum(axis=0, dtype=np.float64)
                self.pooled = total if self.pooled is None else self.pooled + total
        if end < self.prompt_len:
            return
        if self.kind == "LAST":
            vector = np.asarray(rows[-1], np.float32)
        elif self.kind == "MEAN":
            vector = (self.pooled / self.prompt_len).astype(np.float32)
        else:
            vector = self.pooled
        if self.head is not None:
            self.data = self.head(vector, self.activate).astype(np.float32)
            return
        if self.dimensions is not None:
            vector = vector[: self.dimensions]
        if self.activate:
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        self.data = np.asarray(vector, np.float32)


def cross_encoder_ids(tokenizer, first: str, second: str) -> list[int]:
    """A classifier's scoring prompt for a pair of texts: the tokenizer's encoding of the pair, as vLLM makes it
    for cross-encoders."""
    return tokenizer(first, text_pair=second)["input_ids"]


def check_cross_encoder(head: "ClassifierHead") -> None:
    """A classifier scores pairs when it has one label (its score)."""
    if len(head.labels) != 1:
        raise ValueError(f"score: this classifier has {len(head.labels)} labels; scoring pairs needs one (a "
                         f"cross-encoder's score)")


def score_pairs(num_first: int, num_second: int) -> list[tuple[int, int]]:
    """The (first, second) index pairs that a score request of `num_first` and `num_second` texts compares, as
    vLLM pairs them: 1:1, 1:N (the one with each) or N:N (in order); a ValueError for anything else."""
    if num_first == 0 or num_second == 0:
        raise ValueError("score needs at least one text on each side")
    if num_first > 1 and num_first != num_second:
        raise ValueError(f"score inputs must pair 1:1, 1:N or N:N, got {num_first}:{num_second}")
    return [(0 if num_first == 1 else i, i) for i in range(num_second)]


def cosine_similarity(a: np.ndarray, b: np.ndarray) -> float:
    """As torch's: each norm clamped below at 1e-8."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (max(np.linalg.norm(a), 1e-8) * max(np.linalg.norm(b), 1e-8)))
