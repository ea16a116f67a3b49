"""FedBiP's concept level (dissertation ch. 5, Sec. 4.2.2, Eq. 4): a domain concept S (n_s x d_w) and class
concepts V (C x n_v x d_w) trained with the LDM denoising loss on the client's real (non-interpolated) images, every
LDM weight frozen; Adam, lr 0.1, betas (0.9, 0.999) (paper App. A).

Decisions where the paper (dissertation ch. 5) is silent or its code differs:
* Concept training length: ``num_epochs`` (default 50, the paper's Sec. 5.1; App. A says 30) or ``num_steps``; batch 8 (the authors' code).
* Random init (the paper): N(0, s^2) with s the std of the text encoder's token-embedding table (input space) or of
  its output states (output space), so random concepts sit at the scale of real tokens. ``init="words"`` initialises
  from real words (textual-inversion initializer tokens / the authors' code for the output space).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..pipelines.pipeline_fedbip import encode_concept_prompt, expand_template, tokenize_concept_template
from .latents import _vae_size, encode_posterior, images_to_tensor


# ---------------------------------------------------------------------------------------------------------------
# concept level (Eq. 4)
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class ConceptResult:
    domain_concept: torch.Tensor  # S (n_s, d_w)
    class_concepts: torch.Tensor  # V (C, n_v, d_w)
    losses: list = field(default_factory=list)  # training loss per step
    init_domain_concept: torch.Tensor | None = None
    init_class_concepts: torch.Tensor | None = None


def _freeze(*modules):
    flags = [[p.requires_grad for p in m.parameters()] for m in modules]
    for m in modules:
        m.requires_grad_(False)
    return flags


def _restore(modules, flags):
    for m, fl in zip(modules, flags):
        for p, f in zip(m.parameters(), fl):
            p.requires_grad_(f)


@torch.no_grad()
def init_concepts(pipe, num_classes: int, n_s: int = 1, n_v: int = 1, prompt_template: str = "A [S] style of a [V]",
                  init: str = "random", init_std: float | None = None, domain_word: str | None = None,
                  class_words: list[str] | None = None, concept_space: str = "input", generator=None):
    """Initial S (n_s, d_w), V (C, n_v, d_w). ``init="random"`` (the paper) or ``"words"`` (real words' embeddings)."""
    te, tok = pipe.text_encoder, pipe.tokenizer
    d = te.config.hidden_size
    table = te.get_input_embeddings().weight
    if init == "random":
        if init_std is None:
            if concept_space == "input":
                init_std = float(table.std())
            else:
                ids, _, _ = tokenize_concept_template(tok, prompt_template, n_s, n_v)
                init_std = float(te(ids.to(te.device))[0].std())
        S = init_std * torch.randn(n_s, d, generator=generator)
        V = init_std * torch.randn(num_classes, n_v, d, generator=generator)
        return S, V
    if init != "words":
        raise ValueError(f"init must be 'random' or 'words', got {init!r}")
    if domain_word is None or class_words is None or len(class_words) != num_classes:
        raise ValueError("init='words' needs domain_word and one class word per class")

    def word_ids(w, n):
        ids = tok(w, add_special_tokens=False).input_ids or [tok.bos_token_id]
        return [ids[i % len(ids)] for i in range(n)]  # cycle / truncate to n tokens

    if concept_space == "input":
        S = table[word_ids(domain_word, n_s)].detach().float().cpu().clone()
        V = torch.stack([table[word_ids(w, n_v)] for w in class_words]).detach().float().cpu().clone()
        return S, V
    # output space (the authors' code): encoder outputs of the template with the real words at the placeholder positions
    ids, s_pos, v_pos = tokenize_concept_template(tok, prompt_template, n_s, n_v)
    S_acc, V = None, []
    for w in class_words:
        row = ids.clone()
        row[0, s_pos] = torch.tensor(word_ids(domain_word, n_s))
        row[0, v_pos] = torch.tensor(word_ids(w, n_v))
        h = te(row.to(te.device))[0][0].float().cpu()
        S_acc = h[s_pos] if S_acc is None else S_acc + h[s_pos]
        V.append(h[v_pos])
    return S_acc / len(class_words), torch.stack(V)


@torch.no_grad()
def concept_space_scale(text_encoder, tokenizer, prompt_template: str = "A [S] style of a [V]",
                        concept_space: str = "input", n_s: int = 1, n_v: int = 1) -> float:
    """std(space the concepts act in) / std(text-encoder output states).

    The paper's Adam lr 0.1 and perturbation sigma 0.1 come from the authors' code, where the concepts replace the
    text encoder's *output* states (the authors' code); Adam's step size and an additive sigma are absolute, so in the token-
    embedding (input) space, whose scale is the embedding table's std, the same numbers are far too large (measured
    on the MNIST-only tiny LDM: a domain concept 35x the norm of a real token after 40 steps, a perturbation 4x the
    initial concept). Multiplying lr and sigma by this ratio keeps them relative to the space they act in
    (1.0 in output space)."""
    if concept_space == "output":
        return 1.0
    if concept_space != "input":
        raise ValueError(f"concept_space must be 'input' or 'output', got {concept_space!r}")
    ids, _, _ = tokenize_concept_template(tokenizer, prompt_template, n_s, n_v)
    out_std = float(text_encoder(ids.to(text_encoder.device))[0].float().std())
    return float(text_encoder.get_input_embeddings().weight.float().std()) / out_std


def concept_denoising_loss(pipe, noise_scheduler, z0, labels, domain_concept, class_concepts, timesteps, noise,
                           prompt_template: str = "A [S] style of a [V]", concept_space: str = "input"):
    """L_g (Eq. 4) for given latents z(0), timesteps and noise draws (differentiable w.r.t. the concepts)."""
    labels = torch.as_tensor(labels).long()
    zt = noise_scheduler.add_noise(z0, noise, timesteps)
    cond = encode_concept_prompt(pipe.text_encoder, pipe.tokenizer, prompt_template, domain_concept,
                                 class_concepts[labels], concept_space)
    pred = pipe.unet(zt.to(pipe.unet.dtype), timesteps, encoder_hidden_states=cond.to(pipe.unet.dtype)).sample
    return F.mse_loss(pred.float(), noise.float())


def train_concepts(
    pipe,
    images,
    labels,
    num_classes: int,
    n_s: int = 1,
    n_v: int = 1,
    prompt_template: str = "A [S] style of a [V]",
    num_epochs: int = 50,
    num_steps: int | None = None,
    batch_size: int = 8,
    lr: float = 0.1,
    betas: tuple = (0.9, 0.999),
    init: str = "random",
    init_std: float | None = None,
    domain_word: str | None = None,
    class_words: list[str] | None = None,
    init_domain_concept: torch.Tensor | None = None,
    init_class_concepts: torch.Tensor | None = None,
    concept_space: str = "input",
    noise_scheduler=None,
    generator: torch.Generator | None = None,
    progress: bool = False,
    train_domain: bool = True,
    train_class: bool = True,
) -> ConceptResult:
    """Concept-level personalization: optimise only S and V on Eq. 4; the UNet, VAE and text encoder stay frozen
    (their parameters get requires_grad=False for the duration and are never written).

    ``train_domain=False`` / ``train_class=False`` keep S / V at their initial value (the "V only" / "S only"
    ablations of the paper's Table 3 pass the real words' embeddings as the fixed part)."""
    from diffusers import DDPMScheduler

    expand_template(prompt_template, n_s, n_v)
    noise_scheduler = noise_scheduler or DDPMScheduler.from_config(pipe.scheduler.config)
    x = images_to_tensor(images, _vae_size(pipe.vae))
    labels = torch.as_tensor(labels).long()
    if len(labels) != len(x):
        raise ValueError(f"{len(x)} images but {len(labels)} labels")
    if len(labels) and labels.max() >= num_classes:
        raise ValueError(f"label {int(labels.max())} >= num_classes={num_classes}")
    mean, std = encode_posterior(pipe.vae, x)
    sf = pipe.vae.config.scaling_factor
    if init_domain_concept is None or init_class_concepts is None:
        S0, V0 = init_concepts(pipe, num_classes, n_s, n_v, prompt_template, init, init_std, domain_word,
                               class_words, concept_space, generator)
    else:
        S0, V0 = init_domain_concept.float().cpu(), init_class_concepts.float().cpu()
    dev = pipe.unet.device
    S = torch.nn.Parameter(S0.clone().to(dev))
    V = torch.nn.Parameter(V0.clone().to(dev))
    modules = [pipe.unet, pipe.vae, pipe.text_encoder]
    flags = _freeze(*modules)
    S.requires_grad_(train_domain)
    V.requires_grad_(train_class)
    trainable = [p for p, on in ((S, train_domain), (V, train_class)) if on]
    if not trainable:
        raise ValueError("train_concepts: nothing to train (train_domain and train_class are both False)")
    opt = torch.optim.Adam(trainable, lr=lr, betas=betas)
    steps = num_steps if num_steps is not None else num_epochs * math.ceil(len(x) / batch_size)
    T = noise_scheduler.config.num_train_timesteps
    losses = []
    perm, pos = torch.randperm(len(x), generator=generator), 0
    it = range(steps)
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc="concepts")
    try:
        for _ in it:
            if pos + batch_size > len(x) and pos > 0:  # epoch-style shuffling, last partial batch folded over
                perm, pos = torch.randperm(len(x), generator=generator), 0
            idx = perm[pos : pos + batch_size]
            pos += batch_size
            z0 = (mean[idx] + std[idx] * torch.randn(mean[idx].shape, generator=generator)) * sf
            t = torch.randint(0, T, (len(idx),), generator=generator)
            eps = torch.randn(z0.shape, generator=generator)
            loss = concept_denoising_loss(pipe, noise_scheduler, z0.to(dev), labels[idx].to(dev), S, V, t.to(dev),
                                          eps.to(dev), prompt_template, concept_space)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        _restore(modules, flags)
    return ConceptResult(S.detach().cpu().clone(), V.detach().cpu().clone(), losses, S0, V0)

