"""commfuse: spend less time communicating in distributed PyTorch training.

Layers (see DESIGN.md): ``cluster`` (where ranks run), ``comm`` (the transport every
algorithm uses), ``collectives``, ``fused``/``compress``, ``ddp``/``localsgd``, ``sim``.
"""

__version__ = "0.1.0"
