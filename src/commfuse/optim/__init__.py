"""Layer 4: optimizers that communicate, compressed: 1-bit Adam and 0/1 Adam.

Adam's variance cannot ride an error-compensated compressor, so the ``commfuse.compress``
compressors (which average gradients) do not give Adam's convergence at 1 bit. These
optimizers take over the communication themselves: the model is not wrapped in data
parallel; ``step()`` averages whatever it needs (gradients in full precision while the variance
is still learnt, then the momentum or the accumulated update in 1 bit with error feedback).

* ``OneBitAdam`` (``onebit_adam.py``, Tang et al. 2021): Adam warm-up, then frozen variance and
  1-bit momentum every step;
* ``ZeroOneAdam`` (``zeroone_adam.py``, Lu et al. 2022): adaptive variance freezing, then local
  steps with 1-bit synchronisation at ever sparser steps;
* ``CompressedAllReduce`` (``compressed_all_reduce.py``): their two-phase 1-bit allreduce, with
  worker and server residuals, and its byte formulas;
* the configs (``config.py``: the exchanges' settings both share in ``ExchangeConfig``), which
  are also the strategies ``onebit-adam`` and
  ``zeroone-adam`` of ``commfuse train`` and ``commfuse compare``.
"""

from commfuse.optim.compressed_adam import CompressedAdam
from commfuse.optim.compressed_all_reduce import (
    CompressedAllReduce,
    handed_bytes_per_rank,
    two_phase_reference,
    wire_bytes_per_rank,
)
from commfuse.optim.config import (
    ExchangeConfig,
    OneBitAdamConfig,
    ZeroOneAdamConfig,
    sync_steps,
    variance_steps,
)
from commfuse.optim.onebit_adam import OneBitAdam
from commfuse.optim.zeroone_adam import ZeroOneAdam

__all__ = [
    "CompressedAdam",
    "CompressedAllReduce",
    "ExchangeConfig",
    "OneBitAdam",
    "OneBitAdamConfig",
    "ZeroOneAdam",
    "ZeroOneAdamConfig",
    "handed_bytes_per_rank",
    "sync_steps",
    "two_phase_reference",
    "variance_steps",
    "wire_bytes_per_rank",
]
