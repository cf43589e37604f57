"""commfuse inside the trainers people already run: one module per trainer, each imported only
when that trainer is.

===============================  =====================================================
module                           what it gives
===============================  =====================================================
``integrations.lightning``       ``CommfuseDDPStrategy(compressor)``: DDP with commfuse's
                                 hook on CPU and GPU, its state in Lightning's checkpoints;
                                 ``CommfusePeriodicStrategy(method)``: DiLoCo and the other
                                 periodic methods, no DDP wrapper, ``finish()`` at the end
``integrations.accelerate``      ``compress_gradients(accelerator, model, compressor)``:
                                 the hook on a prepared model, its state in ``save_state``;
                                 ``periodic_optimizer(accelerator, model, opt, method)``:
                                 a periodic method over the unprepared model
``integrations.transformers``    ``CompressionCallback(trainer, compressor)``: the hook on
                                 the Trainer's wrapped model, its state in its checkpoints
===============================  =====================================================

Each adapter is a few dozen lines over commfuse's own objects (``CompressionState`` and
``compressed_allreduce_hook`` from ``commfuse.hooks``, ``PeriodicSyncOptimizer``); the
behaviour lives there and is tested there. Error feedback and a compressor's other state differ
from rank to rank, so every adapter saves each rank's hook state and gives each rank its own
back on resume. Snippets: ``docs/integrations.md``.
"""
