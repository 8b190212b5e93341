"""The learner's ends of the three weight paths (learner rank 0 publishes; ``learner.weights_transport``).

* :mod:`.zmq` - ``zmq`` (default): :class:`~.zmq.WeightServer` serves the weights from host memory
  as the buckets of :mod:`streamrl.common.weights.wire`; any engine, any host, late joiners.
* :mod:`.ipc` - ``ipc``: :class:`~.ipc.IpcWeightPublisher` packs them into flat buffers on the
  learner's GPU shared once over CUDA IPC (an engine on the same GPU).
* :mod:`.broadcast` - ``broadcast``: :class:`~.broadcast.BroadcastWeightPublisher` broadcasts the
  same flat buffers over a process group of the learner and its workers (NCCL, gloo on CPU).
* :mod:`.tied` - the tied head every path sends explicitly (full weights only).
* :mod:`.adapter` - a LoRA run's payload (``learner.lora.sync = "adapter"``): the adapter alone, over
  the ``zmq`` or ``ipc`` path.

The flat buffers, their checksum and the process group are :mod:`streamrl.torchkit`'s (the rollout
side uses the same code); the signed event that announces a version is
:mod:`streamrl.common.weights.auth`'s.
"""
