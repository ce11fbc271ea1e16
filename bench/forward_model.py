#!/usr/bin/env python3
"""Paper model of forward designs on the benchmark selections (numpy only, no GPU): per case and
design, the K/V bytes moved from L2 into shared memory, the tensor FLOP executed, the operand
bytes the tensor cores read from shared memory, and the lower bound on time these give at the
rates below (the largest of the three). The numbers behind the design notes in
`codegen/src/kernels/forward_sm90.rs` and bench/README.md ("The forward: designs on paper").

    python3 bench/forward_model.py [--cases doc8k,doc32k,packed64k]

Counting (one KV group g, global key block = document start block + local id):
* an *item* of Q queries loads every distinct block its queries selected (its union) once:
  32 KiB of K and 32 KiB of V;
* an m64 tile (4 queries x 16 heads, one consumer warpgroup of the current kernel) is executed
  for every block in the union of its 4 queries: S and PV, 2 * 2*64*128*128 FLOP, reading Q
  (16 KiB), K and V (32 KiB each) from shared memory;
* a per-query pass (S^T = K.Q^T with N = 16 heads, then O^T += V^T.P^T) executes exactly the
  selected (query, block) pairs: 2 * 2*16*128*128 FLOP each; K and V are the A operands and are
  re-read per wgmma group, so once per (block, consumer) when the selecting queries of a
  consumer are gathered into one N = 16 n group, once per pair otherwise. A gathered PV needs
  the gathered queries' O^T accumulators as one register list, which a run-time selection
  cannot name: the buildable rows gather S only and run PV per query (V re-read per pair) or
  per fixed group of 2 or 4 queries, or densely over all of a consumer's queries (P^T zero
  for the queries that did not select the block).
Rates: L2 -> SM 10 TB/s (ncu on the current kernel, packed64k, bench/results/
ncu-forward-packed64k.txt: 77.5 GB at 4.08 TB/s were 37.8 % of the L2 peak at the locked 1.36 GHz,
i.e. a peak near 10.8 TB/s at that clock if bytes are what sets that percentage), bf16 dense 790 TFLOP/s (an 8192^3 torch.mm on this
H200), shared-memory reads 128 B/clk/SM x 132 SMs x 1.98 GHz = 33.5 TB/s. The bounds are ideal;
the current kernel keeps the tensor pipe busy 53 % of its cycles (same ncu run), so a real
design lands near bound / 0.55 unless it also overlaps its softmax with the GEMMs.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import msa_inputs as mi  # noqa: E402

L2_RATE = 10e12
MMA_RATE = 790e12
SMEM_RATE = 128 * 132 * 1.98e9
KV_TILE = 2 * 128 * 128 * 2          # K and V of one block, one group
M64_FLOP = 2 * 2 * 64 * 128 * 128
PAIR_FLOP = 2 * 2 * 16 * 128 * 128
# B operands of one (query, block) pair: Q (16 x 128) for both 64-key halves of S^T, P^T
# (16 x 128 keys) for both 64-wide d halves of O^T.
PAIR_B = 2 * 2 * 16 * 128 * 2
# a PV over all 8 queries of a consumer (N = 128): FLOP and its P^T operand, read per d half
PV8_FLOP = 2 * 128 * 128 * 128
PV8_B = 2 * 128 * 128 * 2
# kernel ms of the current msa_forward_sm90 (bench/results/h200-2026-12-01-forward-baselines.md)
MEASURED = {"doc8k": 1.792, "doc32k": 14.613, "packed64k": 15.324}


def block_base(cu):
    """Per token, the global key block of its document's local block 0 (the documents'
    blocks numbered in order)."""
    np = mi._np()
    base = np.zeros(cu[-1], dtype=np.int64)
    off = 0
    for d in range(len(cu) - 1):
        base[cu[d]:cu[d + 1]] = off
        off += (cu[d + 1] - cu[d] + mi.BLOCK - 1) // mi.BLOCK
    return base


def unions(q2k, cu, size):
    """Sum over index heads and groups of `size` consecutive queries of the number of distinct
    global blocks they selected; and the number of selections."""
    np = mi._np()
    T = cu[-1]
    base = block_base(cu)
    tot = 0
    for h in range(mi.NUM_INDEX_HEADS):
        g = np.where(q2k[h] >= 0, q2k[h] + base[:, None], -1)
        tp = (T + size - 1) // size * size
        gg = np.full((tp, mi.TOPK), -1, dtype=np.int64)
        gg[:T] = g
        s = np.sort(gg.reshape(tp // size, size * mi.TOPK), axis=1)
        tot += int((((s[:, 1:] != s[:, :-1]) & (s[:, 1:] >= 0)).sum(1) + (s[:, 0] >= 0)).sum())
    return tot, int((q2k >= 0).sum())


def coupling(q2k, cu):
    """Per 8-query item of the current kernel, summed over index heads: the m64 tiles executed
    with the fixed split (slots 0-3 to consumer 0, 4-7 to consumer 1) and with the best split
    of the 8 queries into two groups of 4 (35 candidates), the union of the item's blocks (one
    shared K/V ring: both consumers step through every block of it) and the larger of the two
    consumers' own unions (what two independent rings would each walk)."""
    import itertools

    np = mi._np()
    T = cu[-1]
    base = block_base(cu)
    splits = [c for c in itertools.combinations(range(8), 4) if 0 in c]
    fixed = best = union = larger = 0
    for h in range(mi.NUM_INDEX_HEADS):
        g = np.where(q2k[h] >= 0, q2k[h] + base[:, None], -1)
        for i in range(0, T, 8):
            rows = [frozenset(int(x) for x in g[t] if x >= 0) for t in range(i, min(i + 8, T))]
            rows += [frozenset()] * (8 - len(rows))

            def split(c):
                a = frozenset().union(*(rows[s] for s in c))
                b = frozenset().union(*(rows[s] for s in range(8) if s not in c))
                return a, b

            a, b = split((0, 1, 2, 3))
            fixed += len(a) + len(b)
            union += len(a | b)
            larger += max(len(a), len(b))
            best += min(len(x) + len(y) for x, y in map(split, splits))
    return fixed, best, union, larger


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="doc8k,doc32k,packed64k")
    ap.add_argument("--coupling", action="store_true",
                    help="only the consumer-split table of coupling() (pure Python, ~1 min/case)")
    a = ap.parse_args()
    if a.coupling:
        print("| case | m64 tiles, fixed split | best split of the 8 queries | item unions "
              "(shared ring) | larger consumer union (independent rings) |")
        print("|---|---|---|---|---|")
        for name in a.cases.split(","):
            q2k, cu = mi.make_q2k(mi.CASES[name])
            fixed, best, union, larger = coupling(q2k, cu)
            print(f"| {name} | {fixed} | {best} ({best / fixed - 1:+.1%}) | {union} | "
                  f"{larger} ({larger / union - 1:+.1%}) |")
        return
    print("| case | design | L2->smem GB | tensor TFLOP executed | smem operand GB | bound ms | "
          "bound useful TFLOP/s | limit |")
    print("|---|---|---|---|---|---|---|---|")
    for name in a.cases.split(","):
        q2k, cu = mi.make_q2k(mi.CASES[name])
        useful = 2 * 256 * 16 * mi.keys_attended(q2k, cu)
        u = {s: unions(q2k, cu, s)[0] for s in (2, 4, 8, 16, 32)}
        pairs = unions(q2k, cu, 1)[1]
        m64_smem = KV_TILE + 16384          # Q, K and V per m64 tile (P comes from registers)
        designs = [
            # (label, L2 bytes, executed FLOP, smem bytes)
            ("current: 8-query item, m64 tile per 4 queries", u[8] * KV_TILE, u[4] * M64_FLOP,
             u[4] * m64_smem),
            ("smaller item: 4 queries, m64 tile", u[4] * KV_TILE, u[4] * M64_FLOP,
             u[4] * m64_smem),
            ("current + 2-CTA cluster multicast (16-query union)", u[16] * KV_TILE,
             u[4] * M64_FLOP, u[4] * m64_smem),
            ("per-query S^T (N = 16 per query), 8-query item", u[8] * KV_TILE,
             pairs * PAIR_FLOP, pairs * (KV_TILE + PAIR_B)),
            ("S^T gathered N = 16 n per 4-query consumer, 8-query item", u[8] * KV_TILE,
             pairs * PAIR_FLOP, u[4] * KV_TILE + pairs * PAIR_B),
            ("S^T gathered per 8-query consumer, 16-query item", u[16] * KV_TILE,
             pairs * PAIR_FLOP, u[8] * KV_TILE + pairs * PAIR_B),
            ("same + 2-CTA cluster multicast (32-query union)", u[32] * KV_TILE,
             pairs * PAIR_FLOP, u[8] * KV_TILE + pairs * PAIR_B),
            # the buildable form: S^T over the gathered queries (their Q rows copied into one
            # staging tile, 4 KiB read + 4 KiB written each), PV per selected query (its O^T
            # registers are fixed, so one N = 16 wgmma chain per query, V re-read each time)
            ("S^T gathered + PV per query, 8-query consumers, 16-query item", u[16] * KV_TILE,
             pairs * PAIR_FLOP, u[8] * KV_TILE // 2 + pairs * (KV_TILE // 2 + PAIR_B + 8192)),
            ("same + 2-CTA cluster multicast (32-query union)", u[32] * KV_TILE,
             pairs * PAIR_FLOP, u[8] * KV_TILE // 2 + pairs * (KV_TILE // 2 + PAIR_B + 8192)),
            # between the two: PV per fixed group of k queries (its O^T registers are one
            # static list) for every group with a selecting query
            *[(f"S^T gathered + PV per group of {k} queries, 16-query item", u[16] * KV_TILE,
               pairs * PAIR_FLOP // 2 + u[k] * PV8_FLOP * k // 8,
               u[8] * KV_TILE // 2 + u[k] * (KV_TILE // 2 + PV8_B * k // 8)
               + pairs * (PAIR_B // 2 + 8192)) for k in (2, 4)],
            ("S^T gathered + PV dense over the 8 queries, 16-query item", u[16] * KV_TILE,
             pairs * PAIR_FLOP // 2 + u[8] * PV8_FLOP,
             u[8] * (KV_TILE + PV8_B) + pairs * (PAIR_B // 2 + 8192)),
            ("same + 2-CTA cluster multicast (32-query union)", u[32] * KV_TILE,
             pairs * PAIR_FLOP // 2 + u[8] * PV8_FLOP,
             u[8] * (KV_TILE + PV8_B) + pairs * (PAIR_B // 2 + 8192)),
            # KV-centric: K/V once per block, but per pair Q in (4 KiB) and an fp32 partial O
            # (8 KiB) written and read back for the combine
            ("KV-centric over CSR buckets + partial-O combine", pairs * 20480,
             pairs * PAIR_FLOP, pairs * (KV_TILE // 8 + PAIR_B)),
        ]
        for label, l2, fl, sm in designs:
            times = {"L2": l2 / L2_RATE, "tensor": fl / MMA_RATE, "smem": sm / SMEM_RATE}
            lim = max(times, key=times.get)
            ms = times[lim] * 1e3
            print(f"| {name} | {label} | {l2 / 1e9:.1f} | {fl / 1e12:.2f} | {sm / 1e9:.0f} | "
                  f"{ms:.2f} | {useful / (ms * 1e-3) / 1e12:.0f} | {lim} |")
        if name in MEASURED:
            ms = MEASURED[name]
            print(f"| {name} | current, measured | | | | {ms:.2f} | "
                  f"{useful / (ms * 1e-3) / 1e12:.0f} | {u[4] * M64_FLOP / MMA_RATE / (ms * 1e-3):.0%} "
                  f"of the tensor bound |")


if __name__ == "__main__":
    main()
