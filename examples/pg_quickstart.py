"""The quick start: torch.distributed on the mooncake backends.

    torchrun --nproc-per-node 2 examples/pg_quickstart.py                 # CPU tensors, "mooncake-cpu"
    torchrun --nproc-per-node 2 examples/pg_quickstart.py --backend mooncake   # CUDA tensors (a GPU per rank, or shared)

Each rank all-reduces, all-gathers and passes a tensor around a ring, then
prints one line; the values are checked here against their closed formulas.
"""

import argparse
import os

import torch
import torch.distributed as dist

from mooncake import pg  # registers the "mooncake" and "mooncake-cpu" backends


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="mooncake-cpu", choices=["mooncake-cpu", "mooncake"])
    args = parser.parse_args()
    if args.backend == "mooncake":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")

    dist.init_process_group(args.backend)  # env:// from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()

    t = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(t)
    gathered = torch.empty(world, device=device)
    dist.all_gather_into_tensor(gathered, torch.tensor([float(rank)], device=device))
    got = torch.empty(3, device=device)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((3,), float(rank), device=device),
                                                   (rank + 1) % world),
                                        dist.P2POp(dist.irecv, got, (rank - 1) % world)]):
        work.wait()

    assert t.tolist() == [world * (world + 1) / 2] * 4, t
    assert gathered.tolist() == [float(r) for r in range(world)], gathered
    assert got.tolist() == [float((rank - 1) % world)] * 3, got
    active = pg.get_active_ranks(dist.group.WORLD).tolist()
    dist.barrier()
    os.write(1, f"rank {rank} of {world} on {args.backend}: sum {t[0].item()}, ring from {int(got[0].item())}, "
                f"active ranks {active}\n".encode())  # one write: the ranks share the terminal
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
