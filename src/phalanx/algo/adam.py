"""Adam: its state, in torch.optim's layout, and its update as tensor operations.

Not torch.optim.Adam: creating any torch.optim optimizer imports torch._dynamo (2.3 s of a 2-core CPU,
paid by every `phalanx train` however short), and its functional form does the same on its first call.
The state keeps torch.optim's layout (`param_groups[0]`, `state[param] = {step, exp_avg, exp_avg_sq}`),
so checkpoints and `state_dict()` read as before, and `adam_update` accepts a torch.optim.Adam's state too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch
from torch.autograd.graph import increment_version

_ONE = torch.ones(())


class AdamState(Protocol):
    """What the update reads: one parameter group (params, lr, betas, eps) and per-parameter state."""

    param_groups: list[dict[str, Any]]
    state: Any


class Adam:
    """Adam's hyperparameters and moments (no weight decay, no AMSGrad); `adam_update` applies a step."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        self.param_groups: list[dict[str, Any]] = [
            {"params": list(params), "lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": 0.0}]
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        self.lr = float(lr)  # the learning rate now, on the host: the metrics row and the checkpoint read it

    def set_lr(self, lr: float) -> None:
        """The learning rate from now on; a device tensor's is changed in place (a captured step reads it)."""
        group = self.param_groups[0]
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
        self.lr = float(lr)

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's form: per-parameter state by index (the live tensors, as torch.optim gives them: copy
        them to keep a snapshot), the group's settings with the indices."""
        params = self.param_groups[0]["params"]
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        group["lr"] = float(group["lr"])
        return {"state": {i: dict(self.state[p]) for i, p in enumerate(params) if p in self.state},
                "param_groups": [{**group, "params": list(range(len(params)))}]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        params = self.param_groups[0]["params"]
        (group,) = state_dict["param_groups"]
        if len(group["params"]) != len(params):
            raise ValueError(f"optimizer state for {len(group['params'])} parameters; this one has {len(params)}")
        self.set_lr(float(group["lr"]))
        self.param_groups[0].update(betas=tuple(group["betas"]), eps=group["eps"])
        self.state = {params[int(i)]: {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
                      for i, st in state_dict["state"].items()}


def moments(optimizer: AdamState) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """The moments and step counts (created where missing), as lists the update changes in place; the
    step counts are device tensors, so the update needs no host value."""
    params = optimizer.param_groups[0]["params"]
    for p in params:
        st = optimizer.state.setdefault(p, {})
        if not st:
            st.update(step=torch.zeros((), dtype=torch.float32, device=p.device),
                      exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                      exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format))
        elif not torch.is_tensor(st["step"]) or st["step"].device != p.device:
            st["step"] = torch.as_tensor(st["step"], dtype=torch.float32, device=p.device)
    return ([optimizer.state[p]["exp_avg"] for p in params], [optimizer.state[p]["exp_avg_sq"] for p in params],
            [optimizer.state[p]["step"] for p in params])


def check_adam(optimizer: AdamState) -> None:
    group = optimizer.param_groups
    if len(group) != 1:
        raise TypeError(f"the update takes an Adam with one parameter group; this one has {len(group)}")
    unsupported = [k for k in ("weight_decay", "amsgrad", "maximize") if group[0].get(k)]
    if unsupported:
        raise TypeError(f"the update's Adam supports no {', '.join(unsupported)}")


ADAM_FORMS = ("fused", "foreach", "per_tensor")


@torch.no_grad()
def adam_update(optimizer: AdamState, grads: list[torch.Tensor], form: str | None = None) -> None:
    """One Adam step of `optimizer`'s parameters with `grads`, in place. `form` (None: "fused" on the CPU,
    "foreach" elsewhere):
    - "fused": torch's fused kernel, one op for every tensor (on the CPU it reads the step count and a
      tensor learning rate, which costs nothing there). The foreach form took 0.44 ms a minibatch step on a
      2-core CPU (the 12 tensors of a 64x64 actor-critic), a sixth of the step; this takes 0.09 ms.
    - "foreach": torch's foreach ops, no host value (a device learning rate; every parameter's step count
      advances together and the bias corrections come from the first), so a CUDA graph can replay it.
    - "per_tensor": the same in per-tensor ops, for torch.compile (its CUDA code generation failed on
      foreach kernels, torch 2.11)."""
    group = optimizer.param_groups[0]
    params = group["params"]
    exp_avgs, exp_avg_sqs, steps = moments(optimizer)
    beta1, beta2 = group["betas"]
    form = form or ("fused" if params[0].is_cpu else "foreach")
    if form not in ADAM_FORMS:
        raise ValueError(f"adam_update: form '{form}'; allowed: {', '.join(ADAM_FORMS)}")
    per_tensor = form == "per_tensor"
    if form == "fused":
        # A number added to CPU step counts would be wrapped into a tensor once per count.
        torch._foreach_add_(steps, _ONE if steps[0].is_cpu else 1.0)
        torch._fused_adam_(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=group["lr"], beta1=beta1, beta2=beta2,
                           weight_decay=0.0, eps=group["eps"], amsgrad=False, maximize=False)
        # The fused kernel leaves the parameters' version counters as they were (torch 2.13): autograd could
        # not tell they changed, nor could the rollout's packed weights (`MLPActorCritic.act_value`).
        increment_version(params)
        return
    if per_tensor:
        for m, v, g, s in zip(exp_avgs, exp_avg_sqs, grads, steps):
            s.add_(1)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    else:
        torch._foreach_add_(steps, 1.0)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    t = steps[0]
    bias2_sqrt = (1 - torch.pow(beta2, t)).sqrt()
    step_size = group["lr"] / (1 - torch.pow(beta1, t))
    # p -= step_size * m / (sqrt(v) / sqrt(bias2) + eps), with the step size folded into the denominator.
    if per_tensor:
        for p, m, v in zip(params, exp_avgs, exp_avg_sqs):
            p.addcdiv_(m, v.sqrt().div_(bias2_sqrt).add_(group["eps"]).div_(step_size), value=-1.0)
    else:
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bias2_sqrt)
        torch._foreach_add_(denom, group["eps"])
        torch._foreach_div_(denom, step_size)
        torch._foreach_addcdiv_(params, exp_avgs, denom, -1.0)
