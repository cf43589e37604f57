"""DreamDDP's schedule: which iteration of the period averages which layer.

Every layer is averaged once per period of H iterations; its exchange is launched during the
iteration and waited for just before the layer is next used. Layers are numbered in the order
their exchanges are launched, with profiled times: ``backward_s[l]``, the compute between
layer l-1's launch and layer l's, ``comm_s[l]``, the time of layer l's exchange, and
``slack_s[l]``, the compute between the last launch and layer l's next use. One link carries
the exchanges one after another, so in an iteration that averages the layers S (in launch
order):

1. layer l is launched at ``ready_l = backward_s[0] + ... + backward_s[l]``;
2. its exchange starts when it is launched and the link is free: ``finish_l = max(finish,
   ready_l) + comm_s[l]``;
3. it is needed at ``ready_{L-1} + slack_s[l]``, and the iteration stalls by ``exposed(S) =
   max(0, max over l in S of finish_l - ready_{L-1} - slack_s[l])`` (a wait pushes every later
   use back by as much, so the largest lateness is the stall).

DreamDDP launches in one of two ways (``dreamddp.py``):

- as the iteration's forward starts (a layer's value is final once the previous optimizer step
  wrote it), every due layer at once in the order the forward uses them: ``backward_s`` is all
  zeros, and ``slack_s[l]`` is the forward and backward pass, the optimizer step and the next
  forward up to layer l. The first layers of the forward, the ones needed first, are launched
  first (with equal launch times that order is the one that makes the largest lateness least),
  and each exchange has a whole iteration to hide behind;
- from the backward pass, as each layer's gradients are produced (the paper's): the order is
  the backward order, ``backward_s`` the backward compute between two layers, and
  ``slack_s[l]`` the optimizer step and the next forward up to layer l (zero when the optimizer
  step waits for the exchanges: step 3 is then ``max(0, finish_last - ready_{L-1})``). The
  layers the backward pass finishes last are the ones the next forward uses first, and their
  exchanges have only the optimizer step to hide behind.

``plan_layers`` assigns every layer to one iteration so that the worst iteration's exposed
time is the least, then the heaviest iteration's communication (the sum of its ``comm_s``),
then the exposed times' sum (the order of the key), exactly for small cases (branch and bound
over the assignments, iterations with the same link, load and lateness being
interchangeable), and with the best assignment found within ``max_nodes`` nodes of the search
otherwise (never worse than the greedy start: each layer, in launch order, to the iteration
whose link frees first, the least loaded of those).

The second term spreads the bytes over the period. Exposure alone is indifferent between
stacking layers whose exchanges the model hides in a few iterations and spreading them over
all H, and the search, from a start that filled the first iterations, kept the stack: half the
iterations exchanged nothing, the others several layers each. An exchange hidden behind
computation is not free where the ranks' cores also move the packets (the exchange's copies,
reductions and the network stack take cycles from the computation), so the step that carries
the most bytes is the slow one; spreading them evenly is what the method promises (``4 N / H``
per step). Where the units are slices of layers (``layer_parts.py``) the
load is their bytes (``load``): each slice's profiled time holds a message's fixed cost that
the iteration's one message pays once, and balancing those times balances the slices' count,
not their bytes.

Last, no iteration is left empty while another holds two layers or more: the best plan moves
layers into the empty iterations as long as its key does not get worse (a layer exchanged
alone finishes no later than in company, and the iteration it leaves no later either). The key
is indifferent to an empty iteration; the ranks are not. An allreduce ends once the last rank
has launched it, so each iteration's landing holds the ranks that run ahead back to the
slowest; with no exchange in an iteration they run on unchecked, and the skew they gather is
paid at the next landing, by the ranks ahead, in one step.
``brute_force_plan`` tries every assignment, for the tests.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

#: A plan's key: (the worst iteration's exposed time, the heaviest iteration's communication,
#: the sum of the exposed times).
Key = tuple[float, float, float]


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


def exposed_s(
    layers: Sequence[int],
    backward_s: Sequence[float],
    comm_s: Sequence[float],
    slack_s: Sequence[float] | None = None,
) -> float:
    """Seconds an iteration that averages ``layers`` stalls waiting for them (steps 1-3 of the
    module docstring; ``slack_s`` None: every layer needed at the last launch)."""
    ready = list(itertools.accumulate(backward_s))
    slack = [0.0] * len(backward_s) if slack_s is None else slack_s
    finish, late = 0.0, 0.0
    for layer in sorted(layers):
        finish = max(finish, ready[layer]) + comm_s[layer]
        late = max(late, finish - ready[-1] - slack[layer])
    return late


def plan_key(
    plan: Sequence[int],
    backward_s: Sequence[float],
    comm_s: Sequence[float],
    num_iterations: int,
    slack_s: Sequence[float] | None = None,
    load: Sequence[float] | None = None,
) -> Key:
    """The key of ``plan`` (``plan[l]`` = the iteration that averages layer l); ``load``: what
    each layer adds to its iteration's load (``comm_s`` when None: ``plan_layers``)."""
    weight = comm_s if load is None else load
    members = [[layer for layer, h in enumerate(plan) if h == it] for it in range(num_iterations)]
    costs = [exposed_s(layers, backward_s, comm_s, slack_s) for layers in members]
    loads = [sum(weight[layer] for layer in layers) for layers in members]
    return max(costs), max(loads), sum(costs)


def brute_force_plan(
    backward_s: Sequence[float],
    comm_s: Sequence[float],
    num_iterations: int,
    slack_s: Sequence[float] | None = None,
) -> tuple[list[int], Key]:
    """The best plan by trying all ``H^L`` of them (small cases only)."""
    _check(backward_s, comm_s, num_iterations, slack_s)
    best: tuple[list[int], Key] | None = None
    for plan in itertools.product(range(num_iterations), repeat=len(backward_s)):
        key = plan_key(plan, backward_s, comm_s, num_iterations, slack_s)
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
    # The greedy start: each layer to the iteration whose link frees first, the least loaded
    # of those (all links are free when the first layers are ready: without the load every
    # layer would go to iteration 0 while its link keeps up).
    finish = [0.0] * num_iterations
    loads = [0.0] * num_iterations
    plan = [0] * count
    for layer in range(count):
        it = min(range(num_iterations), key=lambda h: (max(finish[h], ready[layer]), loads[h], h))
        plan[layer] = it
        finish[it] = max(finish[it], ready[layer]) + comm_s[layer]
        loads[it] += weight[layer]
    best_plan = list(plan)
    best_key = plan_key(plan, backward_s, comm_s, num_iterations, slack, weight)
    nodes = 0

    def key_of(lates: list[float], loads: list[float]) -> Key:
        return max(lates), max(loads), sum(lates)

    def search(
        layer: int, frees: list[float], loads: list[float], lates: list[float], current: list[int]
    ) -> None:
        nonlocal best_plan, best_key, nodes
        nodes += 1
        # Exposed times and loads only grow as layers are added: the partial key bounds the
        # complete one.
        if nodes > max_nodes or key_of(lates, loads) >= best_key:
            return
        if layer == count:
            best_plan, best_key = list(current), key_of(lates, loads)
            return
        tried: set[tuple[float, float, float]] = set()
        for it in range(num_iterations):
            state = frees[it], loads[it], lates[it]
            if state in tried:  # interchangeable with one already tried
                continue
            tried.add(state)
            frees[it] = max(state[0], ready[layer]) + comm_s[layer]
            loads[it] = state[1] + weight[layer]
            lates[it] = max(state[2], frees[it] - end - slack[layer])
            current.append(it)
            search(layer + 1, frees, loads, lates, current)
            current.pop()
            frees[it], loads[it], lates[it] = state

    zeros = [0.0] * num_iterations
    search(0, list(zeros), list(zeros), list(zeros), [])
    return _fill_empty(best_plan, backward_s, comm_s, num_iterations, slack, weight)


def _fill_empty(
    plan: list[int],
    backward_s: Sequence[float],
    comm_s: Sequence[float],
    num_iterations: int,
    slack_s: Sequence[float],
    load: Sequence[float],
) -> list[int]:
    """``plan`` with a layer moved into each empty iteration (the module docstring) while one
    can be without a worse key: from the iterations with the most layers first, their lightest
    layer first."""
    plan = list(plan)
    key = plan_key(plan, backward_s, comm_s, num_iterations, slack_s, load)
    while True:
        members = [
            [layer for layer, h in enumerate(plan) if h == it] for it in range(num_iterations)
        ]
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
                trial_key = plan_key(trial, backward_s, comm_s, num_iterations, slack_s, load)
                if trial_key <= key:
                    plan, key, moved = trial, trial_key, True
                    break
            if moved:
                break
        if not moved:
            return plan
