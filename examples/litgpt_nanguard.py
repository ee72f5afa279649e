"""LitGPT's own recipes with the guard switched on by ``NANGUARD=1``: no code change, nothing downloaded.

Run from the repository root (after ``bash scripts/demo.sh`` or ``bash scripts/test.sh`` made ``.venv``)::

    .venv/bin/python examples/litgpt_nanguard.py                 # finetune_lora
    .venv/bin/python examples/litgpt_nanguard.py finetune_full
    .venv/bin/python examples/litgpt_nanguard.py pretrain        # torch.compile, bf16-mixed, clipping
    .venv/bin/python examples/litgpt_nanguard.py finetune_lora --no-guard   # the same run, unguarded

It writes a tiny LitGPT checkpoint (a 2-layer GPT, 6.5 K parameters, a word-level tokenizer) and data
under ``nanguard_demo_logs/litgpt/<recipe>/``, prints the ``litgpt`` command and runs it with
``NANGUARD=1`` in its environment, exactly as you would run yours. The model's vocabulary was extended
with a new word whose embedding row starts at exactly zero (a common way of adding tokens), and its
RMSNorm has no epsilon worth the name. One record holds that word, and the first RMSNorm divides by
the norm of a zero vector:

- ``norm_eps=0.0`` (fine-tuning): ``0 * rsqrt(0)`` is NaN in the forward, the record's loss is NaN;
- ``norm_eps=1e-30`` (pre-training): the forward stays finite (``0 * 1e15``), the backward's
  ``rsqrt(u) ** 3`` overflows and the gradient is NaN while the loss is finite.

Unguarded, fine-tuning ends with exit code 0 and a checkpoint (or LoRA adapter) that is entirely NaN,
and pre-training dies in ``fabric.clip_gradients``. Guarded, the step is skipped, the event names record
5 with the module (``transformer.h.0.norm_1``), the op and LitGPT's source line, and the checkpoint is
finite. ``tests/integration/test_litgpt.py`` runs these commands.

Example:
    >>> from pathlib import Path
    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> checkpoint = write_checkpoint(folder / "ckpt", norm_eps=0.0)
    >>> sorted(p.name for p in checkpoint.iterdir())[:2]
    ['lit_model.pth', 'model_config.yaml']
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
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
    """Pre-training data for ``litgpt pretrain --data litgpt_nanguard.TokenChunks``: random token chunks.

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


RECIPES = ("finetune_lora", "finetune_full", "pretrain")
BAD = 5  # the record (fine-tuning) and the chunk (pre-training) holding the new word


def recipe_arguments(recipe: str, folder: Path, bad: int = BAD) -> list[str]:
    """Write the checkpoint and data for ``recipe`` under ``folder``; the ``litgpt`` CLI arguments to run it."""
    if recipe == "pretrain":
        checkpoint = write_checkpoint(folder / "checkpoint", norm_eps=1e-30, block_size=16)
        args = ["pretrain", "nanguard-tiny", "--model_config", str(checkpoint / "model_config.yaml")]
        args += ["--initial_checkpoint_dir", str(checkpoint), "--precision", "bf16-mixed", "--devices", "1"]
        args += ["--data", "litgpt_nanguard.TokenChunks", "--data.bad", str(bad)]
        args += ["--train.global_batch_size", "4", "--train.micro_batch_size", "2", "--train.max_tokens", "384"]
        args += ["--train.lr_warmup_steps", "1", "--train.save_interval", "null", "--train.max_norm", "1.0"]
        args += ["--eval.interval", "1000", "--eval.max_iters", "1", "--eval.final_validation", "false"]
        return [*args, "--logger_name", "tensorboard", "--out_dir", str(folder / "out")]
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    checkpoint = write_checkpoint(folder / "checkpoint", norm_eps=0.0)
    data = write_sft_data(folder / "data", sft_records(bad=bad))
    args = [recipe, str(checkpoint), "--precision", "32-true", "--data", "JSON", "--data.json_path", str(data)]
    args += ["--data.num_workers", "0", "--train.global_batch_size", "4", "--train.micro_batch_size", "2"]
    args += ["--train.epochs", "1", "--train.lr_warmup_steps", "1", "--train.save_interval", "null"]
    args += ["--eval.interval", "1000", "--eval.max_new_tokens", "4", "--eval.max_iters", "1"]
    args += ["--eval.initial_validation", "false", "--eval.final_validation", "false", "--logger_name", "csv"]
    if recipe == "finetune_lora":
        args += ["--lora_r", "4", "--lora_alpha", "8", "--lora_query", "true", "--lora_value", "true"]
    return [*args, "--out_dir", str(folder / "out")]


def recipe_environment(guard: bool, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a recipe runs in: ``NANGUARD=1`` (or not), and this folder importable (``TokenChunks``)."""
    here = str(Path(__file__).resolve().parent)
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
    for name in ("NANGUARD", "NANGUARD_DIR", "NANGUARD_ARGS"):
        environment.pop(name, None)
    if guard:
        environment["NANGUARD"] = "1"
    environment.update(extra or {})
    return environment


def final_checkpoint(out_dir: Path) -> Path:
    """Where the recipe saved its final weights (the LoRA recipe: only the adapter)."""
    lora = out_dir / "final" / "lit_model.pth.lora"
    return lora if lora.exists() else out_dir / "final" / "lit_model.pth"


def all_finite(path: Path) -> bool:
    """Whether every floating-point tensor in the checkpoint is finite (read with ``weights_only=False``:
    pre-training saves its data loader too; only for files you made)."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    state = state.get("model", state)
    return all(bool(torch.isfinite(t).all()) for t in state.values() if torch.is_tensor(t) and t.is_floating_point())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default="finetune_lora", choices=RECIPES)
    parser.add_argument("--no-guard", action="store_true", help="run without NANGUARD=1, to see the failure")
    parser.add_argument("--folder", type=Path, default=Path("nanguard_demo_logs") / "litgpt")
    args = parser.parse_args()
    folder = (args.folder / args.recipe).resolve()
    arguments = recipe_arguments(args.recipe, folder)
    shown = " ".join(arguments)
    print(f"$ {'' if args.no_guard else 'NANGUARD=1 '}litgpt {shown}\n", flush=True)
    done = subprocess.run([sys.executable, "-m", "litgpt", *arguments], env=recipe_environment(not args.no_guard))
    out_dir = folder / "out"
    final = final_checkpoint(out_dir)
    events = sorted(out_dir.rglob("events.jsonl"))
    print(f"\nexit code {done.returncode}")
    print(f"final checkpoint: {final if final.exists() else 'none'}", end="")
    print(f" ({'finite' if all_finite(final) else 'NOT finite'})" if final.exists() else "")
    for path in events:
        for line in path.read_text().splitlines():
            event = json.loads(line)
            print(
                f"event at step {event['global_step']}: {event['kinds']} -> {event['action']}; records "
                f"{event['dataset_indices']}, {event['culprit_module']} ({event['culprit_op']})"
            )
        print(f"events: {path}")


if __name__ == "__main__":
    main()
