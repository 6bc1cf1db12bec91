"""Episode recordings: play one episode and write its frames as a GIF (or MP4 where imageio's
ffmpeg plugin is installed).

A turn-based game's recording says whose turn it is: each frame carries a caption (the ply, who moved from which
seat and what it played, who moves next or how the game ended), and its moves are written beside the animation,
one line a move (`<name>.moves.tsv`: ply, agent, seat, action, reward).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from phalanx.envs import VecEnv, make
from phalanx.errors import PhalanxError
from phalanx.evaluate import Lineup, play_steps
from phalanx.runs import write_atomic, write_text_atomic
from phalanx.slots import Player, opponent_slots

MOVES_SUFFIX = ".moves.tsv"
MOVES_HEADER = ("ply", "agent", "seat", "action", "reward")


@dataclass(frozen=True)
class Move:
    """One move of a turn-based game: its ply (from 1), the agent that played it from `seat` (its slot), the action
    it played (the slot's action: PettingZoo's own where the agent's space starts at 0), and the reward credited
    to it (see `credit_moves`)."""

    ply: int
    agent: str
    seat: int
    action: int | list[Any]
    reward: float


def credit_moves(movers: list[int], rewards: list[list[float]]) -> list[float]:
    """Per move, the reward the trainer credits to it: its mover's rewards from the record the move gave up to the
    one before the mover's next move, or to the end (a reward that reaches a seat on another's turn belongs to the
    seat's last move). `movers[t]` moved at step t, `rewards[t]` is that step's record's reward per seat; a reward
    before a seat's first move belongs to no move."""
    credited = [0.0] * len(movers)
    latest: dict[int, int] = {}
    for t, (seat, reward) in enumerate(zip(movers, rewards)):
        latest[seat] = t
        for s, move in latest.items():
            credited[move] += reward[s]
    return credited


def player_names(env: VecEnv) -> list[str]:
    """Each slot's player: the env's agent names (PettingZoo's), else its role and slot."""
    if env.agent_names:
        return list(env.agent_names)
    return [f"{env.role_names[r]}_{s}" for s, r in enumerate(env.roles.tolist())]


def moves_text(moves: list[Move]) -> str:
    """The moves as tab-separated lines under a header."""
    rows = ["\t".join(MOVES_HEADER)]
    rows += [f"{m.ply}\t{m.agent}\t{m.seat}\t{m.action}\t{m.reward:g}" for m in moves]
    return "\n".join(rows) + "\n"


def turn_captions(moves: list[Move], names: list[str], first_seat: int, next_seats: list[int | None],
                  ending: str | None) -> list[list[str]]:
    """The caption lines of each frame of a turn-based game: the start, then one frame a move. `next_seats[k]`
    moves after move k (None: nobody); `ending` ("game over: ...") closes the last frame where the game ended."""
    def to_move(seat: int | None) -> str:
        return "" if seat is None else f"{names[seat]} (seat {seat}) to move"

    out = [["start", to_move(first_seat)]]
    for k, m in enumerate(moves):
        last = k == len(moves) - 1
        out.append([f"ply {m.ply}: {m.agent} (seat {m.seat}) played {m.action}",
                    ending if last and ending else to_move(next_seats[k])])
    return out


def ending_line(names: list[str], returns: list[float], truncated: bool) -> str:
    """The last caption of a game that ended: each player's return."""
    scores = ", ".join(f"{n} {r:+g}" for n, r in zip(names, returns))
    return f"{'game cut off' if truncated else 'game over'}: {scores}"


@torch.no_grad()
def record_episode(policy: Player, env_name: str, path: str | Path, env_options: dict[str, Any] | None = None,
                   greedy: bool = True, seed: int = 12345, max_steps: int = 3000, fps: int = 15,
                   opponent: Player = None, device: str | torch.device = "cpu") -> dict[str, Any]:
    """Play env 0's first episode with `policy` (a `Policy`, a scripted name, or None for random;
    `opponent` plays the opponent's side as in `evaluate_policy`) and write every frame to `path`; "return": the
    recorded player's side's rewards (all slots where there is no opponent).
    A turn-based env's frames are captioned and its moves written to `path` with `MOVES_SUFFIX` for its suffix
    (-> "moves": that path; "result": each player's return)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".gif", ".mp4"):
        raise PhalanxError(f"--record '{path}': the file must end in .gif or .mp4")
    env = make(env_name, num_envs=1, device=device, seed=seed, **(env_options or {}))
    if not env.renders:
        raise PhalanxError(f"env '{env_name}' cannot render, so it cannot be recorded")
    side = opponent_slots(env.num_agents, env.device) if opponent is not None else None
    lineup = Lineup(env, policy, opponent=opponent, side=side)
    # The recorded player's side: every slot but the opponent's. Its rewards are summed whoever moved (a game's loss
    # reaches the loser on the winner's move).
    own = torch.ones(env.num_agents, dtype=torch.bool, device=env.device) if side is None else ~side
    gen = torch.Generator(device=env.device)
    gen.manual_seed(seed)
    first = env.reset(seed=seed)
    lineup.reset()
    frames = [env.render(0)]
    total, steps = 0.0, 0
    movers, actions, rewards, next_seats = [], [], [], []
    truncated, last = False, None
    for before, played, rec in play_steps(lineup, env, first, gen, greedy, max_steps):
        steps += 1
        total += float((rec.reward[0] * own).sum())
        if env.turn_based:
            seat = int(before.active[0].nonzero()[0])
            movers.append(seat)
            actions.append(played[0, seat].tolist())
            rewards.append(rec.reward[0].tolist())
            next_seats.append(int(rec.active[0].nonzero()[0]) if bool(rec.active[0].any()) else None)
        if bool((rec.terminated | rec.truncated | ~before.active).all()):
            truncated = not bool(rec.terminated[0].any())
            last = env.ended_frame(0)  # the auto-reset copy's final position, where the env keeps it
            if last is not None:
                frames.append(last)
            break
        frames.append(env.render(0))
    env.close()
    images = [f.cpu().numpy() for f in frames]
    info: dict[str, Any] = {"path": str(path), "frames": len(frames), "steps": steps, "return": total}
    if env.turn_based:
        names = player_names(env)
        moves = [Move(t + 1, names[s], s, a, r) for t, (s, a, r) in
                 enumerate(zip(movers, actions, credit_moves(movers, rewards)))]
        returns = np.sum(rewards, axis=0).tolist() if rewards else [0.0] * len(names)
        ended = last is not None and len(images) == len(moves) + 1
        captions = turn_captions(moves, names, int(first.active[0].nonzero()[0]), next_seats,
                                 ending_line(names, returns, truncated) if ended else None)
        images = [_captioned(image, lines) for image, lines in zip(images, captions)]
        moves_path = path.with_name(path.stem + MOVES_SUFFIX)
        moves_path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(moves_path, moves_text(moves), "moves file")
        info.update(moves=str(moves_path), result=dict(zip(names, returns)))
    _write(path, images, fps)
    return info


def _captioned(frame: np.ndarray, lines: list[str]) -> np.ndarray:
    """`frame` over a white band holding `lines` in black, the font shrunk until the widest line fits."""
    from PIL import Image, ImageDraw, ImageFont

    height, width = frame.shape[:2]
    pad = max(4, width // 80)
    size = max(10, width // 26)
    draw = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    while True:
        font = _font(ImageFont, size)
        if size <= 8 or max(draw.textlength(line, font=font) for line in lines) <= width - 2 * pad:
            break
        size -= 1
    step = int(size * 1.3)
    image = Image.new("RGB", (width, height + len(lines) * step + 2 * pad), "white")
    image.paste(Image.fromarray(frame), (0, 0))
    draw = ImageDraw.Draw(image)
    for k, line in enumerate(lines):
        draw.text((pad, height + pad + k * step), line, fill="black", font=font)
    return np.asarray(image)


def _font(image_font: Any, size: int) -> Any:
    try:
        return image_font.load_default(size=size)
    except (TypeError, ImportError, OSError):  # a Pillow before 10.1, or without FreeType: the fixed bitmap font
        return image_font.load_default()


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
    write_atomic(path, lambda tmp: images[0].save(tmp, format="GIF", save_all=True, append_images=images[1:],
                                                  duration=max(1, 1000 // fps), loop=0), "recording")
