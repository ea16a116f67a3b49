"""Sweep FedBiP's noising timestep and choose it without client test data (hfpfl.fedbip.sweep).

    .venv/bin/python scripts/fedbip_noise_sweep.py --seed 0            # the main setting, ~2 min per timestep
    .venv/bin/python scripts/fedbip_noise_sweep.py --seed 0 --variant instance_only
    .venv/bin/python scripts/fedbip_noise_sweep.py --seed 0 --config recipes/configs/fedbip_dirichlet.yaml

For every timestep of the sampler's schedule from its top down to ``resolution_matched`` (or ``--timesteps``), runs
recipes/fedbip.py's FedBiP-L row (or ``--variant``) there (clients noise to t, the sampler starts at t) and reads its
synthetic images: style share (the public-split domain judge), class fidelity (the LDM's public-image judge),
distance to the nearest client train image against the train images' own spacing, and, recorded but not used to
choose, accuracy and the membership-inference gap. Prints the table and the choice; writes sweep.json and sweep.png
to --output_dir. Any other option goes to recipes/fedbip.py (e.g. --config, --num_inference_steps).
"""
import argparse
import dataclasses
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0, help="Run seed (the choice is made on this seed).")
    p.add_argument("--variant", default="fedbip_l", choices=["fedbip_l", "fedbip_s", "instance_only"],
                   help="The row swept (default FedBiP-L: the synthetic set the method hands the server, whose "
                        "closeness to the clients' images is what the floor guards; instance-only: the level alone).")
    p.add_argument("--timesteps", default=None,
                   help="Comma-separated noising timesteps (default: the sampler's, from its top to "
                        "resolution_matched).")
    p.add_argument("--output_dir", default=None, help="Where sweep.json, sweep.png and one folder per timestep go "
                   "(default: outputs/fedbip-noise-sweep-<timestamp>).")
    p.add_argument("--overwrite_output_dir", action="store_true", help="Replace a finished sweep in --output_dir.")
    args, extra = p.parse_known_args(argv)

    from hfpfl.cli import fail

    from hfpfl.fedbip.method import load_ldm
    from hfpfl.fedbip.ldm import resolve_ldm
    from hfpfl.data import build_federated_dataset
    from hfpfl.experiments import fedbip_compare as compare
    from hfpfl.fedbip.latents import sampler_timesteps
    from hfpfl.fedbip.protocol import noising_timestep
    from hfpfl.fedbip.sweep import check_sweepable, choose_noise_timestep, plot_sweep, train_spacing
    from hfpfl.runtime import check_output_dir, resolve_output_dir
    from hfpfl.tracking import atomic_write_text

    out = Path(resolve_output_dir(args.output_dir, "fedbip-noise-sweep"))
    try:
        check_output_dir(out, overwrite=args.overwrite_output_dir, resume=False, finished_marker="sweep.json")
        run, data, cfg, rec = compare.parse(["--seed", str(args.seed), "--variants", args.variant, *extra])
        pipe = load_ldm(resolve_ldm(cfg.ldm))
        pipe.set_sampler(cfg.sampler)
        T = int(pipe.scheduler.config.num_train_timesteps)
        if args.timesteps:
            try:
                timesteps = sorted({int(t) for t in args.timesteps.split(",") if t.strip()}, reverse=True)
            except ValueError:
                raise ValueError(f"--timesteps must be comma-separated integers, got {args.timesteps!r}") from None
            if not timesteps or not all(0 <= t < T for t in timesteps):
                raise ValueError(f"--timesteps must be timesteps of the LDM's schedule, 0 to {T - 1}, got "
                                 f"{args.timesteps!r}")
        else:
            low = noising_timestep(pipe, dataclasses.replace(cfg, noise_timestep="resolution_matched"))[0]
            timesteps = sorted({t for t in sampler_timesteps(pipe.scheduler, cfg.num_inference_steps) if t >= low},
                               reverse=True)
        fed = build_federated_dataset(data, seed=args.seed)   # the split at --data_seed, the few-shot draw at --seed
        check_sweepable(fed, extra)
    except (ValueError, FileExistsError) as e:
        fail(e)
    out.mkdir(parents=True, exist_ok=True)
    floor = train_spacing(fed)
    rows = []
    for t in timesteps:
        res = compare.main(["--seeds", str(args.seed), "--num_processes", "1", "--variants", args.variant,
                            "--noise_timestep", str(t), "--output_dir", str(out / f"t{t}"),
                            "--overwrite_output_dir", "true", *extra])
        r = {k: m["mean"] for k, m in res["variants"][args.variant]["metrics"].items()}
        rows.append({"timestep": t, "style": r.get("synthetic_style"),
                     "class_fidelity": r.get("synthetic_fidelity_judge"), "nn_dist": r["syn_nn_dist_mean"],
                     "mia_loss_gap": r.get("mia_loss_gap"), "accuracy": r["personal_accuracy"]})
    chosen = choose_noise_timestep(rows, floor)
    head = f"{'t':>5} {'style':>6} {'class':>6} {'NN':>6} {'MIA':>6} {'acc':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        mark = "  <- chosen" if chosen is r else ("" if r["nn_dist"] >= floor else "  (below the floor)")
        cls = r["class_fidelity"] if r["class_fidelity"] is not None else float("nan")  # LDM without a judge
        lines.append(f"{r['timestep']:>5} {r['style']:>6.3f} {cls:>6.3f} "
                     f"{r['nn_dist']:>6.3f} {r['mia_loss_gap']:>6.3f} {r['accuracy']:>6.3f}{mark}")
    lines.append(f"floor (train images' leave-one-out spacing) {floor:.3f}; style = domain judge, class = class "
                 f"judge on the synthetic images; NN = distance to the nearest client train image; MIA = loss gap; "
                 f"acc = mean client test accuracy (recorded, not used to choose)")
    lines.append(f"choice: --noise_timestep {chosen['timestep']}" if chosen else
                 "choice: none keeps the floor; keep --noise_timestep sampler_start")
    print("\n".join(lines))
    chosen_t = chosen["timestep"] if chosen else None
    print(plot_sweep(rows, floor, out / "sweep.png", chosen_t, args.variant))
    # the finished marker, written last and atomically: a sweep stopped part-way leaves no sweep.json
    atomic_write_text(out / "sweep.json", json.dumps({"seed": args.seed, "variant": args.variant, "floor": floor,
                                                      "rows": rows, "extra": extra, "chosen": chosen_t}, indent=2))
    return rows, floor, chosen


if __name__ == "__main__":
    main()
