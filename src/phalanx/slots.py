"""Slot control: which agent slots learn, and the one way other controllers act in the rest.

A controller (`Player`) is a trained policy, a scripted policy's name or random play; `play` gives its
actions for every slot, and a `SlotPlan` (who acts in which slot, as tensors) puts them into the slots
each controls. Teammates (config key
`teammates`: scripted names or `run:RUN_DIR` frozen policies for the last slots), league opponents (the
last `num_agents // 2` slots) and evaluation against scripted teams and opponents all act through them.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from typing import Any

import torch

from phalanx.checkpoint import section
from phalanx.draws import Source
from phalanx.envs.base import StepRecord, VecEnv
from phalanx.envs.registry import import_user_module
from phalanx.errors import ConfigError, OutsidePlayerError, one_line
from phalanx.policy import Policy, load


class OutsidePlayer:
    """A player written outside Phalanx (`--vs mypkg.bots:act`): a plain callable over the observation of the slot
    to move as the env's own API gives it (a turn-based PettingZoo env's observation dict with its action_mask,
    `turn_observations`) that returns an action. A move its mask forbids (or that is no action) is counted in
    `illegal` and not played: a uniformly random allowed move stands in for it. One that raises ends the
    evaluation in one line."""

    def __init__(self, act: Callable[[Any], Any], name: str, where: str = "--vs"):
        self.act, self.name, self.where = act, name, where  # `where`: the flag or config key that named it
        self.moves = self.illegal = 0

    @property
    def label(self) -> str:
        """How errors name it: the flag and the callable (`--vs mypkg.bots:act`), or as a league's opponent."""
        return f"{self.where} {self.name}" if self.where == "--vs" else f"opponent {self.name}"

    def unfit(self, env: VecEnv) -> str:
        """Why `env` cannot host this player ('' where it can)."""
        if env.turn_observations() is not None:
            return ""
        return (f"a callable opponent plays turn-based PettingZoo envs (pz:module:env of an AEC game); env '{env.name}' "
                "is not one")

    def actions(self, env: VecEnv, rec: StepRecord, draws: Source, mine: torch.Tensor | None = None) -> torch.Tensor:
        """Actions [N, A]: the callable's for the slot to move in each copy where `mine` ([A] or [N, A]; None:
        every slot) holds, random allowed ones elsewhere."""
        turns = env.turn_observations()
        if turns is None:
            raise ConfigError(f"{self.where} {self.name}: {self.unfit(env)}")
        out = random_actions(env, draws, rec.action_mask).clone()
        allowed = None if rec.action_mask is None else rec.action_mask.cpu()
        mine = None if mine is None else mine.expand(env.num_envs, env.num_agents).cpu()
        for i, (slot, obs) in enumerate(turns):
            if mine is not None and not bool(mine[i, slot]):
                continue
            try:
                action = self.act(obs)
            except Exception as e:  # the user's code: any error ends the evaluation in one line
                raise OutsidePlayerError(f"{self.label} raised on env copy {i}: {one_line(e)}") from e
            self.moves += 1
            move = _action_index(action)
            n = env.action_space.mask_width if allowed is None else allowed.shape[-1]
            if move is None:  # not a move at all: a wrong return type, not an illegal move to count
                raise OutsidePlayerError(f"{self.label} returned {action!r} ({type(action).__name__}) on env copy {i}; "
                                         f"it must return an action index (an int in 0..{n - 1}, a numpy integer or a 0-d "
                                         "array)")
            if not 0 <= move < n or (allowed is not None and not bool(allowed[i, slot, move])):
                self.illegal += 1
                continue  # the random allowed move stands
            out[i, slot] = move
        return out


def _action_index(action: Any) -> int | None:
    """A discrete action as an int (a Python or numpy integer, a 0-d integer array or tensor), else None."""
    try:
        return operator.index(action.item() if hasattr(action, "item") and not isinstance(action, str) else action)
    except (TypeError, ValueError):
        return None


def outside_player(spec: str, where: str = "--vs") -> OutsidePlayer:
    """The callable `module:attr` (importable from the current directory too) as an `OutsidePlayer`; `where`: the
    flag or config key that named it, for the errors."""
    module, _, attr = spec.partition(":")
    if not module or not attr or not all(p.isidentifier() for p in (*module.split("."), *attr.split("."))):
        raise ConfigError(f"{where} '{spec}' must name a callable as module:attr (e.g. mypkg.bots:act)")
    try:
        obj: Any = import_user_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise ConfigError(f"{where} '{spec}': module '{module}' has no '{attr}'") from None
    except Exception as e:  # the user's module failed to import
        raise ConfigError(f"{where} '{spec}': cannot import '{module}': {one_line(e)}") from None
    if not callable(obj):
        raise ConfigError(f"{where} '{spec}': '{attr}' is a {type(obj).__name__}, not a callable")
    return OutsidePlayer(obj, spec, where)


def is_outside_name(name: str) -> bool:
    """Whether a --vs name is a callable's module:attr (not a scripted name, random or snapshot:NAME)."""
    return ":" in name and not name.startswith(("snapshot:", "run:"))


# A trained policy, a callable written outside Phalanx, a scripted policy's name, or random play (None or "random").
Player = Policy | OutsidePlayer | str | None


def play(player: Player, env: VecEnv, rec: StepRecord, draws: Source, reset: torch.Tensor | None, greedy: bool,
         rows: torch.Tensor | None = None) -> torch.Tensor:
    """Actions for every slot from a `Policy` (its memory reset where `reset` [N, A] marks an episode start),
    a scripted name, or random play (None or "random"); `rows`: the copies whose actions are used, where known (a
    scripted policy may compute only those, `VecEnv.scripted_actions_in`)."""
    if player is None or player == "random":
        return random_actions(env, draws, rec.action_mask)
    if isinstance(player, OutsidePlayer):
        return player.actions(env, rec, draws)
    if isinstance(player, str):
        return env.scripted_actions(player, rec, draws) if rows is None else env.scripted_actions_in(player, rec, draws, rows)
    return player.act(rec.obs, greedy=greedy, generator=draws, reset=reset, active=rec.active, mask=rec.action_mask)


def random_actions(env: VecEnv, draws: Source, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Uniform random actions for every slot of a batched env; with `mask` (StepRecord.action_mask), uniform over
    the actions it allows."""
    if mask is None:
        return env.action_space.sample(env.num_envs, env.num_agents, draws, env.device)
    return env.action_space.sample(env.num_envs, env.num_agents, draws, env.device, mask=mask)


def fill_slots(actions: torch.Tensor, where: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """`actions` [N, A, *act] with `other` in the slots where `where` holds: [A] (every env) or
    [N, A] (per env)."""
    lead = where.reshape(1, -1) if where.dim() == 1 else where
    m = lead.reshape(*lead.shape, *([1] * (actions.dim() - 2)))
    return torch.where(m, other.to(actions.dtype), actions)


def opponent_slots(num_agents: int, device: torch.device | str) -> torch.Tensor:
    """[A] bool: the opponent's side in two-sided play (the last A // 2 slots)."""
    if num_agents < 2:
        raise ConfigError("config key 'opponents' needs an env with at least 2 agent slots (one per side)")
    return torch.arange(num_agents, device=device) >= num_agents - num_agents // 2


def parse_teammates(teammates: str, env: VecEnv) -> list[str]:
    """Per-slot controller names: '' for learner slots, else a scripted name or run:DIR."""
    names = [t.strip() for t in teammates.split(",") if t.strip()]
    if len(names) >= env.num_agents:
        raise ConfigError(
            f"config key 'teammates' names {len(names)} slots but env '{env.name}' has {env.num_agents}; leave at least one learner"
        )
    for n in names:
        if not n.startswith("run:") and n not in env.scripted_names:
            allowed = ", ".join(env.scripted_names) or "none"
            raise ConfigError(f"config key 'teammates' has unknown policy '{n}'; allowed: {allowed}, or run:RUN_DIR")
    return [""] * (env.num_agents - len(names)) + names


LEARNER_SLOT = -1  # `who` of a slot whose actions stand as given (the learner's, or the evaluated player's)


class SlotPlan:
    """Who acts in which slot, and the one way their actions fill the slots: collect (teammates, league
    opponents), evaluation and recording all fill through `fill`.

    `players[i]` (a `Player`: a policy, a scripted name, random) acts in the slots where `who == i`; `who`
    ([A], or [N, A] where it differs per env, as league opponents do) is given to `fill` each step; where it
    is `LEARNER_SLOT` the actions given stand. With `columns` (league opponents: the opponent's side), a
    feed-forward policy reads only those slots' observations, and with `rows_only` (an eager CPU step, where
    selecting rows is free) only the envs it plays in: with a pool of P snapshots, forwarding every env
    through each would cost P full batches a step. A policy with memory reads every slot (its memory keeps
    one row per env slot, whoever plays there next). `alike`: the players that are feed-forward copies of one
    policy (a league's learner and its snapshots): the moves they choose from are a function of the boards alone
    (`Policy.moves`), read once a step for all of them rather than once by each (with a pool of 20, that read
    was a third of a connect four step)."""

    def __init__(self, env: VecEnv, players: list[Player], columns: torch.Tensor | None = None,
                 alike: Iterable[int] = ()):
        self.env, self.players, self.columns = env, players, columns
        self.alike = set(alike)

    def fill(self, actions: torch.Tensor, who: torch.Tensor, rec: StepRecord, draws: Source, reset: torch.Tensor | None,
             greedy: bool = False, playing: Iterable[int] | None = None, rows_only: bool = False) -> torch.Tensor:
        """`actions` [N, A, ...] with each player's in its slots; `playing`: the players that may act (None:
        every one, the static shape a captured step needs); `reset` [N, A]: the slots whose episode starts."""
        order = list(range(len(self.players)) if playing is None else playing)
        shared = self._alike_moves(who, rec, greedy, order, rows_only)
        for i in order:
            player, mine = self.players[i], who == i
            if self.columns is not None and isinstance(player, Policy) and not player.recurrent:
                moves = shared if i in self.alike else None
                actions = self._fill_columns(actions, mine, player, rec, draws, greedy, rows_only, moves)
            elif isinstance(player, OutsidePlayer):  # asked only for the moves it makes
                actions = fill_slots(actions, mine, player.actions(self.env, rec, draws, mine))
            else:
                # A scripted player computes the copies where it is to act alone, where selecting them is free.
                rows = (mine & rec.active).any(-1).nonzero().squeeze(1) if rows_only and isinstance(player, str) \
                    and mine.dim() == 2 else None
                actions = fill_slots(actions, mine, play(player, self.env, rec, draws, reset, greedy, rows))
        return actions

    def _alike_moves(self, who: torch.Tensor, rec: StepRecord, greedy: bool, order: list[int],
                     rows_only: bool) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        """The moves of the `alike` players that act, read once over the columns: (where each env's row lies in
        them [N], None: every env in order; the moves [M, C, n]), or None where fewer than two of them act, or
        the moves are the mask as it is."""
        alike = [i for i in order if i in self.alike and isinstance(self.players[i], Policy)
                 and not self.players[i].recurrent]
        if self.columns is None or len(alike) < 2:
            return None
        cols, mask, first = self.columns, rec.action_mask, self.players[alike[0]]
        if not rows_only:  # every env, the static shape (no host read)
            moves = first.moves(rec.obs[:, cols], None if mask is None else mask[:, cols], greedy)
            return None if moves is None else (None, moves)
        rows = torch.isin(who[:, cols], torch.tensor(alike, device=who.device)).any(-1).nonzero().squeeze(1)
        if rows.numel() == 0:
            return None
        moves = first.moves(rec.obs[rows][:, cols], None if mask is None else mask[rows][:, cols], greedy)
        if moves is None:
            return None
        at = torch.full((who.shape[0],), -1, dtype=torch.long, device=who.device)
        at[rows] = torch.arange(rows.numel(), device=who.device)
        return at, moves

    def _fill_columns(self, actions: torch.Tensor, mine: torch.Tensor, policy: Policy, rec: StepRecord, draws: Source,
                      greedy: bool, rows_only: bool,
                      shared: tuple[torch.Tensor | None, torch.Tensor] | None = None) -> torch.Tensor:
        cols, mask = self.columns, rec.action_mask
        mine = mine[:, cols]  # `who` per env [N, A]: a plan with columns is a league's
        if not rows_only:  # every env, the static shape (no host read)
            other = policy.act(rec.obs[:, cols], greedy=greedy, generator=draws, mask=None if mask is None else mask[:, cols],
                               moves=None if shared is None else shared[1])
            actions = actions.clone()
            actions[:, cols] = fill_slots(actions[:, cols], mine, other)
            return actions
        rows = mine.any(-1).nonzero().squeeze(1)
        if rows.numel() == 0:
            return actions
        moves = None if shared is None else shared[1][shared[0][rows]]
        other = policy.act(rec.obs[rows][:, cols], greedy=greedy, generator=draws,
                           mask=None if mask is None else mask[rows][:, cols], moves=moves).to(actions.dtype)
        return actions.index_put((rows[:, None], cols[None, :]), other)

    def step_state(self) -> dict[str, torch.Tensor]:
        """The memories of the players with one, as a step state (phalanx.graphs)."""
        return {f"{i}.{k}": v for i, p in enumerate(self.players) if isinstance(p, Policy) for k, v in p.step_state().items()}

    def load_step_state(self, state: dict[str, torch.Tensor]) -> None:
        for i, p in enumerate(self.players):
            if isinstance(p, Policy):
                p.load_step_state(section(state, str(i)))

    def reset_memory(self) -> None:
        """Every policy forgets its memory (a new batch of episodes)."""
        for p in self.players:
            if isinstance(p, Policy):
                p.reset_memory()


class Teammates:
    """The non-learner slots' controllers (config key `teammates`, from `parse_teammates`): scripted policies
    and frozen trained ones (`run:RUN_DIR`), each in its fixed slots."""

    def __init__(self, slots: list[str], env: VecEnv, device: torch.device):
        names = list(dict.fromkeys(s for s in slots if s))
        players: list[Player] = [load(n[4:], device=str(device)) if n.startswith("run:") else n for n in names]
        self.plan = SlotPlan(env, players)
        self.who = torch.tensor([names.index(s) if s else LEARNER_SLOT for s in slots], device=device)

    def fill(self, actions: torch.Tensor, record: StepRecord, draws: Source, reset: torch.Tensor) -> torch.Tensor:
        """`actions` with the teammates' in their slots; `reset` [N, A]: the slots whose episode starts at this
        step (a frozen policy with memory resets it there)."""
        return self.plan.fill(actions, self.who, record, draws, reset)
