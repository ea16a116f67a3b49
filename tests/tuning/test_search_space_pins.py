"""FedPop's search space (dissertation ch. 4, appendix: the search space and Eq. 3) pinned by hand: each kind's
sampling-space coordinate -> value map, clipping, a random source whose draws are known for sampling / Evo / the
Delta-box, the YAML checks (each refusal's whole one-line message), fitting the space to what a method reads, and
the space written back out."""
import dataclasses
import logging
import math

import pytest

from hfpfl.tuning import search_space as ss


class Rng:
    """A random source whose draws are known and recorded: uniform(a, b) -> a + 0.25 (b - a), integers(n) -> n - 1
    (integers(lo, hi) -> hi - 1), choice(seq) -> its last element, random() -> r."""

    def __init__(self, r=0.99):
        self.r, self.calls = r, []

    def uniform(self, a, b):
        self.calls.append(("uniform", a, b))
        return a + 0.25 * (b - a)

    def integers(self, lo, hi=None):
        self.calls.append(("integers", lo, hi))
        return (lo if hi is None else hi) - 1

    def choice(self, seq):
        self.calls.append(("choice", list(seq)))
        return list(seq)[-1]

    def random(self):
        self.calls.append(("random",))
        return self.r


class NoRandom(Rng):
    def random(self):
        raise AssertionError("p_re = 0 draws no resampling coin")


U = ss.Param("u", "uniform", 0.0, 0.5)
L = ss.Param("l", "log10", -4.0, 0.0)
G = ss.Param("g", "log10_one_minus", -4.0, -2.0)
C = ss.Param("c", "choice", values=(8, 16, 32, 64))


# ------------------------------------------------------------------------------------------------ one coordinate
def test_param_sample_clip_and_value_of_each_kind_by_hand():
    """sample: U[a, b] for a continuous coordinate (a + 0.25 (b - a) from the stub), an index in [0, n) for a choice;
    clip: into [a, b] / [0, n - 1]; value: u, 10^u, 1 - 10^u, values[u]; width b - a."""
    rng = Rng()
    assert L.sample(rng) == -3.0 and type(L.sample(rng)) is float and rng.calls[0] == ("uniform", -4.0, 0.0)
    assert C.sample(rng) == 3 and type(C.sample(rng)) is int and rng.calls[-1] == ("integers", 4, None)
    assert (U.continuous, L.continuous, G.continuous, C.continuous) == (True, True, True, False)
    assert (U.width, L.width, G.width) == (0.5, 4.0, 2.0)
    assert (U.clip(-0.1), U.clip(0.7), U.clip(0.2)) == (0.0, 0.5, 0.2)
    assert (L.clip(-4.5), L.clip(0.5), L.clip(-4.0), L.clip(0.0)) == (-4.0, 0.0, -4.0, 0.0)
    assert type(U.clip(0)) is float
    assert (C.clip(-1), C.clip(0), C.clip(3), C.clip(4), C.clip(9)) == (0, 0, 3, 3, 3)
    assert type(C.clip(2.0)) is int
    assert U.value(0.3) == 0.3 and type(U.value(0)) is float
    assert L.value(-2) == pytest.approx(0.01) and L.value(0.0) == 1.0 and type(L.value(-1)) is float
    assert G.value(-2) == pytest.approx(0.99) and G.value(-3) == pytest.approx(0.999) and type(G.value(-2)) is float
    assert C.value(1) == 16 and C.value(3.0) == 64


# ------------------------------------------------------------------------------------------------ the YAML checks
@pytest.mark.parametrize("spec,msg", [
    ([1, 2], "search space client.lr: expected a mapping with 'type', got [1, 2]"),
    ({"type": "log10", "low": -3, "high": 0, "step": 1, "mean": 0},
     "search space client.lr: unknown key(s) ['mean', 'step']; known: ['high', 'low', 'type', 'values']"),
    ({"type": "loguniform", "low": -3, "high": 0},
     "search space client.lr: type 'loguniform' is not one of ('uniform', 'log10', 'log10_one_minus', 'choice')"),
    ({"low": -3, "high": 0},
     "search space client.lr: type None is not one of ('uniform', 'log10', 'log10_one_minus', 'choice')"),
    ({"type": "choice", "values": []}, "search space client.lr: a choice takes a non-empty 'values' list only"),
    ({"type": "choice"}, "search space client.lr: a choice takes a non-empty 'values' list only"),
    ({"type": "choice", "values": [1], "low": 0}, "search space client.lr: a choice takes a non-empty 'values' list only"),
    ({"type": "choice", "values": [1], "high": 0},
     "search space client.lr: a choice takes a non-empty 'values' list only"),
    ({"type": "log10", "low": -3, "high": 0, "values": [1]}, "search space client.lr: log10 takes 'low' and 'high' only"),
    ({"type": "uniform", "high": 0}, "search space client.lr: uniform takes 'low' and 'high' only"),
    ({"type": "uniform", "low": 0}, "search space client.lr: uniform takes 'low' and 'high' only"),
    ({"type": "log10", "low": -1, "high": -3}, "search space client.lr: low -1.0 > high -3.0"),
])
def test_a_bad_parameter_is_refused_with_its_whole_message(spec, msg):
    with pytest.raises(ValueError) as e:
        ss.SearchSpace({"client": {"lr": spec}})
    assert str(e.value) == msg


def test_parameters_parse_to_their_kind_bounds_and_values():
    """low == high is a valid (fixed) range; bounds become floats; a choice keeps its values as a tuple; the
    method: section is parsed too; an empty section is allowed; the default is the appendix's space, copied."""
    s = ss.SearchSpace({"server": {"server_lr": {"type": "log10", "low": 0, "high": 0}}, "client": None,
                        "method": {"mu": {"type": "choice", "values": [0.1, 1]}}})
    p = s.server["server_lr"]
    assert (p.name, p.kind, p.low, p.high, p.values) == ("server_lr", "log10", 0.0, 0.0, ())
    assert type(p.low) is float and type(p.high) is float
    assert s.client == {} and s.method["mu"] == ss.Param("mu", "choice", values=(0.1, 1))
    assert s.is_default is False and ss.SearchSpace().is_default is True
    d = ss.SearchSpace()
    assert set(d.server) == {"server_lr", "server_momentum", "server_lr_decay"} and d.method == {}
    assert d.client["local_epochs"] == ss.Param("local_epochs", "choice", values=(1, 2, 3, 4, 5))
    assert d.client["dropout"] == ss.Param("dropout", "uniform", 0.0, 0.5)
    del d.client["lr"]
    assert "lr" in ss.SearchSpace().client and "lr" in ss.DEFAULT_SPACE["client"]   # each space its own copy
    assert ss.SearchSpace({"method": None}).method == {}


def test_unknown_names_are_refused_with_their_whole_message():
    with pytest.raises(ValueError) as e:
        ss.SearchSpace({"clients": {}, "extra": 1})
    assert str(e.value) == "search space: unknown top-level key(s) ['clients', 'extra']; known: ['client', 'method', " \
                           "'server']"
    with pytest.raises(ValueError) as e:
        ss.SearchSpace({"server": {"lr": {"type": "log10", "low": -1, "high": 0}}})
    known = sorted(f.name for f in dataclasses.fields(ss.ServerHParams))
    assert str(e.value) == (f"search space: server hyperparameter 'lr' is unknown; known: {known} (a method's own "
                            "option, e.g. FedProx mu, goes in a method: section)")
    with pytest.raises(ValueError) as e:
        ss.SearchSpace({"client": {"mu": {"type": "log10", "low": -1, "high": 0}}})
    assert str(e.value) == ("search space: client hyperparameter 'mu' is unknown; known: ['batch_size', 'dropout', "
                            "'local_epochs', 'lr', 'momentum', 'weight_decay'] (a method's own option, e.g. FedProx mu, "
                            "goes in a method: section)")
    with pytest.raises(ValueError) as e:   # a method: parameter is checked like the others, under method.
        ss.SearchSpace({"method": {"mu": {"type": "log10"}}})
    assert str(e.value) == "search space method.mu: log10 takes 'low' and 'high' only"
    with pytest.raises(ValueError) as e:
        ss.SearchSpace({"server": {"server_lr": {"type": "log10"}}})
    assert str(e.value) == "search space server.server_lr: log10 takes 'low' and 'high' only"


# ------------------------------------------------------------------------------------------------ fit_method
class Algo:
    name = "toy"
    uses_server_hparams = ("server_lr",)
    uses_client_hparams = ("lr", "momentum", "dropout")


@dataclasses.dataclass
class Cfg:
    mu: float = 0.1
    epochs: int = 2
    flag: bool = False
    mode: str = "a"


def test_fit_method_drops_what_the_method_ignores_from_the_default_space(caplog):
    """The default space keeps only what the toy method reads (server_lr; lr, momentum, dropout), in the
    default's order, returns the dropped names in order and says so in one warning; adam drops momentum, a model
    without dropout drops dropout; has_dropout=None (not known yet) keeps it."""
    s = ss.SearchSpace()
    with caplog.at_level(logging.INFO, logger="hfpfl"):
        dropped = s.fit_method(Algo, Cfg())
    assert dropped == ["server_momentum", "server_lr_decay", "weight_decay", "local_epochs", "batch_size"]
    assert list(s.server) == ["server_lr"] and list(s.client) == ["lr", "momentum", "dropout"]
    msgs = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert msgs == [("WARNING", "search space: method toy ignores server_momentum, server_lr_decay, weight_decay, "
                                "local_epochs, batch_size; dropped them from the default search space")]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hfpfl"):
        assert s.fit_method(Algo, Cfg(), name="again") == []   # nothing left to drop: no log line
    assert caplog.records == []
    s = ss.SearchSpace()
    assert s.fit_method(Algo, Cfg(), optimizer="adam", has_dropout=False, name="other") == [
        "server_momentum", "server_lr_decay", "momentum", "weight_decay", "local_epochs", "batch_size", "dropout"]
    assert list(s.client) == ["lr"]
    s = ss.SearchSpace()
    s.fit_method(Algo, Cfg(), optimizer="sgd", has_dropout=None)
    assert list(s.client) == ["lr", "momentum", "dropout"]
    s = ss.SearchSpace()
    s.fit_method(Algo, Cfg(), has_dropout=True)
    assert "dropout" in s.client


def _refusal(space, *a, **kw):
    with pytest.raises(ValueError) as e:
        ss.SearchSpace(space).fit_method(*a, **kw)
    return str(e.value)


def test_fit_method_refuses_a_file_naming_what_the_method_ignores_with_the_whole_message():
    assert _refusal({"server": {"server_momentum": {"type": "uniform", "low": 0, "high": 0.5}}}, Algo, Cfg()) == (
        "search space: server hyperparameter 'server_momentum' has no effect on method 'toy' (toy's update does not "
        "read it); remove it from the server: section (the server hyperparameters toy uses: ['server_lr'])")
    assert _refusal({"client": {"batch_size": {"type": "choice", "values": [8]}}}, Algo, Cfg(), name="named") == (
        "search space: client hyperparameter 'batch_size' has no effect on method 'named' (named's update does not "
        "read it); remove it from the client: section (the client hyperparameters named uses: ['dropout', 'lr', "
        "'momentum'])")
    assert _refusal({"client": {"momentum": {"type": "uniform", "low": 0, "high": 0.5}}}, Algo, Cfg(),
                    optimizer="adamw") == (
        "search space: client hyperparameter 'momentum' has no effect on method 'toy' (--optimizer adamw has no "
        "momentum); remove it from the client: section (the client hyperparameters toy uses: ['dropout', 'lr'])")
    assert _refusal({"client": {"dropout": {"type": "uniform", "low": 0, "high": 0.5}}}, Algo, Cfg(),
                    has_dropout=False) == (
        "search space: client hyperparameter 'dropout' has no effect on method 'toy' (the model has no dropout "
        "layer); remove it from the client: section (the client hyperparameters toy uses: ['lr', 'momentum'])")

    class NoServer(Algo):
        uses_server_hparams = ()

    assert _refusal({"server": {"server_lr": {"type": "log10", "low": 0, "high": 0}}}, NoServer, Cfg()).endswith(
        "(the server hyperparameters toy uses: none)")
    # what the method reads is accepted in a file
    ss.SearchSpace({"server": {"server_lr": {"type": "log10", "low": 0, "high": 0}},
                    "client": {"momentum": {"type": "uniform", "low": 0, "high": 0.5},
                               "dropout": {"type": "uniform", "low": 0, "high": 0.5}}}).fit_method(Algo, Cfg())


def test_fit_method_checks_the_method_section_against_the_config_with_the_whole_message():
    log = {"type": "log10", "low": -3, "high": 0}
    assert _refusal({"method": {"mu_": log}}, Algo, Cfg()) == (
        "search space: method hyperparameter 'mu_' is not an option of method 'toy'; did you mean 'mu'? known: "
        "['epochs', 'flag', 'mode', 'mu']")
    assert _refusal({"method": {"zzz": log}}, Algo, Cfg()) == (
        "search space: method hyperparameter 'zzz' is not an option of method 'toy'; known: ['epochs', 'flag', "
        "'mode', 'mu']")
    assert _refusal({"method": {"mu": log}}, Algo, object()) == (
        "search space: method hyperparameter 'mu' is not an option of method 'toy'; known: none (the method has no "
        "options)")
    assert _refusal({"method": {"mode": log}}, Algo, Cfg()) == (
        "search space: method hyperparameter 'mode' of 'toy' is not a number ('a'); give it as {type: choice, "
        "values: [...]}")
    assert _refusal({"method": {"flag": log}}, Algo, Cfg()) == (
        "search space: method hyperparameter 'flag' of 'toy' is not a number (False); give it as {type: choice, "
        "values: [...]}")
    assert _refusal({"method": {"epochs": {"type": "uniform", "low": 1, "high": 3}}}, Algo, Cfg()) == (
        "search space: method hyperparameter 'epochs' of 'toy' is an integer; give it as {type: choice, values: "
        "[...]}")
    choice = {"type": "choice", "values": [1, 2]}
    ss.SearchSpace({"method": {"mu": log, "epochs": choice, "flag": {"type": "choice", "values": [True, False]},
                               "mode": {"type": "choice", "values": ["a", "b"]}}}).fit_method(Algo, Cfg())

    @dataclasses.dataclass
    class Clash:
        lr: float = 0.1

    assert _refusal({"client": {"lr": log}}, Algo, Clash()) == (
        "search space: 'lr' is both a client hyperparameter and an option of 'toy'; rename the option")

    @dataclasses.dataclass
    class ServerClash:
        server_lr: float = 0.1

    assert _refusal({"server": {"server_lr": log}}, Algo, ServerClash()) == (
        "search space: 'server_lr' is both a server hyperparameter and an option of 'toy'; rename the option")


# ------------------------------------------------------------------------------------------------ reading and writing
def test_from_yaml_to_dict_and_params(tmp_path):
    """A YAML file reads into the space it names (an empty file: an empty, non-default space; no file: the
    default); to_dict writes each kind back in the file's format, the method: section only when there is one."""
    assert ss.SearchSpace.from_yaml(None).is_default is True
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    e = ss.SearchSpace.from_yaml(empty)
    assert e.is_default is False and e.server == e.client == e.method == {}
    assert e.to_dict() == {"server": {}, "client": {}}
    f = tmp_path / "s.yaml"
    f.write_text("server:\n  server_lr: {type: log10, low: -1, high: 1}\n"
                 "client:\n  local_epochs: {type: choice, values: [1, 2]}\n"
                 "method:\n  mu: {type: log10_one_minus, low: -3, high: -1}\n")
    s = ss.SearchSpace.from_yaml(str(f))
    assert s.to_dict() == {"server": {"server_lr": {"type": "log10", "low": -1.0, "high": 1.0}},
                           "client": {"local_epochs": {"type": "choice", "values": [1, 2]}},
                           "method": {"mu": {"type": "log10_one_minus", "low": -3.0, "high": -1.0}}}
    assert s.params("server") is s.server and s.params("client") is s.client and s.params("method") is s.method


# ------------------------------------------------------------------------------------------------ vector operations
def test_sample_and_to_values_by_hand():
    rng = Rng()
    params = {"u": U, "c": C, "l": L}
    h = ss.sample(params, rng)
    assert h == {"u": 0.125, "c": 3, "l": -3.0}
    assert ss.to_values(h, params) == pytest.approx({"u": 0.125, "c": 64, "l": 0.001})
    assert ss.to_values({"u": 0.1, "c": 0, "l": 0.0, "extra": 5}, params) == {"u": 0.1, "c": 8, "l": 1.0}


def test_evo_by_hand_with_known_draws():
    """Eq. 3: continuous U(h - eps (b - a), h + eps (b - a)) -> (h - d) + 0.25 (2 d), clipped to [a, b]; discrete
    one step s = max(1, floor(eps (n - 1))) drawn from [-s, 0, s] (the stub takes +s); a coin below p_re resamples
    (at p_re itself it does not); p_re = 0 tosses no coin; eps = 0 keeps every coordinate."""
    params = {"u": U, "c": C, "l": L}
    h = {"u": 0.25, "c": 1, "l": -3.9}
    rng = NoRandom()
    e = ss.evo(h, params, 0.2, 0.0, rng)
    assert e["u"] == pytest.approx(0.25 - 0.1 + 0.25 * 0.2)       # d = 0.2 * 0.5 = 0.1
    assert e["l"] == pytest.approx(-4.0)                          # d = 0.8: U(-4.7, -3.1) -> -4.3, clipped to -4
    assert e["c"] == 2 and rng.calls[1] == ("choice", [-1, 0, 1])  # floor(0.2 * 3) = 0 -> at least one step
    rng = NoRandom()
    assert ss.evo({"c": 0}, {"c": C}, 0.7, 0.0, rng)["c"] == 2 and rng.calls == [("choice", [-2, 0, 2])]
    rng = NoRandom()
    assert ss.evo({"c": 2}, {"c": C}, 1.0, 0.0, rng)["c"] == 3 and rng.calls == [("choice", [-3, 0, 3])]
    rng = NoRandom()
    assert ss.evo(h, params, 0.0, 0.0, rng) == h and rng.calls == []   # eps 0: no draw at all
    assert ss.evo(h, params, -0.1, 0.0, NoRandom()) == h
    # the coin: r < p_re resamples from the whole distribution, r = p_re perturbs
    rng = Rng(r=0.3)
    assert ss.evo(h, params, 0.2, 0.5, rng) == {"u": 0.125, "c": 3, "l": -3.0}
    assert rng.calls[:2] == [("random",), ("uniform", 0.0, 0.5)]
    assert ss.evo(h, params, 0.2, 0.3, Rng(r=0.3)) == e
    assert ss.evo(h, params, 0.0, 0.5, Rng(r=0.3)) == {"u": 0.125, "c": 3, "l": -3.0}


def test_delta_box_bounds_sampling_projection_and_membership_by_hand():
    """The Delta-box (appendix): continuous [max(a, c - delta (b - a)), min(b, c + delta (b - a))], discrete
    [max(0, c - 1), min(n - 1, c + 1)]; sample_ball draws U[lo, hi] / an integer in [lo, hi] (numpy's integers(lo,
    hi + 1)); project_ball clips into the box and keeps an index an int."""
    assert ss.ball_bounds(U, 0.25) == pytest.approx((0.15, 0.35))       # default delta 0.2 of width 0.5
    assert ss.ball_bounds(U, 0.25, 0.4) == pytest.approx((0.05, 0.45))
    assert ss.ball_bounds(U, 0.05, 0.4) == pytest.approx((0.0, 0.25))
    assert ss.ball_bounds(U, 0.45, 0.4) == pytest.approx((0.25, 0.5))
    assert ss.ball_bounds(C, 0) == (0, 1) and ss.ball_bounds(C, 2) == (1, 3) and ss.ball_bounds(C, 3) == (2, 3)
    assert ss.ball_bounds(C, 2, 0.9) == (1, 3)                          # discrete: one index whatever delta
    rng = Rng()
    got = ss.sample_ball({"u": 0.25, "c": 1}, 2, {"u": U, "c": C}, rng)
    assert got == [{"u": pytest.approx(0.15 + 0.25 * 0.2), "c": 2}] * 2
    assert type(got[0]["u"]) is float and type(got[0]["c"]) is int
    assert rng.calls[:2] == [("uniform", pytest.approx(0.15), pytest.approx(0.35)), ("integers", 0, 3)]
    assert len(rng.calls) == 4
    rng = Rng()
    assert ss.sample_ball({"u": 0.25}, 1, {"u": U}, rng, delta=0.4) == [{"u": pytest.approx(0.05 + 0.25 * 0.4)}]
    assert ss.sample_ball({"u": 0.25}, 0, {"u": U}, Rng()) == []
    b0 = {"u": 0.25, "c": 1}
    p = ss.project_ball({"u": 0.5, "c": 3}, b0, {"u": U, "c": C})
    assert p == pytest.approx({"u": 0.35, "c": 2}) and type(p["c"]) is int and type(p["u"]) is float
    assert ss.project_ball({"u": 0.0, "c": 0}, b0, {"u": U, "c": C}) == pytest.approx({"u": 0.15, "c": 0})
    assert ss.project_ball({"u": 0.2, "c": 1}, b0, {"u": U, "c": C}) == {"u": 0.2, "c": 1}
    assert ss.project_ball({"u": 0.5}, b0, {"u": U}, delta=0.4) == pytest.approx({"u": 0.45})
    assert ss.in_ball({"c": 2}, {"c": 1}, {"c": C}) and not ss.in_ball({"c": 3}, {"c": 1}, {"c": C})
    assert ss.in_ball({"u": 0.4, "c": 2}, b0, {"u": U, "c": C}, delta=0.4)
    assert not ss.in_ball({"u": 0.25, "c": 3}, b0, {"u": U, "c": C})   # the second coordinate decides


def test_key_identifies_a_vector_up_to_order_and_rounding():
    """key(h): the (name, value rounded to 12 digits) pairs sorted by name."""
    assert ss.key({"b": 2, "a": 0.1 + 0.2}) == (("a", 0.3), ("b", 2.0))
    assert ss.key({"a": 1.0000000000004}) == ss.key({"a": 1.0}) != ss.key({"a": 1.000000000004})
    assert ss.key({}) == ()
    assert math.isclose(ss.key({"x": 1 / 3})[0][1], 0.333333333333, abs_tol=0)
