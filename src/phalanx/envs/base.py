"""The batched environment protocol of DESIGN.md sections 1-2."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from phalanx.draws import Draws, Source
from phalanx.envs.spaces import Space


@dataclass
class StepRecord:
    """What `reset` and `step` return. Shapes: N envs, A agent slots.

    obs [N, A, *obs_shape]; state [N, *state_shape] or None; reward [N, A] float32;
    terminated / truncated / active / trial_end [N, A] bool; final_obs like obs (equals obs
    where no episode ended); final_state like state; info: per-env metric tensors [N] or [N, A].
    Environments auto-reset: where an episode ended, obs is the next episode's first observation.

    `reward`, `terminated`, `truncated` describe the step just taken by the slots that were active
    before it; `active` says which slots act on the returned `obs`. A slot's own end (death,
    leaving) is flagged `terminated` on its last active step. An env's episode ended at this step
    where every slot is done or was already inactive. `info` values are read where the env's
    episode ended (e.g. info["houses_saved"] [N]) and averaged into the update's metrics.

    `quiet`: True where the env knows on the host, at no cost, that terminated, truncated and trial_end
    are all false and active all true (a host env's step where nothing ended): the trainer then skips its
    end-of-episode tests and writes, which on a small CPU batch cost more than the env's own step.
    False: not known.
    `finite`: True where the env checked on the host that every number in obs, final_obs, reward, state
    and final_state is finite (cheap there, on its own arrays): the trainer then skips its own test.
    False: not known, the trainer tests.
    """

    obs: torch.Tensor
    reward: torch.Tensor
    terminated: torch.Tensor
    truncated: torch.Tensor
    active: torch.Tensor
    trial_end: torch.Tensor
    final_obs: torch.Tensor
    state: torch.Tensor | None = None
    final_state: torch.Tensor | None = None
    info: dict[str, torch.Tensor] = field(default_factory=dict)
    quiet: bool = False
    finite: bool = False


class VecEnv:
    """Base class of batched torch environments.

    Subclasses set the attributes below in `__init__` and implement `reset`, `step`,
    `state_dict` and `load_state_dict` (the dynamic state, including the RNG, so a resumed run
    continues bit-identically).
    """

    name: str = "env"
    num_envs: int
    num_agents: int = 1
    device: torch.device
    observation_space: Space
    action_space: Space
    state_space: Space | None = None
    role_names: tuple[str, ...] = ("agent",)
    roles: torch.Tensor  # [A] int64 role index per slot
    success_key: str | None = None  # info key holding per-episode success, if the env defines one
    # Names of scripted policies this env ships (baselines, archetypes); see `scripted_actions`.
    scripted_names: tuple[str, ...] = ()
    # True where `step` is pure tensor code that torch.compile captures whole: no host reads, no
    # Python branch on tensor values, and every random draw made through `rng` (a `Draws` over the
    # env's generator, whose plan the rollout replays inside the graph). --compile then captures the
    # whole rollout step; other envs run eagerly beside a compiled policy.
    capturable: bool = False
    rng: Draws | None = None
    # False where `state_dict` cannot hold the env's whole state (gymnasium / PettingZoo adapters: their
    # envs cannot be saved); a resumed run then goes on from the envs' current episodes.
    restorable: bool = True
    # True where `render` draws frames (`phalanx eval --record`).
    renders: bool = False

    def reset(self, seed: int | None = None) -> StepRecord:
        raise NotImplementedError

    def step(self, actions: torch.Tensor) -> StepRecord:
        raise NotImplementedError

    def state_dict(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def scripted_actions(self, name: str, record: StepRecord, draws: Source) -> torch.Tensor:
        """Actions [N, A, ...] of the scripted policy `name` for every slot, given the latest record.

        Scripted policies may read the env's internal state; they must stay batched on the device, and
        draw only through `draws` (phalanx.draws.uniform / normal / integers), so that a captured rollout
        step can replay their draws.
        """
        raise KeyError(f"env '{self.name}' has no scripted policy '{name}'")

    def render(self, env_index: int = 0) -> torch.Tensor:
        """Env `env_index`'s current frame as uint8 [H, W, 3] on the CPU (where `renders`)."""
        raise NotImplementedError(f"env '{self.name}' cannot render")

    def close(self) -> None:
        pass

    def default_roles(self) -> torch.Tensor:
        return torch.zeros(self.num_agents, dtype=torch.long, device=self.device)


def generator_state(gen: torch.Generator) -> torch.Tensor:
    """A generator's state as a uint8 tensor on the CPU (storable in safetensors)."""
    return gen.get_state().clone()


def set_generator_state(gen: torch.Generator, state: torch.Tensor) -> None:
    gen.set_state(state.to(device="cpu", dtype=torch.uint8).contiguous())


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Whether two devices are one: 'cuda' names the current CUDA device, so it equals 'cuda:0' there
    (torch.device('cuda') != torch.device('cuda:0') as objects, yet tensors made on either live together)."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.index == b.index:
        return True
    current = torch.cuda.current_device() if a.type == "cuda" else 0
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


def roles_from_agent_names(names: list[str], device: torch.device | str) -> tuple[tuple[str, ...], torch.Tensor]:
    """(role_names, roles [A]) from agent names: a name's role is the name without its `_<number>` suffix
    (`adversary_0` -> `adversary`), in order of first appearance; a name without a suffix is its own role."""
    role_of = [re.sub(r"_\d+$", "", str(a)) for a in names]
    role_names = tuple(dict.fromkeys(role_of))
    return role_names, torch.tensor([role_names.index(r) for r in role_of], dtype=torch.long, device=device)
