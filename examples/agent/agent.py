"""An agent program that trains through the rollout tier's OpenAI endpoint, with the official client.

Each task is one sample of a prompt the run issued. The agent has a two-request conversation:
it asks the problem, then - as a stand-in for a tool result or a user's follow-up - says ``#``
("once more") and takes the second reply as its answer; it scores that answer itself and reports
the reward, which makes the conversation one trajectory of the run (docs/agents.md)::

    export STREAMRL_AGENT_TOKEN=...                  # the token the rollout worker was started with
    python examples/agent/agent.py --base-url http://127.0.0.1:8000/v1 --workers 4

Nothing here is streamrl code: the conversation goes through ``openai.OpenAI`` pointed at the
task's ``base_url``; taking a task and reporting the reward are two plain HTTP calls.
``--record FILE`` writes what the endpoint returned for each request (JSON lines), so a test can
compare it with the trajectories the learner trained on.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
from openai import OpenAI

FOLLOW_UP = "#"


def reward(answer: str, label: str | None) -> float:
    """1 for the right answer; else a little for each digit, so that a random policy gets a signal."""
    if label is not None and answer.strip() == label:
        return 1.0
    return 0.1 * sum(c.isdigit() for c in answer) / max(1, len(answer))


def converse(task: dict[str, Any], token: str) -> dict[str, Any]:
    """One conversation on ``task``; returns what was asked and answered."""
    client = OpenAI(base_url=task["base_url"], api_key=token, max_retries=0)
    messages: list[dict[str, str]] = [{"role": "user", "content": task["prompt"]}]
    requests = []
    for follow_up in (None, FOLLOW_UP):
        if follow_up is not None:
            messages.append({"role": "user", "content": follow_up})
        completion = client.chat.completions.create(
            model=task["model"], messages=messages, logprobs=True, extra_body={"return_token_ids": True}
        )  # type: ignore[arg-type]
        choice = completion.choices[0]
        content = choice.message.content or ""
        assert choice.logprobs is not None and choice.logprobs.content is not None
        extra, choice_extra = completion.model_extra or {}, choice.model_extra or {}
        requests.append(
            {
                "prompt_token_ids": extra["prompt_token_ids"],
                "token_ids": choice_extra["token_ids"],
                "logprobs": [t.logprob for t in choice.logprobs.content],
                "content": content,
                "finish_reason": choice.finish_reason,
                "policy_version": extra["policy_version"],
            }
        )
        messages.append({"role": "assistant", "content": content})
    return {"requests": requests, "reward": reward(requests[-1]["content"], task["label"])}


def work(base_url: str, token: str, idle_s: float, record: list[dict[str, Any]], lock: threading.Lock) -> int:
    """Take tasks until none comes for ``idle_s`` or the endpoint goes away; returns how many
    conversations were finished. Waits up to ``idle_s`` for the endpoint to come up."""
    done = 0
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {token}"}, timeout=idle_s + 30) as http:
        wait_for(http, idle_s)
        while True:
            try:
                response = http.post("/streamrl/episodes", json={"wait_s": idle_s})
                response.raise_for_status()
                if response.status_code == 204:
                    return done
                task = response.json()
                result = converse(task, token)
                finished = http.post(f"/streamrl/episodes/{task['id']}/reward", json={"reward": result["reward"]})
                finished.raise_for_status()
            except (httpx.TransportError, openai.APIConnectionError) as e:  # the run ended
                print(f"agent: the endpoint went away ({type(e).__name__}): stopping")
                return done
            with lock:
                record.append({"trajectory_id": task["trajectory_id"], **result})
            done += 1


def wait_for(http: httpx.Client, timeout_s: float) -> None:
    """Until the endpoint answers (the rollout worker may still be loading its model)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            http.get("/models").raise_for_status()
            return
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--token-env", default="STREAMRL_AGENT_TOKEN", help="variable holding the bearer token")
    parser.add_argument("--workers", type=int, default=4, help="conversations at once")
    parser.add_argument("--idle-s", type=float, default=30.0, help="stop when no task came for this long (s)")
    parser.add_argument("--record", default="", help="write each conversation's requests here (JSON lines)")
    args = parser.parse_args()
    token = os.environ[args.token_env]
    record: list[dict[str, Any]] = []
    lock = threading.Lock()
    with ThreadPoolExecutor(args.workers) as pool:
        counts = list(pool.map(lambda _: work(args.base_url, token, args.idle_s, record, lock), range(args.workers)))
    if args.record:
        with open(args.record, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in record)
    print(f"agent: {sum(counts)} conversations finished")


if __name__ == "__main__":
    main()
