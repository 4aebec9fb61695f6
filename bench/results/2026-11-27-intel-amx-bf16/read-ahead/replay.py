"""Replay one optimizer step's I/O (gpt-335m shapes, 3 slots, read-ahead 1) with no compute.

Measures what the disk gives this access pattern, against sequential passes over the same
bytes in the same file, in one run."""

import argparse
import sys
import time

sys.path.insert(0, "/work/main")
from outcore.offload.aio import AioEngine, IOFuture
from outcore.offload.buffers import ALIGN, BufferPool, aligned_empty
from outcore.offload.nvme import NvmeStore

ap = argparse.ArgumentParser()
ap.add_argument("--path", default="/work/prof")
ap.add_argument("--slot-mib", type=float, default=42.7)
ap.add_argument("--threads", type=int, default=4)
ap.add_argument("--block-mib", type=int, default=8)
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument(
    "--layout", default="param"
)  # param: m,c,m1,m2 per param; kind: all masters, then ...
ap.add_argument("--scale", type=float, default=1.0)
args = ap.parse_args()

H, L, V = 1024, 24, 50304
shapes = [V * H, 1024 * H]
for _ in range(L):
    shapes += [H, H, 3 * H * H, 3 * H, H * H, H, H, H, 4 * H * H, 4 * H, 4 * H * H, H]
shapes += [H, H]
shapes = [int(s * args.scale) or 1 for s in shapes]
N = sum(shapes)


def up(n):
    return (n + ALIGN - 1) // ALIGN * ALIGN


with (
    AioEngine(args.threads, args.block_mib << 20) as eng,
    NvmeStore(args.path, rank=0, engine=eng, pool=BufferPool(ALIGN, ALIGN)) as st,
):
    ext = []
    if args.layout == "param":
        for n in shapes:
            ext.append({k: st.allocate(n * (2 if k == "c" else 4)) for k in ("m", "c", "a", "b")})
    else:
        per = [{} for _ in shapes]
        for k in ("m", "c", "a", "b"):
            for i, n in enumerate(shapes):
                per[i][k] = st.allocate(n * (2 if k == "c" else 4))
        ext = per
    total = st.file_bytes
    print(
        f"{N / 1e6:.0f}M elements, swap {total / 1e9:.2f} GB, slot {args.slot_mib} MiB, "
        f"threads {args.threads}, block {args.block_mib} MiB, layout {args.layout}"
    )
    big = aligned_empty(64 << 20)
    # fill every extent once
    t = time.perf_counter()
    fs = []
    for e in ext:
        for x in e.values():
            done = 0
            while done < x.nbytes:
                n = min(64 << 20, x.nbytes - done)
                # write in pieces: sub-extent
                from outcore.offload.nvme import Extent

                fs.append(st.write(Extent(x.offset + done, n, up(n)), big[:n]))
                done += n
            if len(fs) > 8:
                for f in fs:
                    f.result()
                fs = []
    for f in fs:
        f.result()
    print(f"fill {total / 1e9:.2f} GB in {time.perf_counter() - t:.2f} s")

    slot_elems = int(args.slot_mib * (1 << 20) / 14) // 1024 * 1024
    slots = [
        {k: aligned_empty(slot_elems * (2 if k == "c" else 4)) for k in ("m", "c", "a", "b")}
        for _ in range(3)
    ]
    # sub-groups over params in reverse (backward order), slices up to slot_elems
    groups, cur, used = [], [], 0
    for i in reversed(range(len(shapes))):
        lo = 0
        while lo < shapes[i]:
            n = min(shapes[i] - lo, slot_elems - used)
            cur.append((i, lo, n))
            used += n
            lo += n
            if used == slot_elems:
                groups.append(cur)
                cur, used = [], 0
    if cur:
        groups.append(cur)
    from outcore.offload.nvme import Extent

    def sub(x, lo_b, n_b):
        return Extent(x.offset + lo_b, n_b, up(n_b))

    def io(g, slot, op):
        out, pos = [], {k: 0 for k in slot}
        for i, lo, n in g:
            for k in ("m", "a", "b") if op == "r" else ("m", "a", "b", "c"):
                s = 2 if k == "c" else 4
                buf = slot[k][pos[k] : pos[k] + up(n * s)]
                pos[k] += up(n * s)
                e = sub(ext[i][k], lo * s, n * s)
                # slices start on 4 KiB boundaries in the real run; here lo*s may not: round
                if (lo * s) % ALIGN:
                    continue
                out.append((st.read if op == "r" else st.write)(e, buf[: n * s]))
        return IOFuture.gather(out)

    for rnd in range(args.rounds):
        r0, w0 = st.bytes_read, st.bytes_written
        t = time.perf_counter()
        owners = [None] * 3
        ahead = None
        turn = 0
        for gi in range(len(groups) + 1):
            if gi < len(groups):
                s = gi % 3
                if owners[s] is not None:
                    owners[s].result()
                    owners[s] = None
                nxt = (io(groups[gi], slots[s], "r"), s)
            else:
                nxt = None
            if ahead is not None:
                f, s0 = ahead
                f.result()
                owners[s0] = io(groups[gi - 1], slots[s0], "w")
            ahead = nxt
        for o in owners:
            if o is not None:
                o.result()
        dt = time.perf_counter() - t
        rb, wb = st.bytes_read - r0, st.bytes_written - w0
        print(
            f"pipeline round {rnd}: read {rb / 1e9:.2f} GB write {wb / 1e9:.2f} GB in "
            f"{dt:.2f} s  ({(rb + wb) / 1e9 / dt:.2f} GB/s mixed)"
        )
        # sequential passes over the first rb bytes: read then write, 64 MiB requests
        for op in ("r", "w"):
            n = rb if op == "r" else wb
            t = time.perf_counter()
            fs = []
            done = 0
            while done < n:
                k = min(64 << 20, n - done)
                e = Extent(done // ALIGN * ALIGN, k, up(k))
                fs.append((st.read if op == "r" else st.write)(e, big[:k]))
                done += k
                if len(fs) >= 4:
                    fs.pop(0).result()
            for f in fs:
                f.result()
            d = time.perf_counter() - t
            print(
                f"  sequential {'read' if op == 'r' else 'write'} {n / 1e9:.2f} GB in "
                f"{d:.2f} s = {n / 1e9 / d:.2f} GB/s"
            )
