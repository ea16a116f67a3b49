"""Pretraining of the tiny LDM on the broad public pool and its publishing: the recipe side of FedBiP's LDM
(``recipes/pretrain_ldm.py`` runs it; the tests import it). A FedBiP run never imports this package: it loads the
snapshot shipped with hfpfl (:mod:`hfpfl.fedbip.publish`) or any other LDM (:func:`hfpfl.fedbip.ldm.resolve_ldm`);
an import-linter contract in pyproject.toml checks that.

* :mod:`.config`   :class:`PretrainConfig`, the budget per device kind, the model config it builds
* :mod:`.loops`    the VAE, text-tower (LiT) and UNet training loops
* :mod:`.report`   the quality report (plain-prompt fidelity, grids per style) and the model card
* :mod:`.publish`  pretrain and publish into the local Hub cache (:func:`hfpfl.hub.ensure_published`)
"""

from .config import PRETRAIN_BUDGETS, PretrainConfig, ldm_config, resolve_pretrain_config
from .loops import pretrain_text_tower, pretrain_tiny_ldm, text_separation
from .publish import pretrain_and_publish, pretrain_ldm
from .report import measure_cached_ldm, measure_ldm, model_card, plain_prompt_fidelity
