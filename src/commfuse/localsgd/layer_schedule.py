"""DreamDDP's schedule: which iteration of the period averages which layer.

Every layer is averaged once per period of H iterations; its exchange is launched during the
iteration and waited for just before the layer is next used. Layers are numbered in the order
their exchanges are launched, with profiled times: ``backward_s[l]``, the compute between
layer l-1's launch and layer l's, ``comm_s[l]``, the time of layer l's exchange, and
``slack_s[l]``, the compute between the last launch and layer l's next use. One link carries
the exchanges one after another, so in an iteration that averages the layers S (in launch
order):

1. layer l is launched at ``ready_l = backward_s[0] + ... + backward_s[l]``;
2. sent as one message each (``fused`` False), its exchange starts when it is launched and
   the link is free, ``finish_l = max(finish, ready_l) + comm_s[l]``, and it lands at its own
   end; sent as one message (``fused``), the message starts once the last of S is launched and
   every layer of S lands when all of it has arrived: ``finish_l = ready_last + sum over S of
   comm_s`` for each (a layer used first gains nothing from being first in the message);
3. it is needed at ``ready_{L-1} + slack_s[l]``; the iteration's lateness is ``late(S) = max
   over l in S of finish_l - ready_{L-1} - slack_s[l]`` (with one message: the message's end
   against the least slack of S), and it stalls by ``exposed(S) = max(0, late(S))`` (a wait
   pushes every later use back by as much, so the largest lateness is the stall).

``brute_force_plan`` tries every assignment under the same key, for the tests.

Design notes: ``docs/local-sgd.md``, "DreamDDP's schedule".
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

#: A plan's key: (the worst iteration's exposed time, the heaviest iteration's load, the sum of
#: the exposed times, the worst iteration's lateness).
Key = tuple[float, float, float, float]


def _check(
    backward_s: Sequence[float],
    comm_s: Sequence[float],
    num_iterations: int,
    slack_s: Sequence[float] | None,
) -> Sequence[float]:
    """Check the inputs; return the slack (zeros when not given)."""
    slack = [0.0] * len(backward_s) if slack_s is None else slack_s
    if len(backward_s) != len(comm_s) or len(slack) != len(comm_s) or not backward_s:
        raise ValueError(
            f"backward_s, comm_s and slack_s must give one time per layer (at least one), got "
            f"{len(backward_s)}, {len(comm_s)} and {len(slack)}"
        )
    if num_iterations < 1:
        raise ValueError(f"num_iterations (H) must be >= 1, got {num_iterations}")
    if min(*backward_s, *comm_s, *slack) < 0:
        raise ValueError("profiled times must be >= 0")
    return slack


def _lateness_s(
    layers: Sequence[int],
    backward_s: Sequence[float],
    comm_s: Sequence[float],
    slack_s: Sequence[float] | None = None,
    *,
    fused: bool = False,
) -> float:
    """How late the latest of ``layers`` lands for its use (steps 1-3 of the module docstring),
    negative where every one lands early (by the least spare time), ``-inf`` for no layers.

    ``fused``: the layers go as one message, launched once the last of them is ready, and
    every one lands when the whole message has arrived; else one message each, one after
    another on the link."""
    members = sorted(layers)
    if not members:
        return -math.inf
    ready = list(itertools.accumulate(backward_s))
    slack = [0.0] * len(backward_s) if slack_s is None else slack_s
    if fused:
        finish = ready[members[-1]] + sum(comm_s[layer] for layer in members)
        return finish - ready[-1] - min(slack[layer] for layer in members)
    finish, late = 0.0, -math.inf
    for layer in members:
        finish = max(finish, ready[layer]) + comm_s[layer]
        late = max(late, finish - ready[-1] - slack[layer])
    return late


def exposed_s(
    layers: Sequence[int],
    backward_s: Sequence[float],
    comm_s: Sequence[float],
    slack_s: Sequence[float] | None = None,
    *,
    fused: bool = False,
) -> float:
    """Seconds an iteration that averages ``layers`` stalls waiting for them (step 3 of the
    module docstring: ``_lateness_s``, or 0 where it is negative; ``slack_s`` None: every
    layer needed at the last launch)."""
    return max(0.0, _lateness_s(layers, backward_s, comm_s, slack_s, fused=fused))


def plan_key(
    plan: Sequence[int],
    backward_s: Sequence[float],
    comm_s: Sequence[float],
    num_iterations: int,
    slack_s: Sequence[float] | None = None,
    load: Sequence[float] | None = None,
    *,
    fused: bool = False,
) -> Key:
    """The key of ``plan`` (``plan[l]`` = the iteration that averages layer l); ``load``: what
    each layer adds to its iteration's load (``comm_s`` when None: ``plan_layers``)."""
    weight = comm_s if load is None else load
    members = _members(plan, num_iterations)
    lates = [_lateness_s(layers, backward_s, comm_s, slack_s, fused=fused) for layers in members]
    loads = [sum(weight[layer] for layer in layers) for layers in members]
    return _key(lates, loads)


def _members(plan: Sequence[int], num_iterations: int) -> list[list[int]]:
    """The layers of each iteration, in launch order."""
    return [[layer for layer, h in enumerate(plan) if h == it] for it in range(num_iterations)]


def _key(lates: Sequence[float], loads: Sequence[float]) -> Key:
    """A plan's key from its iterations' lateness and load (``Key``)."""
    exposed = [max(0.0, late) for late in lates]
    return max(exposed), max(loads), sum(exposed), max(lates)


def brute_force_plan(
    backward_s: Sequence[float],
    comm_s: Sequence[float],
    num_iterations: int,
    slack_s: Sequence[float] | None = None,
    load: Sequence[float] | None = None,
    *,
    fused: bool = False,
) -> tuple[list[int], Key]:
    """The best plan by trying all ``H^L`` of them (small cases only)."""
    _check(backward_s, comm_s, num_iterations, slack_s)
    best: tuple[list[int], Key] | None = None
    for plan in itertools.product(range(num_iterations), repeat=len(backward_s)):
        key = plan_key(plan, backward_s, comm_s, num_iterations, slack_s, load, fused=fused)
        if best is None or key < best[1]:
            best = (list(plan), key)
    assert best is not None
    return best


def plan_layers(
    backward_s: Sequence[float],
    comm_s: Sequence[float],
    num_iterations: int,
    slack_s: Sequence[float] | None = None,
    *,
    max_nodes: int = 200_000,
    load: Sequence[float] | None = None,
    fused: bool = False,
) -> list[int]:
    """The iteration (0..H-1) that averages each layer (see the module docstring).

    Args:
        backward_s: per layer, in launch order, the compute between the previous layer's
            launch and its own.
        comm_s: per layer, the time of its exchange.
        num_iterations: H, the period.
        slack_s: per layer, the compute between the last launch and its next use (None:
            zeros, every layer needed at the last launch).
        max_nodes: the search stops after this many nodes with the best plan found so far.
        load: per layer, what it adds to its iteration's load, the key's second term (None:
            ``comm_s``). Exchanges timed one by one carry each a message's fixed cost, which
            an iteration sent as one message pays once: slices of layers are balanced by
            their bytes instead.
        fused: an iteration's layers go as one message and all land when it has arrived
            (``_lateness_s``); False: one message per layer, each landing at its own end.

    Returns:
        ``plan[l]``, the iteration of layer l; the same for the same inputs on every rank.

    Raises:
        ValueError: the lists differ in length or are empty, a time is negative, or H < 1.
    """
    slack = _check(backward_s, comm_s, num_iterations, slack_s)
    weight = comm_s if load is None else load
    if len(weight) != len(comm_s) or min(weight) < 0:
        raise ValueError(f"load must give one value >= 0 per layer, got {len(weight)}")
    ready = list(itertools.accumulate(backward_s))
    end = ready[-1]
    count = len(backward_s)

    def key(plan: Sequence[int]) -> Key:
        return plan_key(plan, backward_s, comm_s, num_iterations, slack, weight, fused=fused)

    # An iteration's state as its layers are added in launch order: ``link``, when its last
    # message ends (one message each) or its layers' time added up (one message: it ends at
    # the last layer's launch plus that), its load, its lateness and its layers' least slack.
    State = tuple[float, float, float, float]

    def add(state: State, layer: int) -> State:
        link, weight_sum, late, least = state
        if fused:
            link, least = link + comm_s[layer], min(least, slack[layer])
            late = ready[layer] + link - end - least  # the new layer is the last launched
        else:
            link = max(link, ready[layer]) + comm_s[layer]
            late = max(late, link - end - slack[layer])
        return link, weight_sum + weight[layer], late, least

    def finish(state: State, layer: int) -> float:
        return (ready[layer] + state[0]) if fused else max(state[0], ready[layer])

    empty: State = (0.0, 0.0, -math.inf, math.inf)
    # The greedy start: each layer to the iteration whose link frees first, the least loaded
    # of those (all links are free when the first layers are ready: without the load every
    # layer would go to iteration 0 while its link keeps up).
    states = [empty] * num_iterations
    plan = [0] * count
    for layer in range(count):
        it = min(range(num_iterations), key=lambda h: (finish(states[h], layer), states[h][1], h))
        plan[layer] = it
        states[it] = add(states[it], layer)
    best_plan = list(plan)
    best_key = key(plan)
    nodes = 0

    def key_of(states: list[State]) -> Key:
        return _key([state[2] for state in states], [state[1] for state in states])

    def search(layer: int, states: list[State], current: list[int]) -> None:
        nonlocal best_plan, best_key, nodes
        nodes += 1
        # Every term of an iteration's state only grows as layers are added to it (its
        # least slack only shrinks): the partial key bounds the complete one.
        if nodes > max_nodes or key_of(states) >= best_key:
            return
        if layer == count:
            best_plan, best_key = list(current), key_of(states)
            return
        tried: set[State] = set()
        for it in range(num_iterations):
            state = states[it]
            if state in tried:  # interchangeable with one already tried
                continue
            tried.add(state)
            states[it] = add(state, layer)
            current.append(it)
            search(layer + 1, states, current)
            current.pop()
            states[it] = state

    search(0, [empty] * num_iterations, [])

    def late(layers: Sequence[int]) -> float:
        return _lateness_s(layers, backward_s, comm_s, slack, fused=fused)

    plan = _relieve_latest(best_plan, num_iterations, key, late)
    return _fill_empty(plan, num_iterations, weight, key)


def _fill_empty(
    plan: list[int],
    num_iterations: int,
    load: Sequence[float],
    key: Callable[[Sequence[int]], Key],
) -> list[int]:
    """``plan`` with a layer moved into each empty iteration (the module docstring) while one
    can be without a worse ``key``: from the iterations with the most layers first, their
    lightest layer first."""
    plan = list(plan)
    best = key(plan)
    while True:
        members = _members(plan, num_iterations)
        empty = [it for it in range(num_iterations) if not members[it]]
        sources = sorted(
            (it for it in range(num_iterations) if len(members[it]) > 1),
            key=lambda it: (-len(members[it]), it),
        )
        moved = False
        for source in sources if empty else []:
            for layer in sorted(members[source], key=lambda x: (load[x], x)):
                trial = list(plan)
                trial[layer] = empty[0]
                trial_key = key(trial)
                if trial_key <= best:
                    plan, best, moved = trial, trial_key, True
                    break
            if moved:
                break
        if not moved:
            return plan


def _relieve_latest(
    plan: list[int],
    num_iterations: int,
    key: Callable[[Sequence[int]], Key],
    late: Callable[[Sequence[int]], float],
) -> list[int]:
    """``plan`` with the best move of a layer out of the latest iteration (``late``: an
    iteration's lateness, from its layers) to another, while one makes ``key`` better (the
    module docstring); the latest iteration keeps at least one layer."""
    plan = list(plan)
    best = key(plan)
    for _ in range(len(plan) * num_iterations):  # each move makes the key better: a bound
        members = _members(plan, num_iterations)
        latest = max(range(num_iterations), key=lambda it: (late(members[it]), -it))
        if len(members[latest]) < 2:
            break
        found: tuple[Key, list[int]] | None = None
        for layer in members[latest]:
            for it in range(num_iterations):
                if it == latest:
                    continue
                trial = list(plan)
                trial[layer] = it
                trial_key = key(trial)
                if trial_key < best and (found is None or trial_key < found[0]):
                    found = trial_key, trial
        if found is None:
            break
        best, plan = found
    return plan
