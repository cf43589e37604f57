"""Which strategies fault-tolerant training runs, and where the periods of per-period mode end.

Two modes run on torchft (``commfuse.ft``):

* per-step (``replica.py``): torch DDP, bare or with a commfuse compressor; every step is a
  quorum, an exchange and a commit;
* per-period (``periodic.py``): the local-SGD family of ``commfuse.localsgd``, the
  ``PeriodicMethod`` configs that ``local_sgd``, ``post_local_sgd``, ``slowmo``, ``diloco`` and
  ``streaming_diloco`` build (``local-sgd:H=8``, ``diloco:H=50,compressor=sparseloco``, ...),
  with any outer compressor. The unit of commit is a *period*: the inner steps from one
  synchronisation to the next, ending with that synchronisation (``sync_points``).

The methods that decide at run time when or what to synchronise (SelSync, ADPSGD, PALSGD,
DreamDDP, local SGD with clipping) and hierarchical local SGD (several ranks per replica
group) are refused with the list of what runs.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from commfuse.localsgd.config import PeriodicMethod, PeriodicSyncConfig
from commfuse.localsgd.fragments import fragments_due
from commfuse.train.strategy import StrategyConfig, describe_strategy

#: What ``ft_mode`` accepts, in words (for errors).
_SUPPORTED = (
    "per step: ddp, or ddp with a commfuse compressor and no engine settings "
    "(powersgd:rank=4, topk:ratio=0.01, ...); per period: local-sgd, post-local-sgd, slowmo, "
    "diloco, streaming-diloco, with any outer compressor (diloco:H=50,compressor=sparseloco)"
)


def ft_mode(strategy: StrategyConfig) -> Literal["ddp", "periodic"]:
    """Whether ``strategy`` runs per step (``ddp``) or per period (``periodic``) under torchft.

    Raises:
        ValueError: a strategy neither mode runs; the message lists those that run.
    """
    if isinstance(strategy, PeriodicMethod):
        ft_periodic_config(strategy)
        return "periodic"
    from commfuse.ft.replica import ft_strategy

    try:
        ft_strategy(strategy)
    except ValueError:
        raise ValueError(
            f"fault-tolerant training does not run {describe_strategy(strategy)}; it runs "
            f"{_SUPPORTED}"
        ) from None
    return "ddp"


def ft_periodic_config(method: PeriodicMethod) -> PeriodicSyncConfig:
    """``method``'s config (``periodic()``) as it runs over the quorum: every exchange on
    gloo's own collectives (``algo="native"``, the compressor's too), which the quorum's
    communicator offers (``quorum_comm.py``); the method's settings unchanged.

    Raises:
        ValueError: hierarchical local SGD (a replica group is one rank here).
    """
    config = method.periodic()
    if config.hierarchical:
        raise ValueError(
            "fault-tolerant local SGD runs one rank per replica group: hierarchical=1 needs "
            "several ranks per host; drop it"
        )
    compressor = config.compressor
    if compressor is not None:
        compressor = dataclasses.replace(compressor, algo="native", gather_algo="native")
    return dataclasses.replace(config, algo="native", compressor=compressor)


def sync_points(method: PeriodicMethod, steps: int) -> list[int]:
    """The inner-step counts at which the periods of ``method``'s run of ``steps`` steps end:
    after each step of the synchronous warm-up (its gradients are averaged), after each step at
    which a fragment synchronises (``fragments_due``: every H steps, F times per H steps for
    streaming DiLoCo), and after the last step (where ``finish()`` lands the exchanges in
    flight and makes the final synchronisation). Period k covers inner steps
    ``[points[k - 1], points[k])`` (from 0 for k = 0); ascending, the last is ``steps``.

    Raises:
        ValueError: ``steps`` below 1.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    config = method.periodic()
    points = []
    for done in range(1, steps + 1):
        periodic = done - config.warmup_steps
        warm = periodic <= 0
        if done == steps or warm or fragments_due(periodic, config.num_fragments, config.H):
            points.append(done)
    return points
