"""Episode recordings: play one episode and write its frames as a GIF (or MP4 where imageio's
ffmpeg plugin is installed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from phalanx.envs import make
from phalanx.errors import PhalanxError
from phalanx.evaluate import Lineup, play_steps
from phalanx.slots import Player, opponent_slots


@torch.no_grad()
def record_episode(policy: Player, env_name: str, path: str | Path, env_options: dict[str, Any] | None = None,
                   greedy: bool = True, seed: int = 12345, max_steps: int = 3000, fps: int = 15,
                   opponent: Player = None, device: str | torch.device = "cpu") -> dict[str, Any]:
    """Play env 0's first episode with `policy` (a `Policy`, a scripted name, or None for random;
    `opponent` plays the opponent's side as in `evaluate_policy`) and write every frame to `path`."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".gif", ".mp4"):
        raise PhalanxError(f"--record '{path}': the file must end in .gif or .mp4")
    env = make(env_name, num_envs=1, device=device, seed=seed, **(env_options or {}))
    if not env.renders:
        raise PhalanxError(f"env '{env_name}' cannot render, so it cannot be recorded")
    lineup = Lineup(env, policy, opponent=opponent, side=opponent_slots(env.num_agents, env.device) if opponent is not None else None)
    gen = torch.Generator(device=env.device)
    gen.manual_seed(seed)
    first = env.reset(seed=seed)
    lineup.reset()
    frames = [env.render(0)]
    total, steps = 0.0, 0
    for before, rec in play_steps(lineup, env, first, gen, greedy, max_steps):
        steps += 1
        total += float((rec.reward * before.active).sum())
        if bool((rec.terminated | rec.truncated | ~before.active).all()):
            break
        frames.append(env.render(0))
    env.close()
    _write(path, [f.cpu().numpy() for f in frames], fps)
    return {"path": str(path), "frames": len(frames), "steps": steps, "return": total}


def _write(path: Path, frames: list, fps: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".mp4":
        try:
            import imageio.v3 as iio
        except ImportError:
            raise PhalanxError("writing .mp4 needs imageio with its ffmpeg plugin (pip install imageio[ffmpeg]); use .gif") from None
        iio.imwrite(path, frames, fps=fps)
        return
    from PIL import Image

    images = [Image.fromarray(f) for f in frames]
    tmp = path.with_name(f".{path.name}.tmp")
    images[0].save(tmp, format="GIF", save_all=True, append_images=images[1:], duration=max(1, 1000 // fps), loop=0)
    tmp.replace(path)
