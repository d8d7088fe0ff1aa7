"""MAPPA rewards and advantages: per-action coach scores -> per-token returns -> normalized advantages.

The paper's equations, for one action (one row) with action tokens t = 0..T-1:

    R = s · c                                  c = the coach's score of this action (0-10), s = the topology's
                                               reward_scale (MathChat 0.1, DSBench 1, as the authors)
    r_t = -β · KL_t + [t == T-1] · R           β: --algo.kl.init_coef, or each agent's adaptive KL controller
                                               (--algo.kl.target); 0 here with --algo.kl.use_loss
                                               (KL in the loss)
    G_t = Σ_{t' >= t} γ^(t'-t) · r_t'          return-to-go; γ = 1 (REINFORCE++, the paper) unless
                                               --algo.advantage.gamma
    A_t = (G_t - mean(G)) / std(G)             mean/std over the action tokens of a whole batch
                                               (mean only with --algo.advantage.no_std_norm)

The outcome baseline pays R = s · o · 1[success], o = --mappa.outcome_score (10: the top of the coach's scale,
as the authors), so with the same s the same β·KL costs the same share of R in both modes; so do the
coach-failure fallbacks (R = s · neutral_score, or the outcome R). s is applied first, where R is assigned:
standardize_by_task_type is scale-equivariant and group_normalize scale-invariant, so what s changes is only
the weight of R against β·KL. An action cut off at the token limit trains at zero loss (as the authors'
mask_truncated_completions) unless train_truncated is set.

Batch semantics (--mappa.batch_semantics). "authors" (default): a truncated or unscored action stays in its
agent's batch as a zero-loss row (advantage 0 on every token, its action mask kept), so OpenRLHF's actor gives
it no policy gradient yet counts it in the seq-mean-token-mean denominator, and the batch rule counts whole
batches over all of an agent's actions: the authors' trainer masks truncated completions out of the loss
inside a fixed batch, so every agent takes the same optimizer steps. A truncated action keeps its R in the
whitening statistics, as theirs; an unscored one has no R, so its row is left out of them. "usable": both
leave the batch before the batch rule (fewer optimizer steps, the schedule never reaching its end).

Dynamic filtering (--algo.dynamic_filtering_enable, as OpenRLHF's, per agent and task) leaves out every action
of a group (step, task, agent) whose mean score u on [0, 1] (the coach's score / 10; the outcome, 0 or 1, in
outcome mode or for an outcome fallback) is not strictly inside --algo.dynamic_filtering_range: groups the
agent always or never gets right teach it nothing relative to each other. Unlike OpenRLHF, no new prompt
replaces them: a MAPPA step is a fixed batch of episodes, so the step trains on fewer actions (counted per
agent).

The GRPO-style baseline (norm scope "group", the authors' `group_norm`) normalizes R instead, within the
group g of actions that answer the same prompt (same step, task, agent and turn: the n_samples_per_prompt
episodes of one task), with the sample std, then whitens G per agent as above:

    R' = (R - mean_g(R)) / (std_g(R) + ε)      std with Bessel's correction, ε = 1e-9; a group of one: R' = 0
    A_t = (G_t - mean(G)) / std(G)             G from R', over each agent's batch

Shape suffixes: `_B` one value per action (row), `_BA` one value per action token.
Pure torch + the episode records at import: no Ray or vLLM here (experiences() calls the maker it is given),
and upstream's Experience and compute_reward (whose module imports DeepSpeed) are imported where used, so it
is testable on a CPU.
"""

import collections
import random

import torch

from openrlhf_mappa.episode import Episode


def assign_rewards(episodes: list[Episode], mode: str, on_failure: str = "skip", neutral_score: float = 5.0,
                   scale: float = 1.0, train_truncated: bool = False, standardize_task_type: bool = False,
                   norm_scope: str = "agent", outcome_score: float = 10.0, filter_range: tuple = None,
                   batch_semantics: str = "authors") -> dict:
    """Set every `action.reward` (R, module docstring), then dynamic_filter (`filter_range`),
    standardize_by_task_type and group_normalize where asked; returns how many actions train, and why the
    others do not or what they fell back on.

    In process mode a failed verdict is left out ("skip"), paid the outcome, or paid s · neutral_score (the
    authors' silent 5.0 made explicit); it keeps its failed status. A truncated action (its score judges text
    that never ended; unless train_truncated), a stale one and every action of an episode whose environment
    raised are left out; with batch_semantics "authors" a truncated or unscored action is a zero-loss row
    instead (`zero_loss`), a truncated one with its reward (module docstring). Either way it is not
    `trainable`.
    The string arguments are the flags' values, which argparse's choices have checked.
    """
    zero_loss = batch_semantics == "authors"
    left_out_by_status, fallback, truncated_by_agent, stale_by_agent = {}, 0, {}, {}
    u = {}  # id(action) -> its score on [0, 1], for dynamic_filter
    for episode in episodes:
        outcome_R = scale * outcome_score * float(episode.success)
        for action in episode.actions:
            verdict, action.reward, action.zero_loss = action.verdict, None, False
            if episode.env_error:  # counted per episode: no outcome, and its feedback is untrusted
                continue
            if action.stale:  # its weights too many updates old (async training: trainer.mark_stale)
                stale_by_agent[action.agent] = stale_by_agent.get(action.agent, 0) + 1
                continue
            cut = action.truncated and not train_truncated
            if cut:
                truncated_by_agent[action.agent] = truncated_by_agent.get(action.agent, 0) + 1
                if not zero_loss:
                    continue
            if mode == "outcome":
                action.reward, u[id(action)] = outcome_R, float(episode.success)
            elif verdict is not None and verdict.status == "ok" and verdict.score is not None:
                action.reward, u[id(action)] = scale * float(verdict.score), float(verdict.score) / 10
            elif on_failure == "outcome":
                action.reward, u[id(action)] = outcome_R, float(episode.success)
                fallback += not cut
            elif on_failure == "neutral":
                action.reward, u[id(action)] = scale * float(neutral_score), neutral_score / 10
                fallback += not cut
            elif not cut:
                status = verdict.status if verdict is not None else "missing"
                left_out_by_status[status] = left_out_by_status.get(status, 0) + 1
            action.zero_loss = zero_loss and (cut or action.reward is None)

    filtered = dynamic_filter(episodes, u, filter_range) if filter_range is not None else {}
    if standardize_task_type and mode == "process":
        standardize_by_task_type(episodes)
    if norm_scope == "group":  # R normalized within its prompt's group first (the GRPO-style baseline)
        group_normalize(episodes)
    trainable = sum(a.reward is not None and not a.zero_loss for ep in episodes for a in ep.actions)
    return {"trainable": trainable, "left_out": sum(left_out_by_status.values()),
            "left_out_by_status": left_out_by_status, "fallback": fallback,
            "truncated_left_out": truncated_by_agent, "filtered": filtered, "stale_left_out": stale_by_agent}


def merge_counts(parts: list) -> dict:
    """assign_rewards' counts from calls on disjoint sets of agents' actions (one per agent), as one
    call's."""
    out = {k: sum(p[k] for p in parts) for k in ("trainable", "left_out", "fallback")}
    out["left_out_by_status"] = dict(sum((collections.Counter(p["left_out_by_status"]) for p in parts),
                                         collections.Counter()))
    for k in ("truncated_left_out", "filtered", "stale_left_out"):  # by agent: each in one part only
        out[k] = {agent: n for p in parts for agent, n in p[k].items()}
    return out


def mark_stale(episodes: list[Episode], now: dict, most: int) -> dict:
    """Mark `stale` (assign_rewards leaves it out) every action one of whose weight versions, its own agent's
    or another's whose output it saw, is more than `most` updates behind that agent's version `now` (async
    training; always 0 behind in synchronous training). Returns {agent: [its own staleness, for each of its
    actions]}."""
    lags = {}
    for ep in episodes:
        for a in ep.actions:
            lag = {name: now[name] - v for name, v in a.versions.items()}
            lags.setdefault(a.agent, []).append(lag.get(a.agent, 0))
            a.stale = max(lag.values(), default=0) > most
    return lags


def dynamic_filter(episodes: list[Episode], u: dict, score_range: tuple) -> dict:
    """Leave out (reward None, `filtered` True) every rewarded action of a group g = (step, task, agent)
    unless low < mean_g(u) < high, u = each action's score on [0, 1] (module docstring); OpenRLHF's rule for a
    prompt's samples. Returns {agent: (actions filtered, groups kept, groups)}."""
    low, high = score_range
    out = {}
    groups = rewarded_groups(episodes, lambda ep, a: (ep.step, ep.task_id, a.agent))
    for (_, _, agent), acts in groups.items():
        n, kept, total = out.get(agent, (0, 0, 0))
        if low < sum(u[id(a)] for a in acts) / len(acts) < high:
            out[agent] = (n, kept + 1, total + 1)
            continue
        for a in acts:
            a.reward, a.filtered, a.zero_loss = None, True, False
        out[agent] = (n + len(acts), kept, total + 1)
    return out


def rewarded_groups(episodes: list[Episode], key) -> dict:
    """{key(episode, action): [its actions that have a reward]}, in episode order."""
    groups = {}
    for ep in episodes:
        for a in ep.actions:
            if a.reward is not None:
                groups.setdefault(key(ep, a), []).append(a)
    return groups


def standardize_by_task_type(episodes: list[Episode]) -> None:
    """R' = μ_k + σ_k · (R − μ_kτ) / σ_kτ per agent k and task type τ, over the step's rewarded actions.

    Removes a coach's offset between task types while keeping each agent's mean and spread (so β·KL keeps its
    weight); a group of one action or no spread gets μ_k.
    """
    groups = {}
    for ep in episodes:
        for a in ep.actions:
            if a.reward is not None:
                groups.setdefault(a.agent, {}).setdefault(ep.task_type, []).append(a)
    for by_type in groups.values():
        all_R = torch.tensor([a.reward for acts in by_type.values() for a in acts], dtype=torch.float64)
        mu_k, sigma_k = all_R.mean(), all_R.std(unbiased=False)
        for acts in by_type.values():
            R = torch.tensor([a.reward for a in acts], dtype=torch.float64)
            mu, sigma = R.mean(), R.std(unbiased=False)
            z = (R - mu) / sigma if sigma > 0 else torch.zeros_like(R)
            for a, r in zip(acts, (mu_k + sigma_k * z).tolist()):
                a.reward = r


def group_normalize(episodes: list[Episode], eps: float = 1e-9) -> None:
    """R' = (R - mean_g(R)) / (std_g(R) + ε) per group g = (step, task, agent, turn), Bessel's std, as the
    authors' and OpenRLHF's group_norm; a group of one or of equal rewards gets 0.

    The authors group by position (blocks of n_samples_per_prompt per agent), which mixes prompts as soon as
    an agent acts a varying number of times; this key does not.
    """
    groups = rewarded_groups(episodes, lambda ep, a: (ep.step, ep.task_id, a.agent, a.turn))
    for acts in groups.values():
        R_g = torch.tensor([a.reward for a in acts], dtype=torch.float64)
        z_g = (R_g - R_g.mean()) / (R_g.std() + eps) if len(acts) > 1 else torch.zeros_like(R_g)
        for a, r in zip(acts, z_g.tolist()):
            a.reward = r


def batch_rule(actions: list, train, step: int) -> tuple:
    """(kept, dropped count): a whole number of global train batches B = train.batch_size of an agent's
    actions that fill its batch: those with a reward and the zero-loss rows (assign_rewards).

    DeepSpeed's gradient accumulation is fixed by B, and data-parallel ranks with unequal micro-batch counts
    deadlock in all-reduce. So an agent whose action count varies (a Code Executor acting once or twice)
    trains on floor(n / B) * B of its n actions, drawn with a RNG seeded by train.seed and the step, and skips
    the update when n < B. Dropped actions are counted in the metrics."""
    rows = [a for a in actions if a.reward is not None or a.zero_loss]
    keep = (len(rows) // train.batch_size) * train.batch_size
    picked = random.Random(train.seed * 1000003 + step).sample(rows, keep) if keep else []
    return picked, len(rows) - keep


def experience_of(action):
    """One action as an OpenRLHF Experience: the sequence is prompt + response, and the action mask
    (shifted by one, as OpenRLHF's) covers the response tokens only, so tool output never trains. The rollout
    log-probs (vLLM's) sit on the action mask's positions, where OpenRLHF's PolicyLoss reads them."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    seq = action.prompt_ids + action.response_ids
    action_mask = torch.zeros(len(seq), dtype=torch.bool)
    action_mask[len(action.prompt_ids) :] = True
    # 0 for an unscored action
    reward = torch.tensor([action.reward if action.reward is not None else 0.0], dtype=torch.float32)
    rollout_log_probs = None
    if len(action.rollout_logprobs) == len(action.response_ids):
        rollout_log_probs = torch.zeros(1, len(seq) - 1)
        rollout_log_probs[0, len(action.prompt_ids) - 1 :] = torch.tensor(action.rollout_logprobs)
    return Experience(
        sequences=torch.tensor([seq]),
        attention_mask=torch.ones(1, len(seq), dtype=torch.long),
        action_mask=action_mask[1:].unsqueeze(0),
        rollout_log_probs=rollout_log_probs,
        rewards=reward,
        response_length=torch.tensor([float(len(action.response_ids))]),
        truncated=torch.tensor([action.truncated]),
        total_length=torch.tensor([float(len(seq))]),
        prompts=[action.prompt_text],
        labels=[""],
        info={"reward": reward, "response_length": torch.tensor([float(len(action.response_ids))])},
    )


def experiences(maker, actions: list) -> list:
    """An agent's actions as OpenRLHF Experiences with its actor's and reference's log-probs and KL: `maker`
    is the agent's experience maker (upstream's split into micro-batches, then its forwards)."""
    return maker.make_experience(maker.split_rollout_samples(list(map(experience_of, actions))))


def token_rewards(reward_B: torch.Tensor, kl_BA: torch.Tensor, action_mask_BA: torch.Tensor,
                  kl_coef: float) -> torch.Tensor:
    """r_t = -β·KL_t on every action token, plus R on its last (the highest masked position: EOS, or a
    truncated action's last token), by OpenRLHF's compute_reward; no KL term when β <= 0; 0 off the mask, so a
    row with an empty mask gets nothing. Unlike upstream's trainer, R is never clamped to reward.clip_range (a
    range tuned for reward-model logits would flatten coach scores): reward_clip_range=None never clamps."""
    from openrlhf.models.utils import compute_reward  # imports DeepSpeed, as the experience maker does

    # At least float32, as upstream's trainer promotes rewards (compute_reward returns KL's dtype). Upstream
    # puts -β·KL off the mask too, and an empty mask's R on the last column: both masked out here.
    dtype = torch.promote_types(reward_B.dtype, torch.float32)
    if kl_BA is None:  # no reference model: no KL term
        kl_BA = torch.zeros(action_mask_BA.shape)
    r_BA = compute_reward(reward_B.to(dtype), kl_coef, kl_BA.to(dtype), action_mask_BA)
    return torch.where(action_mask_BA.bool(), r_BA, 0.0)


def returns_to_go(r_BA: torch.Tensor, action_mask_BA: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """G_t = Σ_{t' >= t} γ^(t'-t) · r_t' over action tokens, as OpenRLHF's get_cumulative_returns; 0 off the
    mask."""
    mask_BA = action_mask_BA.bool()
    r_BA = torch.where(mask_BA, r_BA, 0.0)
    if gamma == 1.0:
        G_BA = r_BA.flip(1).cumsum(dim=1).flip(1)
    else:
        G_BA, G_B = torch.zeros_like(r_BA), torch.zeros_like(r_BA[:, 0])
        for t in reversed(range(r_BA.size(1))):
            G_B = r_BA[:, t] + gamma * G_B
            G_BA[:, t] = G_B
    return torch.where(mask_BA, G_BA, 0.0)


def whiten(values: list[torch.Tensor], masks: list[torch.Tensor], eps: float = 1e-8,
           std_norm: bool = True) -> list[torch.Tensor]:
    """(x - mean) / std, mean and population variance over the masked tokens of all tensors together (of any
    widths); x - mean alone without `std_norm`. The variance is clamped at eps: constant values, or no masked
    token, whiten to 0."""
    if not values:
        return []
    x_N = torch.cat([torch.where(m.bool(), x, 0.0).flatten().float() for x, m in zip(values, masks)])
    mask_N = torch.cat([m.bool().flatten() for m in masks])
    n = mask_N.sum().clamp(min=1)
    mean = x_N.sum() / n
    var = (torch.where(mask_N, x_N - mean, 0.0) ** 2).sum() / n
    rstd = var.clamp(min=eps).rsqrt() if std_norm else 1.0
    return [torch.where(m.bool(), (x.float() - mean) * rstd, 0.0) for x, m in zip(values, masks)]


def compute_advantages(batches_by_agent: dict[str, list], kl_coef, scope: str = "agent", gamma: float = 1.0,
                       std_norm: bool = True, actions: dict = None) -> dict:
    """Set `.returns` (G) and `.advantages` (whitened G) on every batch (`.rewards`, `.kl`, `.action_mask`, as
    OpenRLHF's Experience); returns, per agent, each row's mean advantage over its action tokens. `kl_coef`:
    β, or {agent: β} (each agent's KL controller). `actions`: {agent: the actions its rows are, by OpenRLHF's
    `exp.index`}, where some are zero-loss rows: their advantages are 0, and an unscored one's returns stay
    out of the whitening statistics (module docstring).

    "agent" and "group" whiten each agent's batches together (the authors' code; "group" after
    group_normalize, as the authors' group_norm, unlike upstream OpenRLHF's), "global" all agents' (the
    paper's wording).
    """
    rows = {}  # id(batch) -> (its rows in the whitening statistics, its rows that train), each (B,)
    for name, batches in batches_by_agent.items():
        beta = kl_coef[name] if isinstance(kl_coef, dict) else kl_coef
        for b in batches:
            r_BA = token_rewards(b.rewards, b.kl, b.action_mask, beta)
            b.returns = returns_to_go(r_BA, b.action_mask, gamma)
            if isinstance(getattr(b, "info", None), dict):
                b.info["return"] = r_BA.sum(dim=1)  # as upstream's (with γ = 1: G at the first action token)
            of = [actions[name][i] for i in b.index] if actions and name in actions else []
            everyone = torch.ones(b.action_mask.size(0), dtype=torch.bool)
            rows[id(b)] = (torch.tensor([a.reward is not None for a in of]) if of else everyone,
                           torch.tensor([not a.zero_loss for a in of]) if of else everyone)

    if scope == "global":  # one whitening over the whole team's batches
        groups = [sum(batches_by_agent.values(), [])]
    else:
        groups = list(batches_by_agent.values())
    for batches in groups:
        in_stats = [b.action_mask.bool() & rows[id(b)][0].to(b.action_mask.device).unsqueeze(1)
                    for b in batches]
        advantages = whiten([b.returns for b in batches], in_stats, std_norm=std_norm)
        for b, adv_BA in zip(batches, advantages):
            b.advantages = torch.where(rows[id(b)][1].to(adv_BA.device).unsqueeze(1), adv_BA, 0.0)
    mean_A = lambda b: ((b.advantages * b.action_mask).sum(1) / b.action_mask.sum(1).clamp(min=1)).tolist()
    return {name: sum((mean_A(b) for b in batches), []) for name, batches in batches_by_agent.items()}


def logprob_mismatch(batches: list) -> dict:
    """How far the trainer's log-probs (log π_train: the actor's forward in the experience maker) are from
    vLLM's sampling log-probs (log π_rollout) on the same tokens, over every action token of `batches`: the
    mean |Δ| and KL(π_rollout ‖ π_train) by the k3 estimator exp(Δ) − 1 − Δ ≥ 0,
    Δ = log π_train − log π_rollout (the tokens are π_rollout's samples). {} when the engines gave no
    log-probs."""
    rows = [b for b in batches if b.rollout_log_probs is not None]
    d_N = torch.cat([(b.action_log_probs.float() - b.rollout_log_probs.float())[b.action_mask.bool()]
                     for b in rows] or [torch.zeros(0)])
    if not d_N.numel():
        return {}
    return {"logprob_mismatch_abs": d_N.abs().mean().item(),
            "logprob_mismatch_kl": (d_N.exp() - 1 - d_N).mean().item()}
