"""The main job: data-parallel training of a small model on the
"mooncake-cpu" backend, launched with torchrun exactly as users do.

    torchrun --nproc_per_node=4 scripts/pg_demo.py

Each rank trains on its own shard, averages gradients with all_reduce(AVG),
checks that every replica stays bit-identical (all_gather), and hands its
loss to the next rank over point-to-point (send/recv in a ring). At the end
rank 0 compares the result with the same training done in one process, and
times all_reduce against Gloo in the same run.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from mooncake import pg  # noqa: F401  (registers "mooncake-cpu")

STEPS, BATCH, DIM = 20, 64, 256


def make_data(world: int):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(world * BATCH * STEPS, DIM, generator=g)
    w_true = torch.randn(DIM, 1, generator=g)
    return x, x @ w_true + 0.01 * torch.randn(x.shape[0], 1, generator=g)


def step(model, opt, x, y) -> torch.Tensor:
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss.detach()


def main() -> None:
    dist.init_process_group("mooncake-cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = make_data(world)
    torch.manual_seed(1)
    model = torch.nn.Linear(DIM, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for s in range(STEPS):
        lo = (s * world + rank) * BATCH
        loss = step(model, opt, x[lo:lo + BATCH], y[lo:lo + BATCH])
        for p in model.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        opt.step()
        # ring: pass the loss to the next rank, receive the previous rank's
        prev = torch.empty_like(loss)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, loss, (rank + 1) % world),
                                       dist.P2POp(dist.irecv, prev, (rank - 1) % world)])
        for r in reqs:
            r.wait()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    replicas = torch.empty(world * flat.numel())
    dist.all_gather_into_tensor(replicas, flat)
    in_sync = all(torch.equal(r, flat) for r in replicas.view(world, -1))

    # Reference: the same steps in one process, on the union of the shards.
    torch.manual_seed(1)
    ref = torch.nn.Linear(DIM, 1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for s in range(STEPS):
        lo = s * world * BATCH
        step(ref, ref_opt, x[lo:lo + world * BATCH], y[lo:lo + world * BATCH])
        ref_opt.step()
    ref_flat = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    max_err = (flat - ref_flat).abs().max().item()

    gloo = dist.new_group(backend="gloo")
    timings = {}
    for name, group in (("mooncake-cpu", dist.group.WORLD), ("gloo", gloo)):
        t = torch.ones(16 << 10)  # 64 KiB of float32
        for _ in range(5):
            dist.all_reduce(t, group=group)
        dist.barrier(group=gloo)
        t0 = time.perf_counter()
        for _ in range(50):
            dist.all_reduce(t, group=group)
        timings[name] = (time.perf_counter() - t0) / 50 * 1e6
    ok = torch.tensor([int(in_sync and max_err < 1e-4)])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if rank == 0:
        print(f"world {world}: {STEPS} data-parallel steps; every replica holds the same parameters: {in_sync}")
        print(f"max |distributed - single-process| parameter difference: {max_err:.2e}")
        print(f"64 KiB all_reduce: mooncake-cpu {timings['mooncake-cpu']:.0f} µs, gloo {timings['gloo']:.0f} µs "
              f"({timings['gloo'] / timings['mooncake-cpu']:.1f}x)")
        print("demo passed" if int(ok) else "demo FAILED")
    dist.destroy_process_group()
    if not int(ok):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
