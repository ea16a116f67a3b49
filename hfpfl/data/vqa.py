"""VQA data for FedDAT: the offline ``easy-vqa`` benchmark (real rendered images shipped in the ``easy-vqa`` wheel)
and Hub/local VQA datasets through the same loader as the image sources (:mod:`hfpfl.data.sources`).

``load_vqa_source(name)`` returns a :class:`datasets.Dataset` with the columns ``image`` (Image), ``question``,
``answer``, ``question_type`` (strings) and ``image_id``:

* ``easy-vqa``: the 5,000 64x64 images and 48,248 questions (13 answers) of the ``easy-vqa`` package, offline.
  Question types: ``shape`` ("what shape is ..."), ``color`` ("what color is ..."), ``yesno-shape`` ("does the
  image contain a circle?") and ``yesno-color`` ("is there a red shape?").
* ``owner/name`` (e.g. a VQAv2-style copy on the Hub), ``parquet:<glob>``: ``datasets.load_dataset`` via
  :func:`hfpfl.data.hub_sources._load_external` -- offline and uncached it fails at once with the command that fixes it.
  Columns are normalised (``multiple_choice_answer`` / ``answers`` -> ``answer``; no ``question_type`` -> ``all``).

:func:`vqa_benchmark` builds the federated splits of FedDAT's benchmarks at CPU scale (docs/methods/feddat.md):

* ``function``: one question family per client, shared visual style (textual shift);
* ``scene``: one visual style per client (skimage textures, skimage photo backgrounds, a palette shift, blur,
  noise), every question family (visual shift);
* ``domain``: each client its own style *and* its own question family (both shifts).

The images are split once into a *pretraining pool* (30%, rendered only in the pool styles ``plain`` and
``jitter``, held by no client) and the client images (70%); clients get disjoint images, and each client's test
images are disjoint from its training images. Client splits are in model-input format with numeric columns only:
``input_ids``, ``attention_mask``, ``pixels`` (uint8 [3, H, W]) and ``answer`` (int).

``answer_balance`` (default ``question``): each client split keeps, for every question string, the same number of
questions per answer that string takes in easy-vqa (its 2 yes/no answers 50/50, its 3 shapes or 8 colours uniform),
so the question text alone predicts nothing beyond chance within its family and the answers need the image. Raw
easy-vqa is far from that: a colour yes/no string ("is there a red shape?") is ~86% one answer, so a question-only
model scores ~0.66 on the scene split. ``none`` keeps the raw draw (the earlier benchmark).

The foundation stand-ins are not pretrained on questions or answers: :func:`caption_pool` gives the pool images
(pool styles) with captions built from the pool's own annotations (the image's shape and colour, as easy-vqa states
them for that image), for image-text matching / contrastive / masked or causal language modelling
(:mod:`hfpfl.models.vqa`).

``image_ablation`` (controls that say how much of a score the image explains): ``blank`` replaces every client
image (train and test) by one constant grey image, so a model trained and tested on it is a question-only model;
``shuffle`` permutes the images across the questions of each client split, so images keep their style but no longer
belong to their questions. The pretraining pool is left as it is (the foundation model is the same).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

import datasets
from datasets import Array3D, Dataset, Features, Image, Sequence, Value

from .federated import ClientData, FederatedData
from .hub_sources import _load_external

ANSWERS_SHAPE = ("circle", "rectangle", "triangle")
QUESTION_TYPES = ("shape", "color", "yesno-shape", "yesno-color")
CLIENT_STYLES = ("texture", "photo", "palette", "blur", "noise")
POOL_STYLES = ("plain", "jitter")
SPLITS = ("function", "scene", "domain")
POOL_FRACTION = 0.3
IMAGE_ABLATIONS = ("none", "blank", "shuffle")
ANSWER_BALANCES = ("question", "none")
#: caption templates of the pool images ({c}: colour, {s}: shape); words of the tiny vocabulary
CAPTION_TEMPLATES = ("a {c} {s}", "there is a {c} {s} in the image", "the {s} in the image is {c}",
                     "a picture of a {c} {s}", "the {c} shape is a {s}")
#: the blank image's value: mid-grey, the centre of the [-1, 1] pixel normalisation
BLANK_VALUE = 128
#: the domain-like split: (style, question family) per client
DOMAIN_CLIENTS = (("texture", "shape"), ("photo", "color"), ("palette", "yesno-color"), ("blur", "yesno-shape"),
                  ("noise", "color"))
FUNCTION_STYLE = "noise"   # the shared style of the function-like split (not a pool style)


def question_type(question: str, answer: str) -> str:
    if answer in ANSWERS_SHAPE:
        return "shape"
    if answer in ("yes", "no"):
        return "yesno-shape" if any(s in question for s in ANSWERS_SHAPE) else "yesno-color"
    return "color"


@functools.lru_cache(maxsize=1)
def _easy_vqa_raw():
    try:
        import easy_vqa  # why: a missing package is the one-line fix below, not an error at import
    except ImportError as e:  # pragma: no cover - a pinned dependency
        raise ImportError("--dataset easy-vqa needs the easy-vqa package: pip install easy-vqa==1.0") from e
    rows = []
    for split, qs, paths in (("train", easy_vqa.get_train_questions(), easy_vqa.get_train_image_paths()),
                             ("test", easy_vqa.get_test_questions(), easy_vqa.get_test_image_paths())):
        offset = 0 if split == "train" else len(easy_vqa.get_train_image_paths())
        for q, a, i in zip(*qs):
            rows.append((q, a, question_type(q, a), offset + int(i), paths[i]))
    answers = list(easy_vqa.get_answers())
    return rows, answers


def easy_vqa_answers() -> list[str]:
    return _easy_vqa_raw()[1]


def load_vqa_source(name: str = "easy-vqa") -> Dataset:
    """A VQA source as a ``Dataset`` (image, question, answer, question_type, image_id); see the module docstring."""
    if name == "easy-vqa":
        rows, _ = _easy_vqa_raw()
        feats = Features({"image": Image(), "question": Value("string"), "answer": Value("string"),
                          "question_type": Value("string"), "image_id": Value("int64")})
        return Dataset.from_dict({"image": [r[4] for r in rows], "question": [r[0] for r in rows],
                                  "answer": [r[1] for r in rows], "question_type": [r[2] for r in rows],
                                  "image_id": [r[3] for r in rows]}, features=feats)
    if "/" in name or name.startswith("parquet:"):
        dd = _load_external(name)
        ds = datasets.concatenate_datasets(list(dd.values())) if len(dd) > 1 else next(iter(dd.values()))
        return _normalize_vqa(ds, name)
    raise ValueError(f"unknown VQA source {name!r}: use 'easy-vqa' (offline, built in), a Hub dataset id "
                     "('owner/name') or 'parquet:<path-or-glob>'")


def _normalize_vqa(ds: Dataset, name: str) -> Dataset:
    cols = ds.column_names
    img = next((c for c in ("image", "img", "picture") if c in cols), None)
    if img is None:
        img = next((c for c, f in ds.features.items() if isinstance(f, Image)), None)
    ans = next((c for c in ("answer", "multiple_choice_answer", "answers", "label") if c in cols), None)
    if img is None or "question" not in cols or ans is None:
        raise ValueError(f"VQA source {name!r}: needs image, question and answer columns (answer: answer, "
                         f"multiple_choice_answer or answers), found {cols}")

    def fix(b):
        a = b[ans]
        a = [x[0] if isinstance(x, list) and x else (x.get("answer") if isinstance(x, dict) else x) for x in a]
        a = [x[0]["answer"] if isinstance(x, list) and x and isinstance(x[0], dict) else x for x in a]
        out = {"answer": [str(x) for x in a]}
        if "question_type" not in b:
            out["question_type"] = ["all"] * len(a)
        if "image_id" not in b:
            out["image_id"] = [-1] * len(a)
        return out

    ds = ds.map(fix, batched=True)
    if img != "image":
        ds = ds.rename_column(img, "image")
    if not isinstance(ds.features["image"], Image):
        ds = ds.cast_column("image", Image())
    keep = ["image", "question", "answer", "question_type", "image_id"]
    return ds.select_columns(keep)


# ------------------------------------------------------------------------------------------------ images + styles
@functools.lru_cache(maxsize=4)
def easy_vqa_images(image_size: int = 32) -> np.ndarray:
    """All 5,000 images as uint8 [N, H, W, 3] at ``image_size`` (bilinear), indexed by ``image_id``."""
    from PIL import Image as PILImage  # why: PIL only when images are drawn (not at `import hfpfl.data`)
    import easy_vqa  # why: as in _easy_vqa_raw

    paths = list(easy_vqa.get_train_image_paths().items())
    n_train = len(paths)
    paths += [(n_train + i, p) for i, p in easy_vqa.get_test_image_paths().items()]
    out = np.zeros((len(paths), image_size, image_size, 3), np.uint8)
    for i, p in paths:
        with PILImage.open(p) as im:
            out[i] = np.asarray(im.convert("RGB").resize((image_size, image_size), PILImage.BILINEAR))
    return out


@functools.lru_cache(maxsize=8)
def _backgrounds(kind: str, size: int) -> np.ndarray:
    """Real scikit-image textures or photos as uint8 [k, 2*size, 2*size, 3] tiles to crop backgrounds from."""
    import skimage.data as sd  # why: only when photos are read (not at `import hfpfl.data`)
    from PIL import Image as PILImage  # why: PIL only when images are drawn (not at `import hfpfl.data`)

    names = ("brick", "grass", "gravel") if kind == "texture" else ("astronaut", "coffee", "chelsea", "rocket")
    tiles = []
    for n in names:
        a = getattr(sd, n)()
        if a.ndim == 2:
            a = np.stack([a] * 3, -1)
        a = np.asarray(PILImage.fromarray(a[..., :3]).resize((4 * size, 4 * size), PILImage.BILINEAR))
        tiles.append(a)
    return np.stack(tiles)


def apply_style(images: np.ndarray, style: str, seed: int) -> np.ndarray:
    """Render uint8 [N, H, W, 3] images in a visual style; deterministic in ``seed`` and the image order."""
    rng = np.random.default_rng(seed)
    x = images.astype(np.float32)
    n, h, w, _ = x.shape
    if style == "plain":
        return images.copy()
    if style == "jitter":  # pool style: brightness/contrast jitter
        a = rng.uniform(0.8, 1.1, (n, 1, 1, 1))
        b = rng.uniform(-20, 20, (n, 1, 1, 1))
        return np.clip(x * a + b, 0, 255).astype(np.uint8)
    if style in ("texture", "photo"):
        bg_mask = (x.min(-1, keepdims=True) > 200)  # easy-vqa backgrounds are near-white, shapes are saturated
        tiles = _backgrounds(style, h)
        out = x.copy()
        for i in range(n):
            t = tiles[rng.integers(len(tiles))]
            oy, ox = rng.integers(0, t.shape[0] - h), rng.integers(0, t.shape[1] - w)
            bg = t[oy:oy + h, ox:ox + w].astype(np.float32)
            if style == "texture":
                bg = 0.6 * bg + 0.4 * 128
            out[i] = np.where(bg_mask[i], bg, x[i])
        return np.clip(out, 0, 255).astype(np.uint8)
    if style == "palette":  # colour channels rotated: the strongest client-specific shift (colours look different)
        return images[..., [2, 0, 1]].copy()
    if style == "blur":
        from scipy.ndimage import gaussian_filter  # why: scipy.ndimage costs ~0.4 s to import

        return np.clip(gaussian_filter(x, sigma=(0, 1.2, 1.2, 0)), 0, 255).astype(np.uint8)
    if style == "noise":
        return np.clip(x + rng.normal(0, 45, x.shape), 0, 255).astype(np.uint8)
    raise ValueError(f"unknown style {style!r}; expected one of {POOL_STYLES + CLIENT_STYLES}")


def ablate_images(images: np.ndarray, how: str, rng: np.random.Generator) -> np.ndarray:
    """``images`` (uint8 [N, H, W, 3], one per question) under an image ablation: ``none`` as they are, ``blank``
    every one the constant grey :data:`BLANK_VALUE`, ``shuffle`` permuted across the N questions by ``rng``."""
    if how == "none":
        return images
    if how == "blank":
        return np.full_like(images, BLANK_VALUE)
    if how == "shuffle":
        return images[rng.permutation(len(images))]
    raise ValueError(f"--image_ablation must be one of {', '.join(IMAGE_ABLATIONS)}, got {how!r}")


# ------------------------------------------------------------------------------------------------ tokenizer
def vqa_words() -> list[str]:
    rows, answers = _easy_vqa_raw()
    words = set(answers)
    for q, *_ in rows:
        words.update(q.replace("?", " ").split())
    return sorted(words)


MAX_QUESTION_TOKENS = 16


def encode(tokenizer, questions: list[str], answers: list[str], answer_list: list[str], images: np.ndarray) -> Dataset:
    enc = tokenizer(list(questions), padding="max_length", truncation=True, max_length=MAX_QUESTION_TOKENS)
    idx = {a: i for i, a in enumerate(answer_list)}
    n, h, w, c = images.shape
    feats = Features({"input_ids": Sequence(Value("int64")), "attention_mask": Sequence(Value("int64")),
                      "pixels": Array3D((c, h, w), "uint8"), "answer": Value("int64")})
    return Dataset.from_dict({
        "input_ids": np.asarray(enc["input_ids"], np.int64),
        "attention_mask": np.asarray(enc["attention_mask"], np.int64),
        "pixels": np.ascontiguousarray(images.transpose(0, 3, 1, 2)),
        "answer": np.asarray([idx[a] for a in answers], np.int64),
    }, features=feats).with_format("torch")


# ------------------------------------------------------------------------------------------------ answer balance
@functools.lru_cache(maxsize=1)
def question_answer_sets() -> dict[str, tuple[str, ...]]:
    """Every question string of easy-vqa -> the answers it takes anywhere in easy-vqa (sorted)."""
    rows, _ = _easy_vqa_raw()
    out: dict[str, set] = {}
    for r in rows:
        out.setdefault(r[0], set()).add(r[1])
    return {q: tuple(sorted(a)) for q, a in out.items()}


def balanced_by_question(sel: list, answer_sets: dict, cap: int, rng: np.random.Generator) -> list:
    """At most ``cap`` rows of ``sel`` (rows: (question, answer, ...)) in which every question string has the same
    number of rows for each answer of ``answer_sets[question]``: rows are grouped by (question, answer) in a random
    order, a *block* is one row of each answer of one question string, and whole blocks are taken in a random order
    until the next would pass ``cap`` (so a split may hold a few rows fewer than ``cap``). A question string that
    lacks one of its answers in ``sel`` contributes nothing. Returns the rows in a random order."""
    groups: dict[str, dict[str, list]] = {}
    for r in sel:
        groups.setdefault(r[0], {}).setdefault(r[1], []).append(r)
    blocks = []
    for q in sorted(groups):
        answers = answer_sets[q]
        per = [groups[q].get(a, []) for a in answers]
        per = [[g[i] for i in rng.permutation(len(g))] for g in per]
        for j in range(min(len(g) for g in per)):
            blocks.append([g[j] for g in per])
    out = []
    for b in (blocks[i] for i in rng.permutation(len(blocks))):
        if len(out) + len(b) > cap:
            break
        out.extend(b)
    return [out[i] for i in rng.permutation(len(out))]


# ------------------------------------------------------------------------------------------------ caption pool
@functools.lru_cache(maxsize=1)
def image_attributes() -> dict[int, tuple[str, str]]:
    """image id -> (shape, colour), for the images whose easy-vqa questions state both ("what shape is ...?",
    "what color is ...?"): the generator's own record of what it drew."""
    rows, _ = _easy_vqa_raw()
    shape, colour = {}, {}
    for q, a, t, i, _p in rows:
        if t == "shape":
            shape[i] = a
        elif t == "color":
            colour[i] = a
    return {i: (shape[i], colour[i]) for i in sorted(shape) if i in colour}


def caption_pool_ids() -> list[int]:
    """The images of :func:`caption_pool`: the pool images whose shape and colour easy-vqa states."""
    pool, _ = pool_and_client_images()
    attrs = image_attributes()
    return [int(i) for i in pool if int(i) in attrs]


def caption(shape: str, colour: str, template: int) -> str:
    return CAPTION_TEMPLATES[template % len(CAPTION_TEMPLATES)].format(c=colour, s=shape)


def caption_pool(image_size: int = 32, seed: int = 0, captions_per_image: int = 2):
    """The foundation models' pretraining data: the pool images (no client image, :func:`pool_and_client_images`)
    whose shape and colour easy-vqa states, each ``captions_per_image`` times in a pool style (``plain`` / ``jitter``,
    alternating) with a caption naming its colour and shape (:data:`CAPTION_TEMPLATES`, drawn with ``seed``). No
    question and no answer of the VQA task is used. Returns ``(images uint8 [N, H, W, 3], captions, attributes)``
    with ``attributes[i] = (shape, colour)`` (two pairs with equal attributes describe each other's images)."""
    attrs = image_attributes()
    ids = caption_pool_ids()
    rng = np.random.default_rng([seed, 5])
    all_imgs = easy_vqa_images(image_size)
    images, caps, out_attrs = [], [], []
    for k in range(captions_per_image):
        style = POOL_STYLES[k % len(POOL_STYLES)]
        images.append(apply_style(all_imgs[ids], style, seed * 100 + k))
        for i in ids:
            s, c = attrs[i]
            caps.append(caption(s, c, int(rng.integers(len(CAPTION_TEMPLATES)))))
            out_attrs.append((s, c))
    return np.concatenate(images), caps, out_attrs


# ------------------------------------------------------------------------------------------------ benchmark
@dataclass
class VQAClientSpec:
    style: str
    families: tuple[str, ...]

    @property
    def name(self) -> str:
        fam = self.families[0] if len(self.families) == 1 else "all"
        return f"{self.style}/{fam}"


def client_specs(split: str) -> list[VQAClientSpec]:
    if split == "function":
        return [VQAClientSpec(FUNCTION_STYLE, (f,)) for f in QUESTION_TYPES]
    if split == "scene":
        return [VQAClientSpec(s, QUESTION_TYPES) for s in CLIENT_STYLES]
    if split == "domain":
        return [VQAClientSpec(s, (f,)) for s, f in DOMAIN_CLIENTS]
    raise ValueError(f"--vqa_split must be one of {', '.join(SPLITS)}, got {split!r}")


def pool_and_client_images(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Image ids of the pretraining pool and of the clients (disjoint; the pool does not depend on ``seed``, so one
    published foundation model serves every seed without having seen any client image)."""
    rows, _ = _easy_vqa_raw()
    ids = np.unique([r[3] for r in rows])
    order = np.random.default_rng(12345).permutation(ids)
    k = int(round(POOL_FRACTION * len(ids)))
    return np.sort(order[:k]), np.sort(order[k:])


def pretraining_pool(tokenizer, image_size: int = 32, max_questions: int | None = None, seed: int = 0) -> Dataset:
    """The disjoint pool: pool images only, pool styles (plain, jitter), every question family, no client split."""
    rows, answers = _easy_vqa_raw()
    pool, _ = pool_and_client_images()
    pool_set = set(pool.tolist())
    sel = [r for r in rows if r[3] in pool_set]
    rng = np.random.default_rng(seed)
    sel = [sel[i] for i in rng.permutation(len(sel))]
    if max_questions:
        sel = sel[:max_questions]
    imgs = easy_vqa_images(image_size)[[r[3] for r in sel]]
    half = len(sel) // 2
    imgs = np.concatenate([apply_style(imgs[:half], "plain", seed), apply_style(imgs[half:], "jitter", seed + 1)])
    return encode(tokenizer, [r[0] for r in sel], [r[1] for r in sel], answers, imgs)


def vqa_benchmark(split: str = "scene", *, tokenizer, seed: int = 0, train_per_client: int = 400,
                  test_per_client: int = 200, image_size: int = 32, image_ablation: str = "none",
                  answer_balance: str = "question"):
    """A :class:`~hfpfl.data.federated.FederatedData` for one of FedDAT's heterogeneity splits (see module doc).
    Each client draws its own images (disjoint between clients and between its train and test splits).
    ``image_ablation``: ``none`` | ``blank`` | ``shuffle`` (module doc); the questions, answers and their order do
    not depend on it. ``answer_balance``: ``question`` (every question string's answers uniform in each split,
    :func:`balanced_by_question`) | ``none`` (the raw draw)."""
    if image_ablation not in IMAGE_ABLATIONS:
        raise ValueError(f"--image_ablation must be one of {', '.join(IMAGE_ABLATIONS)}, got {image_ablation!r}")
    if answer_balance not in ANSWER_BALANCES:
        raise ValueError(f"--answer_balance must be one of {', '.join(ANSWER_BALANCES)}, got {answer_balance!r}")
    answer_sets = question_answer_sets()

    rows, answers = _easy_vqa_raw()
    specs = client_specs(split)
    _, client_imgs = pool_and_client_images()
    rng = np.random.default_rng([seed, 77])
    img_order = rng.permutation(client_imgs)
    per_client = len(img_order) // len(specs)
    by_image: dict[int, list] = {}
    for r in rows:
        by_image.setdefault(r[3], []).append(r)
    all_imgs = easy_vqa_images(image_size)
    clients, tests = [], []
    for cid, spec in enumerate(specs):
        mine = img_order[cid * per_client:(cid + 1) * per_client]
        n_test_img = int(math.ceil(per_client * test_per_client / (train_per_client + test_per_client)))
        parts = {}
        for which, ids, cap in (("test", mine[:n_test_img], test_per_client), ("train", mine[n_test_img:],
                                                                                 train_per_client)):
            sel = [r for i in ids for r in by_image[int(i)] if r[2] in spec.families]
            if answer_balance == "question":
                sel = balanced_by_question(sel, answer_sets, cap, rng)
            else:
                sel = [sel[j] for j in rng.permutation(len(sel))[:cap]]
            # a balanced split stops before a block that would pass the cap: up to one block (8 answers) short
            if len(sel) < min(cap, 20) - (7 if answer_balance == "question" else 0):
                raise ValueError(f"VQA client {cid} ({spec.name}) has only {len(sel)} {which} questions")
            imgs = apply_style(all_imgs[[r[3] for r in sel]], spec.style, seed=seed * 1000 + cid * 10 + (which == "test"))
            # its own generator: the benchmark's draws (rng) stay the same under every ablation
            imgs = ablate_images(imgs, image_ablation, np.random.default_rng([seed, 78, cid, which == "test"]))
            parts[which] = encode(tokenizer, [r[0] for r in sel], [r[1] for r in sel], answers, imgs)
        clients.append(ClientData(cid, parts["train"], parts["test"], None, spec.name))
        tests.append(parts["test"])
    global_test = datasets.concatenate_datasets(tests).with_format("torch")
    public = pretraining_pool(tokenizer, image_size, max_questions=1000, seed=seed)
    return VQAFederatedData(clients=clients, new_clients=[], global_test=global_test, public=public,
                            num_labels=len(answers), label_names=list(answers), image_size=image_size, num_channels=3)


class VQAFederatedData(FederatedData):
    """FederatedData whose targets are the ``answer`` column (summary, heatmap and save_to_disk work as for images)."""

    def label_histograms(self, which: str = "train", include_new: bool = True) -> np.ndarray:
        rows = [np.bincount(np.asarray(getattr(c, which).with_format(None)["answer"]), minlength=self.num_labels)
                for c in self.clients + (self.new_clients if include_new else [])]
        return np.stack(rows) if rows else np.zeros((0, self.num_labels), np.int64)


__all__ = ["load_vqa_source", "vqa_benchmark", "pretraining_pool", "caption_pool", "balanced_by_question",
           "question_answer_sets", "image_attributes", "ANSWER_BALANCES", "apply_style", "easy_vqa_images",
           "easy_vqa_answers", "client_specs", "question_type", "SPLITS", "QUESTION_TYPES",
           "CLIENT_STYLES", "POOL_STYLES", "IMAGE_ABLATIONS", "ablate_images"]
