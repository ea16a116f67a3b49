"""recipes/fedbasis.py --paper_new_clients: the FedBasis paper's new-client protocol (Sec. 6, Table 2) -- each
domain's shared held-out split cut into validation and test (PFLBED, Sec. 5), every new client trained at each grid
lr from one seed, Last / Best chosen on validation, the means over new clients -- on hand data and stub curves."""
from types import SimpleNamespace

import pytest
from conftest import load_script
from datasets import Dataset

from hfpfl.data.federated import ClientData, FederatedData


@pytest.fixture(scope="module")
def recipe():
    return load_script("recipes/fedbasis.py", "_recipe_fedbasis_protocol")


def _ds(labels, base=0):
    return Dataset.from_dict({"pixel_values": [[float(base + i)] for i in range(len(labels))], "labels": labels})


def _px(ds):
    return [x[0] for x in ds["pixel_values"]]


def test_domain_validation_split_by_hand(recipe):
    """Domain a's shared test split: labels 0 x4, 1 x7 -> validation round(0.25 * 4) = 1 image of class 0 and
    round(0.25 * 7) = round(1.75) = 2 of class 1, the other 8 the test split; domain b (labels 2 x 2: round(0.5) = 0 by Python's
    rounding) keeps its 2 test images and an empty validation split. The cut is shared by every client of a domain
    (participants and new clients alike), the two parts are disjoint and together the whole split, the global test
    split is the domains' test parts, and the training splits are untouched."""
    test_a, test_b = _ds([0, 0, 0, 0] + [1] * 7), _ds([2, 2], base=100)
    clients = [ClientData(0, _ds([0, 1]), test_a, domain="a"), ClientData(1, _ds([1]), test_b, domain="b")]
    new = [ClientData(2, _ds([0]), test_a, domain="a")]
    fed = FederatedData(clients=clients, new_clients=new, global_test=test_a, public=None, num_labels=3,
                        label_names=["x", "y", "z"], image_size=1, num_channels=1)
    out = recipe.with_domain_validation(fed, 0.25, seed=0)
    a, b, n = out.clients[0], out.clients[1], out.new_clients[0]
    assert sorted(a.val["labels"]) == [0, 1, 1] and sorted(a.test["labels"]) == [0] * 3 + [1] * 5
    ids = sorted(_px(a.val) + _px(a.test))
    assert ids == [float(i) for i in range(11)]
    assert len(b.val) == 0 and sorted(_px(b.test)) == [100.0, 101.0]
    assert n.val is a.val and n.test is a.test
    assert all(c.train is o.train for c, o in zip(out.clients + out.new_clients, clients + new))
    assert sorted(_px(out.global_test)) == sorted(_px(a.test) + _px(b.test))
    again = recipe.with_domain_validation(fed, 0.25, seed=0)
    assert _px(again.clients[0].val) == _px(a.val)                                  # seeded


def test_paper_new_client_metrics_by_hand(recipe, monkeypatch):
    """Two new clients (ids 3, 4 after 3 participants), grid (0.1, 0.2), 2 epochs; stub curves (val, test) per
    (client, lr). Each curve is drawn with torch seeded by (round, client, "new-client") -- the same for every lr
    of a client -- and scored on the client's validation split and its test split (label-weighted accuracy
    replaced by a stub that says which split it saw). Client 3: lr 0.1 [(.5,.4) (.6,.5) (.7,.6)],
    lr 0.2 [(.5,.4) (.9,.9) (.1,.2)] -> Last .6 (lr 0.1), Best .9; client 4: lr 0.1 [(.3,.2) (.4,.3) (.2,.1)],
    lr 0.2 [(.3,.2) (.5,.5) (.6,.7)] -> Last .7 (lr 0.2), Best .7. Means: Last .65, Best .8, start .3,
    Delta .15; per lr: lr0 Last (.6 + .1) / 2, Best (.6 + .3) / 2; lr1 Last (.2 + .7) / 2, Best (.9 + .7) / 2."""
    import hfpfl.data.benchmarks as bench
    curves = {(3, 0.1): [(.5, .4), (.6, .5), (.7, .6)], (3, 0.2): [(.5, .4), (.9, .9), (.1, .2)],
              (4, 0.1): [(.3, .2), (.4, .3), (.2, .1)], (4, 0.2): [(.3, .2), (.5, .5), (.6, .7)]}
    seeds, calls, scored = [], [], []
    monkeypatch.setattr(bench, "label_weighted_accuracy",
                        lambda model, client, num_labels: scored.append((client.client_id, client.test)) or 0.0)

    def curve(cid, server_state, data, round_idx, lr, epochs, score):
        calls.append((cid, server_state, data, round_idx, lr, epochs))
        score(None)
        return curves[(cid, lr)]

    news = [ClientData(3, "train3", "test3", val="val3", domain="a"),
            ClientData(4, "train4", "test4", val="val4", domain="b")]
    model = SimpleNamespace(major_only=True)
    algo = SimpleNamespace(config=SimpleNamespace(lr_grid=lambda: [0.1, 0.2]), new_client_curve=curve, model=model)
    sim = SimpleNamespace(data=SimpleNamespace(new_clients=news, num_labels=10), algorithm=algo, num_clients=3,
                          args=SimpleNamespace(new_client_epochs=2), round=6, server_state="S",
                          seed_for=lambda r, c, tag: seeds.append((r, c, tag)) or 1000 * c,
                          seed_torch=lambda s: calls.append(("seed", s)),
                          train_data=lambda c: f"train{c}", recipe_settings={})
    out = recipe.paper_new_client_metrics(sim)
    assert calls == [("seed", 3000), (3, "S", "train3", 6, 0.1, 2), ("seed", 3000), (3, "S", "train3", 6, 0.2, 2),
                     ("seed", 4000), (4, "S", "train4", 6, 0.1, 2), ("seed", 4000), (4, "S", "train4", 6, 0.2, 2)]
    assert seeds == [(6, 3, "new-client")] * 2 + [(6, 4, "new-client")] * 2
    assert scored == [(3, "val3"), (3, "test3")] * 2 + [(4, "val4"), (4, "test4")] * 2
    want = {"new_client_accuracy_lw": .65, "new_best_accuracy_lw": .8, "new_start_accuracy_lw": .3,
            "new_delta_lw": .15, "new_last_lr0_lw": .35, "new_best_lr0_lw": .45, "new_last_lr1_lw": .45,
            "new_best_lr1_lw": .8}
    assert set(out) == set(want)
    for k, v in want.items():
        assert out[k] == pytest.approx(v), k
    assert model.major_only is False


@pytest.mark.parametrize("argv,expected", [
    (["--method", "fedavg"], "--paper_new_clients runs FedBasis' new-client protocol"),
    (["--new_client_epochs", "0"], "--paper_new_clients needs --new_client_epochs >= 1"),
])
def test_paper_protocol_refusals(recipe, tmp_path, capsys, argv, expected):
    """Bad input: one line, exit 2, the option named and the fix said; no output folder."""
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        recipe.main(["--paper_new_clients", "true", *argv, "--output_dir", str(out)])
    assert e.value.code == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and expected in lines[0], lines
    assert not out.exists()


def test_data_without_the_protocol_has_no_validation(recipe, monkeypatch):
    """Without --paper_new_clients the recipe's data is pflbed's as is (no validation split carved out)."""
    import hfpfl.data.benchmarks as bench
    fed = SimpleNamespace(tag="pflbed")
    monkeypatch.setattr(bench, "pflbed", lambda **kw: fed)
    run, data = SimpleNamespace(method="fedbasis", new_client_epochs=0, seed=0), SimpleNamespace(
        num_clients=1, num_new_clients=1, alpha=0.3, max_per_domain=10, image_size=8, num_channels=3)
    opts = recipe.PflbedOptions()
    assert recipe.pflbed_data(run, data, opts) is fed and recipe.pflbed_data(run, data) is fed
    called = []
    monkeypatch.setattr(recipe, "with_domain_validation", lambda f, share, seed: called.append((f, share, seed)) or "cut")
    run = SimpleNamespace(method="fedbasis", new_client_epochs=3, seed=5)
    assert recipe.pflbed_data(run, data, recipe.PflbedOptions(paper_new_clients=True)) == "cut"
    assert called == [(fed, 0.25, 5)]


def test_training_share_is_a_seeded_subset_by_hand(recipe):
    """The paper's Small training size (Sec. 6, suppl.: 50 percent of each new client's training split): the first
    round(0.5 * 10) = 5 of np.random.default_rng(7)'s permutation of the 10 rows, kept in their original order, every
    column cut alike; at least one row (fraction 0.01 of 10 -> 1); fraction 1 is the split itself."""
    import numpy as np
    import torch

    from hfpfl.training.tensor_data import TensorData
    data = TensorData(pixel_values=torch.arange(10.0).view(10, 1, 1, 1) * 3, labels=torch.arange(10))
    assert recipe.training_share(data, 1.0, seed=7) is data
    half = recipe.training_share(data, 0.5, seed=7)
    keep = sorted(np.random.default_rng(7).permutation(10)[:5].tolist())
    assert half.labels.tolist() == keep
    assert half.pixel_values.flatten().tolist() == [3.0 * i for i in keep]
    assert len(recipe.training_share(data, 0.01, seed=7)) == 1


def test_paper_new_clients_train_on_the_small_share(recipe, monkeypatch):
    """--new_client_fraction 0.5: every grid lr of a new client trains on the same half of its training split (4
    rows -> 2), drawn with the seed of (round, client, "new-client-size"); validation and test are not cut."""
    import hfpfl.data.benchmarks as bench
    import torch

    from hfpfl.training.tensor_data import TensorData
    monkeypatch.setattr(bench, "label_weighted_accuracy", lambda model, client, num_labels: 0.5)
    seen, seeds = [], []

    def curve(cid, server_state, data, round_idx, lr, epochs, score):
        seen.append(data.labels.tolist())
        return [(0.5, 0.5), (0.5, 0.5)]

    train = TensorData(pixel_values=torch.zeros(4, 1, 1, 1), labels=torch.arange(4))
    news = [ClientData(3, "train3", "test3", val="val3", domain="a")]
    algo = SimpleNamespace(config=SimpleNamespace(lr_grid=lambda: [0.1, 0.2]), new_client_curve=curve,
                           model=SimpleNamespace(major_only=False))
    sim = SimpleNamespace(data=SimpleNamespace(new_clients=news, num_labels=10), algorithm=algo, num_clients=3,
                          args=SimpleNamespace(new_client_epochs=1), round=6, server_state="S",
                          seed_for=lambda r, c, tag: seeds.append((r, c, tag)) or 11, seed_torch=lambda s: None,
                          train_data=lambda c: train, recipe_settings={"new_client_fraction": 0.5})
    recipe.paper_new_client_metrics(sim)
    import numpy as np
    keep = sorted(np.random.default_rng(11).permutation(4)[:2].tolist())
    assert seen == [keep, keep]
    assert (6, 3, "new-client-size") in seeds
