//! Building blocks shared by kernel descriptions: element addressing, the CTA-wide scan, and
//! the CTA-walk rule mirrored from the host contract.

use crate::plan::gemm::SmemDesc;
use crate::plan::pipeline::{Barriers, Pipe, PipelinePlan, Stage};
use crate::plan::sm90::Sm90Warps;
use crate::plan::smem::{Major, Placed};
use crate::ptx::*;
use crate::target::Target;

/// The softmax scale 128^-0.5, exactly rounded: (1/√2)/8, and the division by 8 is exact
/// (the runtime's `contract::SOFTMAX_SCALE`, which codegen does not depend on).
pub const SCALE: f32 = std::f32::consts::FRAC_1_SQRT_2 / 8.0;
/// log2(e), for the kernels' exp2-based softmax.
pub const LOG2E: f64 = std::f64::consts::LOG2_E;
/// `SCALE · log2(e)` rounded once to f32: the factor of the scores in `exp2`.
pub const SCALE_LOG2E: f32 = (SCALE as f64 * LOG2E) as f32;

/// The dynamic shared window's base `raw` and `raw` rounded up to the 1024-B atom of the 128B
/// swizzle, which is a function of absolute address bits: the tiles sit at aligned offsets
/// whatever base the window gets.
pub fn swizzle_aligned_base(b: &mut KernelBuilder, smem: &SharedVar) -> (Reg<U32>, Reg<U32>) {
    let raw = b.shared_base(smem);
    let base = b.add(raw, 1023u32);
    (raw, b.and(base, !1023u32))
}

/// The aligned base ([`swizzle_aligned_base`]) of `capacity` bytes of dynamic shared memory
/// for a plan of `total` bytes: a plan above the capacity is a codegen error (`None`), and
/// the kernel traps when the alignment's padding leaves less than `total`.
pub fn guarded_smem_base(b: &mut KernelBuilder, total: u32, capacity: u32) -> Option<Reg<U32>> {
    if total > capacity {
        b.error(format!(
            "the shared-memory plan needs {total} B, above {capacity} B"
        ));
        return None;
    }
    let smem = b.dynamic_shared("smem", capacity, 1024);
    b.comment("align the dynamic base to the 1024-B SW128 atom; trap if the slack is short");
    let (raw, base) = swizzle_aligned_base(b, &smem);
    let pad = b.sub(base, raw);
    let short = b.setp(Cmp::Gt, pad, capacity - total);
    b.if_then(short, "smem_guard", |b| b.trap());
    Some(base)
}

fn no_umma(b: &mut KernelBuilder, _: &SharedAddr) {
    b.require("tcgen05.commit", Target::Sm100a);
}

/// The barriers of a Hopper kernel whose barrier words start `offset` bytes past `base`; no
/// pipeline of it is released by a tcgen05 commit.
pub fn sm90_barriers(b: &mut KernelBuilder, base: Reg<U32>, offset: u32) -> Barriers {
    Barriers {
        base: b.add(base, offset),
        umma_commit: no_umma,
    }
}

/// The role split of the Hopper kernels on the task tables ([`Sm90Warps`]): warpgroup 0,
/// after its `setmaxnreg.dec`, runs `producer` on thread 0 (`leader`) and `gather` on warp 1,
/// then returns; the consumer warpgroups, after their `setmaxnreg.inc`, run `consumer`.
pub fn sm90_roles(
    b: &mut KernelBuilder,
    warps: &Sm90Warps,
    (tid, leader): (Reg<U32>, Reg<Pred>),
    producer: impl FnOnce(&mut KernelBuilder),
    gather: impl FnOnce(&mut KernelBuilder),
    consumer: impl FnOnce(&mut KernelBuilder),
) {
    let no_spare: Option<fn(&mut KernelBuilder)> = None;
    sm90_roles_with_spare(
        b,
        warps,
        (tid, leader),
        producer,
        gather,
        no_spare,
        consumer,
    );
}

/// [`sm90_roles`] with work for the producer warpgroup's spare warps 2 and 3 (64 threads,
/// `tid` 64..128), which otherwise return at once. They take no part in any pipeline.
pub fn sm90_roles_with_spare(
    b: &mut KernelBuilder,
    warps: &Sm90Warps,
    (tid, leader): (Reg<U32>, Reg<Pred>),
    producer: impl FnOnce(&mut KernelBuilder),
    gather: impl FnOnce(&mut KernelBuilder),
    spare: Option<impl FnOnce(&mut KernelBuilder)>,
    consumer: impl FnOnce(&mut KernelBuilder),
) {
    let wg = b.shr(tid, 7u32);
    let is_producer = b.setp(Cmp::Eq, wg, 0u32);
    let consumers = b.label("consumers");
    b.bra_unless(is_producer, &consumers);
    warps.emit_producer_setmaxnreg(b);
    b.if_then(leader, "producer", producer);
    let warp = b.shr(tid, 5u32);
    let is_gather = b.setp(Cmp::Eq, warp, 1u32);
    b.if_then(is_gather, "gather", gather);
    if let Some(spare) = spare {
        let is_spare = b.setp(Cmp::Ge, warp, 2u32);
        b.if_then(is_spare, "spare", spare);
    }
    b.ret();

    b.place(&consumers);
    warps.emit_consumer_setmaxnreg(b);
    consumer(b);
    b.ret();
}

/// `n += 1`.
pub fn bump(b: &mut KernelBuilder, n: Reg<U32>) {
    let next = b.add(n, 1u32);
    b.set(n, next);
}

/// Threads of the single-CTA scans ([`tiled_scan`]).
pub const SCAN_THREADS: u32 = 1024;
/// Entries each scan thread owns per tile.
pub const SCAN_PER_THREAD: u32 = 8;

/// `prmt.b32` selector of the lower halves of two words: `(b.lo << 16) | a.lo`.
pub const PRMT_LOW_HALVES: u32 = 0x5410;
/// `prmt.b32` selector of the upper halves of two words: `(b.hi << 16) | a.hi`.
pub const PRMT_HIGH_HALVES: u32 = 0x7632;

/// Address of element `idx` of an array of `T` at `base`.
pub fn elem<T: Ty>(b: &mut KernelBuilder, base: Reg<U64>, idx: Reg<U32>) -> GlobalAddr {
    elem_bytes(b, base, idx, T::BYTES)
}

/// Address of record `idx` of an array of `bytes`-byte records at `base`.
pub fn elem_bytes(b: &mut KernelBuilder, base: Reg<U64>, idx: Reg<U32>, bytes: u32) -> GlobalAddr {
    let off = b.mul_wide(idx, bytes);
    global(b.add(base, off), 0)
}

/// Zeroes the `words` 16-byte words at the pointer parameter `zero`, unless it is null:
/// `lanes(b)` gives this thread's first word and the stride between its words (the caller's
/// mapping of threads and CTAs onto the buffer). The runtime keeps `words` under 2^31, so
/// `i + stride` cannot wrap.
pub fn zero_words_strided(
    b: &mut KernelBuilder,
    zero: &ParamRef<U64>,
    words: &ParamRef<U32>,
    hint: &'static str,
    lanes: impl FnOnce(&mut KernelBuilder) -> (Reg<U32>, Reg<U32>),
) {
    let raw = b.ld_param(zero);
    let some = b.setp(Cmp::Ne, raw, 0u64);
    b.if_then(some, hint, |b| {
        let at = b.ld_param_ptr(zero);
        let words = b.ld_param(words);
        let (first, stride) = lanes(b);
        let z = b.mov::<U32>(0u32);
        b.for_range(first, words, stride, hint, |b, i| {
            let a = elem_bytes(b, at, i, 16);
            b.st_v(&a, [z, z, z, z]);
        });
    });
}

/// Loads `base[idx]` as `u32`.
pub fn load_u32(b: &mut KernelBuilder, base: Reg<U64>, idx: Reg<U32>) -> Reg<U32> {
    let a = elem::<U32>(b, base, idx);
    b.ld(&a)
}

/// Stores `v` to `base[idx]`.
pub fn store_u32(b: &mut KernelBuilder, base: Reg<U64>, idx: Reg<U32>, v: impl Src<U32>) {
    let a = elem::<U32>(b, base, idx);
    b.st::<U32, _>(&a, v);
}

/// The document of packed token `tg`: the largest `d` with `cu[d] <= tg`, by binary search
/// over `cu_seqlens` (`cu[0] <= tg < cu[D]`, D read from `num_docs`).
pub fn doc_search(
    b: &mut KernelBuilder,
    cu: Reg<U64>,
    num_docs: &ParamRef<U32>,
    tg: Reg<U32>,
) -> Reg<U32> {
    let lo = b.mov::<U32>(0u32);
    let hi = b.ld_param(num_docs);
    let top = b.label("doc_search");
    let done = b.label("doc_found");
    b.place(&top);
    let width = b.sub(hi, lo);
    let found = b.setp(Cmp::Le, width, 1u32);
    b.bra_if(found, &done);
    let mid = b.add(lo, hi);
    let mid = b.shr(mid, 1u32);
    let c = load_u32(b, cu, mid);
    let below = b.setp(Cmp::Le, c, tg);
    let nlo = b.selp(mid, lo, below);
    let nhi = b.selp(hi, mid, below);
    b.set(lo, nlo);
    b.set(hi, nhi);
    b.bra(&top);
    b.place(&done);
    lo
}

/// `ceil(a / d)`; `d` must be non-zero.
pub fn div_ceil(b: &mut KernelBuilder, a: Reg<U32>, d: impl Src<U32> + Copy) -> Reg<U32> {
    let dm1 = b.mov::<U32>(d);
    let dm1 = b.sub(dm1, 1u32);
    let s = b.add(a, dm1);
    b.div(s, d)
}

/// `ceil(log2(x))` for `x >= 1` (0 for `x = 1`): the number of `k < 32` with `x > 2^k`.
pub fn ceil_log2(b: &mut KernelBuilder, x: Reg<U32>) -> Reg<U32> {
    let mut n = b.mov::<U32>(0u32);
    for k in 0..32u32 {
        let above = b.setp(Cmp::Gt, x, 1u32 << k);
        let one = b.selp(1u32, 0u32, above);
        n = b.add(n, one);
    }
    n
}

/// Warp-inclusive scan of `v` (Kogge-Stone over `shfl.up`).
pub fn warp_inclusive_scan(b: &mut KernelBuilder, v: Reg<U32>, lane: Reg<U32>) -> Reg<U32> {
    let mut acc = v;
    for d in [1u32, 2, 4, 8, 16] {
        let up = b.shfl(Shfl::Up, acc, d, 0);
        let has = b.setp(Cmp::Ge, lane, d);
        let add = b.selp(up, 0u32, has);
        acc = b.add(acc, add);
    }
    acc
}

/// CTA-wide exclusive scan of one `u32` per thread, for CTAs of whole warps up to 1024
/// threads. `warp_totals` is a 32-word shared scratch. Returns (exclusive prefix, CTA total).
/// Ends with a barrier, so `warp_totals` may be reused at once.
pub fn cta_exclusive_scan(
    b: &mut KernelBuilder,
    v: Reg<U32>,
    tid: Reg<U32>,
    warp_totals: &SharedVar,
) -> (Reg<U32>, Reg<U32>) {
    let lane = b.and(tid, 31u32);
    let warp = b.shr(tid, 5u32);
    let base = b.shared_base(warp_totals);
    let incl = warp_inclusive_scan(b, v, lane);
    let last = b.setp(Cmp::Eq, lane, 31u32);
    let warp4 = b.shl(warp, 2u32);
    let slot = b.add(base, warp4);
    b.predicated(last, false, |b| b.st(&shared(slot, 0), incl));
    b.bar_sync(0, None);
    let first_warp = b.setp(Cmp::Eq, warp, 0u32);
    b.if_then(first_warp, "warp_totals", |b| {
        let lane4 = b.shl(lane, 2u32);
        let mine = b.add(base, lane4);
        let t = b.ld::<U32, _>(&shared(mine, 0));
        let t = warp_inclusive_scan(b, t, lane);
        b.st(&shared(mine, 0), t);
    });
    b.bar_sync(0, None);
    // Warps beyond the CTA's count never wrote their slot, so the total is read from the
    // last warp's slot.
    let ntid = b.sreg(SReg::NtidX);
    let warps = b.shr(ntid, 5u32);
    let last_warp = b.sub(warps, 1u32);
    let last4 = b.shl(last_warp, 2u32);
    let last_slot = b.add(base, last4);
    let total = b.ld::<U32, _>(&shared(last_slot, 0));
    let has_prev = b.setp(Cmp::Gt, warp, 0u32);
    let prev = b.reg::<U32>();
    b.set(prev, 0u32);
    b.predicated(has_prev, false, |b| {
        let p = b.ld::<U32, _>(&shared(slot, -4));
        b.set(prev, p);
    });
    b.bar_sync(0, None);
    let before = b.sub(incl, v);
    (b.add(prev, before), total)
}

/// The CTA walk `(num_full_ctas, tail_rows, grid_ctas)` of `n` rows, the device mirror of the
/// host contract's `chunk_map` (`docs/design.md` §2.4). `r` and `s` must be at least 1.
pub fn chunk_map(
    b: &mut KernelBuilder,
    n: Reg<U32>,
    r: Reg<U32>,
    s: Reg<U32>,
) -> (Reg<U32>, Reg<U32>, Reg<U32>) {
    let chunks = div_ceil(b, n, r);
    let waves = b.div(chunks, s);
    let wave_chunks = b.mul_lo(waves, s);
    let whole = b.div(n, r);
    // Partial chunks never join a full wave.
    let full = b.min(wave_chunks, whole);
    let covered = b.mul_lo(full, r);
    let left = b.sub(n, covered);
    let tail = div_ceil(b, left, s);
    let tail_div = b.max(tail, 1u32);
    let tail_ctas = div_ceil(b, left, tail_div);
    let tail_grid = b.add(full, tail_ctas);
    // Short tails lose to the per-CTA prologue: walk plain chunks instead.
    let short = b.setp(Cmp::Lt, tail, 3u32);
    let full2 = b.selp(0u32, full, short);
    let tail2 = b.selp(r, tail, short);
    let grid2 = b.selp(chunks, tail_grid, short);
    let none_left = b.setp(Cmp::Eq, left, 0u32);
    (
        b.selp(full, full2, none_left),
        b.selp(1u32, tail2, none_left),
        b.selp(full, grid2, none_left),
    )
}

/// Rows per CTA: the device mirror of the host contract's `rows_per_cta`.
pub fn rows_per_cta(
    b: &mut KernelBuilder,
    n: Reg<U32>,
    switch: u32,
    small: u32,
    large: u32,
) -> Reg<U32> {
    let is_small = b.setp(Cmp::Le, n, switch);
    b.selp(small, large, is_small)
}

/// CTA `cta`'s task rows `[lo, hi)` from the descriptor words `(n, r, full, tail, grid)`:
/// the device mirror of the host contract's `cta_interval` (`docs/design.md` §2.4).
pub fn cta_interval(
    b: &mut KernelBuilder,
    cta: Reg<U32>,
    n: Reg<U32>,
    r: Reg<U32>,
    full: Reg<U32>,
    tail: Reg<U32>,
    grid: Reg<U32>,
) -> (Reg<U32>, Reg<U32>) {
    let in_full = b.setp(Cmp::Lt, cta, full);
    let full_lo = b.mul_lo(cta, r);
    let tail_base = b.mul_lo(full, r);
    let tail_index = b.sub(cta, full);
    let tail_lo = b.mad_lo(tail_index, tail, tail_base);
    let lo = b.selp(full_lo, tail_lo, in_full);
    let lo = b.min(lo, n);
    let len = b.selp(r, tail, in_full);
    let end = b.add(lo, len);
    let hi = b.min(end, n);
    // CTAs past the grid (the launch is an upper bound) get an empty interval.
    let outside = b.setp(Cmp::Ge, cta, grid);
    (b.selp(n, lo, outside), b.selp(n, hi, outside))
}

/// A CTA's interval `[lo, hi)` of task rows in the walk (`docs/design.md` §2.4).
pub struct Walk {
    /// First row.
    pub lo: Reg<U32>,
    /// One past the last row.
    pub hi: Reg<U32>,
}

/// A lane pair's exchange of an m64 accumulator's column group `j` (`acc[4j .. 4j+4]`: rows
/// r and r+8, columns c and c+1) into four consecutive columns of one row, for a 16-byte
/// reduction: even lanes keep row r and take the partner's columns c+2, c+3; odd lanes
/// (`is_odd`) keep row r+8 and take the partner's columns c-2, c-1.
pub fn pair_exchange_v4(
    b: &mut KernelBuilder,
    acc: &[Reg<F32>],
    j: u32,
    is_odd: Reg<Pred>,
) -> [Reg<F32>; 4] {
    let i = (4 * j) as usize;
    let send0 = b.selp(acc[i], acc[i + 2], is_odd);
    let send1 = b.selp(acc[i + 1], acc[i + 3], is_odd);
    let got0 = b.shfl(Shfl::Bfly, send0, 1u32, 0x1f);
    let got1 = b.shfl(Shfl::Bfly, send1, 1u32, 0x1f);
    [
        b.selp(got0, acc[i], is_odd),
        b.selp(got1, acc[i + 1], is_odd),
        b.selp(acc[i + 2], got0, is_odd),
        b.selp(acc[i + 3], got1, is_odd),
    ]
}

/// The start the main kernels on the task tables share: thread 0 initialises every barrier
/// of `pipelines`, the CTA meets, and each thread reads this CTA's [`Walk`] from the
/// descriptor parameter `desc`. Returns the predicate "thread 0" and the walk.
pub fn init_and_walk(
    b: &mut KernelBuilder,
    tid: Reg<U32>,
    pipelines: &PipelinePlan,
    bars: &Barriers,
    desc: &ParamRef<U64>,
) -> (Reg<Pred>, Walk) {
    let leader = init_barriers(b, tid, pipelines, bars);
    b.comment("the CTA walk: this CTA's interval of task rows");
    let desc = b.ld_param_ptr(desc);
    (leader, cta_walk(b, desc))
}

/// Thread 0 initialises every barrier of `pipelines`, and the CTA meets. Returns the predicate
/// "thread 0".
pub fn init_barriers(
    b: &mut KernelBuilder,
    tid: Reg<U32>,
    pipelines: &PipelinePlan,
    bars: &Barriers,
) -> Reg<Pred> {
    b.comment("thread 0 initialises every pipeline barrier");
    let leader = b.setp(Cmp::Eq, tid, 0u32);
    b.if_then(leader, "init", |b| pipelines.emit_init(b, bars));
    b.bar_sync(0, None);
    leader
}

/// This CTA's [`Walk`], read from the CTA-walk descriptor at `desc` (words `n, r, full,
/// tail, grid`). Shared by both main kernels.
pub fn cta_walk(b: &mut KernelBuilder, desc: Reg<U64>) -> Walk {
    let d = WalkDesc::load(b, desc);
    let cta = b.sreg(SReg::CtaidX);
    let (lo, hi) = d.interval(b, cta);
    Walk { lo, hi }
}

/// The CTA-walk descriptor's words `n, r, full, tail, grid` (written by `task_scan_bins`).
struct WalkDesc {
    words: [Reg<U32>; 4],
    grid: Reg<U32>,
}

impl WalkDesc {
    fn load(b: &mut KernelBuilder, desc: Reg<U64>) -> Self {
        let words = b.ld_v(&global(desc, 0));
        let grid = b.ld::<U32, _>(&global(desc, 16));
        WalkDesc { words, grid }
    }

    /// Walk `cta`'s rows `[lo, hi)` ([`cta_interval`]).
    fn interval(&self, b: &mut KernelBuilder, cta: Reg<U32>) -> (Reg<U32>, Reg<U32>) {
        let [n, r, full, tail] = self.words;
        cta_interval(b, cta, n, r, full, tail, self.grid)
    }
}

/// This CTA's part of a [`Walk`] split in `2^split_log2` parts: with the descriptor's grid
/// launched `2^split_log2` times over, CTA `c` takes part `c mod 2^k` of walk `c >> k`, the
/// parts' lengths differing by at most one row. With `split_log2 = 0` it is [`cta_walk`].
pub fn cta_walk_part(b: &mut KernelBuilder, desc: Reg<U64>, split_log2: Reg<U32>) -> Walk {
    let d = WalkDesc::load(b, desc);
    let ctaid = b.sreg(SReg::CtaidX);
    let cta = b.shr(ctaid, split_log2);
    let (lo, hi) = d.interval(b, cta);
    let one = b.mov::<U32>(1u32);
    let parts = b.shl(one, split_log2);
    let mask = b.sub(parts, 1u32);
    let part = b.and(ctaid, mask);
    // Part p starts at lo + p·base + min(p, rem): the first `rem` parts take one row more.
    let len = b.sub(hi, lo);
    let base = b.shr(len, split_log2);
    let rem = b.and(len, mask);
    let before = b.mad_lo(part, base, lo);
    let extra = b.min(part, rem);
    let start = b.add(before, extra);
    let longer = b.setp(Cmp::Lt, part, rem);
    let plus = b.selp(1u32, 0u32, longer);
    let size = b.add(base, plus);
    let end = b.add(start, size);
    Walk { lo: start, hi: end }
}

/// `(batch, index_head, kblock, valid)` of task row `row`, with the table's pointer re-read
/// from the parameter bank (holding it across a loop costs a register pair).
pub fn task_meta(b: &mut KernelBuilder, p: &MainParams, row: Reg<U32>) -> [Reg<U32>; 4] {
    task_meta_at(b, &p.meta, row)
}

/// [`task_meta`] from the `task_meta` table parameter `meta` of any kernel that walks it.
pub fn task_meta_at(b: &mut KernelBuilder, meta: &ParamRef<U64>, row: Reg<U32>) -> [Reg<U32>; 4] {
    let meta = b.ld_param_ptr(meta);
    let a = elem_bytes(b, meta, row, 16);
    b.ld_v(&a)
}

/// A row's bucket `(index_head, kblock)` in one word (kblock < 2^24): consecutive rows of one
/// bucket form a segment, which shares one K/V tile and one dK/dV accumulation.
pub fn bucket(b: &mut KernelBuilder, m: &[Reg<U32>; 4]) -> Reg<U32> {
    let h = b.shl(m[1], 24u32);
    b.or(h, m[2])
}

/// Whether the segment ends at `row` of bucket `cur`: the walk ends, or the next row is
/// another bucket.
pub fn segment_ends(
    b: &mut KernelBuilder,
    p: &MainParams,
    walk: &Walk,
    row: Reg<U32>,
    cur: Reg<U32>,
) -> Reg<Pred> {
    let next_row = b.add(row, 1u32);
    let last = b.setp(Cmp::Ge, next_row, walk.hi);
    let end = b.mov::<U32>(1u32);
    b.unless(last, "next_bucket", |b| {
        let nm = task_meta(b, p, next_row);
        let next = bucket(b, &nm);
        let cont = b.setp(Cmp::Eq, next, cur);
        let v = b.selp(0u32, 1u32, cont);
        b.set(end, v);
    });
    b.setp(Cmp::Ne, end, 0u32)
}

/// The parameters both main backward kernels take, in their shared order: the runtime
/// launches either with the same arguments.
pub struct MainParams {
    /// Q `[T, 64, 128]` bf16, boxes of 16 heads × 64 d.
    pub tmap_q: TensorMapRef,
    /// dO, as Q.
    pub tmap_do: TensorMapRef,
    /// K `[W, 4, 128]` bf16, boxes of 128 keys × 64 d.
    pub tmap_k: TensorMapRef,
    /// V, as K.
    pub tmap_v: TensorMapRef,
    /// LSE `[T, 64]` fp32 (natural log).
    pub lse: ParamRef<U64>,
    /// Delta `[T, 64]` fp32.
    pub delta: ParamRef<U64>,
    /// `task_meta [capacity, 4]`.
    pub meta: ParamRef<U64>,
    /// `task_qrows [capacity, 8]`.
    pub qrows: ParamRef<U64>,
    /// `task_qpos [capacity, 8]`.
    pub qpos: ParamRef<U64>,
    /// The CTA-walk descriptor `int32[8]`.
    pub desc: ParamRef<U64>,
    /// The bf16 dQ pool, usually the backward's `dq` output itself: `[T, 64, 128]` for the
    /// Hopper kernel, head-pair-interleaved `[T, 32, 128, 2]` for the Blackwell kernel, which
    /// `bwd_postprocess` then de-interleaves in place (`docs/design.md` §3.6).
    pub dq: ParamRef<U64>,
    /// The fp32 dK pool `[W, 4, 128]`.
    pub dk: ParamRef<U64>,
    /// The fp32 dV pool `[W, 4, 128]`.
    pub dv: ParamRef<U64>,
    /// The default mode's `dq [T, 64, 128]` as a TMA reduce-add target (Q's geometry: boxes
    /// of 16 heads × 64 d, SW128); the Hopper kernel reduces dQ through it.
    pub tmap_dq: Option<TensorMapRef>,
    /// The deterministic variant's extra parameters (its pools then hold fixed-point values:
    /// dQ integer-valued f32 `[T, 4, 4, 128, 4]`, dK/dV one signed 64-bit word per element).
    pub fixed: Option<FixedParams>,
}

/// The extra parameters of the deterministic main kernels (`fixed_point`).
pub struct FixedParams {
    /// `a[t, g]` `[T, 4]` (f32 bits), the per-row dQ bound.
    pub row_bounds: ParamRef<U64>,
    /// The group maxima (`fixed_point::BOUND_WORDS` words).
    pub bounds: ParamRef<U64>,
}

/// Declares the main kernels' parameters.
///
/// The deterministic variants (`deterministic`) take the same list with fixed-point pools
/// and two parameters more at the end.
pub fn main_params(b: &mut KernelBuilder, deterministic: bool) -> MainParams {
    let (dq_elem, kv_elem) = if deterministic {
        (HostElem::F32, HostElem::I32)
    } else {
        (HostElem::Bf16, HostElem::F32)
    };
    let mut p = MainParams {
        tmap_q: b.param_tensor_map("tmap_q"),
        tmap_do: b.param_tensor_map("tmap_do"),
        tmap_k: b.param_tensor_map("tmap_k"),
        tmap_v: b.param_tensor_map("tmap_v"),
        lse: b.param_ptr("lse", HostElem::F32, false),
        delta: b.param_ptr("delta", HostElem::F32, false),
        meta: b.param_ptr("task_meta", HostElem::I32, false),
        qrows: b.param_ptr("task_qrows", HostElem::I32, false),
        qpos: b.param_ptr("task_qpos", HostElem::I32, false),
        desc: b.param_ptr("desc", HostElem::I32, false),
        dq: b.param_ptr("dq_pool", dq_elem, true),
        dk: b.param_ptr("dk_pool", kv_elem, true),
        dv: b.param_ptr("dv_pool", kv_elem, true),
        tmap_dq: None,
        fixed: None,
    };
    if deterministic {
        p.fixed = Some(FixedParams {
            row_bounds: b.param_ptr("row_bounds", HostElem::I32, false),
            bounds: b.param_ptr("bounds", HostElem::I32, false),
        });
    } else {
        p.tmap_dq = Some(b.param_tensor_map("tmap_dq"));
    }
    p
}

/// Bytes of one 128-row × 64-column bf16 panel (one 128B-swizzled TMA box of K/V).
const PANEL: i64 = 128 * 128;

/// The producer's K/V load at a segment's start: when task row `meta`'s bucket differs from
/// `prev` (the bucket last loaded; `u32::MAX` before the first), it acquires the K/V stage of
/// `kv` (`segments`: the loads so far), loads K and V (or K alone: one map and tile) into
/// that stage of the `tiles` buffers (each at its base address; [`load_kv_tiles`]) and
/// advances both. Shared by the main kernels on the task tables.
#[allow(clippy::too_many_arguments)]
pub fn load_kv_if_new_segment<const N: usize>(
    b: &mut KernelBuilder,
    kv: &Pipe,
    bars: &Barriers,
    (prev, segments): (Reg<U32>, Reg<U32>),
    maps: [Reg<U64>; N],
    tiles: [(&Placed, Reg<U32>); N],
    meta: &[Reg<U32>; 4],
    policy: Option<Reg<B64>>,
) {
    on_new_segment(b, kv, bars, (prev, segments), meta, |b, st| {
        let tiles = tiles.map(|(buf, base)| buf.stage_at(b, base, st.index));
        load_kv_tiles(b, maps, tiles, meta, &st.full, policy);
    });
}

/// The segment bookkeeping of [`load_kv_if_new_segment`] around any `load` of the acquired
/// K/V stage: when task row `meta`'s bucket differs from `prev`, acquire the stage of `kv`
/// (`segments`: the loads so far), run `load` on it, and advance both.
pub fn on_new_segment(
    b: &mut KernelBuilder,
    kv: &Pipe,
    bars: &Barriers,
    (prev, segments): (Reg<U32>, Reg<U32>),
    meta: &[Reg<U32>; 4],
    load: impl FnOnce(&mut KernelBuilder, &Stage),
) {
    let cur = bucket(b, meta);
    let same = b.setp(Cmp::Eq, cur, prev);
    b.unless(same, "kv_load", |b| {
        let st = kv.producer_acquire(b, bars, segments);
        load(b, &st);
        bump(b, segments);
        b.set(prev, cur);
    });
}

/// TMA of one segment's K and V (or any `N` tensors of that shape): per tensor two boxes of 128 keys × 64 head dims (the K-major
/// SW128 panels the MMAs read), for kv head `meta[1]` and key block `meta[2]`, completing on
/// `bar`. Shared by both main kernels.
pub fn load_kv_tiles<const N: usize>(
    b: &mut KernelBuilder,
    maps: [Reg<U64>; N],
    tiles: [SharedAddr; N],
    meta: &[Reg<U32>; 4],
    bar: &SharedAddr,
    policy: Option<Reg<B64>>,
) {
    let head = b.bitcast::<S32, U32>(meta[1]);
    let key0 = b.shl(meta[2], 7u32);
    let key0 = b.bitcast::<S32, U32>(key0);
    for (map, tile) in maps.into_iter().zip(tiles) {
        for panel in 0..2 {
            let d0 = b.mov::<S32>(panel * 64);
            b.tma_load_3d_hinted(
                &tile.offset(panel as i64 * PANEL),
                map,
                [d0, head, key0],
                bar,
                policy,
            );
        }
    }
}

/// TMA of one task's query-row tiles (Q and dO for the backward, Q alone for the KV-parallel
/// forward): for each of the 8 query slots, both 64-d halves and each of the `N` maps, one box
/// of the 16 heads of index head `meta[1]` (a −1 query row is out of bounds, so TMA
/// zero-fills it), `16·N` boxes in all, completing on `bar`. Slot `s` of d-half `p` lands at
/// `p·16 KiB + s·2 KiB` of its tile.
pub fn load_qdo_tiles<const N: usize>(
    b: &mut KernelBuilder,
    maps: [Reg<U64>; N],
    tiles: [SharedAddr; N],
    qrows: Reg<U64>,
    row: Reg<U32>,
    meta: &[Reg<U32>; 4],
    bar: &SharedAddr,
) {
    let head16 = b.shl(meta[1], 4u32);
    let head16 = b.bitcast::<S32, U32>(head16);
    let rows_at = elem_bytes(b, qrows, row, 32);
    let lo4: [Reg<S32>; 4] = b.ld_v(&rows_at);
    let hi4: [Reg<S32>; 4] = b.ld_v(&rows_at.offset(16));
    let slots = [
        lo4[0], lo4[1], lo4[2], lo4[3], hi4[0], hi4[1], hi4[2], hi4[3],
    ];
    for (slot, qrow) in slots.into_iter().enumerate() {
        for panel in 0..2 {
            let d0 = b.mov::<S32>(panel * 64);
            let off = panel as i64 * PANEL + slot as i64 * 2048;
            for (map, tile) in maps.into_iter().zip(tiles.iter()) {
                b.tma_load_3d(&tile.offset(off), map, [d0, head16, qrow], bar);
            }
        }
    }
}

/// The 8 compact query rows of task row `row` (`task_qrows [capacity, 8]`), for
/// [`load_q_tiles`].
pub fn load_task_qrows(b: &mut KernelBuilder, qrows: Reg<U64>, row: Reg<U32>) -> [Reg<S32>; 8] {
    let rows_at = elem_bytes(b, qrows, row, 32);
    let lo4: [Reg<S32>; 4] = b.ld_v(&rows_at);
    let hi4: [Reg<S32>; 4] = b.ld_v(&rows_at.offset(16));
    [
        lo4[0], lo4[1], lo4[2], lo4[3], hi4[0], hi4[1], hi4[2], hi4[3],
    ]
}

/// [`load_qdo_tiles`] of one tensor with the task's compact rows already loaded (the KV
/// forward loads them a task ahead).
pub fn load_q_tiles(
    b: &mut KernelBuilder,
    map: Reg<U64>,
    tile: SharedAddr,
    slots: [Reg<S32>; 8],
    meta: &[Reg<U32>; 4],
    bar: &SharedAddr,
    policy: Option<Reg<B64>>,
) {
    let head16 = b.shl(meta[1], 4u32);
    let head16 = b.bitcast::<S32, U32>(head16);
    for (slot, qrow) in slots.into_iter().enumerate() {
        for panel in 0..2 {
            let d0 = b.mov::<S32>(panel * 64);
            let off = panel as i64 * PANEL + slot as i64 * 2048;
            b.tma_load_3d_hinted(&tile.offset(off), map, [d0, head16, qrow], bar, policy);
        }
    }
}

/// A scalar-gather lane's place: lane `4·slot + part` covers folded rows `4·lane .. +4`
/// (slot `lane/4`, heads `4·part ..`). Computed once, outside the task loop.
pub struct GatherLane {
    /// The lane (0..32).
    pub lane: Reg<U32>,
    /// Its query slot, `lane / 4`.
    pub slot: Reg<U32>,
    /// Its first head inside the slot, `4·(lane % 4)`.
    pub part4: Reg<U32>,
    /// Byte offset of its four f32 row scalars, `16·lane`.
    pub lane16: Reg<U32>,
    /// Whether it also copies one of the 8 slot words (`lane < 8`).
    pub word_lane: Reg<Pred>,
}

/// The [`GatherLane`] of thread `tid`.
pub fn gather_lane(b: &mut KernelBuilder, tid: Reg<U32>) -> GatherLane {
    let lane = b.and(tid, 31u32);
    let slot = b.shr(lane, 2u32);
    let part = b.and(lane, 3u32);
    let part4 = b.shl(part, 2u32);
    let lane16 = b.shl(lane, 4u32);
    let word_lane = b.setp(Cmp::Lt, lane, 8u32);
    GatherLane {
        lane,
        slot,
        part4,
        lane16,
        word_lane,
    }
}

/// Gather lane `g`'s row scalars of task row `row` for index head `head`: `−lse·log2e` (−∞
/// for an empty slot) and delta for its four folded rows. Shared by the scalar-gather warps
/// of both main kernels.
pub fn gather_row_scalars(
    b: &mut KernelBuilder,
    p: &MainParams,
    row: Reg<U32>,
    head: Reg<U32>,
    g: &GatherLane,
) -> ([Reg<F32>; 4], [Reg<F32>; 4]) {
    let (l4, d4) = gather_rows_from(b, (&p.qrows, &p.lse, Some(&p.delta)), row, head, g);
    (l4, d4.expect("delta is read"))
}

/// [`gather_row_scalars`] from the tables `(task_qrows, lse, delta)`: `−x·log2e` of `lse`
/// (any `[T, 64]` f32 row quantity; the KV-parallel forward's reference) and, when given,
/// delta.
pub fn gather_rows_from(
    b: &mut KernelBuilder,
    (qrows_p, lse_p, delta_p): (&ParamRef<U64>, &ParamRef<U64>, Option<&ParamRef<U64>>),
    row: Reg<U32>,
    head: Reg<U32>,
    g: &GatherLane,
) -> ([Reg<F32>; 4], Option<[Reg<F32>; 4]>) {
    let (slot, part4) = (g.slot, g.part4);
    let neg_log2e = -(std::f64::consts::LOG2_E as f32);
    let head16 = b.shl(head, 4u32);
    let hcol = b.add(head16, part4);
    let row8 = b.shl(row, 3u32);
    let qrows = b.ld_param_ptr(qrows_p);
    let idx = b.add(row8, slot);
    let a = elem::<S32>(b, qrows, idx);
    let qrow = b.ld::<S32, _>(&a);
    let l4: [Reg<F32>; 4] = std::array::from_fn(|_| b.mov::<F32>(f32::NEG_INFINITY));
    let d4: Option<[Reg<F32>; 4]> = delta_p.map(|_| std::array::from_fn(|_| b.mov::<F32>(0.0f32)));
    let valid = b.setp(Cmp::Ge, qrow, 0i32);
    b.if_then(valid, "gather", |b| {
        let r = b.bitcast::<U32, S32>(qrow);
        let i = b.mad_lo(r, 64u32, hcol);
        let lse = b.ld_param_ptr(lse_p);
        let a = elem::<F32>(b, lse, i);
        let v: [Reg<F32>; 4] = b.ld_global_nc_v(&a);
        for (dst, x) in l4.iter().zip(v) {
            let y = b.fmul(x, neg_log2e);
            b.set(*dst, y);
        }
        if let (Some(delta_p), Some(d4)) = (delta_p, &d4) {
            let delta = b.ld_param_ptr(delta_p);
            let a = elem::<F32>(b, delta, i);
            let v: [Reg<F32>; 4] = b.ld_global_nc_v(&a);
            for (dst, x) in d4.iter().zip(v) {
                b.set(*dst, x);
            }
        }
    });
    (l4, d4)
}

/// Runs `value(b, i, live)` for every `i` a scan thread owns, tile by tile, in a CTA of
/// [`SCAN_THREADS`] threads: thread `t` owns entries `tile + 8t .. tile + 8t + 8`, and `live`
/// says `i < n`. Each tile's per-thread value sums are scanned across the CTA;
/// `store(b, i, live, before, value)` then gets the sum of all values before entry `i`.
/// Returns the grand total. The stores of the last tile follow its last barrier: a reader in
/// the same CTA needs a `bar.sync` first.
pub fn tiled_scan(
    b: &mut KernelBuilder,
    n: Reg<U32>,
    tid: Reg<U32>,
    warp_totals: &SharedVar,
    value: impl Fn(&mut KernelBuilder, Reg<U32>, Reg<Pred>) -> Reg<U32>,
    store: impl Fn(&mut KernelBuilder, Reg<U32>, Reg<Pred>, Reg<U32>, Reg<U32>),
) -> Reg<U32> {
    let zero = b.mov::<U32>(0u32);
    tiled_scan_range(b, (zero, n, n), zero, tid, warp_totals, value, store)
}

/// [`tiled_scan`] of the items `lo .. hi` (tiles from `lo`; an item `>= n` is not live),
/// starting from `carry0`: one CTA's chunk of a scan split between CTAs.
pub fn tiled_scan_range(
    b: &mut KernelBuilder,
    (lo, hi, n): (Reg<U32>, Reg<U32>, Reg<U32>),
    carry0: Reg<U32>,
    tid: Reg<U32>,
    warp_totals: &SharedVar,
    value: impl Fn(&mut KernelBuilder, Reg<U32>, Reg<Pred>) -> Reg<U32>,
    store: impl Fn(&mut KernelBuilder, Reg<U32>, Reg<Pred>, Reg<U32>, Reg<U32>),
) -> Reg<U32> {
    let carry = b.mov::<U32>(carry0);
    let tile = SCAN_THREADS * SCAN_PER_THREAD;
    b.for_range(lo, hi, tile, "scan_tile", |b, tile_base| {
        let first = b.mad_lo(tid, SCAN_PER_THREAD, tile_base);
        let mut idx = Vec::new();
        let mut vals = Vec::new();
        let mut live = Vec::new();
        let mut sum = b.mov::<U32>(0u32);
        for k in 0..SCAN_PER_THREAD {
            let i = b.add(first, k);
            let l = b.setp(Cmp::Lt, i, n);
            let v = value(b, i, l);
            sum = b.add(sum, v);
            idx.push(i);
            vals.push(v);
            live.push(l);
        }
        let (before, total) = cta_exclusive_scan(b, sum, tid, warp_totals);
        let mut running = b.add(carry, before);
        for k in 0..SCAN_PER_THREAD as usize {
            store(b, idx[k], live[k], running, vals[k]);
            running = b.add(running, vals[k]);
        }
        let next = b.add(carry, total);
        b.set(carry, next);
    });
    carry
}

/// `value` if `live`, else 0, loading through `load` only when live.
pub fn load_if(
    b: &mut KernelBuilder,
    live: Reg<Pred>,
    load: impl FnOnce(&mut KernelBuilder) -> Reg<U32>,
) -> Reg<U32> {
    let out = b.mov::<U32>(0u32);
    b.if_then(live, "load_if", |b| {
        let v = load(b);
        b.set(out, v);
    });
    out
}

/// The SW128 tile descriptor of a K-major sm_90a wgmma operand (the typed GEMM plan's view).
pub fn k_major() -> SmemDesc {
    SmemDesc::sw128_tile(Target::Sm90a, Major::K)
}

/// The SW128 tile descriptor of an MN-major sm_90a wgmma operand.
pub fn mn_major() -> SmemDesc {
    SmemDesc::sw128_tile(Target::Sm90a, Major::MN)
}

/// The largest of this thread's 32 values of row `rr` (0: row `quad`, 1: `quad + 8`) of an
/// m64n128 f32 accumulator fragment `x` (64 registers).
pub fn thread_row_max(b: &mut KernelBuilder, x: &[Reg<F32>], rr: usize) -> Reg<F32> {
    let idx: Vec<usize> = (0..64).filter(|i| (i / 2) % 2 == rr).collect();
    let mut mx = x[idx[0]];
    for &i in &idx[1..] {
        mx = b.max(mx, x[i]);
    }
    mx
}

/// The maximum of `mx` over the quad of lanes that share a fragment row.
pub fn quad_max(b: &mut KernelBuilder, mut mx: Reg<F32>) -> Reg<F32> {
    for d in [1u32, 2] {
        let o = b.shfl(Shfl::Bfly, mx, d, 0x1f);
        mx = b.max(mx, o);
    }
    mx
}

/// An m64n128 f32 fragment `p` (64 values per thread) rounded to bf16 as the 32 words of a
/// wgmma A operand from registers: k16 step `k` reads words `4k .. 4k + 4`.
pub fn bf16_a_frags(b: &mut KernelBuilder, p: &[Reg<F32>]) -> Vec<Reg<Bf16x2>> {
    let mut frags = Vec::with_capacity(32);
    for jj in 0..16usize {
        for rr in 0..2usize {
            let i = 4 * jj + 2 * rr;
            frags.push(b.cvt_bf16x2(p[i + 1], p[i]));
        }
    }
    frags
}

/// One Hopper wgmma GEMM over K = 128 with A from registers (`frags`, [`bf16_a_frags`]) and B
/// an MN-major SW128 tile whose descriptor starts at `b0`: eight k16 steps, the first with
/// scale-d `first` (false: overwrite `acc`), the others accumulating (`always`, a true
/// predicate). Fenced and committed by the caller.
pub fn wgmma_rs_k128(
    b: &mut KernelBuilder,
    acc: &[Reg<F32>],
    frags: &[Reg<Bf16x2>],
    b0: Reg<B64>,
    (first, always): (Reg<Pred>, Reg<Pred>),
) {
    for k in 0..8u32 {
        let b_desc = mn_major().emit_step(b, b0, k);
        let a = std::array::from_fn(|e| frags[(4 * k) as usize + e]);
        b.wgmma_rs(acc, a, b_desc, if k == 0 { first } else { always }, true);
    }
}

/// One Hopper wgmma GEMM over K = 128 with both operands in shared memory: eight k16 steps
/// over the SW128 tile views (`major`; MN-major operands are transposed) whose descriptors
/// start at `a0` and `b0`, committed by the caller. The first step overwrites `acc`
/// (`never` is a false predicate), the others accumulate (`always`, a true one).
pub fn wgmma_ss_k128(
    b: &mut KernelBuilder,
    acc: &[Reg<F32>],
    major: Major,
    (a0, b0): (Reg<B64>, Reg<B64>),
    (never, always): (Reg<Pred>, Reg<Pred>),
) {
    let desc = SmemDesc::sw128_tile(Target::Sm90a, major);
    let transpose = major == Major::MN;
    for k in 0..8u32 {
        let a_desc = desc.emit_step(b, a0, k);
        let b_desc = desc.emit_step(b, b0, k);
        let acc_p = if k == 0 { never } else { always };
        b.wgmma_ss(acc, a_desc, b_desc, acc_p, transpose, transpose);
    }
}

/// A lane's part in `stmatrix.x4` of the fragment's 8×8 matrices `(j, rr)` = `(2s, 0)`,
/// `(2s, 1)`, `(2s + 1, 0)`, `(2s + 1, 1)` of instruction `s` into rows with an SW128-style
/// XOR of 16-byte chunks by `row & 7`: lane `8·mi + r` gives row `r + 8·(mi & 1)` of the
/// matrix, whose chunk is `(2s + (mi >> 1)) ^ r` = `2·(s ^ h2) + ((mi >> 1) ^ r) & 1`.
pub struct StmatrixLane {
    /// The matrix row this lane addresses, `r + 8·(mi & 1)` (0..16).
    pub row: Reg<U32>,
    /// `16·(((mi >> 1) ^ r) & 1)`: the byte offset of the chunk's odd bit.
    half_chunk: Reg<U32>,
    /// `r >> 1`, XORed into `s`.
    h2: Reg<U32>,
}

impl StmatrixLane {
    pub fn new(b: &mut KernelBuilder, lane: Reg<U32>) -> Self {
        let mi = b.shr(lane, 3u32);
        let r = b.and(lane, 7u32);
        let rr = b.and(mi, 1u32);
        let row = b.mad_lo(rr, 8u32, r);
        let a = b.shr(mi, 1u32);
        let odd = b.xor(a, r);
        let odd = b.and(odd, 1u32);
        let half_chunk = b.shl(odd, 4u32);
        let h2 = b.shr(r, 1u32);
        StmatrixLane {
            row,
            half_chunk,
            h2,
        }
    }

    /// `count` `stmatrix.x4` of a warp's fragment into 128-byte SW128 rows, this lane's
    /// addressed row being `row` at `base + 128·row`: instruction `s` stores the words of
    /// column groups `2s`, `2s + 1` (`words(b, s)`, in the order above), chunks `2(s % 4)`,
    /// `+1` of box `s / 4` (boxes of 16 rows, 2048 bytes apart), `offset` bytes further.
    pub fn store_sw128<T: Packed16x2>(
        &self,
        b: &mut KernelBuilder,
        row: Reg<U32>,
        base: Reg<U32>,
        offset: u32,
        count: u32,
        words: impl FnMut(&mut KernelBuilder, u32) -> [Reg<T>; 4],
    ) {
        self.sw128_rows(b, row, base).store(b, offset, count, words);
    }

    /// This lane's four `stmatrix` addresses of [`Self::store_sw128`] into rows at `base`:
    /// computed once where `row` and `base` do not change across a loop.
    pub fn sw128_rows(&self, b: &mut KernelBuilder, row: Reg<U32>, base: Reg<U32>) -> Sw128Rows {
        let lane_at = b.mad_lo(row, 128u32, self.half_chunk);
        let lane_at = b.add(lane_at, base);
        let at = [0u32, 1, 2, 3].map(|s| {
            let x = b.xor(self.h2, s);
            b.mad_lo(x, 32u32, lane_at)
        });
        Sw128Rows { at }
    }
}

/// A lane's `stmatrix` addresses into SW128 rows ([`StmatrixLane::sw128_rows`]): instruction
/// `s` at `at[s % 4]`, box `s / 4` 2048 bytes further.
pub struct Sw128Rows {
    at: [Reg<U32>; 4],
}

impl Sw128Rows {
    /// `count` `stmatrix.x4` of `words(b, s)`, as [`StmatrixLane::store_sw128`] describes,
    /// `offset` bytes further.
    pub fn store<T: Packed16x2>(
        &self,
        b: &mut KernelBuilder,
        offset: u32,
        count: u32,
        mut words: impl FnMut(&mut KernelBuilder, u32) -> [Reg<T>; 4],
    ) {
        for s in 0..count {
            let v = words(b, s);
            let addr = self.at[(s % 4) as usize];
            b.stmatrix_x4(&shared(addr, i64::from(offset + 2048 * (s / 4))), v);
        }
    }
}

/// A warp's 16 rows of an m64n128 f32 accumulator (the 16 heads of its query slot) as bf16
/// into its 4 KB at `stage`, as the two boxes a TMA reduce-add of 16 heads × 64 head dims reads
/// (`[16 heads][128 B]` each, SW128: the 16-byte chunk `k` of row `h` at `k ^ (h & 7)`), with
/// eight `stmatrix.x4`, conflict-free. The backward's dQ staging.
pub fn stage_rows_bf16(b: &mut KernelBuilder, acc: &[Reg<F32>], stage: Reg<U32>, lane: Reg<U32>) {
    stage_rows_16(b, acc, stage, lane, |b, hi, lo| b.cvt_bf16x2(hi, lo));
}

/// As [`stage_rows_bf16`], with the pairs packed by `pack(hi, lo)` (bf16 or f16): the KV
/// forward's f16 O staging.
pub fn stage_rows_16<T: Packed16x2>(
    b: &mut KernelBuilder,
    acc: &[Reg<F32>],
    stage: Reg<U32>,
    lane: Reg<U32>,
    pack: impl Fn(&mut KernelBuilder, Reg<F32>, Reg<F32>) -> Reg<T>,
) {
    let rows = stage_rows_at(b, stage, lane);
    stage_rows_16_at(b, acc, &rows, pack);
}

/// The lane's addresses of [`stage_rows_16`] into the 4 KB at `stage`, for a loop that
/// stages into the same place every time.
pub fn stage_rows_at(b: &mut KernelBuilder, stage: Reg<U32>, lane: Reg<U32>) -> Sw128Rows {
    let sm = StmatrixLane::new(b, lane);
    sm.sw128_rows(b, sm.row, stage)
}

/// As [`stage_rows_16`], at addresses from [`stage_rows_at`].
pub fn stage_rows_16_at<T: Packed16x2>(
    b: &mut KernelBuilder,
    acc: &[Reg<F32>],
    rows: &Sw128Rows,
    pack: impl Fn(&mut KernelBuilder, Reg<F32>, Reg<F32>) -> Reg<T>,
) {
    // Word (j, rr): row quad + 8rr, columns 8j + 2·pair, +1; box j / 8, chunk j % 8.
    let word = |b: &mut KernelBuilder, j: u32, rr: u32| {
        let i = (4 * j + 2 * rr) as usize;
        pack(b, acc[i + 1], acc[i])
    };
    rows.store(b, 0, 8, |b, s| {
        [
            word(b, 2 * s, 0),
            word(b, 2 * s, 1),
            word(b, 2 * s + 1, 0),
            word(b, 2 * s + 1, 1),
        ]
    });
}
