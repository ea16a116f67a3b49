"""A config that names a ResNet shortcut (conv + BN, no activation) as an adapter or BN target is refused when the
adapter is built, in one line, instead of failing on the first forward. Refused rather than supported: the adapters
paper's ResNet26 (Elvebakken et al., section III, after Rebuffi et al.) has parameter-free shortcuts, so there is no
shortcut conv for a parallel adapter in the paper to follow."""
import pytest

from hfpfl.models import build_classifier
from hfpfl.models.adapters import ParallelAdapterConfig, ResidualAdapterConfig, get_adapter_model

SHORTCUT = "resnet.encoder.stages.1.layers.0.shortcut"


@pytest.mark.parametrize("config", [ParallelAdapterConfig(norm_modules=[SHORTCUT]),
                                    ParallelAdapterConfig(target_modules=[SHORTCUT]),
                                    ResidualAdapterConfig(target_modules=[SHORTCUT]),
                                    ResidualAdapterConfig(norm_modules=[SHORTCUT])])
def test_shortcut_target_is_refused_at_build_time(config):
    model = build_classifier("tiny-resnet", num_labels=10, image_size=16, num_channels=3)
    with pytest.raises(ValueError, match="shortcut/downsample unit") as err:
        get_adapter_model(model, config)
    assert "\n" not in str(err.value) and "norm_modules" in str(err.value)
