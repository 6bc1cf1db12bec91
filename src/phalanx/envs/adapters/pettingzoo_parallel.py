"""A PettingZoo `ParallelEnv` as a phalanx `VecEnv`: N copies stepped together on the host (`pz:`, see
pettingzoo.py); agents that leave become inactive slots.

pettingzoo (and gymnasium) are imported lazily, inside functions: `import phalanx` works without them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from phalanx.envs.adapters.gym import _map_action_space, _map_obs_space
from phalanx.envs.base import StepRecord, VecEnv, roles_from_agent_names
from phalanx.envs.spaces import Box, Discrete, Space
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

    Where the copies draw `rgb_array` frames (`pz:` makes them so where the env lists that render mode), `render`
    gives one copy's frame, and `ended_frame` the last frame of its episode that ended at the latest step, drawn
    before the auto-reset: a recording shows the end (a game's final position).

    Stepping is a Python loop over the copies with host copies, so this is the slow compatibility
    path, for checks and small runs. `state_dict` is empty: PettingZoo envs cannot be saved and
    restored bit-identically, so a resumed run continues with the copies' current episodes.
    """

    restorable = False  # PettingZoo envs cannot be saved: a resume goes on from their episodes

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
        self.renders = getattr(first, "render_mode", None) == "rgb_array"
        self._watched: set[int] = set()  # the copies rendered so far: their episodes' last frames are kept
        self._ended_frames: dict[int, torch.Tensor] = {}

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
            try:
                space, flatten = _map_obs_space(spaces[0])
            except ConfigError as e:  # the space's own complaint, with the env and the space it is about
                raise ConfigError(f"env 'pz:{rest}': its observation space {spaces[0]} cannot be read: {e}") from None
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

    # -- frames ----------------------------------------------------------------------------------
    def render(self, env_index: int = 0) -> torch.Tensor:
        """Copy `env_index`'s frame from PettingZoo's `render()` (render_mode rgb_array); from then on the last frame
        of each of its episodes is kept as well (`ended_frame`)."""
        if not self.renders:
            raise NotImplementedError(f"env '{self.name}' draws no rgb_array frames")
        self._watched.add(env_index)
        return self._frame(env_index)

    def ended_frame(self, env_index: int = 0) -> torch.Tensor | None:
        """The last frame of `env_index`'s episode where it ended at the latest step (drawn before the copy's
        auto-reset, once the copy has been rendered); None where its episode goes on."""
        return self._ended_frames.get(env_index)

    def _frame(self, i: int) -> torch.Tensor:
        frame = np.asarray(self.envs[i].render())
        if frame.dtype != np.uint8 or frame.ndim != 3 or frame.shape[2] != 3:
            raise EnvContractError(f"env '{self.name}' (copy {i}): render() in rgb_array mode must give uint8 frames of "
                                   f"shape [height, width, 3]; got {frame.dtype} {list(frame.shape)}")
        return torch.from_numpy(frame.copy())

    def _keep_ended_frame(self, i: int) -> None:
        """Before copy `i` auto-resets: its episode's last frame, where the copy is watched."""
        if i in self._watched:
            self._ended_frames[i] = self._frame(i)

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
        return self._reset_record(obs_buf, self._active)

    def _reset_record(self, obs_buf: np.ndarray, active: np.ndarray, action_mask: torch.Tensor | None = None) -> StepRecord:
        """The record of a reset: the first observations, nothing ended, the episode counters started afresh."""
        n, a = self.num_envs, self.num_agents
        self._ep_return[:] = 0
        self._ep_length[:] = 0
        o = self._t(obs_buf, self._obs_dtype)
        false = torch.zeros(n, a, dtype=torch.bool, device=self.device)
        st = self._states()
        state = None if st is None else self._t(st, torch.float32)
        return StepRecord(obs=o, reward=torch.zeros(n, a, device=self.device), terminated=false,
                          truncated=false.clone(), active=self._t(active, torch.bool),
                          trial_end=false.clone(), final_obs=o, state=state, final_state=state, action_mask=action_mask)

    def _step_buffers(self, obs_buf: np.ndarray) -> tuple[np.ndarray, ...]:
        """A step's host buffers, filled copy by copy: final observations, rewards, terminations, truncations, episode
        ends and final global states (None without a state space); the frames of the last step's ended episodes go."""
        n, a = self.num_envs, self.num_agents
        self._ended_frames = {}
        final_state = None if self._state_space is None else np.zeros((n, *self.state_space.shape), dtype=np.float32)
        return (np.zeros_like(obs_buf), np.zeros((n, a), dtype=np.float32), np.zeros((n, a), dtype=bool),
                np.zeros((n, a), dtype=bool), np.zeros(n, dtype=bool), final_state)

    def step(self, actions: torch.Tensor) -> StepRecord:
        actions = self.action_space.check(actions, self.num_envs, self.num_agents, values=True)
        n, a = self.num_envs, self.num_agents
        acts = actions.detach().cpu().numpy().reshape((n, a, *self.action_space.shape))
        obs_buf = np.zeros((n, a, *self._obs_shape), dtype=np.float32)
        active = np.zeros((n, a), dtype=bool)
        final_buf, reward, term, trunc, ep_done, final_state = self._step_buffers(obs_buf)
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
                self._keep_ended_frame(i)
                obs2, _ = env.reset()
                self._fill(i, obs2, list(env.agents), obs_buf)
                for ag in env.agents:
                    active[i, self._slot[ag]] = True
        self._active = active
        return self._step_record(obs_buf, reward, term, trunc, active, final_buf, final_state, ep_done)

    def _step_record(self, obs_buf: np.ndarray, reward: np.ndarray, term: np.ndarray, trunc: np.ndarray,
                     active: np.ndarray, final_buf: np.ndarray, final_state: np.ndarray | None, ep_done: np.ndarray,
                     action_mask: torch.Tensor | None = None) -> StepRecord:
        """A step's record from its host buffers (see `_step_buffers`), on the device."""
        return StepRecord(
            obs=self._t(obs_buf, self._obs_dtype),
            reward=self._t(reward, torch.float32),
            terminated=self._t(term, torch.bool),
            truncated=self._t(trunc, torch.bool),
            active=self._t(active, torch.bool),
            trial_end=torch.zeros(self.num_envs, self.num_agents, dtype=torch.bool, device=self.device),
            final_obs=self._t(final_buf, self._obs_dtype),
            state=None if final_state is None else self._t(self._states(), torch.float32),
            final_state=None if final_state is None else self._t(final_state, torch.float32),
            info=self._episode_info(ep_done),
            action_mask=action_mask,
        )

    def _episode_info(self, ep_done: np.ndarray) -> dict[str, torch.Tensor]:
        """The return and length of the episodes that ended (0 elsewhere), their counters started afresh."""
        info = {
            "episode_return": self._t(np.where(ep_done, self._ep_return, 0.0), torch.float32),
            "episode_length": self._t(np.where(ep_done, self._ep_length, 0), torch.float32),
        }
        self._ep_return[ep_done] = 0
        self._ep_length[ep_done] = 0
        return info

    def close(self) -> None:
        for env in self.envs:
            env.close()
