"""streamrl.common: what every service shares (messages, codec, bus, consumer loop, config, launcher).

Never imports torch, vLLM or DeepSpeed.
"""

__version__ = "0.1.0"
