"""Multi-turn episodes over an engine stand-in: token bookkeeping, masks, budgets, stop reasons, errors.

The stand-in engine is a character-level "policy": it reads its prompt ids back as text, asks a
script what to write, and answers with those characters (one token each) and log-probs that depend
on the position, so every check below sees exactly which context each turn was generated from.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from streamrl.common.errors import RetryableError
from streamrl.common.messages import PromptWorkItem, SamplingParams, Tensor, Turn
from streamrl.rollout.config import EnvironmentConfig
from streamrl.rollout.engines.engine import GenerationRequest, Sample
from streamrl.rollout.environments.calculator import CalculatorEnvironment
from streamrl.rollout.environments.environment import EnvironmentCallError, StepResult
from streamrl.rollout.environments.episode import Episode, EpisodeRunner

EOS = 1
"""The stand-in's end-of-sequence id (no character has it)."""


def tokenize(text: str) -> list[int]:
    return [ord(c) for c in text]


def detokenize(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids if i != EOS)


def logprob(position: int) -> float:
    """The stand-in's behaviour log-prob of the token at ``position`` of the whole sequence."""
    return -0.01 * (position + 1)


class ScriptEngine:
    """Writes ``script(context_text)`` (then EOS) for each request, cut at ``max_new_tokens``."""

    def __init__(self, script: Callable[[str], str]) -> None:
        self.script = script
        self.version = 0
        self.requests: list[GenerationRequest] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.after_request: Callable[[], None] = lambda: None

    async def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        (request,) = requests
        assert request.sampling.n == 1
        self.requests.append(request)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(0.01)
        self.in_flight -= 1
        ids = [*tokenize(self.script(detokenize(request.prompt_ids))), EOS]
        cut = len(ids) > request.sampling.max_new_tokens
        ids = ids[: request.sampling.max_new_tokens]
        start = len(request.prompt_ids)
        sample = Sample(
            token_ids=ids,
            logprobs=[logprob(start + i) for i in range(len(ids))],
            text=detokenize(ids),
            finish_reason="length" if cut else "stop",
            version_start=self.version,
            version_end=self.version,
        )
        self.after_request()
        return [[sample]]

    async def update_weights(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("not used")

    def close(self) -> None:
        pass


def calculator_script(context: str) -> str:
    """Call the calculator on the problem, then answer with its result."""
    if "<result>" not in context:
        return f"<calc>{context.split('=')[0]}</calc>"
    return "Answer: " + context.rsplit("<result>", 1)[1].split("</result>")[0]


def item(prompt: str = "12+7=", n: int = 1, max_new_tokens: int = 32, seed: int | None = None) -> PromptWorkItem:
    return PromptWorkItem(
        id="p1",
        prompt_ids=Tensor.from_list(tokenize(prompt), "int32"),
        prompt_text=prompt,
        label="19",
        metadata={"source": "test"},
        sampling=SamplingParams(n=n, max_new_tokens=max_new_tokens, seed=seed),
    )


def run(
    engine: ScriptEngine,
    work: PromptWorkItem,
    make_env: Callable[[], object] = CalculatorEnvironment,
    max_model_len: int = 4096,
    **config: object,
) -> list[Episode]:
    cfg = EnvironmentConfig(path="unused", **config)  # type: ignore[arg-type]
    runner = EpisodeRunner(engine, make_env, tokenize, cfg, max_model_len)  # type: ignore[arg-type]
    return asyncio.run(runner.run_group(work))


def spans(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) runs of a 0/1 mask."""
    out: list[tuple[int, int, int]] = []
    for i, m in enumerate(mask):
        if out and out[-1][0] == m:
            out[-1] = (m, out[-1][1], i + 1)
        else:
            out.append((m, i, i + 1))
    return out


def test_a_tool_episode_records_turns_masks_and_exact_contexts() -> None:
    engine = ScriptEngine(calculator_script)
    (ep,) = run(engine, item())
    call, result, answer = "<calc>12+7</calc>", "<result>19</result>", "Answer: 19"
    assert ep.token_ids == [*tokenize(call), EOS, *tokenize(result), *tokenize(answer), EOS]
    assert ep.text == call + result + answer
    a, b = len(call) + 1, len(call) + 1 + len(result)
    assert ep.turns == [Turn(start=0, end=a, policy_version=0), Turn(start=b, end=len(ep.token_ids), policy_version=0)]
    assert spans(ep.loss_mask) == [(1, 0, a), (0, a, b), (1, b, len(ep.token_ids))]
    # each turn was generated from the prompt and every token before it, as ids (never re-tokenized)
    prompt = tokenize("12+7=")
    assert [r.prompt_ids for r in engine.requests] == [prompt, prompt + ep.token_ids[:b]]
    # the engine's log-probs on the model's tokens (their absolute positions), 0 on the environment's
    expected = [logprob(len(prompt) + i) if m else 0.0 for i, m in enumerate(ep.loss_mask)]
    assert ep.logprobs == pytest.approx(expected)
    assert (ep.stop_reason, ep.finish_reason, ep.truncated, ep.env_error) == ("done", "stop", False, None)
    assert ep.env_infos == [{"calls": 1, "errors": 0, "answered": False}, {"calls": 0, "errors": 0, "answered": True}]
    assert ep.num_model_tokens == a + len(answer) + 1


def test_turn_rewards_and_versions_are_per_turn() -> None:
    class Counting:
        def __init__(self) -> None:
            self.steps = 0

        def reset(self, prompt: str, label: str | None, metadata: dict) -> None:
            return None

        def step(self, response: str) -> StepResult:
            self.steps += 1
            return StepResult(observation=f"[{self.steps}]", reward=0.5 * self.steps, done=self.steps == 3)

    engine = ScriptEngine(lambda context: "go")
    engine.after_request = lambda: setattr(engine, "version", engine.version + 1)  # an update after every turn
    (ep,) = run(engine, item(), Counting)
    assert [t.reward for t in ep.turns] == [0.5, 1.0, 1.5]
    assert [t.policy_version for t in ep.turns] == [0, 1, 2]
    assert (ep.version_start, ep.version_end, ep.stop_reason) == (0, 2, "done")
    # each turn's version from its first token on (an observation carries the turn's before it)
    assert ep.versions == [(t.start, t.policy_version) for t in ep.turns]
    assert ep.text == "go[1]go[2]go"


@pytest.mark.parametrize("seed", [None, 100])
def test_the_samples_of_a_group_run_concurrently(seed: int | None) -> None:
    engine = ScriptEngine(calculator_script)
    episodes = run(engine, item(n=4, seed=seed))
    assert len(episodes) == 4 and all(ep.stop_reason == "done" for ep in episodes)
    assert engine.max_in_flight == 4, "the four episodes' turns are in the engine together"
    seeds = sorted(r.sampling.seed for r in engine.requests if r.sampling.seed is not None)
    assert seeds == ([] if seed is None else [100, 101, 102, 103, 104, 105, 106, 107])  # seed + j + k * n


def test_max_turns_stops_without_a_trailing_observation() -> None:
    engine = ScriptEngine(lambda context: "<calc>1+1</calc>")
    (ep,) = run(engine, item(), max_turns=3)
    assert len(ep.turns) == 3 and len(engine.requests) == 3
    assert ep.loss_mask[-1] == 1 and ep.text.endswith("</calc>") and ep.text.count("<result>") == 2
    assert (ep.stop_reason, ep.truncated, ep.finish_reason) == ("max_turns", True, "stop")


def test_a_turn_cut_at_max_new_tokens_ends_with_length_and_is_not_stepped() -> None:
    class Never:
        def reset(self, prompt: str, label: str | None, metadata: dict) -> None:
            return None

        def step(self, response: str) -> StepResult:
            raise AssertionError("a cut turn is not shown to the environment")

    (ep,) = run(ScriptEngine(lambda context: "x" * 50), item(max_new_tokens=8), Never)
    assert len(ep.token_ids) == 8 and ep.loss_mask == [1] * 8
    assert (ep.stop_reason, ep.finish_reason, ep.truncated) == ("length", "length", True)


def test_the_token_budget_caps_turns_and_observations() -> None:
    # turn 1: 18 tokens, observation 19: 37 < 40; turn 2 may have 3 tokens and is cut there
    engine = ScriptEngine(calculator_script)
    (ep,) = run(engine, item(), max_tokens=40)
    assert [r.sampling.max_new_tokens for r in engine.requests] == [32, 3]
    assert len(ep.token_ids) == 40 and (ep.stop_reason, ep.finish_reason) == ("max_tokens", "length")
    # an observation that would leave no room for a turn after it is not appended
    engine = ScriptEngine(calculator_script)
    (ep,) = run(engine, item(), max_tokens=37)
    assert len(engine.requests) == 1 and len(ep.token_ids) == 18 and ep.loss_mask == [1] * 18
    assert (ep.stop_reason, ep.finish_reason, ep.truncated) == ("max_tokens", "stop", True)


def test_the_context_limit_ends_with_length_where_it_is_tighter() -> None:
    engine = ScriptEngine(calculator_script)
    (ep,) = run(engine, item(), max_model_len=5 + 40)  # the prompt has 5 tokens
    assert [r.sampling.max_new_tokens for r in engine.requests] == [32, 3]
    assert len(engine.requests[-1].prompt_ids) + 3 == 45 and ep.stop_reason == "length"


def test_an_opening_text_goes_before_the_first_turn_as_environment_tokens() -> None:
    class Opening:
        async def reset(self, prompt: str, label: str | None, metadata: dict) -> str:
            assert (prompt, label, metadata) == ("12+7=", "19", {"source": "test"})
            return "<hint>"

        async def step(self, response: str) -> dict:
            return {"done": True, "reward": 1}

    engine = ScriptEngine(lambda context: "ok")
    (ep,) = run(engine, item(), Opening)
    assert ep.turns == [Turn(start=6, end=9, policy_version=0, reward=1.0)]
    assert ep.loss_mask == [0] * 6 + [1] * 3 and ep.logprobs[:6] == [0.0] * 6
    assert engine.requests[0].prompt_ids == tokenize("12+7=<hint>") and ep.text == "<hint>ok"


class Failing:
    """Answers the first turn, then fails the way ``how`` says."""

    closed: list[str] = []

    def __init__(self, how: str) -> None:
        self.how = how
        self.steps = 0

    def reset(self, prompt: str, label: str | None, metadata: dict) -> None:
        if self.how == "reset":
            raise RuntimeError("no sandbox")
        return None

    async def step(self, response: str) -> object:
        self.steps += 1
        if self.steps == 1:
            return StepResult(observation="<ok>", reward=0.25)
        if self.how == "raise":
            raise ZeroDivisionError("in the tool")
        if self.how == "hang":
            await asyncio.sleep(10)
        return "not a result"

    def close(self) -> None:
        Failing.closed.append(self.how)


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("raise", "step of turn 1 raised ZeroDivisionError: in the tool"),
        ("hang", "step of turn 1 timed out after 0.2 s"),
        ("malformed", "step returned a str, not a StepResult or a mapping"),
    ],
)
def test_an_environment_error_ends_the_episode_with_the_turns_so_far(how: str, message: str) -> None:
    Failing.closed = []
    (ep,) = run(ScriptEngine(lambda context: "go"), item(), lambda: Failing(how), step_timeout_s=0.2)
    assert (ep.stop_reason, ep.env_error, ep.truncated) == ("error", message, False)
    assert [t.reward for t in ep.turns] == [0.25, 0.0] and ep.text == "go<ok>go"
    assert Failing.closed == [how]


def test_a_failed_reset_fails_the_prompt_and_closes_every_environment() -> None:
    Failing.closed = []
    engine = ScriptEngine(lambda context: "go")
    with pytest.raises(EnvironmentCallError, match="reset raised RuntimeError: no sandbox"):
        run(engine, item(n=3), lambda: Failing("reset"))
    assert engine.requests == [] and Failing.closed == ["reset"] * 3


def test_an_opening_text_that_leaves_no_room_fails_the_prompt() -> None:
    class Verbose(CalculatorEnvironment):
        def reset(self, prompt: str, label: str | None, metadata: dict) -> str:  # type: ignore[override]
            return "x" * 50

    with pytest.raises(ValueError, match="opening text \\(50 tokens\\) leave no room for a turn"):
        run(ScriptEngine(lambda context: "go"), item(), Verbose, max_tokens=50)


def test_an_engine_abort_is_retried_and_stops_the_other_episodes() -> None:
    class Aborting(ScriptEngine):
        async def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
            self.requests.append(requests[0])
            if len(self.requests) == 1:
                await asyncio.sleep(0.01)
                return [[Sample([5], [-1.0], "x", "abort", 0, 0)]]
            await asyncio.sleep(10)  # the other episodes: cancelled when the first one fails
            raise AssertionError("not cancelled")

    started = time.monotonic()
    with pytest.raises(RetryableError, match="aborted turn 0"):
        run(Aborting(lambda context: ""), item(n=3))
    assert time.monotonic() - started < 5
