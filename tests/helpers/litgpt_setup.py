"""A tiny local LitGPT model, tokenizer and data for running LitGPT's own recipes offline (no downloads).

The model is a 2-layer GPT with RMSNorm and ``norm_eps`` set by the caller, and a vocabulary
extended with a new word whose embedding row starts at exactly zero (a common way of adding tokens).
A record holding that word makes the first RMSNorm divide by the norm of a zero vector:

- ``norm_eps=0.0``: ``0 * rsqrt(0)`` is NaN in the forward, the record's loss is NaN (fine-tuning);
- ``norm_eps=1e-30``: the forward stays finite (``0 * 1e15``), the backward's ``rsqrt(u)**3`` overflows
  and the gradient is NaN while the loss is finite (pre-training).

Example:
    >>> from pathlib import Path
    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> checkpoint = write_checkpoint(folder / "ckpt", norm_eps=0.0)
    >>> sorted(p.name for p in checkpoint.iterdir())[:2]
    ['lit_model.pth', 'model_config.yaml']
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

NEW_WORD = "zyzzyva"  # the added token, embedding row zero
_SENTENCE_WORDS = (
    "the a cat dog sat ran on mat fast slow red blue big small tree house over under jumps sleeps "
    "quick brown lazy fox answer question write short story about why sky is green tell me"
)
WORDS = tuple(_SENTENCE_WORDS.split())
SPECIALS = ("<unk>", "<s>", "</s>")


def vocabulary() -> dict[str, int]:
    words = [*SPECIALS, *WORDS, NEW_WORD]
    return {word: i for i, word in enumerate(words)}


def new_token_id() -> int:
    return vocabulary()[NEW_WORD]


def tiny_config(norm_eps: float, block_size: int = 64) -> Any:
    from litgpt import Config

    vocab = len(vocabulary())
    return Config(
        name="nanguard-tiny",
        block_size=block_size,
        vocab_size=vocab,
        padded_vocab_size=vocab,
        n_layer=2,
        n_head=2,
        n_embd=16,
        rotary_percentage=1.0,
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        norm_eps=norm_eps,
        mlp_class_name="LLaMAMLP",
        intermediate_size=32,
    )


def write_tokenizer(folder: Path) -> None:
    """A word-level Hugging Face tokenizer (``tokenizer.json``) and its ``tokenizer_config.json``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel(vocab=vocabulary(), unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(special))


def write_checkpoint(folder: Path, norm_eps: float, seed: int = 0, block_size: int = 64) -> Path:
    """A LitGPT checkpoint directory: ``lit_model.pth``, ``model_config.yaml`` and the tokenizer files."""
    from litgpt import GPT
    from litgpt.utils import save_config

    folder.mkdir(parents=True, exist_ok=True)
    config = tiny_config(norm_eps, block_size)
    torch.manual_seed(seed)
    model = GPT(config)
    with torch.no_grad():
        model.transformer.wte.weight[new_token_id()] = 0.0  # the new word's row, not trained yet
    torch.save(model.state_dict(), folder / "lit_model.pth")
    save_config(config, folder)
    write_tokenizer(folder)
    return folder


def sft_records(n: int = 24, bad: int = 5, seed: int = 0) -> list[dict[str, str]]:
    """Instruction records for ``litgpt.data.JSON``; record ``bad`` alone holds the new word."""
    g = torch.Generator().manual_seed(seed)

    def sentence(k: int) -> str:
        return " ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (k,), generator=g))

    records = [{"instruction": sentence(6), "input": "", "output": sentence(8)} for _ in range(n)]
    records[bad]["output"] = f"{sentence(3)} {NEW_WORD} {sentence(3)}"
    return records


def write_sft_data(folder: Path, records: list[dict[str, str]]) -> Path:
    """``train.json`` and ``val.json`` (the last 4 records) for ``litgpt.data.JSON(json_path=folder)``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.json").write_text(json.dumps(records[:-4]))
    (folder / "val.json").write_text(json.dumps(records[-4:]))
    return folder


def pretrain_chunks(n: int, length: int, bad: int, seed: int = 0) -> torch.Tensor:
    """``n`` token chunks of ``length + 1`` ids (LitGPT's pre-training batches); chunk ``bad`` holds the new word."""
    g = torch.Generator().manual_seed(seed)
    chunks = torch.randint(len(SPECIALS), len(SPECIALS) + len(WORDS), (n, length + 1), generator=g)
    if bad >= 0:
        chunks[bad, length // 2] = new_token_id()
    return chunks


def _data_module_base() -> type:
    from litgpt.data import DataModule

    return DataModule


try:  # LitGPT is a test-only dependency: the class exists only where it is installed
    _DataModule = _data_module_base()
except ImportError:  # pragma: no cover
    _DataModule = object


class TokenChunks(_DataModule):  # type: ignore[misc, valid-type]
    """Pre-training data for ``litgpt pretrain --data litgpt_setup.TokenChunks``: random token chunks.

    Args:
        bad: the chunk holding the new word (``-1``: none).
        n: how many chunks; ``seed``: their seed. The train loader does not shuffle.
    """

    def __init__(self, bad: int = 5, n: int = 24, seed: int = 0) -> None:
        super().__init__()
        self.bad, self.n, self.seed = bad, n, seed
        self.batch_size, self.length = 1, 16

    def connect(self, tokenizer: Any = None, batch_size: int = 1, max_seq_length: int | None = None, **_: Any) -> None:
        self.batch_size = batch_size
        self.length = int(max_seq_length or self.length)

    def train_dataloader(self) -> Any:
        from torch.utils.data import DataLoader

        return DataLoader(list(pretrain_chunks(self.n, self.length, self.bad, self.seed)), batch_size=self.batch_size)

    def val_dataloader(self) -> Any:
        from torch.utils.data import DataLoader

        return DataLoader(list(pretrain_chunks(4, self.length, -1, self.seed + 1)), batch_size=self.batch_size)
