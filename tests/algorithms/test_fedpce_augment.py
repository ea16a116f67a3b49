"""FedPCE's training augmentation (FedPCE paper section 5: zero-pad 4 and random crop, horizontal flip p 0.25,
rotation U(-15, 15) p 0.25, random erasing 16-256 px p 0.5): hfpfl.data.augment on hand-made images with hand-set
parameters, the draws' rates and ranges, and the ``augment`` option of the FedPCE loop."""
from types import SimpleNamespace

import pytest
import torch

from hfpfl.algorithms import get_algorithm
from hfpfl.data import augment as aug
from test_fedpce import TINY, pce_sim  # noqa: F401  (pce_sim: a fixture)

X = torch.arange(16.0).view(1, 1, 4, 4) / 10          # rows 0.0-0.3, 0.4-0.7, 0.8-1.1, 1.2-1.5
B = -1.0                                               # black, the paper's padding value, on model inputs


def _params(**kw):
    p = {"pad": 1, "offsets": torch.tensor([[1, 1]]), "flip": torch.tensor([False]), "rotate": torch.tensor([False]),
         "angle": torch.tensor([0.0], dtype=torch.float64), "erase": torch.tensor([False]),
         "box": torch.tensor([[0, 0, 1, 1]])}
    return {**p, **kw}


def test_pad_and_crop_by_hand():
    """Padding 1 with black, then the 4x4 crop at offset (1, 1) is the image; at (0, 0) it moves down-right by one
    with a black top row and left column; at (2, 0) up by one and right by one."""
    torch.testing.assert_close(aug.apply(X, _params()), X)
    down_right = torch.tensor([[B, B, B, B], [B, 0.0, 0.1, 0.2], [B, 0.4, 0.5, 0.6], [B, 0.8, 0.9, 1.0]])
    torch.testing.assert_close(aug.apply(X, _params(offsets=torch.tensor([[0, 0]])))[0, 0], down_right)
    up_right = torch.tensor([[B, 0.4, 0.5, 0.6], [B, 0.8, 0.9, 1.0], [B, 1.2, 1.3, 1.4], [B, B, B, B]])
    torch.testing.assert_close(aug.apply(X, _params(offsets=torch.tensor([[2, 0]])))[0, 0], up_right)


def test_flip_and_erase_by_hand():
    """flip: columns reversed; erase box (top 1, left 2, 2 x 2): those four pixels 0, the rest unchanged."""
    flipped = torch.tensor([[0.3, 0.2, 0.1, 0.0], [0.7, 0.6, 0.5, 0.4], [1.1, 1.0, 0.9, 0.8], [1.5, 1.4, 1.3, 1.2]])
    torch.testing.assert_close(aug.apply(X, _params(flip=torch.tensor([True])))[0, 0], flipped)
    erased = X[0, 0].clone()
    erased[1, 2] = erased[1, 3] = erased[2, 2] = erased[2, 3] = 0.0
    out = aug.apply(X, _params(erase=torch.tensor([True]), box=torch.tensor([[1, 2, 2, 2]])))
    torch.testing.assert_close(out[0, 0], erased)


def test_rotation_by_hand():
    """0 degrees: unchanged; 90 degrees: a counter-clockwise quarter turn (0 1 2 / 3 4 5 / 6 7 8 -> 2 5 8 / 1 4 7 /
    0 3 6: the centres land on centres, so bilinear sampling is exact); 45 degrees on an all-white (1) 4x4 image:
    the centre pixels stay white; a corner pixel's centre (-0.75, -0.75) (normalised) samples the input at
    (0, -0.75 sqrt 2) = (0, -1.06066), i.e. row ((1 - 1.06066) 4 - 1) / 2 = -0.62132: weight 0.37868 on row 0 (white)
    and the rest on the black fill outside: 0.37868 * 1 + 0.62132 * (-1) = -0.24264."""
    x = torch.arange(9.0).view(1, 1, 3, 3)
    torch.testing.assert_close(aug.rotate(x, torch.tensor([0.0])), x)
    torch.testing.assert_close(aug.rotate(x, torch.tensor([90.0]))[0, 0],
                               torch.tensor([[2.0, 5.0, 8.0], [1.0, 4.0, 7.0], [0.0, 3.0, 6.0]]), atol=1e-5, rtol=0)
    white = aug.rotate(torch.ones(1, 1, 4, 4), torch.tensor([45.0]))[0, 0]
    torch.testing.assert_close(white[1:3, 1:3], torch.ones(2, 2))
    for corner in (white[0, 0], white[0, 3], white[3, 0], white[3, 3]):
        assert float(corner) == pytest.approx(-0.24264, abs=1e-4)


def test_draws_follow_the_papers_rates_and_ranges():
    """4,000 draws at 32 px: flips and rotations about 1/4 of the images, erasures about 1/2 (+-0.03: > 4 standard
    errors); angles within (-15, 15) and reaching near both ends; crop offsets 0..8 (padding 4) with both ends hit;
    erased areas about 16-256 px (rounding of the sides: 9-300), mean near 136; at 16 px the padding is 2 and the
    areas a quarter."""
    p = aug.draw(4000, 32, 32, torch.Generator().manual_seed(0))
    assert p["pad"] == 4
    assert abs(p["flip"].double().mean() - 0.25) < 0.03 and abs(p["rotate"].double().mean() - 0.25) < 0.03
    assert abs(p["erase"].double().mean() - 0.5) < 0.03
    assert -15 <= float(p["angle"].min()) < -14.5 and 14.5 < float(p["angle"].max()) <= 15
    assert int(p["offsets"].min()) == 0 and int(p["offsets"].max()) == 8
    area = (p["box"][:, 2] * p["box"][:, 3]).double()
    assert 9 <= float(area.min()) and float(area.max()) <= 300 and 120 < float(area.mean()) < 152
    top, left, h, w = p["box"].T
    assert bool(((top + h) <= 32).all() and ((left + w) <= 32).all() and (top >= 0).all() and (left >= 0).all())
    small = aug.draw(4000, 16, 16, torch.Generator().manual_seed(0))
    assert small["pad"] == 2 and int(small["offsets"].max()) == 4
    assert 30 < float((small["box"][:, 2] * small["box"][:, 3]).double().mean()) < 38


def test_augmented_loss_sees_the_drawn_augmentation():
    """augment='paper': the loss hook gets the pixels as apply(draw(...)) with the generator the run gives for
    (round, client, tag); labels untouched; augment='none' returns the hooks as they were."""
    cfg = get_algorithm("fedpce").Config(**TINY, augment="paper")
    asked = []
    ctx = SimpleNamespace(generator=lambda r, c, t: asked.append((r, c, t)) or torch.Generator().manual_seed(5))
    stub = SimpleNamespace(config=cfg, ctx=ctx)
    seen = []
    hooks = get_algorithm("fedpce").augmented(stub, {"loss_fn": lambda m, b: seen.append(b) or torch.tensor(0.0)},
                                             3, 2, "augment")
    x = torch.rand(6, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    y = torch.arange(6)
    hooks["loss_fn"](None, {"pixel_values": x, "labels": y})
    assert asked == [(3, 2, "augment")]
    expect = aug.apply(x, aug.draw(6, 16, 16, torch.Generator().manual_seed(5)))
    torch.testing.assert_close(seen[0]["pixel_values"], expect)
    assert torch.equal(seen[0]["labels"], y)
    plain = {"loss_fn": "f"}
    stub.config = get_algorithm("fedpce").Config(**TINY)
    assert stub.config.augment == "none" and get_algorithm("fedpce").augmented(stub, plain, 1, 0, "t") is plain
    with pytest.raises(ValueError, match="^--augment must be one of none, paper"):
        get_algorithm("fedpce").Config(augment="torchvision")


def test_collaborative_and_new_client_training_augment(pce_sim, monkeypatch):  # noqa: F811
    """With augment='paper' every local step of a collaborative round and of a new client's adaptation passes its
    batch through the augmentation (counted by a spy), with the tags 'augment' and 'new-client-augment'."""
    calls = []
    real = aug.paper_augment
    monkeypatch.setattr(aug, "paper_augment", lambda x, g: calls.append(x.shape[0]) or real(x, g))
    sim = pce_sim("fedpce", augment="paper")
    tags = []
    gen = sim.algorithm.ctx.generator
    monkeypatch.setattr(sim.algorithm.ctx, "generator", lambda r, c, t: tags.append(t) or gen(r, c, t))
    sim.step()
    steps = sum(u.metrics["steps"] for u in sim.last_updates)
    assert len(calls) == steps > 0 and tags.count("augment") == len(sim.last_updates)
    calls.clear()
    sim.algorithm.personalize_new_client(sim.num_clients, sim.server_state, sim.algorithm.ctx.train_data(0), 1)
    assert len(calls) == TINY["new_client_steps"] and "new-client-augment" in tags
