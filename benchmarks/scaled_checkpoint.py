"""What the scripts that make checkpoints scaled to this CPU share (make_deepseek.py, make_gpt_oss.py,
make_gpt_oss_20b.py, make_gemma4.py): the shared model's tokenizer, so that the shared workload's prompts (random
token ids) run on them, its copy beside their weights, and a transformers model's random weights saved with it.

Importing this module drops this folder from sys.path: its kernels.py would shadow the `kernels` package that
transformers imports. Import it before transformers.
"""

import shutil
import sys
from pathlib import Path

sys.path = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]


def target(name: str) -> tuple[Path, Path, Path, dict]:
    """A maker's paths from its command line (MODELS_DIR): (MODELS_DIR, MODELS_DIR/`name`, the shared model's folder
    there, the config fields its tokenizer sets: vocab_size and the bos/eos/pad token ids)."""
    import transformers

    models = Path(sys.argv[1])
    folder = models / "llama-135m"
    vocab = transformers.AutoTokenizer.from_pretrained(folder)
    return models, models / name, folder, dict(vocab_size=len(vocab), bos_token_id=vocab.bos_token_id,
                                               eos_token_id=vocab.eos_token_id, pad_token_id=vocab.pad_token_id)


def save_random(model_class, config, out: Path, tokenizer: Path, spread=lambda name, p: None) -> None:
    """`model_class(config)`, built with torch seeded 0, its weights random and saved in bfloat16 to `out` with the
    tokenizer: normal with `spread(name, parameter)`'s deviation where it gives one, else norms at 1 and the others
    fan-in scaled ([out, in]: by the last axis; transformers' default initialisation is far smaller)."""
    import torch

    config.architectures = [model_class.__name__]
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            deviation = spread(name, p)
            if deviation is not None:
                p.normal_(0.0, deviation)
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    model.to(torch.bfloat16).save_pretrained(out)
    copy_tokenizer(tokenizer, out)


def copy_tokenizer(tokenizer: Path, out: Path) -> None:
    """The tokenizer's files (and chat template) from the folder `tokenizer` into `out`."""
    for f in Path(tokenizer).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.suffix == ".jinja":
            shutil.copy(f, Path(out) / f.name)
