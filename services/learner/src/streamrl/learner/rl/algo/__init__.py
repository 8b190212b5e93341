"""RL algorithm library: pure tensor functions (advantages, KL, losses, corrections, shaping).

Modules, one concept each: ``advantages``, ``kl``, ``losses``, ``correction``, ``shaping``;
``config`` (``AlgoConfig``, no torch) selects them by name and ``objective`` composes them for the
learner service. The formulas and their sources are in ``/work/shared/algorithms.md`` and the
option table in ``docs/algorithms.md``. Nothing is re-exported here so that importing the config
never imports torch.
"""
