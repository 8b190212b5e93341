"""streamrl's torch library: the code both the rollout and the learner service need, written once.

Services never import each other (they meet only on the bus), and ``streamrl.common`` imports no
torch; what both torch services need lives here, imported by them alone:

* :mod:`streamrl.torchkit.weights` - weight sync: the publisher / receiver protocols, the factory
  that picks a transport, and both ends of every transport (ZMQ, CUDA IPC, broadcast) side by side.
* :mod:`streamrl.torchkit.flat` - flat device buffers of named tensors (layout, typed views) and
  their block checksum: the CUDA IPC and broadcast weight paths' wire contract.
* :mod:`streamrl.torchkit.process_group` - a process group built directly on a store (NCCL or
  gloo), never the default group: the weight-broadcast group of the learner and its workers.
* :mod:`streamrl.torchkit.wire` - torch tensors to and from the ZMQ path's buckets
  (:mod:`streamrl.common.weights.wire`), bf16 as raw 16-bit words.
* :mod:`streamrl.torchkit.delta` - delta weight sync: the changed elements between two versions as
  bytes, applied in place and checked against the new version's digest; the full-or-delta policy.
* :mod:`streamrl.torchkit.vision` - vision-language checkpoints: the vision tower test, the
  processor and its image token.
* :mod:`streamrl.torchkit.testing` - tiny random checkpoints (Qwen2, Idefics3) with a locally
  trained tokenizer, for tests, benchmarks and CPU demos; no service module imports it.
"""
