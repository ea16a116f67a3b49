"""DENSE (Zhang et al., "DENSE: Data-Free One-Shot Federated Learning", NeurIPS 2022), a one-shot baseline of the
FedBiP paper's Tables 1-2 (dissertation ch. 5, Sec. 5.1 and App. A: "we first finetune the pretrained ResNet-18 at
each client and then optimize a Generator to conduct model distillation at central server").

One round (``one_shot = True``):

* **client**: trains the classifier on its real train split with the engine's training loop (the run's optimizer,
  ``--local_steps`` / ``--local_epochs``), from the same initial weights as every other row, and uploads its model
  (the ``"model"`` part, bytes counted). Nothing else leaves it.
* **server**: the uploaded models form the teacher ensemble, the mean of their logits (DENSE's ``Ensemble``). A
  generator G(z) and the global classifier (the student) are trained in turns, one step each per iteration, through
  the engine's one training loop with two optimizers on the same batch of noise codes z and target labels y:

  1. generator step (Adam, ``generator_lr``, betas (0.5, 0.999), DENSE's code): on x = G(z),
     L_G = oh * CE(ensemble(x), y) + bn * sum over every teacher BatchNorm layer of
     (||mu(x) - running_mean||_2 + ||var(x) - running_var||_2) + adv * L_adv,
     L_adv = -mean_i[ 1{argmax student(x_i) = argmax ensemble(x_i)} * KL(p_ens(x_i) || p_student(x_i)) ]
     (DENSE's data generation: the one-hot term, the DeepInversion BN-statistics term, and its boundary-support
     adversarial term, which pushes the generator towards samples where the student still agrees with the ensemble
     but their distributions differ). The student's logits here come from it in eval mode (its statistics untouched).
  2. student step (the run's optimizer, e.g. SGD): KL(softmax(ensemble(x)/T) || softmax(student(x)/T)) * T^2 on
     the batch x = G(z) of step 1, detached (DENSE's ``KLDiv``, T = 20).

  The student trains exactly ``classifier_steps`` steps (the budget every row of a FedBiP comparison shares).

Simplifications of DENSE's code (the dissertation only names the method): one generator step per student step on a
fresh z batch, instead of 30 generator steps per epoch whose best batch joins a growing pool of synthetic images the
student replays; targets y uniform over the classes; the generator's architecture is DENSE's (a DCGAN-style
upsampling generator) at the classifier's image size, ending in tanh for model inputs in [-1, 1].
"""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..options import at_least, non_negative, positive, validate
from ..training import TensorData
from ..training.optimizers import make_optimizer
from .base import MODEL, Algorithm, Update, register

logger = logging.getLogger("hfpfl")


@dataclass
class DENSEConfig:
    classifier_steps: int = field(default=500, metadata={
        "help": "Student (global classifier) distillation steps on the server; one generator step precedes each.",
        "check": at_least(1)})
    generator_lr: float = field(default=1e-3, metadata={
        "help": "Adam learning rate of the generator (DENSE's code: 1e-3, betas (0.5, 0.999)).", "check": positive()})
    z_dim: int = field(default=256, metadata={"help": "Noise dimension of the generator (DENSE's code: 256).",
                                              "check": at_least(1)})
    generator_width: int = field(default=64, metadata={"help": "Base channel width ngf of the generator (DENSE: 64).",
                                                       "check": at_least(1)})
    oh_weight: float = field(default=1.0, metadata={
        "help": "Weight of the generator's one-hot term CE(ensemble(x), y) (DENSE's --oh 1).", "check": non_negative()})
    bn_weight: float = field(default=1.0, metadata={
        "help": "Weight of the BatchNorm-statistics term over the teachers' BN layers (DENSE's --bn 1).",
        "check": non_negative()})
    adv_weight: float = field(default=1.0, metadata={
        "help": "Weight of the boundary-support adversarial term (DENSE's --adv 1).", "check": non_negative()})
    temperature: float = field(default=20.0, metadata={
        "help": "Temperature T of the student's distillation loss (DENSE's --T 20; the loss is scaled by T^2).",
        "check": positive()})

    def __post_init__(self):
        validate(self)


class Generator(nn.Module):
    """DENSE's generator (after DeepInversion / CMI): Linear(z) -> (2 ngf, s/4, s/4) -> BN -> up x2 -> conv -> BN ->
    LeakyReLU -> up x2 -> conv -> BN -> LeakyReLU -> conv to the image channels; tanh (model inputs in [-1, 1])."""

    def __init__(self, z_dim: int, image_size: int, channels: int, ngf: int = 64):
        super().__init__()
        if image_size % 4:
            raise ValueError(f"DENSE's generator upsamples twice by 2: the image size must be a multiple of 4, got "
                             f"{image_size}")
        self.init_size = image_size // 4
        self.l1 = nn.Linear(z_dim, ngf * 2 * self.init_size ** 2)
        self.ngf = ngf
        self.conv = nn.Sequential(
            nn.BatchNorm2d(ngf * 2), nn.Upsample(scale_factor=2),
            nn.Conv2d(ngf * 2, ngf * 2, 3, 1, 1, bias=False), nn.BatchNorm2d(ngf * 2), nn.LeakyReLU(0.2),
            nn.Upsample(scale_factor=2),
            nn.Conv2d(ngf * 2, ngf, 3, 1, 1, bias=False), nn.BatchNorm2d(ngf), nn.LeakyReLU(0.2),
            nn.Conv2d(ngf, channels, 3, 1, 1), nn.Tanh())

    def forward(self, z):
        h = self.l1(z).view(len(z), self.ngf * 2, self.init_size, self.init_size)
        return self.conv(h)


class BNStatistics:
    """DeepInversion's feature-statistics hook on one BatchNorm layer: after a forward, ``loss`` = ||mu(input) -
    running_mean||_2 + ||var(input) - running_var||_2, mu and var (biased) over batch and space, per channel."""

    def __init__(self, module: nn.modules.batchnorm._BatchNorm):
        self.loss = torch.zeros(())
        self.handle = module.register_forward_hook(self.hook)

    def hook(self, module, inputs, output):
        x = inputs[0]
        dims = [0, *range(2, x.ndim)]
        mean = x.mean(dims)
        var = x.var(dims, unbiased=False)
        self.loss = torch.norm(module.running_var - var, 2) + torch.norm(module.running_mean - mean, 2)

    def remove(self):
        self.handle.remove()


def logits_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(pixel_values=x)
    return out.logits if hasattr(out, "logits") else out


def kl_per_sample(student_logits, teacher_logits, T: float = 1.0) -> torch.Tensor:
    """KL(softmax(teacher/T) || softmax(student/T)) * T^2 per sample (DENSE's ``kldiv(..., reduction='none')``
    summed over classes)."""
    p = F.softmax(teacher_logits / T, dim=1)
    return (p * (F.log_softmax(teacher_logits / T, dim=1) - F.log_softmax(student_logits / T, dim=1))).sum(1) * T * T


def generator_loss(teacher_logits, student_logits, targets, bn_losses, oh: float, bn: float, adv: float):
    """DENSE's data-generation loss (see the module docstring): returns (total, {term: value})."""
    loss_oh = F.cross_entropy(teacher_logits, targets)
    loss_bn = sum(bn_losses) if bn_losses else teacher_logits.new_zeros(())
    agree = (student_logits.argmax(1) == teacher_logits.argmax(1)).float()
    loss_adv = -(kl_per_sample(student_logits, teacher_logits) * agree).mean()
    total = oh * loss_oh + bn * loss_bn + adv * loss_adv
    return total, {"oh": loss_oh.detach(), "bn": torch.as_tensor(loss_bn).detach(), "adv": loss_adv.detach()}


class Ensemble:
    """The uploaded models, each a frozen copy of the classifier in eval mode; logits = their mean."""

    def __init__(self, template: nn.Module, states: list[dict]):
        self.models = []
        base = template.state_dict()
        for state in states:
            m = copy.deepcopy(template)
            m.load_state_dict({**base, **{k: v.to(base[k].device) for k, v in state.items()}})
            m.eval().requires_grad_(False)
            self.models.append(m)
        self.hooks = [BNStatistics(mod) for m in self.models for mod in m.modules()
                      if isinstance(mod, nn.modules.batchnorm._BatchNorm)]

    def __call__(self, x):
        return torch.stack([logits_of(m, x) for m in self.models]).mean(0)

    def bn_losses(self) -> list:
        return [h.loss for h in self.hooks]

    def close(self):
        for h in self.hooks:
            h.remove()


@register
class DENSE(Algorithm):
    """DENSE: clients upload locally trained models once; the server distils their ensemble into the global
    classifier on data from a generator trained against it."""

    name = "dense"
    aggregation = "gather"
    local_update = "own"
    personal_model = "own"
    Config = DENSEConfig
    one_shot = True
    # the clients' local training reads the run's client hyperparameters; the server distils with its own loop
    uses_server_hparams = frozenset()

    def download(self, server_state, client_id):
        return {MODEL: {k: server_state[MODEL][k] for k in self.global_keys}}  # the shared initial weights

    def init_private_state(self, client_id):
        return {}

    def client_update(self, client_id, down, private, round_idx):
        self.ctx.load(down[MODEL])
        metrics = self.local_train(client_id, round_idx, tag="dense-local")
        return Update(client_id, upload={MODEL: self.ctx.snapshot(self.global_keys)},
                      num_samples=len(self.ctx.train_data(client_id)), metrics=metrics)

    def noise_codes(self, round_idx: int):
        """z (steps x batch, z_dim) and uniform target labels, drawn once from the server's seeded generator."""
        cfg, hp = self.config, self.ctx.run_hparams
        n = cfg.classifier_steps * hp.batch_size
        g = self.ctx.generator(round_idx, -1, "dense-noise")
        z = torch.randn(n, cfg.z_dim, generator=g)
        y = torch.randint(0, self.ctx.data.num_labels, (n,), generator=g)
        return TensorData.of(z=z, labels=y)

    def aggregate(self, server_state, updates, round_idx):
        if not updates:
            return server_state
        cfg, dev = self.config, self.ctx.device
        data = self.ctx.data
        self.ctx.load({k: server_state[MODEL][k] for k in self.global_keys})
        torch.manual_seed(self.ctx.seed_for(round_idx, -1, "dense-generator"))
        gen = Generator(cfg.z_dim, data.image_size, data.num_channels, cfg.generator_width).to(dev)
        ensemble = Ensemble(self.model, [u.upload[MODEL] for u in sorted(updates, key=lambda u: u.client_id)])
        T = cfg.temperature

        made = {}

        def gen_step(model, batch):
            x = gen(batch["z"])
            t = ensemble(x)
            model.eval()  # the student's view of x, its running statistics untouched
            s = logits_of(model, x)
            model.train()
            loss, _ = generator_loss(t, s, batch["labels"], ensemble.bn_losses(), cfg.oh_weight, cfg.bn_weight,
                                     cfg.adv_weight)
            made.update(x=x.detach(), t=t.detach())
            return loss

        def student_step(model, batch):
            # the batch the generator just made and the ensemble's logits on it (one generator and ensemble pass
            # per step: DENSE's student, too, learns from images already synthesised)
            return kl_per_sample(logits_of(model, made["x"]), made["t"], T).mean()

        gen_params = list(gen.parameters())

        def optimizer(params, hp):
            if params is gen_params:
                return torch.optim.Adam(params, lr=cfg.generator_lr, betas=(0.5, 0.999))
            return make_optimizer(params, hp.optimizer, hp.lr, hp.momentum, hp.weight_decay)

        try:
            gen.train()
            metrics = self.local_train(-1, round_idx, params=[gen_params, self.trainable_parameters()],
                                       loss_fn=[gen_step, student_step], steps=cfg.classifier_steps,
                                       data=self.noise_codes(round_idx), optimizer=optimizer, tag="dense-distill")
        finally:
            ensemble.close()
        self.generator = gen
        self.server_training = {k: metrics[k] for k in ("steps", "examples", "train_loss")}
        logger.info("DENSE: distilled %d client models into the classifier over %d steps", len(updates),
                    metrics["steps"])
        return {**server_state, MODEL: self.ctx.snapshot(self.global_keys)}

    def load_personal(self, client_id, server_state, private, round_idx):
        return self.load_global(server_state)

    def personalize_new_client(self, client_id, server_state, data, round_idx):
        return self.load_global(server_state)
