"""Greedy or sampled evaluation of a policy on fresh episodes."""

from __future__ import annotations

import statistics
from typing import Any

import torch

from phalanx.envs import make


@torch.no_grad()
def evaluate_policy(
    policy: Any,
    env_name: str,
    env_options: dict[str, Any] | None = None,
    episodes: int = 20,
    greedy: bool = True,
    seed: int = 12345,
    device: str | torch.device = "cpu",
    num_envs: int | None = None,
    max_steps: int = 1_000_000,
) -> dict[str, Any]:
    """Play `episodes` complete episodes; `policy` is a `Policy` or None for uniform random play."""
    n = num_envs or min(episodes, 64)
    env = make(env_name, num_envs=n, device=device, seed=seed, **(env_options or {}))
    gen = torch.Generator(device=env.device)
    gen.manual_seed(seed)
    rec = env.reset(seed=seed)
    ep_ret = torch.zeros(n, device=env.device)
    ep_len = torch.zeros(n, device=env.device)
    returns: list[float] = []
    lengths: list[float] = []
    successes: list[float] = []
    # Each env contributes its first episodes in order, so the sample is not biased toward short ones.
    quota = -(-episodes // n)
    taken = torch.zeros(n, dtype=torch.long)
    steps = 0
    while len(returns) < episodes and steps < max_steps:
        if policy is None:
            actions = random_actions(env, gen)
        else:
            actions = policy.act(rec.obs, greedy=greedy, generator=gen)
        rec = env.step(actions)
        steps += 1
        # Per-agent mean: for one agent the episode return; for a team, the mean agent return.
        ep_ret += rec.reward.mean(-1)
        ep_len += 1
        done = (rec.terminated | rec.truncated).any(-1)
        if bool(done.any()):
            idx = done.nonzero().flatten().tolist()
            succ = rec.info.get(env.success_key) if env.success_key else None
            for i in idx:
                if taken[i] < quota and len(returns) < episodes:
                    returns.append(float(ep_ret[i]))
                    lengths.append(float(ep_len[i]))
                    if succ is not None:
                        successes.append(float(succ.reshape(n, -1)[i].float().mean()))
                    taken[i] += 1
            ep_ret[done] = 0.0
            ep_len[done] = 0.0
    env.close()
    out: dict[str, Any] = {
        "episodes": len(returns),
        "mean_return": statistics.fmean(returns) if returns else float("nan"),
        "median_return": statistics.median(returns) if returns else float("nan"),
        "std_return": statistics.pstdev(returns) if len(returns) > 1 else 0.0,
        "mean_length": statistics.fmean(lengths) if lengths else float("nan"),
        "greedy": greedy,
    }
    if successes:
        out["success_rate"] = statistics.fmean(successes)
    return out


def random_actions(env: Any, gen: torch.Generator) -> torch.Tensor:
    """Uniform random actions for every slot of a batched env."""
    from phalanx.envs.spaces import Box, Discrete, MultiDiscrete

    space, shape = env.action_space, (env.num_envs, env.num_agents)
    if isinstance(space, Discrete):
        return torch.randint(0, space.n, shape, generator=gen, device=env.device)
    if isinstance(space, MultiDiscrete):
        nvec = torch.tensor(space.nvec, device=env.device)
        u = torch.rand(*shape, len(space.nvec), generator=gen, device=env.device)
        return (u * nvec).long().clamp_max(nvec - 1)
    if isinstance(space, Box):
        lo, hi = space.low_tensor(env.device), space.high_tensor(env.device)
        return lo + (hi - lo) * torch.rand(*shape, *space.shape, generator=gen, device=env.device)
    raise TypeError(f"no random policy for {space!r}")
