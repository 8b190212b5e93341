"""streamrl.common: what every service shares (messages, codec, bus, consumer loop, config, telemetry).

Never imports torch, vLLM, DeepSpeed or transformers, nor a service, nor the operator tooling
(``streamrl.ops``, libs/ops): tests/unit/test_import_graph.py checks it.
"""

__version__ = "0.1.0"
