"""The learner unit tests' fixtures: the tiny Qwen2 folder and the data kit (defined in learner_fixtures.py)."""

from __future__ import annotations

from learner_fixtures import kit, tiny_qwen_dir

__all__ = ["kit", "tiny_qwen_dir"]
