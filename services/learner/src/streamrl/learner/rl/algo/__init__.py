"""RL algorithm library: pure tensor functions (advantages, KL, losses, corrections, shaping).

Modules, one concept each: ``advantages``, ``kl``, ``losses``, ``correction``, ``shaping``;
``config`` (``AlgoConfig``, no torch) selects them by name and ``objective`` composes them for the
learner service. The formulas, their sources and the option table are in ``docs/algorithms.md``.
Nothing is re-exported here so that importing the config never imports torch.
"""
