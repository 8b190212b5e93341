"""The rollout service: prompts in, trajectories out, with the weights of the version each prompt asks for.

Layout (each folder a concept; the arrows of the import graph point down this list):

* ``__main__``, ``service``, ``config`` - the entry point, the consumer loop on ``prompts`` and the
  ``weights`` tail (:class:`~streamrl.rollout.service.RolloutService`), and ``RolloutConfig``.
* ``agents/`` - the OpenAI-compatible endpoint an external agent drives an episode through:
  ``openai_server`` (HTTP), ``gateway`` (conversations to engine requests), ``conversation``
  (token-exact transcripts), ``config``.
* ``environments/`` - multi-turn episodes: ``environment`` (the environment protocol, loading one by
  path, calling it), ``calculator`` (the built-in calculator environment), ``episode`` (one
  episode: engine turns and environment steps into one trajectory).
* ``engines/`` - generation: ``engine`` (the protocol and its request/sample types), ``factory``
  (``build_engine``: the one module that imports both implementations), ``hf_engine`` (plain
  transformers, with ``kv_decoder`` and ``sampling``), ``vllm_engine`` (the only module importing
  vLLM), ``driver`` (the driver thread both run their model in), ``config``.
* ``weights/`` - the engines' ends of the three weight paths (ZMQ, CUDA IPC, broadcast) and the vLLM
  worker extension; the torch code they share with the learner is ``streamrl.torchkit``.
* ``vision`` - images for vision-language policies (collapsed and expanded prompts), used by the
  engines and the episodes.
"""
