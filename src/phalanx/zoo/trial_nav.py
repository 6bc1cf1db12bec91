"""trial_nav: multi-trial navigation with co-players (docs/WORKLOADS.md section 3).

The world (`TrialNavWorld`, one trial) is a 7 x 7 grid: a 5 x 5 room (cells 1..5 on both axes)
inside a wall with four exits in the middle of the walls: 0 N (0, 3), 1 E (3, 6), 2 S (6, 3), 3 W (3, 0).
One exit, drawn per episode, is the goal; the egos cannot see which until one stands on it.

* Egos (`num_agents`, 1..8, default 2) start on cells drawn per episode from the central 3 x 3
  block (rows and columns 2..4; egos may share a cell). Actions Discrete(5): 0 stay, 1 N (row - 1),
  2 S (row + 1), 3 E (column + 1), 4 W (column - 1); a move into the wall is a stay. Egos do not
  block each other.
* Co-players (`coplayers`, 0..4, default 1) are simulated inside the env as moving obstacles, not
  learner slots: each patrols back and forth along one row or one column of the room (axis, line and
  phase drawn per episode), one cell per step, and replays the same patrol in every trial. They are
  soft obstacles: an active ego that ends a step on a co-player's cell pays `-0.05` (the move still
  happens), so whatever the co-players do, every exit stays reachable in time.
* Reward per active ego and step: `-0.01`, `+1` on the step it reaches the goal exit, `-0.05` per
  co-player collision. An ego on the goal is parked (inactive, reward 0) until the trial ends;
  non-goal exits are ordinary cells.
* Timing (default `max_trial_steps` L = 7): from any start cell every exit is at most 5 steps away,
  while visiting two exits takes at least 2 + 6 = 8 steps (exits are 6 apart). So within a trial an
  ego can check exactly one exit: a memoryless ego guesses (1 in 4; with teammates watching each
  other's parking a memoryless team can do a little better, about 3/8 per ego with 2 egos), while an
  ego that remembers the goal from an earlier trial reaches it in every later trial. A larger L
  makes several exits reachable per trial (and the task easier without memory).

The world is a pure function of the episode seed (a counter-based hash evaluated with tensor ops,
exact on every device: no generator, no Python loop over envs), so `reset_envs(mask, seeds)`
rebuilds the bit-identical world — goal, starts, co-player patrols — at every trial start.

Observation per ego (49 + 2 (A - 1) + 2 C + 1): own position one-hot over the 7 x 7 grid, the other
egos' positions (row / 6, column / 6, in slot order), the co-players' positions (same scale), and
whether this ego found the goal in this trial (it is then parked on it). Not which exit is the goal.
The registered env (`MultiTrialEnv`) appends the trial one-hot, the time in the trial and the
previous-trial success bit (see trials.py).
Global state (privileged, for a centralized critic; 3A + 2C + 4): all egos' positions, parked flags,
co-players' positions and the goal exit one-hot.

Scripted policies (`scripted_names`): "random" (uniform over the 5 actions); "sweep" (ego i heads
for exit i mod 4, then the next exits in the order N, E, S, W; memoryless: it restarts every trial, so
its score is the same in every trial); "remember" (a memory baseline: sweep, but it skips exits it
already visited in earlier trials of this episode and goes straight to the goal once it has found
it: 1/4, 1/2, 3/4, 1 in trials 0..3); "oracle" (straight to the goal; for tests). Navigation: to an
exit in the N / S wall move along the row to its column first, then through it (E / W: column
first), which is a shortest path in the open room. The "remember" policy keeps its memory in the
world (exits visited and goal found per ego, cleared when a reset brings a new episode seed).
"""

from __future__ import annotations

import torch

from phalanx.draws import Source, integers
from phalanx.envs import draw
from phalanx.envs.base import StepRecord, VecEnv
from phalanx.envs.registry import EnvOption, EnvSpec, register
from phalanx.envs.spaces import Box, Discrete
from phalanx.envs.trials import MAX_TRIALS, MultiTrialEnv
from phalanx.errors import ConfigError

ROOM = 5  # interior cells 1..ROOM on both axes
GRID = ROOM + 2
MID = (ROOM + 1) // 2
DOORS = ((0, MID), (MID, GRID - 1), (GRID - 1, MID), (MID, 0))  # N, E, S, W
NUM_DOORS = len(DOORS)
# Action deltas (row, column): stay, N, S, E, W.
DELTAS = ((0, 0), (-1, 0), (1, 0), (0, 1), (0, -1))
STAY, NORTH, SOUTH, EAST, WEST = range(5)
START_SIDE = 3  # starts are drawn from the central START_SIDE x START_SIDE block
STEP_PENALTY = -0.01
GOAL_REWARD = 1.0
COLLISION_PENALTY = 0.05
PATROL_PERIOD = 2 * (ROOM - 1)
MAX_AGENTS, MAX_COPLAYERS = 8, 4
DEFAULT_TRIAL_STEPS = 7
MAX_TRIAL_STEPS = 100

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32), without int64 overflow."""
    hi = (((x >> 16) * c) & 0xFFFF) << 16
    return (hi + (x & 0xFFFF) * c) & _M32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """The lowbias32 integer hash on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seed_draws(seeds: torch.Tensor, count: int) -> torch.Tensor:
    """`count` 32-bit draws [N, count] (int64 in [0, 2**32)) that depend only on each seed [N] (>= 0)."""
    seeds = seeds.long()
    key = hash32((seeds & _M32) ^ hash32((seeds >> 32) ^ 0x9E3779B9))
    ctr = hash32(torch.arange(1, count + 1, device=seeds.device, dtype=torch.long) * 0x9E3779B9 & _M32)
    return hash32(hash32(key.unsqueeze(1) ^ ctr) ^ key.unsqueeze(1))


class TrialNavWorld(VecEnv):
    """One trial of trial_nav (the `MultiTrialEnv` inner protocol); the rules are in the module docstring."""

    name = "trial_nav_world"
    renders = True
    action_space = Discrete(5)
    role_names = ("ego",)
    scripted_names = ("random", "sweep", "remember", "oracle")

    def __init__(self, num_envs: int = 1, device: torch.device | str = "cpu", num_agents: int = 2, coplayers: int = 1) -> None:
        if isinstance(num_agents, bool) or not isinstance(num_agents, int) or not 1 <= num_agents <= MAX_AGENTS:
            raise ConfigError(f"trial_nav num_agents must be an integer in 1..{MAX_AGENTS}, got {num_agents!r}")
        if isinstance(coplayers, bool) or not isinstance(coplayers, int) or not 0 <= coplayers <= MAX_COPLAYERS:
            raise ConfigError(f"trial_nav coplayers must be an integer in 0..{MAX_COPLAYERS}, got {coplayers!r}")
        self.num_envs = int(num_envs)
        self.num_agents = num_agents
        self.num_coplayers = coplayers
        self.device = dev = torch.device(device)
        a, c = num_agents, coplayers
        self.obs_dim = GRID * GRID + 2 * (a - 1) + 2 * c + 1
        self.state_dim = 3 * a + 2 * c + NUM_DOORS
        self.observation_space = Box.uniform(0.0, 1.0, (self.obs_dim,))
        self.state_space = Box.uniform(0.0, 1.0, (self.state_dim,))
        self.roles = self.default_roles()
        self.doors = torch.tensor(DOORS, dtype=torch.long, device=dev)  # [4, 2]
        self.deltas = torch.tensor(DELTAS, dtype=torch.long, device=dev)  # [5, 2]
        others = [[b for b in range(a) if b != i] for i in range(a)]
        self._others = torch.tensor(others, dtype=torch.long, device=dev).reshape(a, a - 1)
        self._cells = torch.arange(GRID * GRID, device=dev)
        self._door_ids = torch.arange(NUM_DOORS, device=dev)
        self._order = (torch.arange(a, device=dev).unsqueeze(1) + self._door_ids) % NUM_DOORS  # [A, 4] sweep order
        n = self.num_envs
        self.seeds = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.goal = torch.zeros(n, dtype=torch.long, device=dev)
        self.start = torch.full((n, a, 2), MID, dtype=torch.long, device=dev)
        self.pos = self.start.clone()
        self.parked = torch.zeros(n, a, dtype=torch.bool, device=dev)
        self.t = torch.zeros(n, dtype=torch.long, device=dev)
        self.patrol = torch.zeros(n, c, 3, dtype=torch.long, device=dev)  # axis, line, phase
        # Memory of the scripted policies (not visible to learners).
        self.visited_trial = torch.zeros(n, a, NUM_DOORS, dtype=torch.bool, device=dev)
        self.visited_episode = torch.zeros(n, a, NUM_DOORS, dtype=torch.bool, device=dev)
        self.known_goal = torch.zeros(n, a, dtype=torch.bool, device=dev)

    # --- the world ---------------------------------------------------------------------------------
    def world(self, seeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The world of each seed [N]: goal exit [N], ego starts [N, A, 2], co-player patrols [N, C, 3]."""
        a, c = self.num_agents, self.num_coplayers
        u = seed_draws(seeds.to(self.device), 1 + a + 3 * c)
        goal = u[:, 0] % NUM_DOORS
        cell = u[:, 1:1 + a] % (START_SIDE * START_SIDE)
        lo = MID - START_SIDE // 2
        start = torch.stack((lo + cell // START_SIDE, lo + cell % START_SIDE), -1)
        p = u[:, 1 + a:].reshape(u.shape[0], c, 3)
        patrol = torch.stack((p[..., 0] % 2, 1 + p[..., 1] % ROOM, p[..., 2] % PATROL_PERIOD), -1)
        return goal, start, patrol

    def coplayer_pos(self, t: torch.Tensor | None = None) -> torch.Tensor:
        """Co-player cells [N, C, 2] at step `t` [N] of the trial (default: now)."""
        t = self.t if t is None else t
        q = (self.patrol[..., 2] + t.unsqueeze(1)) % PATROL_PERIOD
        along = 1 + torch.where(q < ROOM - 1, q, PATROL_PERIOD - q)
        line = self.patrol[..., 1]
        row_patrol = self.patrol[..., 0] == 0  # fixed row, moving along the columns
        return torch.stack((torch.where(row_patrol, line, along), torch.where(row_patrol, along, line)), -1)

    def _on_doors(self, pos: torch.Tensor) -> torch.Tensor:
        return (pos.unsqueeze(-2) == self.doors).all(-1)  # [N, A, 4]

    def _obs(self) -> torch.Tensor:
        n, a, c = self.num_envs, self.num_agents, self.num_coplayers
        flat = self.pos[..., 0] * GRID + self.pos[..., 1]  # [N, A]
        onehot = (flat.unsqueeze(-1) == self._cells).float()  # [N, A, 49]
        norm = self.pos.float() / (GRID - 1)
        others = norm[:, self._others].reshape(n, a, 2 * (a - 1))
        cop = (self.coplayer_pos().float() / (GRID - 1)).reshape(n, 1, 2 * c).expand(n, a, 2 * c)
        return torch.cat((onehot, others, cop, self.parked.float().unsqueeze(-1)), -1)

    def _state(self) -> torch.Tensor:
        n = self.num_envs
        return torch.cat(
            (
                (self.pos.float() / (GRID - 1)).reshape(n, -1),
                self.parked.float(),
                (self.coplayer_pos().float() / (GRID - 1)).reshape(n, -1),
                (self.goal.unsqueeze(1) == self._door_ids).float(),
            ),
            1,
        )

    # --- MultiTrialEnv protocol --------------------------------------------------------------------
    def reset_envs(self, mask: torch.Tensor, seeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rebuild the world of the masked envs [N] from their seeds [N]; returns (obs, state) of every env."""
        mask = mask.to(self.device).bool()
        seeds = seeds.to(device=self.device, dtype=torch.long)
        goal, start, patrol = self.world(seeds)
        m1, m2, m3 = mask.unsqueeze(1), mask.view(-1, 1, 1), mask.view(-1, 1, 1)
        new_ep = mask & (seeds != self.seeds)
        self.goal = torch.where(mask, goal, self.goal)
        self.start = torch.where(m2, start, self.start)
        self.pos = torch.where(m2, start, self.pos)
        self.patrol = torch.where(m3, patrol, self.patrol)
        self.parked = self.parked & ~m1
        self.t = torch.where(mask, 0, self.t)
        ne3 = new_ep.view(-1, 1, 1)
        self.visited_episode = torch.where(m3, (self.visited_episode | self.visited_trial) & ~ne3, self.visited_episode)
        self.visited_trial = self.visited_trial & ~m3
        self.known_goal = self.known_goal & ~new_ep.unsqueeze(1)
        self.seeds = torch.where(mask, seeds, self.seeds)
        return self._obs(), self._state()

    def reset(self, seed: int | None = None) -> StepRecord:
        """Standalone use (tests): all envs to the worlds of seeds `seed + i`."""
        n, a, dev = self.num_envs, self.num_agents, self.device
        base = 0 if seed is None else int(seed)
        obs, state = self.reset_envs(torch.ones(n, dtype=torch.bool, device=dev), base + torch.arange(n, device=dev))
        false = torch.zeros(n, a, dtype=torch.bool, device=dev)
        return StepRecord(
            obs=obs, reward=torch.zeros(n, a, device=dev), terminated=false, truncated=false.clone(),
            active=~self.parked, trial_end=false.clone(), final_obs=obs, state=state, final_state=state,
        )

    def step(self, actions: torch.Tensor) -> StepRecord:
        n, a = self.num_envs, self.num_agents
        active = ~self.parked
        act = actions.to(device=self.device, dtype=torch.long).reshape(n, a).clamp(0, len(DELTAS) - 1)
        new = self.pos + self.deltas[act]
        inside = ((new >= 1) & (new <= ROOM)).all(-1)
        on_doors = self._on_doors(new)
        move = active & (inside | on_doors.any(-1))
        self.pos = torch.where(move.unsqueeze(-1), new, self.pos)
        self.t = self.t + 1
        on_doors = self._on_doors(self.pos) & active.unsqueeze(-1)
        self.visited_trial = self.visited_trial | on_doors
        at_goal = on_doors.gather(2, self.goal.view(n, 1, 1).expand(n, a, 1)).squeeze(2)
        hit = (self.pos.unsqueeze(2) == self.coplayer_pos().unsqueeze(1)).all(-1).any(-1) & active
        reward = torch.where(active, STEP_PENALTY + GOAL_REWARD * at_goal.float() - COLLISION_PENALTY * hit.float(), 0.0)
        self.known_goal = self.known_goal | at_goal
        self.parked = self.parked | at_goal
        obs, state = self._obs(), self._state()
        false = torch.zeros(n, a, dtype=torch.bool, device=self.device)
        return StepRecord(
            obs=obs, reward=reward, terminated=at_goal, truncated=false, active=~self.parked,
            trial_end=false.clone(), final_obs=obs, state=state, final_state=state,
            info={"collisions": hit.float().sum(1)},
        )

    # --- scripted policies -------------------------------------------------------------------------
    def _first_unvisited(self, visited: torch.Tensor) -> torch.Tensor:
        """Per ego the first exit in its sweep order not in `visited` [N, A, 4] (the goal if none)."""
        n, a = self.num_envs, self.num_agents
        order = self._order.expand(n, a, NUM_DOORS)
        free = ~visited.gather(2, order)
        first = order.gather(2, free.float().argmax(-1, keepdim=True)).squeeze(2)
        return torch.where(free.any(-1), first, self.goal.unsqueeze(1).expand(n, a))

    def navigate(self, target: torch.Tensor) -> torch.Tensor:
        """Actions [N, A] moving each ego one step along a shortest path to exit `target` [N, A]."""
        tgt = self.doors[target]  # [N, A, 2]
        dr = tgt[..., 0] - self.pos[..., 0]
        dc = tgt[..., 1] - self.pos[..., 1]
        ns_door = (target % 2) == 0  # an exit in the N / S wall: align the column first
        step_r = torch.where(dr < 0, NORTH, SOUTH)
        step_c = torch.where(dc < 0, WEST, EAST)
        act = torch.where(
            ns_door,
            torch.where(dc != 0, step_c, step_r),
            torch.where(dr != 0, step_r, step_c),
        )
        return torch.where((dr == 0) & (dc == 0), STAY, act)

    def scripted_actions(self, name: str, record: StepRecord, draws: Source) -> torch.Tensor:
        n, a = self.num_envs, self.num_agents
        if name == "random":
            return integers(draws, 0, len(DELTAS), (n, a), self.device)
        if name == "oracle":
            return self.navigate(self.goal.unsqueeze(1).expand(n, a))
        if name == "sweep":
            return self.navigate(self._first_unvisited(self.visited_trial))
        if name == "remember":
            target = self._first_unvisited(self.visited_trial | self.visited_episode)
            return self.navigate(torch.where(self.known_goal, self.goal.unsqueeze(1), target))
        raise KeyError(f"env '{self.name}' has no scripted policy '{name}'; known: {', '.join(self.scripted_names)}")

    # --- checkpoints -------------------------------------------------------------------------------
    def step_state(self) -> dict[str, torch.Tensor]:
        return {"seeds": self.seeds, "goal": self.goal, "start": self.start, "pos": self.pos, "parked": self.parked,
                "t": self.t, "patrol": self.patrol, "visited_trial": self.visited_trial,
                "visited_episode": self.visited_episode, "known_goal": self.known_goal}

    def load_step_state(self, state: dict[str, torch.Tensor]) -> None:
        self.seeds, self.goal, self.start, self.pos = state["seeds"], state["goal"], state["start"], state["pos"]
        self.parked, self.t, self.patrol = state["parked"], state["t"], state["patrol"]
        self.visited_trial, self.visited_episode, self.known_goal = (state["visited_trial"], state["visited_episode"],
                                                                     state["known_goal"])

    # --- rendering ---------------------------------------------------------------------------------
    def render(self, env_index: int = 0) -> torch.Tensor:
        """Top view of env `env_index`'s grid now: uint8 [224, 224, 3] on the CPU (32 px a cell).

        Walls dark, floor light; the exits tan, the goal exit green (the egos cannot see which);
        co-players dark red diamonds on a faint line along their patrol; egos discs in their slot
        colours (several on one cell share it), a parked ego (on the goal) with a gold rim."""
        cell = 32
        size = GRID * cell
        img = draw.canvas(size, size, (80, 82, 92))
        draw.fill_rect(img, cell, cell, (GRID - 1) * cell, (GRID - 1) * cell, (236, 234, 224))
        for r in range(1, GRID):
            draw.fill_rect(img, cell, r * cell, (GRID - 1) * cell, r * cell + 1, (218, 215, 203))
            draw.fill_rect(img, r * cell, cell, r * cell + 1, (GRID - 1) * cell, (218, 215, 203))
        goal = int(self.goal[env_index])
        for d, (r, c) in enumerate(DOORS):
            color = (90, 190, 90) if d == goal else (205, 185, 135)
            draw.fill_rect(img, c * cell + 1, r * cell + 1, (c + 1) * cell - 1, (r + 1) * cell - 1, color)
        lo, hi = 1.5 * cell, (GRID - 1.5) * cell
        for axis, line, _ in self.patrol[env_index].tolist():
            mid = (line + 0.5) * cell
            if axis == 0:  # a fixed row
                draw.draw_line(img, lo, mid, hi, mid, (225, 170, 165), width=3.0)
            else:
                draw.draw_line(img, mid, lo, mid, hi, (225, 170, 165), width=3.0)
        for r, c in self.coplayer_pos()[env_index].tolist():
            x, y, e = (c + 0.5) * cell, (r + 0.5) * cell, 0.4 * cell
            draw.fill_polygon(img, ((x, y - e), (x + e, y), (x, y + e), (x - e, y)), (150, 30, 40))
        pos = self.pos[env_index].tolist()
        parked = self.parked[env_index].tolist()
        share: dict[tuple[int, int], list[int]] = {}
        for i, (r, c) in enumerate(pos):
            share.setdefault((r, c), []).append(i)
        for (r, c), slots in share.items():
            m = len(slots)
            side = 1 if m == 1 else 2 if m <= 4 else 3
            sub = cell / side
            rad = 0.36 * sub if m == 1 else 0.42 * sub
            for k, i in enumerate(slots):
                x = c * cell + (k % side + 0.5) * sub
                y = r * cell + (k // side + 0.5) * sub
                if parked[i]:
                    draw.fill_circle(img, x, y, rad + 2.5, (240, 190, 20))
                draw.fill_circle(img, x, y, rad, draw.slot_color(i))
        return draw.to_tensor(img)


class TrialNavEnv(MultiTrialEnv):
    """trial_nav: `TrialNavWorld` played for `trials` trials per episode (see the module docstring)."""

    capturable = True

    def __init__(
        self,
        num_envs: int = 1,
        device: torch.device | str = "cpu",
        seed: int | None = 0,
        trials: int = 4,
        num_agents: int = 2,
        coplayers: int = 1,
        max_trial_steps: int = DEFAULT_TRIAL_STEPS,
    ) -> None:
        if isinstance(max_trial_steps, bool) or not isinstance(max_trial_steps, int) or not 1 <= max_trial_steps <= MAX_TRIAL_STEPS:
            raise ConfigError(f"trial_nav max_trial_steps must be an integer in 1..{MAX_TRIAL_STEPS}, got {max_trial_steps!r}")
        world = TrialNavWorld(num_envs, device, num_agents=num_agents, coplayers=coplayers)
        super().__init__(world, trials=trials, max_trial_steps=max_trial_steps, seed=seed, name="trial_nav")


register(
    EnvSpec(
        name="trial_nav",
        factory=TrialNavEnv,
        description="Multi-trial navigation: k trials of one 5x5 room with 4 exits (one hidden goal), A egos, scripted co-players; Discrete(5)",
        options={
            "trials": EnvOption(4, "trials per episode (the world replays identically in each)", tuple(range(1, MAX_TRIALS + 1))),
            "num_agents": EnvOption(2, "ego agents (learner slots)", tuple(range(1, MAX_AGENTS + 1))),
            "coplayers": EnvOption(1, "scripted co-players patrolling the room (moving obstacles, replayed every trial)", tuple(range(MAX_COPLAYERS + 1))),
            "max_trial_steps": EnvOption(DEFAULT_TRIAL_STEPS, f"steps per trial (timeout L, 1..{MAX_TRIAL_STEPS}; 7 lets an ego check one exit per trial)",
                                             min=1, max=MAX_TRIAL_STEPS),
        },
        # A transformer over the episode (4 trials x 7 steps fits its 32-step horizon), one shared policy
        # that knows which ego it is (so the egos can split the exits in trial 0); each rollout covers two
        # whole episodes. Greedy trial scores after 2.5M steps: 0.25, 0.70, 0.91, 1.0 (an MLP: flat).
        train_defaults={
            # Its published figures were measured with the value loss clipped; not yet measured without.
            "clip_vloss": True,
            "model": "transformer", "param_sharing": "shared_id", "total_steps": 2_500_000, "num_envs": 64,
            "num_steps": 56, "num_minibatches": 4, "lr": 1e-3, "ent_coef": 0.01,
        },
    )
)
