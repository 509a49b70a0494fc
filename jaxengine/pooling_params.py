"""`PoolingParams` and the pooler's settings, with vLLM's names: what an embedding request asks of a pooling model."""

import dataclasses
import json
from pathlib import Path

from jaxengine.validation import check_field_types, field_error, is_integer

POOLING_TYPES = ("LAST", "MEAN", "CLS")  # the hidden state of the last token, the mean over tokens, the first's
POOLING_TASKS = ("embed", "classify")


@dataclasses.dataclass
class PoolingParams:
    """An embedding request's parameters, as vLLM's: `dimensions` keeps the first d dimensions of a Matryoshka
    model's embedding (refused for other models); `use_activation` normalises it to unit length (None: the
    pooler's setting, by default True); `truncate_prompt_tokens` keeps the prompt's last k tokens (-1: as many
    as max_model_len allows)."""

    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    use_activation: bool | None = None

    def __post_init__(self):
        check_field_types(self, optional_integers=("truncate_prompt_tokens", "dimensions"))
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise field_error(self, "use_activation", "true, false or None")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < -1:
            raise ValueError(f"truncate_prompt_tokens must be >= -1, got {self.truncate_prompt_tokens}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be >= 1, got {self.dimensions}")


@dataclasses.dataclass(frozen=True)
class PoolerConfig:
    """How a pooling engine turns a prompt's final hidden states into its embedding (vLLM's --pooler-config):
    `pooling_type` one of POOLING_TYPES, `use_activation` the default of the requests' (normalise), `dimensions`
    the default of theirs."""

    pooling_type: str = "LAST"
    use_activation: bool = True
    dimensions: int | None = None

    @classmethod
    def of(cls, model_dir: Path, override: dict | None) -> "PoolerConfig":
        """The model's pooler: a Sentence Transformers checkpoint's own (its modules.json: the Pooling module's
        mode, normalised where a Normalize module follows), else vLLM's default for embeddings (LAST,
        normalised); `override` (EngineConfig.pooler_config) over either."""
        override = dict(override or {})
        values = _sentence_transformers_pooler(Path(model_dir), with_type="pooling_type" not in override)
        unknown = sorted(set(override) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            hint = " (normalize is use_activation)" if "normalize" in unknown else ""
            raise ValueError(f"pooler_config: unknown keys {unknown}{hint}; known: pooling_type, use_activation, "
                             f"dimensions")
        values |= override
        kind = values.get("pooling_type", cls.pooling_type)
        if not isinstance(kind, str) or kind.upper() not in POOLING_TYPES:
            raise ValueError(f"pooler_config: pooling_type must be one of {', '.join(POOLING_TYPES)}, got {kind!r}")
        values["pooling_type"] = kind.upper()
        if not isinstance(values.get("use_activation", True), bool):
            raise ValueError(f"pooler_config: use_activation must be true or false, got {values['use_activation']!r}")
        dims = values.get("dimensions")
        if dims is not None and (not is_integer(dims) or dims < 1):
            raise ValueError(f"pooler_config: dimensions must be a positive integer or null, got {dims!r}")
        return cls(**values)


def _sentence_transformers_pooler(model_dir: Path, with_type: bool) -> dict:
    """use_activation and (`with_type`) pooling_type from a Sentence Transformers modules.json ({} without one).
    Its Pooling module's config names the mode (pooling_mode_lasttoken, _mean_tokens or _cls_token); a mode we
    do not compute (max, weighted mean, several at once) is refused rather than replaced."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return {}
    modules = json.loads(modules_file.read_text())
    types = [m.get("type", "") for m in modules]
    pooling = next((m for m in modules if m.get("type", "").endswith("models.Pooling")), None)
    values = {"use_activation": any(t.endswith("models.Normalize") for t in types)}
    if pooling is None or not with_type:
        return values
    config_file = model_dir / pooling.get("path", "") / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    modes = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
    chosen = [kind for key, kind in modes.items() if config.get(key)]
    others = sorted(k for k, v in config.items() if k.startswith("pooling_mode_") and v and k not in modes)
    if len(chosen) != 1 or others:
        raise ValueError(f"{config_file}: the Sentence Transformers pooling {sorted(chosen) + others} is not "
                         f"supported; one of pooling_mode_lasttoken, pooling_mode_mean_tokens or "
                         f"pooling_mode_cls_token is (or set pooler_config's pooling_type)")
    return values | {"pooling_type": chosen[0]}
