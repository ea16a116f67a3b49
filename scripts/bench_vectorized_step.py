"""One vectorized gradient step of many clients' MLP 64-64-10 (bench_simulator's ``--model mlp``), three ways:

  * vmap(grad)   : ``vmap(grad_and_value(functional_call))``, what hfpfl runs for models with convolutions;
  * summed       : ``vmap(functional_call)`` forward, one backward of the clients' summed losses (hfpfl's path for
                   models without convolutions; each client's gradient is its own row);
  * by hand      : the same maths written with ``baddbmm`` (no vmap, no functional_call): the floor for this shape.

    python scripts/bench_vectorized_step.py --clients 20 100 500
Prints ms per step (min over ``--repeats`` blocks) and the largest gradient difference to ``vmap(grad)``.
"""
import argparse
import time

import torch


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, nargs="+", default=[20, 100])
    p.add_argument("--batch_size", type=int, default=10)
    p.add_argument("--steps", type=int, default=100, help="steps per timed block")
    p.add_argument("--repeats", type=int, default=3, help="timed blocks (the minimum is printed)")
    a = p.parse_args()
    for opt, vals in (("--clients", a.clients), ("--batch_size", [a.batch_size]), ("--steps", [a.steps]),
                      ("--repeats", [a.repeats])):
        if min(vals) < 1:
            p.error(f"{opt} must be >= 1, got {min(vals)}")
    from torch.func import functional_call, grad_and_value, vmap

    from bench_simulator import build_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model("mlp", 1, 8)
    print(f"MLP 64-64-10, batch {a.batch_size}, 1 torch thread; ms per step (min of {a.repeats} x {a.steps})")
    print(f"{'clients':>7} {'vmap(grad)':>10} {'summed':>8} {'by hand':>8} {'summed max|dg|':>15}")
    for n in a.clients:
        P = {k: v.detach().unsqueeze(0).repeat(n, *[1] * v.dim()).clone() for k, v in model.named_parameters()}
        x, y = torch.randn(n, a.batch_size, 1, 8, 8), torch.randint(0, 10, (n, a.batch_size))

        def loss(p, xb, yb):
            out = functional_call(model, p, args=(), kwargs={"pixel_values": xb, "labels": yb}, strict=False)
            return out.loss, out.loss

        per_client = vmap(lambda p, xb, yb: grad_and_value(lambda q: loss(q, xb, yb), has_aux=True)(p)[0])
        vloss = vmap(loss)

        def summed():
            leaves = {k: v.detach().requires_grad_() for k, v in P.items()}
            return dict(zip(leaves, torch.autograd.grad(vloss(leaves, x, y)[0].sum(), list(leaves.values()))))

        def by_hand():
            leaves = [v.detach().requires_grad_() for v in P.values()]
            w1, b1, w2, b2, w3, b3 = leaves
            h = torch.relu(torch.baddbmm(b1[:, None], x.flatten(2), w1.transpose(1, 2)))
            h = torch.relu(torch.baddbmm(b2[:, None], h, w2.transpose(1, 2)))
            o = torch.baddbmm(b3[:, None], h, w3.transpose(1, 2))
            ce = torch.nn.functional.cross_entropy(o.flatten(0, 1), y.flatten(), reduction="none")
            return torch.autograd.grad(ce.view(n, -1).mean(1).sum(), leaves)

        ref, got = per_client(P, x, y), summed()
        diff = max((ref[k] - got[k]).abs().max().item() for k in ref)
        row = []
        for f in (lambda: per_client(P, x, y), summed, by_hand):
            for _ in range(10):
                f()
            best = float("inf")
            for _ in range(a.repeats):
                t = time.perf_counter()
                for _ in range(a.steps):
                    f()
                best = min(best, (time.perf_counter() - t) / a.steps * 1e3)
            row.append(best)
        print(f"{n:>7} {row[0]:>10.2f} {row[1]:>8.2f} {row[2]:>8.2f} {diff:>15.1e}")


if __name__ == "__main__":
    main()
