"""What the attention precursor watch costs per step, measured side by side in one process.

Run from the repository root::

    python -m benchmarks.precursor_cost                    # 3 models, 60 alternating pairs each
    python -m benchmarks.precursor_cost --pairs 30 --accelerator cuda
    python -m benchmarks.precursor_cost --calls-only --against 53be519   # per attention call, now and then

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

``--calls-only`` measures the watch alone, per attention call, on forward passes (no backward, no
optimizer): a sampled step's work (``PrecursorWatch.arm``, the forward, ``finish`` and ``ready``,
as ``NanGuard`` runs them) against the same forward without the watch, in alternation. Printed per
model: the attention calls of one forward, the aten operator calls the watch adds per attention
call and per sampled step (counted by a ``TorchDispatchMode``: on a GPU about one kernel launch
each, views aside), and the host microseconds it adds per attention call (medians; on a CPU the
thread's CPU time, which the machine's other load leaves out). Besides the
three models above, three small launch-bound ones (8 layers of width 16, 8 rows of 8 tokens), where the
measured time is mostly the host's work (on a CPU the kernels also compute: small ones, but not
nothing). ``--against REV`` loads the watch and the
probe of a git revision as well (``git show``) and measures both in the same process, alternating.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.models import GPT2, MODELS, GPT2Shape, _Transformer, make
from lightning_nanguard.detect.attention import AttentionProbe
from lightning_nanguard.detect.precursors import PrecursorSettings
from lightning_nanguard.engine.step import precursors as current_watch

EVERY_N_STEPS = PrecursorSettings().every_n_steps  # NanGuard's precursor_every_n_steps default
ROWS = PrecursorSettings().rows  # the batch rows the guard measures per attention call


def _eager_gpt2(
    device: torch.device, layers: int, heads: int, width: int, vocab: int, tokens: int, positions: int, lm_loss: bool
) -> tuple[nn.Module, Callable[[], Tensor]]:
    """A Hugging Face GPT-2 from a config (eager attention) on 8 sequences of ``tokens``; its LM loss or mean logit."""
    import transformers

    config = transformers.GPT2Config(
        n_layer=layers, n_head=heads, n_embd=width, vocab_size=vocab, n_positions=positions
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).to(device)
    ids = torch.randint(vocab, (8, tokens), generator=torch.Generator().manual_seed(0)).to(device)
    if lm_loss:
        return model, lambda: model(ids, labels=ids).loss
    return model, lambda: model(ids).logits.mean()


def _hf_gpt2(device: torch.device) -> tuple[nn.Module, Callable[[], Tensor]]:
    return _eager_gpt2(device, layers=4, heads=4, width=128, vocab=1024, tokens=64, positions=128, lm_loss=True)


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


def _tiny_gpt(device: torch.device) -> tuple[nn.Module, Callable[[], Tensor]]:
    torch.manual_seed(0)
    model = GPT2(GPT2Shape(layers=8, width=16, heads=2, vocab=64, context=8)).to(device)
    tokens = torch.randint(64, (8, 8), generator=torch.Generator().manual_seed(0)).to(device)
    return model, lambda: model(tokens).float().mean()


def _tiny_encoder(device: torch.device) -> tuple[nn.Module, Callable[[], Tensor]]:
    torch.manual_seed(0)
    model = _Transformer(vocab=64, width=16, layers=8).to(device)
    tokens = torch.randint(64, (8, 8), generator=torch.Generator().manual_seed(0)).to(device)
    return model, lambda: model(tokens).mean()


def _tiny_hf(device: torch.device) -> tuple[nn.Module, Callable[[], Tensor]]:
    return _eager_gpt2(device, layers=8, heads=2, width=16, vocab=64, tokens=8, positions=8, lm_loss=False)


TINY: dict[str, Callable[[torch.device], tuple[nn.Module, Callable[[], Tensor]]]] = {
    "small: 8 SDPA blocks (width 16, 8x8 tokens)": _tiny_gpt,
    "small: TransformerEncoder, 8 layers (width 16)": _tiny_encoder,
    "small: HF GPT-2, 8 eager layers (width 16)": _tiny_hf,
}


class _Ops(TorchDispatchMode):
    """Counts aten operator calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _revision(rev: str) -> ModuleType:
    """The precursor watch module of git revision ``rev``, with that revision's attention probe."""
    modules: dict[str, str] = {}
    for short, path in (
        ("attention", "lightning_nanguard/detect/attention.py"),
        ("precursors", "lightning_nanguard/engine/step/precursors.py"),
    ):
        text = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True, check=True).stdout
        name = f"_precursor_cost_{short}_{rev}"
        text = text.replace(
            "from lightning_nanguard.detect.attention import", f"from {modules.get('attention')} import"
        )
        spec = importlib.util.spec_from_loader(name, loader=None)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        exec(compile(text, f"{rev}:{path}", "exec"), module.__dict__)
        modules[short] = name
    return sys.modules[modules["precursors"]]


def _sampled(watch: Any, step: int, loss_of: Callable[[], Tensor]) -> Tensor:
    """One sampled step's forward under ``watch``, as the guard runs it (armed, checked, read)."""
    watch.arm(step)
    loss = loss_of()
    watch.finish(step)
    watch.ready()
    return loss


def _calls_only(args: argparse.Namespace, device: torch.device) -> None:
    kinds = {"now": current_watch}
    if args.against:
        kinds[args.against] = _revision(args.against)
    settings = PrecursorSettings(every_n_steps=1, max_cost=None, rows=args.rows)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    # on a CPU, this thread's CPU time (one thread computes): what other processes do on the machine is left out
    clock = time.perf_counter if device.type == "cuda" else time.thread_time
    makers = {**TINY, **MAKERS}
    names = args.models or list(makers)
    print(f"{'model':48s} {'watch':>9s} {'calls':>5s} {'aten/call':>9s} {'aten/step':>9s} {'host us/call':>12s}")
    for name in names:
        model, loss_of = makers[name](device)
        model.train()
        watches = {}
        for kind, module in kinds.items():
            watch = module.PrecursorWatch(settings)
            watch.attach(model)
            watches[kind] = watch
        step = 0
        for _ in range(3):  # warm-up; the first pass finds the attention modules
            for watch in watches.values():
                _sampled(watch, step, loss_of)
                step += 1
        counts = {}
        for kind, watch in watches.items():
            plain, probed = _Ops(), _Ops()
            with plain:
                loss_of()
            with probed:
                _sampled(watch, step, loss_of)
            step += 1
            counts[kind] = probed.calls - plain.calls
        calls = len(watches["now"].probe.attention or ())
        with watches["now"].probe.measuring():  # the calls of one forward (a module may make several)
            loss_of()
        calls = sum(len(part.names) for part in watches["now"].probe.take_calls()) or calls
        added: dict[str, list[float]] = {kind: [] for kind in watches}
        for i in range(args.reps):
            order = list(watches) if i % 2 == 0 else list(reversed(watches))
            for kind in order:
                sync()
                start = clock()
                loss_of()
                sync()
                middle = clock()
                _sampled(watches[kind], step, loss_of)
                sync()
                end = clock()
                step += 1
                added[kind].append((end - middle) - (middle - start))
        for kind in watches:
            extra = statistics.median(added[kind])
            print(
                f"{name:48s} {kind:>9s} {calls:5d} {counts[kind] / calls:9.1f} {counts[kind]:9d} "
                f"{extra * 1e6 / calls:12.1f}"
            )
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU, 1 thread, its CPU time"
    print(f"(forward passes only, {args.reps} alternating repetitions per watch, medians; {where})")


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
        probe.take_calls()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sync()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=60)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--models", nargs="*", help="default: the three above (--calls-only: and the small ones)")
    parser.add_argument(
        "--rows", type=int, default=ROWS, help=f"batch rows measured per attention call (default {ROWS}, the guard's)"
    )
    parser.add_argument("--calls-only", action="store_true", help="the watch alone, per attention call (see above)")
    parser.add_argument("--against", help="with --calls-only: also the watch of this git revision")
    parser.add_argument("--reps", type=int, default=200, help="with --calls-only: repetitions per model")
    args = parser.parse_args()
    device = torch.device("cuda" if args.accelerator == "cuda" else "cpu")
    if args.calls_only:
        torch.set_num_threads(1)
        _calls_only(args, device)
        return
    torch.set_num_threads(2)
    args.models = args.models or list(MAKERS)
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
