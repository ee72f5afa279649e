"""What the attention precursor watch costs per step, measured side by side in one process.

Run from the repository root::

    python -m benchmarks.precursor_cost                    # 3 models, 60 alternating pairs each
    python -m benchmarks.precursor_cost --pairs 30 --accelerator cuda

The watch works inside the forward pass of one optimizer step in ``precursor_every_n_steps`` (10):
module hooks on the attention modules and, inside them, one ``q @ k^T`` of the guard's 4 batch rows
per attention call with a few reductions. For each model this script times, in alternation, a whole
training step (forward, backward, AdamW) and the same step with the forward under the watch
(``AttentionProbe.measuring()``, after its first pass has found the attention modules, as in a run);
the median of the paired differences over the median step is the share one sampled step adds, and a
tenth of it is the default's share. Pairs alternate so drift in the machine's speed hits both
alike. Models: the benchmark's GPT-2-shaped stack (12 blocks of SDPA attention), torch's
``TransformerEncoder`` (``nn.MultiheadAttention``) and a Hugging Face GPT-2 from a tiny config
(eager attention, 4 layers).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from benchmarks.models import MODELS, make
from lightning_nanguard.detect.attention import AttentionProbe
from lightning_nanguard.detect.precursors import PrecursorSettings

EVERY_N_STEPS = PrecursorSettings().every_n_steps  # NanGuard's precursor_every_n_steps default
ROWS = PrecursorSettings().rows  # the batch rows the guard measures per attention call


def _hf_gpt2(device: torch.device) -> tuple[nn.Module, Callable[[], Tensor]]:
    import transformers

    config = transformers.GPT2Config(n_layer=4, n_head=4, n_embd=128, vocab_size=1024, n_positions=128)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).to(device)
    ids = torch.randint(1024, (8, 64), generator=torch.Generator().manual_seed(0)).to(device)
    return model, lambda: model(ids, labels=ids).loss


def _bench_model(name: str, device: torch.device) -> tuple[nn.Module, Callable[[], Tensor]]:
    module, loader = make(name)
    module = module.to(device)
    batch = [t.to(device) for t in next(iter(loader))]
    return module, lambda: module.training_step(batch, 0)


MAKERS: dict[str, Callable[[torch.device], tuple[nn.Module, Callable[[], Tensor]]]] = {
    "GPT-2-small-shaped (12x256, 4x64 tokens)": lambda d: _bench_model("GPT-2-small-shaped (12x256, 4x64 tokens)", d),
    "transformer (2 layers)": lambda d: _bench_model("transformer (2 layers)", d),
    "HF GPT-2 (4x128, eager)": _hf_gpt2,
}
assert set(MAKERS) - {"HF GPT-2 (4x128, eager)"} <= set(MODELS)


def _step(
    model: nn.Module, loss_of: Callable[[], Tensor], optimizer: torch.optim.Optimizer, probe: AttentionProbe | None
) -> float:
    sync = torch.cuda.synchronize if next(model.parameters()).is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    if probe is None:
        loss = loss_of()
    else:
        with probe.measuring():
            loss = loss_of()
        probe.take()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sync()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=60)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--models", nargs="*", default=list(MAKERS))
    parser.add_argument(
        "--rows", type=int, default=ROWS, help=f"batch rows measured per attention call (default {ROWS}, the guard's)"
    )
    args = parser.parse_args()
    torch.set_num_threads(2)
    device = torch.device("cuda" if args.accelerator == "cuda" else "cpu")
    print(f"{'model':42s} {'step':>9s} {'sampled step adds':>18s} {'default (1 in 10)':>18s}  attention modules")
    for name in args.models:
        model, loss_of = MAKERS[name](device)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        probe = AttentionProbe(model, rows=args.rows)
        for _ in range(3):  # warm-up; the first pass under the probe finds the attention modules
            _step(model, loss_of, optimizer, None)
            _step(model, loss_of, optimizer, probe)
        plain, added = [], []
        for i in range(args.pairs):
            first, second = (None, probe) if i % 2 == 0 else (probe, None)
            a = _step(model, loss_of, optimizer, first)
            b = _step(model, loss_of, optimizer, second)
            without, with_probe = (a, b) if first is None else (b, a)
            plain.append(without)
            added.append(with_probe - without)
        step, extra = statistics.median(plain), statistics.median(added)
        share = 100 * extra / step
        found = len(probe.attention or ())
        print(
            f"{name:42s} {step * 1e3:7.2f} ms {extra * 1e3:8.3f} ms {share:+6.2f}% "
            f"{share / EVERY_N_STEPS:+16.2f}%  {found}"
        )
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU, 2 threads"
    print(f"({args.pairs} alternating pairs of training steps per model, medians; {where})")


if __name__ == "__main__":
    main()
