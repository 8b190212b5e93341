"""Weight sync, both ends of every transport side by side (docs/architecture.md "Weight paths").

* :mod:`.protocol` - :class:`~.protocol.WeightPublisher` (learner rank 0) and
  :class:`~.protocol.WeightReceiver` (an engine, or each vLLM worker): all services and engines see.
* :mod:`.factory` - the one place a transport is picked: ``make_publisher(learner.weights_transport)``,
  ``receiver_for(event)`` from the event's ``transport`` tag.
* :mod:`.zmq` - ``zmq``: buckets served from host memory (:mod:`streamrl.common.weights.wire`); any
  engine, any host, late joiners.
* :mod:`.ipc` (+ :mod:`.ipc_plan`, its torch-free checks) - ``ipc``: flat buffers on the learner's GPU
  shared once over CUDA IPC, for an engine on the same GPU.
* :mod:`.broadcast` / :mod:`.broadcast_member` - ``broadcast``: the same flat buffers over a process
  group of the learner and its workers (NCCL, gloo on CPU); membership protocol
  :mod:`streamrl.common.weights.broadcast`.
* :mod:`.relay` - ``relay``: one flat buffer rooted at the learner, relayed worker to worker in verified
  chunks (:mod:`streamrl.common.weights.relay`); each worker's upstreams come from the rollout service's
  view of the registry (a :class:`~.relay.RelaySeat`).
* :mod:`.tied` - the tied head every path sends explicitly (full weights only).

Either payload (full weights, or a LoRA adapter's tensors) travels the same way; every version is
verified against the signed event's checksum before an engine sees it.
"""
