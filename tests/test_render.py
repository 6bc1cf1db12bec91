"""render(env_index): RGB uint8 images of one env's current state, for episode recordings."""

import numpy as np
import pytest
import torch

from phalanx.envs import draw, make
from phalanx.slots import random_actions

NAMES = ("cartpole", "pendulum", "bucket_brigade", "trial_nav", "duel")


def _played(name: str, steps: int, seed: int = 0):
    env = make(name, num_envs=3, seed=seed)
    env.reset(seed=seed)
    gen = torch.Generator(device=env.device)
    gen.manual_seed(seed)
    for _ in range(steps):
        env.step(random_actions(env, gen))
    return env


def _is_image(img: torch.Tensor) -> bool:
    return img.dtype == torch.uint8 and img.dim() == 3 and img.shape[2] == 3 and img.device.type == "cpu"


@pytest.mark.parametrize("name", NAMES)
def test_render_is_an_rgb_image_of_the_state(name):
    env = _played(name, 0)
    first = env.render(1)
    assert _is_image(first)
    assert 100 <= first.shape[0] <= 320 and 160 <= first.shape[1] <= 320
    assert len(torch.unique(first.reshape(-1, 3), dim=0)) >= 3  # more than a blank canvas
    assert torch.equal(first, env.render(1))  # rendering does not change anything

    env = _played(name, 12)
    later = env.render(1)
    assert _is_image(later) and later.shape == first.shape
    assert torch.equal(later, env.render(1))
    assert not torch.equal(later, first)  # the state moved on
    # The same state gives the same image: a replay, and a copy loaded from a checkpoint.
    assert torch.equal(later, _played(name, 12).render(1))
    copy = make(name, num_envs=3, seed=5)
    copy.load_state_dict(env.state_dict())
    assert torch.equal(later, copy.render(1))
    # Different envs (in different states) give different images.
    images = [env.render(i) for i in range(3)]
    assert all(im.shape == first.shape for im in images)
    assert not torch.equal(images[0], images[1]) and not torch.equal(images[1], images[2])


@pytest.mark.parametrize("name", ("cartpole", "duel", "trial_nav"))
def test_render_changes_step_by_step(name):
    env = _played(name, 0)
    gen = torch.Generator()
    gen.manual_seed(3)
    frames = [env.render(1)]
    for _ in range(6):
        env.step(random_actions(env, gen))
        frames.append(env.render(1))
    assert all(not torch.equal(a, b) for a, b in zip(frames, frames[1:]))


def test_duel_render_is_in_world_coordinates():
    env = make("duel", num_envs=2, seed=0)
    env.reset(seed=0)
    env.set_fighters(x=torch.tensor([[-3.0, 3.0]]), y=0.0)
    a = env.render(0).numpy().astype(int)
    env.set_fighters(x=torch.tensor([[3.0, -3.0]]), y=0.0)
    b = env.render(0).numpy().astype(int)
    blue, red = np.array([50, 100, 220]), np.array([215, 60, 50])

    def column(img, rgb):  # mean column of the pixels of a fighter's colour below the HUD
        hits = np.argwhere(np.abs(img[24:] - rgb).sum(-1) == 0)
        return hits[:, 1].mean()

    assert column(a, blue) < a.shape[1] / 2 < column(a, red)
    assert column(b, red) < b.shape[1] / 2 < column(b, blue)


def test_trial_strip_and_inner_without_render():
    env = _played("trial_nav", 0)
    img = env.render(0)
    assert img.shape[0] == env.inner.render(0).shape[0] + 20
    assert torch.equal(img[:-20], env.inner.render(0))

    env.inner.renders = False  # an inner env that cannot render (the written flag, no longer a missing method)
    with pytest.raises(NotImplementedError):
        env.render(0)


def test_draw_primitives():
    img = draw.canvas(10, 12, (0, 0, 0))
    draw.fill_rect(img, 2, 3, 5, 6, (255, 0, 0))
    assert (img[3:6, 2:5] == (255, 0, 0)).all() and img[:, :2].sum() == 0 and img[6:].sum() == 0
    draw.fill_circle(img, 9, 5, 2.0, (0, 255, 0))
    assert (img[5, 8] == (0, 255, 0)).all() and img[0, 11].sum() == 0
    draw.draw_line(img, -5, 0.5, 50, 0.5, (0, 0, 255))  # clipped at the border
    assert (img[0] == (0, 0, 255)).all() and img[2].sum() == 0
    draw.fill_polygon(img, ((0, 9), (4, 9), (0, 5)), (9, 9, 9))
    assert (img[8, 0] == 9).all()
    draw.fill_rect(img, 0, 0, 12, 10, (255, 255, 255), alpha=0.5)
    assert img.min() >= 127
    t = draw.to_tensor(img)
    assert _is_image(t) and t.shape == (10, 12, 3)
