"""The rollout engines' ends of the three weight paths (the learner's are ``streamrl.learner.rl.weights``).

* :mod:`.zmq` - pull the buckets of a version from the learner's weight server (any engine, any host).
* :mod:`.ipc` - :class:`~.ipc.IpcWeightReceiver`: copy the learner's CUDA IPC buffers into staging
  buffers on the same GPU and verify them; :class:`~.ipc.FlatParameters` loads them in one copy per buffer.
* :mod:`.broadcast` - :class:`~.broadcast.BroadcastReceiver`: a member of the learner's
  weight-broadcast group, receiving every version into staging buffers in the background.
* :mod:`.lora` - a LoRA run's versions, the adapter alone (``payload = "lora"``): fetched over ZMQ or
  IPC and verified like full weights, then copied into the transformers engine's peft layers or written
  as the peft folder the vLLM engine loads.
* :mod:`.vllm_extension` - the worker extension vLLM mixes into each of its workers, which runs the
  three above inside the worker process (imported by vLLM by qualified name).

Every version is verified before it is loaded: blake2b over the buckets (ZMQ), the block checksum
of :mod:`streamrl.torchkit.flat` (IPC, broadcast), both named by the signed ``WeightsPublished`` event.
"""
