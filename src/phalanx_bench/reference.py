"""The minimal loop Phalanx is measured against: CleanRL's ppo.py reduced to its tensors, on Phalanx's
batched cartpole env. `phalanx bench cartpole` runs it in the same process as the trainer;

    python -m phalanx_bench.reference --total-steps 1000000 --num-envs 4096 --num-steps 32

runs it alone, as a whole process to time against `phalanx train` at the same settings.
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn

from phalanx.envs import make


class _RefAgent(nn.Module):
    def __init__(self, obs_dim: int, n_actions: int, hidden: int = 64):
        super().__init__()

        def layer(i: int, o: int, gain: float = math.sqrt(2)) -> nn.Linear:
            lin = nn.Linear(i, o)
            nn.init.orthogonal_(lin.weight, gain)
            nn.init.zeros_(lin.bias)
            return lin

        self.actor = nn.Sequential(
            layer(obs_dim, hidden), nn.Tanh(), layer(hidden, hidden), nn.Tanh(), layer(hidden, n_actions, 0.01)
        )
        self.critic = nn.Sequential(layer(obs_dim, hidden), nn.Tanh(), layer(hidden, hidden), nn.Tanh(), layer(hidden, 1, 1.0))


class ReferencePPO:
    """CleanRL's ppo.py reduced to its tensors, on the phalanx cartpole env (no logging, no truncation bootstrap)."""

    def __init__(self, num_envs: int, num_steps: int, device: torch.device, seed: int = 1,
                 epochs: int = 4, minibatches: int = 8, lr: float = 2.5e-4, gamma: float = 0.99, lam: float = 0.95,
                 hidden: int = 64, clip_vloss: bool = True):
        torch.manual_seed(seed)
        self.clip_vloss = clip_vloss
        self.N, self.T, self.dev = num_envs, num_steps, device
        self.epochs, self.minibatches, self.gamma, self.lam = epochs, minibatches, gamma, lam
        self.env = make("cartpole", num_envs=num_envs, device=device, seed=seed)
        self.agent = _RefAgent(4, 2, hidden).to(device)
        self.opt = torch.optim.Adam(self.agent.parameters(), lr=lr, eps=1e-5)
        T, N = num_steps, num_envs
        self.obs = torch.zeros(T, N, 4, device=device)
        self.actions = torch.zeros(T, N, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(T, N, device=device)
        self.rewards = torch.zeros(T, N, device=device)
        self.dones = torch.zeros(T, N, device=device)
        self.values = torch.zeros(T, N, device=device)
        rec = self.env.reset(seed=seed)
        self.next_obs = rec.obs[:, 0]
        self.next_done = torch.zeros(N, device=device)

    @torch.no_grad()
    def collect(self) -> None:
        agent = self.agent
        for t in range(self.T):
            self.obs[t] = self.next_obs
            self.dones[t] = self.next_done
            logits = agent.actor(self.next_obs)
            action = torch.multinomial(torch.softmax(logits, -1), 1).squeeze(-1)
            self.actions[t] = action
            self.logprobs[t] = torch.log_softmax(logits, -1).gather(-1, action.unsqueeze(-1)).squeeze(-1)
            self.values[t] = agent.critic(self.next_obs).squeeze(-1)
            rec = self.env.step(action.unsqueeze(-1))
            self.rewards[t] = rec.reward[:, 0]
            self.next_obs = rec.obs[:, 0]
            self.next_done = (rec.terminated | rec.truncated)[:, 0].float()

    def update(self) -> torch.Tensor:
        agent, T = self.agent, self.T
        with torch.no_grad():
            next_value = agent.critic(self.next_obs).squeeze(-1)
            adv = torch.zeros_like(self.rewards)
            last = torch.zeros_like(next_value)
            for t in reversed(range(T)):
                nonterm = 1.0 - (self.next_done if t == T - 1 else self.dones[t + 1])
                nv = next_value if t == T - 1 else self.values[t + 1]
                delta = self.rewards[t] + self.gamma * nv * nonterm - self.values[t]
                last = delta + self.gamma * self.lam * nonterm * last
                adv[t] = last
            ret = adv + self.values
        b_obs, b_act, b_logp = self.obs.reshape(-1, 4), self.actions.reshape(-1), self.logprobs.reshape(-1)
        b_adv, b_ret, b_val = adv.reshape(-1), ret.reshape(-1), self.values.reshape(-1)
        size = b_obs.shape[0]
        mb = size // self.minibatches
        for _ in range(self.epochs):
            perm = torch.randperm(size, device=self.dev)
            for start in range(0, mb * self.minibatches, mb):
                idx = perm[start:start + mb]
                logits = agent.actor(b_obs[idx])
                logp_all = torch.log_softmax(logits, -1)
                newlogp = logp_all.gather(-1, b_act[idx].unsqueeze(-1)).squeeze(-1)
                entropy = -(logp_all.exp() * logp_all).sum(-1)
                newv = agent.critic(b_obs[idx]).squeeze(-1)
                ratio = (newlogp - b_logp[idx]).exp()
                a = b_adv[idx]
                a = (a - a.mean()) / (a.std(correction=0) + 1e-8)
                pg = torch.max(-a * ratio, -a * ratio.clamp(0.8, 1.2)).mean()
                v_loss = (newv - b_ret[idx]) ** 2
                if self.clip_vloss:
                    v_clip = b_val[idx] + (newv - b_val[idx]).clamp(-0.2, 0.2)
                    v_loss = torch.max(v_loss, (v_clip - b_ret[idx]) ** 2)
                v_loss = 0.5 * v_loss.mean()
                loss = pg - 0.0 * entropy.mean() + 0.5 * v_loss
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), 0.5)
                self.opt.step()
        return loss.detach()

    def iteration(self) -> None:
        self.collect()
        self.update().item()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m phalanx_bench.reference", description=__doc__.splitlines()[0])
    p.add_argument("--total-steps", type=int, default=1_000_000)
    p.add_argument("--num-envs", type=int, default=4096)
    p.add_argument("--num-steps", type=int, default=32)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--minibatches", type=int, default=8)
    p.add_argument("--lr", type=float, default=2.5e-3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    ref = ReferencePPO(args.num_envs, args.num_steps, torch.device(args.device), seed=args.seed, epochs=args.epochs,
                       minibatches=args.minibatches, lr=args.lr)
    for _ in range(math.ceil(args.total_steps / (args.num_envs * args.num_steps))):
        ref.iteration()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
