"""One-shot baselines of the FedBiP paper's Tables 1-2 that use the same frozen LDM and server pipeline as FedBiP
(dissertation ch. 5, Sec. 5.1): :mod:`.fgl` (clients upload captions) and :mod:`.feddeo` (clients upload
optimised per-class descriptions). DENSE and FedD3 need no LDM: :mod:`hfpfl.algorithms.dense`,
:mod:`hfpfl.algorithms.fedd3`. Importing this package registers the two methods and loads no model code."""
from . import feddeo, fgl  # noqa: F401  (registration)
