"""Ground truth for issue 26: attention-logit growth and entropy collapse in tiny pre-LN GPTs, and warning rules.

Run from the repository root::

    python -m studies.attention_collapse           # the default grid (88 runs), writes the JSON traces
    python -m studies.attention_collapse --quick   # smoke run: 6 runs of 150 steps, under a minute
    python -m studies.attention_collapse --attention sdpa --qk-norm off --lr 0.1 --seed 3 --layers 2
    python -m studies.attention_collapse --replay studies/traces/attention_collapse_runs.json  # rules only

The traces go to ``studies/traces/attention_collapse_runs.json`` (not committed; ``precursor_rule.py``,
``precursor_rows.py`` and ``qk_clip.py`` read them). The task, the model, the schedule and the side
measurement are ``tests/helpers/collapse_gpt.py``'s; the training loop, the onset, stall and class
definitions below are ``studies/common.py``'s.

Plain torch on CPU, ``torch.set_num_threads(1)`` in each of ``--workers`` processes (default 2). The
default grid took 528 s of wall time on a 2-core machine shared with other jobs (load average ~2;
559 s at load 2-5; ~270 s for the 64 two-layer runs alone at load ~1.5). ``--replay`` re-scores a traces file without
training (its values are rounded to 4 significant digits, so an onset can move by a step or two).

**Task.** Vocabulary 64, sequences of 32 tokens: the first 16 follow a fixed random bigram (Markov)
chain (transition logits ``3 * randn(64, 64)``, task seed 0, the same for every run), the last 16
repeat the first 16 (a copy task, predictable only through attention: an induction circuit). Batch
32, next-token loss on every position. A healthy run learns the chain and then the copy: its loss
falls from 4.2 to ~2.0 by step 40 and to ~0.8 around step 80-100. A seed fixes the init and the
batches, so runs of one seed see the same data.

**Model.** Pre-LN GPT: token + learned position embeddings, ``--layers`` blocks of ``x + attn(LN(x))``,
``x + MLP(LN(x))`` (GELU, 4x), final LN, linear head; d_model 64, 4 heads of 16. The attention
modules are ``blocks.{i}.attn`` (a fused ``qkv`` projection and ``out``). ``--attention manual``
computes ``softmax(q @ k.transpose(-2, -1) / sqrt(d) + causal_mask) @ v``; ``--attention sdpa`` calls
``F.scaled_dot_product_attention(q, k, v, is_causal=True)``; same parameters, same init. ``--qk-norm
on`` adds a LayerNorm over the head dimension (shared by the heads) on q and on k. AdamW (betas
0.9/0.95, weight decay 0), linear warm-up over 30 steps, then cosine decay to 0.1x the peak at the
last step; 300 steps.

**Default grid** (88 runs): 2 layers, seeds 0-3, QK-norm off at lr 0.01, 0.03, 0.05, 0.07, 0.1,
0.15 and on at 0.03, 0.1; 3 layers, seeds 0-1, QK-norm off at 0.01, 0.05, 0.07, 0.1, 0.15 and on at
0.1; every configuration with both implementations. A manual run and its sdpa twin are the same
computation up to float rounding (the script checks: same class, onsets within a few steps), so
they are pairs, not independent samples: 44 distinct trajectories.

**Measurements**, every step, every layer, identical for both implementations: computed on the side
from the detached q and k in float64 under ``no_grad`` (so SDPA's hidden logits are materialised for
the measurement only): the max pre-softmax logit ``q.k / sqrt(d)`` over batch, heads and unmasked
positions; the mean attention entropy in nats (per query row, averaged over batch, heads and rows;
row 0 has one key, entropy 0); the min-entropy bound ``logsumexp - max`` per row (``-log`` of the
largest attention weight, a lower bound of the entropy), averaged the same way; the loss. Also
checked: that every value is finite, and the largest step-to-step loss ratio after step 5. This
side measurement costs ~9 of ~32 ms per step here (float64, 32x32 logits): far above a guard's
budget if done every step.

**Definitions** (computed from the traces):

- *baseline* of a layer's signal: its mean (entropy) or median (max logit, min-entropy bound) over
  steps 5-15 (over the sampled steps among them when a rule samples every s steps).
- *onset*: the first step > 15 where some layer's mean entropy falls below 0.2x its mean over
  steps 5-15; that layer is the *collapsing layer*. Column ``on.1``: the same with 0.1x.
- *reference* of a run: the run with the same implementation, seed and depth, QK-norm off, at
  ``--reference-lr`` (0.01; added when missing). Every reference learns the task (final loss
  0.79-0.81, max logit <= 37).
- *loss stall*: the first step t such that the loss (trailing mean over 10 steps) stays above 1.5x
  the reference's at every step t..t+19. The reference learns the copy around step 80-90, so the
  stall step mostly says when the reference got better, not when the run got worse.
- *class*: ``collapse``: an onset, a loss stall, and a final loss (mean of the last 10 steps) still
  above 1.5x the reference's. ``healthy``: no stall, final loss within 1.5x the reference's, and not
  (an onset together with a max logit >= max(100, 10x baseline)): many healthy runs have an entropy
  onset, from a learned one-hot head (the previous-token head of ``blocks.0``) with small logits,
  and the ``why`` column says so. ``borderline``: the rest (logits grew and entropy fell but the run
  recovered; a stall with no attention signal at all, e.g. QK-norm at lr 0.1, which learns slowly).

**Rules** replayed on the traces with the signals sampled every s in {1, 5, 10} steps (a rule sees
only steps divisible by s; "20 steps earlier" is the sample 20 steps earlier). A rule fires at the
first sampled step where it holds in some layer, and names that layer. Per rule and s: collapsing
runs warned >= 10 steps before the onset (and before the 0.1x onset), the median and range of the
lead, the lead before the loss stall, whether the named layer is the collapsing one, borderline runs
warned, and false alarms (healthy and reference runs warned at any step). Candidates: (a) a fixed
level; (b) a level and a growth factor over 20 steps; (c) k x the layer's own baseline with a floor;
(d) the min-entropy bound below a fraction of its baseline; (e) combinations; then a sweep of level x
growth rules, of which the Pareto front (in time, false alarms, median lead) is printed.

**Findings** (the run the docs cite, 528 s; see the printed tables): 30 collapsing runs (15 pairs), 30 healthy +
12 references, 16 borderline; no NaN/Inf and no loss spike anywhere (largest step-to-step loss ratio
~1.25, the same in healthy runs). Collapse: the max logit of ``blocks.1.attn`` (2 layers) or
``blocks.2.attn`` (3 layers) grows to 880-32000 while ``blocks.0`` goes uniform; the 0.2x entropy
onset comes at steps 31-90 with the max logit only at 62-285; healthy runs peak at 11.7-67. No
max-logit rule warns >= 10 steps before the 0.2x onset in every collapse without false alarms: the
best with none is a level of 70 (18/30, margin 3 over the highest healthy peak); level 100: 12/30
(28/30 against the 0.1x onset, all 30 before the stall, >= 13 steps ahead, 0 false alarms); level 50
and 3x in 20 steps: 22/30 with 4 false alarms. Min-entropy rules alone fire on every healthy run
(learned sharp heads). Sampling every 5 steps costs a few steps of lead; every 10 costs more.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from studies.common import (
    BASELINE_STEPS,
    DEFAULT_LRS_OFF,
    DEFAULT_SEEDS,
    LEAD_NEEDED,
    LayerTrace,
    Row,
    RunResult,
    baseline_median,
    classify_all,
    collapse_grid,
    first_warning,
    read_runs,
    traces_file,
    train,
    with_references,
    write_runs,
)
from tests.helpers.collapse_gpt import RunConfig

DEFAULT_OUT = traces_file("attention_collapse")
SAMPLE_EVERY = (1, 5, 10)


# --------------------------------------------------------------------------------------------------
# Warning rules
# --------------------------------------------------------------------------------------------------


@dataclass
class Sampled:
    """What a rule sees of one layer when the signals are measured every ``every`` steps."""

    every: int
    steps: list[int]
    max_logit: list[float]
    min_entropy: list[float]
    base_logit: float  # median of the sampled steps in 5..15
    base_min_entropy: float

    @classmethod
    def of(cls, trace: LayerTrace, every: int) -> Sampled:
        steps = list(range(0, len(trace.max_logit), every))
        base = [s for s in steps if s in BASELINE_STEPS]
        if not base:
            raise ValueError(f"no sampled step in steps 5..15 with every={every}")
        return cls(
            every,
            steps,
            [trace.max_logit[s] for s in steps],
            [trace.min_entropy[s] for s in steps],
            baseline_median(trace.max_logit, base),
            baseline_median(trace.min_entropy, base),
        )

    def armed(self, i: int) -> bool:
        """Whether sample ``i`` comes after the baseline window (rules relative to the baseline wait)."""
        return self.steps[i] >= BASELINE_STEPS.stop

    def logit_before(self, i: int, lag: int) -> float | None:
        j = i - lag // self.every
        return self.max_logit[j] if j >= 0 else None


# A rule says whether it holds at sample i of a layer.
RuleFn = Callable[[Sampled, int], bool]


def rule_level(limit: float) -> RuleFn:
    """(a) max logit above a fixed level."""
    return lambda x, i: x.max_logit[i] > limit


def rule_growth(level: float, factor: float, lag: int = 20) -> RuleFn:
    """(b) max logit above ``level`` and at least ``factor`` x its value ``lag`` steps earlier."""

    def rule(x: Sampled, i: int) -> bool:
        before = x.logit_before(i, lag)
        return x.max_logit[i] > level and before is not None and x.max_logit[i] >= factor * before

    return rule


def rule_baseline(k: float, floor: float) -> RuleFn:
    """(c) max logit at least ``k`` x its own baseline (median of steps 5-15), and at least ``floor``."""
    return lambda x, i: x.armed(i) and x.max_logit[i] >= max(floor, k * x.base_logit)


def rule_min_entropy(fraction: float) -> RuleFn:
    """(d) min-entropy bound (logsumexp - max) below ``fraction`` x its baseline."""
    return lambda x, i: x.armed(i) and x.min_entropy[i] < fraction * x.base_min_entropy


def both(*rules: RuleFn) -> RuleFn:
    return lambda x, i: all(r(x, i) for r in rules)


def either(*rules: RuleFn) -> RuleFn:
    return lambda x, i: any(r(x, i) for r in rules)


RULES: dict[str, RuleFn] = {
    "a   logit>100": rule_level(100),
    "a   logit>70": rule_level(70),
    "a   logit>50": rule_level(50),
    "b   logit>50 & >=3x 20 steps ago": rule_growth(50, 3),
    "b   logit>30 & >=3x 20 steps ago": rule_growth(30, 3),
    "b   logit>50 & >=2x 20 steps ago": rule_growth(50, 2),
    "b   logit>70 & >=1.5x 20 steps ago": rule_growth(70, 1.5),
    "c5  logit>=5x base & >=20": rule_baseline(5, 20),
    "c10 logit>=10x base & >=20": rule_baseline(10, 20),
    "c10 logit>=10x base & >=50": rule_baseline(10, 50),
    "c20 logit>=20x base & >=20": rule_baseline(20, 20),
    "d   min-ent<0.5x base": rule_min_entropy(0.5),
    "d   min-ent<0.3x base": rule_min_entropy(0.3),
    "d   min-ent<0.2x base": rule_min_entropy(0.2),
    "e   b(50,3x) | c10(50)": either(rule_growth(50, 3), rule_baseline(10, 50)),
    "e   c10(20) & d0.3": both(rule_baseline(10, 20), rule_min_entropy(0.3)),
    "e   logit>50 & d0.3": both(rule_level(50), rule_min_entropy(0.3)),
    "e   b(50,3x) & d0.5": both(rule_growth(50, 3), rule_min_entropy(0.5)),
    "e   b(50,2x) | logit>100": either(rule_growth(50, 2), rule_level(100)),
    "e   b(70,1.5x) | logit>100": either(rule_growth(70, 1.5), rule_level(100)),
}

# The sweep: max logit > level, and (when factor > 1) >= factor x its value 20 steps earlier.
SWEEP_LEVELS = (30, 40, 50, 60, 70, 80, 100, 150)
SWEEP_FACTORS = (1.0, 1.5, 2.0, 3.0)


@dataclass
class RuleScore:
    """One rule at one sampling interval, over the grid."""

    rule: str
    every: int
    collapses: int
    in_time: int
    in_time_strict: int
    right_layer: int
    leads: list[int]
    strict_leads: list[int]
    stall_leads: list[int]
    borderline_warned: int
    borderline: int
    false_alarms: int
    healthy: int
    false_alarm_runs: list[str]


def score_rule(
    label: str,
    rule: RuleFn,
    every: int,
    views: dict[RunConfig, dict[str, Sampled]],
    rows: dict[RunConfig, Row],
) -> RuleScore:
    score = RuleScore(label, every, 0, 0, 0, 0, [], [], [], 0, 0, 0, 0, [])
    for cfg, layer_views in views.items():
        row = rows[cfg]
        warn, layer = first_warning(layer_views, rule) or (None, None)
        if row.cls == "collapse":
            assert row.onset is not None and row.stall is not None and row.onset_strict is not None
            score.collapses += 1
            if warn is None:
                continue
            score.leads.append(row.onset - warn)
            score.strict_leads.append(row.onset_strict - warn)
            score.stall_leads.append(row.stall - warn)
            score.in_time += row.onset - warn >= LEAD_NEEDED
            score.in_time_strict += row.onset_strict - warn >= LEAD_NEEDED
            score.right_layer += layer == row.onset_layer
        elif row.cls == "borderline":
            score.borderline += 1
            score.borderline_warned += warn is not None
        else:
            score.healthy += 1
            if warn is not None:
                score.false_alarms += 1
                score.false_alarm_runs.append(cfg.name + f"/L{cfg.n_layers}@{warn}")
    return score


def score_rules(
    runs: dict[RunConfig, RunResult], rows: dict[RunConfig, Row], rules: dict[str, RuleFn]
) -> list[RuleScore]:
    scores: list[RuleScore] = []
    for every in SAMPLE_EVERY:
        views = {cfg: {n: Sampled.of(t, every) for n, t in run.layers.items()} for cfg, run in runs.items()}
        scores += [score_rule(label, rule, every, views, rows) for label, rule in rules.items()]
    return scores


def sweep_rules() -> dict[str, RuleFn]:
    return {
        (f"logit>{level}" + (f" & >={factor:g}x 20 ago" if factor > 1 else "")): (
            rule_growth(level, factor) if factor > 1 else rule_level(level)
        )
        for level in SWEEP_LEVELS
        for factor in SWEEP_FACTORS
    }


def pareto(scores: list[RuleScore]) -> list[RuleScore]:
    """The scores no other beats on (in time, false alarms, median lead) at the same sampling interval."""

    def key(s: RuleScore) -> tuple[int, int, float]:
        return s.in_time, -s.false_alarms, statistics.median(s.leads) if s.leads else -math.inf

    front: list[RuleScore] = []
    for s in scores:
        ks = key(s)
        dominated = any(
            o.every == s.every and all(a >= b for a, b in zip(key(o), ks, strict=True)) and key(o) != ks for o in scores
        )
        if not dominated and not any(f.every == s.every and key(f) == ks for f in front):
            front.append(s)  # of rules that tie, the first (the lowest level, then the smallest factor)
    return front


# --------------------------------------------------------------------------------------------------
# Grid, output
# --------------------------------------------------------------------------------------------------


def fmt(x: float | None, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def build_grid(args: argparse.Namespace) -> tuple[list[RunConfig], set[RunConfig]]:
    """The configurations to run (references added where missing), and which of them are references."""
    size = {
        "steps": args.steps,
        "d_model": args.d_model,
        "n_heads": args.heads,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "warmup": args.warmup,
    }
    custom = any(v is not None for v in (args.attention, args.qk_norm, args.lr, args.seed, args.layers))
    attentions = args.attention or ["manual", "sdpa"]
    configs: list[RunConfig] = []
    if args.quick:
        for att in attentions:
            configs += [RunConfig(att, qk, 0.1, 0, n_layers=args.layers or 2, **size) for qk in (False, True)]
    elif custom:
        qk = [q == "on" for q in (args.qk_norm or ["off", "on"])]
        lrs = args.lr or list(DEFAULT_LRS_OFF[2])
        seeds = args.seed if args.seed is not None else list(DEFAULT_SEEDS[2])
        for att, q, lr, seed in itertools.product(attentions, qk, lrs, seeds):
            configs.append(RunConfig(att, q, lr, seed, n_layers=args.layers or 2, **size))
    else:
        configs = collapse_grid(attentions, **size)
    return with_references(configs, args.reference_lr)


def run_all(configs: list[RunConfig], workers: int) -> dict[RunConfig, RunResult]:
    results: dict[RunConfig, RunResult] = {}
    if workers <= 1:
        for cfg in configs:
            results[cfg] = train(cfg)
            print(f"  {cfg.name:28s} {results[cfg].seconds:5.1f} s", flush=True)
        return results
    with ProcessPoolExecutor(max_workers=workers) as pool:
        for cfg, res in zip(configs, pool.map(train, configs), strict=True):
            results[cfg] = res
            print(f"  {cfg.name:28s} {res.seconds:5.1f} s", flush=True)
    return results


def print_table(rows: list[Row]) -> None:
    head = (
        f"{'L':1s} {'attention':9s} {'qk':3s} {'lr':>5s} {'seed':>4s} {'class':10s} {'onset':>5s} {'on.1':>4s} "
        f"{'stall':>5s} {'layer':13s} {'logit@10':>8s} {'@20':>6s} {'@50':>6s} {'@onset':>6s} {'peak':>7s} "
        f"{'ent min/base':>12s} {'final':>5s} {'ref':>5s} {'maxLratio':>9s}  why"
    )
    print(head)
    print("-" * (len(head) + 40))
    for r in rows:
        c = r.config
        print(
            f"{c.n_layers:1d} {c.attention:9s} {'on' if c.qk_norm else 'off':3s} {c.lr:5g} {c.seed:4d} {r.cls:10s} "
            f"{fmt(r.onset, 'd'):>5s} {fmt(r.onset_strict, 'd'):>4s} {fmt(r.stall, 'd'):>5s} {r.layer:13s} "
            f"{fmt(r.logit_at['10'], '.3g'):>8s} {fmt(r.logit_at['20'], '.3g'):>6s} {fmt(r.logit_at['50'], '.3g'):>6s} "
            f"{fmt(r.logit_at['onset'], '.3g'):>6s} {r.peak_logit:7.4g} {r.min_entropy_ratio:12.3f} "
            f"{r.final_loss:5.2f} {fmt(r.reference_final_loss, '5.2f'):>5s} {r.max_loss_ratio:9.3f}  {r.why}"
        )


def _median(values: list[int]) -> str:
    return f"{statistics.median(values):.0f}" if values else "-"


def _span(values: list[int]) -> str:
    return f"{min(values)}..{max(values)}" if values else "-"


def print_rules(scores: list[RuleScore], show_false_alarms: bool = False) -> None:
    head = (
        f"{'rule':34s} {'every':>5s} | {'onset: >=10 ahead':>17s} {'median lead':>11s} {'range':>9s} | "
        f"{'onset 0.1x: >=10 ahead':>22s} {'median':>6s} | {'stall: median lead':>18s} {'range':>7s} | "
        f"{'layer ok':>8s} {'borderline':>10s} {'false alarms':>12s}"
    )
    print(head)
    print("-" * len(head))
    for s in scores:
        print(
            f"{s.rule:34s} {s.every:5d} | {f'{s.in_time}/{s.collapses}':>17s} {_median(s.leads):>11s} "
            f"{_span(s.leads):>9s} | {f'{s.in_time_strict}/{s.collapses}':>22s} {_median(s.strict_leads):>6s} | "
            f"{_median(s.stall_leads):>18s} {_span(s.stall_leads):>7s} | {f'{s.right_layer}/{len(s.leads)}':>8s} "
            f"{f'{s.borderline_warned}/{s.borderline}':>10s} {f'{s.false_alarms}/{s.healthy}':>12s}"
        )
        if show_false_alarms and s.false_alarm_runs:
            print(f"{'':41s}false alarms: {', '.join(s.false_alarm_runs)}")


def pair_agreement(runs: dict[RunConfig, RunResult], rows: dict[RunConfig, Row]) -> str:
    """How closely each sdpa run tracks the manual run of the same configuration."""
    same_class = pairs = 0
    onset_gaps: list[int] = []
    agree_until: list[int] = []
    for cfg, run in runs.items():
        twin = replace(cfg, attention="sdpa")
        if cfg.attention != "manual" or twin not in runs:
            continue
        pairs += 1
        same_class += rows[cfg].cls == rows[twin].cls
        a, b = rows[cfg].onset, rows[twin].onset
        if a is not None and b is not None:
            onset_gaps.append(abs(a - b))
        other = runs[twin]
        until = len(run.loss)
        for step in range(len(run.loss)):
            if any(
                abs(t.max_logit[step] - other.layers[n].max_logit[step]) > 0.01 * abs(t.max_logit[step]) + 1e-3
                for n, t in run.layers.items()
            ):
                until = step
                break
        agree_until.append(until)
    if not pairs:
        return "no manual/sdpa pairs"
    return (
        f"{pairs} manual/sdpa pairs (same seed, init and batches): same class in {same_class}; onsets differ by "
        f"{max(onset_gaps, default=0)} steps at most; max logits agree within 1% up to step "
        f"{min(agree_until)} (median {statistics.median(agree_until):.0f}) - the two implementations are "
        f"the same run up to float rounding, so the pairs are not independent samples"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a ~1 minute smoke run (150 steps, seed 0, lr 0.1)")
    parser.add_argument("--attention", nargs="+", choices=["manual", "sdpa"], help="restrict the grid")
    parser.add_argument("--qk-norm", nargs="+", choices=["off", "on"], help="restrict the grid")
    parser.add_argument("--lr", nargs="+", type=float, help="peak learning rates (replaces the grid's)")
    parser.add_argument("--seed", nargs="+", type=int, help="seeds (replaces the grid's)")
    parser.add_argument("--reference-lr", type=float, default=0.01, help="the healthy reference run's LR")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 300, 150 with --quick)")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=None, help="one depth (default grid: 2 and 3 layers)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--workers", type=int, default=2, help="worker processes, one thread each")
    parser.add_argument(
        "--replay", type=Path, default=None, help="classify and score the rules on a traces file, without training"
    )
    parser.add_argument("--out", type=Path, default=None, help=f"traces JSON (default {DEFAULT_OUT}, not with --quick)")
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 150 if args.quick else 300
    custom = any(v is not None for v in (args.attention, args.qk_norm, args.lr, args.seed, args.layers))
    out = args.out or (None if args.quick or custom or args.replay else DEFAULT_OUT)

    if args.replay is not None:
        runs, meta = read_runs(args.replay)
        args.reference_lr, args.workers, wall = meta["reference_lr"], meta["workers"], meta["wall_seconds"]
        args.steps = max(len(r.loss) for r in runs.values())
        print(f"replaying {len(runs)} runs from {args.replay}")
    else:
        configs, _ = build_grid(args)
        print(
            f"{len(configs)} runs of {args.steps} steps, {args.workers} worker(s), torch {torch.__version__}, "
            f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}",
            flush=True,
        )
        start = time.perf_counter()
        runs = run_all(configs, args.workers)
        wall = time.perf_counter() - start
        print(f"load average after: {os.getloadavg()[0]:.2f}")

    rows = classify_all(runs, args.reference_lr)
    order = sorted(
        rows.values(),
        key=lambda r: (r.config.n_layers, r.config.attention, r.config.qk_norm, r.config.lr, r.config.seed),
    )
    print()
    print_table(order)
    counts = {k: sum(r.cls == k for r in order) for k in ("collapse", "borderline", "healthy", "reference")}
    collapse_rows = [r for r in order if r.cls == "collapse"]
    print(f"\nclasses: {counts}; every loss, logit and entropy finite: {all(r.finite for r in order)}")
    if collapse_rows:
        onsets = [r.onset for r in collapse_rows if r.onset is not None]
        stalls = [r.stall for r in collapse_rows if r.stall is not None]
        at_onset = [r.logit_at["onset"] for r in collapse_rows if r.logit_at["onset"] is not None]
        print(
            f"collapse: onsets at steps {min(onsets)}..{max(onsets)}, loss stalls {min(stalls)}..{max(stalls)}, "
            f"max logit at onset {min(at_onset):.0f}..{max(at_onset):.0f}, peak "
            f"{min(r.peak_logit for r in collapse_rows):.0f}..{max(r.peak_logit for r in collapse_rows):.0f}; "
            f"largest step-to-step loss ratio after step 5: {max(r.max_loss_ratio for r in collapse_rows):.3f}"
        )
    healthy_rows = [r for r in order if r.cls in ("healthy", "reference")]
    if healthy_rows:
        peaks = [max(max(t.max_logit) for t in runs[r.config].layers.values()) for r in healthy_rows]
        print(
            f"healthy (incl. references): peak max logit {min(peaks):.1f}..{max(peaks):.1f}; "
            f"{sum(r.onset is not None for r in healthy_rows)} of {len(healthy_rows)} have an entropy onset "
            f"(a learned sharp head) without logit growth; largest step-to-step loss ratio "
            f"{max(r.max_loss_ratio for r in healthy_rows):.3f}"
        )
    print(pair_agreement(runs, rows))

    print("\nCandidate rules (every = sampling interval in steps; false alarms = healthy and reference runs warned):")
    t0 = time.perf_counter()
    scores = score_rules(runs, rows, RULES)
    print_rules(sorted(scores, key=lambda s: (list(RULES).index(s.rule), s.every)), show_false_alarms=False)
    print("\nSweep of level x growth rules, the Pareto front (in time, false alarms, median lead) per interval:")
    sweep = score_rules(runs, rows, sweep_rules())
    print_rules(pareto(sweep), show_false_alarms=True)
    replay = time.perf_counter() - t0

    secs = [r.seconds for r in runs.values()]
    print(
        f"\nwall {wall:.0f} s for {len(runs)} runs ({args.workers} workers), per run {statistics.median(secs):.1f} s "
        f"median ({min(secs):.1f}..{max(secs):.1f}), {1000 * statistics.median(secs) / args.steps:.1f} ms/step "
        f"(measurement included); rule replay {replay:.0f} s"
    )
    if out is not None:
        meta = {
            "command": "python -m studies.attention_collapse" + ("" if out == DEFAULT_OUT else " (custom)"),
            "torch": torch.__version__,
            "wall_seconds": round(wall, 1),
            "workers": args.workers,
            "onset": "first step > 15 where a layer's mean entropy < 0.2x its mean over steps 5-15",
            "onset_strict": "the same with 0.1x",
            "stall": "first step t with the 10-step mean loss > 1.5x the reference's for steps t..t+19",
            "reference": f"same attention, seed and depth, QK-norm off, lr {args.reference_lr}",
            "reference_lr": args.reference_lr,
            "signals": "max_logit, entropy (nats), min_entropy (logsumexp - max), per step, 4 significant digits",
        }
        write_runs(out, runs, rows, meta)
        print(f"traces: {out} ({out.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
