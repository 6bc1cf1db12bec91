"""pixel_goal: pixels-only goal reaching in a top-down tile world (docs/WORKLOADS.md section 4).

The world
---------
A 72 x 80 image of 4 shades (0 = lightest .. 3 = darkest) made of 8 x 8 pixel tiles: 9 rows x 10
columns. Tiles are floor `.`, grass `,` (walkable decoration), wall `#` and tree `T` (blocking
decoration); the player is an 8 x 8 sprite with transparent pixels drawn over them. The `map` option
picks one of the fixed layouts in `MAPS` ("default", "open", "maze", "rooms"). Each episode the
player starts on a tile drawn uniformly (from the env's generator) among the map's start tiles: the
2 x 2 block marked `S` (`start="region"`, default) or every free tile except the goal tile
(`start="any"`).

Frames, steps and actions
-------------------------
Actions are Discrete(7), no no-op: 0 A, 1 B, 2 START, 3 UP, 4 DOWN, 5 LEFT, 6 RIGHT. One agent step
is `FRAMES_PER_STEP` = 24 frames. The button is held for the first `HOLD_FRAMES` = 8 frames and
released for the other 16. A movement key whose target tile is free moves the player one tile,
1 px per held frame (frames 1..8 of the step show offsets 1..8 px), then the sprite stays put on
frames 9..24; into a wall or a tree the player does not move. A, B and START change nothing in the
world (the 24 frames still pass): they are the ways to stand still. `step_frames(actions)` steps
like `step` and also returns all 24 frames [N, 24, 72, 80] of the step (`step` renders only the
last one, which is all the observation and the reward need).

Observation [N, 1, 4, 72, 80] uint8, values 0..3: a frame stack of 4, oldest first, holding the last
frame of each of the last 4 agent steps (Atari-style frame skip + stack, so it shows the motion of
the last 3 steps; the in-step frames after the release are all alike). At an episode start the
stack is 4 copies of the first frame. Observations stay uint8 end to end (obs and final_obs).

Goal, reward, done
------------------
The goal is a template image [72, 80] uint8 and `dist = mean |frame - goal| / 3` over the last frame
of the step (a float in [0, 1], computed exactly from integer pixel sums). Templates (`goal` option)
are rendered states: "default" (the player on the map's `G` tile: 4..6 moves from the start block
on the default map, 5..8 on the others), "alt" (on the map's `a` tile) and "far" (on the free tile farthest by path from the start
block); `goal_template_from_state(map, tile)` renders any state, and the constructor takes
`goal_image=` for a custom template. The step ends `terminated` once `dist < tau` held at the end
of `k` consecutive steps (the reset frame does not count; a step with `dist >= tau` resets the
count). Reward `-0.01 + (prev_dist - dist) + 10 * terminated`, prev_dist being the dist of the
previous step's last frame (of the first frame after a reset). Reward and done come from pixels
only (the frame and the template), never from the player's coordinates. The time limit
(`max_steps`, 512) truncates (both flags may be set on one step, like gymnasium's TimeLimit).

Calibration of tau and k: at the end of a step the player always stands on a whole tile, so the
frame of the goal state matches its template exactly (dist 0), while on any other tile the two
sprite footprints differ: the smallest such dist over every map and pair of free tiles is
`min_off_goal_dist()` = 170 / 17280 (about 0.0098). The default TAU = 0.005 sits halfway between;
tests check it separates the goal tile from every other free tile on every map and goal.
K (`k`, default 4): 3 of the 7 actions stand still, so a uniform random walker that stumbles on the
goal tile rarely stays for k - 1 more steps. Measured success of `random` in its first episode on
the default map (256 envs): 0.89 with k = 2, 0.60 with k = 3, 0.37 with k = 4 (the default: random
mostly fails, yet finds the goal often enough for a learner to start), while the oracle needs at
most 6 moves + 3 steps standing still.

info (read where an episode ended, 0 elsewhere): `success` (1.0 where it ended by reaching the goal),
`steps_to_goal` (the episode length where success, else 0: take medians over successful episodes
only), `final_dist` (dist of the last frame), `episode_return`, `episode_length`.

Scripted policies: "random" (uniform over the 7 actions) and "oracle" (a shortest path to the goal
tile from a BFS table of next actions per tile precomputed per map and goal, then A to stand still;
for sanity checks). The oracle's goal tile is the free tile whose rendered frame is closest to the
template, so it also serves custom templates.

Cost: `step` renders one frame per env (the background copied, the sprite pasted by advanced
indexing), its dist and the stack shift: about 15 ms for 1024 envs on one CPU thread. The first
frames of the start tiles (and their dists) are rendered once at construction and gathered at
auto-resets. `step_frames` renders all 24 frames (about 0.2 s for 1024 envs; for tests and GIFs).

The RNG draws one start tile per env at every step (used only where an episode ended), so its
stream does not depend on which envs finished; `state_dict` holds every dynamic tensor and the RNG
state, so a restored env continues bit-identically.
"""

from __future__ import annotations

import functools
from collections import deque

import torch

from phalanx.draws import Source, integers
from phalanx.envs.base import StepRecord, VecEnv
from phalanx.envs.registry import EnvOption, EnvSpec, register
from phalanx.envs.spaces import Box, Discrete
from phalanx.errors import ConfigError

TILE = 8
ROWS, COLS = 9, 10
HEIGHT, WIDTH = ROWS * TILE, COLS * TILE  # 72 x 80
SHADES = 4
STACK = 4
FRAMES_PER_STEP = 24
HOLD_FRAMES = 8  # the button is held for these first frames of a step, then released
A, B, START, UP, DOWN, LEFT, RIGHT = range(7)
ACTION_NAMES = ("A", "B", "START", "UP", "DOWN", "LEFT", "RIGHT")
# (row, column) tile deltas per action; A, B, START do not move.
DELTAS = ((0, 0), (0, 0), (0, 0), (-1, 0), (1, 0), (0, -1), (0, 1))
STEP_PENALTY = -0.01
GOAL_BONUS = 10.0
DIST_SCALE = (SHADES - 1) * HEIGHT * WIDTH  # dist = sum |frame - goal| / DIST_SCALE
TAU = 0.005
K = 4
MAX_STEPS = 512
# RGB of shades 0..3 for render() (a 4-grey palette, lightest first).
PALETTE = ((232, 232, 232), (160, 160, 160), (88, 88, 88), (16, 16, 16))

# Tile bitmaps (8 x 8, shades as digits).
_FLOOR = (
    "00000000",
    "00000000",
    "00000100",
    "00000000",
    "00000000",
    "01000000",
    "00000000",
    "00000000",
)
_GRASS = (
    "00000000",
    "01000010",
    "10100101",
    "00000000",
    "00010000",
    "00101000",
    "00000000",
    "00000000",
)
_WALL = (
    "33333333",
    "22232222",
    "22232222",
    "33333333",
    "22222223",
    "22222223",
    "33333333",
    "22232222",
)
_TREE = (
    "00222200",
    "02211220",
    "22122122",
    "21222212",
    "02222220",
    "00033000",
    "00033000",
    "00333300",
)
# The player sprite; '.' is transparent.
_PLAYER = (
    "..3333..",
    ".311113.",
    ".313133.",
    ".311113.",
    "..3333..",
    ".322223.",
    ".322223.",
    "..3..3..",
)
FLOOR, GRASS, WALL, TREE = range(4)
_TILE_CHARS = {".": FLOOR, "S": FLOOR, "G": FLOOR, "a": FLOOR, ",": GRASS, "#": WALL, "T": TREE}
_BLOCKING = (False, False, True, True)

# Layouts: 9 rows x 10 columns. S start block (floor), G default goal, a alt goal (floor).
MAPS: dict[str, tuple[str, ...]] = {
    "default": (
        "##########",
        "#SS...,..#",
        "#SS.T....#",
        "#....,.T.#",
        "#.T.G....#",
        "#...,....#",
        "#.....T..#",
        "#,......a#",
        "##########",
    ),
    "open": (
        "##########",
        "#........#",
        "#.SS.....#",
        "#.SS.....#",
        "#........#",
        "#.....G..#",
        "#........#",
        "#a.......#",
        "##########",
    ),
    "maze": (
        "##########",
        "#SS#....a#",
        "#SS#.###.#",
        "#..#...#.#",
        "#.####.#.#",
        "#...G..#.#",
        "###.####.#",
        "#........#",
        "##########",
    ),
    "rooms": (
        "##########",
        "#SS,#....#",
        "#SS.#.T.a#",
        "#...#....#",
        "#........#",
        "#...#G...#",
        "#.,.#..,.#",
        "#...#....#",
        "##########",
    ),
}
GOALS = ("default", "alt", "far")
STARTS = ("region", "any")


def _bitmap(rows: tuple[str, ...]) -> torch.Tensor:
    return torch.tensor([[int(c) if c != "." else -1 for c in r] for r in rows], dtype=torch.int16)


TILE_BITMAPS = torch.stack([_bitmap(t) for t in (_FLOOR, _GRASS, _WALL, _TREE)]).to(torch.uint8)  # [4, 8, 8]
_SPRITE = _bitmap(_PLAYER)
SPRITE = _SPRITE.clamp_min(0).to(torch.uint8)  # [8, 8]
SPRITE_MASK = _SPRITE >= 0  # [8, 8] opaque pixels


def map_tiles(map: str) -> torch.Tensor:
    """The tile kinds [9, 10] (long) of a map."""
    if map not in MAPS:
        raise ConfigError(f"pixel_goal map must be one of {', '.join(MAPS)}, got {map!r}")
    return torch.tensor([[_TILE_CHARS[c] for c in row] for row in MAPS[map]], dtype=torch.long)


def map_marks(map: str, char: str) -> list[tuple[int, int]]:
    """Tiles (row, column) marked `char` in a map's layout, row-major."""
    return [(r, c) for r, row in enumerate(MAPS[map]) for c, ch in enumerate(row) if ch == char]


def free_tiles(map: str) -> torch.Tensor:
    """Walkable tiles [F, 2] (row, column) of a map, row-major."""
    blocking = torch.tensor(_BLOCKING)[map_tiles(map)]
    return (~blocking).nonzero()


def background(map: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """The map without the player [72, 80] uint8 (tile bitmaps composed by indexing)."""
    tiles = TILE_BITMAPS[map_tiles(map)]  # [9, 10, 8, 8]
    return tiles.permute(0, 2, 1, 3).reshape(HEIGHT, WIDTH).contiguous().to(device)


def draw_player(
    bg: torch.Tensor, py: torch.Tensor, px: torch.Tensor, sprite: torch.Tensor | None = None, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Frames [M, 72, 80] uint8: the background [72, 80] with the player sprite at pixel (py, px) [M]
    (`sprite` / `mask`: SPRITE / SPRITE_MASK already on bg's device, to skip the copy)."""
    m, dev = py.shape[0], bg.device
    sprite = SPRITE.to(dev) if sprite is None else sprite
    mask = SPRITE_MASK.to(dev) if mask is None else mask
    frames = bg.expand(m, HEIGHT, WIDTH).clone()
    ar = torch.arange(TILE, device=dev)
    rows = (py.unsqueeze(1) + ar).unsqueeze(2)  # [M, 8, 1]
    cols = (px.unsqueeze(1) + ar).unsqueeze(1)  # [M, 1, 8]
    idx = torch.arange(m, device=dev).view(m, 1, 1)
    under = frames[idx, rows, cols]
    frames[idx, rows, cols] = torch.where(mask, sprite, under)
    return frames


def _select_frames(done: torch.Tensor, first: torch.Tensor, stack: torch.Tensor) -> torch.Tensor:
    """Stacks [N, 4, 72, 80]: 4 copies of `first` [N, 72, 80] where `done` [N], else `stack`.
    (A select on the bytes viewed as int64: 8x fewer elements than uint8, same result.)"""
    n = stack.shape[0]
    a = first.contiguous().view(n, 1, HEIGHT * WIDTH).view(torch.int64)
    b = stack.contiguous().view(n, STACK, HEIGHT * WIDTH).view(torch.int64)
    out = torch.where(done.view(n, 1, 1), a, b)
    return out.view(torch.uint8).view(n, STACK, HEIGHT, WIDTH)


def goal_template_from_state(map: str, player_tile: tuple[int, int] | torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """The frame [72, 80] uint8 of the state "player standing on `player_tile` (row, column) of `map`"
    (what the env renders at the end of a step there): a goal template."""
    tile = torch.as_tensor(player_tile, dtype=torch.long).reshape(2).to(device)
    return draw_player(background(map, device), tile[:1] * TILE, tile[1:] * TILE)[0]


def frame_dist(frames: torch.Tensor, goal: torch.Tensor) -> torch.Tensor:
    """dist = mean |frame - goal| / 3 per frame [..., 72, 80] -> [...] (float32), from exact integer sums."""
    goal = goal.to(torch.uint8)
    diff = torch.maximum(frames, goal) - torch.minimum(frames, goal)  # |frame - goal| in uint8
    total = diff.reshape(*frames.shape[:-2], HEIGHT * WIDTH).sum(-1, dtype=torch.int32)
    return total.float() / DIST_SCALE


def bfs_steps(map: str, target: tuple[int, int]) -> dict[tuple[int, int], int]:
    """Path lengths (in moves) from every reachable free tile to `target`."""
    blocking = torch.tensor(_BLOCKING)[map_tiles(map)].tolist()
    dist = {target: 0}
    queue = deque([target])
    while queue:
        r, c = queue.popleft()
        for dr, dc in DELTAS[UP:]:
            nr, nc = r + dr, c + dc
            if 0 <= nr < ROWS and 0 <= nc < COLS and not blocking[nr][nc] and (nr, nc) not in dist:
                dist[(nr, nc)] = dist[(r, c)] + 1
                queue.append((nr, nc))
    return dist


def oracle_table(map: str, target: tuple[int, int]) -> torch.Tensor:
    """Next action [9, 10] (long) per tile on a shortest path to `target` (A on the target and on
    tiles that cannot reach it)."""
    dist = bfs_steps(map, target)
    table = torch.full((ROWS, COLS), A, dtype=torch.long)
    for (r, c), d in dist.items():
        for a in (UP, DOWN, LEFT, RIGHT):
            dr, dc = DELTAS[a]
            if d > 0 and dist.get((r + dr, c + dc), -1) == d - 1:
                table[r, c] = a
                break
    return table


def goal_tile(map: str, goal: str) -> tuple[int, int]:
    """The tile the named goal template shows the player on."""
    if goal not in GOALS:
        raise ConfigError(f"pixel_goal goal must be one of {', '.join(GOALS)}, got {goal!r}")
    if goal == "default":
        return map_marks(map, "G")[0]
    if goal == "alt":
        return map_marks(map, "a")[0]
    # far: the free tile with the longest shortest path from the start block (first in row-major order).
    starts = map_marks(map, "S")
    far = {}
    for s in starts:
        for t, d in bfs_steps(map, s).items():
            far[t] = min(far.get(t, d), d)
    best = max(far.values())
    return min(t for t, d in far.items() if d == best)


class PixelGoalEnv(VecEnv):
    """pixel_goal: see the module docstring."""

    name = "pixel_goal"
    renders = True
    capturable = True
    frame_stack = STACK  # the observation is the last 4 steps' frames: the rollout stores each once
    num_agents = 1
    action_space = Discrete(len(ACTION_NAMES))
    observation_space = Box.uniform(0, SHADES - 1, (STACK, HEIGHT, WIDTH), dtype=torch.uint8)
    role_names = ("agent",)
    success_key = "success"
    scripted_names = ("random", "oracle")

    def __init__(
        self,
        num_envs: int = 1,
        device: torch.device | str = "cpu",
        seed: int | None = 0,
        map: str = "default",
        goal: str = "default",
        tau: float = TAU,
        k: int = K,
        max_steps: int = MAX_STEPS,
        start: str = "region",
        goal_image: torch.Tensor | None = None,
    ) -> None:
        if map not in MAPS:
            raise ConfigError(f"pixel_goal map must be one of {', '.join(MAPS)}, got {map!r}")
        if start not in STARTS:
            raise ConfigError(f"pixel_goal start must be one of {', '.join(STARTS)}, got {start!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"pixel_goal k must be a positive integer, got {k!r}")
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
            raise ConfigError(f"pixel_goal max_steps must be a positive integer, got {max_steps!r}")
        if not 0.0 < float(tau) <= 1.0:
            raise ConfigError(f"pixel_goal tau must be in (0, 1], got {tau!r}")
        self.num_envs = n = int(num_envs)
        self.device = dev = torch.device(device)
        self.map, self.tau, self.k, self.max_steps, self.start = map, float(tau), k, max_steps, start
        self.roles = self.default_roles()
        self._seed_generator(seed)
        self.background = background(map, dev)
        self.sprite, self.sprite_mask = SPRITE.to(dev), SPRITE_MASK.to(dev)
        self._last_frame_no = torch.tensor([FRAMES_PER_STEP], device=dev)
        tiles = map_tiles(map)
        self.blocking = torch.tensor(_BLOCKING)[tiles].to(dev)  # [9, 10] bool
        self.free = free_tiles(map).to(dev)  # [F, 2]
        if goal_image is None:
            self.goal_name = goal
            target = goal_tile(map, goal)
            self.goal = goal_template_from_state(map, target, dev)
        else:
            self.goal_name = "custom"
            self.goal = torch.as_tensor(goal_image).to(device=dev, dtype=torch.uint8).reshape(HEIGHT, WIDTH).clone()
            # The oracle heads for the free tile whose frame is closest to the template.
            frames = self.render_tiles(self.free)
            target = tuple(self.free[int(frame_dist(frames, self.goal).argmin())].tolist())
        self.goal_tile = target
        self.oracle = oracle_table(map, target).to(dev)  # [9, 10] next action per tile
        if start == "region":
            starts = torch.tensor(map_marks(map, "S"), dtype=torch.long)
        else:
            starts = free_tiles(map)
            starts = starts[(starts != torch.tensor(target)).any(1)]
        self.start_tiles = starts.to(dev)  # [S, 2]
        # First frames of the start tiles and their dists, rendered once (an episode start is one of them).
        self.start_frames = self.render_tiles(self.start_tiles)  # [S, 72, 80]
        self.start_dists = frame_dist(self.start_frames, self.goal)  # [S]
        self.deltas = torch.tensor(DELTAS, dtype=torch.long, device=dev)  # [7, 2]
        self.palette = torch.tensor(PALETTE, dtype=torch.uint8, device=dev)
        # Dynamic state.
        self.pos = torch.zeros(n, 2, dtype=torch.long, device=dev)  # player tile (row, column)
        self.frames = torch.zeros(n, STACK, HEIGHT, WIDTH, dtype=torch.uint8, device=dev)  # the obs stack
        self.prev_dist = torch.zeros(n, dtype=torch.float32, device=dev)
        self.under = torch.zeros(n, dtype=torch.long, device=dev)  # consecutive steps with dist < tau
        self.elapsed = torch.zeros(n, dtype=torch.long, device=dev)
        self.ep_return = torch.zeros(n, dtype=torch.float32, device=dev)
        self._start_all(self.start_tiles[self._draw_starts()])

    # --- rendering ---------------------------------------------------------------------------------
    def render_tiles(self, tiles: torch.Tensor) -> torch.Tensor:
        """Frames [M, 72, 80] uint8 of the player standing on `tiles` [M, 2]."""
        return draw_player(self.background, tiles[:, 0] * TILE, tiles[:, 1] * TILE, self.sprite, self.sprite_mask)

    def _step_frames(self, start: torch.Tensor, delta: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
        """Frames [N, len(frames), 72, 80] at frame numbers `frames` (1..24) of a step from tiles
        `start` [N, 2] moving by `delta` [N, 2] (zero where the player does not move)."""
        n, f = start.shape[0], frames.shape[0]
        off = frames.clamp(max=HOLD_FRAMES).view(1, f, 1) * delta.view(n, 1, 2)  # px moved so far
        px = (start * TILE).view(n, 1, 2) + off  # [N, F, 2]
        out = draw_player(self.background, px[..., 0].reshape(-1), px[..., 1].reshape(-1), self.sprite, self.sprite_mask)
        return out.view(n, f, HEIGHT, WIDTH)

    def render_frames(self, frames: torch.Tensor) -> torch.Tensor:
        """RGB images [..., 72, 80, 3] uint8 of shade frames [..., 72, 80] (for GIFs)."""
        return self.palette[frames.long()]

    def render(self, env_index: int = 0) -> torch.Tensor:
        """RGB image [72, 80, 3] uint8 of env `env_index`'s current last frame."""
        return self.render_frames(self.frames[env_index, -1])

    # --- episodes ----------------------------------------------------------------------------------
    def _draw_starts(self) -> torch.Tensor:
        """Indices [N] into the start tiles, one per env."""
        return self.rng.randint(0, self.start_tiles.shape[0], (self.num_envs,), self.device)

    def _start_all(self, tiles: torch.Tensor) -> None:
        self.pos = tiles.clone()
        first = self.render_tiles(tiles)
        self.frames = first.unsqueeze(1).expand(-1, STACK, -1, -1).clone()
        self.prev_dist = frame_dist(first, self.goal)
        self.under = torch.zeros_like(self.under)
        self.elapsed = torch.zeros_like(self.elapsed)
        self.ep_return = torch.zeros_like(self.ep_return)

    def set_player(self, tiles: torch.Tensor, elapsed: torch.Tensor | None = None, under: torch.Tensor | None = None) -> torch.Tensor:
        """Put the players on `tiles` [N, 2] as at an episode start (stack of 4 copies of the frame,
        prev_dist of it), optionally with step counters `elapsed` and goal counts `under` [N].
        Returns the observation [N, 1, 4, 72, 80]. For tests and demos."""
        self._start_all(tiles.to(device=self.device, dtype=torch.long).reshape(self.num_envs, 2))
        if elapsed is not None:
            self.elapsed = elapsed.to(device=self.device, dtype=torch.long).reshape(self.num_envs).clone()
        if under is not None:
            self.under = under.to(device=self.device, dtype=torch.long).reshape(self.num_envs).clone()
        return self.frames.unsqueeze(1)

    def _record(self, obs, final_obs, reward, terminated, truncated, info) -> StepRecord:
        n, dev = self.num_envs, self.device
        return StepRecord(
            obs=obs.unsqueeze(1),
            reward=reward.unsqueeze(1),
            terminated=terminated.unsqueeze(1),
            truncated=truncated.unsqueeze(1),
            active=torch.ones(n, 1, dtype=torch.bool, device=dev),
            trial_end=torch.zeros(n, 1, dtype=torch.bool, device=dev),
            final_obs=final_obs.unsqueeze(1),
            info=info,
        )

    def reset(self, seed: int | None = None) -> StepRecord:
        self._seed_generator(seed)
        self._start_all(self.start_tiles[self._draw_starts()])
        obs = self.frames
        false = torch.zeros(self.num_envs, dtype=torch.bool, device=self.device)
        zero = torch.zeros(self.num_envs, dtype=torch.float32, device=self.device)
        return self._record(obs, obs, zero, false, false.clone(), {})

    def step(self, actions: torch.Tensor) -> StepRecord:
        actions = self.action_space.check(actions, self.num_envs, self.num_agents)
        return self._step(actions, all_frames=False)[0]

    def step_frames(self, actions: torch.Tensor) -> tuple[StepRecord, torch.Tensor]:
        """`step`, also returning all 24 frames [N, 24, 72, 80] uint8 of the step (the last one is
        the last frame of `final_obs`)."""
        rec, frames = self._step(actions, all_frames=True)
        assert frames is not None
        return rec, frames

    def _step(self, actions: torch.Tensor, all_frames: bool) -> tuple[StepRecord, torch.Tensor | None]:
        n, dev = self.num_envs, self.device
        act = actions.to(device=dev, dtype=torch.long).reshape(n).clamp(0, len(ACTION_NAMES) - 1)
        delta = self.deltas[act]
        target = self.pos + delta  # maps have wall borders, so targets stay on the grid
        blocked = self.blocking[target[:, 0].clamp(0, ROWS - 1), target[:, 1].clamp(0, COLS - 1)]
        delta = torch.where(blocked.unsqueeze(1), 0, delta)
        if all_frames:
            numbers = torch.arange(1, FRAMES_PER_STEP + 1, device=dev)
            every = self._step_frames(self.pos, delta, numbers)
            last = every[:, -1]
        else:
            every = None
            last = self._step_frames(self.pos, delta, self._last_frame_no)[:, 0]
        new_pos = self.pos + delta
        # Reward and done from pixels only: the last frame against the goal template.
        dist = frame_dist(last, self.goal)
        under = torch.where(dist < self.tau, self.under + 1, 0)
        terminated = under >= self.k
        self.elapsed = self.elapsed + 1
        truncated = self.elapsed >= self.max_steps
        done = terminated | truncated
        reward = STEP_PENALTY + (self.prev_dist - dist) + GOAL_BONUS * terminated.float()
        self.ep_return = self.ep_return + reward
        final_obs = torch.cat((self.frames[:, 1:], last.unsqueeze(1)), 1)
        info = {
            "success": terminated.float(),
            "steps_to_goal": torch.where(terminated, self.elapsed, 0).float(),
            "final_dist": torch.where(done, dist, 0.0),
            "episode_return": torch.where(done, self.ep_return, 0.0),
            "episode_length": torch.where(done, self.elapsed, 0).float(),
        }
        # Auto-reset: a start tile is drawn for every env, used where the episode ended.
        u = self._draw_starts()
        first = self.start_frames[u]
        self.pos = torch.where(done.view(n, 1), self.start_tiles[u], new_pos)
        self.frames = _select_frames(done, first, final_obs)
        self.prev_dist = torch.where(done, self.start_dists[u], dist)
        self.under = torch.where(done, 0, under)
        self.elapsed = torch.where(done, 0, self.elapsed)
        self.ep_return = torch.where(done, 0.0, self.ep_return)
        return self._record(self.frames, final_obs, reward, terminated, truncated, info), every

    # --- scripted policies -------------------------------------------------------------------------
    def scripted_actions(self, name: str, record: StepRecord, draws: Source) -> torch.Tensor:
        n = self.num_envs
        if name == "random":
            return integers(draws, 0, len(ACTION_NAMES), (n, 1), self.device)
        if name == "oracle":
            return self.oracle[self.pos[:, 0], self.pos[:, 1]].view(n, 1)
        raise KeyError(f"env '{self.name}' has no scripted policy '{name}'; known: {', '.join(self.scripted_names)}")

    # --- checkpoints -------------------------------------------------------------------------------
    def step_state(self) -> dict[str, torch.Tensor]:
        return {"pos": self.pos, "frames": self.frames, "prev_dist": self.prev_dist, "under": self.under,
                "elapsed": self.elapsed, "ep_return": self.ep_return}

    def load_step_state(self, state: dict[str, torch.Tensor]) -> None:
        self.pos, self.frames, self.prev_dist = state["pos"], state["frames"], state["prev_dist"]
        self.under, self.elapsed, self.ep_return = state["under"], state["elapsed"], state["ep_return"]


@functools.cache
def min_off_goal_dist() -> float:
    """The smallest dist between the frames of two different player tiles over every map (tau must
    stay under it so that only the goal tile passes)."""
    best = 1.0
    for m in MAPS:
        free = free_tiles(m)
        frames = draw_player(background(m), free[:, 0] * TILE, free[:, 1] * TILE)
        d = torch.stack([frame_dist(frames, f) for f in frames])  # [F, F]
        d = d + torch.eye(len(free))  # not a tile against itself
        best = min(best, float(d.min()))
    return best


register(
    EnvSpec(
        name="pixel_goal",
        factory=PixelGoalEnv,
        description=(
            "Pixels-only goal reaching in a 9x10 tile world: obs 4 stacked 72x80 uint8 frames (4 shades), "
            "Discrete(7) buttons (A, B, START, UP, DOWN, LEFT, RIGHT), 24 frames per step; done after k steps "
            "within tau of a goal template image"
        ),
        options={
            "map": EnvOption("default", "tile layout", tuple(MAPS)),
            "goal": EnvOption("default", "goal template: the player on the map's G tile, its a tile, or the free tile farthest from the start", GOALS),
            "tau": EnvOption(TAU, "dist threshold (mean |frame - goal| / 3); 0.005 separates the goal tile from every other tile", min=0.0),
            "k": EnvOption(K, "consecutive steps under tau that end the episode (terminated)", min=1),
            "max_steps": EnvOption(MAX_STEPS, "time limit in steps (episode is truncated)", min=1),
            "start": EnvOption("region", "start tile per episode: drawn from the map's 2x2 start block, or any free tile but the goal", STARTS),
        },
        # Set model to a CNN policy where the trainer offers one; a few minutes of CPU training.
        train_defaults={
            # Its published figures were measured with the value loss clipped; not yet measured without.
            "clip_vloss": True,
            "num_envs": 32, "num_steps": 128, "total_steps": 400_000, "lr": 2.5e-4, "gamma": 0.99,
            "gae_lambda": 0.95, "ent_coef": 0.01, "num_minibatches": 4, "num_epochs": 4, "model": "cnn",
            "cnn_channels": [16, 32, 32], "cnn_dense": 256,
        },
    )
)
