"""Layer 3: gradient compressors with error feedback.

Every compressor is a ``Compressor`` (``base.py``) that averages a bucket in place with a smaller
message; build one (``PowerSGD(rank=8)``) for ``DataParallelConfig`` or ``commfuse.hooks``.

============= =========== ======================================================= ===============
class         aggregation message per rank (d elements, fp32)                     error feedback
============= =========== ======================================================= ===============
NoCompression all_reduce  d x 4 bytes                                             -
FP16, BF16    all_reduce  d x 2 bytes                                             off (ef=True)
Int8          all_gather  4 + d bytes                                             on
QSGD          all_gather  4 per 512-chunk + d x 4 bits (levels <= 7)              off (ef=True *)
TernGrad      all_gather  4 per 512-chunk + d x 2 bits                            off
Sign          all_gather  4 + d / 8 bytes                                         off
EFSign        all_gather  4 + d / 8 bytes                                         on
TopK          all_gather  k x (4 + 4) bytes, k = ceil(ratio d)                    on
RandomK       all_reduce  k x 4 bytes (shared random indices)                     on
RandomBlock   all_reduce  k x 4 bytes (shared random block)                       on
DGC           all_gather  k x (4 + 4) bytes, momentum correction, warm-up         always
PowerSGD      all_reduce  per tensor: 1-D ones x 4 + (rows + cols) r' x 4 bytes   on
                          (flat bucket, no layout: (m + c) r x 4, m x c ~ d);
                          x 2 instead of x 4 with wire="bf16" or wire="fp16"
ACPSGD        all_reduce  per tensor: 1-D ones x 4 + rows r' x 4 bytes (even      on
                          steps, P) or cols r' x 4 (odd steps, Q): one round trip
SparseLoCo    all_gather  per chunk of c (4096): 8 + k x (2 + 1/4) bytes, k = 64    decayed (0.95)
DeMo          all_gather  per chunk of c (64): k x (4 + 1) bytes of DCT, k = 4      momentum (0.9)
Int4          all_gather  4 per chunk of 512 + d / 2 bytes                          on
============= =========== ======================================================= ===============

Design notes: ``docs/data-parallel.md``, "Compressors: the interface, the layout, the padding".
"""

from commfuse.compress.acpsgd import ACPSGD
from commfuse.compress.base import Compressor, OuterRecipe, generator_for
from commfuse.compress.cast import BF16, FP16, CastCompressor, NoCompression
from commfuse.compress.demo import DeMo
from commfuse.compress.dgc import DGC
from commfuse.compress.feedback import ErrorFeedback
from commfuse.compress.int4 import Int4
from commfuse.compress.int8 import Int8
from commfuse.compress.layout import BucketLayout, StateMoves
from commfuse.compress.message import MessageCompressor
from commfuse.compress.powersgd import PowerSGD, Wire
from commfuse.compress.quantize import QSGD, TernGrad
from commfuse.compress.sign import EFSign, Sign
from commfuse.compress.sparse import RandomBlock, RandomK, TopK
from commfuse.compress.sparseloco import SparseLoCo

__all__ = [
    "ACPSGD",
    "BF16",
    "DGC",
    "FP16",
    "QSGD",
    "BucketLayout",
    "CastCompressor",
    "Compressor",
    "DeMo",
    "EFSign",
    "ErrorFeedback",
    "Int4",
    "Int8",
    "MessageCompressor",
    "NoCompression",
    "OuterRecipe",
    "PowerSGD",
    "RandomBlock",
    "RandomK",
    "Sign",
    "SparseLoCo",
    "StateMoves",
    "TernGrad",
    "TopK",
    "Wire",
    "generator_for",
]
