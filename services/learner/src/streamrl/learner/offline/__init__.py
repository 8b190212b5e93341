"""Offline jobs that share the learner's DeepSpeed engine but not the bus: SFT, reward-model and
DPO training (``sft``, ``rm``, ``dpo``) over one training loop (``loop``), their data (``data``),
losses, configs, metric sinks and command line (``cli``)."""
