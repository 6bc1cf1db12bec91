"""Evaluation of a policy, a scripted team or random play on fresh episodes."""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from typing import Any

import torch

from phalanx.envs import make
from phalanx.envs.base import StepRecord, VecEnv
from phalanx.envs.spaces import Discrete, MultiDiscrete
from phalanx.episodes import EpisodeCounters
from phalanx.errors import ConfigError
from phalanx.league import learner_outcome
from phalanx.league.ratings import DRAW, LOSS, WIN, wilson_interval
from phalanx.policy import Policy
from phalanx.slots import LEARNER_SLOT, OutsidePlayer, Player, SlotPlan, Teammates, opponent_slots, parse_teammates, play


@torch.no_grad()
def evaluate_policy(
    policy: Player,
    env_name: str,
    env_options: dict[str, Any] | None = None,
    episodes: int = 20,
    greedy: bool = True,
    seed: int = 12345,
    device: str | torch.device = "cpu",
    num_envs: int | None = None,
    max_steps: int = 1_000_000,
    teammates: str = "",
    opponent: Player = None,
    opponent_greedy: bool = False,
) -> dict[str, Any]:
    """Play `episodes` complete episodes.

    `policy` is a trained `Policy`, the name of one of the env's scripted policies (every slot
    plays it), an `OutsidePlayer` (slots.py), or None for uniform random play. `teammates` (as the config key)
    fills the last slots with other policies, for a trained policy that learned in a mixed team. `opponent` (a
    scripted name, "random", a `Policy` (greedy where `opponent_greedy`) or an `OutsidePlayer`) plays the
    opponent's side (the last A // 2 slots) in head-to-head matches: then per-slot metrics are the learner side's, and the result adds
    wins / draws / losses, their rates and a 95% Wilson interval of the win rate.
    Returns the mean/median/std of the episode return (summed over agent slots: the team return),
    the mean per-agent return, mean length, success rate, the env's own episode metrics, and each
    episode's return (`episode_returns`).
    """
    n = num_envs or min(episodes, 64)
    env = make(env_name, num_envs=n, device=device, seed=seed, **(env_options or {}))
    if isinstance(policy, str) and policy not in env.scripted_names:
        allowed = ", ".join(("random",) + tuple(x for x in env.scripted_names if x != "random"))
        raise ConfigError(f"unknown opponent/team '{policy}' for env '{env_name}'; allowed: {allowed}")
    side = None
    if opponent is not None:
        side = opponent_slots(env.num_agents, env.device)
        if isinstance(opponent, str) and opponent != "random" and opponent not in env.scripted_names:
            named = ", ".join(dict.fromkeys(("random", *env.scripted_names)))
            raise ConfigError(f"unknown opponent '{opponent}' for env '{env_name}'; allowed: {named}, snapshot:LATEST or "
                              "snapshot:NAME")
    mates = Teammates(parse_teammates(teammates, env), env, env.device) if teammates and isinstance(policy, Policy) else None
    lineup = Lineup(env, policy, mates, opponent, side, opponent_greedy)
    gen = torch.Generator(device=env.device)
    gen.manual_seed(seed)
    first = env.reset(seed=seed)
    lineup.reset()
    counters = EpisodeCounters(n, env.num_agents, env.device)
    rows: list[dict[str, float]] = []
    # Each env contributes its first episodes in order, so the sample is not biased toward short ones.
    quota = -(-episodes // n)
    taken = [0] * n
    # A running hash of each copy's discrete actions this episode: games that repeat one another (two deterministic
    # players meet the same way every time) are counted as one (`distinct_games`), not as independent samples.
    discrete = isinstance(env.action_space, (Discrete, MultiDiscrete))
    trace = torch.zeros(n, dtype=torch.long, device=env.device)
    for before, played, rec in play_steps(lineup, env, first, gen, greedy, max_steps if episodes > 0 else 0):
        prev_active, prev_done = before.active, rec.terminated | rec.truncated
        if discrete:
            moves = (played.reshape(n, -1).long() + 1) * before.active.repeat_interleave(
                played.reshape(n, -1).shape[1] // env.num_agents, 1)
            mix = (torch.arange(moves.shape[1], device=env.device) * 2 + 3) ** 3  # a different weight per slot and head
            trace = trace * 1_000_003 + (moves * mix).sum(-1)
        env_done = counters.step(rec.reward, prev_done, prev_active, idle_rewards=env.turn_based)
        if bool(env_done.any()):
            info = {k: _side_mean(v.float().reshape(n, -1), side).tolist() for k, v in rec.info.items()}
            slot_ret = counters.slot_return
            if side is not None:
                sides = torch.stack([(slot_ret * ~side).sum(-1), (slot_ret * side).sum(-1)], -1)
                outcome = learner_outcome(rec.info, sides).tolist()
            for i in env_done.nonzero().flatten().tolist():
                if taken[i] < quota and len(rows) < episodes:
                    row = {"return": float(counters.team_return[i]), "length": float(counters.env_length[i]),
                           "game": int(trace[i])}
                    if env.turn_based:  # as training counts it: a slot's own moves (the learner's side's); plies apart
                        own = torch.ones(env.num_agents, dtype=torch.bool, device=env.device) if side is None else ~side
                        row["plies"] = row["length"]
                        row["length"] = float((counters.slot_length[i] * own).sum() / own.sum())
                    if side is not None:
                        row["return"] = float((slot_ret[i] * ~side).sum())
                        row["outcome"] = outcome[i]
                    row.update({k: v[i] for k, v in info.items()})
                    rows.append(row)
                    taken[i] += 1
            counters.end_slots(env_done[:, None].expand(n, env.num_agents))
            counters.end_envs(env_done)
            trace = trace.masked_fill(env_done, 0)
        if len(rows) >= episodes:
            break
    A = env.num_agents
    success_key = env.success_key
    env.close()
    returns = [r["return"] for r in rows]
    out: dict[str, Any] = {
        "episodes": len(rows),
        "mean_return": statistics.fmean(returns) if returns else float("nan"),
        "median_return": statistics.median(returns) if returns else float("nan"),
        "std_return": statistics.pstdev(returns) if len(returns) > 1 else 0.0,
        "mean_agent_return": statistics.fmean(returns) / (A - int(side.sum()) if side is not None else A) if returns else float("nan"),
        "mean_length": statistics.fmean(r["length"] for r in rows) if rows else float("nan"),
        **({"mean_plies": statistics.fmean(r["plies"] for r in rows)} if rows and "plies" in rows[0] else {}),
        **({"distinct_games": len({r["game"] for r in rows})} if discrete else {}),
        "greedy": greedy,
        "episode_returns": returns,  # in the order the episodes were taken, for intervals over episodes
    }
    if success_key is not None and rows and success_key in rows[0]:
        out["success_rate"] = statistics.fmean(r[success_key] for r in rows)
        if "steps_to_goal" in rows[0]:  # over the episodes that reached the goal
            reached = [r["steps_to_goal"] for r in rows if r[success_key] > 0.5]
            out["median_steps_to_goal"] = statistics.median(reached) if reached else float("nan")
    for k in rows[0] if rows else ():
        if k not in ("return", "length", "plies", "game", "outcome", success_key) and not k.startswith("episode_"):
            out[f"mean_{k}"] = statistics.fmean(r[k] for r in rows)
    if side is not None and rows:
        w, d, lost = (sum(r["outcome"] == c for r in rows) for c in (WIN, DRAW, LOSS))
        out.update({"wins": w, "draws": d, "losses": lost, "win_rate": w / len(rows), "draw_rate": d / len(rows),
                    "loss_rate": lost / len(rows), "win_rate_ci95": list(wilson_interval(w, len(rows)))})
    return out


def evaluate_seats(policy: Player, env_name: str, opponent: Player, greedy: bool = True, opponent_greedy: bool = True,
                   **common: Any) -> dict[str, Any]:
    """`policy` against `opponent` in a two-player game from each seat, `common` (evaluate_policy's keywords) the
    same: "first" with the policy in the first slots, "second" with the opponent there; each with the policy's wins,
    draws, losses, win rate and its 95% Wilson interval. A trained opponent acts greedily in both seats where
    `opponent_greedy`, else samples in both. An `OutsidePlayer`'s moves and illegal moves (not played) are added up
    over both. `distinct_games` per seat: how many of the games differ (a greedy policy against a deterministic player
    plays one game again and again: its interval is no interval)."""
    first = evaluate_policy(policy, env_name, greedy=greedy, opponent=opponent, opponent_greedy=opponent_greedy, **common)
    seat_two = evaluate_policy(None if opponent == "random" else opponent, env_name, greedy=opponent_greedy,
                               opponent="random" if policy is None else policy, opponent_greedy=greedy, **common)
    games = seat_two["episodes"]
    second = {"episodes": games, "wins": seat_two["losses"], "draws": seat_two["draws"], "losses": seat_two["wins"],
              "distinct_games": seat_two["distinct_games"], "mean_plies": seat_two.get("mean_plies", float("nan"))}
    second.update({"win_rate": second["wins"] / max(games, 1), "draw_rate": second["draws"] / max(games, 1),
                   "loss_rate": second["losses"] / max(games, 1),
                   "win_rate_ci95": list(wilson_interval(second["wins"], games))})
    keys = ("episodes", "wins", "draws", "losses", "win_rate", "draw_rate", "loss_rate", "win_rate_ci95", "distinct_games")
    out: dict[str, Any] = {"first": {**{k: first[k] for k in keys}, "mean_plies": first.get("mean_plies", float("nan"))},
                           "second": second}
    if isinstance(opponent, OutsidePlayer):
        out.update({"opponent_moves": opponent.moves, "opponent_illegal_moves": opponent.illegal})
    return out


def _side_mean(v: torch.Tensor, side: torch.Tensor | None) -> torch.Tensor:
    """[n, k] info -> [n]: per-slot values averaged over the learner's side in head-to-head play."""
    if side is None or v.shape[1] != side.shape[0]:
        return v.mean(-1)
    return (v * ~side).sum(-1) / (~side).sum()


class Lineup:
    """Who plays which slots of an evaluated or recorded episode: `player` in every slot, then `teammates`
    in theirs (learner slots keep the player's actions) and `opponent` on the opponent's side `side`
    (head-to-head), filled through one `SlotPlan`."""

    def __init__(self, env: VecEnv, player: Player, teammates: Teammates | None = None, opponent: Player = None,
                 side: torch.Tensor | None = None, opponent_greedy: bool = False):
        self.env, self.player, self.opponent_greedy = env, player, opponent_greedy
        others: list[Player] = list(teammates.plan.players) if teammates is not None else []
        who = teammates.who.clone() if teammates is not None else torch.full((env.num_agents,), LEARNER_SLOT, device=env.device)
        if side is not None:
            others.append(opponent)
            who[side] = len(others) - 1
        self.others, self.who = SlotPlan(env, others), who

    def reset(self) -> None:
        """Clear the memory of every policy in the lineup (a new batch of episodes)."""
        if isinstance(self.player, Policy):
            self.player.reset_memory()
        self.others.reset_memory()

    def act(self, rec: StepRecord, gen: torch.Generator, prev_done: torch.Tensor, greedy: bool) -> torch.Tensor:
        actions = play(self.player, self.env, rec, gen, prev_done, greedy)
        return self.others.fill(actions, self.who, rec, gen, prev_done, greedy=self.opponent_greedy)


def play_steps(lineup: Lineup, env: VecEnv, rec: StepRecord, gen: torch.Generator, greedy: bool,
               max_steps: int) -> Iterator[tuple[StepRecord, torch.Tensor, StepRecord]]:
    """Step `env` from `rec` with `lineup`, up to `max_steps` times: yields (the record acted on, the actions
    played, the record that followed) a step."""
    prev_done = torch.zeros(env.num_envs, env.num_agents, dtype=torch.bool, device=env.device)
    for _ in range(max_steps):
        actions = lineup.act(rec, gen, prev_done, greedy)
        before, rec = rec, env.step(actions)
        prev_done = rec.terminated | rec.truncated
        yield before, actions, rec
