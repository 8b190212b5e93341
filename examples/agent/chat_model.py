"""A tiny chat policy for the agent example and its tests: the arithmetic demo's character-level
Llama with role tokens and a chat template, built locally (no hub).

The template renders ``<|role|>content`` per message, ends each assistant message with ``</s>``
(the token the policy ends a reply with) and, with the generation prompt, opens ``<|assistant|>``::

    <|user|>12+34=<|assistant|>46</s><|user|>#<|assistant|>

So a reply the endpoint returned, sent back as the assistant message, renders to exactly the tokens
the engine generated: the conversation extends token for token (docs/agents.md).

    python examples/agent/chat_model.py OUT_DIR    # OUT_DIR/model, OUT_DIR/train.jsonl, OUT_DIR/eval.jsonl
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "arithmetic"))

import model as model_lib
import task as task_lib
from transformers import PreTrainedTokenizerFast

ROLES = ("system", "user", "assistant", "tool")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}</s>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_chat_tokenizer() -> PreTrainedTokenizerFast:
    """The arithmetic tokenizer plus one special token per role and the chat template."""
    tokenizer = model_lib.build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [f"<|{role}|>" for role in ROLES]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def prepare(out_dir: Path, seed: int = 0) -> Path:
    """Data (2-digit additions) and a randomly initialised small chat policy under ``out_dir``."""
    train, held_out = task_lib.make_splits(task_lib.TaskSpec(operators="+", digits=2, num_eval=64, seed=seed))
    task_lib.write_jsonl(out_dir / "train.jsonl", train)
    task_lib.write_jsonl(out_dir / "eval.jsonl", held_out)
    tokenizer = build_chat_tokenizer()
    model_lib.save(
        model_lib.build_model(model_lib.PRESETS["small"], tokenizer, seed=seed), tokenizer, out_dir / "model"
    )
    return out_dir


if __name__ == "__main__":
    print(prepare(Path(sys.argv[1])))
