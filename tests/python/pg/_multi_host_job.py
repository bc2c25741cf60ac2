"""One rank of a job whose ranks run on several "hosts" (separate user+pid
namespaces, see test_multi_host.py). Started by torchrun (env://) or by
test_multi_host's launcher. Checks every collective of mooncake-cpu against
Gloo over the same ranks, then prints one line "RANK r OK <facts>".

Argument "fail": rank world-1 exits after the first collective; the others'
next collective must complete over the survivors (not hang), with the
failure hint naming it: "RANK r SURVIVED <seconds> HINT <hint> VALUE <v>".

Argument "stall": the same, but rank world-1 stops itself (SIGSTOP): alive,
its connections open, silent.

Argument "cut": rank 2 (the second host's leader) has its traffic cut after
the first collective (pg._test_cut_traffic) and keeps calling collectives;
the others' next collective completes over the survivors: "RANK r SURVIVED
... AFTER <v>"; the cut rank reports how its calls failed: "RANK 2 CUT ...".
"""

import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from mooncake import pg  # registers "mooncake-cpu"

MODE = sys.argv[1] if len(sys.argv) > 1 else "check"


def say(line):
    os.write(1, (line + "\n").encode())  # one write: ranks may share a pipe


def same(a, b, what):
    if a.dtype == torch.bfloat16:  # partial sums round differently from Gloo's order
        ok = torch.allclose(a.double(), b.double(), rtol=1e-2, atol=0.1)
    elif a.dtype.is_floating_point:
        ok = torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-4)
    else:
        ok = torch.equal(a, b)
    if not ok:
        raise AssertionError(f"rank {dist.get_rank()}: {what}: mooncake {a.flatten()[:8]} vs gloo {b.flatten()[:8]}")


def check_everything(gloo):
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(1234 + rank)
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for n in (1, 1237, 300_000):
            def data(scale=1):
                if dtype.is_floating_point:
                    return (torch.randn(n, generator=gen) * scale).to(dtype)
                return torch.randint(-1000, 1000, (n,), generator=gen, dtype=dtype)

            x = data()
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN):
                ours, ref = x.clone(), x.clone()
                dist.all_reduce(ours, op=op)
                dist.all_reduce(ref, op=op, group=gloo)
                same(ours, ref, f"all_reduce {op} {dtype} {n}")
            ours = x.clone()
            dist.all_reduce(ours, op=dist.ReduceOp.AVG)
            ref = x.clone().double()
            dist.all_reduce(ref, group=gloo)
            expect = (ref / world).to(dtype) if dtype.is_floating_point else torch.div(ref, world, rounding_mode="trunc").to(dtype)
            same(ours, expect, f"all_reduce AVG {dtype} {n}")
            for root in range(world):
                ours, ref = x.clone(), x.clone()
                dist.broadcast(ours, src=root)
                dist.broadcast(ref, src=root, group=gloo)
                same(ours, ref, f"broadcast root {root} {dtype} {n}")
                ours, ref = x.clone(), x.clone()
                dist.reduce(ours, dst=root)
                dist.reduce(ref, dst=root, group=gloo)
                same(ours, ref if rank == root else x, f"reduce root {root} {dtype} {n}")
            ours = torch.empty(world * n, dtype=dtype)
            dist.all_gather_into_tensor(ours, x)
            same(ours, torch.cat([t for t in _gloo_all_gather(x, gloo)]), f"all_gather {dtype} {n}")
            big = data()
            big = torch.cat([big] + [data() for _ in range(world - 1)])
            ours, ref = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(ours, big)
            full = big.clone()
            dist.all_reduce(full, group=gloo)
            same(ours, full[rank * n:(rank + 1) * n], f"reduce_scatter {dtype} {n}")
    # Uneven all_to_all_single: rank s sends s+d+1 elements to d.
    send_splits = [rank + d + 1 for d in range(world)]
    recv_splits = [s + rank + 1 for s in range(world)]
    inp = torch.cat([torch.full((send_splits[d],), rank * 100 + d, dtype=torch.int32) for d in range(world)])
    out = torch.empty(sum(recv_splits), dtype=torch.int32)
    dist.all_to_all_single(out, inp, recv_splits, send_splits)
    expect = torch.cat([torch.full((recv_splits[s],), s * 100 + rank, dtype=torch.int32) for s in range(world)])
    same(out, expect, "all_to_all_single uneven")
    # Large blocks, ten calls in a row: blocks from other hosts land straight
    # in the caller's buffer (a receive window per block and call) while
    # host mates write theirs through shared memory.
    block = 100_000

    def blocks(src, dst, call):
        return torch.arange(block, dtype=torch.int64) * 1000 + (src * world + dst) * 10 + call

    for call in range(10):
        inp = torch.cat([blocks(rank, d, call) for d in range(world)])
        out = torch.empty(world * block, dtype=torch.int64)
        dist.all_to_all_single(out, inp)
        same(out, torch.cat([blocks(s, rank, call) for s in range(world)]), f"all_to_all_single large, call {call}")
    for root in range(world):
        g = [torch.empty(5) for _ in range(world)] if rank == root else None
        dist.gather(torch.full((5,), float(rank)), g, dst=root)
        if rank == root:
            same(torch.stack(g), torch.arange(world, dtype=torch.float32)[:, None].expand(world, 5), "gather")
        out = torch.empty(3)
        dist.scatter(out, [torch.full((3,), float(10 * d)) for d in range(world)] if rank == root else None, src=root)
        same(out, torch.full((3,), float(10 * rank)), "scatter")
    objs = [None] * world
    # A host: a pid namespace (test_multi_host) or a network namespace (test_netns_hosts).
    host = os.readlink("/proc/self/ns/pid") + os.readlink("/proc/self/ns/net")
    dist.all_gather_object(objs, {"rank": rank, "ns": host})
    assert [o["rank"] for o in objs] == list(range(world))
    # P2P ring crossing hosts.
    got = torch.empty(1000)
    for w in dist.batch_isend_irecv([
        dist.P2POp(dist.isend, torch.full((1000,), float(rank)), (rank + 1) % world),
        dist.P2POp(dist.irecv, got, (rank - 1) % world),
    ]):
        w.wait()
    same(got, torch.full((1000,), float((rank - 1) % world)), "p2p ring")
    big = torch.empty(300_000)  # credited, in place where the neighbour is on another host
    for w in dist.batch_isend_irecv([
        dist.P2POp(dist.isend, torch.arange(300_000, dtype=torch.float32) + rank, (rank + 1) % world),
        dist.P2POp(dist.irecv, big, (rank - 1) % world),
    ]):
        w.wait()
    same(big, torch.arange(300_000, dtype=torch.float32) + (rank - 1) % world, "p2p ring, large")
    # A sub-group across hosts (even ranks) and one inside a host (first two).
    for members in ([r for r in range(world) if r % 2 == 0], [0, 1]):
        sub = dist.new_group(members)
        if rank in members:
            t = torch.full((300_000,), float(rank))
            dist.all_reduce(t, group=sub)
            same(t, torch.full((300_000,), float(sum(members))), f"sub-group {members}")
    dist.barrier()
    hosts = len({o["ns"] for o in objs})
    return f"HOSTS {hosts}"


def _gloo_all_gather(x, gloo):
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x, group=gloo)
    return out


def expect_failure():
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.ones(1000)
    dist.all_reduce(t)
    if rank == world - 1:
        if MODE == "stall":
            os.kill(os.getpid(), signal.SIGSTOP)  # the test kills it once the others are done
        os._exit(0)  # dies without a word
    start = time.monotonic()
    t = torch.ones(1000)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    took = time.monotonic() - start
    hint = pg.get_failed_ranks_hint(work).tolist()
    say(f"RANK {rank} SURVIVED {took:.2f} HINT {hint} VALUE {t[0].item()} LOCAL_SUCCESS {pg.get_local_success(work)}")
    os._exit(0)  # a rank is gone; skip the teardown


CUT = 2


def expect_cut():
    rank = dist.get_rank()
    t = torch.ones(1000)
    dist.all_reduce(t)
    if rank == CUT:
        pg._test_cut_traffic()
        start = time.monotonic()
        for _ in range(50):  # keeps calling collectives until it is told it is cut off
            try:
                dist.all_reduce(torch.ones(1000))
            except Exception as e:  # noqa: BLE001
                cut_off = "lost the membership's control plane" in str(e)
                say(f"RANK {rank} CUT FAILED {time.monotonic() - start:.2f} CUT_OFF {cut_off}")
                if cut_off:
                    break
            time.sleep(0.1)
        os._exit(0)
    start = time.monotonic()
    t = torch.ones(1000)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    took = time.monotonic() - start
    hint = pg.get_failed_ranks_hint(work).tolist()
    after = torch.ones(1000)
    dist.all_reduce(after)
    say(f"RANK {rank} SURVIVED {took:.2f} HINT {hint} VALUE {t[0].item()} LOCAL_SUCCESS {pg.get_local_success(work)} "
        f"AFTER {after[0].item()}")
    os._exit(0)


def main():
    timeout = datetime.timedelta(seconds={"fail": 8, "stall": 8, "cut": 20}.get(MODE, 60))
    dist.init_process_group("mooncake-cpu", timeout=timeout)
    if MODE in ("fail", "stall"):
        expect_failure()
        return
    if MODE == "cut":
        expect_cut()
        return
    gloo = dist.new_group(backend="gloo")
    facts = check_everything(gloo)
    say(f"RANK {dist.get_rank()} OK {facts}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
