"""FedDAT, its Table 4 ablations and every PEFT baseline on the easy-vqa 'function' split with the BLIP stand-in (for
ALBEF), with the VQA controls (the description, rows, claims and controls: :mod:`hfpfl.experiments.studies._feddat`)."""
from hfpfl.experiments.studies._feddat import DESCRIPTION, FULL_LR, LR, feddat_study

ROUNDS, TRAIN, TEST = 10, 200, 150
#: the rows run on fewer seeds than 0-2 (the description's "cut to fit")
CUT = ""

STUDY = feddat_study("function", rounds=ROUNDS, train=TRAIN, test=TEST,
                     doc=DESCRIPTION.replace("\n", " ").format(split="function", rounds=ROUNDS, train=TRAIN, test=TEST,
                                                               lr=LR, cut=CUT, full_lr=FULL_LR))
