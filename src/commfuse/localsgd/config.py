"""What to synchronise, how often, and the outer optimizer applied to the averaged update."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(kw_only=True)
class PeriodicSyncConfig:
    """One config covers local SGD, post-local SGD, SlowMo, DiLoCo and streaming DiLoCo: they
    differ in the period, the warm-up, the outer optimizer and the fragmenting (see
    ``PRESETS``)."""

    period_steps: int = 8
    """H: inner steps between two synchronisations of a fragment."""
    warmup_steps: int = 0
    """Steps of fully synchronous data parallel (gradients averaged every step) before the
    periodic phase starts (post-local SGD)."""
    outer_lr: float = 1.0
    """Outer learning rate applied to the averaged pseudo-gradient (1.0 with no momentum is
    plain model averaging)."""
    outer_momentum: float = 0.0
    """Momentum of the outer SGD (SlowMo's beta, DiLoCo's 0.9)."""
    inner_lr_scale: float = 1.0
    """Multiplies the inner optimizer's learning rate in the periodic phase (not during the
    synchronous warm-up). A replica's optimizer sees 1/P of the batch that synchronous
    training's does, so its gradients are noisier; AdamW normalises them to full-size steps
    anyway, and the noise then goes into the drift that averaging removes. On charlm (4
    replicas, H=50): from scratch, 100 steps, 0.35-0.5 brought DiLoCo's training loss from 8%
    to 5-6% above DDP's, 2.0 made it 23% worse; from a 200-step DDP model (as the DiLoCo paper
    starts from a pre-trained one) plus 200 steps, 0.35 made the final model's held-out loss
    DDP's (1.801 vs 1.799; 1.918 at 1.0): at the full rate, batch-8 replicas continuing DDP's
    AdamW state see their loss rise for tens of steps."""
    nesterov: bool = False
    """Nesterov momentum for the outer SGD (DiLoCo)."""
    num_fragments: int = 1
    """Streaming DiLoCo: parameters split into this many fragments synchronised at staggered
    steps (fragment f at steps where (step - f H / F) is a multiple of H)."""
    overlap_steps: int = 0
    """Streaming: the exchange of a fragment runs in the background for this many inner steps
    and its result is applied then (0 = applied at once, blocking)."""
    mix_global: float = 1.0
    """Streaming: weight of the synchronised value when it is merged with the local value that
    kept training during the overlap (1.0 discards the local progress of those steps)."""
    hierarchical: bool = False
    """Average gradients inside each host every step and synchronise across hosts every H
    steps (needs the host layout: ranks_per_host)."""
    ranks_per_host: int = 1
    """Ranks per host, for ``hierarchical`` (the launcher's LOCAL_WORLD_SIZE)."""
    compressor: str | None = None
    """A ``commfuse.compress`` spec applied to the outer exchange ("fp16", "int8", ...)."""
    algo: str = "auto"
    """The commfuse allreduce algorithm of the outer exchange."""
    final_sync: bool = True
    """At the end of training (``finish()``), replace every fragment whose replicas have moved
    since its last exchange by the replicas' average (an exchange in flight is applied without
    mixing), so that every rank holds the same final model. Without it a run that stops
    mid-period, and streaming DiLoCo always (its fragments sit at staggered phases and are
    mixed with local values), ends with P different replicas and rank 0's is the one
    evaluated and saved."""

    def __post_init__(self) -> None:
        if self.period_steps < 1:
            raise ValueError(f"period_steps (H) must be >= 1, got {self.period_steps}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.outer_lr <= 0:
            raise ValueError(f"outer_lr must be > 0, got {self.outer_lr}")
        if not self.inner_lr_scale > 0:
            raise ValueError(f"inner_lr_scale must be > 0, got {self.inner_lr_scale}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if self.num_fragments < 1:
            raise ValueError(f"num_fragments must be >= 1, got {self.num_fragments}")
        if self.num_fragments > self.period_steps:
            raise ValueError(
                f"num_fragments={self.num_fragments} > period_steps={self.period_steps}: "
                "each fragment needs its own step in the period"
            )
        if not 0 <= self.overlap_steps < self.period_steps:
            raise ValueError(
                f"overlap_steps must be in [0, period_steps), got {self.overlap_steps}"
            )
        if not 0 < self.mix_global <= 1:
            raise ValueError(f"mix_global must be in (0, 1], got {self.mix_global}")
        if self.ranks_per_host < 1:
            raise ValueError(f"ranks_per_host must be >= 1, got {self.ranks_per_host}")


#: Strategy name -> (defaults, the keys a user may set, mapped to config fields).
PRESETS: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    # Stich, "Local SGD converges fast and communicates little" (ICLR 2019).
    "localsgd": ({"period_steps": 8}, {"H": "period_steps"}),
    # Lin et al., "Don't use large mini-batches, use local SGD" (ICLR 2020).
    "postlocal": (
        {"period_steps": 8, "warmup_steps": 100},
        {"H": "period_steps", "warmup": "warmup_steps"},
    ),
    # Wang et al., "SlowMo: improving communication-efficient distributed SGD with slow
    # momentum" (ICLR 2020).
    "slowmo": (
        {"period_steps": 8, "outer_momentum": 0.5, "outer_lr": 1.0},
        {"H": "period_steps", "beta": "outer_momentum", "alpha": "outer_lr"},
    ),
    # Douillard et al., "DiLoCo: distributed low-communication training of language models"
    # (2023).
    "diloco": (
        {"period_steps": 50, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True},
        {"H": "period_steps", "outer_lr": "outer_lr", "outer_momentum": "outer_momentum"},
    ),
    # Douillard et al., "Streaming DiLoCo with overlapping communication" (2025).
    "streaming-diloco": (
        {
            "period_steps": 50,
            "outer_lr": 0.7,
            "outer_momentum": 0.9,
            "nesterov": True,
            "num_fragments": 4,
            "overlap_steps": 1,
            "mix_global": 0.5,
        },
        {
            "H": "period_steps",
            "fragments": "num_fragments",
            "overlap": "overlap_steps",
            "mix": "mix_global",
            "outer_lr": "outer_lr",
            "outer_momentum": "outer_momentum",
        },
    ),
}

#: Keys every preset accepts.
_COMMON_KEYS = {
    "compress": "compressor",
    "algo": "algo",
    "hierarchical": "hierarchical",
    "inner_lr_scale": "inner_lr_scale",
    "final_sync": "final_sync",
}


def config_from_preset(name: str, options: dict[str, str] | None = None) -> PeriodicSyncConfig:
    """The config of strategy ``name`` (a key of ``PRESETS``) with ``options`` (strings, as
    parsed from ``--strategy diloco:H=50,outer_lr=0.7``) applied."""
    if name not in PRESETS:
        raise ValueError(f"unknown local-SGD strategy {name!r}; known: {', '.join(PRESETS)}")
    defaults, keys = PRESETS[name]
    allowed = {**keys, **_COMMON_KEYS}
    values: dict[str, Any] = dict(defaults)
    types = {f.name: f.type for f in dataclasses.fields(PeriodicSyncConfig)}
    for key, raw in (options or {}).items():
        if key not in allowed:
            raise ValueError(
                f"strategy {name!r} has no option {key!r}; known: {', '.join(sorted(allowed))}"
            )
        field = allowed[key]
        values[field] = _convert(key, raw, str(types[field]))
    return PeriodicSyncConfig(**values)


def _convert(key: str, raw: str, type_name: str) -> Any:
    try:
        if type_name == "int":
            return int(raw)
        if type_name == "float":
            return float(raw)
        if type_name == "bool":
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes")
    except ValueError:
        raise ValueError(f"option {key}={raw!r} is not a valid {type_name}") from None
    return raw
