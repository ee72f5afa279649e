"""Other precursors of attention collapse (issue 26): output-logit drift, AdamW update RMS, gradient/update spikes.

Run from the repository root::

    python -m studies.other_precursors            # 44 runs (8-11 min, 1 process), writes the traces JSON
    python -m studies.other_precursors --quick    # smoke run: 6 runs of 150 steps, under a minute
    python -m studies.other_precursors --replay studies/traces/other_precursors_runs.json   # rules only, ~10 s
    python -m studies.other_precursors --attention manual sdpa   # both implementations (88 runs)

Plain torch on CPU, one process, ``torch.set_num_threads(1)``.

**Runs.** ``studies/attention_collapse.py``'s tiny pre-LN GPTs on its Markov + copy task (read its
docstring), its default grid restricted to ``manual`` attention (the ``sdpa`` twins are the same
computation up to rounding): 2 layers, seeds 0-3, QK-norm off at lr 0.01-0.15 and on at 0.03, 0.1; 3
layers, seeds 0-1, off at 0.01-0.15 and on at 0.1; 44 runs, the lr-0.01 ones are the references. The
training loop is its ``train()`` (``studies/common.py``'s: same init, batches, AdamW betas 0.9/0.95,
eps 1e-8, no weight decay, warm-up and cosine schedule, 300 steps) with the extra signals measured on
the side, under ``no_grad``, from detached tensors: the re-trained loss and max logits match the
benchmark's traces (``studies/traces/attention_collapse_runs.json``, when it is there) to their 4
significant digits (checked and printed), so the classes, onsets and stalls are the benchmark's (its
``classify``).

**Signals**, every step (``studies/traces/other_precursors_runs.json``, not committed; 4 significant digits):

- output-logit drift: ``logz_mean`` and ``logz_max``, the mean and the max over the batch's tokens
  of ``logsumexp`` of the LM head's logits (log Z);
- relative update: ``update_rel = ||theta_after - theta_before|| / ||theta_before||`` over the whole
  model, and ``qkv_update_rel`` for each attention module's fused qkv weight; in the replay also both
  divided by the step's learning rate (``/lr``: warm-up and decay taken out);
- AdamW's update against its second moment, per qkv weight, read from ``optimizer.state`` after the
  step with bias correction: ``qkv_adam_rms``, the RMS over elements of ``m_hat / (sqrt(v_hat) + eps)``
  (AdamW's normalized update), and ``qkv_stable_rms``, ``sqrt(mean(g^2 / v_hat))`` (StableAdamW's
  update-clipping statistic: above 1 when the second moment lags the gradient);
- ``grad_norm``, the global gradient norm before the step; ``update_spike`` and ``grad_spike``, the
  step's update norm (gradient norm) over its median over the 20 steps before.

**Rules**, replayed on values sampled every 10 steps (the guard's default; "20 steps earlier" is the
sample 20 steps earlier), firing at the first sampled step where they hold in some unit (module, or the
model for the global signals), swept per signal (89 rules each):

- ``G``: level + growth, the attention rule's shape: above a level (14 levels spread over the range of
  the per-run peaks) and, unless the factor is 1, >= 1.5/2/3/5x its value 20 steps earlier;
- ``B``: k x its own baseline (the median of the sampled steps 5-15, i.e. step 10), after step 15,
  k = 1.5-50, upwards (``>=kx``) and downwards (``<=1/kx``);
- ``S``: spike, >= 1.5-10x the median of its samples in the 50 steps before (two at least).

For log Z a ratio is a ratio of Z: ``+0.41`` means log Z rose by log(1.5), ``-0.41`` fell by as much.

**Scores**, per rule: collapsing runs (15) warned >= 10 steps before the entropy onset, at 0.1x (the
guard's benchmark, ``precursor_rule.py``) and 0.2x (the benchmark's ``onset``) of the steps 5-15 mean,
and before the loss stall; the median lead to the 0.1x onset; false alarms: healthy and reference runs
(21) warned at any step; borderline runs (8) warned, not counted either way. Against: the guard's own
``LogitGrowthRule(80, 2.0, 20, cooldown=100)`` replayed on the max-logit traces sampled every 10 steps,
and, as a control, the same sweep on the **learning rate itself**: in this grid the lr nearly separates
the classes (every collapse has a peak lr of 0.07 or more, no healthy run is above 0.07), so any signal
that scales with the lr looks like a precursor here without being one.

Thresholds are picked on the same runs they are scored on, so each signal's best rule is also **held
out by seed**: leave one seed out (4 folds; the 3-layer runs have seeds 0-1), pick the best rule (fewest
false alarms, then most in time at 0.1x, then at 0.2x, then the longest median lead) on the other
seeds, score it on the held-out seed, add the folds up. The same for the best rule OR the guard's rule
(the warning is the earlier of the two), and OR the lr control.

**Verdict rule** (fixed before looking at the rules' scores, then the lr control added once the
update-size rules turned out to fire at step 10-20 on every high-lr run): a signal earns its place if,
held out, either alone it warns as many collapses in time (0.1x) as the guard's rule with no false
alarm, or OR the guard's rule it warns >= 2 more with no more false alarms; **and** OR the lr control it
warns >= 2 more than the lr control alone (or has fewer false alarms), i.e. it knows something the
learning rate does not. (The guard's rule passes that last test: +3.) One run more is not enough: the
runs come in seeds and learning rates, not independent samples.

**Findings** (the run the docs cite). Classes: 15 collapse (0.1x onsets at steps 52-120, stalls 79-92), 15
healthy + 6 references, 8 borderline. The guard's rule, every 10 steps: 12/15 in time for the 0.1x
onset (median lead 22, -4..40), 4/15 for the 0.2x onset, 14/15 before the stall, 0/21 false alarms
(sampled every step: 15/15, 8/15, 15/15, 0/21). The lr control's best rule (lr > 0.0529 and 3x in 20
steps: a peak lr above 0.075, seen at step 20): 12/15 at both onsets, 0 false alarms; guard OR lr
control: 15/15 (12/15 at 0.2x), 0 false alarms.

Cells: in time before the 0.1x onset / before the 0.2x onset, false alarms of 21; "+n": collapses in
time added to the guard's rule (or to the lr control) held out::

    signal              best alone (in sample)       held out  guard|it   lr|it   verdict
    logz_mean           4/3 fa0 (log Z -0.41 base)   4/3 fa0   +0 fa0     +0 fa1  no
    logz_max            2/2 fa0                      1/1 fa0   +0 fa0     +0 fa1  no
    update_rel          13/13 fa0 (> 0.0406)         13/13 fa0 +3 fa0     +1 fa0  no: a learning-rate proxy
    qkv_update_rel      12/12 fa0 (> 0.11)           12/12 fa1 +3 fa1     +0 fa1  no: the same, and a false alarm
    update_rel/lr       0/0 fa0                      0/0 fa0   +0 fa0     +0 fa0  no
    qkv_update_rel/lr   0/0 fa0                      0/0 fa0   +0 fa0     +0 fa0  no
    qkv_adam_rms        0/0 fa0                      0/0 fa1   +0 fa1     +0 fa1  no
    qkv_stable_rms      0/0 fa0                      1/0 fa1   +0 fa0     +0 fa0  no
    grad_norm           3/3 fa0 (> 0.763)            3/3 fa0   +0 fa0     +0 fa1  no (+1 in sample)
    update_spike        0/0 fa0                      0/0 fa0   +0 fa0     +0 fa0  no
    grad_spike          4/4 fa0 (<= 1/2x base)       8/8 fa1   +2 fa1     +2 fa2  no (+1 in sample)

No signal earns its place. What the numbers say:

- Output-logit drift runs the other way here: a healthy run's mean log Z rises to 8.7-11.8 as it grows
  confident, a collapsing run's is 5.8-6.4 ten steps before its onset; there is no output-logit
  divergence in this failure, so log Z has nothing to warn about beyond "learns slower" (its best
  rule, log Z 0.41 below its step-10 value, 4/15, adds nothing to the guard's).
- The whole-model relative update above 0.0406 looks best of all (13/15 in time, 0 false alarms, lead
  68, held out the same; OR the guard's rule 15/15), but it fires at step 10 on every run with a peak
  lr of 0.1 or more, the QK-norm runs that never collapse included (7/8 borderline warned), and misses
  the 2-layer lr-0.07 collapses, whose updates (peaks 0.0403, 0.0404) are those of the healthy lr-0.07
  run (0.0401): it measures the learning rate (OR the lr control: +1), with its level 2% above the
  highest healthy sample (0.0397). Divided by the lr (``/lr``) the update warns of nothing (0/15).
- Update size and AdamW's normalized update of the collapsing layer's qkv weight do move before the
  onset, but downwards (``qkv_update_rel/lr`` 0.13-0.51 ten steps before the onset against healthy
  peaks up to 5), and healthy runs reach the same values later in training: no threshold separates
  them without a clock.
- Nothing spikes ahead of a collapse more than in healthy runs (every step counted): the update norm
  reaches at most 1.39x its trailing median in a collapsing run before its 0.1x onset (1.55x in healthy
  runs), the gradient norm 4.0x (3.7x), StableAdamW's RMS 1.38 (1.81); and no run has a loss spike
  (the benchmark's finding). Spike precursors target loss spikes, a failure this benchmark does not
  contain: not earning a place here says nothing of them there.
- The combination that matters is sampling: the guard's own rule measured every step instead of every
  10 warns 15/15 in time, more than any OR with another signal (in sample at most 13/15 without a
  learning-rate proxy; held out, none adds a collapse without a false alarm).

Cost, were one kept: log Z needs the head's output (one logsumexp over the vocabulary per token), the
update norms a copy of the parameters before the step (or AdamW's state: m and v give the update), the
gradient norm is free where clipping computes it.

Wall time: 494 s of training for the 44 runs of the traces the docs cite (1 process; 11.2 s per run median,
on a 2-core machine at load average 3-4.5 from other jobs; an identical earlier run took 637 s at load
~7), replay ~10 s; ``--quick`` ~50 s.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from studies.common import (
    BASELINE_STEPS,
    LEAD_NEEDED,
    REFERENCE_LR,
    LayerTrace,
    Row,
    RunResult,
    adamw,
    attention_modules,
    baseline_median,
    classify_all,
    collapse_grid,
    dump_traces,
    first_warning,
    fit,
    guard_warning,
    load_traces,
    lr_at,
    read_runs,
    sig4,
    tiny_gpt,
    traces_file,
    with_references,
)
from tests.helpers.collapse_gpt import RunConfig

DEFAULT_OUT = traces_file("other_precursors")
REFERENCE_TRACES = traces_file("attention_collapse")
QUICK_LRS = (REFERENCE_LR, 0.05, 0.15)  # --quick: these, 2 layers, seeds 0 and 1, 150 steps
SPIKE_WINDOW = 20  # trailing window (steps) of the per-step spike ratios
EPS = 1e-8  # AdamW's default eps, the one the runs use

# Per-step signals of the whole model, and of each attention module (its fused qkv weight).
GLOBAL_SIGNALS = ("logz_mean", "logz_max", "grad_norm", "update_rel", "update_norm", "update_spike", "grad_spike")
LAYER_SIGNALS = ("max_logit", "entropy", "min_entropy", "qkv_update_rel", "qkv_adam_rms", "qkv_stable_rms")


@dataclass
class Trace:
    """Every per-step signal of one run."""

    config: RunConfig
    loss: list[float]
    signals: dict[str, list[float]]  # GLOBAL_SIGNALS
    layers: dict[str, dict[str, list[float]]]  # module -> LAYER_SIGNALS
    lr: list[float] = field(default_factory=list)
    seconds: float = 0.0

    def as_result(self) -> RunResult:
        """The benchmark's view of the run (loss and attention signals), for its :func:`classify`."""
        layers = {
            name: LayerTrace(values["max_logit"], values["entropy"], values["min_entropy"])
            for name, values in self.layers.items()
        }
        return RunResult(self.config, self.loss, layers, self.seconds)


# --------------------------------------------------------------------------------------------------
# Training: the benchmark's train() loop, with the extra signals measured on the side
# --------------------------------------------------------------------------------------------------


def _norm(tensors: Sequence[Tensor]) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))


def _trailing_ratio(values: list[float], window: int = SPIKE_WINDOW) -> float:
    """The last value over the median of the ``window`` values before it (1.0 until there are any)."""
    before = values[-window - 1 : -1]
    if not before:
        return 1.0
    median = statistics.median(before)
    return values[-1] / median if median > 0 else math.inf


@torch.no_grad()
def _adam_signals(optimizer: torch.optim.AdamW, weight: Tensor) -> tuple[float, float]:
    """RMS of AdamW's normalized update ``m_hat / (sqrt(v_hat) + eps)``, and StableAdamW's ``sqrt(mean(g^2 / v_hat))``.

    Read after ``optimizer.step()``: ``exp_avg`` and ``exp_avg_sq`` include this step's gradient, which
    ``weight.grad`` still holds.
    """
    state = optimizer.state[weight]
    beta1, beta2 = optimizer.param_groups[0]["betas"]
    step = float(state["step"])
    m_hat = state["exp_avg"].double() / (1 - beta1**step)
    v_hat = state["exp_avg_sq"].double() / (1 - beta2**step)
    normalized = m_hat / (v_hat.sqrt() + EPS)
    assert weight.grad is not None
    stable = weight.grad.double().pow(2) / v_hat.clamp_min(EPS**2)
    return float(normalized.pow(2).mean().sqrt()), float(stable.mean().sqrt())


def train(config: RunConfig) -> Trace:
    """``common.train``'s run (same init, batches and updates), plus the output, optimizer and update signals."""
    model = tiny_gpt(config)
    optimizer = adamw(model, config)
    names = attention_modules(model)
    params = [p for p in model.parameters() if p.requires_grad]
    index = {id(p): i for i, p in enumerate(params)}
    trace = Trace(
        config,
        [],
        {key: [] for key in GLOBAL_SIGNALS},
        {name: {key: [] for key in LAYER_SIGNALS} for name in names},
    )
    step_before: dict[str, Any] = {}  # what after_update needs of the step before the update

    @torch.no_grad()
    def after_backward(step: int, logits: Tensor) -> None:
        step_before["logz"] = torch.logsumexp(logits.detach().double(), dim=-1)  # (batch, positions): log Z per token
        step_before["grad_norm"] = _norm([p.grad for p in params if p.grad is not None])
        step_before["params"] = [p.detach().clone() for p in params]

    @torch.no_grad()
    def after_update(step: int, loss: float) -> None:
        trace.loss.append(loss)
        trace.lr.append(lr_at(config, step))
        logz, before = step_before["logz"], step_before["params"]
        delta = [p.detach() - b for p, b in zip(params, before, strict=True)]
        update_norm = _norm(delta)
        sig = trace.signals
        sig["logz_mean"].append(float(logz.mean()))
        sig["logz_max"].append(float(logz.max()))
        sig["grad_norm"].append(step_before["grad_norm"])
        sig["update_norm"].append(update_norm)
        sig["update_rel"].append(update_norm / _norm(before))
        sig["update_spike"].append(_trailing_ratio(sig["update_norm"]))
        sig["grad_spike"].append(_trailing_ratio(sig["grad_norm"]))
        for name, attn in names.items():
            assert attn.last is not None
            layer = trace.layers[name]
            layer["max_logit"].append(attn.last[0])
            layer["entropy"].append(attn.last[1])
            layer["min_entropy"].append(attn.last[2])
            weight = attn.qkv.weight
            i = index[id(weight)]
            layer["qkv_update_rel"].append(_norm([delta[i]]) / _norm([before[i]]))
            normalized, stable = _adam_signals(optimizer, weight)
            layer["qkv_adam_rms"].append(normalized)
            layer["qkv_stable_rms"].append(stable)

    trace.seconds = fit(config, model, after_update, after_backward=after_backward, optimizer=optimizer)
    return trace


# --------------------------------------------------------------------------------------------------
# Grid, traces file
# --------------------------------------------------------------------------------------------------


def build_grid(quick: bool, attentions: Sequence[str], steps: int) -> list[RunConfig]:
    """The benchmark's default grid for ``attentions`` (its references included), or a few runs with ``quick``."""
    if quick:
        return [RunConfig("manual", False, lr, seed, steps=steps) for seed in (0, 1) for lr in QUICK_LRS]
    configs, _ = with_references(collapse_grid(attentions, steps=steps), REFERENCE_LR)
    return configs


def _sig4(values: Sequence[float]) -> list[float]:
    return [sig4(v) for v in values]


def write_json(path: Path, traces: dict[RunConfig, Trace], meta: dict[str, Any]) -> None:
    """The traces, 4 significant digits, with each run's class, onsets and stall (the benchmark's, for reading)."""
    rows = classify_traces(traces)
    out: dict[str, Any] = {"meta": meta, "runs": []}
    for cfg, tr in traces.items():
        row = rows[cfg]
        out["runs"].append(
            {
                "config": asdict(cfg),
                "name": cfg.name,
                "row": {
                    "cls": row.cls,
                    "why": row.why,
                    "onset": row.onset,
                    "onset_strict": row.onset_strict,
                    "onset_layer": row.onset_layer,
                    "stall": row.stall,
                },
                "seconds": round(tr.seconds, 2),
                "loss": _sig4(tr.loss),
                "lr": _sig4(tr.lr),
                "signals": {key: _sig4(values) for key, values in tr.signals.items()},
                "layers": {name: {key: _sig4(v) for key, v in values.items()} for name, values in tr.layers.items()},
            }
        )
    dump_traces(path, out)


def read_json(path: Path) -> tuple[dict[RunConfig, Trace], dict[str, Any]]:
    data = load_traces(path)
    traces: dict[RunConfig, Trace] = {}
    for item in data["runs"]:
        cfg = RunConfig(**item["config"])
        traces[cfg] = Trace(cfg, item["loss"], item["signals"], item["layers"], item["lr"], item["seconds"])
    return traces, data["meta"]


def check_against_benchmark(traces: dict[RunConfig, Trace]) -> str:
    """How closely the re-trained runs match the benchmark's traces (same loop, so they should)."""
    if not REFERENCE_TRACES.exists():
        return f"no {REFERENCE_TRACES.name} to compare with (`python -m studies.attention_collapse` writes it)"
    committed, _ = read_runs(REFERENCE_TRACES)
    worst, compared = 0.0, 0
    for cfg, tr in traces.items():
        other = committed.get(cfg)
        if other is None:
            continue
        compared += 1
        pairs = list(zip(tr.loss, other.loss, strict=True))
        for name, layer in tr.layers.items():
            pairs += list(zip(layer["max_logit"], other.layers[name].max_logit, strict=True))
        worst = max(worst, max(abs(a - b) / max(abs(b), 1e-6) for a, b in pairs))
    if not compared:
        return f"none of the runs is in {REFERENCE_TRACES.name} (other steps or settings): not compared"
    return (
        f"{compared} of {len(traces)} runs are in {REFERENCE_TRACES.name}: loss and max logits agree within a relative "
        f"{worst:.1e} (the stored values have 4 significant digits)"
    )


# --------------------------------------------------------------------------------------------------
# Classes (the benchmark's), sampled views, rules
# --------------------------------------------------------------------------------------------------


def classify_traces(traces: dict[RunConfig, Trace]) -> dict[RunConfig, Row]:
    """The benchmark's onset, stall and class of every run, against its reference run."""
    return classify_all({cfg: tr.as_result() for cfg, tr in traces.items()}, REFERENCE_LR)


@dataclass(frozen=True)
class Signal:
    """A candidate precursor: where its values come from, and whether ratios of it mean anything."""

    key: str
    family: str  # the name for it
    per_layer: bool
    log: bool = False  # a logarithm (log Z): growth is a difference, ``factor`` means ``log(factor)`` added
    per_lr: bool = False  # divided by the step's learning rate (warm-up and decay taken out)
    source: str = ""  # the recorded signal it is computed from (default: key)

    def series(self, tr: Trace) -> dict[str, list[float]]:
        """Unit (module, or ``model``) -> per-step values."""
        src = self.source or self.key
        if self.per_layer:
            units = {name: values[src] for name, values in tr.layers.items()}
        else:
            units = {"model": tr.lr if src == "lr" else tr.signals[src]}
        if self.per_lr:
            units = {u: [v / lr for v, lr in zip(vals, tr.lr, strict=True)] for u, vals in units.items()}
        return units


SIGNALS: tuple[Signal, ...] = (
    Signal("logz_mean", "output-logit drift: mean log Z", per_layer=False, log=True),
    Signal("logz_max", "output-logit drift: max log Z", per_layer=False, log=True),
    Signal("update_rel", "relative update, whole model", per_layer=False),
    Signal("qkv_update_rel", "relative update, qkv weight", per_layer=True),
    Signal("update_rel/lr", "relative update / lr, whole model", per_layer=False, per_lr=True, source="update_rel"),
    Signal("qkv_update_rel/lr", "relative update / lr, qkv", per_layer=True, per_lr=True, source="qkv_update_rel"),
    Signal("qkv_adam_rms", "AdamW RMS(m_hat/(sqrt(v_hat)+eps)), qkv", per_layer=True),
    Signal("qkv_stable_rms", "StableAdamW RMS(g/sqrt(v_hat)), qkv", per_layer=True),
    Signal("grad_norm", "global gradient norm", per_layer=False),
    Signal("update_spike", "update norm / trailing median (20)", per_layer=False),
    Signal("grad_spike", "grad norm / trailing median (20)", per_layer=False),
)
MAX_LOGIT = Signal("max_logit", "attention max logit (the guard's)", per_layer=True)
# The control: in this grid the learning rate alone nearly separates the classes (every collapse is at a peak lr
# of 0.07 or more; no healthy run above 0.07), so a signal that scales with the lr looks like a precursor here.
LR_CONTROL = Signal("lr", "control: the learning rate itself (not a precursor)", per_layer=False)


@dataclass
class View:
    """One unit's values at the sampled steps (every ``every``), and its baseline (median of sampled steps 5-15)."""

    every: int
    steps: list[int]
    values: list[float]
    base: float
    log: bool

    @classmethod
    def of(cls, values: Sequence[float], every: int, log: bool) -> View:
        steps = list(range(0, len(values), every))
        base = baseline_median(values, [s for s in steps if s in BASELINE_STEPS])
        return cls(every, steps, [values[s] for s in steps], base, log)

    def ratio(self, value: float, other: float) -> float:
        """How many times ``other`` ``value`` is (for a log signal: exp of the difference)."""
        if self.log:
            return math.exp(min(value - other, 700.0))
        return value / other if other > 0 else math.inf

    def before(self, i: int, lag: int) -> float | None:
        j = i - lag // self.every
        return self.values[j] if j >= 0 else None


RuleFn = Callable[[View, int], bool]


def rule_growth(level: float, factor: float, lag: int = 20) -> RuleFn:
    """Above ``level`` and at least ``factor`` x its value ``lag`` steps earlier (the attention rule's shape)."""

    def rule(v: View, i: int) -> bool:
        if v.values[i] <= level:
            return False
        if factor <= 1:
            return True
        earlier = v.before(i, lag)
        return earlier is not None and v.ratio(v.values[i], earlier) >= factor

    return rule


def rule_baseline(k: float, down: bool = False) -> RuleFn:
    """At least ``k`` x its own baseline (median of the sampled steps 5-15), or at most 1/k x with ``down``."""

    def rule(v: View, i: int) -> bool:
        if v.steps[i] < BASELINE_STEPS.stop:
            return False
        r = v.ratio(v.values[i], v.base)
        return r <= 1 / k if down else r >= k

    return rule


def rule_spike(k: float, window: int = 50) -> RuleFn:
    """At least ``k`` x the median of its samples in the previous ``window`` steps (two at least)."""

    def rule(v: View, i: int) -> bool:
        earlier = v.values[max(0, i - window // v.every) : i]
        return len(earlier) >= 2 and v.ratio(v.values[i], statistics.median(earlier)) >= k

    return rule


FACTORS = (1.0, 1.5, 2.0, 3.0, 5.0)
BASELINE_KS = (1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0)
SPIKE_KS = (1.5, 2.0, 3.0, 5.0, 10.0)
N_LEVELS = 14


def _levels(signal: Signal, views: Iterable[View]) -> list[float]:
    """Levels to sweep: spread over the range of the per-unit peaks after step 15 (log-spaced unless log)."""
    peaks = [max(v.values[i] for i in range(len(v.steps)) if v.steps[i] >= BASELINE_STEPS.stop) for v in views]
    low, high = min(peaks), max(peaks)
    if signal.log or low <= 0:
        return [low + (high - low) * j / (N_LEVELS - 1) for j in range(N_LEVELS)]
    return [low * (high / low) ** (j / (N_LEVELS - 1)) for j in range(N_LEVELS)]


def candidate_rules(signal: Signal, views: Iterable[View]) -> dict[str, RuleFn]:
    """The sweep for one signal: level x growth, k x baseline (up and down), spike over the trailing median."""
    rules: dict[str, RuleFn] = {}
    for level in _levels(signal, views):
        for factor in FACTORS:
            grow = (
                "" if factor <= 1 else (f" & +{math.log(factor):.2g} in 20" if signal.log else f" & >={factor:g}x 20")
            )
            rules[f"G >{level:.3g}{grow}"] = rule_growth(level, factor)
    for k in BASELINE_KS:
        up, down = (f"+{math.log(k):.2g}", f"-{math.log(k):.2g}") if signal.log else (f">={k:g}x", f"<=1/{k:g}x")
        rules[f"B {up} base"] = rule_baseline(k)
        rules[f"B {down} base"] = rule_baseline(k, down=True)
    for k in SPIKE_KS:
        rules[f"S {f'+{math.log(k):.2g}' if signal.log else f'>={k:g}x'} median 50"] = rule_spike(k)
    return rules


def first_step(views: dict[str, View], rule: RuleFn) -> int | None:
    """First sampled step where ``rule`` holds in some unit."""
    first = first_warning(views, rule)
    return None if first is None else first[0]


def guard_warnings(traces: dict[RunConfig, Trace], every: int) -> dict[RunConfig, int | None]:
    """The guard's own ``LogitGrowthRule(80, 2.0, 20, 100)`` on each run's max logits sampled every ``every``."""
    out: dict[RunConfig, int | None] = {}
    for cfg, tr in traces.items():
        first = guard_warning({name: layer["max_logit"] for name, layer in tr.layers.items()}, every)
        out[cfg] = None if first is None else first[0]
    return out


# --------------------------------------------------------------------------------------------------
# Scores
# --------------------------------------------------------------------------------------------------


@dataclass
class Score:
    """One rule (its first warning per run) against the classes."""

    rule: str
    warnings: dict[RunConfig, int | None]
    collapses: int = 0
    in_time: int = 0  # >= 10 steps before the 0.2x onset
    in_time_strict: int = 0  # >= 10 steps before the 0.1x onset
    before_stall: int = 0  # >= 10 steps before the loss stall
    leads: list[int] = field(default_factory=list)  # to the 0.1x onset, warned collapses
    false_alarms: int = 0  # healthy and reference runs warned at any step
    quiet: int = 0  # healthy and reference runs
    borderline_warned: int = 0
    borderline: int = 0
    false_alarm_runs: list[str] = field(default_factory=list)

    @property
    def key(self) -> tuple[int, int, int, float]:
        """Better first: fewer false alarms, then more in time (0.1x, then 0.2x), then a longer median lead."""
        lead = statistics.median(self.leads) if self.leads else -math.inf
        return (-self.false_alarms, self.in_time_strict, self.in_time, lead)

    def line(self, label: str) -> str:
        lead = f"{statistics.median(self.leads):.0f}" if self.leads else "-"
        span = f"{min(self.leads)}..{max(self.leads)}" if self.leads else "-"
        return (
            f"{label:58s} {self.in_time_strict:2d}/{self.collapses:<2d} {self.in_time:2d}/{self.collapses:<2d} "
            f"{self.before_stall:2d}/{self.collapses:<2d} {lead:>5s} {span:>9s} "
            f"{self.false_alarms:2d}/{self.quiet:<2d} {self.borderline_warned:2d}/{self.borderline:<2d}"
        )


SCORE_HEAD = (
    f"{'rule (sampled every 10 steps)':58s} {'0.1x':>5s} {'0.2x':>5s} {'stall':>5s} {'lead':>5s} {'range':>9s} "
    f"{'false':>5s} {'bord.':>5s}"
)
SCORE_NOTE = (
    "0.1x / 0.2x / stall: collapsing runs warned >= 10 steps before the entropy onset (0.1x, the guard's benchmark, "
    "and 0.2x) and before the loss stall; lead: median (range) steps from the warning to the 0.1x onset; false: "
    "healthy + reference runs warned at any step; bord.: borderline runs warned"
)


def score(label: str, warnings: dict[RunConfig, int | None], rows: dict[RunConfig, Row]) -> Score:
    s = Score(label, warnings)
    for cfg, warn in warnings.items():
        row = rows[cfg]
        if row.cls == "collapse":
            assert row.onset is not None and row.onset_strict is not None and row.stall is not None
            s.collapses += 1
            if warn is None:
                continue
            s.leads.append(row.onset_strict - warn)
            s.in_time += row.onset - warn >= LEAD_NEEDED
            s.in_time_strict += row.onset_strict - warn >= LEAD_NEEDED
            s.before_stall += row.stall - warn >= LEAD_NEEDED
        elif row.cls == "borderline":
            s.borderline += 1
            s.borderline_warned += warn is not None
        else:
            s.quiet += 1
            if warn is not None:
                s.false_alarms += 1
                s.false_alarm_runs.append(f"{cfg.name}/L{cfg.n_layers}@{warn}")
    return s


def either(*warnings: dict[RunConfig, int | None]) -> dict[RunConfig, int | None]:
    """The first warning of any of the rules, per run."""
    out: dict[RunConfig, int | None] = {}
    for cfg in warnings[0]:
        steps = [w[cfg] for w in warnings if w[cfg] is not None]
        out[cfg] = min(steps) if steps else None  # type: ignore[type-var]
    return out


def restrict(s: Score, keep: set[RunConfig], rows: dict[RunConfig, Row]) -> Score:
    return score(s.rule, {cfg: w for cfg, w in s.warnings.items() if cfg in keep}, rows)


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------

EVERY = 10  # the guard's default sampling interval
GAIN_NEEDED = 2  # collapsing runs (of 15) a rule must add, held out, to count as an improvement


def views_of(signal: Signal, tr: Trace, every: int) -> dict[str, View]:
    return {unit: View.of(values, every, signal.log) for unit, values in signal.series(tr).items()}


def describe(signal: Signal, traces: dict[RunConfig, Trace], rows: dict[RunConfig, Row]) -> str:
    """Where the signal sits: healthy runs after step 15 against collapsing runs 10 steps before the 0.1x onset."""
    quiet: list[float] = []
    border: list[float] = []
    at_lead: list[float] = []
    for cfg, tr in traces.items():
        views = views_of(signal, tr, EVERY)
        row = rows[cfg]
        if row.cls == "collapse":
            assert row.onset_strict is not None
            i = (row.onset_strict - LEAD_NEEDED) // EVERY
            at_lead.append(max(v.values[i] for v in views.values()))
        else:
            after = [x for v in views.values() for x in v.values[2:]]  # steps 20, 30, ...
            (border if row.cls == "borderline" else quiet).extend([min(after), max(after)])

    def span(values: list[float]) -> str:
        return f"{min(values):9.3g}..{max(values):<9.3g}" if values else f"{'-':^20s}"

    median = f"{statistics.median(at_lead):9.3g}" if at_lead else f"{'-':>9s}"
    return f"{signal.key:18s} | {span(quiet)} | {median} {span(at_lead)} | {span(border)}"


@dataclass
class Sweep:
    """One signal's rules, scored at the guard's interval."""

    signal: Signal
    rules: dict[str, RuleFn]
    scores: list[Score]


def sweep(signal: Signal, traces: dict[RunConfig, Trace], rows: dict[RunConfig, Row]) -> Sweep:
    views = {cfg: views_of(signal, tr, EVERY) for cfg, tr in traces.items()}
    rules = candidate_rules(signal, (v for unit_views in views.values() for v in unit_views.values()))
    scores = [
        score(label, {cfg: first_step(views[cfg], rule) for cfg in traces}, rows) for label, rule in rules.items()
    ]
    return Sweep(signal, rules, scores)


def best(scores: list[Score], key: Callable[[Score], tuple[int, int, int, float]] = lambda s: s.key) -> Score:
    return max(scores, key=key)  # ties: the first in sweep order


def cross_validate(
    scores: list[Score],
    rows: dict[RunConfig, Row],
    partner: dict[RunConfig, int | None] | None,
) -> Score:
    """Leave one seed out: the best rule (alone, or OR ``partner``'s warnings) on the other seeds, scored on the
    held-out seed; the held-out warnings of every fold put together."""
    candidates = [score(s.rule, either(partner, s.warnings), rows) for s in scores] if partner is not None else scores
    seeds = sorted({cfg.seed for cfg in rows})
    if len(seeds) < 2:
        return best(candidates)  # nothing to hold out: in sample
    held_out: dict[RunConfig, int | None] = {}
    for seed in seeds:
        fold = {cfg for cfg in rows if cfg.seed != seed}

        def on_fold(s: Score, fold: set[RunConfig] = fold) -> tuple[int, int, int, float]:
            return restrict(s, fold, rows).key

        choice = best(candidates, on_fold)
        held_out.update({cfg: w for cfg, w in choice.warnings.items() if cfg.seed == seed})
    return score("held out", held_out, rows)


def beats(s: Score, other: Score) -> bool:
    """No more false alarms than ``other``, and fewer, or ``GAIN_NEEDED`` more collapses in time (0.1x onset)."""
    if s.false_alarms > other.false_alarms:
        return False
    return s.false_alarms < other.false_alarms or s.in_time_strict >= other.in_time_strict + GAIN_NEEDED


@dataclass
class Verdict:
    """A signal's best rules in sample, held out by seed, and whether it earns a place in the guard."""

    signal: Signal
    alone: Score  # the best rule alone, in sample
    combo: Score  # the guard's rule OR the best rule for the combination, in sample
    cv_alone: Score  # held out
    cv_combo: Score  # held out
    cv_over_lr: Score  # the learning-rate control OR the best rule for that combination, held out
    earns: bool
    why: str


def judge(
    sw: Sweep,
    rows: dict[RunConfig, Row],
    guard: Score,
    lr_control: Score,
) -> Verdict:
    """Earns its place: held out, alone as good as the guard's rule with no false alarm, or OR the guard's rule
    ``GAIN_NEEDED`` more in time with none; and more than a learning-rate detector: OR the learning-rate control,
    it beats the control alone (:func:`beats`)."""
    alone = best(sw.scores)
    combo = best([score(f"guard | {s.rule}", either(guard.warnings, s.warnings), rows) for s in sw.scores])
    cv_alone = cross_validate(sw.scores, rows, None)
    cv_combo = cross_validate(sw.scores, rows, guard.warnings)
    cv_over_lr = cross_validate(sw.scores, rows, lr_control.warnings)
    as_good = cv_alone.false_alarms == 0 and cv_alone.in_time_strict >= guard.in_time_strict
    adds = beats(cv_combo, guard)
    not_lr = beats(cv_over_lr, lr_control)
    gain = cv_combo.in_time_strict - guard.in_time_strict
    gain_lr = cv_over_lr.in_time_strict - lr_control.in_time_strict
    parts = [
        f"alone {cv_alone.in_time_strict}/{cv_alone.collapses} fa{cv_alone.false_alarms}",
        f"guard|it {gain:+d} fa{cv_combo.false_alarms}",
        f"lr|it {gain_lr:+d} fa{cv_over_lr.false_alarms}",
    ]
    if (as_good or adds) and not not_lr:
        parts.append("a learning-rate proxy: adds nothing to the lr itself")
    return Verdict(
        sw.signal, alone, combo, cv_alone, cv_combo, cv_over_lr, (as_good or adds) and not_lr, "; ".join(parts)
    )


def report(traces: dict[RunConfig, Trace], wall: float) -> list[Verdict]:
    """Classes, where the signals sit, the rule sweeps, and the verdict per signal (printed)."""
    rows = classify_traces(traces)
    counts = {k: sum(r.cls == k for r in rows.values()) for k in ("collapse", "borderline", "healthy", "reference")}
    print(f"\nclasses (the benchmark's classify): {counts}")
    collapse = [r for r in rows.values() if r.cls == "collapse"]
    if not collapse:
        print("no collapsing run: nothing to score")
        return []
    onsets = [r.onset_strict for r in collapse if r.onset_strict is not None]
    stalls = [r.stall for r in collapse if r.stall is not None]
    print(f"collapse: 0.1x onsets at steps {min(onsets)}..{max(onsets)}, loss stalls {min(stalls)}..{max(stalls)}")

    print(
        f"\nWhere the signals sit (sampled every {EVERY} steps; max over modules for per-module signals):\n"
        f"{'signal':18s} | {'healthy + reference, steps>=20':^20s} | {'collapse, 10 steps before 0.1x onset':^30s} | "
        f"{'borderline, steps>=20':^20s}\n"
        f"{'':18s} | {'min..max':^20s} | {'median':>9s} {'min..max':^20s} | {'min..max':^20s}"
    )
    for signal in (MAX_LOGIT, LR_CONTROL, *SIGNALS):
        print(describe(signal, traces, rows))

    guard = score("guard: LogitGrowthRule(80, 2.0, 20, 100)", guard_warnings(traces, EVERY), rows)
    lr_sweep = sweep(LR_CONTROL, traces, rows)
    lr_control = best(lr_sweep.scores)
    print(f"\n{SCORE_NOTE}\n\n{SCORE_HEAD}\n{'-' * len(SCORE_HEAD)}")
    print(guard.line(guard.rule))
    print(score("", guard_warnings(traces, 1), rows).line("  the same rule sampled every step"))
    print(lr_control.line(f"control, the lr itself: {lr_control.rule}"))
    guard_over_lr = score("", either(guard.warnings, lr_control.warnings), rows)
    print(guard_over_lr.line("  guard | lr control (what the max logit adds to the lr)"))

    verdicts: list[Verdict] = []
    for signal in SIGNALS:
        sw = sweep(signal, traces, rows)
        print(f"\n{signal.key}: {signal.family} ({len(sw.rules)} rules swept)")
        for fam in ("G", "B", "S"):
            fam_scores = [s for s in sw.scores if s.rule.startswith(fam)]
            top = best(fam_scores)
            print(top.line(f"  {'no false alarm' if top.false_alarms == 0 else 'fewest false alarms'}: {top.rule}"))
            loose = max(fam_scores, key=lambda s: (s.in_time_strict, s.in_time, -s.false_alarms))
            if loose is not top:
                print(loose.line(f"  most in time: {loose.rule}"))
        v = judge(sw, rows, guard, lr_control)
        print(v.combo.line(f"  {v.combo.rule}"))
        rule = sw.rules[v.alone.rule]
        every_step = {cfg: first_step(views_of(signal, tr, 1), rule) for cfg, tr in traces.items()}
        print(score("", every_step, rows).line(f"  {v.alone.rule}, sampled every step"))
        print(v.cv_alone.line("  held out by seed: the best alone"))
        print(v.cv_combo.line("  held out by seed: guard | the best for it"))
        print(v.cv_over_lr.line("  held out by seed: lr control | the best for it"))
        verdicts.append(v)

    print(
        f"\nVerdict. Earns its place: held out by seed, alone as good as the guard's rule with no false alarm, or OR "
        f"the guard's rule >= {GAIN_NEEDED} more collapsing runs in time (0.1x onset) with no more false alarms; and "
        f"OR the learning-rate control, >= {GAIN_NEEDED} more than the control alone (else a learning-rate proxy).\n"
        f"The guard's rule: {guard.in_time_strict}/{guard.collapses} in time (0.1x onset), {guard.in_time}/"
        f"{guard.collapses} (0.2x), {guard.before_stall}/{guard.collapses} before the stall, {guard.false_alarms}/"
        f"{guard.quiet} false alarms; the lr control {lr_control.in_time_strict}/{lr_control.collapses} with "
        f"{lr_control.false_alarms}; guard | lr control {guard_over_lr.in_time_strict}/{guard_over_lr.collapses} with "
        f"{guard_over_lr.false_alarms} (the max logit adds {guard_over_lr.in_time_strict - lr_control.in_time_strict})."
        f"\nCells: in time before the 0.1x onset / before the 0.2x onset, false alarms (of {guard.quiet})."
    )
    head = (
        f"{'signal':18s} {'alone':>15s} {'guard | it':>15s} {'held out: alone':>15s} {'guard | it':>15s} "
        f"{'lr | it':>15s}  verdict"
    )
    print(head + "\n" + "-" * (len(head) + 60))

    def cell(s: Score) -> str:
        return f"{s.in_time_strict}/{s.in_time} fa{s.false_alarms}"

    for v in verdicts:
        print(
            f"{v.signal.key:18s} {cell(v.alone):>15s} {cell(v.combo):>15s} {cell(v.cv_alone):>15s} "
            f"{cell(v.cv_combo):>15s} {cell(v.cv_over_lr):>15s}  {'EARNS ITS PLACE' if v.earns else 'no'} ({v.why})"
        )
    secs = [tr.seconds for tr in traces.values()]
    print(
        f"\ntraining wall {wall:.0f} s for {len(traces)} runs (1 process), "
        f"per run {statistics.median(secs):.1f} s median"
    )
    return verdicts


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 runs of 150 steps (2 layers, seeds 0-1)")
    parser.add_argument("--attention", nargs="+", choices=["manual", "sdpa"], default=["manual"])
    parser.add_argument("--replay", type=Path, default=None, help="score a traces file without training")
    parser.add_argument("--out", type=Path, default=None, help=f"traces JSON (default {DEFAULT_OUT}, not with --quick)")
    args = parser.parse_args(argv)
    if args.replay is not None:
        traces, meta = read_json(args.replay)
        wall = meta["wall_seconds"]
        print(f"replaying {len(traces)} runs from {args.replay}")
    else:
        configs = build_grid(args.quick, args.attention, 150 if args.quick else 300)
        print(
            f"{len(configs)} runs, 1 process, torch {torch.__version__}, {os.cpu_count()} CPUs, "
            f"load average {os.getloadavg()[0]:.2f}",
            flush=True,
        )
        start = time.perf_counter()
        traces = {}
        for cfg in configs:
            traces[cfg] = train(cfg)
            print(f"  {cfg.name:28s} L{cfg.n_layers} {traces[cfg].seconds:5.1f} s", flush=True)
        wall = time.perf_counter() - start
        print(f"wall {wall:.0f} s, load average after: {os.getloadavg()[0]:.2f}")
        out = args.out or (None if args.quick else DEFAULT_OUT)
        if out is not None:
            meta = {
                "command": " ".join(["python -m studies.other_precursors", *(sys.argv[1:] if argv is None else argv)]),
                "torch": torch.__version__,
                "wall_seconds": round(wall, 1),
                "workers": 1,
                "reference_lr": REFERENCE_LR,
                "row": "the benchmark's classify(): class, onset (0.2x), onset_strict (0.1x), stall (informative; "
                "--replay recomputes them)",
                "signals": "per step: logz_mean/logz_max (logsumexp of the head's logits, mean/max over tokens), "
                "grad_norm (global, before the step), update_norm (||theta_after - theta_before||, whole model), "
                "update_rel (update_norm / ||theta_before||), update_spike / grad_spike (the value over the median "
                "of the 20 steps before); per attention module: max_logit, entropy, min_entropy (the benchmark's), "
                "qkv_update_rel (the qkv weight's relative update), qkv_adam_rms (RMS of m_hat / (sqrt(v_hat) + "
                "eps)), qkv_stable_rms (sqrt(mean(g^2 / v_hat)), StableAdamW's)",
            }
            write_json(out, traces, meta)
            print(f"traces: {out} ({out.stat().st_size / 1e6:.2f} MB)")
    print(check_against_benchmark(traces))
    report(traces, wall)


if __name__ == "__main__":
    main()
