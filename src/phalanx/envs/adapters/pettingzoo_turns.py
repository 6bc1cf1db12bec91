"""A turn-based PettingZoo `AECEnv` as a phalanx `VecEnv` (`pz:`, see pettingzoo.py): the agent to move is the one
active slot, the `action_mask` of its observation dict (or else of its info) the record's mask, rewards credited as
PettingZoo's `last()` says.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from phalanx.envs.adapters.pettingzoo_parallel import PettingZooVecEnv
from phalanx.envs.base import StepRecord
from phalanx.envs.spaces import ActionError, Discrete, MultiDiscrete
from phalanx.errors import ConfigError, EnvContractError


class PettingZooTurnsVecEnv(PettingZooVecEnv):
    """N copies of a turn-based PettingZoo `AECEnv` (the classic games: tic-tac-toe, connect four, chess) as a
    phalanx VecEnv: one step is one move in every copy.

    Slots, roles and spaces are planned as for a ParallelEnv (agents whose spaces differ are padded the same
    way). In each copy only the slot of `agent_selection` is active, on `observe(agent)`; every other slot
    is inactive, its observation zero-filled. Where the observations are dicts holding `observation` and
    `action_mask` (PettingZoo's convention), the slot observes the `observation` and the mask becomes
    `StepRecord.action_mask` (False where an agent has fewer actions than the largest space); where they hold none
    and the first mover's info does (`infos[agent]["action_mask"]`), every mover's info's mask is; an inactive
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
        self._mask_in_obs = bool(holds) and all(holds.values())
        super().__init__(rest, envs, device=device, seed=seed)
        # Where the observations hold none, the convention some envs follow instead: infos[agent]["action_mask"].
        self._mask_in_info = not self._mask_in_obs and self._info_holds_mask(first, seed)
        self._masked = self.action_masks = self._mask_in_obs or self._mask_in_info
        self._mask_widths = self._plan_masks(rest, first) if self._masked else {}
        n = self.num_envs
        self._turn = np.zeros(n, dtype=np.int64)  # the slot that moves next, per copy
        self._allowed: list[np.ndarray | None] = [None] * n  # its mask row
        self._seen: list[Any] = [None] * n  # its observation as PettingZoo gave it

    def _observation_part(self, space: Any) -> Any:
        return space["observation"] if self._mask_in_obs else space

    def _info_holds_mask(self, first: Any, seed: int | None) -> bool:
        """Whether the first mover's info holds an action_mask, seen at a reset of the first copy (the trainer and a
        loaded policy read `action_masks` before the first reset; `reset` gives the copy the same seed again)."""
        first.reset(seed=seed)
        info = self._last(0, first, self._selected(0, first))[4]
        return isinstance(info, dict) and "action_mask" in info

    def _plan_masks(self, rest: str, first: Any) -> dict[str, int]:
        """Each agent's mask width (its own action count), checked against its action space."""
        from gymnasium import spaces as gs

        if not isinstance(self.action_space, (Discrete, MultiDiscrete)):
            raise ConfigError(f"env 'pz:{rest}': {self._mask_source}s hold an action_mask but the action space is "
                              f"{self.action_space.describe()}; masks are for Discrete and MultiDiscrete actions")
        widths = {}
        for a in self.agent_names:
            space = self._act_spaces[a]
            widths[a] = int(space.n) if isinstance(space, gs.Discrete) else int(np.sum(space.nvec))
            if not self._mask_in_obs:
                continue  # an info's mask has no space: its shape is checked on each turn
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

    @property
    def _mask_source(self) -> str:
        return "observation" if self._mask_in_obs else "info"

    def _last(self, i: int, env: Any, agent: str) -> tuple[Any, float, bool, bool, Any]:
        out = env.last()
        if not isinstance(out, tuple) or len(out) != 5:
            raise EnvContractError(f"env '{self.name}' (copy {i}) breaks PettingZoo's AEC API: last() must return "
                                   f"(observation, reward, termination, truncation, info); got {type(out).__name__}"
                                   + (f" of {len(out)}" if isinstance(out, tuple) else ""))
        obs, reward, terminated, truncated, info = out
        try:
            reward = float(reward)
        except (TypeError, ValueError):
            raise EnvContractError(f"env '{self.name}' (copy {i}) breaks PettingZoo's AEC API: last() gave {agent} the "
                                   f"reward {reward!r}, not a number") from None
        return obs, reward, bool(terminated), bool(truncated), info

    def _advance(self, i: int, env: Any, reward: np.ndarray, term: np.ndarray, trunc: np.ndarray,
                 final: np.ndarray) -> tuple[str, Any, Any] | None:
        """After a move (or a reset): each agent that comes up adds its `last()` reward to `reward`; one whose
        episode ended is flagged, its last observation kept in `final`, and stepped with None (PettingZoo's
        dead step). -> (agent to move, its observation, its info), or None where no agent is left."""
        for _ in range(len(self.agent_names) + 1):
            if not env.agents:
                return None
            agent = self._selected(i, env)
            obs, r, te, tr, info = self._last(i, env, agent)
            s = self._slot[agent]
            reward[s] += r
            if not (te or tr):
                return agent, obs, info
            term[s], trunc[s] = te, tr and not te
            final[s] = self._obs_one(agent, self._observed(obs))
            env.step(None)
        raise EnvContractError(f"env '{self.name}' (copy {i}) breaks PettingZoo's AEC API: the dead steps (action None) "
                               f"of its ended agents did not remove them from agents ({list(env.agents)} remain)")

    def _observed(self, obs: Any) -> Any:
        if not self._mask_in_obs:
            return obs
        if not isinstance(obs, dict) or "observation" not in obs:
            raise EnvContractError(f"env '{self.name}' breaks PettingZoo's AEC API: its observation space is a dict of "
                                   f"observation and action_mask, but it observed {type(obs).__name__}")
        return obs["observation"]

    def turn_observations(self) -> list[tuple[int, Any]]:
        """Per copy, the slot to move and its observation as PettingZoo gave it (the dict with its action_mask; where
        the env puts the mask in the info, the dict of the observation and that mask): what a player written against
        PettingZoo reads."""
        return [(int(s), obs) for s, obs in zip(self._turn, self._seen)]

    def _take_turn(self, i: int, agent: str, obs: Any, info: Any, obs_buf: np.ndarray, mask_buf: np.ndarray) -> None:
        s = self._slot[agent]
        self._turn[i] = s
        self._seen[i] = obs
        obs_buf[i, s] = self._obs_one(agent, self._observed(obs))
        if self._masked:
            holder = obs if self._mask_in_obs else info
            raw = holder["action_mask"] if isinstance(holder, dict) and "action_mask" in holder else None
            row = self._mask_row(i, agent, raw)
            mask_buf[i, s] = row
            self._allowed[i] = row
            if self._mask_in_info:
                self._seen[i] = {"observation": obs, "action_mask": raw}

    def _mask_row(self, i: int, agent: str, raw: Any) -> np.ndarray:
        """`agent`'s action_mask as a bool row of the slot's mask width, checked."""
        want = self._mask_widths[agent]
        m = None if raw is None else np.asarray(raw)
        ok = m is not None and m.shape == (want,) and (m.dtype == np.bool_ or (np.issubdtype(m.dtype, np.integer)
                                                                              and bool(np.isin(m, (0, 1)).all())))
        if not ok:
            got = "no action_mask" if m is None else f"{m.dtype} {list(m.shape)}"
            raise EnvContractError(f"env '{self.name}' (copy {i}): {agent}'s {self._mask_source}['action_mask'] must be bool or "
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
        obs_buf, mask_buf = self._buffers()
        for i, env in enumerate(self.envs):
            self._start(i, env, None if seed is None else seed + i, obs_buf, mask_buf)
        return self._reset_record(obs_buf, self._active_now(), self._mask_tensor(mask_buf))

    def step(self, actions: torch.Tensor) -> StepRecord:
        actions = self.action_space.check(actions, self.num_envs, self.num_agents, values=True)
        n, a = self.num_envs, self.num_agents
        acts = actions.detach().cpu().numpy().reshape((n, a, *self.action_space.shape))
        obs_buf, mask_buf = self._buffers()
        final_buf, reward, term, trunc, ep_done, final_state = self._step_buffers(obs_buf)
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
                self._keep_ended_frame(i)
                self._start(i, env, None, obs_buf, mask_buf)
            else:
                self._take_turn(i, *turn, obs_buf, mask_buf)
        ended = (term | trunc).reshape(n, a, *(1,) * len(self._obs_shape))
        return self._step_record(obs_buf, reward, term, trunc, self._active_now(), np.where(ended, final_buf, obs_buf),
                                 final_state, ep_done, self._mask_tensor(mask_buf))


def _holds_mask(space: Any) -> bool:
    """Whether observations of `space` are PettingZoo's dicts of `observation` and `action_mask`."""
    from gymnasium import spaces as gs

    return isinstance(space, gs.Dict) and {"observation", "action_mask"} <= set(space.spaces)
