"""RLTrainer: one RL training step on a TrainingBatch, on DeepSpeed engines.

One step, in order::

    rl        = collate(batch)                                       # padded [B, ...] tensors
    (old, ref, values) = no-grad passes, only when needed           # see below
    rewards   = shape_rewards(...)                                   # [B]
    adv, ret  = compute_advantages(... over the WHOLE batch ...)     # [B, T]
    for each update (ppo_epochs x mini_batches of whole groups):     # rl_batch.update_plan
        N     = normaliser of the update's rows (tokens or sequences)
        for each of grad_accum micro-batches:
            logp  = log pi_theta(response | prompt) at each sample's sampling temperature
            loss  = policy_objective(..., normaliser=N)              # + KL / entropy terms
            backward(loss * grad_accum); step()                      # DeepSpeed divides by grad_accum
    (critic: the same updates on the value loss)

Multi-turn trajectories need nothing else: the loss mask (0 on environment tokens) is the ``mask`` of
every log-prob, KL, entropy, correction, aggregation and metric, and their per-turn rewards reach the
estimator as ``rl.turn_rewards`` (docs/multiturn.md).

Vision-language policies (:mod:`streamrl.learner.vision`): collate prepares each image row's pixel
inputs once per step, and every log-prob pass of a micro-batch holding an image row (policy, pi_old,
reference) runs its rows with them; the loss and masks are the same.

With one update per batch (the default) the proximal policy ``pi_old`` equals ``pi_theta`` before
the step, so when nothing else needs a separate pass the trainer uses ``logp.detach()`` as ``old``
and saves a forward pass. A no-grad pass over the batch is made first when there are several
updates (later ones are clipped against the policy the batch started from), when the KL sits in
the reward (advantages need ``k(old, ref)``) or when a critic is trained (advantages need values).

Data parallel (a learner group of W ranks): every rank collates the whole batch and computes the
same advantages; each update's rows are dealt out to the ranks balanced by tokens
(:func:`rl_batch.rank_share`), and each rank splits its share into ``grad_accum`` micro-batches.
The normaliser is the whole update's divided by W, so DeepSpeed's mean over ranks gives the
gradient of the 1-rank loss. No-grad passes run on each rank's share and are summed over ranks;
a rank with nothing to do in a micro-batch still runs one row with zero loss, so every rank joins
every collective (ZeRO-3 gathers parameters inside each forward). Metrics are summed over ranks.

Failures in a group: every rank must agree on a step's outcome, or one rank waits for ever in a
collective the others left. A failure before a backward pass - a non-finite loss, an exception in
collate or in a forward (an out-of-memory error, bad data) on any rank - is held by the rank until the
next agreement point (after collate, before a no-grad pass's sum, before each micro-batch's backward),
where one all-reduce of an ok flag makes every rank raise :class:`StepFailedError` together; the
group then gathers the failing rank's error for rank 0 (:mod:`~streamrl.learner.rl.group`). With
ZeRO-3 a forward holds collectives of its own, so only a non-finite loss is agreed on; any other
exception (and one raised after a backward on any stage) ends its rank, and the group exits for the
orchestrator to restart it.

For the samples whose trace is recorded (``traces.traced_rows``) and with an off-policy correction on,
the step also keeps each one's mean correction weight and masked fraction (``sample_corrections``,
gathered from the rank that trained it) for the learner's training spans; other samples cost nothing.
"""

from __future__ import annotations

import logging
import time
import zlib
from contextlib import nullcontext
from typing import Any

import torch

from streamrl.common.messages import TrainingBatch
from streamrl.learner.engine import ModelEngine
from streamrl.learner.logprobs import entropy as entropy_fn
from streamrl.learner.logprobs import token_logprobs
from streamrl.learner.prompt_sharing import shared_prompt_logits
from streamrl.learner.rl.adapter import check_target_modules
from streamrl.learner.rl.algo.kl import KLController, kl_estimate, sequence_mean_kl
from streamrl.learner.rl.algo.losses import aggregate, normaliser_count, value_loss
from streamrl.learner.rl.algo.objective import compute_advantages, policy_objective, sample_correction, shape_rewards
from streamrl.learner.rl.batch import RLBatch, collate, micro_batches, rank_share, response_logits_index, update_plan
from streamrl.learner.rl.config import LearnerConfig
from streamrl.learner.rl.traces import SampleCorrection, traced_rows
from streamrl.learner.vision import check_learner, image_inputs
from streamrl.learner.vision import response_logprobs as image_response_logprobs

logger = logging.getLogger(__name__)


def response_logits(model: Any, mb: RLBatch, share_prompts: bool = False) -> torch.Tensor:
    """[b, T, V] logits predicting each response token, divided by each sample's temperature.

    ``share_prompts``: each distinct prompt is computed once (:mod:`streamrl.learner.prompt_sharing`).
    """
    width = mb.response_ids.shape[1]
    if share_prompts:
        picked = shared_prompt_logits(model, mb.input_ids, mb.attention_mask, mb.prompt_lens, width)
    else:
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
        index = response_logits_index(mb.prompt_lens, width).clamp(max=logits.shape[1] - 1).to(logits.device)
        picked = logits.gather(1, index[:, :, None].expand(-1, -1, logits.shape[-1]))
    return picked / mb.temperatures.to(picked.device)[:, None, None]


def response_values(critic: Any, mb: RLBatch) -> torch.Tensor:
    """[b, T] critic values V(s_t) of the state before each response token."""
    out = critic(input_ids=mb.input_ids, attention_mask=mb.attention_mask)
    values = out.logits.squeeze(-1)
    index = response_logits_index(mb.prompt_lens, mb.response_ids.shape[1]).clamp(max=values.shape[1] - 1)
    return values.gather(1, index.to(values.device)).float()


class StepFailedError(RuntimeError):
    """A step failed before a backward pass on one rank or more; every rank of the group raises it at the
    same point. ``local``: this rank's own error (None when it failed elsewhere)."""

    def __init__(self, message: str, local: str | None) -> None:
        super().__init__(message)
        self.local = local


def describe(error: BaseException, rank: int) -> str:
    """``Type: message (rank r)``: how a rank's failure is reported."""
    return f"{type(error).__name__}: {error} (rank {rank})"


class RLTrainer:
    """Owns the policy engine (and reference / critic) and runs training steps."""

    def __init__(self, cfg: LearnerConfig) -> None:
        self.cfg = cfg
        algo = cfg.algo
        optimizer_steps = cfg.total_steps * cfg.updates_per_batch  # what the lr schedules count
        if cfg.lora is not None:
            check_target_modules(cfg.model, cfg.lora)
        self.policy = ModelEngine.from_config(
            cfg.model,
            cfg.ds,
            "causal_lm",
            lora=cfg.lora,
            total_steps=optimizer_steps,
            shared_prompts=cfg.share_prompts,
            freeze_vision_tower=cfg.freeze_vision_tower,
        )
        self.images = image_inputs(self.policy)
        """Pixel inputs of image trajectories (None for a text-only policy)."""
        if self.images is not None:
            check_learner(uses_critic=algo.uses_critic, zero_stage=cfg.ds.zero_stage, world_size=self.policy.world_size)
        self.device = self.policy.device
        self.pad_id = int(self.policy.tokenizer.pad_token_id)
        # with LoRA and no other reference model, the reference is the policy's own frozen base: its
        # forwards with the adapter switched off (no second copy of the base in memory)
        base_is_reference = cfg.lora is not None and cfg.ref_model is None
        self.ref: ModelEngine | None = None
        if algo.needs_reference:
            self.ref = (
                self.policy
                if base_is_reference
                else ModelEngine.from_config(cfg.ref_model or cfg.model, cfg.ds, "causal_lm", train=False)
            )
        self.critic = (
            ModelEngine.from_config(cfg.critic_model or cfg.model, cfg.ds, "value", total_steps=optimizer_steps)
            if algo.uses_critic
            else None
        )
        self.policy_algo = algo.model_copy(update={"critic": None})  # value loss is trained on the critic engine
        self.kl_ctl = KLController(algo.kl.coef, algo.kl.target, algo.kl.horizon)
        self.world, self.rank = self.policy.world_size, self.policy.rank
        self.agreeable = self.world > 1 and self.cfg.ds.zero_stage < 3
        """Whether an exception before a backward pass is held for the group's agreement (see the docstring)."""
        self.sample_corrections: dict[int, SampleCorrection] = {}
        """Row -> correction figures of the last step's traced samples (empty without a correction)."""

    def _logprobs(
        self, engine: ModelEngine, mb: RLBatch, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if mb.has_images:  # row by row with the pixel inputs (vision.py)
            return image_response_logprobs(engine, mb, self.cfg.ds, with_entropy)
        if not self.cfg.share_prompts:  # unpadded varlen forward, fused log-prob head (lm_forward.py)
            from streamrl.learner.lm_forward import rl_response_logprobs

            return rl_response_logprobs(engine, mb, self.cfg.ds, with_entropy)
        logits = response_logits(engine, mb, self.cfg.share_prompts)
        targets = mb.response_ids.to(logits.device)
        logp = token_logprobs(logits, targets)
        return logp, (entropy_fn(logits) if with_entropy else None)

    @torch.no_grad()
    def _no_grad_pass(
        self, engine: ModelEngine, rl: RLBatch, chunks: list[list[int]], values: bool = False
    ) -> torch.Tensor:
        """Log-probs (or values) of this rank's rows ``chunks``, summed over the ranks into the whole batch's."""
        out = torch.zeros_like(rl.mask, device=self.device)
        error = None
        try:
            for rows in chunks:
                if rows or self.world > 1:  # an empty chunk still joins ZeRO-3's gathers: one row, result dropped
                    mb = rl.select(rows or [0])
                    result = response_values(engine, mb) if values else self._logprobs(engine, mb, False)[0]
                    if rows:
                        out[rows] = result.to(out.device)
        except Exception as e:  # held for the group's agreement, raised on every rank below
            if not self.agreeable:
                raise
            error = describe(e, self.rank)
        self._agree(error)
        if self.world > 1:
            torch.distributed.all_reduce(out)
        return out.cpu()

    def _my_micro_batches(self, rl: RLBatch, rows: list[int]) -> list[list[int]]:
        """This rank's share of ``rows`` (balanced by tokens across the group) in ``grad_accum`` micro-batches."""
        share = rank_share(rows, rl.group_index, rl.attention_mask.sum(dim=1), self.world, self.rank)
        return [[share[i] for i in chunk] for chunk in micro_batches(len(share), self.cfg.ds.grad_accum)]

    def _sum_over_ranks(self, values: dict[str, float]) -> dict[str, float]:
        if self.world == 1:
            return values
        gathered: list[dict[str, float] | None] = [None] * self.world
        torch.distributed.all_gather_object(gathered, values)
        total: dict[str, float] = {}
        for part in gathered:
            for k, v in (part or {}).items():
                total[k] = total.get(k, 0.0) + v
        return total

    def step(self, batch: TrainingBatch) -> dict[str, float]:
        """Train on ``batch`` (``updates_per_batch`` optimizer steps); returns the step's metrics."""
        started = time.perf_counter()
        algo = self.cfg.algo
        error = None
        try:
            rl = collate(batch, self.pad_id, self.images)
            chunks = self._my_micro_batches(rl, list(range(rl.size)))
            plan = update_plan(
                rl.group_index,
                mini_batches=self.cfg.mini_batches,
                epochs=self.cfg.ppo_epochs,
                grad_accum=self.cfg.ds.grad_accum,
                seed=zlib.crc32(batch.id.encode()),
            )
        except Exception as e:  # held for the group's agreement, raised on every rank below
            if not self.agreeable:
                raise
            error = describe(e, self.rank)
        self._agree(error)
        mask = rl.mask
        kl_in_reward = algo.kl.placement == "reward" and self.ref is not None
        old = ref = old_values = kl = None
        if kl_in_reward or self.critic is not None or len(plan) > 1:
            old = self._no_grad_pass(self.policy, rl, chunks)
        if self.ref is not None:
            with self.policy.module.disable_adapter() if self.ref is self.policy else nullcontext():
                ref = self._no_grad_pass(self.ref, rl, chunks)
        if kl_in_reward:
            assert old is not None and ref is not None
            kl = kl_estimate(old, ref, algo.kl.estimator) * mask
        if self.critic is not None:
            old_values = self._no_grad_pass(self.critic, rl, chunks, values=True)
        lengths = mask.sum(dim=1)
        rewards = shape_rewards(algo, rewards=rl.rewards, response_lengths=lengths, truncated=rl.truncated)
        advantages, returns = compute_advantages(
            algo,
            rewards=rewards,
            group_index=rl.group_index,
            mask=mask,
            kl=kl,
            values=old_values,
            kl_coef=self.kl_ctl.value,
            turn_rewards=rl.turn_rewards,
        )
        wanted = set(traced_rows(batch)) if algo.correction.type != "none" else set()
        corrections: dict[int, SampleCorrection] = {}
        metrics = self._train_updates(
            rl, plan, old, ref, advantages, old_values, returns, batch.id, wanted, corrections
        )
        corrections = _to_host(corrections)
        self.sample_corrections = self._gather(corrections) if wanted and self.world > 1 else corrections
        if old_values is not None:
            metrics["learner/value_mean"] = float((old_values * mask).sum() / mask.sum())
        if kl is not None:
            current_kl = float(sequence_mean_kl(kl, mask).mean())
            metrics["learner/kl_coef"] = self.kl_ctl.value
            self.kl_ctl.update(current_kl, rl.size)
        metrics.update(
            {
                "learner/grad_norm": self.policy.grad_norm or 0.0,
                "learner/lr": self.policy.lr,
                "learner/advantage_mean": float((advantages * mask).sum() / mask.sum().clamp(min=1)),
                "learner/reward_mean": float(rewards.mean()),
                "learner/samples": float(rl.size),
                "learner/updates": float(len(plan)),
                "learner/step_s": time.perf_counter() - started,
            }
        )
        return metrics

    def _train_updates(
        self,
        rl: RLBatch,
        plan: list[list[list[int]]],
        old: torch.Tensor | None,
        ref: torch.Tensor | None,
        advantages: torch.Tensor,
        old_values: torch.Tensor | None,
        returns: torch.Tensor | None,
        batch_id: str,
        wanted: set[int],
        corrections: dict[int, SampleCorrection],
    ) -> dict[str, float]:
        """Every update of ``plan`` on this rank's share (policy, then critic); losses and metrics of the whole group.
        The correction figures of this rank's ``wanted`` rows go into ``corrections``."""
        mask = rl.mask
        sums: dict[str, float] = {}
        weighted: dict[str, float] = {}
        num_tokens = 0.0
        mine = [self._my_micro_batches(rl, [r for chunk in update for r in chunk]) for update in plan]
        for update, local in zip(plan, mine, strict=True):
            normaliser = self._normaliser(mask, update)
            update_sums = self._policy_update(
                rl, local, normaliser, old, ref, advantages, batch_id, wanted, corrections
            )
            for k, v in update_sums.items():
                if k == "learner/tokens":
                    num_tokens += v
                elif k.startswith("learner/loss/"):
                    sums[k] = sums.get(k, 0.0) + v / len(plan)  # the mean update's loss
                else:
                    weighted[k] = weighted.get(k, 0.0) + v
        if self.critic is not None:
            assert old_values is not None and returns is not None
            for update, local in zip(plan, mine, strict=True):
                value_loss_sum = self._critic_step(rl, local, old_values, returns, self._normaliser(mask, update))
                sums["learner/loss/value"] = sums.get("learner/loss/value", 0.0) + value_loss_sum / len(plan)
        # each rank's losses are over its rows with the whole update's normaliser / W: their sum / W
        # is the 1-rank loss; token-weighted sums and token counts simply add up
        totals = self._sum_over_ranks({**sums, **weighted, "learner/tokens": num_tokens})
        num_tokens = totals.pop("learner/tokens")
        metrics = {
            k: v / self.world if k.startswith("learner/loss/") else v / max(num_tokens, 1.0) for k, v in totals.items()
        }
        metrics["learner/tokens"] = num_tokens / self.cfg.ppo_epochs
        return metrics

    def _normaliser(self, mask: torch.Tensor, update: list[list[int]]) -> float:
        rows = [r for chunk in update for r in chunk]
        return float(normaliser_count(mask[rows], self.cfg.algo.loss.aggregation)) / self.policy.world_size

    def _policy_update(
        self,
        rl: RLBatch,
        update: list[list[int]],
        normaliser: float,
        old: torch.Tensor | None,
        ref: torch.Tensor | None,
        advantages: torch.Tensor,
        batch_id: str,
        wanted: set[int],
        corrections: dict[int, SampleCorrection],
    ) -> dict[str, float]:
        """One optimizer step on the micro-batches of ``update``: loss sums, token-weighted metric sums, tokens.
        Notes the correction figures of the ``wanted`` rows not noted yet in ``corrections``."""
        algo = self.cfg.algo
        gas = self.cfg.ds.grad_accum
        out: dict[str, float] = {"learner/tokens": 0.0}
        for rows in update:
            if not rows:
                self._agree(None)
                self._empty_micro_step(self.policy, rl)
                continue
            error = None
            try:
                mb = rl.select(rows)
                logp, ent = self._logprobs(self.policy, mb, with_entropy=algo.loss.entropy_coef > 0)
                dev = logp.device
                old_mb = old[rows].to(dev) if old is not None else logp.detach()
                if wanted:
                    self._note_corrections(rows, old_mb, mb, wanted, corrections)
                loss, m = policy_objective(
                    self.policy_algo,
                    logprobs=logp,
                    old_logprobs=old_mb,
                    advantages=advantages[rows].to(dev),
                    mask=mb.mask.to(dev),
                    normaliser=normaliser,
                    behaviour_logprobs=mb.behaviour_logprobs.to(dev),
                    ref_logprobs=None if ref is None else ref[rows].to(dev),
                    entropy=ent,
                    kl_coef=self.kl_ctl.value,
                )
                error = self._non_finite(loss, f"{batch_id}: non-finite policy loss")
            except Exception as e:  # held for the group's agreement, raised on every rank below
                if not self.agreeable:
                    raise
                error = describe(e, self.rank)
            self._agree(error)
            self.policy.backward(loss * gas)
            self.policy.step()
            tokens = m.pop("learner/tokens")
            out["learner/tokens"] += tokens
            for k, v in m.items():
                out[k] = out.get(k, 0.0) + (v if k.startswith("learner/loss/") else v * tokens)
        return out

    def _note_corrections(
        self,
        rows: list[int],
        old: torch.Tensor,
        mb: RLBatch,
        wanted: set[int],
        corrections: dict[int, SampleCorrection],
    ) -> None:
        """Correction figures of the ``wanted`` rows of micro-batch ``rows`` not noted yet (those of their first
        update: with several, every update corrects against the same pi_old)."""
        picked = [j for j, row in enumerate(rows) if row in wanted and row not in corrections]
        if not picked:
            return
        index = torch.tensor(picked, device=old.device)
        weight, masked = sample_correction(
            self.cfg.algo.correction,
            old_logprobs=old[index],
            mask=mb.mask.to(old.device)[index],
            behaviour_logprobs=mb.behaviour_logprobs.to(old.device)[index],
        )
        for k, j in enumerate(picked):  # still on the device: read once the step is done (no sync here)
            corrections[rows[j]] = SampleCorrection(weight[k], masked[k])  # type: ignore[arg-type]

    def _gather(self, corrections: dict[int, SampleCorrection]) -> dict[int, SampleCorrection]:
        """Every rank's correction figures (each row is trained on one rank), on every rank."""
        gathered: list[dict[int, SampleCorrection] | None] = [None] * self.world
        torch.distributed.all_gather_object(gathered, corrections)
        return {row: SampleCorrection(*figures) for part in gathered for row, figures in (part or {}).items()}

    def _critic_step(
        self, rl: RLBatch, chunks: list[list[int]], old_values: torch.Tensor, returns: torch.Tensor, normaliser: float
    ) -> float:
        """One critic optimizer step on this rank's micro-batches ``chunks``; returns the sum of their losses."""
        assert self.critic is not None and self.cfg.algo.critic is not None
        crit = self.cfg.algo.critic
        total = 0.0
        for rows in chunks:
            if not rows:
                self._agree(None)
                self._empty_micro_step(self.critic, rl, values=True)
                continue
            error = None
            try:
                mb = rl.select(rows)
                values = response_values(self.critic, mb)
                dev = values.device
                per_token, _ = value_loss(values, old_values[rows].to(dev), returns[rows].to(dev), crit.value_clip)
                loss = crit.value_coef * aggregate(
                    per_token,
                    mb.mask.to(dev),
                    self.cfg.algo.loss.aggregation,
                    normaliser,
                    self.cfg.algo.loss.norm_constant,
                )
                error = self._non_finite(loss, "non-finite value loss")
            except Exception as e:  # held for the group's agreement, raised on every rank below
                if not self.agreeable:
                    raise
                error = describe(e, self.rank)
            self._agree(error)
            self.critic.backward(loss * self.cfg.ds.grad_accum)
            self.critic.step()
            total += float(loss.detach())
        return total

    def _non_finite(self, loss: torch.Tensor, what: str) -> str | None:
        """The error of a loss that is not finite (None when it is)."""
        return None if bool(torch.isfinite(loss)) else f"FloatingPointError: {what} ({float(loss)} on rank {self.rank})"

    def _agree(self, error: str | None) -> None:
        """An agreement point: raise :class:`StepFailedError` on every rank when ``error`` (this rank's
        failure, None if none) is set on any rank. Every rank of a group reaches the same points in the
        same order, so all of them raise together, and none waits in a collective for a rank that stopped."""
        everywhere = error is None
        if self.world > 1:
            flag = torch.tensor([1.0 if error is None else 0.0], device=self.policy.device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
            everywhere = bool(flag.item() == 1.0)
        if not everywhere:
            raise StepFailedError(error or "the step failed on another rank", local=error)

    def _empty_micro_step(self, engine: ModelEngine, rl: RLBatch, values: bool = False) -> None:
        """A micro-batch with no rows on this rank: one row's forward and backward with zero loss, so that
        DeepSpeed's accumulation count and every collective of the group (gradient reduction, ZeRO-3
        gathers) stay in step with the other ranks."""
        mb = rl.select([0])
        out = response_values(engine, mb) if values else self._logprobs(engine, mb, with_entropy=False)[0]
        engine.backward(out.sum() * 0.0)
        engine.step()


def _to_host(corrections: dict[int, SampleCorrection]) -> dict[int, SampleCorrection]:
    """The figures noted on the device during the step as floats, read in one transfer."""
    if not corrections:
        return corrections
    rows = list(corrections)
    values = torch.stack([torch.stack([corrections[r][0], corrections[r][1]]).float() for r in rows]).tolist()  # type: ignore[list-item]
    return {r: SampleCorrection(w, m) for r, (w, m) in zip(rows, values, strict=True)}
