"""Bucket brigade: cooperative fire fighting on a ring of 10 houses (docs/WORKLOADS.md section 1).

`A` agents (2..10, default 4) share a ring of 10 houses, each Safe (0), Burning (1) or Ruined (2).
Agent `i` owns house `i % 10`. Every night each agent picks `[house 0..9, mode REST=0 / WORK=1]`
(MultiDiscrete([10, 2]); actions [N, A, 2] int64, clamped into range). The mode is the agent's public
signal for the night.

A night, in order:

1. signals and positions: a WORKing agent stands at the house it chose and fights fire there; a
   RESTing agent stays at its own house and does not fight fire (the house it chose is ignored,
   except in the "last actions" part of the observation);
2. each burning house is extinguished with probability `1 - (1 - kappa) ** workers_there`;
3. fire spreads from each still-burning house to each Safe neighbour (i +- 1 on the ring) with
   probability `beta`; a Safe house with two burning neighbours gets two independent chances; newly
   ignited houses do not spread further this night;
4. houses still burning that were burning at the start of the night become Ruined (houses ignited by
   spread this night stay Burning);
5. Safe houses (including ones extinguished this night) ignite spontaneously with `p_ignite`;
6. rewards; 7. night += 1.

`legacy_phase_order=True` swaps 3 and 4 (burn-out, then spread), reproducing the original project's
bug: every house that could spread has already burnt out, so `beta` has no effect.

Reset: each house is Burning with probability `rho` (0.2; trivial_cooperation 0.1, chain_reaction
0.3); where no house was drawn burning, one uniformly random house is ignited, so no episode starts
empty. Every step draws a fresh start for every env (used only where an episode ended), so the RNG
stream does not depend on which envs finished, and nothing syncs with the host.

Rewards per agent per night: `-c` when WORKing, `+0.5` when RESTing, plus the house-outcome terms.
For the houses `h` the outcome potential of agent `i` is

    Phi_i(h) = A_team * saved / 10 - L_team * ruined / 10 + 100 * [own house Safe]
               + 50 * [house own-1 Safe] + 50 * [house own+1 Safe]

with saved / ruined the numbers of Safe / Ruined houses (a Burning house counts as neither; so at
truncation a house still on fire is neither saved nor lost). `outcome_reward="terminal"` pays
`Phi(final houses)` on the episode's last night (terminated or truncated). `"shaped"` (default) pays
`Phi(after) - Phi(before)` every night, with Phi before the first night defined as 0, so an
episode's total is exactly the terminal version's (the sum telescopes) while the outcome of every
night's work is visible the same night. Shaping also keeps truncation bootstrapping sound: the
agents do not observe the night counter, so a terminal lump paid at the time limit would be
indistinguishable from the continuation value the trainer bootstraps with V(final_obs); with
per-night differences the return from any state is a function of what the agents see.

Ends: terminated when `night >= min_nights` and all houses are Safe or all are Ruined (a ring of
Safe and Ruined houses with no fire is not an end: with `p_ignite > 0` it can still ignite, with
`p_ignite = 0` it runs to the time limit, resting); truncated when `night >= max_nights` (50). Both
flags are set when both hold (as gymnasium's TimeLimit does; the trainer lets terminated win). Flags
are [N, A], the same for every agent; every slot is always active; no trials.

Observation per agent (float32, 20 + 4A, identical for all agents; the trainer may append an agent
id): houses (10: Safe 0.5, Burning 1, Ruined 0, so "burning" is the largest value and a linear
score can single it out; see `encode_houses`), last night's signals of all agents (A: 0/1), last
night's locations of all agents (A: house / 9), last actions of all agents (2A: house / 9, mode),
scenario info (10: beta, kappa, p_ignite, A_team / 100, L_team / 100, c, min_nights / 50, A / 10, 0,
0). At reset signals and last actions are 0 and locations are the own houses.
Global state for a centralized critic (41 + 4A): houses one-hot (30), signals (A), locations (A), last
actions (2A), scenario info (10), night / max_nights (1).

info (each [N] float32, set where the episode ended, 0 elsewhere): houses_saved, houses_ruined,
nights, team_return (sum over agents of the episode's rewards).

Scripted policies (`scripted_names`): the five archetypes of docs/WORKLOADS.md plus "random" (uniform over
[10] x [2]). Baseline policy: work with probability `work_tendency * (1 - rest_bias)`; a worker goes
to its own house if it burns (with probability own_priority), else to a uniformly random burning
house (possibly its own), else it works at home (paying `-c`, as the archetype decided to work);
a non-worker rests at home (`[own house, REST]`). Only work_tendency, rest_bias and own_priority
are used: honesty has no effect because the signal *is* the mode (an agent cannot announce one
thing and do another), and the remaining parameters are carried for mixed-team experiments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from phalanx.consts import constant
from phalanx.draws import Source, uniform
from phalanx.envs import draw
from phalanx.envs.base import StepRecord, VecEnv
from phalanx.envs.registry import EnvOption, EnvSpec, register
from phalanx.envs.spaces import Box, MultiDiscrete
from phalanx.errors import ConfigError

NUM_HOUSES = 10
SAFE, BURNING, RUINED = 0, 1, 2
REST, WORK = 0, 1
REST_REWARD = 0.5
OWN_HOUSE_REWARD = 100.0
NEIGHBOUR_REWARD = 50.0
MIN_AGENTS, MAX_AGENTS = 2, 10


@dataclass(frozen=True)
class Scenario:
    beta: float  # spread probability per burning house and Safe neighbour
    kappa: float  # extinguish probability per worker
    p_ignite: float  # nightly spontaneous ignition of Safe houses
    c: float  # cost of a night's work
    min_nights: int  # no termination before this night
    rho: float = 0.2  # initial burning probability per house
    team_reward: float = 100.0  # A_team: per saved house, scaled to 10 houses
    team_penalty: float = 100.0  # L_team: per ruined house, scaled to 10 houses


SCENARIOS: dict[str, Scenario] = {
    "default": Scenario(0.25, 0.5, 0.02, 0.5, 12),
    "easy": Scenario(0.1, 0.8, 0.01, 0.5, 10),
    "hard": Scenario(0.4, 0.3, 0.05, 0.5, 15),
    "trivial_cooperation": Scenario(0.15, 0.9, 0.0, 0.5, 12, rho=0.1),
    "early_containment": Scenario(0.35, 0.6, 0.02, 0.5, 12),
    "greedy_neighbor": Scenario(0.15, 0.4, 0.02, 1.0, 12),
    "sparse_heroics": Scenario(0.1, 0.5, 0.02, 0.8, 20),
    "rest_trap": Scenario(0.05, 0.95, 0.02, 0.2, 12),
    "chain_reaction": Scenario(0.45, 0.6, 0.03, 0.7, 15, rho=0.3),
    "deceptive_calm": Scenario(0.25, 0.6, 0.05, 0.4, 20),
    "overcrowding": Scenario(0.2, 0.3, 0.02, 0.6, 12, team_reward=50.0),
    "mixed_motivation": Scenario(0.3, 0.5, 0.03, 0.6, 15),
}

ARCHETYPE_PARAMS = (
    "honesty", "work_tendency", "neighbor_help", "own_priority", "risk_aversion",
    "coordination", "exploration", "fatigue_memory", "rest_bias", "altruism",
)

ARCHETYPES: dict[str, tuple[float, ...]] = {
    "firefighter": (1.0, 0.9, 0.5, 0.8, 0.5, 0.7, 0.1, 0.0, 0.0, 0.8),
    "free_rider": (0.7, 0.2, 0.0, 0.9, 0.0, 0.0, 0.1, 0.0, 0.9, 0.0),
    "hero": (1.0, 1.0, 1.0, 0.5, 0.1, 0.5, 0.0, 0.9, 0.0, 1.0),
    "coordinator": (0.9, 0.6, 0.7, 0.6, 0.8, 1.0, 0.05, 0.0, 0.2, 0.6),
    "liar": (0.1, 0.7, 0.0, 0.9, 0.2, 0.8, 0.3, 0.0, 0.4, 0.2),
}


def archetype(name: str) -> dict[str, float]:
    """The named parameters of an archetype."""
    return dict(zip(ARCHETYPE_PARAMS, ARCHETYPES[name]))


_HOUSE_CODE = (0.5, 1.0, 0.0)  # Safe, Burning, Ruined


def encode_houses(houses: torch.Tensor) -> torch.Tensor:
    """House states -> observation values (Safe 0.5, Burning 1, Ruined 0)."""
    return constant(_HOUSE_CODE, houses.device)[houses]


def decode_houses(values: torch.Tensor) -> torch.Tensor:
    """Observation values -> house states (the inverse of `encode_houses`)."""
    return torch.where(values > 0.75, BURNING, torch.where(values < 0.25, RUINED, SAFE)).long()


def baseline_actions(
    houses: torch.Tensor, own: torch.Tensor, work_prob: float, own_priority: float, draws: Source
) -> torch.Tensor:
    """The archetype baseline policy, batched. houses [N, 10] long, own [A] long -> actions [N, A, 2].

    Work with probability `work_prob`; a worker goes to its own house if it burns (with probability
    `own_priority`), else to a uniformly random burning house, else stays home (still working).
    A non-worker rests at home.
    """
    n, a, dev = houses.shape[0], own.shape[0], houses.device
    u = uniform(draws, (n, a, 2 + NUM_HOUSES), dev)
    burning = (houses == BURNING).unsqueeze(1)  # [N, 1, 10]
    any_burning = burning.any(-1)  # [N, 1]
    own_burning = (houses[:, own] == BURNING)  # [N, A]
    # Uniform over burning houses: argmax of iid uniforms restricted to them.
    pick = torch.where(burning, u[..., 2:], -1.0).argmax(-1)  # [N, A]
    work = u[..., 0] < work_prob
    go_own = own_burning & (u[..., 1] < own_priority)
    target = torch.where(go_own, own, torch.where(any_burning, pick, own))
    house = torch.where(work, target, own)
    return torch.stack((house, work.long()), -1)


class BucketBrigadeEnv(VecEnv):
    """Batched bucket brigade (N envs, A agents); the rules and the choices are in the module docstring."""

    name = "bucket_brigade"
    renders = True
    capturable = True
    # The house only matters when working: a resting agent stays at home.
    action_space = MultiDiscrete((NUM_HOUSES, 2), gates=((0, 1, WORK),))
    role_names = ("agent",)
    scripted_names = ("firefighter", "free_rider", "hero", "coordinator", "liar", "random")

    def __init__(
        self,
        num_envs: int = 1,
        device: torch.device | str = "cpu",
        seed: int | None = 0,
        scenario: str = "default",
        num_agents: int = 4,
        outcome_reward: str = "shaped",
        legacy_phase_order: bool = False,
        max_nights: int = 50,
    ) -> None:
        if scenario not in SCENARIOS:
            raise ConfigError(f"unknown bucket_brigade scenario '{scenario}'; allowed: {', '.join(SCENARIOS)}")
        if isinstance(num_agents, bool) or not isinstance(num_agents, int) or not MIN_AGENTS <= num_agents <= MAX_AGENTS:
            raise ConfigError(f"bucket_brigade num_agents must be an integer in {MIN_AGENTS}..{MAX_AGENTS}, got {num_agents!r}")
        if outcome_reward not in ("shaped", "terminal"):
            raise ConfigError(f"bucket_brigade outcome_reward must be 'shaped' or 'terminal', got {outcome_reward!r}")
        if isinstance(max_nights, bool) or not isinstance(max_nights, int) or max_nights < 1:
            raise ConfigError(f"bucket_brigade max_nights must be a positive integer, got {max_nights!r}")
        self.num_envs = int(num_envs)
        self.num_agents = num_agents
        self.device = torch.device(device)
        self.scenario_name = scenario
        self.scenario = SCENARIOS[scenario]
        self.outcome_reward = outcome_reward
        self.legacy_phase_order = bool(legacy_phase_order)
        self.max_nights = max_nights
        a = num_agents
        self.obs_dim = 2 * NUM_HOUSES + 4 * a
        self.state_dim = 3 * NUM_HOUSES + 4 * a + NUM_HOUSES + 1
        self.observation_space = Box.uniform(0.0, 1.0, (self.obs_dim,))
        self.state_space = Box.uniform(0.0, 1.0, (self.state_dim,))
        self.roles = self.default_roles()
        dev = self.device
        self.own = torch.arange(a, device=dev) % NUM_HOUSES  # [A]
        self.left = (self.own - 1) % NUM_HOUSES
        self.right = (self.own + 1) % NUM_HOUSES
        s = self.scenario
        self.scenario_info = torch.tensor(
            [s.beta, s.kappa, s.p_ignite, s.team_reward / 100, s.team_penalty / 100, s.c, s.min_nights / 50, a / 10, 0.0, 0.0],
            dtype=torch.float32, device=dev,
        )
        self._last_scale = torch.tensor([1.0 / (NUM_HOUSES - 1), 1.0], dtype=torch.float32, device=dev)
        self._house_ids = torch.arange(NUM_HOUSES, device=dev)
        self._nvec = torch.tensor([NUM_HOUSES, 2], dtype=torch.long, device=dev)
        self._state_ids = torch.arange(3, device=dev)
        self._seed_generator(seed)
        self._new_episodes()

    def _new_episodes(self) -> None:
        """Fresh start state for every env: houses, night, signals, locations, last actions."""
        n, a, dev = self.num_envs, self.num_agents, self.device
        self.houses = self._sample_start()
        self.night = torch.zeros(n, dtype=torch.long, device=dev)
        self.signals = torch.zeros(n, a, dtype=torch.long, device=dev)
        self.locations = self.own.expand(n, a).clone()
        self.last_actions = torch.zeros(n, a, 2, dtype=torch.long, device=dev)
        self.ep_team_return = torch.zeros(n, dtype=torch.float32, device=dev)

    # --- dynamics ---------------------------------------------------------------------------------
    def _sample_start(self) -> torch.Tensor:
        n, dev = self.num_envs, self.device
        u = self.rng.rand((n, NUM_HOUSES), dev)
        fallback = self.rng.randint(0, NUM_HOUSES, (n, 1), dev)
        burning = u < self.scenario.rho
        none = ~burning.any(1, keepdim=True)
        burning = burning | (none & (self._house_ids == fallback))
        return burning.long() * BURNING

    def potential(self, houses: torch.Tensor) -> torch.Tensor:
        """Outcome potential Phi [N, A] of the houses [N, 10] for every agent (see the module docstring)."""
        s = self.scenario
        saved = (houses == SAFE).float()
        ruined = (houses == RUINED).float()
        team = (s.team_reward * saved.sum(1) - s.team_penalty * ruined.sum(1)) / NUM_HOUSES
        return (
            team.unsqueeze(1)
            + OWN_HOUSE_REWARD * saved[:, self.own]
            + NEIGHBOUR_REWARD * (saved[:, self.left] + saved[:, self.right])
        )

    def _night(self, houses: torch.Tensor, work: torch.Tensor, loc: torch.Tensor) -> torch.Tensor:
        """Phases 2-5 of a night on houses [N, 10]; returns the new houses."""
        s = self.scenario
        n = houses.shape[0]
        u = self.rng.rand((n, NUM_HOUSES, 4), self.device)
        workers = torch.zeros(n, NUM_HOUSES, dtype=torch.float32, device=self.device)
        workers.scatter_add_(1, loc, work.float())
        burning0 = houses == BURNING
        p_ext = 1.0 - (1.0 - s.kappa) ** workers
        h = torch.where(burning0 & (u[..., 0] < p_ext), SAFE, houses)
        if self.legacy_phase_order:
            h = torch.where(h == BURNING, RUINED, h)  # burn-out first: nothing is left to spread
        src = h == BURNING
        # roll(1)[j] is house j-1, roll(-1)[j] is house j+1.
        spread = (src.roll(1, 1) & (u[..., 1] < s.beta)) | (src.roll(-1, 1) & (u[..., 2] < s.beta))
        newly = (h == SAFE) & spread
        if not self.legacy_phase_order:
            h = torch.where(src, RUINED, h)  # every source was burning at the start of the night
        h = torch.where(newly, BURNING, h)
        h = torch.where((h == SAFE) & (u[..., 3] < s.p_ignite), BURNING, h)
        return h

    # --- observations -----------------------------------------------------------------------------
    def _obs(self, houses, signals, locations, last_actions) -> torch.Tensor:
        n, a = houses.shape[0], self.num_agents
        flat = torch.cat(
            (
                encode_houses(houses),
                signals.float(),
                locations.float() / (NUM_HOUSES - 1),
                (last_actions.float() * self._last_scale).reshape(n, 2 * a),
                self.scenario_info.expand(n, NUM_HOUSES),
            ),
            1,
        )
        return flat.unsqueeze(1).expand(n, a, self.obs_dim).contiguous()

    def _state(self, houses, signals, locations, last_actions, night) -> torch.Tensor:
        n, a = houses.shape[0], self.num_agents
        onehot = (houses.unsqueeze(-1) == self._state_ids).float().reshape(n, 3 * NUM_HOUSES)
        return torch.cat(
            (
                onehot,
                signals.float(),
                locations.float() / (NUM_HOUSES - 1),
                (last_actions.float() * self._last_scale).reshape(n, 2 * a),
                self.scenario_info.expand(n, NUM_HOUSES),
                (night.float() / self.max_nights).unsqueeze(1),
            ),
            1,
        )

    def _current(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            self._obs(self.houses, self.signals, self.locations, self.last_actions),
            self._state(self.houses, self.signals, self.locations, self.last_actions, self.night),
        )

    # --- protocol ---------------------------------------------------------------------------------
    def _flags(self, x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(1).expand(self.num_envs, self.num_agents).contiguous()

    def reset(self, seed: int | None = None) -> StepRecord:
        self._seed_generator(seed)
        n, a, dev = self.num_envs, self.num_agents, self.device
        self._new_episodes()
        obs, state = self._current()
        false = torch.zeros(n, a, dtype=torch.bool, device=dev)
        return StepRecord(
            obs=obs, reward=torch.zeros(n, a, dtype=torch.float32, device=dev), terminated=false,
            truncated=false.clone(), active=torch.ones(n, a, dtype=torch.bool, device=dev),
            trial_end=false.clone(), final_obs=obs, state=state, final_state=state, info={},
        )

    def step(self, actions: torch.Tensor) -> StepRecord:
        actions = self.action_space.check(actions, self.num_envs, self.num_agents)
        n, a, s = self.num_envs, self.num_agents, self.scenario
        act = actions.to(device=self.device, dtype=torch.long).reshape(n, a, 2)
        house = act[..., 0].clamp(0, NUM_HOUSES - 1)
        mode = act[..., 1].clamp(0, 1)
        act = torch.stack((house, mode), -1)
        work = mode == WORK
        loc = torch.where(work, house, self.own)
        phi_before = torch.where((self.night > 0).unsqueeze(1), self.potential(self.houses), 0.0)
        houses = self._night(self.houses, work, loc)
        night = self.night + 1
        # Fresh starts for every env, drawn every step (used only where an episode ended).
        start = self._sample_start()

        phi_after = self.potential(houses)
        all_safe = (houses == SAFE).all(1)
        all_ruined = (houses == RUINED).all(1)
        terminated = (night >= s.min_nights) & (all_safe | all_ruined)
        truncated = night >= self.max_nights
        done = terminated | truncated
        reward = torch.where(work, -s.c, REST_REWARD)
        if self.outcome_reward == "shaped":
            reward = reward + (phi_after - phi_before)
        else:
            reward = reward + torch.where(done.unsqueeze(1), phi_after, 0.0)
        team_return = self.ep_team_return + reward.sum(1)

        signals = work.long()
        final_obs = self._obs(houses, signals, loc, act)
        final_state = self._state(houses, signals, loc, act, night)
        info = {
            "houses_saved": torch.where(done, (houses == SAFE).sum(1).float(), 0.0),
            "houses_ruined": torch.where(done, (houses == RUINED).sum(1).float(), 0.0),
            "nights": torch.where(done, night.float(), 0.0),
            "team_return": torch.where(done, team_return, 0.0),
        }

        d1 = done.unsqueeze(1)
        self.houses = torch.where(d1, start, houses)
        self.night = torch.where(done, 0, night)
        self.signals = torch.where(d1, 0, signals)
        self.locations = torch.where(d1, self.own, loc)
        self.last_actions = torch.where(d1.unsqueeze(2), 0, act)
        self.ep_team_return = torch.where(done, 0.0, team_return)
        obs, state = self._current()
        return StepRecord(
            obs=obs, reward=reward, terminated=self._flags(terminated), truncated=self._flags(truncated),
            active=torch.ones(n, a, dtype=torch.bool, device=self.device),
            trial_end=torch.zeros(n, a, dtype=torch.bool, device=self.device),
            final_obs=final_obs, state=state, final_state=final_state, info=info,
        )

    # --- testing and scripted policies ------------------------------------------------------------
    def set_houses(self, houses: torch.Tensor, night: torch.Tensor | None = None) -> None:
        """Overwrite the houses [N, 10] (values SAFE / BURNING / RUINED) and optionally the nights [N].

        In "shaped" mode the next night pays Phi(after) - Phi(these houses) where night > 0 and
        Phi(after) where night == 0, as for an episode that reached these houses naturally.
        """
        self.houses = houses.to(device=self.device, dtype=torch.long).reshape(self.num_envs, NUM_HOUSES).clone()
        if night is not None:
            self.night = night.to(device=self.device, dtype=torch.long).reshape(self.num_envs).clone()

    def scripted_actions(self, name: str, record: StepRecord, draws: Source) -> torch.Tensor:
        """Actions [N, A, 2] of archetype `name` (or "random") for every slot, from the record's houses."""
        n, a = self.num_envs, self.num_agents
        if name == "random":
            u = uniform(draws, (n, a, 2), self.device)
            return (u * self._nvec).long().clamp_max(self._nvec - 1)
        if name not in ARCHETYPES:
            raise KeyError(f"env '{self.name}' has no scripted policy '{name}'; known: {', '.join(self.scripted_names)}")
        p = archetype(name)
        houses = decode_houses(record.obs[:, 0, :NUM_HOUSES])
        return baseline_actions(houses, self.own, p["work_tendency"] * (1 - p["rest_bias"]), p["own_priority"], draws)

    def step_state(self) -> dict[str, torch.Tensor]:
        return {"houses": self.houses, "night": self.night, "signals": self.signals, "locations": self.locations,
                "last_actions": self.last_actions, "ep_team_return": self.ep_team_return}

    def load_step_state(self, state: dict[str, torch.Tensor]) -> None:
        self.houses, self.night, self.signals = state["houses"], state["night"], state["signals"]
        self.locations, self.last_actions, self.ep_team_return = state["locations"], state["last_actions"], state["ep_team_return"]

    # --- rendering --------------------------------------------------------------------------------
    def render(self, env_index: int = 0) -> torch.Tensor:
        """Env `env_index` now: uint8 [256, 240, 3] on the CPU.

        The 10 houses on a ring, house 0 at the top, clockwise: green Safe, orange with a flame
        Burning, dark grey Ruined; a stripe under a house in its owner's colour. Each agent is a dot
        in its colour inside the ring at the house it stands at (last night's location): filled with a
        black rim when it WORKed last night, hollow when it RESTed. The bar at the bottom is the night
        out of `max_nights`."""
        w, h, cx, cy, radius = 240, 256, 120.0, 120.0, 92.0
        houses = self.houses[env_index].tolist()
        signals = self.signals[env_index].tolist()
        locations = self.locations[env_index].tolist()
        img = draw.canvas(h, w, (245, 242, 232))
        draw.ring(img, cx, cy, radius + 1, (215, 208, 190), width=3.0)
        body = {SAFE: (120, 180, 110), BURNING: (240, 120, 40), RUINED: (85, 75, 70)}
        roof = {SAFE: (70, 130, 70), BURNING: (200, 45, 30), RUINED: (50, 45, 40)}

        def spot(house: int, r: float) -> tuple[float, float, float]:
            a = -math.pi / 2 + 2 * math.pi * house / NUM_HOUSES
            return cx + r * math.cos(a), cy + r * math.sin(a), a

        for i, state in enumerate(houses):
            hx, hy, _ = spot(i, radius)
            draw.fill_rect(img, hx - 11, hy - 6, hx + 11, hy + 12, body[state])
            draw.fill_polygon(img, ((hx - 14, hy - 6), (hx + 14, hy - 6), (hx, hy - 19)), roof[state])
            if state == BURNING:
                draw.fill_circle(img, hx, hy - 20, 6.0, (255, 200, 50))
                draw.fill_circle(img, hx, hy - 18, 3.0, (255, 245, 180))
            elif state == RUINED:
                draw.draw_line(img, hx - 8, hy - 3, hx + 8, hy + 9, (30, 25, 20), width=2.0)
            if i < self.num_agents:
                draw.fill_rect(img, hx - 11, hy + 14, hx + 11, hy + 17, draw.slot_color(i))
        crowd = [0] * NUM_HOUSES
        for i, (loc, sig) in enumerate(zip(locations, signals)):
            k = crowd[loc]
            crowd[loc] += 1
            ax, ay, a = spot(loc, 62.0 - 12.0 * (k // 3))
            off = ((k % 3) - 1) * 12.0
            ax, ay = ax - off * math.sin(a), ay + off * math.cos(a)
            color = draw.slot_color(i)
            if sig == WORK:
                draw.fill_circle(img, ax, ay, 5.5, (20, 20, 20))
                draw.fill_circle(img, ax, ay, 4.0, color)
            else:
                draw.fill_circle(img, ax, ay, 5.5, color)
                draw.fill_circle(img, ax, ay, 3.0, (255, 255, 255))
        frac = float(self.night[env_index]) / self.max_nights
        draw.bar(img, 12, h - 16, w - 12, h - 8, frac, (60, 60, 140), back=(215, 208, 190))
        return draw.to_tensor(img)


register(
    EnvSpec(
        name="bucket_brigade",
        factory=BucketBrigadeEnv,
        description="Cooperative fire fighting on a ring of 10 houses: A agents, MultiDiscrete([10, 2]), obs 20+4A, 12 scenarios",
        options={
            "scenario": EnvOption("default", "scenario parameters (beta, kappa, p_ignite, c, min_nights, rho, team reward)", tuple(SCENARIOS)),
            "num_agents": EnvOption(4, "agents (agent i owns house i % 10)", tuple(range(MIN_AGENTS, MAX_AGENTS + 1))),
            "outcome_reward": EnvOption("shaped", "house-outcome terms: per-night potential differences or paid at the end", ("shaped", "terminal")),
            "legacy_phase_order": EnvOption(False, "burn-out before spread (the original project's bug: spread is inert)", (False, True)),
            "max_nights": EnvOption(50, "time limit in nights (episode is truncated)", min=1),
        },
        train_defaults={
            # Its published figures were measured with the value loss clipped; not yet measured without.
            "clip_vloss": True,
            # Cooperative MAPPO: a centralised critic on the global state, one shared policy that knows its
            # slot, and every agent learning from the team's mean reward (with individual rewards the
            # agents settle into free-riding: the work cost is private, the saved houses are shared).
            "total_steps": 6_000_000, "num_envs": 256, "num_steps": 32, "lr": 1e-3, "gamma": 0.8, "gae_lambda": 0.9,
            "critic": "mappo", "param_sharing": "shared_id", "norm_reward": True, "team_reward": 1.0,
        },
    )
)
