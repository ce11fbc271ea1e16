//! The paired `o_pool`: each row's reductions kept inside one L2 partition.
//!
//! # Why
//! Hopper's L2 is two partitions joined by a fabric. A reduction is performed in the
//! partition its address is homed in, so an SM adding into a row homed on the other side
//! sends it across. The KV sum pass adds every task's rows from whichever SM ran the task:
//! half its reductions cross, and the fabric, not the slices, bounds the pass
//! (`bench/results/h100-2026-12-07-s27-forward-fabric.md`: `lts__ltcfabric2ltc_cycles_active`
//! at 97 %).
//!
//! # Measured once, with broken probes (session 29); not yet measured since
//! On an H100 (`bench/results/h100-2026-12-08-s29-paired.md`) the paired pool and paired
//! K/V passed the GPU tests and sanitizers but were 14-24 % slower at every length, with half
//! of the pass's reduction sectors still coming from the fabric. Session 30 found why in the
//! SASS: ptxas issued each probe's second clock read before its atomic returned (in
//! `fwd_kv_homes`' phase 1 and in the pass's consumer warps), so those labels were noise and
//! each warp's choice of copy a coin toss. [`latency`] now keeps the order, and a test reads
//! it in the SASS. Whether the premise holds (an atomic's latency tells where a reduction or
//! a read miss crosses) is untested on a GPU; both stay opt-in until it is measured
//! (`bench/results/s30/call1/call.sh`).
//!
//! # Layout
//! Homes alternate between the partitions at 4 KiB, and chunks `2r` and `2r + 1` of a 4 KiB
//! aligned buffer always sit on different sides (measured on an H200 with
//! `bench/probe/l2_sides.cu`: address bit 12 is in the partition hash). The paired pool holds
//! [`ANCHORS`] pairs that only the side probes touch (their atomics never meet a row's
//! reductions), then gives each `(token, index head)` row `r` of 16 heads × 128 d f16 (4 KiB)
//! the two chunks of pair `ANCHORS + r`;
//! a warp adds its row into the chunk homed on its own side, as the raw image of its SW128
//! staging (two boxes of `[16 heads][128 B]`, the 16-byte chunk `k` of head `h` at
//! `k ^ (h & 7)`). The combine adds the two copies. Correctness never depends on which copy
//! a warp picks: a wrong guess only sends that reduction across the fabric.
//!
//! # Which copy is near
//! Nothing names an SM's side or an address's home, so both are measured by the latency of a
//! returning `atom.add 0` (performed at the home: about 280 cycles on the near side and 480
//! on the far one, on an H200), the lower of two tries:
//! - `fwd_kv_homes`, once per pool allocation: `homes[r]` labels the home of chunk `2r`,
//!   label 0 being the home of chunk 0. Phase 0 (one thread) labels the first [`ANCHORS`]
//!   pairs against pair 0; phase 1 (every warp's lane 0) finds its own side from anchor
//!   `warp mod ANCHORS` and labels the other pairs from it, so that no line takes many
//!   probes at once.
//! - The sum pass's consumer warps find their side the same way at the start
//!   ([`side_from_anchor`]); the copy of row `r` homed there is `2r + (homes[r] ^ side)`.
//!
//! # Paired K/V
//! The same pairing serves the sum pass's K/V loads, whose misses cross the fabric when the
//! lines are homed on the other side: `fwd_kv_pair_kv` ([`PAIR_KV`]) writes, for every
//! (key block, KV head) tile, K's and V's shared-memory images (two SW128 panels of
//! 128 keys × 64 d each, as the tensor-map loads write them: 8 chunks of 4 KiB) into both
//! chunks of their pairs, and each tile's chunk labels as two 8-bit masks. The producer then
//! loads every chunk from the copy homed on its side with a bulk copy.

use super::common;
use super::KernelDesc;
use crate::ptx::*;
use crate::target::Target;

/// The pairs phase 0 labels, against which every later warp finds its side; a paired pool
/// holds at least this many pairs.
pub const ANCHORS: u32 = 64;
/// Bytes of one copy of a row: 16 heads × 128 d f16, the partitions' interleave.
pub const CHUNK_BYTES: u32 = 4096;
const THREADS: u32 = 128;
/// 4 KiB chunks of one K or V tile's image (128 keys × 128 d bf16).
pub const KV_CHUNKS: u32 = 8;
/// Threads of a `fwd_kv_pair_kv` CTA, which writes one tile's K or V image.
const PAIR_KV_THREADS: u32 = 256;
/// 16-byte units of one tile image.
const IMAGE_UNITS: u32 = KV_CHUNKS * CHUNK_BYTES / 16;
/// Warps of `fwd_kv_homes`'s CTA, each probing with its lane 0.
pub const HOMES_WARPS_PER_CTA: u32 = THREADS / 32;

/// Labels the homes of a paired pool's chunks.
pub const HOMES: KernelDesc = KernelDesc {
    name: "fwd_kv_homes",
    about: "the L2 partition each pair of a paired o_pool's chunk 2r is homed in (label 0: \
            chunk 0's), from the latency of returning atomics: phase 0 the anchors, phase 1 \
            the rest",
    // Plain PTX: shipped for both targets, as the other row kernels (only the Hopper KV
    // forward uses it).
    targets: &[Target::Sm90a, Target::Sm100a],
    threads: (THREADS, 1, 1),
    describe: describe_homes,
};

/// Writes the paired K/V tiles and their masks.
pub const PAIR_KV: KernelDesc = KernelDesc {
    name: "fwd_kv_pair_kv",
    about: "per (key block, KV head) tile, K's and V's SW128 shared-memory images into both \
            chunks of their pairs, and the pairs' labels as one 8-bit mask per image",
    targets: &[Target::Sm90a, Target::Sm100a],
    threads: (PAIR_KV_THREADS, 1, 1),
    describe: describe_pair_kv,
};

/// Cycles a returning `atom.global.add.u32 0` at `at` takes, the lower of two tries (the
/// word is unchanged). `sink` is a shared word only this thread writes meanwhile.
///
/// The second clock read must issue after the atomic has returned. Hopper issues a warp's
/// instructions in order, so an instruction that waits for the atomic's value, placed before
/// that read, holds it back; but ptxas schedules an arithmetic consumer after an independent
/// `%clock` read (session 29's kernels: in `fwd_kv_homes`' phase 1 and in the sum pass's
/// consumers each "latency" was the issue gap, so those labels were noise). A store of the
/// value is a memory operation, which ptxas keeps ahead of the read; `st.volatile`, since it
/// drops a plain store that a later one overwrites and then turns the atomic into a `REDG`.
/// `timed_atomics_return_before_the_second_clock_read` (`tests/tests/codegen.rs`) checks the
/// order in the SASS of every kernel that reads `%clock`.
pub fn latency(b: &mut KernelBuilder, at: &GlobalAddr, sink: &SharedAddr) -> Reg<U32> {
    let mut best = None;
    for _ in 0..2 {
        let t0 = b.sreg(SReg::Clock);
        let old = b.atom::<U32, _>(AtomOp::Add, at, 0u32);
        b.st_volatile(sink, old);
        let t1 = b.sreg(SReg::Clock);
        let d = b.sub(t1, t0);
        best = Some(match best {
            None => d,
            Some(m) => b.min(m, d),
        });
    }
    best.expect("two tries")
}

/// Whether chunk `2·pair` of the paired pool at `o` answers faster than chunk `2·pair + 1`:
/// it is then homed on this SM's side. `sink` as for [`latency`].
pub fn even_is_near(
    b: &mut KernelBuilder,
    o: Reg<U64>,
    pair: Reg<U32>,
    sink: &SharedAddr,
) -> Reg<Pred> {
    let even = b.shl(pair, 1u32);
    let odd = b.add(even, 1u32);
    let at_even = common::elem_bytes(b, o, even, CHUNK_BYTES);
    let at_odd = common::elem_bytes(b, o, odd, CHUNK_BYTES);
    let l_even = latency(b, &at_even, sink);
    let l_odd = latency(b, &at_odd, sink);
    b.setp(Cmp::Lt, l_even, l_odd)
}

/// This SM's side (the label of the partition it sits next to), from anchor pair `anchor`
/// whose label `homes[anchor]` holds. `sink` as for [`latency`].
pub fn side_from_anchor(
    b: &mut KernelBuilder,
    o: Reg<U64>,
    homes: Reg<U64>,
    anchor: Reg<U32>,
    sink: &SharedAddr,
) -> Reg<U32> {
    let near = even_is_near(b, o, anchor, sink);
    let at = common::elem::<U32>(b, homes, anchor);
    let label = b.ld::<U32, _>(&at);
    let other = b.xor(label, 1u32);
    b.selp(label, other, near)
}

/// One shared word per warp of a CTA of `warps` warps, each the [`latency`] sink of the
/// warp's probing lane: this warp's.
pub fn warp_sink(b: &mut KernelBuilder, warps: u32) -> SharedAddr {
    let sinks = b.shared_array("latency_sink", 4 * warps, 4);
    let base = b.shared_base(&sinks);
    let tid = b.sreg(SReg::TidX);
    let warp = b.shr(tid, 5u32);
    let at = b.mad_lo(warp, 4u32, base);
    shared(at, 0)
}

fn describe_homes(b: &mut KernelBuilder) {
    b.grid("phase 0: [1, 1, 1]; phase 1: [min(ceil(pairs / 4), num_sms), 1, 1]");
    let o_p = b.param_ptr("o_pool", HostElem::U32, true);
    let homes_p = b.param_ptr("homes", HostElem::U32, true);
    let pairs_p = b.param_u32("pairs");
    let phase_p = b.param_u32("phase");
    let tid = b.sreg(SReg::TidX);
    let lane = b.and(tid, 31u32);
    let lane0 = b.setp(Cmp::Eq, lane, 0u32);
    let warp = b.shr(tid, 5u32);
    let cta = b.sreg(SReg::CtaidX);
    let ctas = b.sreg(SReg::NctaidX);
    let gwarp = b.mad_lo(cta, HOMES_WARPS_PER_CTA, warp);
    let pairs = b.ld_param(&pairs_p);
    let phase = b.ld_param(&phase_p);
    let first = b.setp(Cmp::Eq, phase, 0u32);
    let o = b.ld_param_ptr(&o_p);
    let homes = b.ld_param_ptr(&homes_p);
    let sink = warp_sink(b, HOMES_WARPS_PER_CTA);
    let exit = b.label("exit");
    b.bra_unless(lane0, &exit);
    b.if_then(first, "anchors", |b| {
        b.comment("phase 0, one thread: the anchors' labels against pair 0");
        let leader = b.setp(Cmp::Eq, gwarp, 0u32);
        b.if_then(leader, "leader", |b| {
            let zero = b.mov::<U32>(0u32);
            let near0 = even_is_near(b, o, zero, &sink);
            let near0 = b.selp::<U32>(1u32, 0u32, near0);
            let n = b.min(pairs, ANCHORS);
            b.for_range(0u32, n, 1u32, "anchor", |b, a| {
                let near = even_is_near(b, o, a, &sink);
                let near = b.selp::<U32>(1u32, 0u32, near);
                let same = b.setp(Cmp::Eq, near, near0);
                let label = b.selp::<U32>(0u32, 1u32, same);
                let at = common::elem::<U32>(b, homes, a);
                b.st(&at, label);
            });
        });
    });
    b.unless(first, "rest", |b| {
        b.comment("phase 1: this warp's side from its anchor, then its pairs past the anchors");
        let anchor = b.and(gwarp, ANCHORS - 1);
        let side = side_from_anchor(b, o, homes, anchor, &sink);
        let other = b.xor(side, 1u32);
        let warps = b.mul_lo(ctas, HOMES_WARPS_PER_CTA);
        let start = b.add(gwarp, ANCHORS);
        b.for_range(start, pairs, warps, "pair", |b, r| {
            let near = even_is_near(b, o, r, &sink);
            let label = b.selp(side, other, near);
            let at = common::elem::<U32>(b, homes, r);
            b.st(&at, label);
        });
    });
    b.place(&exit);
    b.ret();
}

/// CTA `2·tile + x` (`x`: 0 for K, 1 for V) writes that image: 16-byte unit `i` of the image
/// (panel `i / 1024`, key row `r = (i / 8) mod 128`, unit `i mod 8` holding the row's unit
/// `(i mod 8) ^ (r mod 8)`: the SW128 pattern of a 1024-byte aligned stage) into both chunks
/// of pair `16·tile + 8x + i / 256`; thread 0 gathers the 8 pairs' labels into mask `2·tile + x`.
fn describe_pair_kv(b: &mut KernelBuilder) {
    b.grid("[2 * tiles, 1, 1]");
    let k_p = b.param_ptr("k_aligned", HostElem::Bf16, false);
    let v_p = b.param_ptr("v_aligned", HostElem::Bf16, false);
    let pairs_p = b.param_ptr("kv_pair", HostElem::U16, true);
    let homes_p = b.param_ptr("homes", HostElem::U32, false);
    let masks_p = b.param_ptr("masks", HostElem::U32, true);
    let tid = b.sreg(SReg::TidX);
    let cta = b.sreg(SReg::CtaidX);
    let tile = b.shr(cta, 1u32);
    let x = b.and(cta, 1u32);
    let block = b.shr(tile, 2u32);
    let head = b.and(tile, 3u32);
    let is_v = b.setp(Cmp::Ne, x, 0u32);
    let k = b.ld_param_ptr(&k_p);
    let v = b.ld_param_ptr(&v_p);
    let src = b.selp(v, k, is_v);
    let pairs = b.ld_param_ptr(&pairs_p);
    // The image's first pair.
    let pair0 = b.mad_lo(cta, KV_CHUNKS, 0u32);
    // Source units: key row `block·128 + r`, head `head`, 16 units of 16 bytes per head row.
    let key0 = b.shl(block, 7u32);
    for j in 0..IMAGE_UNITS / PAIR_KV_THREADS {
        let i = b.add(tid, j * PAIR_KV_THREADS);
        let panel = b.shr(i, 10u32);
        let r = b.shr(i, 3u32);
        let r = b.and(r, 127u32);
        let u = b.and(i, 7u32);
        let r7 = b.and(r, 7u32);
        let u = b.xor(u, r7);
        let key = b.add(key0, r);
        let row = b.mad_lo(key, 4u32, head);
        let unit = b.shl(row, 4u32);
        let unit = b.mad_lo(panel, 8u32, unit);
        let unit = b.add(unit, u);
        let at = common::elem_bytes(b, src, unit, 16);
        let data: [Reg<U32>; 4] = b.ld_v(&at);
        let chunk = b.shr(i, 8u32);
        let pair = b.add(pair0, chunk);
        let within = b.and(i, 255u32);
        let even = b.shl(pair, 9u32);
        let even = b.add(even, within);
        let odd = b.add(even, CHUNK_BYTES / 16);
        for at in [even, odd] {
            let at = common::elem_bytes(b, pairs, at, 16);
            b.st_v(&at, data);
        }
    }
    let leader = b.setp(Cmp::Eq, tid, 0u32);
    b.if_then(leader, "mask", |b| {
        let homes = b.ld_param_ptr(&homes_p);
        let masks = b.ld_param_ptr(&masks_p);
        let mut mask = b.mov::<U32>(0u32);
        for c in 0..KV_CHUNKS {
            let pair = b.add(pair0, c);
            let at = common::elem::<U32>(b, homes, pair);
            let label = b.ld::<U32, _>(&at);
            let label = b.and(label, 1u32);
            mask = b.mad_lo(label, 1u32 << c, mask);
        }
        let at = common::elem::<U32>(b, masks, cta);
        b.st(&at, mask);
    });
    b.ret();
}
