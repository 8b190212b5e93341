"""The reward service's config, scorers and service import without torch, transformers, vLLM or DeepSpeed (checked in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys


def test_config_and_scorers_import_without_torch() -> None:
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'transformers', 'vllm', 'deepspeed'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import streamrl.reward.config, streamrl.reward.scorers, streamrl.reward.service\n"
        "import streamrl.reward.batcher, streamrl.reward.combine\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
