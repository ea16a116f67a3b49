"""FedDAT, FedDAT w/o mutual KD, Adapter and Adapter-L on the easy-vqa 'scene' split, with the VQA controls.

FedDAT (Chen et al., AAAI 2024; Chen 2025, dissertation, Ch. 3) claims FedDAT >= Adapter >= Adapter-L (Tables 2-3),
FedDAT > w/o MKD > Adapter and A_s >= DAT >= A_c at inference (Table 4), on ViLT-B over VQA clients. Here the
offline easy-vqa benchmark ('scene': see hfpfl.data.vqa) with the tiny ViLT stand-in (hfpfl/tiny-vilt-easyvqa-pool,
pretrained on a disjoint image pool with the same 13 answers), {rounds} rounds of one local epoch, {train} training and
{test} test questions per client, batch 32, AdamW lr 1e-3 and weight decay 0.01 with the recipe's per-round warm-up
and linear decay (the paper: lr 1e-4, batch 64, 20 rounds). Adapter-L trains one local epoch per round like the
others (the paper: 20 epochs). The controls: chance (uniform over the client's own answers), each client's
majority answer, the Adapter model before training (its client head is random), the stand-in with its own
pool-trained answer head before training, and Adapter trained and tested on blank images
(question-only) or on images shuffled across questions (--image_ablation). If the question-only control matches the
methods, this benchmark cannot rank them: the claims below are evaluated all the same. Matched by epochs: the steps
column counts local batches; FedDAT takes two optimizer steps on each (A_s, then A_c), Adapter one. Cut to fit the time: LoRA, prompt, bias, full,
clf-L and the two teacher ablations (w/o A_s, w/o A_c); the BLIP stand-in."""
from hfpfl.experiments.studies._feddat import feddat_study

ROUNDS, TRAIN, TEST = 6, 200, 150

STUDY = feddat_study("scene", rounds=ROUNDS, train=TRAIN, test=TEST,
                     doc=__doc__.split("\n\n", 1)[1].replace("\n", " ").format(rounds=ROUNDS, train=TRAIN, test=TEST))
