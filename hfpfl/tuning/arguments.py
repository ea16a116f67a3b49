"""The tuning flags: the fedpop recipe's own options (hfpfl.arguments.parse_run_args parses and checks them)."""
from __future__ import annotations

from dataclasses import dataclass

from ..options import at_least, in_range, option

#: the tuners by name, in the order --help lists them (each a class registered in hfpfl.tuning's registry). The paper's
#: wrappers (Table 2, "Tuning Wrapper"): RS trains N_c configurations side by side; SHA starts sha_start and
#: eliminates; fedpop_sha / fedex_sha are FedPop / FedEx inside the SHA wrapper (appendix, "FedPop wrapped with SHA").
TUNERS = ("fedpop", "rs", "sha", "fedex", "fedpop_sha", "fedex_sha")
#: how a member's list of per-round scores becomes one score (appendix, "Ablation Study on Score Computation",
#: Table 5): the power-law decay of Eq. 5 (the paper's choice), the plain average, or the last score
SCORES = ("power_law", "avg", "last")


@dataclass
class TunerArguments:
    """Tuning flags: the fedpop recipe's own options (hfpfl.arguments.parse_run_args parses and checks them)."""

    tuner: str = option("fedpop", "fedpop | rs | sha | fedex (all at the same budget); fedpop_sha / fedex_sha: FedPop / "
                        "FedEx wrapped in SHA (sha_start configurations, eliminated as SHA).", choices=list(TUNERS))
    population_size: int = option(4, "N_c: members (RS/FedPop/FedEx). SHA and the SHA-wrapped tuners start sha_start "
                                  "members; the budget is still population_size * rounds_per_member.",
                                  check=at_least(1))
    rounds_per_member: int = option(30, "R_c: rounds each member trains; the budget is R_t = population_size * "
                                    "rounds_per_member rounds.", check=at_least(1))
    generation_rounds: int | None = option(None, "T_g: rounds between FedPop-G steps (default max(1, round(0.1 * "
                                           "R_c)); fedpop_sha: R_c is a survivor's rounds over all SHA stages).",
                                           check=at_least(1))
    rho: int = option(3, "Quantile rate: the best/worst ceil(n / rho) are donors/replaced.", check=at_least(1))
    eps0: float = option(0.1, "Initial perturbation intensity epsilon_0 (a fraction of each range).",
                         check=in_range(0, 1))
    p_re0: float = option(0.1, "Initial resampling probability p_re^0.", check=in_range(0, 1))
    gamma_g: float = option(0.9, "Power-law decay of the FedPop-G score (Eq. 5).", check=in_range(0, 1, low_open=True))
    score: str = option("power_law", "How a member's per-round scores are combined to rank it (FedPop-G, SHA's "
                        "elimination): power_law (Eq. 5, decay gamma_g), avg (their mean) or last (the last round's); "
                        "appendix Table 5.", choices=list(SCORES))
    local_window_frac: float = option(0.2, "FedPop-L runs for ceil(frac * T_g) rounds (>= 1) after a configuration is "
                                      "(re)initialised (appendix); 0 = every round (Algorithm 1).", check=in_range(0, 1))
    delta: float = option(0.2, "Delta-box half-width as a fraction of each range.", check=in_range(0, 1))
    fedpop_l: bool = option(True, "Enable FedPop-L (ablation switch).")
    fedpop_g: bool = option(True, "Enable FedPop-G (ablation switch).")
    search_space: str | None = option(None, "YAML search space (server:/client: blocks, see "
                                      "hfpfl/tuning/search_space.py); default: the paper's (appendix).")
    sha_start: int = option(27, "SHA: initial configurations (27 -> 9 -> 3 -> 1).", check=at_least(1))
    sha_eta: int = option(3, "SHA: elimination rate (each stage keeps ceil(n / sha_eta)).", check=at_least(2))
    fedex_configs: int = option(27, "FedEx: client configurations per member.", check=at_least(1))
    final_finetune_epochs: int = option(1, "Epochs of Loc(beta^0) for the best member's fine-tuned accuracy (0 = "
                                        "none; named apart from fedavg_ft's --finetune_epochs, which a method config "
                                        "may carry).", check=at_least(0))
    resume: bool = option(False, "Continue from output_dir/population.pt if present.")
