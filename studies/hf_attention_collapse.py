"""Issue 26 on a third-party model: a tiny Hugging Face GPT-2 whose attention collapses at a high learning rate.

Run from the repository root::

    python -m studies.hf_attention_collapse           # the default grid, writes the JSON traces
    python -m studies.hf_attention_collapse --quick   # smoke run: 4 runs of 150 steps
    python -m studies.hf_attention_collapse --attention sdpa --lr 0.1 --seed 3

The traces go to ``studies/traces/hf_attention_collapse_runs.json`` (not committed).

Plain torch + ``transformers`` on CPU, one process, ``torch.set_num_threads(1)``; no download
(``GPT2LMHeadModel(GPT2Config(...))``, random init). The default grid (36 runs of 300 steps) took
471 s of wall time on a 2-core machine shared with other jobs (load average 5-6; 610 s at load 7-8),
``--quick`` under a minute (its 150-step schedule decays faster: a smoke run, not the same runs).

**Model.** ``transformers.GPT2LMHeadModel`` (5.x), ``n_layer=2, n_head=4, n_embd=64`` (heads of 16),
``vocab_size=64, n_positions=32``, every dropout 0, no cache, tied input/output embeddings, GPT-2's
own init (std 0.02); ``attn_implementation`` ``eager`` (a softmax in ``eager_attention_forward``) or
``sdpa`` (``F.scaled_dot_product_attention``). The attention modules are ``transformer.h.{i}.attn``.

**Task and training**: those of ``attention_collapse.py`` (``studies/common.py``'s ``fit`` on the task of
``tests/helpers/collapse_gpt.py``, where the model and its side measurement live too): the Markov + copy task
(batch 32, 32 tokens, the same task seed), AdamW betas (0.9, 0.95), weight decay 0, warm-up over 30
steps then cosine to 0.1x, 300 steps; a seed fixes the init and the batches.

**Measured** every step, every layer, on the side: a forward hook on ``c_attn`` splits its output into
q and k and computes, in float64 under ``no_grad``, the causal logits ``q.k * attn.scaling``
(``1/sqrt(16)``) as ``collapse_gpt.attention_signals`` does: the max logit (over batch, heads
and unmasked positions), the mean entropy, the mean min-entropy bound; also the max logit of batch
row 0 alone, which is what ``NanGuard``'s probe measures (``rows=1``); and the loss.

**Definitions**: ``attention_collapse.py``'s (onset: first step > 15 where a layer's mean entropy
< 0.2x its mean over steps 5-15, ``on.1`` with 0.1x; loss stall and class against the reference, the
same attention and seed at lr 0.01). **The guard's rule**: ``LogitGrowthRule(80, 2.0, 20, 100)``
itself, fed the max logit at steps 0, 10, 20, ... (``warn``/``lead``: whole batch, as the other
benchmark; ``warn0``/``lead0``: batch row 0, what the guard sees; a ``Trainer`` run with
``NanGuard()`` warned at the ``warn0`` step in every run tried: lr 0.05 seeds 0 and 1, lr 0.1 seed 0).
Also replayed every 5 and every 1 steps.

**Grid**: eager at lr 0.01 (reference), 0.02, 0.03, 0.04, 0.05, 0.07, 0.1, 0.15, seeds 0-3; sdpa
twins at lr 0.01 and 0.05, seeds 0-1 (the same run up to rounding: same class and warning step).

**Findings** (the run the docs cite, ``hf_attention_collapse_runs.json``). Tiny GPT-2 does collapse:
14 runs (13 distinct), 11 borderline, 5 healthy + 6 references; no NaN/Inf, no loss spike anywhere
(largest step-to-step loss ratio 1.26, the same in healthy runs). It learns the task more slowly
than the hand-written GPT: the references end at loss 0.83 (seed 1, copy learned) to 1.32 (seeds 0
and 3), peak max logit 28-33; lr 0.02 (and 0.03 seed 3) is healthy, peak 57-99. Two collapse regimes:

- lr >= 0.1 (8/8 runs): ``transformer.h.0.attn`` collapses inside the warm-up: its max logit is
  19-106 at step 10 and passes 100 at steps 10-17; entropy onset at steps 16-19 (0.1x at 18-24),
  max logit at the onset 136-579, later 2e4-1.2e5 with entropy ~0.001; final loss 2.3-3.4.
  The first sample above 80 is step 20 (10 in one run): the rule, sampled every 10 steps, warns
  1-4 steps after the onset in 7 of 8 (6 steps before in one); every step it would lead by 3-7.
- lr 0.03-0.07 (6 runs, seeds 1 and 2): ``transformer.h.1.attn`` collapses gradually (``h.0`` goes
  uniform): its entropy falls steadily while the max logit climbs through 80-200 at the onset
  (76-195; onset at steps 23-93), peak 155-3000; final loss 1.5-1.9. The rule fires as the logit crosses 80, about
  when the entropy reaches 0.2x: whole-batch leads 3-19 (10, 19, 19 in time; lr 0.03 seed 1 never).
- Borderline (lr 0.03-0.07, seeds 0, 2, 3): the same gradual collapse, but the seed's reference
  learns slowly too, so the final loss stays within 1.5x of it; the rule fired in 9/11 (either view).

The guard's rule, sampled every 10 steps: warned 13/14 collapses (whole batch), named the
collapsing layer 13/13, fired in 0 of 11 healthy and reference runs, before the loss stall 13/14;
but >= 10 steps before the 0.2x onset only 3/14 (5/14 before the 0.1x onset). On batch row 0, the
guard's own view, 1/14 (3/14 before the 0.1x onset): row 0's max logit can lag the batch's by tens
of steps (lr 0.05 seed 1, onset 59: the batch passed the rule at step 40, row 0 at 80 eager / 110
sdpa; lr 0.03 seed 1: 260 against never).
Sampling every step: 4/14 (7/14 before the 0.1x onset). So on GPT-2 the default warning is mostly
concurrent with the collapse rather than tens of steps ahead; in time at lr 0.04-0.05 (e.g. eager
and sdpa lr 0.05 seed 0: warned at step 50 naming ``h.1``, onset 61, 0.1x onset 95-98 - the case
``tests/integration/test_precursor_hf.py`` trains through a real ``Trainer``).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from studies.common import (
    GUARD_EVERY,
    LEAD_NEEDED,
    REFERENCE_LR,
    LayerTrace,
    Row,
    RunResult,
    classify,
    dump_traces,
    fit,
    guard_warning,
    row_json,
    sig4,
    traces_file,
    with_references,
)
from tests.helpers.collapse_gpt import RunConfig, SideMeasurement, gpt2

DEFAULT_OUT = traces_file("hf_attention_collapse")

DEFAULT_LRS = (0.01, 0.02, 0.03, 0.04, 0.05, 0.07, 0.1, 0.15)
DEFAULT_SEEDS = (0, 1, 2, 3)
SDPA_LRS = (0.01, 0.05)  # sdpa twins of the eager runs at these learning rates, seeds SDPA_SEEDS
SDPA_SEEDS = (0, 1)


@dataclass
class HFRun:
    """One run's traces; ``row0`` is each layer's max logit over batch row 0 only."""

    result: RunResult
    row0: dict[str, list[float]]


def train(config: RunConfig) -> HFRun:
    """Train one tiny GPT-2 on the collapse task (:func:`~studies.common.fit`) and record every step's signals."""
    model = gpt2(config)
    side = SideMeasurement(model)
    layers: dict[str, LayerTrace] = {}
    row0: dict[str, list[float]] = {}
    losses: list[float] = []

    def record(step: int, loss: float) -> None:
        losses.append(loss)
        for name, signals in side.last.items():
            layers.setdefault(name, LayerTrace()).append(signals)
            row0.setdefault(name, []).append(signals[3])

    seconds = fit(config, model, record, logits=lambda x: model(input_ids=x).logits)
    return HFRun(RunResult(config, losses, layers, seconds), row0)


# --------------------------------------------------------------------------------------------------
# The guard's rule, replayed
# --------------------------------------------------------------------------------------------------


@dataclass
class Scored:
    """A run's class (``common.classify``) and the guard's replayed warning (``common.guard_warning``)."""

    row: Row
    warning: int | None
    warned_layer: str | None
    warning_row0: int | None  # on the batch-row-0 max logit (the guard's own view)
    warned_layer_row0: str | None
    nan: bool

    @property
    def lead(self) -> int | None:
        return None if self.warning is None or self.row.onset is None else self.row.onset - self.warning

    @property
    def lead_row0(self) -> int | None:
        return None if self.warning_row0 is None or self.row.onset is None else self.row.onset - self.warning_row0


def score(run: HFRun, reference: HFRun | None, is_reference: bool) -> Scored:
    row = classify(run.result, reference.result if reference else None, is_reference)
    nan = not all(math.isfinite(x) for x in run.result.loss)
    if nan:
        row = replace(row, cls="nan", why="the loss went NaN/Inf")
    warning, layer = guard_warning({n: t.max_logit for n, t in run.result.layers.items()}) or (None, None)
    warning0, layer0 = guard_warning(run.row0) or (None, None)
    return Scored(row, warning, layer, warning0, layer0, nan)


# --------------------------------------------------------------------------------------------------
# Grid, output
# --------------------------------------------------------------------------------------------------


def fmt(x: float | None, spec: str = "d") -> str:
    return "-" if x is None else format(x, spec)


def build_grid(args: argparse.Namespace) -> tuple[list[RunConfig], set[RunConfig]]:
    size = {"steps": args.steps, "n_layers": args.layers, "warmup": args.warmup}
    configs: list[RunConfig] = []
    if args.quick:
        configs = [RunConfig(att, False, lr, 0, **size) for att in ("eager", "sdpa") for lr in (0.01, 0.05)]
    elif args.lr or args.seed is not None or args.attention:
        for att, lr, seed in itertools.product(
            args.attention or ["eager"], args.lr or DEFAULT_LRS, args.seed if args.seed is not None else DEFAULT_SEEDS
        ):
            configs.append(RunConfig(att, False, lr, seed, **size))
    else:
        for seed in DEFAULT_SEEDS:
            configs += [RunConfig("eager", False, lr, seed, **size) for lr in DEFAULT_LRS]
        configs += [RunConfig("sdpa", False, lr, seed, **size) for seed in SDPA_SEEDS for lr in SDPA_LRS]
    return with_references(configs, REFERENCE_LR)


def print_table(scored: list[Scored], runs: dict[RunConfig, HFRun]) -> None:
    head = (
        f"{'attention':9s} {'lr':>5s} {'seed':>4s} {'class':10s} {'onset':>5s} {'on.1':>4s} {'stall':>5s} "
        f"{'onset layer':20s} {'warn':>4s} {'lead':>4s} {'warned layer':20s} {'warn0':>5s} {'lead0':>5s} "
        f"{'@onset':>7s} {'peak':>7s} {'final':>5s} {'ref':>5s}  why"
    )
    print(head)
    print("-" * (len(head) + 30))
    for s in scored:
        r, c = s.row, s.row.config
        trace = runs[c].result.layers[r.layer]
        at_onset = trace.max_logit[r.onset] if r.onset is not None else None
        print(
            f"{c.attention:9s} {c.lr:5g} {c.seed:4d} {r.cls:10s} {fmt(r.onset):>5s} {fmt(r.onset_strict):>4s} "
            f"{fmt(r.stall):>5s} {r.onset_layer or '-':20s} {fmt(s.warning):>4s} {fmt(s.lead):>4s} "
            f"{s.warned_layer or '-':20s} {fmt(s.warning_row0):>5s} {fmt(s.lead_row0):>5s} "
            f"{fmt(at_onset, '.4g'):>7s} {r.peak_logit:7.4g} {r.final_loss:5.2f} "
            f"{fmt(r.reference_final_loss, '5.2f'):>5s}  {r.why}"
        )


def _view(run: HFRun, row0: bool) -> dict[str, list[float]]:
    """The max logit traces a rule sees: over the whole batch, or over batch row 0 (the guard's ``rows=1``)."""
    return run.row0 if row0 else {n: t.max_logit for n, t in run.result.layers.items()}


def summary(scored: list[Scored], runs: dict[RunConfig, HFRun]) -> None:
    counts = {k: sum(s.row.cls == k for s in scored) for k in ("collapse", "borderline", "healthy", "reference", "nan")}
    print(f"\nclasses: {counts}")
    for cls in ("collapse", "borderline", "healthy", "reference"):
        group = [s for s in scored if s.row.cls == cls]
        if not group:
            continue
        all_peaks = [max(max(t.max_logit) for t in runs[s.row.config].result.layers.values()) for s in group]
        line = (
            f"{cls:10s} {len(group):2d} runs, lr {sorted({s.row.config.lr for s in group})}: "
            f"peak max logit (any layer) {min(all_peaks):.1f}..{max(all_peaks):.1f}"
        )
        if cls != "collapse":
            warned = [s for s in group if s.warning is not None or s.warning_row0 is not None]
            line += f"; the guard's rule fired in {len(warned)}/{len(group)}"
            if warned:
                line += " (" + ", ".join(f"{s.row.config.name}@{s.warning}/{s.warning_row0}" for s in warned) + ")"
            print(line)
            continue
        onsets = [s.row.onset for s in group if s.row.onset is not None]
        at_onset = [runs[s.row.config].result.layers[s.row.layer].max_logit[s.row.onset] for s in group if s.row.onset]
        layers = sorted({s.row.onset_layer or "-" for s in group})
        print(
            f"{line}; collapsing layer peak {min(s.row.peak_logit for s in group):.0f}.."
            f"{max(s.row.peak_logit for s in group):.0f}, at the onset {min(at_onset):.0f}..{max(at_onset):.0f}; "
            f"onsets {min(onsets)}..{max(onsets)}; collapsing layers {layers}"
        )
        print(
            f"  {'the guard rule on':26s} {'warned':>6s} {'>=10 before onset':>17s} {'>=10 before 0.1x':>16s} "
            f"{'before stall':>12s} {'layer ok':>8s}  leads before the onset"
        )
        for row0, every in ((False, GUARD_EVERY), (True, GUARD_EVERY), (False, 5), (True, 5), (False, 1)):
            found = [(s, *(guard_warning(_view(runs[s.row.config], row0), every) or (None, None))) for s in group]
            hits = [(s, w, layer) for s, w, layer in found if w is not None]
            leads = sorted(s.row.onset - w for s, w, _ in hits if s.row.onset is not None)
            strict = [s.row.onset_strict - w for s, w, _ in hits if s.row.onset_strict is not None]
            stall = [s.row.stall - w for s, w, _ in hits if s.row.stall is not None]
            right = sum(layer == s.row.onset_layer for s, _, layer in hits)
            label = f"{'batch row 0' if row0 else 'whole batch'}, every {every}"
            print(
                f"  {label:26s} {len(hits):>3d}/{len(group):<2d} {sum(x >= LEAD_NEEDED for x in leads):>14d}/"
                f"{len(group):<2d} {sum(x >= LEAD_NEEDED for x in strict):>13d}/{len(group):<2d} "
                f"{sum(x > 0 for x in stall):>9d}/{len(group):<2d} {right:>5d}/{len(hits):<2d}  {leads}"
            )
        by_lr: dict[float, list[str]] = {}
        for s in group:
            by_lr.setdefault(s.row.config.lr, []).append(f"{fmt(s.lead)}/{fmt(s.lead_row0)}")
        print(
            "  leads (whole batch/row 0, every 10) by lr: "
            + "; ".join(f"{lr:g}: {' '.join(v)}" for lr, v in by_lr.items())
        )
    finite = all(math.isfinite(x) for s in scored for x in runs[s.row.config].result.loss)
    ratios = [s.row.max_loss_ratio for s in scored if math.isfinite(s.row.max_loss_ratio)]
    print(f"every loss finite: {finite}; largest step-to-step loss ratio after step 5: {max(ratios):.3f}")
    by_config = {s.row.config: s for s in scored}
    twins = [(c, replace(c, attention="sdpa")) for c in runs if c.attention == "eager"]
    pairs = [(by_config[a], by_config[b]) for a, b in twins if b in by_config]
    if pairs:
        print(
            f"{len(pairs)} eager/sdpa pairs (same seed, init, batches): same class in "
            f"{sum(a.row.cls == b.row.cls for a, b in pairs)}, same guard warning step in "
            f"{sum(a.warning == b.warning for a, b in pairs)} "
            f"(row 0: {sum(a.warning_row0 == b.warning_row0 for a, b in pairs)})"
        )


def write_json(path: Path, runs: dict[RunConfig, HFRun], scored: list[Scored], meta: dict[str, Any]) -> None:
    out: dict[str, Any] = {"meta": meta, "runs": []}
    for s in scored:
        run = runs[s.row.config]
        out["runs"].append(
            {
                "config": asdict(s.row.config),
                "name": s.row.config.name,
                "row": row_json(s.row),
                "guard": {
                    "warning": s.warning,
                    "layer": s.warned_layer,
                    "lead": s.lead,
                    "warning_row0": s.warning_row0,
                    "layer_row0": s.warned_layer_row0,
                    "lead_row0": s.lead_row0,
                },
                "loss": [sig4(x) for x in run.result.loss],
                "layers": {
                    name: {
                        **{key: [sig4(x) for x in values] for key, values in asdict(trace).items()},
                        "max_logit_row0": [sig4(x) for x in run.row0[name]],
                    }
                    for name, trace in run.result.layers.items()
                },
            }
        )
    dump_traces(path, out)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 runs of 150 steps (lr 0.01 and 0.05, seed 0)")
    parser.add_argument("--attention", nargs="+", choices=["eager", "sdpa"], help="restrict the grid")
    parser.add_argument("--lr", nargs="+", type=float, help="peak learning rates (replaces the grid's)")
    parser.add_argument("--seed", nargs="+", type=int, help="seeds (replaces the grid's)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 300, 150 with --quick)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None, help=f"traces JSON (default {DEFAULT_OUT}, full grid only)")
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 150 if args.quick else 300
    custom = args.quick or args.lr or args.seed is not None or args.attention
    out = args.out or (None if custom else DEFAULT_OUT)
    torch.set_num_threads(1)

    configs, references = build_grid(args)
    print(
        f"{len(configs)} runs of {args.steps} steps, 1 process, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    start = time.perf_counter()
    runs: dict[RunConfig, HFRun] = {}
    for cfg in configs:
        runs[cfg] = train(cfg)
        print(f"  {cfg.name:28s} {runs[cfg].result.seconds:5.1f} s", flush=True)
    wall = time.perf_counter() - start
    print(f"load average after: {os.getloadavg()[0]:.2f}\n")

    scored = [score(run, runs.get(replace(cfg, lr=REFERENCE_LR)), cfg in references) for cfg, run in runs.items()]
    scored.sort(key=lambda s: (s.row.config.attention, s.row.config.lr, s.row.config.seed))
    print_table(scored, runs)
    summary(scored, runs)
    secs = [r.result.seconds for r in runs.values()]
    print(
        f"\nwall {wall:.0f} s for {len(runs)} runs (1 process, 1 thread), per run {statistics.median(secs):.1f} s "
        f"median, {1000 * statistics.median(secs) / args.steps:.1f} ms/step (side measurement included)"
    )
    if out is not None:
        meta = {
            "command": "python -m studies.hf_attention_collapse",
            "model": "transformers.GPT2LMHeadModel, n_layer 2, n_head 4, n_embd 64, vocab 64, n_positions 32, "
            "dropout 0, random init",
            "torch": torch.__version__,
            "wall_seconds": round(wall, 1),
            "workers": 1,
            "onset": "first step > 15 where a layer's mean entropy < 0.2x its mean over steps 5-15",
            "onset_strict": "the same with 0.1x",
            "stall": "first step t with the 10-step mean loss > 1.5x the reference's for steps t..t+19",
            "reference": "same attention and seed, lr 0.01",
            "reference_lr": REFERENCE_LR,
            "guard": "LogitGrowthRule(80, 2.0, 20, 100) on the max logit at steps 0, 10, 20, ...; *_row0: "
            "on batch row 0 only (NanGuard's probe measures rows=1)",
            "signals": "max_logit, entropy (nats), min_entropy, max_logit_row0, per step, 4 significant digits",
        }
        write_json(out, runs, scored, meta)
        print(f"traces: {out} ({out.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
