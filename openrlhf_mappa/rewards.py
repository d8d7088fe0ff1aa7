"""MAPPA rewards and advantages: per-action coach scores -> per-token returns -> normalized advantages.

The paper's equations, for one action (one row) with action tokens t = 0..T-1:

    R = s · c                                  c = the coach's score of this action (0-10), s = the topology's
                                               reward_scale (MathChat 0.1, DSBench 1, as the authors)
    r_t = -β · KL_t + [t == T-1] · R
    G_t = Σ_{t' >= t} r_t'                     undiscounted return-to-go (γ = 1, REINFORCE++)
    A_t = (G_t - mean(G)) / std(G)             mean/std over the action tokens of a whole batch

The outcome baseline pays R = s · o · 1[success], o = --mappa.outcome_score (10: the top of the coach's scale,
as the authors), so with the same s the same β·KL costs the same share of R in both modes; so do the
coach-failure fallbacks (R = s · neutral_score, or the outcome R). s is applied first, where R is assigned:
standardize_by_task_type is scale-equivariant and group_normalize scale-invariant, so what s changes is only
the weight of R against β·KL. An action cut off at the token limit gets no R at all (left out, as the authors'
mask_truncated_completions) unless train_truncated is set.

The GRPO-style baseline (norm scope "group", the authors' `group_norm`) normalizes R instead, within the
group g of actions that answer the same prompt (same step, task, agent and turn: the n_samples_per_prompt
episodes of one task), with the sample std, then whitens G per agent as above:

    R' = (R - mean_g(R)) / (std_g(R) + ε)      std with Bessel's correction, ε = 1e-9; a group of one: R' = 0
    A_t = (G_t - mean(G)) / std(G)             G from R', over each agent's batch

Shape suffixes: `_B` one value per action (row), `_BA` one value per action token.
Pure torch + the episode records: no Ray, vLLM or DeepSpeed here, so it is testable on a CPU.
"""

import torch

from openrlhf_mappa.episode import Episode

REWARD_MODES = ("process", "outcome")
# What each --mappa.norm_scope does, decided here only: (R normalized within its prompt group first,
# advantages whitened over the whole team's batches instead of each agent's).
NORM_SCOPES = {"agent": (False, False), "global": (False, True), "group": (True, False)}



FAILURE_POLICIES = ("skip", "outcome", "neutral")


def assign_rewards(
    episodes: list[Episode],
    mode: str,
    on_failure: str = "skip",
    neutral_score: float = 5.0,
    scale: float = 1.0,
    train_truncated: bool = False,
    standardize_task_type: bool = False,
    norm_scope: str = "agent",
    outcome_score: float = 10.0,
) -> dict:
    """Set `action.reward` for every action: s · the coach's score ("process") or s · the episode outcome
    ("outcome": `outcome_score` if solved, else 0), s = `scale` (the topology's reward_scale); then, in "process" mode with `standardize_task_type`,
    standardize_by_task_type, and for `norm_scope` "group", group_normalize.

    In "process" mode an action whose coach gave no valid score is handled by the named `on_failure`
    policy: "skip" (default) leaves it out of training (reward None); "outcome" pays it the episode's
    outcome, as the outcome baseline would; "neutral" pays it s · `neutral_score`, the authors' silent 5.0
    made explicit. The verdict itself keeps its failed status and no score. In both modes an action cut
    off at the token limit is left out (its score judges text that never ended) unless `train_truncated`, and
    so is every action of an episode whose environment raised (Episode.env_error).
    Returns how many actions train, and why the others do not or on what they fell back.
    """
    if mode not in REWARD_MODES:
        raise ValueError(f"unknown reward mode {mode!r}; expected one of {REWARD_MODES}")
    if on_failure not in FAILURE_POLICIES:
        raise ValueError(f"unknown coach failure policy {on_failure!r}; expected one of {FAILURE_POLICIES}")
    if norm_scope not in NORM_SCOPES:
        raise ValueError(f"unknown normalization scope {norm_scope!r}; expected one of {tuple(NORM_SCOPES)}")

    trainable, left_out_by_status, fallback, truncated_by_agent = 0, {}, 0, {}
    for episode in episodes:
        outcome_R = scale * outcome_score * float(episode.success)
        for action in episode.actions:
            verdict = action.verdict
            if episode.env_error:  # its environment raised (counted per episode): no outcome, feedback untrusted
                action.reward = None
                continue
            if action.truncated and not train_truncated:
                action.reward = None
                truncated_by_agent[action.agent] = truncated_by_agent.get(action.agent, 0) + 1
                continue
            if mode == "outcome":
                action.reward = outcome_R
            elif verdict is not None and verdict.status == "ok" and verdict.score is not None:
                action.reward = scale * float(verdict.score)
            elif on_failure == "outcome":
                action.reward, fallback = outcome_R, fallback + 1
            elif on_failure == "neutral":
                action.reward, fallback = scale * float(neutral_score), fallback + 1
            else:
                action.reward = None
                status = verdict.status if verdict is not None else "missing"
                left_out_by_status[status] = left_out_by_status.get(status, 0) + 1
                continue
            trainable += 1

    if standardize_task_type and mode == "process":
        standardize_by_task_type(episodes)
    per_prompt_R, _ = NORM_SCOPES[norm_scope]
    if per_prompt_R:
        group_normalize(episodes)
    return {
        "trainable": trainable,
        "left_out": sum(left_out_by_status.values()),
        "left_out_by_status": left_out_by_status,
        "fallback": fallback,
        "truncated_left_out": truncated_by_agent,
    }


def standardize_by_task_type(episodes: list[Episode]) -> None:
    """Remove a coach's offset between task types, per agent k and task type τ (a bias mitigation):

        R' = μ_k + σ_k · (R − μ_kτ) / σ_kτ

    μ/σ over the step's rewarded actions: the agent's overall mean and spread are kept, so β·KL keeps its
    weight, but a task type the coach scores higher no longer pays more on average. A group with one
    action or no spread gets μ_k (nothing to learn from within it).
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
    """R' = (R - mean_g(R)) / (std_g(R) + ε) per group g = (step, task, agent, turn): each action is judged
    against the other samples of the same prompt. std with Bessel's correction and ε = 1e-9, as the authors'
    and OpenRLHF's group_norm. A group of one (its std is undefined) or of equal rewards gets 0: nothing to
    learn from a prompt every sample did equally well on.

    The authors group by position instead (blocks of n_samples_per_prompt in each agent's list, sorted by
    prompt), which mixes prompts as soon as an agent acts a varying number of times; the key here does not.
    """
    groups = {}
    for ep in episodes:
        for a in ep.actions:
            if a.reward is not None:
                groups.setdefault((ep.step, ep.task_id, a.agent, a.turn), []).append(a)
    for acts in groups.values():
        R_g = torch.tensor([a.reward for a in acts], dtype=torch.float64)
        z_g = (R_g - R_g.mean()) / (R_g.std() + eps) if len(acts) > 1 else torch.zeros_like(R_g)
        for a, r in zip(acts, z_g.tolist()):
            a.reward = r


def token_rewards(
    reward_B: torch.Tensor, kl_BA: torch.Tensor, action_mask_BA: torch.Tensor, kl_coef: float
) -> torch.Tensor:
    """r_t = -β·KL_t on every action token, plus the action's reward R on its last token; 0 off the mask.

    Unlike OpenRLHF's compute_reward, R is never clamped to reward.clip_range: coach scores (0-10)
    and any sum of them must reach the returns unchanged, or a clip range tuned for reward-model
    logits would silently flatten the signal.
    """
    mask_BA = action_mask_BA.bool()
    dtype = torch.promote_types(reward_B.dtype, torch.float32)
    r_BA = torch.zeros(mask_BA.shape, dtype=dtype, device=mask_BA.device)
    if kl_coef > 0:
        r_BA = r_BA - kl_coef * kl_BA.to(dtype)

    # The last action token is the highest masked position: the EOS token, or for a truncated
    # action the last token it generated. Rows with an empty mask get no reward at all.
    pos_A = torch.arange(mask_BA.size(1), device=mask_BA.device)
    last_B = torch.where(mask_BA, pos_A, -1).max(dim=1).values
    is_last_BA = pos_A == last_B.unsqueeze(1)
    r_BA = r_BA + is_last_BA * reward_B.to(dtype).unsqueeze(1)

    return torch.where(mask_BA, r_BA, 0.0)


def returns_to_go(r_BA: torch.Tensor, action_mask_BA: torch.Tensor) -> torch.Tensor:
    """G_t = Σ_{t' >= t} r_t' over action tokens (γ = 1); 0 off the mask."""
    mask_BA = action_mask_BA.bool()
    r_BA = torch.where(mask_BA, r_BA, 0.0)
    G_BA = r_BA.flip(1).cumsum(dim=1).flip(1)
    return torch.where(mask_BA, G_BA, 0.0)


def whiten(values: list[torch.Tensor], masks: list[torch.Tensor], eps: float = 1e-8) -> list[torch.Tensor]:
    """(x - mean) / std with mean and population variance over the masked tokens of ALL tensors together.

    Tensors may differ in width (each agent's batch is padded to its own longest action). The
    variance is clamped at eps, so constant values whiten to 0, and no masked token at all gives
    zeros rather than 0/0.
    """
    if not values:
        return []
    x_N = torch.cat([torch.where(m.bool(), x, 0.0).flatten().float() for x, m in zip(values, masks)])
    mask_N = torch.cat([m.bool().flatten() for m in masks])
    n = mask_N.sum().clamp(min=1)
    mean = x_N.sum() / n
    var = (torch.where(mask_N, x_N - mean, 0.0) ** 2).sum() / n
    rstd = var.clamp(min=eps).rsqrt()
    return [torch.where(m.bool(), (x.float() - mean) * rstd, 0.0) for x, m in zip(values, masks)]


def compute_advantages(batches_by_agent: dict[str, list], kl_coef: float, scope: str = "agent") -> dict:
    """Set `.returns` (G) and `.advantages` (whitened G) on every batch of every agent; returns, per agent, each
    row's mean advantage over its action tokens (the value an action's record shows).

    Each batch needs `.rewards` (B,), `.kl` (B, A) and `.action_mask` (B, A), e.g. OpenRLHF's
    Experience. scope "agent" normalizes each agent's batches together (the authors' code);
    "global" normalizes all agents' batches together (the paper's wording); "group" whitens per agent too:
    its rewards were already normalized per prompt by `group_normalize`, and the authors' group_norm
    whitens the returns after that (upstream OpenRLHF's does not).
    """
    if scope not in NORM_SCOPES:
        raise ValueError(f"unknown normalization scope {scope!r}; expected one of {tuple(NORM_SCOPES)}")

    for batches in batches_by_agent.values():
        for b in batches:
            r_BA = token_rewards(b.rewards, b.kl, b.action_mask, kl_coef)
            b.returns = returns_to_go(r_BA, b.action_mask)
            if isinstance(getattr(b, "info", None), dict):
                # With γ = 1, G at the first action token is the whole row's reward sum.
                b.info["return"] = r_BA.sum(dim=1)

    _, over_team = NORM_SCOPES[scope]
    groups = [sum(batches_by_agent.values(), [])] if over_team else list(batches_by_agent.values())
    for batches in groups:
        advantages = whiten([b.returns for b in batches], [b.action_mask for b in batches])
        for b, adv_BA in zip(batches, advantages):
            b.advantages = adv_BA
    mean_A = lambda b: ((b.advantages * b.action_mask).sum(1) / b.action_mask.sum(1).clamp(min=1)).tolist()
    return {name: sum((mean_A(b) for b in batches), []) for name, batches in batches_by_agent.items()}
