"""The words of the notices the step engine gives once per run: one place to read and reword them.

The engine decides *when* a notice is due (:class:`~lightning_nanguard.reporting.notices.RankNotices`
keeps it to once per key); what the user reads is written here, next to each other, so that the
same things are said the same way.

Example:
    >>> print(rebaseline(5, 120)[:62])
    NanGuard: 5 loss spikes in a row at step 120: the loss level s
"""

from __future__ import annotations

__all__ = [
    "FABRIC_LOSS_FN",
    "NO_QK_PROJECTIONS",
    "ONE_FABRIC",
    "QK_CLIP_MANUAL_DDP",
    "logged_unsupported",
    "metrics_unsupported",
    "quarantine_unverified",
    "rebaseline",
    "stray_params",
    "sync_free_unsupported",
]

NO_QK_PROJECTIONS = (
    "NanGuard(qk_clip=...): no attention module of the model has query and key projections the guard "
    "knows, so nothing will be rescaled (known: nn.MultiheadAttention, Linear children named q_proj/k_proj, "
    "query/key, q/k, wq/wk, q_lin/k_lin or to_q/to_k, Hugging Face GPT-2's c_attn, and modules with a "
    "`nanguard_qk_projections()` method: see the precursor guide)."
)

QK_CLIP_MANUAL_DDP = (
    "NanGuard(qk_clip=...): off under manual optimisation with several processes (the ranks "
    "could not agree on the rescaling without a collective per optimizer step)."
)

FABRIC_LOSS_FN = (
    "NanGuard: in a Fabric loop bad steps are skipped, but the offending samples, module and op are "
    "named only when the guard can re-run the step: pass NanGuard(loss_fn=...), with "
    "loss_fn(model, batch) -> loss."
)

ONE_FABRIC = (
    "NanGuard: one guard guards one Fabric; this one keeps guarding the first. Give each Fabric its own NanGuard()."
)


def stray_params(count: int) -> str:
    """The optimizer updates ``count`` tensors the model no longer holds."""
    return (
        f"NanGuard: the optimizer updates {count} tensor(s) that are no longer the model's parameters "
        "(replaced by load_state_dict(..., assign=True) or by assigning new Parameters?): training no longer "
        "changes those weights of the model. Load with assign=False, or build the optimizer after replacing "
        "them."
    )


def metrics_unsupported(description: str) -> str:
    """Metrics whose updates a dropped step cannot undo."""
    return f"NanGuard: {description}."


def logged_unsupported(description: str) -> str:
    """``self.log`` values a dropped step cannot withdraw on this Lightning version."""
    return (
        f"NanGuard: {description} on this Lightning version: a skipped step's self.log values stay in the "
        "epoch aggregates (checked on Lightning 2.6)."
    )


def sync_free_unsupported(reason: str) -> str:
    """An optimizer or scaler ``sync_free=True`` cannot skip on the device."""
    return f"NanGuard(sync_free=True): {reason}"


def rebaseline(spikes_in_a_row: int, step: int) -> str:
    """The spike statistic starts over after ``spikes_in_a_row`` spikes."""
    return (
        f"NanGuard: {spikes_in_a_row} loss spikes in a row at step {step}: the loss level shifted for good "
        "(a curriculum change?); the spike statistic starts over from the coming steps."
    )


def quarantine_unverified(why: str) -> str:
    """Quarantine left out records it could not verify."""
    return (
        f"NanGuard: quarantine skipped {why}. Quarantine removes only records whose dataset index and "
        "blame are both verified (see the event's indices_verified and blame_verified); this notice is "
        "given once."
    )
