"""Layer 3: gradient compressors with error feedback.

Every compressor averages a flat bucket of gradients over the ranks in place with a smaller
message (``GradientCompressor.reduce_``), declares its ``aggregation`` (allreduce or allgather)
and the exact bytes it contributes (``payload_bytes``), and keeps its step-to-step state
(error-feedback residuals, momentum, PowerSGD factors) in ``state_dict``. Build one with
``make_compressor("topk:ratio=0.01")``; ``commfuse.hooks`` exposes the same ones as torch DDP
communication hooks.

=========== ========= ===================================================== ==============
name        aggreg.   message per rank (d elements, fp32)                   error feedback
=========== ========= ===================================================== ==============
none        allreduce d x 4 bytes                                           -
fp16, bf16  allreduce d x 2 bytes                                           off (ef=1)
int8        allgather 4 + d bytes                                           on
qsgd        allgather 4 per 512-chunk + d x 4 bits (levels <= 7)             off (ef=1 *)
terngrad    allgather 4 per 512-chunk + d x 2 bits                           off
sign        allgather 4 + d / 8 bytes                                       off
ef-sign     allgather 4 + d / 8 bytes                                       on
topk        allgather k x (4 + 4) bytes, k = ceil(ratio d)                   on
randomk     allreduce k x 4 bytes (shared random indices)                    on
randblock   allreduce k x 4 bytes (shared random block)                      on
dgc         allgather k x (4 + 4) bytes, momentum correction, warm-up        always
powersgd    allreduce per tensor: 1-D ones x 4 + (rows + cols) r' x 4 bytes    on
                      (flat bucket, no layout: (m + c) r x 4, m x c ~ d);
                      x 2 instead of x 4 with wire=bf16 or wire=fp16
acpsgd      allreduce per tensor: 1-D ones x 4 + rows r' x 4 bytes (even      on
                      steps, P) or cols r' x 4 (odd steps, Q): one round trip
=========== ========= ===================================================== ==============

Messages of allgather compressors are padded to whole 4-byte words. (*) only when
``levels**2 > chunk_numel``: otherwise the quantiser's variance makes the residual diverge.
PowerSGD needs the shapes of the tensors in a bucket (``set_layout``, which the engine and the
hooks call) to compress each weight matrix on its own (r' = min(r, rows, cols); tensors whose
factors would not be smaller travel as they are); other compressors ignore the layout.
"""

from commfuse.compress.acpsgd import ACPSGDCompressor
from commfuse.compress.base import GradientCompressor, generator_for
from commfuse.compress.cast import BF16Compressor, CastCompressor, FP16Compressor, NoCompression
from commfuse.compress.dgc import DGCCompressor
from commfuse.compress.feedback import ErrorFeedback
from commfuse.compress.int8 import Int8Compressor
from commfuse.compress.message import MessageCompressor
from commfuse.compress.powersgd import PowerSGDCompressor
from commfuse.compress.quantize import QSGDCompressor, TernGradCompressor
from commfuse.compress.sign import EFSignCompressor, SignCompressor
from commfuse.compress.sparse import RandomBlockCompressor, RandomKCompressor, TopKCompressor
from commfuse.compress.spec import COMPRESSORS, make_compressor, parse_spec

__all__ = [
    "COMPRESSORS",
    "ACPSGDCompressor",
    "BF16Compressor",
    "CastCompressor",
    "DGCCompressor",
    "EFSignCompressor",
    "ErrorFeedback",
    "FP16Compressor",
    "GradientCompressor",
    "Int8Compressor",
    "MessageCompressor",
    "NoCompression",
    "PowerSGDCompressor",
    "QSGDCompressor",
    "RandomBlockCompressor",
    "RandomKCompressor",
    "SignCompressor",
    "TernGradCompressor",
    "TopKCompressor",
    "generator_for",
    "make_compressor",
    "parse_spec",
]
