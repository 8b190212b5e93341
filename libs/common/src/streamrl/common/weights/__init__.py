"""The torch-free half of weight sync: what the learner and its rollout workers agree on.

* :mod:`streamrl.common.weights.auth` - signed ``WeightsPublished`` events (HMAC with the run's key).
* :mod:`streamrl.common.weights.wire` - the ZMQ path's buckets, pull protocol, manifest and checksum.
* :mod:`streamrl.common.weights.chunks` - the raw TCP chunk server next to the ZMQ socket.
* :mod:`streamrl.common.weights.stream` - the streaming receiver: chunks over several connections,
  each bucket handed out once verified.
* :mod:`streamrl.common.weights.broadcast` - the broadcast path's rendezvous: store keys and records.

The torch half (flat device buffers, their block checksum, the weight process group) is
``streamrl.torchkit``; both ends of every transport, their protocols and the factory that picks one
are ``streamrl.torchkit.weights``.
"""
