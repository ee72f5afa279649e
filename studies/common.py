"""What the attention-collapse studies share: one training loop, the classes of a run, the grid, the traces, the rule.

The task, the schedule and the models are ``tests/helpers/collapse_gpt.py``'s (one copy: the tests
train the same runs through a ``Trainer`` and may not import the studies, so the studies import it).

- :func:`fit`, the training loop of every study (:func:`adamw`, the warm-up/cosine schedule, the
  seed's batches), with hooks for what a study measures; :func:`train`, the tiny GPT's run
  (:func:`tiny_gpt`) with the attention signals of its :func:`attention_modules` recorded every step
  (:class:`RunResult`).
- :func:`classify`: a run's entropy onset, loss stall and class against its healthy reference
  (the definitions are ``attention_collapse.py``'s docstring's); :func:`classify_all` for a grid.
- :func:`collapse_grid` and :func:`with_references`: the default grid and its reference runs.
- The traces files (``studies/traces/``, not committed: ``python -m studies.regenerate`` writes them):
  :func:`traces_file`, :func:`load_traces` / :func:`dump_traces`, :func:`write_runs` / :func:`read_runs`
  (``attention_collapse``'s format), :func:`sig4`, :func:`row_json`.
- :func:`guard_warning`, the guard's own ``LogitGrowthRule`` replayed on max-logit traces, and
  :func:`first_warning`, any rule replayed on sampled views.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_nanguard.detect.precursors import LogitGrowthRule
from tests.helpers.collapse_gpt import Attention, RunConfig, TinyGPT, lr_at, make_batch, transition_matrix

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT / "studies" / "traces"  # git-ignored: regenerated, never committed

BASELINE_STEPS = range(5, 16)  # steps 5..15
ONSET_FRACTION = 0.2
STALL_RATIO = 1.5
STALL_STEPS = 20
SMOOTH = 10
LEAD_NEEDED = 10

# The default grid, by number of layers: both implementations at each seed; QK-norm off at every
# learning rate, on at a few. 0.01 is the reference learning rate.
DEFAULT_SEEDS = {2: (0, 1, 2, 3), 3: (0, 1)}
DEFAULT_LRS_OFF = {2: (0.01, 0.03, 0.05, 0.07, 0.1, 0.15), 3: (0.01, 0.05, 0.07, 0.1, 0.15)}
DEFAULT_LRS_ON = {2: (0.03, 0.1), 3: (0.1,)}
REFERENCE_LR = 0.01

# The guard's rule as the studies measured it (NanGuard's precursor_* defaults when they ran): sampled every
# 10 steps, max logit > 80 and >= 2x its value 20 steps before, at most one warning per module per 100 steps.
GUARD_EVERY = 10
GUARD_RULE = (80.0, 2.0, 20, 100)  # LogitGrowthRule(min_logit, growth, window, cooldown)


@dataclass
class LayerTrace:
    """Per-step signals of one attention module."""

    max_logit: list[float] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)
    min_entropy: list[float] = field(default_factory=list)

    def append(self, signals: tuple[float, ...]) -> None:
        """One step's max logit, entropy and min-entropy bound (what ``Attention.last`` holds)."""
        self.max_logit.append(signals[0])
        self.entropy.append(signals[1])
        self.min_entropy.append(signals[2])


@dataclass
class RunResult:
    """The traces of one run."""

    config: RunConfig
    loss: list[float]
    layers: dict[str, LayerTrace]
    seconds: float


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------


def adamw(model: nn.Module, config: RunConfig) -> torch.optim.AdamW:
    """The runs' optimizer: AdamW, betas 0.9/0.95, eps 1e-8, ``config.weight_decay`` (0 in every grid)."""
    return torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay)


def fit(
    config: RunConfig,
    model: nn.Module,
    after_update: Callable[[int, float], float | None],
    *,
    logits: Callable[[Tensor], Tensor] | None = None,
    before_forward: Callable[[int], None] | None = None,
    after_backward: Callable[[int, Tensor], None] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> float:
    """Train ``model`` on the collapse task as every study does; the seconds the steps took.

    One thread; ``optimizer`` (default :func:`adamw`) at ``lr_at(config, step)`` times the factor
    ``after_update`` last returned (1 until it returns one); the batches of ``config.seed``. Each
    step: ``before_forward(step)``, the forward (``logits(x)``, default ``model(x)``), the loss and
    backward, ``after_backward(step, logits)``, ``optimizer.step()``, then ``after_update(step, loss)``.
    """
    torch.set_num_threads(1)
    chain = transition_matrix()
    optimizer = optimizer or adamw(model, config)
    data = torch.Generator().manual_seed(10_000 + config.seed)
    forward = logits or model
    scale = 1.0
    start = time.perf_counter()
    for step in range(config.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(config, step) * scale
        x, y = make_batch(chain, data, config.batch_size, config.seq_len)
        if before_forward is not None:
            before_forward(step)
        out = forward(x)
        loss = F.cross_entropy(out.flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if after_backward is not None:
            after_backward(step, out)
        optimizer.step()
        factor = after_update(step, loss.item())
        if factor is not None:
            scale = factor
    return time.perf_counter() - start


def tiny_gpt(config: RunConfig) -> TinyGPT:
    """The run's tiny GPT, initialised from ``config.seed``."""
    torch.manual_seed(config.seed)
    return TinyGPT(config)


def attention_modules(model: nn.Module) -> dict[str, Attention]:
    """The tiny GPT's attention modules by name (``blocks.{i}.attn``)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, Attention)}


def train(config: RunConfig, watch: Any = None, after_update: Callable[[int], float] | None = None) -> RunResult:
    """Train one tiny GPT and record the loss and every layer's attention signals at every step.

    ``watch`` (NanGuard's ``PrecursorWatch``, for ``qk_clip.py``) is attached to the model, armed
    before each step's forward and finished after its backward; ``after_update(step)`` runs after
    ``optimizer.step()`` and returns the factor on the learning rate of the steps after it.
    """
    model = tiny_gpt(config)
    if watch is not None:
        watch.attach(model)
    modules = attention_modules(model)
    layers = {name: LayerTrace() for name in modules}
    losses: list[float] = []

    def record(step: int, loss: float) -> float | None:
        factor = after_update(step) if after_update is not None else None
        losses.append(loss)
        for name, attn in modules.items():
            assert attn.last is not None
            layers[name].append(attn.last)
        return factor

    seconds = fit(
        config,
        model,
        record,
        before_forward=watch.arm if watch is not None else None,
        after_backward=(lambda step, _: watch.finish(step)) if watch is not None else None,
    )
    return RunResult(config, losses, layers, seconds)


# --------------------------------------------------------------------------------------------------
# Onset, stall, class
# --------------------------------------------------------------------------------------------------


def smooth(values: Sequence[float], window: int = SMOOTH) -> list[float]:
    """Trailing mean over ``window`` steps."""
    out: list[float] = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def entropy_onset(run: RunResult, fraction: float = ONSET_FRACTION) -> tuple[int | None, str | None]:
    """First step > 15 where some layer's entropy < ``fraction`` x its mean over steps 5-15, and that layer."""
    thresholds = {
        name: fraction * statistics.fmean(trace.entropy[s] for s in BASELINE_STEPS)
        for name, trace in run.layers.items()
    }
    for step in range(BASELINE_STEPS.stop, len(run.loss)):
        for name, trace in run.layers.items():
            if trace.entropy[step] < thresholds[name]:
                return step, name
    return None, None


def loss_stall(run: RunResult, reference: RunResult | None) -> int | None:
    """First step t with the smoothed loss > 1.5x the reference's at every step t..t+19."""
    if reference is None or reference is run:
        return None
    mine, ref = smooth(run.loss), smooth(reference.loss)
    above = [m > STALL_RATIO * r for m, r in zip(mine, ref, strict=True)]
    for t in range(len(above) - STALL_STEPS + 1):
        if all(above[t : t + STALL_STEPS]):
            return t
    return None


def final_loss(run: RunResult) -> float:
    return statistics.fmean(run.loss[-SMOOTH:])


def baseline_median(values: Sequence[float], steps: Iterable[int]) -> float:
    return statistics.median(values[s] for s in steps)


@dataclass
class Row:
    """One line of the per-run table."""

    config: RunConfig
    cls: str
    why: str
    onset: int | None
    onset_layer: str | None
    onset_strict: int | None
    stall: int | None
    final_loss: float
    reference_final_loss: float | None
    layer: str
    logit_at: dict[str, float | None]
    peak_logit: float
    min_entropy_ratio: float
    max_loss_ratio: float
    finite: bool
    seconds: float


def classify(run: RunResult, reference: RunResult | None, is_reference: bool) -> Row:
    """Onset, stall and class of one run (see ``attention_collapse.py``'s docstring)."""
    onset, onset_layer = entropy_onset(run)
    onset_strict, _ = entropy_onset(run, ONSET_FRACTION / 2)
    stall = loss_stall(run, reference)
    fin = final_loss(run)
    ref_fin = final_loss(reference) if reference is not None else None
    # the collapsing layer, or else the layer whose max logit peaked highest
    layer = onset_layer or max(run.layers, key=lambda n: max(run.layers[n].max_logit))
    trace = run.layers[layer]
    logit_at: dict[str, float | None] = {
        str(s): (trace.max_logit[s] if s < len(run.loss) else None) for s in (10, 20, 50)
    }
    logit_at["onset"] = trace.max_logit[onset] if onset is not None else None
    grew = any(
        max(t.max_logit) >= max(100.0, 10 * baseline_median(t.max_logit, BASELINE_STEPS)) for t in run.layers.values()
    )
    fin_ok = ref_fin is None or fin <= STALL_RATIO * ref_fin
    if is_reference:
        cls, why = "reference", "the healthy reference"
    elif onset is not None and stall is not None and not fin_ok:
        cls, why = "collapse", "entropy onset, loss stalled to the end"
    elif stall is None and fin_ok and not (grew and onset is not None):
        cls = "healthy"
        why = "learns; no entropy onset" if onset is None else "learns; entropy fell without logit growth (sharp head)"
    else:
        cls = "borderline"
        if onset is not None and grew and fin_ok:
            why = "logits grew, entropy fell, then recovered" + (" (stalled a while)" if stall is not None else "")
        elif onset is None and not fin_ok:
            why = "stalled, no entropy onset, no logit growth (slow)" if not grew else "stalled, logits grew, no onset"
        else:
            why = "onset without a lasting stall" if fin_ok else "stall without onset"
    values = [run.loss, *(v for t in run.layers.values() for v in (t.max_logit, t.entropy, t.min_entropy))]
    finite = all(math.isfinite(x) for seq in values for x in seq)
    ratios = [b / a for a, b in itertools.pairwise(run.loss) if a > 0]
    min_ent_ratio = min(
        min(t.entropy[BASELINE_STEPS.stop :]) / statistics.fmean(t.entropy[s] for s in BASELINE_STEPS)
        for t in run.layers.values()
    )
    return Row(
        config=run.config,
        cls=cls,
        why=why,
        onset=onset,
        onset_layer=onset_layer,
        onset_strict=onset_strict,
        stall=stall,
        final_loss=fin,
        reference_final_loss=ref_fin,
        layer=layer,
        logit_at=logit_at,
        peak_logit=max(trace.max_logit),
        min_entropy_ratio=min_ent_ratio,
        max_loss_ratio=max(ratios[BASELINE_STEPS.start :]) if len(ratios) > BASELINE_STEPS.start else math.nan,
        finite=finite,
        seconds=run.seconds,
    )


def reference_of(config: RunConfig, reference_lr: float = REFERENCE_LR) -> RunConfig:
    """The healthy reference of a run: same implementation, seed and depth, QK-norm off, at ``reference_lr``."""
    return replace(config, qk_norm=False, lr=reference_lr)


def classify_all(runs: Mapping[RunConfig, RunResult], reference_lr: float = REFERENCE_LR) -> dict[RunConfig, Row]:
    """:func:`classify` every run against its reference (the references among them are classed as such)."""
    references = {reference_of(cfg, reference_lr) for cfg in runs}
    return {
        cfg: classify(run, runs.get(reference_of(cfg, reference_lr)), cfg in references) for cfg, run in runs.items()
    }


# --------------------------------------------------------------------------------------------------
# Grid
# --------------------------------------------------------------------------------------------------


def collapse_grid(attentions: Sequence[str], **size: Any) -> list[RunConfig]:
    """The default grid for ``attentions`` (``size``: the other ``RunConfig`` fields), references not added."""
    configs: list[RunConfig] = []
    for layers in (2, 3):
        for att, seed in itertools.product(attentions, DEFAULT_SEEDS[layers]):
            configs += [RunConfig(att, False, lr, seed, n_layers=layers, **size) for lr in DEFAULT_LRS_OFF[layers]]
            configs += [RunConfig(att, True, lr, seed, n_layers=layers, **size) for lr in DEFAULT_LRS_ON[layers]]
    return configs


def with_references(
    configs: list[RunConfig], reference_lr: float = REFERENCE_LR
) -> tuple[list[RunConfig], set[RunConfig]]:
    """``configs`` and the reference runs they lack (added last), and which of them are references."""
    references = {reference_of(c, reference_lr) for c in configs}
    missing = sorted(references - set(configs), key=lambda c: (c.n_layers, c.attention, c.seed))
    return configs + missing, references


# --------------------------------------------------------------------------------------------------
# Traces files
# --------------------------------------------------------------------------------------------------


def traces_file(study: str) -> Path:
    """Where ``python -m studies.<study>`` writes its traces by default: ``studies/traces/<study>_runs.json``."""
    return TRACES / f"{study}_runs.json"


def load_traces(path: Path) -> dict[str, Any]:
    """A traces file's JSON; a missing one stops the study with the command that writes it."""
    if not path.is_file():
        study = path.name.removesuffix("_runs.json")
        raise SystemExit(
            f"{path} is missing: the traces are not committed. Write them with `python -m studies.{study}` "
            "(or every traces file with `python -m studies.regenerate`; studies/README.md says how long it takes)."
        )
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def dump_traces(path: Path, data: dict[str, Any]) -> None:
    """Write a traces file (compact JSON; its folder made if needed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, separators=(",", ":")) + "\n", encoding="utf-8")


def sig4(x: float) -> float:
    """``x`` rounded to 4 significant digits (the traces files' precision)."""
    return float(f"{x:.4g}") if math.isfinite(x) else x


def row_json(row: Row) -> dict[str, Any]:
    """A run's row as the traces files store it (floats to 4 significant digits, no config)."""
    out = {k: (sig4(v) if isinstance(v, float) else v) for k, v in asdict(row).items() if k != "config"}
    out["logit_at"] = {k: (None if v is None else sig4(v)) for k, v in row.logit_at.items()}
    return out


def write_runs(
    path: Path, runs: Mapping[RunConfig, RunResult], rows: Mapping[RunConfig, Row], meta: dict[str, Any]
) -> None:
    """The runs' traces and rows, 4 significant digits (``attention_collapse.py``'s traces file)."""
    out: dict[str, Any] = {"meta": meta, "runs": []}
    for cfg, run in runs.items():
        out["runs"].append(
            {
                "config": asdict(cfg),
                "name": cfg.name,
                "row": row_json(rows[cfg]),
                "loss": [sig4(x) for x in run.loss],
                "layers": {
                    name: {key: [sig4(x) for x in values] for key, values in asdict(trace).items()}
                    for name, trace in run.layers.items()
                },
            }
        )
    dump_traces(path, out)


def read_runs(path: Path) -> tuple[dict[RunConfig, RunResult], dict[str, Any]]:
    """The runs of a traces file written by :func:`write_runs` (values rounded to 4 significant digits)."""
    data = load_traces(path)
    runs: dict[RunConfig, RunResult] = {}
    for item in data["runs"]:
        cfg = RunConfig(**item["config"])
        layers = {name: LayerTrace(**values) for name, values in item["layers"].items()}
        runs[cfg] = RunResult(cfg, item["loss"], layers, item["row"]["seconds"])
    return runs, data["meta"]


# --------------------------------------------------------------------------------------------------
# Rules replayed
# --------------------------------------------------------------------------------------------------


def guard_warning(
    max_logits: Mapping[str, Sequence[float]],
    every: int = GUARD_EVERY,
    rule: tuple[float, float, int, int] = GUARD_RULE,
) -> tuple[int, str] | None:
    """The first finding of the guard's own ``LogitGrowthRule(*rule)`` on max logits sampled at steps 0, every, ...

    ``max_logits``: each module's max logit per step. ``(step, module)``, or ``None`` when it never fires.
    """
    growth = LogitGrowthRule(*rule)
    steps = len(next(iter(max_logits.values())))
    for step in range(0, steps, every):
        for name in sorted(max_logits):
            finding = growth.observe(name, step, max_logits[name][step])
            if finding is not None:
                return finding.step, finding.module
    return None


class HasSteps(Protocol):
    """One unit's values at the sampled steps (a rule's view of it)."""

    @property
    def steps(self) -> list[int]: ...


V = TypeVar("V", bound=HasSteps)


def first_warning(views: Mapping[str, V], rule: Callable[[V, int], bool]) -> tuple[int, str] | None:
    """First sampled step where ``rule`` holds at sample ``i`` of some unit's view, and that unit."""
    some = next(iter(views.values()))
    for i, step in enumerate(some.steps):
        for name, view in views.items():
            if rule(view, i):
                return step, name
    return None
