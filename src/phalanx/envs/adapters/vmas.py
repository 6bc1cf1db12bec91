"""VMAS scenarios as phalanx envs, named `vmas:<scenario>` (e.g. `phalanx train --env vmas:navigation`).

VMAS (the `vmas` extra) simulates a batch of multi-agent worlds as torch tensors on one device, so the
adapter builds the world on the run's device and only stacks VMAS's per-agent lists into `[N, A, ...]`
tensors: nothing goes through the host on the step path but what VMAS itself reads (see `VmasVecEnv`).
Options other than `max_steps` and `continuous_actions` are the scenario's own keyword arguments,
e.g. `--n-agents 3 --shared-rew false`; an option the scenario does not take is refused.

Every `vmas:` name trains from Phalanx's VMAS defaults (BenchMARL's batch, network and discounting, Phalanx's
optimiser settings). Six names carry BenchMARL's task settings: navigation, balance, dispersion, passage,
transport and wheel (phalanx_bench/studies/vmas_vs_benchmarl.py measures them against BenchMARL's MAPPO).
"""

from __future__ import annotations

import contextlib
import io
import warnings
from typing import Any

import torch

from phalanx.envs.base import StepRecord, VecEnv, roles_from_agent_names
from phalanx.envs.registry import EnvSpec, register, register_prefix
from phalanx.envs.spaces import Box, Discrete, Space
from phalanx.errors import ConfigError, MissingExtraError, PhalanxError, one_line

# BenchMARL's horizon for every VMAS task (its conf/task/vmas/*.yaml); VMAS's own default is no limit.
DEFAULT_MAX_STEPS = 100

# Scenarios whose batched reset (`reset_world_at(None)`) draws part of the layout once for every world
# (`torch.randperm(...).tolist()`: passage's gap and formation order, the agent order of the others), so that N worlds
# reset together are N copies of one draw. passage trained on ten gaps in 3M frames and was scored on one (issue 51).
# Phalanx resets these world by world; `independent_resets=False` takes VMAS's one call back.
ONE_DRAW_PER_BATCH = frozenset({"passage", "ball_passage", "ball_trajectory", "football", "joint_passage", "wind_flocking"})


def _require_vmas(what: str) -> Any:
    try:
        # VMAS imports gym, which prints gym-notices' several-line deprecation notice to stderr (for
        # gym-notices >= 0.1): it would stand before every one-line error and in every log.
        with contextlib.redirect_stderr(io.StringIO()):
            import vmas
    except ImportError:
        raise MissingExtraError(f"{what} needs vmas; install it with `pip install 'phalanx[vmas]'`") from None
    return vmas


def _flat(obs: torch.Tensor | dict[str, Any], n: int) -> torch.Tensor:
    """One agent's observation [N, D]: a tensor flattened, a dict's values (VMAS `dict` observations)
    flattened and concatenated in key order."""
    if isinstance(obs, dict):
        return torch.cat([_flat(obs[k], n) for k in sorted(obs)], dim=-1)
    return obs.reshape(n, -1)


class VmasVecEnv(VecEnv):
    """A VMAS scenario as a phalanx VecEnv: A = the scenario's policy agents, one slot each.

    Observations: each agent's observation flattened to a vector; where agents' sizes differ, each is
    zero-padded to the longest (a per-role model, `--param-sharing per_role`, then reads each role's
    features at fixed positions). Roles come from agent names without their `_<number>` suffix. The
    global state (`--critic mappo`) is every agent's observation concatenated, as BenchMARL's MAPPO
    critic sees it. Actions: continuous (Box over the loosest of the agents' ranges; VMAS clamps each
    agent to its own) or, with `continuous_actions=False`, one Discrete per agent (`slot_n` where the
    agents' counts differ).

    Boundaries: VMAS's `done` is per world, so every agent of a world ends together. `terminated` is the
    scenario's own end (all goals reached, the package on the ground); `truncated` is `max_steps` reached
    without it: the value bootstraps there (BenchMARL counts the time limit as a termination). Finished
    worlds are reset in one vectorised call when all of them end together (the usual case under a time
    limit); otherwise VMAS resets one world at a time (`reset_at` takes an index, not a mask), so the
    step reads the done mask once (one device sync) and loops over the finished worlds only.

    Like VMAS's own step (which checks actions with host reads), this path is not capturable. The
    worlds' physics state is not saved (`restorable = False`): a resumed run starts fresh episodes.
    """

    restorable = False
    renders = True

    def __init__(self, scenario: str, num_envs: int = 1, device: torch.device | str = "cpu", seed: int | None = 0,
                 max_steps: int = DEFAULT_MAX_STEPS, continuous_actions: bool = True, independent_resets: bool | None = None,
                 **scenario_options: Any) -> None:
        vmas = _require_vmas(f"env 'vmas:{scenario}'")
        known = sorted(set(vmas.scenarios) | set(vmas.mpe_scenarios) | set(vmas.debug_scenarios))
        if scenario not in known:
            raise ConfigError(f"unknown VMAS scenario '{scenario}'; allowed: {', '.join(known)}")
        if not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps < 1:
            raise ConfigError(f"env option 'max_steps' of 'vmas:{scenario}' must be a positive int; got {max_steps!r}")
        if not isinstance(continuous_actions, bool):
            raise ConfigError(f"env option 'continuous_actions' of 'vmas:{scenario}' must be true or false; got {continuous_actions!r}")
        if independent_resets is not None and not isinstance(independent_resets, bool):
            raise ConfigError(f"env option 'independent_resets' of 'vmas:{scenario}' must be true or false; got {independent_resets!r}")
        self.independent_resets = scenario in ONE_DRAW_PER_BATCH if independent_resets is None else independent_resets
        self.name = f"vmas:{scenario}"
        self.num_envs = num_envs
        self.device = torch.device(device)
        self.max_steps = max_steps
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                self.vmas = vmas.make_env(scenario, num_envs=num_envs, device=self.device, continuous_actions=continuous_actions,
                                          max_steps=max_steps, seed=seed, clamp_actions=True, terminated_truncated=True,
                                          **scenario_options)
            except PhalanxError:
                raise
            except Exception as e:  # a scenario refusing its options: one line, never a traceback
                raise ConfigError(f"env '{self.name}' rejected options {scenario_options}: {one_line(e)}") from None
        unused = [str(w.message) for w in caught if "not used by the scenario" in str(w.message)]
        if unused:
            raise ConfigError(f"env '{self.name}': {unused[0].split(' This will')[0]}")
        agents = self.vmas.agents
        self.num_agents = len(agents)
        self.role_names, self.roles = roles_from_agent_names([a.name for a in agents], self.device)
        self.action_space = self._plan_actions(continuous_actions)
        sizes = [_flat(o, num_envs).shape[-1] for o in self._observe()]  # make_env has reset the worlds
        self._width = max(sizes)
        self._uniform = all(s == self._width for s in sizes)
        self.observation_space = Box.uniform(float("-inf"), float("inf"), (self._width,))
        self.state_space = Box.uniform(float("-inf"), float("inf"), (self.num_agents * self._width,))
        self._continuous = continuous_actions

    def _plan_actions(self, continuous: bool) -> Space:
        spaces = [self.vmas.get_agent_action_space(a) for a in self.vmas.agents]
        if continuous:
            shapes = {tuple(s.shape) for s in spaces}
            if len(shapes) > 1:
                raise ConfigError(f"env '{self.name}': agents' action sizes differ ({sorted(shapes)}); phalanx needs one size")
            low = torch.stack([torch.as_tensor(s.low, dtype=torch.float32) for s in spaces]).amin(0)
            high = torch.stack([torch.as_tensor(s.high, dtype=torch.float32) for s in spaces]).amax(0)
            return Box(tuple(low.tolist()), tuple(high.tolist()), tuple(spaces[0].shape))
        return Discrete.per_slot(tuple(int(s.n) for s in spaces))

    def _observe(self) -> list[Any]:
        """Every agent's current observation, as VMAS lists them."""
        return self.vmas.get_from_scenario(get_observations=True, get_rewards=False, get_infos=False, get_dones=False)[0]

    def _obs(self, per_agent: list[Any]) -> torch.Tensor:
        n = self.num_envs
        flat = [_flat(o, n) for o in per_agent]
        if self._uniform:
            return torch.stack(flat, dim=1)
        out = torch.zeros(n, self.num_agents, self._width, device=self.device)
        for j, o in enumerate(flat):
            out[:, j, : o.shape[-1]] = o
        return out

    def _state(self, obs: torch.Tensor) -> torch.Tensor:
        return obs.reshape(self.num_envs, -1)

    def reset(self, seed: int | None = None) -> StepRecord:
        if self.independent_resets:  # the batched call only seeds and sets up; each world then draws its own layout
            self.vmas.reset(seed=seed, return_observations=False)
            for i in range(self.num_envs):
                self.vmas.reset_at(i, return_observations=False)
            obs = self._obs(self._observe())
        else:
            obs = self._obs(self.vmas.reset(seed=seed))
        n, a = self.num_envs, self.num_agents
        false = torch.zeros(n, a, dtype=torch.bool, device=self.device)
        state = self._state(obs)
        return StepRecord(obs=obs, reward=torch.zeros(n, a, device=self.device), terminated=false, truncated=false.clone(),
                          active=torch.ones(n, a, dtype=torch.bool, device=self.device), trial_end=false.clone(),
                          final_obs=obs, state=state, final_state=state)

    def step(self, actions: torch.Tensor) -> StepRecord:
        actions = self.action_space.check(actions, self.num_envs, self.num_agents)
        per_agent = list(actions.unbind(1)) if self._continuous else [a.unsqueeze(-1) for a in actions.unbind(1)]
        obs_list, rewards, terminated, truncated, _ = self.vmas.step(per_agent)
        n, a = self.num_envs, self.num_agents
        final_obs = self._obs(obs_list)
        term = terminated.bool()
        trunc = truncated.bool() & ~term  # an env that ends on its last allowed step ended: no bootstrap
        done = term | trunc
        finished = done.nonzero().flatten()
        obs = final_obs
        if finished.numel():
            if finished.numel() == n and not self.independent_resets:
                self.vmas.reset(return_observations=False)
            else:
                for i in finished.tolist():
                    self.vmas.reset_at(i, return_observations=False)
            fresh = self._obs(self._observe())
            obs = torch.where(done[:, None, None], fresh, final_obs)
        return StepRecord(
            obs=obs,
            reward=torch.stack([r.reshape(n) for r in rewards], dim=1).float(),  # wheel gives each agent [N, 1], the others [N]
            terminated=term[:, None].expand(n, a).clone(),
            truncated=trunc[:, None].expand(n, a).clone(),
            active=torch.ones(n, a, dtype=torch.bool, device=self.device),
            trial_end=torch.zeros(n, a, dtype=torch.bool, device=self.device),
            final_obs=final_obs,
            state=self._state(obs),
            final_state=self._state(final_obs),
        )

    def render(self, env_index: int = 0) -> torch.Tensor:
        try:
            frame = self.vmas.render(mode="rgb_array", env_index=env_index, visualize_when_rgb=False)
        except Exception as e:  # no OpenGL / display here: one line
            raise PhalanxError(f"env '{self.name}' cannot render here (VMAS's renderer needs pyglet and OpenGL): {one_line(e)}") from None
        return torch.as_tensor(frame.copy(), dtype=torch.uint8)

    def close(self) -> None:
        if self.vmas.viewer is not None:  # made by the first render
            self.vmas.viewer.close()


def _make_vmas(scenario: str, num_envs: int = 1, device: torch.device | str = "cpu", seed: int | None = 0,
               **options: Any) -> VmasVecEnv:
    return VmasVecEnv(scenario, num_envs=num_envs, device=device, seed=seed, **options)


def _task(scenario: str, settings: dict[str, Any]):
    def factory(num_envs: int = 1, device: torch.device | str = "cpu", seed: int | None = 0, **options: Any) -> VmasVecEnv:
        return VmasVecEnv(scenario, num_envs=num_envs, device=device, seed=seed, **{**settings, **options})

    factory.__doc__ = f"VMAS '{scenario}' with BenchMARL's task settings {settings} (any scenario option overrides them)"
    return factory


# Phalanx's PPO for VMAS, the defaults of every `vmas:` name (phalanx_bench/studies/vmas_vs_benchmarl.py measured them on the six
# tasks below): BenchMARL's batch of 600 worlds x 100 steps, network (256x256 tanh), MAPPO critic on all observations
# and discounting (gamma = lambda = 0.9), with fewer, larger optimisation steps than its 45 passes over 15 minibatches
# at lr 5e-5.
_VMAS_TRAIN = {
    "num_envs": 600, "num_steps": 100, "gamma": 0.9, "gae_lambda": 0.9, "hidden_sizes": [256, 256], "activation": "tanh",
    "critic": "mappo", "param_sharing": "shared", "lr": 1e-3, "num_epochs": 10, "num_minibatches": 15, "ent_coef": 0.0,
    "norm_obs": False, "norm_reward": False, "total_steps": 3_000_000,
    "clip_vloss": True,  # the benchmark's figures were measured with the value loss clipped; not yet without
}
register_prefix("vmas", _make_vmas, train_defaults=_VMAS_TRAIN)

# Per-task training defaults over _VMAS_TRAIN. dispersion's agents all start on one point and see the same observation,
# so one shared network without an agent id gives all of them the same deterministic action: they chase one food
# together (greedy return 0.145 at 720k frames, below random play's 0.305; with the id 0.570, seed 1, issue 51).
# transport pays nothing until its 50-mass package moves, and at 3M frames the greedy agents had not learned to go to
# it (0.097, seed 1; VMAS's scripted policy 4.95): it trains for BenchMARL's 10M VMAS budget. The package moves only
# under sustained full force and actions are clipped to [-1, 1]: action noise std e^1 puts 71% of draws at the limit
# (std 1: 32%), and untrained agents' pushes move the package about twice as far (0.0066 against 0.0036 of reward
# magnitude an episode, 600 worlds), the only signal it pays. Greedy, seeds 1-2: at BenchMARL's 720k frames 0.033 [0.028,
# 0.039] against std 1's 0.0063 [0.0044, 0.0081] and BenchMARL's 0.029 [0.016, 0.043]; at 10M 3.29 [1.08, 5.49]
# against std 1's 0.58 [0.29, 0.86]; hold-out seed 3, 0.51 against 0.18.
# passage's five agents stand 0.1 apart and cannot see each other: under the schema's unit action noise (std 1 on
# actions in [-1, 1]) they collide in training wherever the mean field does not, so the mean training optimises is not
# the greedy policy that is scored, and at gamma 0.9 (about 10 steps, 0.28 of the 2-wide world at top speed) a detour to
# the gap is out of sight. Greedy at 3M: -312 [-351, -272] at the shared defaults (seeds 1-2), random play -436; with
# these +82 [+39, +142] (seeds 1-3; the narrow noise alone +122 on seed 1, the discount alone -1,732 and -503, seeds 1-2).
# No agent crosses yet: they close in on their goals and stop short of the wall, out of each other's way.
_VMAS_TASK_TRAIN: dict[str, dict[str, Any]] = {"dispersion": {"param_sharing": "shared_id"},
                                                "passage": {"init_log_std": -1.0, "gamma": 0.99, "gae_lambda": 0.95},
                                                "transport": {"total_steps": 10_020_000, "init_log_std": 1.0}}

# BenchMARL's task settings (its conf/task/vmas/<task>.yaml, BenchMARL 1.5.2), so that `--env vmas:<task>` is the task
# its tables report.
for _scenario, _settings, _about in (
    ("navigation", {"n_agents": 3, "shared_rew": False, "collisions": True, "agents_with_same_goal": 1, "split_goals": False,
                    "observe_all_goals": False, "lidar_range": 0.35, "agent_radius": 0.1},
     "3 agents reach their own goals past each other (lidar); individual rewards"),
    ("balance", {"n_agents": 4, "random_package_pos_on_line": True, "package_mass": 5},
     "4 agents carry a package on a line to a goal without dropping it; shared reward"),
    ("dispersion", {"n_agents": 4, "n_food": 4, "share_reward": True, "food_radius": 0.02, "penalise_by_time": False},
     "4 agents spread out to eat 4 food items; shared reward"),
    ("passage", {"max_steps": 500, "n_passages": 1, "shared_reward": True},
     "5 agents in formation cross a wall through one gap to their goals; shared reward, 500 steps"),
    ("transport", {"n_agents": 4, "n_packages": 1, "package_width": 0.15, "package_length": 0.15, "package_mass": 50},
     "4 agents push a package 50 times their mass to a goal; shared reward"),
    ("wheel", {"n_agents": 4, "line_length": 1, "line_mass": 30, "desired_velocity": 0.05},
     "4 agents turn a heavy line about its centre at a desired angular velocity; shared reward"),
):
    register(EnvSpec(
        name=f"vmas:{_scenario}", factory=_task(_scenario, _settings),
        description=f"VMAS {_scenario} with BenchMARL's settings: {_about}; Box(2) per agent"
                    f"{'' if 'max_steps' in _settings else ', 100 steps'} (vmas extra)",
        train_defaults={**_VMAS_TRAIN, **_VMAS_TASK_TRAIN.get(_scenario, {})}, free_options=True,
    ))

__all__ = ["VmasVecEnv"]
