"""What the rollout engines do with a received version (receiving it is :mod:`streamrl.torchkit.weights`).

* :mod:`.lora` - a LoRA run's versions, the adapter alone (``payload = "lora"``): copied into the
  transformers engine's peft layers or written as the peft folder the vLLM engine loads.
* :mod:`.vllm_extension` - the worker extension vLLM mixes into each of its workers: the event's
  receiver inside the worker process, and the two-phase stage / apply (imported by vLLM by qualified name).
"""
