"""--mappa.batch_semantics (issue 49, Why 3): by default an agent's truncated and unscored actions stay in its batch
at zero loss, as in the authors' trainer, so the agent takes a fixed number of optimizer steps and its learning-rate
schedule ends at 0.1x. Checked through the real reward and batch rules, on the MathChat script as submitted, with
transformers' scheduler as OpenRLHF builds it, and with OpenRLHF's own PolicyLoss and loss normalizers."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import REPO, submit_script

from openrlhf_mappa import rewards
from openrlhf_mappa.cli.train_mappa_ray import parse_args, schedule_steps
from openrlhf_mappa.episode import Action, Episode, Verdict
from openrlhf_mappa.team import load_topology


def mathchat(tmp_path):
    """The MathChat recipe's arguments (train_mappa_mathchat.sh, run for real with `ray` stood in) and topology."""
    argv, _ = submit_script(f"{REPO}/examples/scripts/train_mappa_mathchat.sh", tmp_path)
    args = parse_args(argv[argv.index("openrlhf_mappa.cli.train_mappa_ray") + 1:])
    return args, load_topology(f"{REPO}/{args.mappa.topology}")


def solver_optimizer_steps(args, truncated_fraction: float, seed: int = 0) -> tuple:
    """The audit's simulation (fidelity-audit-3, Part E 5): the Solver acts once per episode, so a rollout step gives
    it rollout batch x samples (64) actions, over tasks / rollout batch x episodes (128) steps; each action is cut off
    with `truncated_fraction` (a binomial draw) and scored 0-10. Through assign_rewards and batch_rule as the trainer
    calls them, returns (the optimizer steps it takes, a list of each step's truncated count)."""
    rng = np.random.RandomState(seed)
    per_step = args.rollout.batch_size * args.rollout.n_samples_per_prompt
    steps, truncated = 0, []
    for step in range(1, args.data.max_samples // args.rollout.batch_size * args.train.num_episodes + 1):
        cut, scores = rng.binomial(1, truncated_fraction, per_step).astype(bool), rng.randint(0, 11, per_step)
        actions = [Action(f"e{i}", "problem_solver", 0, [1], [2], truncated=bool(c), verdict=Verdict(float(s), "ok"))
                   for i, (c, s) in enumerate(zip(cut, scores))]
        episodes = [Episode(a.episode_id, "t", step=step, actions=[a]) for a in actions]
        rewards.assign_rewards(episodes, "process", scale=0.1, batch_semantics=args.mappa.batch_semantics)
        kept, _ = rewards.batch_rule(actions, args.train, step)
        steps += len(kept) // args.train.batch_size * args.train.max_epochs
        truncated.append(int(cut.sum()))
    return steps, truncated


def final_lr_factor(args, schedule: int, taken: int) -> float:
    """The learning rate (a fraction of --actor.adam.lr) of the last of `taken` optimizer steps, with the scheduler
    OpenRLHF builds (openrlhf/utils/deepspeed/deepspeed.py: get_scheduler, ceil(steps x warm-up ratio), min_lr_rate)."""
    from transformers import get_scheduler

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    warmup = math.ceil(schedule * args.actor.lr_warmup_ratio)
    sched = get_scheduler(args.actor.lr_scheduler, opt, num_warmup_steps=warmup, num_training_steps=schedule,
                          scheduler_specific_kwargs={"min_lr_rate": args.actor.min_lr_ratio})
    for _ in range(taken - 1):
        opt.step()
        sched.step()
    return opt.param_groups[0]["lr"]


def test_the_truncation_simulation_takes_the_authors_512_optimizer_steps(tmp_path):
    # Catches the old batch: truncated actions left it before the whole-batch rule, so at 30% truncation the Solver
    # took ~286 of its 512 steps and ended at ~0.49x the learning rate instead of 0.1x.
    args, topology = mathchat(tmp_path)
    assert args.mappa.batch_semantics == "authors"  # the script's (the default)
    schedule = schedule_steps(args, topology, 512)["problem_solver"]
    steps, truncated = solver_optimizer_steps(args, 0.3)
    assert schedule == steps == 512 and sum(truncated) / len(truncated) == pytest.approx(0.3 * 64, rel=0.05)
    assert final_lr_factor(args, schedule, steps) == pytest.approx(args.actor.min_lr_ratio, abs=1e-4) == 0.1
    # The switch: only the usable actions fill whole batches of 16, the same draws.
    args.mappa.batch_semantics = "usable"
    usable, again = solver_optimizer_steps(args, 0.3)
    assert again == truncated and usable == sum((64 - n) // 16 for n in truncated)
    assert 270 < usable < 300 and 0.4 < final_lr_factor(args, schedule, usable) < 0.6  # the audit's 286 and 0.49x


def test_zero_loss_rows_keep_the_authors_whitening_and_get_no_gradient_but_count_in_the_denominator():
    """One agent's batch of four, in one optimizer step of micro-batches of one (the recipe's), through
    assign_rewards, batch_rule, experience_of and compute_advantages as the trainer calls them, then OpenRLHF's own
    PolicyLoss (seq-mean-token-mean: token_level_loss False) with the normalizers its actor computes per step
    (_optimizer_step_loss_norm) and DeepSpeed's 1 / gradient-accumulation scaling."""
    from openrlhf.models.loss import PolicyLoss
    from openrlhf.utils.loss_utils import _optimizer_step_loss_norm

    lengths = {"scored_high": 3, "scored_low": 5, "truncated": 2, "unscored": 4}
    verdicts = {"scored_high": Verdict(8.0, "ok"), "scored_low": Verdict(2.0, "ok"), "truncated": Verdict(5.0, "ok"),
                "unscored": Verdict(None, "timeout")}  # fmt: skip
    actions = [Action("e", "solver", i, [7, 8], list(range(10, 10 + lengths[k])), prompt_text=k, verdict=verdicts[k],
                      truncated=k == "truncated") for i, k in enumerate(lengths)]  # fmt: skip
    counts = rewards.assign_rewards([Episode("e", "t", actions=actions)], "process", scale=0.1)  # default: authors
    assert (counts["trainable"], counts["truncated_left_out"], counts["left_out_by_status"]) == (
        2, {"solver": 1}, {"timeout": 1})
    assert [a.zero_loss for a in actions] == [False, False, True, True]
    assert [a.reward for a in actions[:3]] == pytest.approx([0.8, 0.2, 0.5]) and actions[3].reward is None
    kept, dropped = rewards.batch_rule(actions, SimpleNamespace(batch_size=4, seed=0), step=1)
    assert dropped == 0 and sorted(a.prompt_text for a in kept) == sorted(lengths)  # a whole batch of all four
    rows = [rewards.experience_of(a) for a in kept]
    for i, e in enumerate(rows):  # what the experience maker adds: each row's index, its KL (0: an unchanged model)
        e.index, e.kl = [i], torch.zeros(e.action_mask.shape)
    rewards.compute_advantages({"solver": rows}, kl_coef=0.0, actions={"solver": kept})

    # Whitening over the tokens of the rows with a reward (G = R on each token), the truncated one's included as the
    # authors'; the unscored one has none and is left out of the statistics. Both zero-loss rows get advantage 0.
    R = {"scored_high": 0.8, "scored_low": 0.2, "truncated": 0.5}
    tokens = np.concatenate([[r] * lengths[k] for k, r in R.items()])
    whitened = {k: (r - tokens.mean()) / tokens.std() for k, r in R.items()}
    names = [a.prompt_text for a in kept]
    for name, e in zip(names, rows):
        expected = whitened[name] if name in ("scored_high", "scored_low") else 0.0
        assert e.advantages[e.action_mask].tolist() == pytest.approx([expected] * lengths[name], abs=1e-5), name
        assert e.action_mask.sum() == lengths[name]  # every row keeps its action mask: counted in the loss

    # One optimizer step: each micro-batch's loss with the step's normalizers, scaled 1/4 by DeepSpeed.
    norm = _optimizer_step_loss_norm([e.action_mask for e in rows], None, 1, len(rows))
    assert norm["global_batch_size"] * len(rows) == 4  # the zero-loss rows count as sequences
    loss_fn = PolicyLoss(token_level_loss=False)  # as OpenRLHF's actor builds it for seq-mean-token-mean
    log_probs = [torch.zeros(e.action_mask.shape, requires_grad=True) for e in rows]  # = the old ones: ratio 1
    total = sum(loss_fn(lp, torch.zeros(e.action_mask.shape), e.advantages, action_mask=e.action_mask, **norm)[0]
                for lp, e in zip(log_probs, rows)) / len(rows)
    total.backward()
    for name, e, lp in zip(names, rows, log_probs):
        if name in ("truncated", "unscored"):
            assert torch.equal(lp.grad, torch.zeros_like(lp.grad)), name  # exactly no gradient
        else:  # the authors' token mean of the row, over 4 sequences (the zero-loss ones in the denominator)
            grad = lp.grad[e.action_mask]
            assert grad.tolist() == pytest.approx([-whitened[name] / lengths[name] / 4] * lengths[name], rel=1e-5)
    # Why the mask is kept: a row with an empty action mask (another way to get zero loss) would leave OpenRLHF's
    # denominator, and each other row would weigh 1/3 of the step instead of 1/4.
    emptied = [torch.zeros_like(e.action_mask) if n == "unscored" else e.action_mask for n, e in zip(names, rows)]
    assert _optimizer_step_loss_norm(emptied, None, 1, len(rows))["global_batch_size"] * len(rows) == 3


def test_the_usable_switch_leaves_truncated_and_unscored_actions_out_of_the_batch(capsys):
    actions = [Action("e", "solver", i, [1], [2], truncated=i == 0, verdict=Verdict(None, "parse_error") if i == 1 else
                      Verdict(6.0, "ok")) for i in range(4)]  # fmt: skip
    counts = rewards.assign_rewards([Episode("e", "t", actions=actions)], "process", batch_semantics="usable")
    assert [a.reward for a in actions] == [None, None, 6.0, 6.0] and not any(a.zero_loss for a in actions)
    assert (counts["trainable"], counts["truncated_left_out"], counts["left_out_by_status"]) == (
        2, {"solver": 1}, {"parse_error": 1})
    kept, dropped = rewards.batch_rule(actions, SimpleNamespace(batch_size=4, seed=0), step=1)
    assert (kept, dropped) == ([], 2)  # two usable actions: less than a batch, no update
    with pytest.raises(SystemExit) as refused:  # any other value: the flag's choices refuse it, not assign_rewards
        parse_args(["--mappa.topology", "t.yaml", "--mappa.batch_semantics", "all"])
    assert refused.value.code == 2
    assert "--mappa.batch_semantics: invalid choice: 'all' (choose from 'authors', 'usable')" in capsys.readouterr().err
