"""The opponent league of a training run: snapshots of the learner kept on disk, a weighted mix of
opponents drawn per env at episode resets, batched opponent actions, and ratings.

Slots: the last `num_agents // 2` agent slots of every env are the opponent's side, the others
the learner's. Each env plays one opponent at a time (`assign[env]`), swapped only where the env's
episode ended. Mix entries (config key `opponents`, e.g. `self_play:8,based:1.5,constant:0.5`):

- `self_play`: past snapshots, weighted by `pool_sampling` (uniform, latest, or pfsp:
  prioritized fictitious self-play; the strategies are league/sampling.py's); with no snapshot
  yet, the current learner plays instead.
- `learner`: the current learner (its memory kept separately from the learner's own).
- a scripted policy of the env (`phalanx envs` lists them), or `random` (uniform over the allowed actions).
- a player written outside Phalanx, `module:callable` (as `phalanx eval --vs` takes it; turn-based PettingZoo
  envs), e.g. `self_play:8,phalanx_bench.players.tictactoe:act:1`.
- a trained run's policy, frozen: `run:RUN_DIR` samples its actions (as snapshots do), `greedy:RUN_DIR` plays
  greedily (as `phalanx eval` plays it: what `phalanx exploit` trains a best response against), e.g.
  `greedy:runs/c4:1`. The run must be of the same env.

Seats: where the env's sides swap (seats.py: the learner plays first in half of its games and second in the
others), games are counted and the learner rated per seat too (`learner@first`, `learner@second`).

Outcomes come from the env's `win` / `draw` info of the learner's first slot where it has them,
else from comparing the two sides' episode returns.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path
from typing import Any

import torch

from phalanx.checkpoint import read_tensors, section, write_tensors_atomic
from phalanx.draws import Source, uniform
from phalanx.errors import CheckpointError, ConfigError, PhalanxError
from phalanx.league.ratings import DRAW, LEARNER, LOSS, WIN, Ratings
from phalanx.league.sampling import Candidate, pool_sampling
from phalanx.league.seats import SEAT_KEY, SEAT_NAMES
from phalanx.policy import Policy, frozen_copy, load, load_frozen
from phalanx.slots import LEARNER_SLOT, OutsidePlayer, SlotPlan, is_outside_name, opponent_slots, outside_player

SELF_PLAY = "self_play"
RANDOM = "random"  # uniform over the allowed actions (slots.play)
SNAPSHOT_DIR = "league/snapshots"
LEAGUE_FILE = "league/league.json"


FROZEN_PREFIXES = ("run:", "greedy:")  # a trained run's policy: sampled, or greedy


def _frozen_name_weight(part: str) -> tuple[str, str]:
    """'greedy:runs/a:2' -> ('greedy:runs/a', '2'); a last field that is no number belongs to the path."""
    head, sep, tail = part.rpartition(":")
    try:
        float(tail)
    except ValueError:
        return part, ""
    return (head, tail) if head not in FROZEN_PREFIXES and head + sep not in FROZEN_PREFIXES else (part, "")


def is_frozen_name(name: str) -> bool:
    return name.startswith(FROZEN_PREFIXES)


def parse_mix(text: str, scripted: tuple[str, ...]) -> list[tuple[str, float]]:
    """'self_play:8,based:1.5,mypkg.bots:act:2,greedy:runs/a:1' -> [(name, weight)]; a name with a ':' is an outside
    player (`is_outside_name`) or a frozen run (`FROZEN_PREFIXES`). Errors name the config key and allowed values."""
    allowed = (SELF_PLAY, LEARNER, *scripted, *(() if RANDOM in scripted else (RANDOM,)))
    out: list[tuple[str, float]] = []
    for part in [p.strip() for p in text.split(",") if p.strip()]:
        fields = [f.strip() for f in part.split(":")]
        # 'self_play:8' or an outside player's 'mypkg.bots:act:2' (its attr an identifier, never a weight).
        head = 2 if len(fields) > 1 and fields[0] not in allowed and fields[1].isidentifier() else 1
        name, w = ":".join(fields[:head]), ":".join(fields[head:])
        if is_frozen_name(part):
            name, w = _frozen_name_weight(part)
            if name in FROZEN_PREFIXES or name + ":" in FROZEN_PREFIXES:
                raise ConfigError(f"config key 'opponents': '{part}' names no run directory (run:RUN_DIR or greedy:RUN_DIR)")
        elif name not in allowed and not is_outside_name(name):
            raise ConfigError(f"config key 'opponents' has unknown opponent '{name}'; allowed: {', '.join(allowed)}, "
                              "or a callable as module:attr")
        try:
            weight = float(w) if w else 1.0
        except ValueError:
            raise ConfigError(f"config key 'opponents': weight of '{name}' must be a number, got {w!r}") from None
        if not weight >= 0:
            raise ConfigError(f"config key 'opponents': weight of '{name}' must be >= 0, got {weight}")
        out.append((name, weight))
    if not out or sum(w for _, w in out) <= 0:
        raise ConfigError("config key 'opponents' needs at least one opponent with a positive weight")
    return out


@dataclasses.dataclass
class Opponent:
    name: str
    kind: str  # "scripted" (the env's, or an outside player) | "learner" | "snapshot" | "frozen" (a trained run's)
    policy: Policy | None = None  # the learner's copy with its own memory / a bank slot's frozen policy
    step: int = 0
    pinned: bool = False
    retired: bool = False  # out of the pool: no new games, kept until no env plays it
    outside: OutsidePlayer | None = None  # a scripted opponent written outside Phalanx


_SNAPSHOT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,100}")


def snapshot_path(run_dir: Path, name: str) -> Path:
    """The file of snapshot `name`; names come from league.json, so one that could reach outside the
    run directory is refused."""
    if not _SNAPSHOT_NAME.fullmatch(name) or name.startswith("."):
        raise CheckpointError(f"league snapshot name {name!r} is not allowed (letters, digits, _ . - only)")
    return Path(run_dir) / SNAPSHOT_DIR / f"{name}.safetensors"


def save_snapshot(run_dir: Path, name: str, model: torch.nn.Module, obs_rms: Any) -> Path:
    """Write the learner's weights and observation statistics atomically (tmp file + rename)."""
    path = snapshot_path(run_dir, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    if obs_rms is not None:
        tensors.update({f"obs_rms.{k}": v for k, v in obs_rms.state_dict().items()})
    write_tensors_atomic(path, tensors, "league snapshot")
    return path


def load_snapshot(run_dir: Path, name: str, learner_policy: Policy, into: Policy | None = None) -> Policy:
    """A frozen `Policy` with a snapshot's weights, built like the learner's policy (or `into`, a frozen
    policy whose tensors take them in place)."""
    path = snapshot_path(run_dir, name)
    tensors = read_tensors(path, "league snapshot")
    policy = into if into is not None else frozen_copy(learner_policy)
    load_frozen(policy, section(tensors, "model"), section(tensors, "obs_rms"), f"league snapshot '{path}'")
    return policy


def draw_players(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Player indices, one per uniform draw in `u`, with probabilities proportional to `weights` (the
    inverse of the cumulative weights: one draw per env, replayable in a captured step)."""
    cdf = weights.cumsum(0)
    return torch.searchsorted(cdf, u * cdf[-1], right=True).clamp_max(weights.shape[0] - 1)


def learner_outcome(info: dict[str, torch.Tensor], side_returns: torch.Tensor) -> torch.Tensor:
    """[N] outcome code (WIN / DRAW / LOSS) for the learner's side.

    `side_returns` [N, 2] = (learner side, opponent side) episode returns, used without win info.
    """
    if "win" in info and "draw" in info:
        win, draw = info["win"], info["draw"]
        win = win[:, 0] if win.dim() == 2 else win
        draw = draw[:, 0] if draw.dim() == 2 else draw
        return torch.where(win > 0.5, WIN, torch.where(draw > 0.5, DRAW, LOSS))
    diff = side_returns[:, 0] - side_returns[:, 1]
    return torch.where(diff > 0, WIN, torch.where(diff == 0, DRAW, LOSS))


@dataclasses.dataclass(frozen=True)
class LeagueParams:
    """What the league reads of the run's config: the keys of the same names, whose defaults and meanings config.py
    holds (`config.params_of` fills them)."""

    env: str  # the run's env, which a frozen opponent (run:, greedy:) must have been trained on
    opponents: str  # the weighted mix (`parse_mix`)
    pool_sampling: str  # how self_play picks snapshots (league/sampling.py)
    pool_size: int  # snapshots kept in play, the pinned ones besides
    snapshot_every: int  # 0: every 5% of the run, at least once an update
    pin_every: int  # 0: no snapshot is pinned
    total_steps: int
    num_steps: int  # with the envs, an update's steps


class League:
    """Opponents for the opponent slots of every env, sampled per episode; see the module docstring.

    Players sit in a fixed layout, `players[i]` being the opponent of the envs with `assign == i`: the
    mix's scripted policies, the learner, then a bank of frozen policies that snapshots take turns in
    (None: a free slot). A snapshot's weights are copied into its slot's tensors in place, so a captured
    rollout step, which runs every player over every env and keeps each env's own, reads the same
    tensors for the whole run."""

    def __init__(self, params: LeagueParams, env: Any, run_dir: Path, learner_policy: Any, generator: torch.Generator,
                 host_free: bool = False):
        self.params, self.env, self.run_dir = params, env, Path(run_dir)
        self.device, self.N = env.device, env.num_envs
        self.slots = opponent_slots(env.num_agents, env.device)
        self.slot_index = self.slots.nonzero().squeeze(1)
        # An eager CPU step runs the players in use, each over its own envs' rows (free there); elsewhere
        # (accelerators, a captured step: `host_free`, no host reads) every player of the layout runs over every env.
        self.select_rows = torch.device(env.device).type == "cpu" and not host_free
        self.mix = dict(parse_mix(params.opponents, env.scripted_names))
        self.pool_sampling = pool_sampling(params.pool_sampling)
        self.learner_policy = learner_policy
        self.ratings = Ratings()
        self.learner_as_opponent = copy.copy(learner_policy)  # same weights, its own memory
        self.players: list[Opponent | None] = [
            self._frozen(n) if is_frozen_name(n) else Opponent(n, "scripted", outside=self._outside(n) if is_outside_name(n) else None)
            for n in self.mix if n not in (SELF_PLAY, LEARNER)]
        for o in self.players:
            self.ratings.ensure(o.name)
        self.players.append(Opponent(LEARNER, "learner", self.learner_as_opponent))
        self.bank_start = len(self.players)
        self.bank: list[Policy] = []
        # Who plays: players[i] acts where an env's assign is i (the bank's policies, free or not, included).
        self.plan = SlotPlan(env, [o.policy or o.outside or o.name for o in self.players], columns=self.slot_index,
                             alike=[self.bank_start - 1])  # the learner; the bank's copies of it join as it grows
        self.weights = torch.zeros(len(self.players), device=self.device)
        # Finished games per player, by the learner's seat (first, second: seats.py) and outcome.
        self.counts = torch.zeros(len(self.players), len(SEAT_NAMES), 3, device=self.device)
        self.layout = 0  # bumped where the bank grows: a recorded CUDA graph of the old layout is stale
        # Room for the pool, the run's pinned snapshots (up to 32: each slot is a model copy, and a captured
        # step runs every slot) and one retired snapshot still being played; more grows the bank, which a
        # captured step traces again.
        if self.mix.get(SELF_PLAY, 0.0) > 0:
            pinned = params.total_steps // params.pin_every if params.pin_every else 0
            self._grow(params.pool_size + 1 + min(pinned, 32))
        self.snapshot_every = params.snapshot_every or max(self.N * params.num_steps, params.total_steps // 20)
        self.last_snapshot_step = 0
        self._refresh()
        self.assign = draw_players(self.weights, torch.rand(self.N, generator=generator, device=self.device))
        self.reset_next = torch.ones(self.N, dtype=torch.bool, device=self.device)
        self.in_use = set(range(len(self.players)))

    def _outside(self, name: str) -> OutsidePlayer:
        player = outside_player(name, "config key 'opponents'")
        if player.unfit(self.env):
            raise ConfigError(f"config key 'opponents': {name}: {player.unfit(self.env)}")
        return player

    def _frozen(self, name: str) -> Opponent:
        """A trained run's policy as a fixed opponent (`run:` sampled, `greedy:` greedy)."""
        prefix, _, path = name.partition(":")
        try:
            policy = load(path, device=str(self.device))
        except PhalanxError as e:
            raise ConfigError(f"config key 'opponents': {name}: {e}") from None
        if policy.config.env != self.params.env:
            raise ConfigError(f"config key 'opponents': {name} was trained on env '{policy.config.env}', not "
                              f"'{self.params.env}'; a frozen opponent must play the same env")
        policy.model.requires_grad_(False)
        policy.fixed_greedy = prefix == "greedy"
        return Opponent(name, "frozen", policy)

    def _grow(self, slots: int) -> None:
        """`slots` more bank slots (frozen copies of the learner, free until a snapshot takes one)."""
        grown = [frozen_copy(self.learner_policy) for _ in range(slots)]
        self.plan.alike.update(range(len(self.plan.players), len(self.plan.players) + slots))
        self.bank += grown
        self.plan.players += grown
        self.players += [None] * slots
        self.weights = torch.cat([self.weights, self.weights.new_zeros(slots)])
        self.counts = torch.cat([self.counts, self.counts.new_zeros(slots, *self.counts.shape[1:])])
        self.layout += 1

    @property
    def opponents(self) -> list[Opponent]:
        """The players that exist (scripted, the learner, snapshots), in layout order."""
        return [o for o in self.players if o is not None]

    # -- sampling ------------------------------------------------------------------------------------
    def _candidate(self, i: int) -> Candidate:
        """Snapshot `players[i]` as the pool sampling sees it: its step and the learner's record against it."""
        o = self.players[i]
        p = self.ratings.players.get(o.name)
        if p is None:
            return Candidate(o.step)
        return Candidate(o.step, p.learner_wins, p.learner_draws, p.learner_losses)

    def _refresh(self) -> None:
        """Recompute the sampling weights over the players (host side; between updates) into the same
        tensors (a recorded CUDA graph reads them), and clear the game counts."""
        w = [0.0] * len(self.players)
        for i, o in enumerate(self.players):
            if o is not None and o.kind in ("scripted", "frozen"):
                w[i] = self.mix[o.name]
            elif o is not None and o.kind == "learner":
                w[i] = self.mix.get(LEARNER, 0.0)
        snaps = [i for i, o in enumerate(self.players) if o is not None and o.kind == "snapshot" and not o.retired]
        sp = self.mix.get(SELF_PLAY, 0.0)
        if sp > 0:
            if not snaps:
                w[self._index(LEARNER)] += sp
            else:
                sw = self.pool_sampling([self._candidate(i) for i in snaps])
                total = sum(sw)
                for i, x in zip(snaps, sw):
                    w[i] = sp * x / total
        self.weights.copy_(torch.tensor(w, dtype=torch.float32))
        self.counts.zero_()

    def _index(self, name: str) -> int:
        return next(i for i, o in enumerate(self.players) if o is not None and o.name == name)

    # -- rollout (on the device, no host reads) ---------------------------------------------------------
    def fill(self, actions: torch.Tensor, record: Any, draws: Source) -> torch.Tensor:
        """Replace the opponent slots' actions: one batched forward per player (see `select_rows`; without
        it every player, free bank slots included, runs over every env, so the step's shape never changes)."""
        who = torch.where(self.slots, self.assign[:, None], LEARNER_SLOT)
        reset = self.reset_next[:, None].expand(self.N, self.slots.shape[0])
        playing = sorted(self.in_use) if self.select_rows else None
        actions = self.plan.fill(actions, who, record, draws, reset, playing=playing, rows_only=self.select_rows)
        self.reset_next = torch.zeros_like(self.reset_next)
        return actions

    def after_step(self, record: Any, env_done: torch.Tensor, side_returns: torch.Tensor, draws: Source) -> None:
        """Count finished games by opponent and draw new opponents where episodes ended."""
        outcome = learner_outcome(record.info, side_returns)
        seat = record.info.get(SEAT_KEY)
        seat = seat[:, 0].long() if seat is not None else torch.zeros_like(outcome)
        self.counts.index_put_((self.assign, seat, outcome), env_done.float(), accumulate=True)
        fresh = draw_players(self.weights, uniform(draws, (self.N,), self.device))
        self.assign = torch.where(env_done, fresh, self.assign)
        self.reset_next = env_done

    def step_state(self) -> dict[str, torch.Tensor]:
        """Each env's opponent and pending reset, and the memories of the players with one, as a step state
        (phalanx.graphs). The sampling weights and game counts are written in place."""
        return {"assign": self.assign, "reset_next": self.reset_next,
                **{f"players.{k}": v for k, v in self.plan.step_state().items()}}

    def load_step_state(self, state: dict[str, torch.Tensor]) -> None:
        self.assign, self.reset_next = state["assign"], state["reset_next"]
        self.plan.load_step_state(section(state, "players"))

    # -- between updates (host) -------------------------------------------------------------------------
    def end_update(self, step: int, model: torch.nn.Module, obs_rms: Any) -> dict[str, float]:
        """Rate the update's games, snapshot the learner when due, retire old snapshots.

        Returns per-opponent metrics for the log (`league_win_rate_<name>`, `league_games`).
        """
        playing = torch.bincount(self.assign, minlength=len(self.players)).float()
        counts = torch.cat([self.counts.flatten(1), playing[:, None]], 1)
        rows = counts.tolist()  # the league's one host read per update
        seated = bool(sum(row[3:6].count(0.0) < 3 for row in rows))  # a game was played from the second seat
        metrics: dict[str, float] = {}
        by_kind: dict[str, list[int]] = {}
        for o, row in zip(self.players, rows):
            if o is None:
                continue
            for seat, name in enumerate(SEAT_NAMES):
                w, d, lo = (int(x) for x in row[3 * seat: 3 * seat + 3])
                if w + d + lo == 0:
                    continue
                key = SELF_PLAY if o.kind == "snapshot" else o.name  # per-snapshot figures live in the ratings
                for k in (key, f"{key}_{name}") if seated else (key,):
                    tot = by_kind.setdefault(k, [0, 0, 0])
                    tot[0], tot[1], tot[2] = tot[0] + w, tot[1] + d, tot[2] + lo
                if o.kind != "learner":
                    self.ratings.record_counts(o.name, w, d, lo, seat=name if seated else None)
        for key, (w, d, lo) in by_kind.items():
            metrics[f"league_win_rate_{key}"] = (w + 0.5 * d) / (w + d + lo)
        metrics["league_games"] = float(sum(sum(v) for k, v in by_kind.items() if not k.endswith(SEAT_NAMES)))
        metrics["league_rating"] = self.ratings.players[LEARNER].ordinal
        for o in self.players:
            if o is not None and o.outside is not None:  # moves its mask forbade, not played (slots.OutsidePlayer)
                metrics[f"league_illegal_moves_{o.name}"] = float(o.outside.illegal)
        for name in SEAT_NAMES:
            if seated and f"{LEARNER}@{name}" in self.ratings.players:
                metrics[f"league_rating_{name}"] = self.ratings.players[f"{LEARNER}@{name}"].ordinal
        self.in_use = {i for i, (row, wt) in enumerate(zip(rows, self.weights.tolist())) if row[-1] > 0 or wt > 0}
        if self.mix.get(SELF_PLAY, 0.0) > 0 and step - self.last_snapshot_step >= self.snapshot_every:
            self.snapshot(step, model, obs_rms)
        self._drop_unused()
        self._refresh()
        return metrics

    def _free_slot(self) -> int:
        free = [i for i in range(self.bank_start, len(self.players)) if self.players[i] is None]
        if not free:
            self._grow(1)
            return len(self.players) - 1
        return free[0]

    def snapshot(self, step: int, model: torch.nn.Module, obs_rms: Any) -> Opponent:
        name = f"snapshot_{step:012d}"
        save_snapshot(self.run_dir, name, model, obs_rms)
        every = self.params.pin_every
        pin = every > 0 and (step // every) > (self.last_snapshot_step // every)
        slot = self._free_slot()
        policy = load_snapshot(self.run_dir, name, self.learner_policy, into=self.bank[slot - self.bank_start])
        opp = self.players[slot] = Opponent(name, "snapshot", policy, step, pinned=pin)
        self.ratings.ensure(name, like=LEARNER)
        self.last_snapshot_step = step
        # Oldest first by step, not by bank slot: a freed slot takes the next snapshot, and retiring in slot order
        # retired that newest one at once, freezing the pool at the run's first snapshots.
        pool = sorted((o for o in self.players if o is not None and o.kind == "snapshot" and not o.retired and not o.pinned),
                      key=lambda o: o.step)
        for old in pool[: max(0, len(pool) - self.params.pool_size)]:
            old.retired = True
        self.in_use.add(slot)
        return opp

    def _drop_unused(self) -> None:
        """Free the bank slots of retired snapshots no env plays any more (their ratings stay in the table)."""
        for i, o in enumerate(self.players):
            if o is not None and o.retired and i not in self.in_use:
                self.players[i] = None

    # -- persistence ------------------------------------------------------------------------------------
    def state_json(self, step: int) -> dict[str, Any]:
        return {
            "step": step,
            "last_snapshot_step": self.last_snapshot_step,
            "opponents": [{"name": o.name, "kind": o.kind, "step": o.step, "pinned": o.pinned, "retired": o.retired,
                           "slot": i} for i, o in enumerate(self.players) if o is not None],
            "ratings": self.ratings.to_json(),
            "in_use": sorted(self.in_use),
        }

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {"league.assign": self.assign, "league.reset_next": self.reset_next}
        for i, o in enumerate(self.players):
            mem = o.policy.memory if o is not None and o.policy is not None else None
            if mem is not None:
                out.update({f"league.memory.{i}.{k}": v for k, v in mem.tensors().items()})
        return out

    def load(self, data: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Restore from a checkpoint's league state (snapshots are reloaded from their files into their
        bank slots). A state from before the fixed layout has no `slot`: its list (scripted, the learner, then
        the snapshots, retired ones dropped) is the layout's order, so its indices hold as they are."""
        self.ratings = Ratings.from_json(data["ratings"])
        self.last_snapshot_step = int(data["last_snapshot_step"])
        entries = data["opponents"]
        slots = [d.get("slot", i) for i, d in enumerate(entries)]
        if max(slots, default=0) >= len(self.players):
            self._grow(max(slots) + 1 - len(self.players))
        self.players[self.bank_start:] = [None] * (len(self.players) - self.bank_start)
        for d, i in zip(entries, slots):
            o = self.players[i] if i < self.bank_start else None
            if d["kind"] == "snapshot":
                policy = load_snapshot(self.run_dir, d["name"], self.learner_policy, into=self.bank[i - self.bank_start])
                o = self.players[i] = Opponent(d["name"], "snapshot", policy)
            o.step, o.pinned, o.retired = d["step"], d["pinned"], d["retired"]
        dev = self.device
        self.assign = tensors["league.assign"].to(dev)
        self.reset_next = tensors["league.reset_next"].to(dev)
        for i in slots:
            fields = {k.rsplit(".", 1)[1]: v.to(dev) for k, v in tensors.items() if k.startswith(f"league.memory.{i}.")}
            if fields and self.players[i].policy is not None:
                self.players[i].policy.memory = type(self.learner_policy.model.initial_state(1, dev)).of(fields)
        self.in_use = set(data["in_use"])
        self._refresh()

    def prune_files(self) -> None:
        """Delete snapshot files no opponent refers to (after the state naming them was saved)."""
        names = {o.name for o in self.opponents if o.kind == "snapshot"}
        for path in (self.run_dir / SNAPSHOT_DIR).glob("snapshot_*.safetensors"):
            if path.stem not in names:
                path.unlink(missing_ok=True)
