"""The RL learner: the service that trains on batches from the bus (``service``), its DeepSpeed
step (``trainer``, ``batch``, the algorithms in ``algo``), the learner group of N ranks (``group``)
and the transports that publish its weights to rollout workers (``weights/``: ``zmq``, ``ipc``,
``broadcast``)."""
