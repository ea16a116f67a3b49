"""recipes/feddat.py --validation_per_client: each client's test split is replaced by N questions drawn from its
training split, which loses exactly those (the validation split the FedDAT studies chose their lr on)."""
import datasets
import pytest

from hfpfl.data.federated import ClientData, FederatedData
from hfpfl.experiments.runner import _load_recipe


def _fed(sizes):
    clients = []
    for cid, n in enumerate(sizes):
        ids = list(range(cid * 1000, cid * 1000 + n))
        train = datasets.Dataset.from_dict({"qid": ids, "answer": [i % 3 for i in ids]}).with_format("torch")
        test = datasets.Dataset.from_dict({"qid": [-1], "answer": [0]}).with_format("torch")
        clients.append(ClientData(cid, train, test))
    return FederatedData(clients=clients, new_clients=[], global_test=clients[0].test, public=None, num_labels=3,
                         label_names=["a", "b", "c"], image_size=8, num_channels=3)


def test_validation_is_n_training_questions_held_out_of_training():
    """Client k keeps len - N training questions and reports on the other N; together they are its original training
    questions, none of its original test questions remain, and the global test is the union of the validation sets."""
    rec = _load_recipe("recipes/feddat.py")
    fed = rec.held_out_validation(_fed([40, 50]), 12, seed=0)
    for cid, n in enumerate([40, 50]):
        c = fed.clients[cid]
        tr, va = [int(q) for q in c.train["qid"]], [int(q) for q in c.test["qid"]]
        assert len(tr) == n - 12 and len(va) == 12
        assert sorted(tr + va) == list(range(cid * 1000, cid * 1000 + n))
    assert sorted(int(q) for q in fed.global_test["qid"]) == sorted(int(q) for c in fed.clients for q in c.test["qid"])


def test_validation_too_large_names_the_option():
    """N that leaves a client fewer than 20 training questions is refused, naming the option and the fix."""
    rec = _load_recipe("recipes/feddat.py")
    with pytest.raises(ValueError, match="--validation_per_client 31 .*lower it"):
        rec.held_out_validation(_fed([50]), 31, seed=0)
