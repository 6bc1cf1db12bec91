"""Model memory: what a model carries from one step of a slot's episode to the next.

Every model has one (`initial_state`): the LSTM's (h, c), the transformer's KV cache, the strategy
encoder's both, and `NoMemory`, the empty memory of a feed-forward model. The rollout keeps it, stores it
at each segment's start, checkpoints it and names it in the step state alike for every model.
"""

from __future__ import annotations

import dataclasses

import torch


def exporting() -> bool:
    """Whether the forward runs to be exported as a graph (torch.export's tracing, or the TorchScript ONNX exporter)."""
    return torch.compiler.is_exporting() or torch.onnx.is_in_onnx_export()


class MemoryState:
    """A model's memory of B slots: tensor fields, each with a slot axis (`_batch_dims` names it), and the
    batch helpers every memory shares."""

    _batch_dims: dict[str, int] = {}
    # Fields an exported step takes and returns with the slots as the deployed contract has them, [batch, agents]
    # leading (deployed.py), rather than flattened: a reshape of a graph output copies it whole, which for a KV cache
    # was a fifth of the graph's time (issue 63).
    deployed_slots: tuple[str, ...] = ()

    def _map(self, fn):
        return type(self)(**{f: fn(getattr(self, f), d) for f, d in self._batch_dims.items()})

    def clone(self):
        return self._map(lambda t, d: t.clone())

    def select(self, rows: torch.Tensor):
        """The states of some slots (a long index or a bool mask over the batch axis)."""
        return self._map(lambda t, d: t[(slice(None),) * d + (rows,)])

    def tensors(self) -> dict[str, torch.Tensor]:
        """The fields by name (the memory's part of a step state; checkpoints store them so)."""
        return {f: getattr(self, f) for f in self._batch_dims}

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor]):
        """The memory made of `tensors` (the names of `tensors()`), as they are."""
        return cls(**{f: tensors[f] for f in cls._batch_dims})

    @classmethod
    def cat(cls, states):
        return cls(**{f: torch.cat([getattr(s, f) for s in states], d) for f, d in cls._batch_dims.items()})

    @property
    def batch_size(self) -> int:
        f, d = next(iter(self._batch_dims.items()))
        return getattr(self, f).shape[d]


@dataclasses.dataclass
class NoMemory(MemoryState):
    """The memory of a feed-forward model: no tensors."""

    _batch_dims = {}

    @property
    def batch_size(self) -> int:
        return 0
