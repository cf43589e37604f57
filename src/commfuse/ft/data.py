"""Which samples a replica group trains at a step, when the quorum is smaller than the run.

A fault-tolerant run of ``num_replicas`` replica groups defines the data of step ``s`` as one
global batch of ``N = num_replicas x batch`` samples: slot ``r``'s batch is
``workload.batch(s, r, num_replicas)`` (a pure function of seed, step and slot), and sample
``i`` of the global batch is sample ``i % batch`` of slot ``i // batch``. Each committed step
trains a set of those indices; the accounting (``accounting.py``) checks that no index is
trained twice and counts every index left out as lost. Two policies say who trains what while
a replica group is missing (``GlobalBatch``):

* ``shrink``: each replica group trains its own slot, ``[r x batch, (r + 1) x batch)``, and the
  slots of the missing ones are lost: the global batch shrinks with the quorum, and the step's
  gradient is the mean over the samples trained (every participant weighs ``1 / k``);
* ``fixed``: the ``k`` participants of the quorum split the ``N`` indices in ``k`` contiguous
  ranges in the order of their quorum ranks (participant ``p`` takes
  ``[floor(p N / k), floor((p + 1) N / k))``), so the survivors take more samples per step and
  the global batch stays ``N``: nothing is lost while a quorum commits. Ranges differ in size
  by at most one sample when ``k`` does not divide ``N``, so each participant scales its loss
  by ``k x size / N`` before backward: the hook's mean over ``k`` participants is then the
  mean over all ``N`` samples, exactly as one replica training the whole batch would weigh
  them.

Without faults the two are the same run (each participant's range is its own slot and the
scale is 1). A joiner takes part in the step it recovered in (the quorum is synchronous), so
it always knows its range from the quorum it was admitted to.
"""

from __future__ import annotations

from typing import Any

import torch

from commfuse.ft.config import GLOBAL_BATCH_CHOICES, GlobalBatch


def sample_range(
    policy: GlobalBatch,
    *,
    replica: int,
    participant: int,
    participants: int,
    num_replicas: int,
    batch: int,
) -> tuple[int, int]:
    """The indices ``[start, stop)`` of the step's global batch that this replica trains.

    Args:
        policy: ``shrink`` (its own slot) or ``fixed`` (its share of all the slots).
        replica: this replica group's slot (its host).
        participant: its rank in the quorum (0-based).
        participants: the quorum's size.
        num_replicas: replica groups of the run (slots of the global batch).
        batch: samples per slot.

    Raises:
        ValueError: an unknown policy, or a participant outside the quorum.
    """
    if not 0 <= participant < participants:
        raise ValueError(f"participant {participant} is outside a quorum of {participants}")
    if policy == "shrink":
        return replica * batch, (replica + 1) * batch
    if policy == "fixed":
        total = num_replicas * batch
        return participant * total // participants, (participant + 1) * total // participants
    raise ValueError(f"global batch policy must be one of {GLOBAL_BATCH_CHOICES}, got {policy!r}")


def _cat(parts: list[Any]) -> Any:
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    if isinstance(first, (tuple, list)):
        return type(first)(_cat([p[i] for p in parts]) for i in range(len(first)))
    raise TypeError(f"cannot split a batch of type {type(first).__name__} by samples")


def _slice(part: Any, start: int, stop: int) -> Any:
    if isinstance(part, torch.Tensor):
        return part[start:stop]
    return type(part)(_slice(p, start, stop) for p in part)


def global_batch_slice(
    workload: Any, step: int, start: int, stop: int, *, num_replicas: int, batch: int, seed: int
) -> Any:
    """Samples ``[start, stop)`` of step ``step``'s global batch, built from the slots' batches
    that hold them (a tensor, or a tuple of tensors, split along dimension 0)."""
    if not 0 <= start < stop <= num_replicas * batch:
        raise ValueError(f"samples [{start}, {stop}) are outside the global batch")
    parts = []
    for slot in range(start // batch, (stop - 1) // batch + 1):
        lo, hi = max(start, slot * batch), min(stop, (slot + 1) * batch)
        whole = workload.batch(step, slot, num_replicas, seed=seed)
        parts.append(_slice(whole, lo - slot * batch, hi - slot * batch))
    return parts[0] if len(parts) == 1 else _cat(parts)


def loss_scale(start: int, stop: int, *, participants: int, total: int) -> float:
    """``participants x (stop - start) / total``: the factor that turns the quorum's mean of
    per-participant mean losses into the mean over the ``total`` samples (1 with equal
    shares)."""
    return participants * (stop - start) / total
