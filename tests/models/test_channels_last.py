"""``--channels_last``: conv weights in channels_last memory format while training on the CPU, and back after."""
import torch
from torch import nn

from hfpfl.training import channels_last_pays, conv_channels_last, optimizer_state_tensors


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 1), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


def _steps(model, n=5):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        x, y = torch.randn(6, 2, 8, 8, generator=g), torch.randint(0, 3, (6,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return opt


def test_conv_channels_last_trains_the_same_weights_in_place():
    plain, cl = _net(), _net()
    _steps(plain)
    w = cl[0].weight
    ptr = w.data_ptr()
    state = cl.state_dict()                                    # a cached state dict shares the weights' storage
    with conv_channels_last(cl):
        assert w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous()
        assert w.stride() == (18, 1, 6, 2) and cl[2].weight.stride() == (4, 1, 4, 4)   # [4, 2, 3, 3], [4, 4, 1, 1]
        opt = _steps(cl)
        buf = optimizer_state_tensors(opt, {id(p): n for n, p in cl.named_parameters()})
    assert w.data_ptr() == ptr and w.is_contiguous()   # the original tensor, back
    assert all(v.is_contiguous() for v in buf.values())                          # optimizer state saves as is
    assert torch.equal(state["0.weight"], w)                   # the cached state dict sees the trained values
    assert not torch.equal(w, _net()[0].weight)                # it trained
    for (k, a), b in zip(plain.state_dict().items(), cl.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=k)   # the same training, to float precision
    with conv_channels_last(cl, enabled=False):                # off: nothing changes
        assert w.data_ptr() == ptr


def test_run_with_channels_last_matches_the_default(run_sim):
    _, off = run_sim("fedavg", num_rounds=1, output_dir="off", channels_last="off")
    sim, on = run_sim("fedavg", num_rounds=1, output_dir="on", channels_last="on")
    assert abs(on["final"]["global_accuracy"] - off["final"]["global_accuracy"]) <= 1 / 60
    assert all(v.is_contiguous() for part in sim.server_state.values() for v in part.values())
    assert all(v.is_contiguous() for v in sim.model.parameters())


def test_auto_picks_cpu_models_whose_convolutions_all_have_stride_1():
    plain = _net()                                                      # stride-1 convolutions only
    strided = nn.Sequential(nn.Conv2d(2, 4, 3, stride=2), nn.Flatten())
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(8, 2))
    assert channels_last_pays(plain, "auto", "cpu") and not channels_last_pays(strided, "auto", "cpu")
    assert channels_last_pays(strided, "on", "cpu") and not channels_last_pays(plain, "off", "cpu")
    assert not channels_last_pays(mlp, "on", "cpu")                    # nothing to convert
    assert not channels_last_pays(plain, "on", "meta") and not channels_last_pays(plain, "auto", "cuda")


def test_pointwise_strided_conv_with_few_channels_stays_contiguous():
    # oneDNN corrupted the heap in this shape's channels_last backward; the 3x3 conv beside it still converts
    net = nn.Sequential(nn.Conv2d(3, 8, 1, stride=2), nn.Conv2d(8, 8, 3), nn.Conv2d(16, 16, 1, stride=2))
    with conv_channels_last(net):
        assert net[0].weight.stride() == (3, 1, 1, 1)                  # [8, 3, 1, 1] contiguous
        assert not net[1].weight.is_contiguous() and net[1].weight.is_contiguous(memory_format=torch.channels_last)
        assert net[2].weight.stride() == (16, 1, 16, 16)               # 16 input channels: channels_last strides


def test_evaluation_under_channels_last_scores_the_same(run_sim):
    sim, _ = run_sim("fedavg", num_rounds=1, output_dir="ev", channels_last="on")
    split = sim.ctx.test_data(0)
    on = sim.ctx.evaluate(sim.model, split)
    sim.args.channels_last = "off"
    off = sim.ctx.evaluate(sim.model, split)
    assert on.keys() == off.keys() and on["accuracy"] == off["accuracy"]
    assert abs(on["loss"] - off["loss"]) <= 1e-5
    assert all(v.is_contiguous() for v in sim.model.parameters())   # the weights are back in their tensors


def test_yaml_on_off_words_reach_the_option_as_words(tmp_path):
    from hfpfl.config import RunArguments
    from hfpfl.arguments import load_config_file
    cfg = tmp_path / "run.yaml"
    cfg.write_text("channels_last: off\nvectorize: on\n")       # YAML 1.1 reads both words as booleans
    assert load_config_file(cfg, [RunArguments]) == {"channels_last": "off", "vectorize": "on"}


def test_a_yaml_boolean_for_other_text_options_is_still_an_error(tmp_path):
    import pytest
    from hfpfl.config import RunArguments
    from hfpfl.arguments import load_config_file
    cfg = tmp_path / "run.yaml"
    cfg.write_text("output_dir: yes\n")                         # not an on/off option: no silent "on" directory
    with pytest.raises(ValueError, match="'output_dir' .* must be text"):
        load_config_file(cfg, [RunArguments])
