"""MG-WFBP: merge a small gradient into the next one when its start-up cost would not pay.

Shi, Wang, Chu and Li, "MG-WFBP: Efficient Data Communication for Distributed Synchronous SGD
Algorithms", INFOCOM 2019. Wait-free backprop sends each group of gradients as soon as it is
ready, so communication overlaps the rest of backward. But every collective pays a start-up
cost alpha: when the next group's gradient follows within less than alpha, sending the two
together finishes earlier than sending them apart. The paper's rule, as we apply it:

1. Measure, for one step, when each unit (a parameter) becomes ready in backward (``ready_s``,
   seconds since backward started), and know each unit's size and the collective's time for
   n bytes (``all_reduce_s``, from ``collectives/tuner.py``: alpha-beta-gamma corrected by
   what calibration measured).
2. Walk the units in launch order, keeping the group being built. Simulate the communication
   stream (one collective at a time, each starting when both its data and the stream are
   ready) for two choices: close the group and send the unit next, or add the unit to the
   group. Add it when that does not finish later; a group whose last unit is ready before the
   stream frees up gains nothing from leaving early, and alpha is saved.
3. Optionally cap a group's bytes (``cap_bytes``), so one huge bucket does not serialise the
   end of backward.

Every rank must get the same layout: the engine broadcasts rank 0's arrival times and every
rank runs this deterministic function on them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def _finish(
    start_free: float, groups: Sequence[tuple[float, int]], cost: Callable[[int], float]
) -> float:
    """When the stream is free after sending ``groups`` (ready time, bytes) in order."""
    free = start_free
    for ready, nbytes in groups:
        free = max(free, ready) + cost(nbytes)
    return free


def merge_by_cost(
    sizes_bytes: Sequence[int],
    ready_s: Sequence[float],
    all_reduce_s: Callable[[int], float],
    *,
    cap_bytes: int | None = None,
) -> list[list[int]]:
    """Group consecutive units (in launch order) as MG-WFBP does; returns lists of positions."""
    if len(sizes_bytes) != len(ready_s):
        raise ValueError(f"{len(sizes_bytes)} sizes but {len(ready_s)} ready times")
    if not sizes_bytes:
        return []
    groups: list[list[int]] = []
    free = 0.0  # when the stream is done with the groups already closed
    current = [0]
    current_bytes, current_ready = sizes_bytes[0], ready_s[0]
    for unit in range(1, len(sizes_bytes)):
        size, ready = sizes_bytes[unit], max(ready_s[unit], current_ready)
        # Choice A: send the current group now, the unit after it; choice B: send them together.
        apart = _finish(free, [(current_ready, current_bytes), (ready, size)], all_reduce_s)
        together = _finish(free, [(ready, current_bytes + size)], all_reduce_s)
        fits = cap_bytes is None or current_bytes + size <= cap_bytes
        if fits and together <= apart:
            current.append(unit)
            current_bytes += size
            current_ready = ready
            continue
        groups.append(current)
        free = _finish(free, [(current_ready, current_bytes)], all_reduce_s)
        current, current_bytes, current_ready = [unit], size, ready
    groups.append(current)
    return groups
