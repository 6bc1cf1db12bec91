"""PettingZoo interop, both ways.

* `to_pettingzoo(env, index)`: one environment of a phalanx batch as a PettingZoo `ParallelEnv`.
* `pz:<module>:<factory>`: any importable function returning a PettingZoo `ParallelEnv` or a turn-based
  `AECEnv` as a phalanx `VecEnv` over N copies, e.g. `phalanx train --env pz:mypkg.envs:make_env` (module
  `mypkg.envs`, function `make_env`), or `pz:pettingzoo.classic.tictactoe_v3:env`.

pettingzoo (and gymnasium) are imported lazily, inside functions: `import phalanx` works without them.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import torch

from phalanx.envs.adapters.gym import _map_action_space, _map_obs_space, gym_space_of
from phalanx.envs.base import StepRecord, VecEnv, roles_from_agent_names
from phalanx.envs.registry import register_prefix
from phalanx.envs.spaces import ActionError, Box, Discrete, MultiDiscrete, Space
from phalanx.errors import ConfigError, EnvContractError, MissingExtraError


def _require_pettingzoo(what: str) -> Any:
    try:
        import pettingzoo
    except ImportError:
        raise MissingExtraError(f"{what} needs pettingzoo; install it with `pip install pettingzoo`") from None
    return pettingzoo


# --------------------------------------------------------------------------------------------------
# Export: a phalanx env as a PettingZoo ParallelEnv
# --------------------------------------------------------------------------------------------------


def _agent_names(env: VecEnv) -> list[str]:
    """`f"{role_name}_{i}"`, with i counting the slots of each role (e.g. sensor_0, sensor_1, relay_0)."""
    roles = getattr(env, "roles", None)
    names = tuple(getattr(env, "role_names", ("agent",))) or ("agent",)
    role_idx = [0] * env.num_agents if roles is None else [int(r) for r in torch.as_tensor(roles).reshape(-1).tolist()]
    counts: dict[str, int] = {}
    out = []
    for r in role_idx:
        role = names[r] if 0 <= r < len(names) else f"role{r}"
        out.append(f"{role}_{counts.get(role, 0)}")
        counts[role] = counts.get(role, 0) + 1
    return out


def to_pettingzoo(env: VecEnv, index: int = 0) -> Any:
    """Environment `index` of the phalanx batch `env` as a PettingZoo `ParallelEnv`.

    Agents are named `f"{role_name}_{i}"` (i counts the slots of each role). `agents` holds the
    slots that are active and have not finished this episode. Other environments of the batch are
    stepped with action 0 (use `num_envs=1` to avoid the waste). See `PhalanxParallelEnv`.
    """
    _require_pettingzoo("to_pettingzoo")
    if not 0 <= index < env.num_envs:
        raise ConfigError(f"index {index} out of range for an env batch of {env.num_envs}")
    return _parallel_env_class()(env, index)


_PARALLEL_CLASS: type | None = None


def _parallel_env_class() -> type:
    """Build the ParallelEnv subclass on first use, so pettingzoo stays an optional import."""
    global _PARALLEL_CLASS
    if _PARALLEL_CLASS is not None:
        return _PARALLEL_CLASS
    from pettingzoo import ParallelEnv

    class PhalanxParallelEnv(ParallelEnv):
        """One env of a phalanx batch with PettingZoo's parallel API (numpy values, per-agent dicts).

        Boundary mapping: `step` returns values for the agents that acted (those in `agents`
        before the step). A slot flagged `terminated`/`truncated`, or one that went inactive
        without a flag (reported as terminated), leaves `agents` and is not re-added in this
        episode, even if the phalanx env revives it (it is then stepped with action 0). When every
        agent is gone, `agents` is empty and the returned observations are the phalanx `final_obs`
        (the auto-reset stays hidden); call `reset()` to start the next episode, which resets the
        whole phalanx batch with the given seed. A `trial_end` appears as `infos[agent]["trial_end"]`;
        the env's `info` values are copied into every agent's infos on the step the episode ends.
        """

        metadata = {"name": "phalanx", "render_modes": [], "is_parallelizable": True}

        def __init__(self, venv: VecEnv, index: int) -> None:
            self.venv = venv
            self.index = index
            self.metadata = {"name": f"phalanx_{venv.name}", "render_modes": [], "is_parallelizable": True}
            self.possible_agents = _agent_names(venv)
            self._slot = {a: i for i, a in enumerate(self.possible_agents)}
            obs_space = gym_space_of(venv.observation_space)
            act_space = gym_space_of(venv.action_space)
            # The same object per agent, every call (parallel_api_test checks identity).
            self.observation_spaces = {a: obs_space for a in self.possible_agents}
            self.action_spaces = {a: act_space for a in self.possible_agents}
            self.state_space = None if venv.state_space is None else gym_space_of(venv.state_space)
            self.agents: list[str] = []
            self._finished: set[str] = set()
            self._record: StepRecord | None = None
            self._state: np.ndarray | None = None
            self._act_space = venv.action_space

        def observation_space(self, agent: str) -> Any:
            return self.observation_spaces[agent]

        def action_space(self, agent: str) -> Any:
            return self.action_spaces[agent]

        def _np(self, t: torch.Tensor) -> np.ndarray:
            return t[self.index].detach().cpu().numpy()

        def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[dict, dict]:
            rec = self.venv.reset(seed=seed)
            self._record = rec
            self._finished = set()
            obs = self._np(rec.obs)
            active = self._np(rec.active)
            self.agents = [a for a in self.possible_agents if active[self._slot[a]]]
            self._state = None if rec.state is None else self._np(rec.state)
            return {a: obs[self._slot[a]].copy() for a in self.agents}, {a: {} for a in self.agents}

        def _actions_tensor(self, actions: dict[str, Any]) -> torch.Tensor:
            n, a_count, dev = self.venv.num_envs, self.venv.num_agents, self.venv.device
            space = self._act_space
            if isinstance(space, Discrete):
                out = torch.zeros(n, a_count, dtype=torch.long, device=dev)
            elif isinstance(space, MultiDiscrete):
                out = torch.zeros(n, a_count, len(space.nvec), dtype=torch.long, device=dev)
            else:
                low, high = space.low_tensor(dev), space.high_tensor(dev)
                # Default action: 0 clipped into the box (finite bounds only).
                default = torch.zeros(space.shape, device=dev)
                default = torch.where(torch.isfinite(low), torch.maximum(default, low), default)
                default = torch.where(torch.isfinite(high), torch.minimum(default, high), default)
                out = default.expand(n, a_count, *space.shape).clone()
            dtype = out.dtype
            for agent, act in actions.items():
                if agent not in self._slot:
                    raise KeyError(f"unknown agent {agent!r}; possible agents: {self.possible_agents}")
                if agent not in self.agents:
                    continue  # PettingZoo lets callers pass actions of finished agents; ignore them
                out[self.index, self._slot[agent]] = torch.as_tensor(np.asarray(act), dtype=dtype, device=dev).reshape(out.shape[2:])
            return out

        def step(self, actions: dict[str, Any]) -> tuple[dict, dict, dict, dict, dict]:
            if self._record is None or not self.agents:
                raise RuntimeError("step() called with no live agents; call reset() first")
            missing = [a for a in self.agents if a not in actions]
            if missing:
                raise KeyError(f"no action for live agents {missing}")
            acting = list(self.agents)
            rec = self.venv.step(self._actions_tensor(actions))
            self._record = rec
            i = self.index
            reward = self._np(rec.reward)
            term = self._np(rec.terminated)
            trunc = self._np(rec.truncated)
            active = self._np(rec.active)
            trial_end = self._np(rec.trial_end)
            obs_np, final_np = self._np(rec.obs), self._np(rec.final_obs)
            terminations, truncations = {}, {}
            for a in acting:
                s = self._slot[a]
                terminations[a] = bool(term[s]) or not (bool(trunc[s]) or bool(active[s]))
                truncations[a] = bool(trunc[s])
            # The env's episode ended: every acting slot is done (others were already inactive).
            episode_end = all(terminations[a] or truncations[a] for a in acting)
            self._finished |= {a for a in acting if terminations[a] or truncations[a]}
            if episode_end:
                self.agents = []
                observations = {a: final_np[self._slot[a]].copy() for a in acting}
                if rec.final_state is not None:
                    self._state = self._np(rec.final_state)
            else:
                self.agents = [a for a in self.possible_agents if active[self._slot[a]] and a not in self._finished]
                # Slots that just ended report their last observation (final_obs), others the new one.
                observations = {
                    a: (final_np if (terminations[a] or truncations[a]) else obs_np)[self._slot[a]].copy()
                    for a in sorted(set(acting) | set(self.agents), key=self._slot.get)
                }
                if rec.state is not None:
                    self._state = self._np(rec.state)
            infos: dict[str, dict[str, Any]] = {a: {} for a in observations}
            for a in observations:
                if trial_end[self._slot[a]]:
                    infos[a]["trial_end"] = True
            if episode_end and rec.info:
                for a in acting:
                    s = self._slot[a]
                    for k, v in rec.info.items():
                        v = v[i]
                        if v.ndim >= 1 and v.shape[0] == self.venv.num_agents:
                            v = v[s]
                        infos[a][k] = v.item() if v.numel() == 1 else v.detach().cpu().numpy()
            rewards = {a: float(reward[self._slot[a]]) if a in acting else 0.0 for a in observations}
            for a in observations:
                terminations.setdefault(a, False)
                truncations.setdefault(a, False)
            return observations, rewards, terminations, truncations, infos

        def state(self) -> np.ndarray:
            if self._state is None:
                raise NotImplementedError(f"phalanx env '{self.venv.name}' has no global state")
            return self._state.copy()

        def close(self) -> None:
            self.venv.close()

    PhalanxParallelEnv.__qualname__ = "PhalanxParallelEnv"
    _PARALLEL_CLASS = PhalanxParallelEnv
    return PhalanxParallelEnv


# --------------------------------------------------------------------------------------------------
# Import: a PettingZoo ParallelEnv factory as a phalanx VecEnv
# --------------------------------------------------------------------------------------------------


def _load_factory(rest: str) -> Any:
    if rest.count(":") != 1 or not all(rest.split(":")):
        raise ConfigError(f"env 'pz:{rest}' must be named pz:<module>:<factory> (e.g. pz:mypkg.envs:make_env)")
    module_name, attr = rest.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"env 'pz:{rest}': cannot import module '{module_name}': {str(e).splitlines()[0]}") from None
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"env 'pz:{rest}': module '{module_name}' has no '{attr}'") from None
        except ImportError as e:  # packages that load submodules lazily (pettingzoo.classic, ...)
            raise ConfigError(f"env 'pz:{rest}': cannot import '{attr}': {str(e).splitlines()[0]}") from None
    if not callable(obj):
        raise ConfigError(f"env 'pz:{rest}': '{attr}' is not callable")
    return obj


class PettingZooVecEnv(VecEnv):
    """N copies of a PettingZoo `ParallelEnv` as a phalanx VecEnv with A = len(possible_agents) slots.

    Slot j is `possible_agents[j]`; roles come from the agent names without their `_<number>`
    suffix. Agents' action spaces may differ only in the size of a Discrete space (then
    `Discrete(largest, slot_n=...)`: policies mask each slot's missing actions). Agents whose observation spaces differ (MPE's
    adversaries and agents) see their own observation flattened and zero-padded to the longest one,
    so a per-role model (`--param-sharing per_role`) reads each role's features at fixed positions.
    Where the env defines `state()` and `state_space`, the state feeds a centralized critic
    (`--critic mappo`); `final_state` is the state before an auto-reset. An agent that is
    not in the copy's `agents` is an inactive slot (obs zero-filled, reward 0, active False); its
    own end is flagged `terminated`/`truncated` on its last active step (an agent that disappears
    without a flag counts as terminated), with its last observation in `final_obs`. When no agent
    is left the copy auto-resets: `obs` is the new episode's first observation, `final_obs` the
    last one of each slot that acted. Copy i is seeded with `seed + i` at the first reset (or at
    `reset(seed)`); later episodes use each copy's own RNG.

    Stepping is a Python loop over the copies with host copies, so this is the slow compatibility
    path, for checks and small runs. `state_dict` is empty: PettingZoo envs cannot be saved and
    restored bit-identically, so a resumed run continues with the copies' current episodes.
    """

    restorable = False

    def __init__(self, rest: str, envs: list[Any], device: torch.device | str = "cpu", seed: int | None = 0) -> None:
        self.envs = envs
        first = self.envs[0]
        self.name = f"pz:{rest}"
        self.num_envs = len(envs)
        self.device = torch.device(device)
        self.agent_names: list[str] = list(first.possible_agents)
        if not self.agent_names:
            raise ConfigError(f"env 'pz:{rest}' has no possible_agents")
        self.num_agents = len(self.agent_names)
        self._slot = {a: j for j, a in enumerate(self.agent_names)}
        self._act_spaces = {a: first.action_space(a) for a in self.agent_names}
        self.action_space = self._plan_actions(rest)
        self._obs_spaces = {a: self._observation_part(first.observation_space(a)) for a in self.agent_names}
        self.observation_space, self._flatten = self._plan_observations(rest)
        self._state_space = getattr(first, "state_space", None)  # PettingZoo's optional state API
        if self._state_space is not None:
            self.state_space = Box.uniform(-np.inf, np.inf, (int(np.prod(self._state_space.shape)),))
        self.role_names, self.roles = roles_from_agent_names(self.agent_names, self.device)
        self._pending_seed = seed
        self._obs_shape = tuple(self.observation_space.shape)
        self._obs_dtype = self.observation_space.dtype
        n, a = self.num_envs, self.num_agents
        self._active = np.zeros((n, a), dtype=bool)
        self._ep_return = np.zeros(n, dtype=np.float64)
        self._ep_length = np.zeros(n, dtype=np.int64)

    def _observation_part(self, space: Any) -> Any:
        """The space of what a slot observes (a turn-based env's observation dict holds it beside its mask)."""
        return space

    def _plan_actions(self, rest: str) -> Space:
        """The shared action space; or, where agents' Discrete spaces differ in size, Discrete(largest)
        with each slot's own count (`slot_n`: policies mask the actions a slot does not have)."""
        from gymnasium import spaces as gs

        spaces = list(self._act_spaces.values())
        if all(sp == spaces[0] for sp in spaces[1:]):
            return _map_action_space(spaces[0], self.name)
        if all(isinstance(sp, gs.Discrete) for sp in spaces):
            return Discrete.per_slot(tuple(int(sp.n) for sp in spaces))
        ref = self.agent_names[0]
        differ = [a for a in self.agent_names[1:] if self._act_spaces[a] != spaces[0]]
        raise ConfigError(
            f"env 'pz:{rest}': agents' action spaces may differ only in the size of a Discrete space; {ref} has {spaces[0]} but "
            + ", ".join(f"{a} has {self._act_spaces[a]}" for a in differ)
        )

    def _plan_observations(self, rest: str) -> tuple[Box, bool]:
        """One per-slot Box for every agent: the shared space, or each agent's flattened observation
        zero-padded to the longest (bounds: the loosest over agents, 0 in the padding)."""
        from gymnasium import spaces as gs

        spaces = list(self._obs_spaces.values())
        if all(sp == spaces[0] for sp in spaces[1:]):
            space, flatten = _map_obs_space(spaces[0])
            if space.dtype not in (torch.float32, torch.uint8):  # int8 boards (PettingZoo's classic games): floats
                space = Box(space.low_tensor(), space.high_tensor(), space.shape)
            return space, flatten
        flat = {}
        for a, sp in self._obs_spaces.items():
            box = gs.flatten_space(sp)
            if not isinstance(box, gs.Box):
                raise ConfigError(f"env 'pz:{rest}': the observation space of {a} ({sp}) cannot be flattened to a Box")
            flat[a] = box
        width = max(int(np.prod(b.shape)) for b in flat.values())
        low, high = np.zeros(width), np.zeros(width)
        for b in flat.values():
            k = int(np.prod(b.shape))
            low[:k] = np.minimum(low[:k], b.low.ravel())
            high[:k] = np.maximum(high[:k], b.high.ravel())
        return Box(tuple(low.tolist()), tuple(high.tolist()), (width,)), True

    # -- conversions -----------------------------------------------------------------------------
    def _obs_one(self, agent: str, o: Any) -> np.ndarray:
        from gymnasium import spaces as gs

        if not self._flatten:
            return np.asarray(o, dtype=np.float32).reshape(self._obs_shape)
        arr = np.asarray(gs.flatten(self._obs_spaces[agent], o), dtype=np.float32).ravel()
        out = np.zeros(self._obs_shape, dtype=np.float32)
        out[: arr.size] = arr
        return out

    def _fill(self, i: int, obs: dict[str, Any], agents: list[str], out: np.ndarray) -> None:
        out[i] = 0.0
        for a in agents:
            if a in obs and a in self._slot:
                out[i, self._slot[a]] = self._obs_one(a, obs[a])

    def _states(self) -> np.ndarray | None:
        if self._state_space is None:
            return None
        return np.stack([np.asarray(env.state(), dtype=np.float32).ravel() for env in self.envs])

    def _t(self, x: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        # A copy: a record must not share memory with the adapter's buffers, which a later reset
        # overwrites in place (check_env caught the last step's `active` changing under a reset).
        return torch.from_numpy(np.array(x)).to(device=self.device, dtype=dtype)

    def _actions_for(self, env: Any, acts: np.ndarray) -> dict[str, Any]:
        return {a: self._action_of(a, acts[self._slot[a]]) for a in env.agents}

    def _action_of(self, agent: str, x: np.ndarray) -> Any:
        """Slot action `x` as `agent`'s own space takes it (a Discrete space's `start` added)."""
        from gymnasium import spaces as gs

        space = self._act_spaces[agent]
        if isinstance(space, gs.Discrete):
            return int(x) + int(space.start)
        if isinstance(space, gs.MultiDiscrete):
            return (x.astype(np.int64) + space.start).astype(space.dtype)
        return np.asarray(x, dtype=space.dtype).reshape(space.shape)

    # -- protocol --------------------------------------------------------------------------------
    def reset(self, seed: int | None = None) -> StepRecord:
        seed = self._pending_seed if seed is None else seed
        self._pending_seed = None
        n, a = self.num_envs, self.num_agents
        obs_buf = np.zeros((n, a, *self._obs_shape), dtype=np.float32)
        self._active[:] = False
        for i, env in enumerate(self.envs):
            obs, _ = env.reset(seed=None if seed is None else seed + i)
            self._fill(i, obs, list(env.agents), obs_buf)
            for ag in env.agents:
                self._active[i, self._slot[ag]] = True
        self._ep_return[:] = 0
        self._ep_length[:] = 0
        o = self._t(obs_buf, self._obs_dtype)
        false = torch.zeros(n, a, dtype=torch.bool, device=self.device)
        st = self._states()
        state = None if st is None else self._t(st, torch.float32)
        return StepRecord(obs=o, reward=torch.zeros(n, a, device=self.device), terminated=false,
                          truncated=false.clone(), active=self._t(self._active, torch.bool),
                          trial_end=false.clone(), final_obs=o, state=state, final_state=state)

    def step(self, actions: torch.Tensor) -> StepRecord:
        actions = self.action_space.check(actions, self.num_envs, self.num_agents, values=True)
        n, a = self.num_envs, self.num_agents
        acts = actions.detach().cpu().numpy().reshape((n, a, *self.action_space.shape))
        obs_buf = np.zeros((n, a, *self._obs_shape), dtype=np.float32)
        final_buf = np.zeros_like(obs_buf)
        reward = np.zeros((n, a), dtype=np.float32)
        term = np.zeros((n, a), dtype=bool)
        trunc = np.zeros((n, a), dtype=bool)
        active = np.zeros((n, a), dtype=bool)
        ep_done = np.zeros(n, dtype=bool)
        final_state = None if self._state_space is None else np.zeros((n, *self.state_space.shape), dtype=np.float32)
        for i, env in enumerate(self.envs):
            acting = list(env.agents)
            obs, rew, te, tr, _ = env.step(self._actions_for(env, acts[i]))
            if final_state is not None:
                final_state[i] = np.asarray(env.state(), dtype=np.float32).ravel()
            remaining = [ag for ag in env.agents if not (te.get(ag, False) or tr.get(ag, False))]
            # The last observation of every slot that acted (or just appeared): final_obs.
            self._fill(i, obs, list(obs), final_buf)
            for ag in acting:
                s = self._slot[ag]
                reward[i, s] = float(rew.get(ag, 0.0))
                trunc[i, s] = bool(tr.get(ag, False))
                # Gone without a flag: its end is still flagged (as a termination).
                term[i, s] = bool(te.get(ag, False)) or (ag not in remaining and not trunc[i, s])
            self._ep_return[i] += reward[i].sum()
            self._ep_length[i] += 1
            if remaining:
                for ag in remaining:
                    active[i, self._slot[ag]] = True
                # Slots that left at this step: zero obs, last observation kept in final_obs.
                obs_buf[i] = np.where(active[i].reshape(a, *(1,) * len(self._obs_shape)), final_buf[i], 0.0)
                # Inactive slots that did not act keep final_obs == obs (zeros).
                for s in range(a):
                    if not active[i, s] and self.agent_names[s] not in acting:
                        final_buf[i, s] = 0.0
            else:
                ep_done[i] = True
                for s in range(a):
                    if self.agent_names[s] not in acting:
                        final_buf[i, s] = 0.0
                obs2, _ = env.reset()
                self._fill(i, obs2, list(env.agents), obs_buf)
                for ag in env.agents:
                    active[i, self._slot[ag]] = True
        self._active = active
        info = {
            "episode_return": self._t(np.where(ep_done, self._ep_return, 0.0), torch.float32),
            "episode_length": self._t(np.where(ep_done, self._ep_length, 0), torch.float32),
        }
        self._ep_return[ep_done] = 0
        self._ep_length[ep_done] = 0
        return StepRecord(
            obs=self._t(obs_buf, self._obs_dtype),
            reward=self._t(reward, torch.float32),
            terminated=self._t(term, torch.bool),
            truncated=self._t(trunc, torch.bool),
            active=self._t(active, torch.bool),
            trial_end=torch.zeros(n, a, dtype=torch.bool, device=self.device),
            final_obs=self._t(final_buf, self._obs_dtype),
            state=None if final_state is None else self._t(self._states(), torch.float32),
            final_state=None if final_state is None else self._t(final_state, torch.float32),
            info=info,
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Empty: PettingZoo envs cannot be restored bit-identically (a resume keeps their episodes)."""
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Nothing to restore (see `state_dict`)."""

    def close(self) -> None:
        for env in self.envs:
            env.close()


class PettingZooTurnsVecEnv(PettingZooVecEnv):
    """N copies of a turn-based PettingZoo `AECEnv` (the classic games: tic-tac-toe, connect four, chess) as a
    phalanx VecEnv: one step is one move in every copy.

    Slots, roles and spaces are planned as for a ParallelEnv (agents whose spaces differ are padded the same
    way). In each copy only the slot of `agent_selection` is active, on `observe(agent)`; every other slot
    is inactive, its observation zero-filled. Where the observations are dicts holding `observation` and
    `action_mask` (PettingZoo's convention), the slot observes the `observation` and the mask becomes
    `StepRecord.action_mask` (False where an agent has fewer actions than the largest space); an inactive
    slot's row allows every action, since its action is not played. An action the mask forbids is refused
    in one line (ActionError): an illegal move is never played.

    Rewards are those of PettingZoo's `last()`: a slot's reward in a record is what `last()` returned for its
    agent when the agent came up during that step (for its next move, or for its end), i.e. its reward since
    its last move, to which it belongs (`turn_based`: it may come on another agent's turn). An agent whose
    episode ended comes up for its dead step: the adapter reads `last()` (the reward, terminated or
    truncated, and its last observation into `final_obs`) and steps it with None, within the same step.
    When no agent is left the copy auto-resets and the next game's first mover is the active slot.
    """

    turn_based = True

    def __init__(self, rest: str, envs: list[Any], device: torch.device | str = "cpu", seed: int | None = 0) -> None:
        first = envs[0]
        holds = {a: _holds_mask(first.observation_space(a)) for a in first.possible_agents}
        if any(holds.values()) and not all(holds.values()):
            raise ConfigError(f"env 'pz:{rest}': some agents' observations hold an action_mask and some do not "
                              f"({', '.join(a for a, h in holds.items() if not h)} do not); give every agent one or none")
        self._masked = bool(holds) and all(holds.values())
        self.action_masks = self._masked
        super().__init__(rest, envs, device=device, seed=seed)
        self._mask_widths = self._plan_masks(rest, first) if self._masked else {}
        n = self.num_envs
        self._turn = np.zeros(n, dtype=np.int64)  # the slot that moves next, per copy
        self._allowed: list[np.ndarray | None] = [None] * n  # its mask row
        self._seen: list[Any] = [None] * n  # its observation as PettingZoo gave it

    def _observation_part(self, space: Any) -> Any:
        return space["observation"] if self._masked else space

    def _plan_masks(self, rest: str, first: Any) -> dict[str, int]:
        """Each agent's mask width (its own action count), checked against its action space."""
        from gymnasium import spaces as gs

        if not isinstance(self.action_space, (Discrete, MultiDiscrete)):
            raise ConfigError(f"env 'pz:{rest}': observations hold an action_mask but the action space is "
                              f"{self.action_space.describe()}; masks are for Discrete and MultiDiscrete actions")
        widths = {}
        for a in self.agent_names:
            space = self._act_spaces[a]
            widths[a] = int(space.n) if isinstance(space, gs.Discrete) else int(np.sum(space.nvec))
            shape = tuple(first.observation_space(a)["action_mask"].shape)
            if shape != (widths[a],):
                raise ConfigError(f"env 'pz:{rest}': {a}'s observation space has an action_mask of shape {list(shape)}; "
                                  f"its action space {space} needs [{widths[a]}] (one entry per action)")
        return widths

    # -- one copy ------------------------------------------------------------------------------------
    def _selected(self, i: int, env: Any) -> str:
        agent = env.agent_selection
        if agent not in self._slot or agent not in env.agents:
            raise EnvContractError(f"env '{self.name}' (copy {i}) breaks PettingZoo's AEC API: agent_selection {agent!r} "
                                   f"is not one of its live agents {list(env.agents)}")
        return agent

    def _last(self, i: int, env: Any, agent: str) -> tuple[Any, float, bool, bool]:
        out = env.last()
        if not isinstance(out, tuple) or len(out) != 5:
            raise EnvContractError(f"env '{self.name}' (copy {i}) breaks PettingZoo's AEC API: last() must return "
                                   f"(observation, reward, termination, truncation, info); got {type(out).__name__}"
                                   + (f" of {len(out)}" if isinstance(out, tuple) else ""))
        obs, reward, terminated, truncated, _ = out
        try:
            reward = float(reward)
        except (TypeError, ValueError):
            raise EnvContractError(f"env '{self.name}' (copy {i}) breaks PettingZoo's AEC API: last() gave {agent} the "
                                   f"reward {reward!r}, not a number") from None
        return obs, reward, bool(terminated), bool(truncated)

    def _advance(self, i: int, env: Any, reward: np.ndarray, term: np.ndarray, trunc: np.ndarray,
                 final: np.ndarray) -> tuple[str, Any] | None:
        """After a move (or a reset): each agent that comes up adds its `last()` reward to `reward`; one whose
        episode ended is flagged, its last observation kept in `final`, and stepped with None (PettingZoo's
        dead step). -> (agent to move, its observation), or None where no agent is left."""
        for _ in range(len(self.agent_names) + 1):
            if not env.agents:
                return None
            agent = self._selected(i, env)
            obs, r, te, tr = self._last(i, env, agent)
            s = self._slot[agent]
            reward[s] += r
            if not (te or tr):
                return agent, obs
            term[s], trunc[s] = te, tr and not te
            final[s] = self._obs_one(agent, self._observed(obs))
            env.step(None)
        raise EnvContractError(f"env '{self.name}' (copy {i}) breaks PettingZoo's AEC API: the dead steps (action None) "
                               f"of its ended agents did not remove them from agents ({list(env.agents)} remain)")

    def _observed(self, obs: Any) -> Any:
        if not self._masked:
            return obs
        if not isinstance(obs, dict) or "observation" not in obs:
            raise EnvContractError(f"env '{self.name}' breaks PettingZoo's AEC API: its observation space is a dict of "
                                   f"observation and action_mask, but it observed {type(obs).__name__}")
        return obs["observation"]

    def turn_observations(self) -> list[tuple[int, Any]]:
        """Per copy, the slot to move and its observation as PettingZoo gave it (the dict with its action_mask):
        what a player written against PettingZoo reads."""
        return [(int(s), obs) for s, obs in zip(self._turn, self._seen)]

    def _take_turn(self, i: int, agent: str, obs: Any, obs_buf: np.ndarray, mask_buf: np.ndarray) -> None:
        s = self._slot[agent]
        self._turn[i] = s
        self._seen[i] = obs
        obs_buf[i, s] = self._obs_one(agent, self._observed(obs))
        if self._masked:
            row = self._mask_row(i, agent, obs["action_mask"] if isinstance(obs, dict) and "action_mask" in obs else None)
            mask_buf[i, s] = row
            self._allowed[i] = row

    def _mask_row(self, i: int, agent: str, raw: Any) -> np.ndarray:
        """`agent`'s action_mask as a bool row of the slot's mask width, checked."""
        want = self._mask_widths[agent]
        m = None if raw is None else np.asarray(raw)
        ok = m is not None and m.shape == (want,) and (m.dtype == np.bool_ or (np.issubdtype(m.dtype, np.integer)
                                                                              and bool(np.isin(m, (0, 1)).all())))
        if not ok:
            got = "no action_mask" if m is None else f"{m.dtype} {list(m.shape)}"
            raise EnvContractError(f"env '{self.name}' (copy {i}): {agent}'s observation['action_mask'] must be bool or "
                                   f"0/1 integers of shape [{want}] (one per action of {self._act_spaces[agent]}); got {got}")
        row = np.zeros(self.action_space.mask_width, dtype=bool)
        row[:want] = m.astype(bool)
        heads = self.action_space.nvec if isinstance(self.action_space, MultiDiscrete) else (self.action_space.n,)
        if not all(part.any() for part in np.split(row, np.cumsum(heads)[:-1])):
            raise EnvContractError(f"env '{self.name}' (copy {i}): {agent}'s action_mask allows no action on its turn"
                                   f"{' for some head' if len(heads) > 1 else ''}; a mask must leave the agent to move "
                                   "at least one action")
        return row

    def _refuse_illegal(self, i: int, agent: str, x: np.ndarray) -> None:
        allowed = self._allowed[i]
        if allowed is None:
            return
        space = self.action_space
        starts = np.concatenate([[0], np.cumsum(space.nvec)[:-1]]) if isinstance(space, MultiDiscrete) else np.zeros(1, np.int64)
        picked = starts + np.asarray(x, dtype=np.int64).reshape(-1)
        if not allowed[picked].all():
            legal = np.flatnonzero(allowed).tolist()
            raise ActionError(f"env '{self.name}' (copy {i}): action {np.asarray(x).tolist()} of {agent} is not allowed by "
                              f"its action_mask (allowed: {legal}{' as flat indices' if len(starts) > 1 else ''}); "
                              "an illegal move is never played")

    # -- protocol ------------------------------------------------------------------------------------
    def _buffers(self) -> tuple[np.ndarray, np.ndarray]:
        n, a = self.num_envs, self.num_agents
        obs_buf = np.zeros((n, a, *self._obs_shape), dtype=np.float32)
        mask_buf = np.ones((n, a, self.action_space.mask_width if self._masked else 0), dtype=bool)
        return obs_buf, mask_buf

    def _start(self, i: int, env: Any, seed: int | None, obs_buf: np.ndarray, mask_buf: np.ndarray) -> None:
        env.reset(seed=seed)
        scratch = np.zeros(self.num_agents), np.zeros(self.num_agents, bool), np.zeros(self.num_agents, bool)
        turn = self._advance(i, env, *scratch, np.zeros((self.num_agents, *self._obs_shape), dtype=np.float32))
        if turn is None:
            raise EnvContractError(f"env '{self.name}' (copy {i}) breaks PettingZoo's AEC API: reset() left no agent to move")
        self._take_turn(i, *turn, obs_buf, mask_buf)

    def _active_now(self) -> np.ndarray:
        active = np.zeros((self.num_envs, self.num_agents), dtype=bool)
        active[np.arange(self.num_envs), self._turn] = True
        return active

    def _mask_tensor(self, mask_buf: np.ndarray) -> torch.Tensor | None:
        return self._t(mask_buf, torch.bool) if self._masked else None

    def reset(self, seed: int | None = None) -> StepRecord:
        seed = self._pending_seed if seed is None else seed
        self._pending_seed = None
        n, a = self.num_envs, self.num_agents
        obs_buf, mask_buf = self._buffers()
        for i, env in enumerate(self.envs):
            self._start(i, env, None if seed is None else seed + i, obs_buf, mask_buf)
        self._ep_return[:] = 0
        self._ep_length[:] = 0
        o = self._t(obs_buf, self._obs_dtype)
        false = torch.zeros(n, a, dtype=torch.bool, device=self.device)
        st = self._states()
        state = None if st is None else self._t(st, torch.float32)
        return StepRecord(obs=o, reward=torch.zeros(n, a, device=self.device), terminated=false,
                          truncated=false.clone(), active=self._t(self._active_now(), torch.bool),
                          trial_end=false.clone(), final_obs=o, state=state, final_state=state,
                          action_mask=self._mask_tensor(mask_buf))

    def step(self, actions: torch.Tensor) -> StepRecord:
        actions = self.action_space.check(actions, self.num_envs, self.num_agents, values=True)
        n, a = self.num_envs, self.num_agents
        acts = actions.detach().cpu().numpy().reshape((n, a, *self.action_space.shape))
        obs_buf, mask_buf = self._buffers()
        final_buf = np.zeros_like(obs_buf)
        reward = np.zeros((n, a), dtype=np.float32)
        term = np.zeros((n, a), dtype=bool)
        trunc = np.zeros((n, a), dtype=bool)
        ep_done = np.zeros(n, dtype=bool)
        final_state = None if self._state_space is None else np.zeros((n, *self.state_space.shape), dtype=np.float32)
        for i, env in enumerate(self.envs):
            agent = self.agent_names[self._turn[i]]
            x = acts[i, self._turn[i]]
            self._refuse_illegal(i, agent, x)
            env.step(self._action_of(agent, x))
            turn = self._advance(i, env, reward[i], term[i], trunc[i], final_buf[i])
            if final_state is not None:
                final_state[i] = np.asarray(env.state(), dtype=np.float32).ravel()
            self._ep_return[i] += reward[i].sum()
            self._ep_length[i] += 1
            if turn is None:
                ep_done[i] = True
                self._start(i, env, None, obs_buf, mask_buf)
            else:
                self._take_turn(i, *turn, obs_buf, mask_buf)
        ended = (term | trunc).reshape(n, a, *(1,) * len(self._obs_shape))
        info = {
            "episode_return": self._t(np.where(ep_done, self._ep_return, 0.0), torch.float32),
            "episode_length": self._t(np.where(ep_done, self._ep_length, 0), torch.float32),
        }
        self._ep_return[ep_done] = 0
        self._ep_length[ep_done] = 0
        return StepRecord(
            obs=self._t(obs_buf, self._obs_dtype),
            reward=self._t(reward, torch.float32),
            terminated=self._t(term, torch.bool),
            truncated=self._t(trunc, torch.bool),
            active=self._t(self._active_now(), torch.bool),
            trial_end=torch.zeros(n, a, dtype=torch.bool, device=self.device),
            final_obs=self._t(np.where(ended, final_buf, obs_buf), self._obs_dtype),
            state=None if final_state is None else self._t(self._states(), torch.float32),
            final_state=None if final_state is None else self._t(final_state, torch.float32),
            info=info,
            action_mask=self._mask_tensor(mask_buf),
        )


def _holds_mask(space: Any) -> bool:
    """Whether observations of `space` are PettingZoo's dicts of `observation` and `action_mask`."""
    from gymnasium import spaces as gs

    return isinstance(space, gs.Dict) and {"observation", "action_mask"} <= set(space.spaces)


def _build(factory: Any, rest: str, options: dict[str, Any]) -> Any:
    try:
        env = factory(**options)
    except TypeError as e:
        raise ConfigError(f"env 'pz:{rest}' rejected options {options}: {str(e).splitlines()[0]}") from None
    except ImportError as e:
        raise ConfigError(f"env 'pz:{rest}' needs a missing package: {str(e).splitlines()[0]}") from None
    needs = ("possible_agents", "reset", "step", "observation_space", "action_space")
    if _is_aec(env):
        needs += ("last", "observe")  # agents and agent_selection exist from the first reset on
    missing = [k for k in needs if not hasattr(env, k)]
    if missing:
        kind = "AEC env" if _is_aec(env) else "ParallelEnv"
        raise ConfigError(f"env 'pz:{rest}': the factory returned {type(env).__name__}, not a PettingZoo {kind} "
                          f"(it has no {', '.join(missing)})")
    return env


def _is_aec(env: Any) -> bool:
    from pettingzoo import AECEnv

    return isinstance(env, AECEnv)


def _make_pz(rest: str, num_envs: int = 1, device: torch.device | str = "cpu", seed: int | None = 0,
             **options: Any) -> PettingZooVecEnv:
    """A ParallelEnv's copies step together; an AEC env's copies take turns (PettingZooTurnsVecEnv)."""
    _require_pettingzoo(f"env 'pz:{rest}'")
    factory = _load_factory(rest)
    envs = [_build(factory, rest, options) for _ in range(num_envs)]
    kind = PettingZooTurnsVecEnv if _is_aec(envs[0]) else PettingZooVecEnv
    return kind(rest, envs, device=device, seed=seed)


register_prefix("pz", _make_pz)

__all__ = ["PettingZooTurnsVecEnv", "PettingZooVecEnv", "to_pettingzoo"]
