"""The deployed policy as one module: what `phalanx export` turns into an ONNX graph (docs/EXPORT.md).

`DeployedPolicy(policy)` maps the env's raw observations to greedy env actions, the action distribution's
parameters, the value and, for a memory model, the next memory, with every input and output a named tensor
whose first axis is the batch B (the env copies played together) and whose second is the agent slot A:

    feed-forward: forward(obs) -> (action, <distribution parameters>, [value])
    memory:       forward(obs, episode_start, active, *memory) -> (..., *next_memory)

The observations go through the run's own `Policy.preprocess` (normalisation folded in; pixels pass as
they are and the CNN scales them), the actions through the action head's own greedy pick and `to_env`,
the memory through the model's own step forward, so the module computes what `Policy.act` computes.
Memory fields keep the model's names (`MemoryState.tensors()`) but are laid out [B, A, *per-slot shape]
(the model keeps them [.., B * A, ..] with the slot axis where its `_batch_dims` says): `memory_to_model`
and `memory_from_model` convert between the two.

Pure torch: no ONNX here (phalanx.export exports it and proves it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from phalanx.envs.spaces import Box, Discrete, MultiDiscrete, Space
from phalanx.errors import PhalanxError
from phalanx.models.board import BoardActorCritic
from phalanx.models.cnn import CNNActorCritic, CNNMemoryActorCritic
from phalanx.models.layers import FastTanh
from phalanx.models.memory import LSTMActorCritic, TransformerActorCritic
from phalanx.models.mlp import ActionHead, MLPActorCritic
from phalanx.models.role_attention import RoleAttentionActorCritic
from phalanx.models.state import MemoryState, exporting
from phalanx.models.strategy import StrategyActorCritic
from phalanx.policy import Policy, frozen_copy

OBS = "obs"
EPISODE_START = "episode_start"
ACTIVE = "active"
ACTION_MASK = "action_mask"
ACTION = "action"
VALUE = "value"
MEMORY_PREFIX = "memory."
NEXT_MEMORY_PREFIX = "next_memory."


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of the deployed policy: `shape` with "batch" for the dynamic axis."""

    name: str
    shape: tuple[int | str, ...]
    dtype: torch.dtype

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": str(self.dtype).removeprefix("torch.")}


def distribution_names(space: Space) -> tuple[str, ...]:
    """The names of the distribution's parameters among the outputs: logits (Discrete, MultiDiscrete) or
    mean and log_std (Box)."""
    return ("mean", "log_std") if isinstance(space, Box) else ("logits",)


def memory_to_model(memory: dict[str, torch.Tensor], memory_type: type[MemoryState]) -> MemoryState:
    """Memory fields [B, A, *per slot] (the deployed layout) -> the model's `MemoryState` (copies); while exporting,
    the memory's `deployed_slots` stay [B, A, ...] as they came (an exported step reads them so)."""
    fields = {}
    for name, dim in memory_type._batch_dims.items():
        t = memory[name]
        kept = name in memory_type.deployed_slots and exporting()
        fields[name] = t if kept else t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]).movedim(0, dim).clone()
    return memory_type.of(fields)


def memory_from_model(state: MemoryState, num_agents: int) -> dict[str, torch.Tensor]:
    """The model's `MemoryState` -> fields [B, A, *per slot] (the deployed layout)."""
    out = {}
    for name, dim in state._batch_dims.items():
        t = getattr(state, name)
        if name in state.deployed_slots and exporting():
            out[name] = t
        else:
            t = t.movedim(dim, 0)
            out[name] = t.reshape(t.shape[0] // num_agents, num_agents, *t.shape[1:])
    return out


# The model classes whose forward the deployed policy knows: the feed-forward ones by the path their `act`
# takes to the action head (`_actor_output`), the memory ones through their step forward.
FEED_FORWARD = (MLPActorCritic, CNNActorCritic, RoleAttentionActorCritic, BoardActorCritic)
MEMORY = (LSTMActorCritic, TransformerActorCritic, StrategyActorCritic, CNNMemoryActorCritic)


def _actor_output(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The action head's input (its raw parameters) of a feed-forward model, by the path its `act` takes."""
    if isinstance(model, MLPActorCritic):
        return model.actor(model.actor_input(x))
    if isinstance(model, CNNActorCritic):
        return model.actor(model.features(x))
    if isinstance(model, BoardActorCritic):
        return model.forward_both(x)[0]
    return model.actor(model._features(model.actor_attn, x, None))  # RoleAttentionActorCritic, every slot present


def _plain_tanh(model: nn.Module) -> None:
    """FastTanh -> nn.Tanh in place: FastTanh picks its form from the batch's size on the host, a branch an
    exported graph with a dynamic batch cannot hold; ONNX's Tanh is the one form (within 2e-7 of the others)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, FastTanh):
                setattr(module, name, nn.Tanh())


class DeployedPolicy(nn.Module):
    """A CPU copy of `policy` (its weights and observation statistics; `policy` itself is left as it is) as
    one forward; the names and shapes of its inputs and outputs are `inputs` and `outputs`."""

    def __init__(self, policy: Policy):
        super().__init__()
        if not isinstance(policy.model, FEED_FORWARD + MEMORY):
            known = ", ".join(c.__name__ for c in FEED_FORWARD + MEMORY)
            raise PhalanxError(f"model class {type(policy.model).__name__} cannot be exported: the deployed policy knows "
                               f"the forward of {known} only")
        frozen = frozen_copy(policy)
        frozen.step = policy.step  # the contract names the checkpoint's step
        frozen.model.to("cpu")
        if frozen.obs_rms is not None:
            frozen.obs_rms.to("cpu")
        _plain_tanh(frozen.model)
        # A board policy's play search (play_rollouts: games played on, a loop whose length depends on the game) is
        # no graph: the graph is the net's own greedy play, and `policy` keeps its search.
        # Nor is its endgame solver (play_solve_empties: a search on the host).
        self.search_left_out = 0
        self.solver_left_out = False
        if isinstance(frozen.model, BoardActorCritic):
            self.search_left_out, frozen.model.play_rollouts = frozen.model.play_rollouts, 0
            self.solver_left_out, frozen.model.play_solved = frozen.model.play_solved is not None, None
        self.policy = frozen  # not a module: its preprocess is the run's, reading the modules registered below
        self.model = frozen.model
        self.obs_rms = frozen.obs_rms
        self.head: ActionHead = frozen.model.head
        self.num_agents = int(frozen.model.num_agents)
        self.recurrent = bool(frozen.model.recurrent)
        # The run's env gives action masks: the graph takes the step's mask and plays only what it allows.
        self.masked = bool(policy.action_masks)
        # A centralised critic reads the env's global state, which a deployed agent does not have: no value.
        self.has_value = not frozen.model.centralized
        self.memory_type: type[MemoryState] | None = None
        self.initial_memory: dict[str, torch.Tensor] = {}
        if self.recurrent:
            state = frozen.model.initial_state(1, "cpu")
            self.memory_type = type(state)
            self.initial_memory = {k: v[0, 0] for k, v in memory_from_model(state, 1).items()}
        self.eval()

    # -- the contract ------------------------------------------------------------------------------
    @property
    def memory_names(self) -> tuple[str, ...]:
        return tuple(self.initial_memory)

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        A, space = self.num_agents, self.policy.observation_space
        specs = [TensorSpec(OBS, ("batch", A, *space.shape), space.dtype)]
        if self.masked:
            specs.append(TensorSpec(ACTION_MASK, ("batch", A, self.policy.action_space.mask_width), torch.bool))
        if self.recurrent:
            specs += [TensorSpec(EPISODE_START, ("batch", A), torch.bool), TensorSpec(ACTIVE, ("batch", A), torch.bool)]
            specs += [TensorSpec(MEMORY_PREFIX + k, ("batch", A, *v.shape), v.dtype) for k, v in self.initial_memory.items()]
        return tuple(specs)

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        A, space = self.num_agents, self.policy.action_space
        if isinstance(space, Discrete):
            specs = [TensorSpec(ACTION, ("batch", A), torch.int64), TensorSpec("logits", ("batch", A, space.n), torch.float32)]
        elif isinstance(space, MultiDiscrete):
            heads, width = len(space.nvec), max(space.nvec)
            specs = [TensorSpec(ACTION, ("batch", A, heads), torch.int64),
                     TensorSpec("logits", ("batch", A, heads, width), torch.float32)]
        else:
            d = self.head.out_dim
            specs = [TensorSpec(ACTION, ("batch", A, d), torch.float32), TensorSpec("mean", ("batch", A, d), torch.float32),
                     TensorSpec("log_std", ("batch", A, d), torch.float32)]
        if self.has_value:
            specs.append(TensorSpec(VALUE, ("batch", A), torch.float32))
        specs += [TensorSpec(NEXT_MEMORY_PREFIX + k, ("batch", A, *v.shape), v.dtype) for k, v in self.initial_memory.items()]
        return tuple(specs)

    def example_inputs(self, batch: int = 2) -> tuple[torch.Tensor, ...]:
        """Inputs of `batch` env copies at an episode start (observations zero, memory as it starts)."""
        out = []
        for spec in self.inputs:
            shape = (batch, *spec.shape[1:])
            if spec.name.startswith(MEMORY_PREFIX):
                out.append(self.initial_memory[spec.name[len(MEMORY_PREFIX):]].expand(shape).clone())
            elif spec.name in (ACTIVE, ACTION_MASK):
                out.append(torch.ones(shape, dtype=spec.dtype))
            else:
                out.append(torch.zeros(shape, dtype=spec.dtype))
        return tuple(out)

    # -- the forward -------------------------------------------------------------------------------
    def _outputs(self, out: torch.Tensor, value: torch.Tensor | None, mask: torch.Tensor | None) -> list[torch.Tensor]:
        action = self.head.to_env(self.head.sample(out, None, True, mask))
        if self.head.kind == "gaussian":
            params = [out, self.head.log_std.expand_as(out)]
        else:
            params = [self.head._logits(out, self.head._legal(mask))]  # the masks and padding of the head's own sampling
        return [action, *params, *([value] if self.has_value else [])]

    def forward(self, obs: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = self.policy.preprocess(obs)
        mask = None
        if self.masked:
            mask, *rest = rest
        if isinstance(self.model, BoardActorCritic):  # the moves it chooses from: the mask, narrowed by exact outcomes
            mask = self.model.moves(x, mask, greedy=True)
        if not self.recurrent:
            out = _actor_output(self.model, x)
            return tuple(self._outputs(out, self.model.value(x) if self.has_value else None, mask))
        episode_start, active, *memory = rest
        state = memory_to_model(dict(zip(self.memory_names, memory)), self.memory_type)
        out, value = self.model.step(x, state, episode_start, active)
        if self.has_value and value is None:  # a memoryless critic beside the memory (not centralised)
            value = self.model.value(x)
        return (*self._outputs(out, value, mask), *memory_from_model(state, self.num_agents).values())

    @torch.no_grad()
    def named(self, *inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """`forward` with its outputs by name."""
        return dict(zip((s.name for s in self.outputs), self(*inputs)))


__all__ = ["ACTION", "ACTION_MASK", "ACTIVE", "EPISODE_START", "FEED_FORWARD", "MEMORY", "MEMORY_PREFIX", "NEXT_MEMORY_PREFIX", "OBS", "VALUE",
           "DeployedPolicy", "TensorSpec", "distribution_names", "memory_from_model", "memory_to_model"]
