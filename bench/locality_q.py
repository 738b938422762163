"""The exchange fraction Q of ``--sampler local`` at ImageNet size: bytes read on their own node and
how much of a node's sample set changes between epochs, for Q in {0, 0.05, 0.1, 0.2}.

``python -m bench.locality_q [--nodes 16 --ranks-per-node 8 --samples 1281167]`` (CPU, seconds).
Owners are uniform over the nodes, as CRC16 key slots spread the samples over the masters.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from client.locality_sampler import plan_epoch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=16)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--samples", type=int, default=1_281_167)
    args = p.parse_args()
    n, nodes, per = args.samples, args.nodes, args.ranks_per_node
    owners = np.random.default_rng(0).integers(0, nodes, n).astype(np.int16)
    node_of_rank = np.repeat(np.arange(nodes), per)
    print(f"{n} samples, {nodes} nodes x {per} ranks (uniform sampling: {100 / nodes:.2f} % local)")
    for q in (0.0, 0.05, 0.1, 0.2):
        t = time.perf_counter()
        a = plan_epoch(owners, node_of_rank, seed=0, epoch=3, exchange=q)
        dt = time.perf_counter() - t
        b = plan_epoch(owners, node_of_rank, seed=0, epoch=4, exchange=q)
        s3, s4 = (set(np.concatenate(x.per_rank[:per]).tolist()) for x in (a, b))
        print(f"Q={q:<5} local {100 * a.local_fraction:6.2f} %  node 0's set changed e3->e4 "
              f"{100 * (1 - len(s3 & s4) / len(s3)):5.2f} %  plan {dt:.2f} s")


if __name__ == "__main__":
    main()
