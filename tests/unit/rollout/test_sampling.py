"""Device-side sampling: per-row distributions equal the one-setting reference; draws follow them."""

from __future__ import annotations

import pytest
import torch

from streamrl.rollout.engines.sampling import RowParams, exponential_noise, pick, processed_logprobs, row_logprobs

SETTINGS = [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.5, 7, 0.6), (0.0, 3, 0.5), (2.0, 100, 0.99)]


def _params(settings: list[tuple[float, int, float]]) -> RowParams:
    return RowParams(
        temperature=torch.tensor([s[0] for s in settings]),
        top_k=torch.tensor([s[1] for s in settings]),
        top_p=torch.tensor([s[2] for s in settings]),
        filtered=True,
    )


def test_mixed_rows_equal_each_rows_own_setting() -> None:
    logits = torch.randn(len(SETTINGS), 40, generator=torch.Generator().manual_seed(0)) * 3
    logits[:, 10] = logits[:, 11]  # a tie at the top-k boundary is kept by both
    got = row_logprobs(logits, _params(SETTINGS))
    for row, (temperature, top_k, top_p) in enumerate(SETTINGS):
        want = processed_logprobs(logits[row : row + 1], temperature, top_k, top_p)[0]
        torch.testing.assert_close(got[row], want)


def test_unfiltered_rows_skip_the_sort_and_match() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    params = RowParams(torch.tensor([1.0, 0.5, 0.0]), torch.zeros(3, dtype=torch.long), torch.ones(3), filtered=False)
    got = row_logprobs(logits, params)
    torch.testing.assert_close(got[0], torch.log_softmax(logits[0], -1))
    torch.testing.assert_close(got[1], torch.log_softmax(logits[1] / 0.5, -1))
    torch.testing.assert_close(got[2], torch.log_softmax(logits[2], -1), msg="greedy reports the raw log-softmax")


@pytest.mark.parametrize("setting", [(1.0, 0, 1.0), (0.8, 4, 1.0), (1.5, 0, 0.7)])
def test_draws_follow_the_processed_distribution(setting: tuple[float, int, float]) -> None:
    """20k draws: empirical frequencies within 4 standard errors of the distribution; none outside it."""
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(2)) * 2
    draws = 20_000
    logp = row_logprobs(logits.expand(draws, -1), _params([setting] * draws))
    gen = torch.Generator().manual_seed(3)
    ids, chosen = pick(logp, torch.zeros(draws, dtype=torch.bool), exponential_noise((draws, 12), logp.device, gen))
    probs = logp[0].exp()
    freq = torch.bincount(ids, minlength=12).double() / draws
    se = (probs * (1 - probs) / draws).sqrt().double()
    assert ((freq - probs.double()).abs() <= 4 * se + 1e-12).all(), (freq, probs)
    assert (freq[probs == 0] == 0).all(), "a filtered token was drawn"
    torch.testing.assert_close(chosen, logp[0][ids])


def test_greedy_rows_take_the_argmax_and_seeded_rows_repeat() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(4))
    params = RowParams(torch.tensor([0.0, 1.0, 1.0, 0.0]), torch.zeros(4, dtype=torch.long), torch.ones(4), False)
    logp = row_logprobs(logits, params)

    def draw(engine_seed: int) -> torch.Tensor:
        own = {1: torch.Generator().manual_seed(7)}
        noise = exponential_noise((4, 30), logp.device, torch.Generator().manual_seed(engine_seed), own)
        return pick(logp, params.temperature <= 0, noise)[0]

    a, b = draw(0), draw(1)
    assert a[0] == logits[0].argmax() and a[3] == logits[3].argmax()
    assert a[1] == b[1], "a row with its own generator does not depend on the engine's"
