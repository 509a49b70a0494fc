"""What the scripts that make checkpoints scaled to this CPU share (make_deepseek.py, make_gpt_oss.py,
make_gpt_oss_20b.py, make_gemma4.py): the shared model's tokenizer, so that the shared workload's prompts (random
token ids) run on them, and its copy beside their weights.

Importing this module drops this folder from sys.path: its kernels.py would shadow the `kernels` package that
transformers imports. Import it before transformers.
"""

import shutil
import sys
from pathlib import Path

sys.path = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]


def shared_tokenizer(models: Path) -> tuple[Path, dict]:
    """(the shared model's folder under `models`, the config fields its tokenizer sets: vocab_size and the
    bos/eos/pad token ids)."""
    import transformers

    folder = Path(models) / "llama-135m"
    vocab = transformers.AutoTokenizer.from_pretrained(folder)
    return folder, dict(vocab_size=len(vocab), bos_token_id=vocab.bos_token_id, eos_token_id=vocab.eos_token_id,
                        pad_token_id=vocab.pad_token_id)


def copy_tokenizer(tokenizer: Path, out: Path) -> None:
    """The tokenizer's files (and chat template) from the folder `tokenizer` into `out`."""
    for f in Path(tokenizer).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.suffix == ".jinja":
            shutil.copy(f, Path(out) / f.name)
