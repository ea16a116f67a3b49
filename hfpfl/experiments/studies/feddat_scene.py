"""FedDAT, its Table 4 ablations and every PEFT baseline on the easy-vqa 'scene' split, with the VQA controls
(the description, rows, claims and controls: :mod:`hfpfl.experiments.studies._feddat`)."""
from hfpfl.experiments.studies._feddat import DESCRIPTION, feddat_study

ROUNDS, TRAIN, TEST = 6, 200, 150

STUDY = feddat_study("scene", rounds=ROUNDS, train=TRAIN, test=TEST,
                     doc=DESCRIPTION.replace("\n", " ").format(split="scene", rounds=ROUNDS, train=TRAIN, test=TEST))
