"""A small built-in smoke-test model, created locally on first use: random weights and a byte-level BPE
tokenizer trained on Python's own sources. Its output is gibberish by design; it lets the engine, the CLI
and the server run on a fresh machine with no network."""

import inspect
import json
import logging
import os
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

DEMO_NAME = "jaxengine-demo-random-v1"
_CONFIG = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=1024, hidden_size=256,
    intermediate_size=688, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
    max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
    bos_token_id=1, eos_token_id=2, torch_dtype="float32", hidden_act="silu",
)
_SPECIALS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def demo_model_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jaxengine"
    return root / DEMO_NAME


def ensure_demo_model(path: Path | None = None) -> Path:
    path = Path(path or demo_model_dir())
    if not (path / "model.safetensors").is_file():
        logger.warning("creating the built-in demo model (random weights, smoke tests only) in %s", path)
        make_demo_model(path)
    return path


def make_demo_model(path: Path) -> None:
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    make_tokenizer(path, _CONFIG["vocab_size"])
    c = _CONFIG
    rng = np.random.default_rng(0)
    d, i, hd = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], d), "model.norm.weight": (d,)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes |= {
            p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (c["num_attention_heads"] * hd, d),
            p + "self_attn.k_proj.weight": (c["num_key_value_heads"] * hd, d),
            p + "self_attn.v_proj.weight": (c["num_key_value_heads"] * hd, d),
            p + "self_attn.o_proj.weight": (d, c["num_attention_heads"] * hd),
            p + "mlp.gate_proj.weight": (i, d), p + "mlp.up_proj.weight": (i, d), p + "mlp.down_proj.weight": (d, i),
        }
    tensors = {name: (np.ones(s) if len(s) == 1 else rng.normal(0, s[-1] ** -0.5, s)).astype(np.float32)
               for name, s in shapes.items()}
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(_CONFIG | {"_name_or_path": DEMO_NAME}, indent=1))
    (path / "README.md").write_text(f"# {DEMO_NAME}\n\nRandom weights: a smoke-test model, not a language model.\n")


def make_tokenizer(path: Path, vocab_size: int) -> None:
    """Byte-level BPE trained on local Python sources, saved as a transformers fast tokenizer with a chat
    template (special tokens: pad 0, bos 1, eos 2)."""
    import json as json_mod
    import textwrap

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([inspect.getsource(m) for m in (json_mod, textwrap, inspect)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>", additional_special_tokens=_SPECIALS[3:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
