"""The batched environment protocol of docs/DESIGN.md sections 1-2."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from phalanx.draws import Draws, Source
from phalanx.envs.spaces import Space


@dataclass
class StepRecord:
    """What `reset` and `step` return. Shapes: N envs, A agent slots.

    obs `[N, A, *obs_shape]`; state `[N, *state_shape]` or None; reward `[N, A]` float32;
    terminated / truncated / active / trial_end `[N, A]` bool; final_obs like obs (equals obs
    where no episode ended); final_state like state; info: per-env metric tensors `[N]` or `[N, A]`.
    Environments auto-reset: where an episode ended, obs is the next episode's first observation.

    `reward`, `terminated`, `truncated` describe the step just taken by the slots that were active
    before it; `active` says which slots act on the returned `obs`. A slot's own end (death,
    leaving) is flagged `terminated` on its last active step. An env's episode ended at this step
    where every slot is done or was already inactive. `info` values are read where the env's
    episode ended (e.g. `info["houses_saved"]` `[N]`) and averaged into the update's metrics.

    `action_mask`: None (every action allowed), or bool `[N, A, n]` for a Discrete action space, `[N, A, sum(nvec)]`
    for a MultiDiscrete one (each head's values in turn): True where the slot may take the action on `obs`.
    It leaves every slot, active or not, at least one action (per head), and the env accepts every action it
    allows; policies sample and play greedily over allowed actions only (docs/ENVIRONMENTS.md, Action masks).

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
    action_mask: torch.Tensor | None = None
    quiet: bool = False
    finite: bool = False

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the record by name (info's as 'info.<key>'); a state or mask that is None is left out."""
        out = {"obs": self.obs, "reward": self.reward, "terminated": self.terminated, "truncated": self.truncated,
               "active": self.active, "trial_end": self.trial_end, "final_obs": self.final_obs}
        if self.state is not None:
            out["state"] = self.state
        if self.final_state is not None:
            out["final_state"] = self.final_state
        if self.action_mask is not None:
            out["action_mask"] = self.action_mask
        out.update({f"info.{k}": v for k, v in self.info.items()})
        return out

    def with_tensors(self, tensors: dict[str, torch.Tensor]) -> StepRecord:
        """This record with the tensors of `tensors()` replaced by those named in `tensors`, as they are."""
        info = {k[5:]: v for k, v in tensors.items() if k.startswith("info.")}
        fields = {k: v for k, v in tensors.items() if not k.startswith("info.")}
        return dataclasses.replace(self, **fields, info={**self.info, **info})


class VecEnv:
    """Base class of batched torch environments.

    Subclasses set the attributes below in `__init__` and implement `reset`, `step`, and either
    `step_state` and `load_step_state` (the tensors a step reads and may replace; the checkpoint methods
    derive from them) or `state_dict` and `load_state_dict` (the dynamic state, including the RNG, so a
    resumed run continues bit-identically).
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
    # The env's own generator, where it has one: saved with its state (the default `state_dict`).
    gen: torch.Generator | None = None
    # False where `state_dict` cannot hold the env's whole state (gymnasium / PettingZoo adapters: their
    # envs cannot be saved); a resumed run then goes on from the envs' current episodes.
    restorable: bool = True
    # True where `render` draws frames (`phalanx eval --record`).
    renders: bool = False
    # S > 1 where each slot's observation is a stack of S frames on its first axis, oldest first, that
    # moves by one frame a step: where the slot's stack goes on (`episodes.stack_restarts` is False) the
    # next observation is this one's last S - 1 frames and one new frame; where it starts afresh it holds
    # S copies of its first frame. The rollout then stores each frame once (S times less memory for
    # pixels); `phalanx check-env` checks the rule.
    frame_stack: int = 0
    # True where every record carries an `action_mask` (StepRecord), False where none does: the trainer knows
    # before the first step whether to keep one a step (`phalanx check-env` checks the records agree).
    action_masks: bool = False
    # True where slots take turns (PettingZoo's AEC games): a slot may receive reward, and the end of its
    # episode, on a step it sat out (another slot's turn). Both belong to its last action, as PettingZoo's
    # `last()` has them; `phalanx check-env` allows them only here.
    turn_based: bool = False
    # The env's own names for its slots where it has them (PettingZoo's agents), else None: a recording names
    # each slot's player by them (else by role and slot).
    agent_names: list[str] | None = None
    # Where a left-right reflection of the observation (its second-last axis: a board's columns) is the same state
    # of the game: the action each action becomes in the reflection (a permutation). None where none is.
    # `model: board` with `mirror` makes its policy symmetric by it.
    mirror_actions: tuple[int, ...] | None = None
    # True where the game is deterministic and `afterstates` gives, from a slot's observation alone, the observation
    # of the position each of its actions leads to (a board game): `model: board` with `lookahead` scores each move
    # by the board it makes.
    has_afterstates: bool = False
    # True where `move_outcome_fn` gives, from a slot's observation alone, which of its moves force a win and which
    # let the other side force one within a few plies (a board game's rules): `model: board` with `exact_outcomes`.
    has_move_outcomes: bool = False
    # True where `solved_outcome_fn` gives, from a slot's observation alone, each of its moves' outcome under perfect
    # play to the end of the game (a board game small enough to solve near its end): `play_solve_empties`.
    has_solved_outcomes: bool = False

    def reset(self, seed: int | None = None) -> StepRecord:
        """Every copy afresh (`seed`: the env's draws from now on; None: go on from its generator) -> the first
        record, every slot active and no flag set."""
        raise NotImplementedError

    def step(self, actions: torch.Tensor) -> StepRecord:
        """Every copy one step on `actions` `[N, A, *action_shape]` (what inactive slots take is ignored) -> its
        record; copies whose episode ended are reset in the same call (see `StepRecord`)."""
        raise NotImplementedError

    def step_state(self) -> dict[str, torch.Tensor]:
        """The env's dynamic state: every tensor `step` (and `scripted_actions`) reads that a step may change,
        the live tensors themselves (not copies), under names that never change.

        A step may write these in place or replace them (`self.x = torch.where(...)`); either way the
        next `step_state()` returns the current ones. Under --cuda-graphs the recorded step's new values
        are copied back into the tensors it started from and handed back through `load_step_state`, so
        a replay reads and writes the same memory (phalanx.graphs). Constants (tables, masks made in
        `__init__`, caches filled once) are not part of it.
        """
        raise NotImplementedError(f"env '{self.name}' does not name its step state (VecEnv.step_state)")

    def load_step_state(self, state: dict[str, torch.Tensor]) -> None:
        """Take `state` (the names of `step_state`) as the env's own tensors, as they are: no copy."""
        raise NotImplementedError(f"env '{self.name}' does not name its step state (VecEnv.load_step_state)")

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A copy of the dynamic state for checkpoints: `step_state`, and the generator's state as 'rng'; empty
        where the env is not `restorable` (its worlds cannot be saved: a resume goes on from their episodes)."""
        if not self.restorable:
            return {}
        out = {k: v.clone() for k, v in self.step_state().items()}
        if self.gen is not None:
            out["rng"] = generator_state(self.gen)
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore a `state_dict`: each tensor copied to this env's device, dtype and shape (nothing where the env
        is not `restorable`)."""
        if not self.restorable:
            return
        self.load_step_state({k: state[k].to(device=self.device, dtype=ref.dtype).reshape(ref.shape).clone()
                              for k, ref in self.step_state().items()})
        if self.gen is not None:
            set_generator_state(self.gen, state["rng"])

    def scripted_actions(self, name: str, record: StepRecord, draws: Source) -> torch.Tensor:
        """Actions [N, A, ...] of the scripted policy `name` for every slot, given the latest record.

        Scripted policies may read the env's internal state; they must stay batched on the device, and
        draw only through `draws` (phalanx.draws.uniform / normal / integers), so that a captured rollout
        step can replay their draws.
        """
        raise KeyError(f"env '{self.name}' has no scripted policy '{name}'")

    def scripted_actions_in(self, name: str, record: StepRecord, draws: Source, rows: torch.Tensor) -> torch.Tensor:
        """`scripted_actions` where only the copies `rows` ([R] long) will be used (a caller that knows them: an eager
        CPU step, where selecting rows costs nothing). An env whose scripted policy is costly (a search) computes
        those alone and returns anything in the others; by default every copy is computed."""
        return self.scripted_actions(name, record, draws)

    def afterstate_fn(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """Where `has_afterstates`: a function from observations [..., *obs_shape] of the slot to move to
        [..., n, *obs_shape], the position after each of its n actions as the mover sees it. Pure tensor code that holds
        no env state (a model keeps it, copies it with its snapshots and an export traces it); an action the mask
        forbids may give any board."""
        raise NotImplementedError(f"env '{self.name}' has no afterstates")

    def move_outcome_fn(self, plies: int = 2) -> Callable[[torch.Tensor], torch.Tensor]:
        """Where `has_move_outcomes`: a function from observations [..., *obs_shape] of the slot to move to [..., n],
        each move's outcome searched `plies` deep (the move the first): above 0.5 a win the mover can force (the
        sooner, the larger, at most 1), below -0.5 a loss the other side can force (the later, the larger), 0 neither;
        any value for a move the mask forbids. Pure tensor code that holds no env state, like `afterstate_fn`."""
        raise NotImplementedError(f"env '{self.name}' has no move outcomes")

    def solved_outcome_fn(self, empties: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """Where `has_solved_outcomes`: a function from observations [..., *obs_shape] of the slot to move to [..., n],
        each move's outcome with perfect play by both sides to the end of the game (1 a win, 0 a draw, -1 a loss, or
        a move the mask forbids) on the boards with at most `empties` empty cells, NaN on the others. A search on the
        host, not tensor code: for greedy play, never a rollout. It holds no env state, like `move_outcome_fn`."""
        raise NotImplementedError(f"env '{self.name}' has no solved outcomes")

    def turn_observations(self) -> list[tuple[int, Any]] | None:
        """Per copy, the slot to move and its observation in the game's own form (a turn-based PettingZoo env's
        observation dict with its action_mask): what a player written outside Phalanx reads
        (`phalanx eval --vs module:callable`). None where the env has no such form."""
        return None

    def render(self, env_index: int = 0) -> torch.Tensor:
        """Env `env_index`'s current frame as uint8 [H, W, 3] on the CPU (where `renders`)."""
        raise NotImplementedError(f"env '{self.name}' cannot render")

    def ended_frame(self, env_index: int = 0) -> torch.Tensor | None:
        """The frame copy `env_index`'s episode ended on at the latest step, as `render` draws it, for an env that
        resets a copy inside `step` (a recording's last frame: a game's final position); None where the env
        keeps none."""
        return None

    def close(self) -> None:
        """Release what the env holds outside torch (a host env's processes, windows); the default holds nothing."""

    def default_roles(self) -> torch.Tensor:
        """`[A]` long: each slot's role (an index into `role_names`) where the env does not say otherwise; all 0."""
        return torch.zeros(self.num_agents, dtype=torch.long, device=self.device)

    def _seed_generator(self, seed: int | None) -> None:
        """Seed the env's own generator, called from `__init__` (after `self.device` is set) and `reset(seed)`.

        The first call makes `gen` on the env's device and `rng` drawing from it, and seeds it with `seed`,
        or from the OS where None; a later call reseeds it where `seed` is given and leaves it going on from
        its state where None.
        """
        if self.gen is None:
            self.gen = torch.Generator(device=self.device)
            self.rng = Draws(self.gen)
            if seed is None:
                self.gen.seed()
                return
        if seed is not None:
            self.gen.manual_seed(seed)


def generator_state(gen: torch.Generator) -> torch.Tensor:
    """A generator's state as a uint8 tensor on the CPU (storable in safetensors)."""
    return gen.get_state().clone()


def set_generator_state(gen: torch.Generator, state: torch.Tensor) -> None:
    """Put back a state `generator_state` took (from any device, as loaded from a checkpoint)."""
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
