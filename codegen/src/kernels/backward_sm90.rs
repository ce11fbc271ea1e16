//! `msa_backward_sm90`: the main backward kernel for Hopper (sm_90a).
//!
//! # Design
//! The kernel consumes the task tables and descriptor of the device task build and walks
//! CTAs with the same rule as the SM100 kernel (`docs/design.md` §2.4, §3.3). One task row is a
//! 128×128 tile: 128 keys of one key block × 128 folded rows (8 query slots × 16 heads of the
//! bucket's index head, column `n = slot·16 + h`), head dim 128.
//!
//! - **Warpgroups.** 384 threads. Warpgroup 0 is the producer: after `setmaxnreg.dec` its
//!   thread 0 issues every TMA load (K/V once per segment, Q/dO as 16-head × 64-d boxes,
//!   32 per task; a −1 query row is out of bounds, so TMA zero-fills it), and its warp 1
//!   gathers each task's row scalars (`−lse·log2e`, −∞ for an empty slot; delta; the slots'
//!   query positions) into shared memory ahead of the softmax. Every consumer thread
//!   releases the row scalars itself, right after its last read of them: the write-after-read
//!   order of the next fill then rests on each reader's own `mbarrier.arrive` (release) and
//!   the gather lanes' `try_wait` (acquire), which compute-sanitizer's racecheck follows; a
//!   hand-off through `bar.sync` and one elected arrival is just as ordered by the PTX memory
//!   model, but racecheck reports it as a hazard. Warpgroups 1 and 2 are
//!   consumers (`setmaxnreg.inc`); consumer `c` owns keys `64c .. 64c+64`.
//! - **Pipelines** are the typed [`Pipeline`] values the SM100 plan uses: K/V one stage
//!   (full: 1 arrival + the tx bytes of its four TMA boxes; empty: one arrival per consumer
//!   warpgroup), Q/dO two stages (32 boxes), row scalars one stage (full: the gather warp's
//!   32 lanes; empty: all 256 consumer threads). Stage indices and parities come from
//!   [`Pipe`] over running counters, never written by hand; the operand descriptors are the
//!   plan's [`SmemDesc`] SW128 views (Hopper encoding).
//! - **GEMMs** (wgmma, bf16 in, f32 in registers), per task and consumer, over two 64-row
//!   halves of the folded rows:
//!   - `S^T = K_c·Q_hᵀ` and `dP^T = V_c·dO_hᵀ`: m64n64k16, both operands K-major SW128.
//!   - `P^T = exp2(S^T·scale·log2e − lse·log2e)` with the causal predicate
//!     `qpos ≥ key_pos` in workspace coordinates; invalid slots have −lse·log2e = −∞.
//!   - `dS^T = bf16(P^T ∘ (dP^T − Delta) · scale)`: the softmax scale is folded into dS.
//!   - `dV_c += P^T·dO_h` and `dK_c += dS^T·Q_h`: m64n128k16 with A from registers (the
//!     accumulator layout of S^T is the wgmma A-fragment layout) and B an MN-major
//!     descriptor over the same Q/dO bytes. dK/dV stay in registers across a segment.
//!   - dS^T is also stored to shared memory (SW128, MN-major panels); after both consumers
//!     have written it, `dQ^T_c = K^T_c·dS^T` (two m64n64k16 passes over the folded halves,
//!     both operands MN-major, to keep the accumulator small next to dK/dV; consumer
//!     `c` owns head dims `64c .. 64c+64`).
//! - **Writes.** dQ^T columns come in head pairs (2m, 2m+1) in one thread, so each pair is
//!   one `red.global.add.noftz.bf16x2` into the head-pair-interleaved pool, with an L2
//!   evict_last policy. At a segment's end dK/dV are flushed with `red.global.add.v4.f32`
//!   after a lane-pair exchange that gives each lane four consecutive head dims.

use super::common::{self, elem_bytes, MainParams};
use super::KernelDesc;
use crate::plan::gemm::SmemDesc;
use crate::plan::pipeline::{Barriers, Pipe, Pipeline, TmaBox};
use crate::plan::roles::Role;
use crate::plan::smem::Major;
use crate::ptx::*;
use crate::target::Target;

/// Threads per CTA: one producer warpgroup and two consumer warpgroups.
pub const THREADS: u32 = 384;
/// Registers of the producer warpgroup after `setmaxnreg.dec`.
pub const PRODUCER_REGS: u32 = 24;
/// Registers of each consumer warpgroup after `setmaxnreg.inc`.
pub const CONSUMER_REGS: u32 = 240;

const TILE_BYTES: u32 = 128 * 128 * 2;
const PANEL_BYTES: u32 = 128 * 128;
const SK: u32 = 0;
const SV: u32 = TILE_BYTES;
const SQ: u32 = 2 * TILE_BYTES;
const SDO: u32 = 4 * TILE_BYTES;
const SDS: u32 = 6 * TILE_BYTES;
const BARS: u32 = 7 * TILE_BYTES;
/// The task's row scalars (one stage): `−lse·log2e` (−∞ for an empty slot) and delta per
/// folded row, then the 8 slots' query positions.
const SCALARS: u32 = BARS + 128;
const S_LSE: u32 = SCALARS;
const S_DELTA: u32 = SCALARS + 4 * 128;
const S_QPOS: u32 = SCALARS + 8 * 128;
/// Dynamic shared memory: sK, sV, sQ×2, sdO×2, sdS (32 KiB each), the barriers and the row
/// scalars, and 1 KiB of slack to align the tiles to the 1024-B swizzle atom at run time.
pub const SMEM_BYTES: u32 = S_QPOS + 4 * 8 + 96 + 1024;

/// The K/V pipeline: one stage per segment, two 128-key × 64-d boxes each of K and V; each
/// consumer warpgroup releases it once.
pub fn kv_pipeline() -> Pipeline {
    let mut p = Pipeline::new("kv", 1, Role::Load, &[Role::Compute], 1, 2);
    p.tx = vec![
        TmaBox {
            dims: vec![64, 1, 128],
            elem_bytes: 2
        };
        4
    ];
    p
}

/// The Q/dO pipeline: two stages, 8 slots × 2 d-halves × 2 tensors of 16 heads × 64 d.
pub fn qdo_pipeline() -> Pipeline {
    let mut p = Pipeline::new("q_do", 2, Role::Load, &[Role::Compute], 1, 2);
    p.tx = vec![
        TmaBox {
            dims: vec![64, 16, 1],
            elem_bytes: 2
        };
        32
    ];
    p
}

/// The row-scalar pipeline: one stage filled by the gather warp's 32 lanes (each arrives
/// after its stores) and released by every consumer thread after its own last read, so that
/// each read is ordered before the next fill by that thread's own release-arrive (no
/// hand-off through a warpgroup barrier and one elected thread).
pub fn rows_pipeline() -> Pipeline {
    Pipeline::new("rows", 1, Role::Scalar, &[Role::Compute], 32, 2 * 128)
}

/// Barrier slots: K/V full/empty at 0/1, Q/dO full at 2-3 and empty at 4-5, rows full/empty
/// at 6/7.
const KV_SLOT: u32 = 0;
const QDO_SLOT: u32 = 2;
const ROWS_SLOT: u32 = 6;

fn barriers(b: &mut KernelBuilder, base: Reg<U32>) -> Barriers {
    common::sm90_barriers(b, base, BARS)
}

/// The Hopper main kernel.
pub const DESC: KernelDesc = KernelDesc {
    name: "msa_backward_sm90",
    about:
        "MSA backward main kernel for Hopper: TMA + mbarrier pipelines, wgmma, dK/dV in registers",
    targets: &[Target::Sm90a],
    threads: (THREADS, 1, 1),
    describe,
};

/// The CTA's task-row interval and a row's bucket.
struct Walk {
    lo: Reg<U32>,
    hi: Reg<U32>,
}

fn describe(b: &mut KernelBuilder) {
    b.grid("[grid_launch_bound(capacity, num_sms), 1, 1]");
    b.min_ctas_per_sm(1);
    let p = common::main_params(b);
    let smem = b.dynamic_shared("smem", SMEM_BYTES, 1024);
    let (_, base) = common::swizzle_aligned_base(b, &smem);
    let tid = b.sreg(SReg::TidX);
    let leader = common::sm90_init_pipelines(
        b,
        tid,
        base,
        BARS,
        &[
            (kv_pipeline(), KV_SLOT),
            (qdo_pipeline(), QDO_SLOT),
            (rows_pipeline(), ROWS_SLOT),
        ],
    );

    b.comment("the CTA walk: this CTA's interval of task rows");
    let desc = b.ld_param_ptr(&p.desc);
    let walk = cta_interval(b, desc);

    let wg = b.shr(tid, 7u32);
    let is_producer = b.setp(Cmp::Eq, wg, 0u32);
    let consumers = b.label("consumers");
    b.bra_unless(is_producer, &consumers);
    b.setmaxnreg(false, PRODUCER_REGS);
    b.if_then(leader, "producer", |b| producer(b, &p, base, &walk));
    let warp = b.shr(tid, 5u32);
    let is_gather = b.setp(Cmp::Eq, warp, 1u32);
    b.if_then(is_gather, "gather", |b| gather(b, &p, base, tid, &walk));
    b.ret();

    b.place(&consumers);
    b.setmaxnreg(true, CONSUMER_REGS);
    consumer(b, &p, base, tid, &walk);
    b.ret();
}

/// CTA `b`'s rows `[lo, hi)` from the descriptor (the device mirror of `cta_interval`).
fn cta_interval(b: &mut KernelBuilder, desc: Reg<U64>) -> Walk {
    let words: [Reg<U32>; 4] = b.ld_v(&global(desc, 0));
    let [n, r, full, tail] = words;
    let grid = b.ld::<U32, _>(&global(desc, 16));
    let cta = b.sreg(SReg::CtaidX);
    let (lo, hi) = common::cta_interval(b, cta, n, r, full, tail, grid);
    Walk { lo, hi }
}

/// Reads `(index_head, kblock, valid)` of task row `row`.
fn task_meta(b: &mut KernelBuilder, meta: Reg<U64>, row: Reg<U32>) -> [Reg<U32>; 4] {
    let a = elem_bytes(b, meta, row, 16);
    b.ld_v(&a)
}

/// A row's bucket `(index_head, kblock)` packed in one word (kblock < 2^24).
fn bucket(b: &mut KernelBuilder, m: &[Reg<U32>; 4]) -> Reg<U32> {
    let h = b.shl(m[1], 24u32);
    b.or(h, m[2])
}

fn producer(b: &mut KernelBuilder, p: &MainParams, base: Reg<U32>, walk: &Walk) {
    let meta = b.ld_param_ptr(&p.meta);
    let qrows = b.ld_param_ptr(&p.qrows);
    let tq = b.tensor_map_addr(&p.tmap_q);
    let tdo = b.tensor_map_addr(&p.tmap_do);
    let tk = b.tensor_map_addr(&p.tmap_k);
    let tv = b.tensor_map_addr(&p.tmap_v);
    let (kv, qdo) = (kv_pipeline(), qdo_pipeline());
    let kv = Pipe {
        pipeline: &kv,
        slot: KV_SLOT,
    };
    let qdo = Pipe {
        pipeline: &qdo,
        slot: QDO_SLOT,
    };
    let bars = barriers(b, base);
    let prev = b.mov::<U32>(u32::MAX);
    let segments = b.mov::<U32>(0u32);
    let tasks = b.mov::<U32>(0u32);
    b.for_range(walk.lo, walk.hi, 1, "producer_row", |b, row| {
        let m = task_meta(b, meta, row);
        let cur = bucket(b, &m);
        let same = b.setp(Cmp::Eq, cur, prev);
        b.unless(same, "kv_load", |b| {
            // A new segment: wait until both consumers released the previous K/V.
            let st = kv.producer_acquire(b, &bars, segments);
            let tiles = [shared(base, SK as i64), shared(base, SV as i64)];
            common::load_kv_tiles(b, [tk, tv], tiles, &m, &st.full);
            let next = b.add(segments, 1u32);
            b.set(segments, next);
            b.set(prev, cur);
        });
        let st = qdo.producer_acquire(b, &bars, tasks);
        let stage_off = b.mul_lo(st.index, TILE_BYTES);
        let q_tile = b.add(base, stage_off);
        let tiles = [shared(q_tile, SQ as i64), shared(q_tile, SDO as i64)];
        common::load_qdo_tiles(b, [tq, tdo], tiles, qrows, row, &m, &st.full);
        let next = b.add(tasks, 1u32);
        b.set(tasks, next);
    });
}

/// The gather warp (warp 1 of the producer warpgroup): per task, the row scalars of its 128
/// folded rows into shared memory, ahead of the consumers' softmax. Lane `4·slot + part`
/// fills folded rows `4·lane .. 4·lane+4` (slot `lane/4`, heads `4·part ..`).
fn gather(b: &mut KernelBuilder, p: &MainParams, base: Reg<U32>, tid: Reg<U32>, walk: &Walk) {
    let rows = rows_pipeline();
    let rows = Pipe {
        pipeline: &rows,
        slot: ROWS_SLOT,
    };
    let bars = barriers(b, base);
    let g = common::gather_lane(b, tid);
    let tasks = b.mov::<U32>(0u32);
    b.for_range(walk.lo, walk.hi, 1, "gather_row", |b, row| {
        let st = rows.producer_acquire(b, &bars, tasks);
        let meta = b.ld_param_ptr(&p.meta);
        let m = task_meta(b, meta, row);
        let (l4, d4) = common::gather_row_scalars(b, p, row, m[1], &g);
        let row8 = b.shl(row, 3u32);
        let at = b.add(base, g.lane16);
        b.st_v(&shared(at, S_LSE as i64), l4);
        b.st_v(&shared(at, S_DELTA as i64), d4);
        b.if_then(g.word_lane, "gather_qpos", |b| {
            let idx = b.add(row8, g.lane);
            let qpos = b.ld_param_ptr(&p.qpos);
            let a = common::elem::<S32>(b, qpos, idx);
            let v = b.ld::<S32, _>(&a);
            let lane4 = b.shl(g.lane, 2u32);
            let at = b.add(base, lane4);
            b.st(&shared(at, S_QPOS as i64), v);
        });
        rows.producer_commit(b, &bars, &st);
        let next = b.add(tasks, 1u32);
        b.set(tasks, next);
    });
}

/// SW128 tile descriptors (from the typed GEMM plan): K-major and MN-major views.
fn k_major() -> SmemDesc {
    SmemDesc::sw128_tile(Target::Sm90a, Major::K)
}

fn mn_major() -> SmemDesc {
    SmemDesc::sw128_tile(Target::Sm90a, Major::MN)
}

#[allow(clippy::too_many_lines)]
fn consumer(b: &mut KernelBuilder, p: &MainParams, base: Reg<U32>, tid: Reg<U32>, walk: &Walk) {
    let t = b.sub(tid, 128u32);
    let c = b.shr(t, 7u32); // consumer index 0/1: keys 64c.., head dims 64c..
    let tw = b.and(t, 127u32);
    let warp = b.shr(tw, 5u32);
    let lane = b.and(tw, 31u32);
    let quad = b.shr(lane, 2u32);
    let pair = b.and(lane, 3u32);
    let col0 = b.shl(pair, 1u32); // first column of this thread inside an 8-column group
    let row0 = b.mad_lo(warp, 16u32, quad); // accumulator row (and row + 8)
    let key_local = b.mad_lo(c, 64u32, row0); // key inside the block (and + 8)
    let elected = b.setp(Cmp::Eq, tw, 0u32);
    let wg_bar = b.add(c, 2u32); // named barrier 2 + c: one consumer warpgroup
    let zero = b.mov::<U32>(0u32);
    let always = b.setp(Cmp::Eq, zero, 0u32);
    let never = b.setp(Cmp::Ne, zero, 0u32);
    let neg_inf = f32::NEG_INFINITY;
    let scale_log2e = common::SCALE_LOG2E;

    // Pointers are re-read from the parameter bank where used: holding all eight across the
    // loop costs 16 registers the accumulators need.

    let (kv, qdo, rows) = (kv_pipeline(), qdo_pipeline(), rows_pipeline());
    let kv = Pipe {
        pipeline: &kv,
        slot: KV_SLOT,
    };
    let qdo = Pipe {
        pipeline: &qdo,
        slot: QDO_SLOT,
    };
    let rows = Pipe {
        pipeline: &rows,
        slot: ROWS_SLOT,
    };
    let bars = barriers(b, base);
    let c_panel = b.mul_lo(c, PANEL_BYTES);
    let c_rows = b.mul_lo(c, 64 * 128);
    let dv_acc: Vec<Reg<F32>> = (0..64).map(|_| b.reg()).collect();
    let dk_acc: Vec<Reg<F32>> = (0..64).map(|_| b.reg()).collect();
    let prev = b.mov::<U32>(u32::MAX);
    let segments = b.mov::<U32>(0u32);
    let tasks = b.mov::<U32>(0u32);

    b.for_range(walk.lo, walk.hi, 1, "task", |b, row| {
        let meta = b.ld_param_ptr(&p.meta);
        let m = task_meta(b, meta, row);
        let head = m[1];
        let kb = m[2];
        let cur = bucket(b, &m);
        // `same` also marks the segment's first task, whose first dV/dK MMA overwrites.
        let same = b.setp(Cmp::Eq, cur, prev);
        b.unless(same, "kv_wait", |b| {
            kv.consumer_wait(b, &bars, segments);
            b.set(prev, cur);
        });
        // The segment ends at the interval's end or where the next row changes bucket.
        let next_row = b.add(row, 1u32);
        let last = b.setp(Cmp::Ge, next_row, walk.hi);
        let seg_end = b.mov::<U32>(1u32);
        b.unless(last, "next_bucket", |b| {
            let meta = b.ld_param_ptr(&p.meta);
            let nm = task_meta(b, meta, next_row);
            let next = bucket(b, &nm);
            let cont = b.setp(Cmp::Eq, next, prev);
            let v = b.selp(0u32, 1u32, cont);
            b.set(seg_end, v);
        });

        let qst = qdo.consumer_wait(b, &bars, tasks);
        let stage_off = b.mul_lo(qst.index, TILE_BYTES);
        let q_tile = b.add(base, stage_off);
        let q_base = b.add(q_tile, SQ);
        let do_base = b.add(q_tile, SDO);

        let key_pos = b.shl(kb, 7u32);
        let key_pos = b.add(key_pos, key_local);
        let key_pos8 = b.add(key_pos, 8u32);
        // Slot words are re-read where needed (L1 hits) rather than held in 16 registers.
        let slot_word = |b: &mut KernelBuilder, table: &ParamRef<U64>, slot: usize| {
            let table = b.ld_param_ptr(table);
            let a = elem_bytes(b, table, row, 32);
            b.ld::<S32, _>(&a.offset(4 * slot as i64))
        };
        let key_pos_s = b.bitcast::<S32, U32>(key_pos);
        let key_pos8_s = b.bitcast::<S32, U32>(key_pos8);
        let mut rows_stage = None;

        for half in 0..2u32 {
            b.comment(&format!(
                "half {half}: S^T and dP^T for folded rows {}..{}",
                64 * half,
                64 * half + 64
            ));
            let s_acc: Vec<Reg<F32>> = (0..32).map(|_| b.reg()).collect();
            let dp_acc: Vec<Reg<F32>> = (0..32).map(|_| b.reg()).collect();
            b.wgmma_fence();
            for (acc, a_tile, b_tile) in [(&s_acc, SK, q_base), (&dp_acc, SV, do_base)] {
                let a_addr = b.add(base, a_tile);
                let a_addr = b.add(a_addr, c_rows);
                let a0 = k_major().emit(b, a_addr);
                let b_addr = b.add(b_tile, half * 64 * 128);
                let b0 = k_major().emit(b, b_addr);
                for k in 0..8u32 {
                    let a_desc = k_major().emit_step(b, a0, k);
                    let b_desc = k_major().emit_step(b, b0, k);
                    let acc_p = if k == 0 { never } else { always };
                    b.wgmma_ss(acc, a_desc, b_desc, acc_p, false, false);
                }
            }
            b.wgmma_commit();
            b.wgmma_wait(0);
            if half == 0 {
                b.comment("the gather warp's row scalars for this task");
                rows_stage = Some(rows.consumer_wait(b, &bars, tasks));
            }

            b.comment("P^T = exp2(S^T*scale*log2e - lse*log2e) under the causal predicate; dS^T");
            let mut p_frag = Vec::new();
            let mut ds_frag = Vec::new();
            for j in 0..8u32 {
                // Columns 64·half + 8j + col0 + e: slot 4·half + j/2, head 8(j%2) + col0 + e.
                let slot = 4 * half + j / 2;
                let slot_qpos = b.ld::<S32, _>(&shared(base, (S_QPOS + 4 * slot) as i64));
                let mut p_pair = [[None; 2]; 2];
                let mut ds_pair = [[None; 2]; 2];
                for e in 0..2u32 {
                    // Folded row 16·slot + 8(j%2) + col0 + e: −lse·log2e (−∞ for an empty
                    // slot) and delta, gathered into shared memory.
                    let n4 = b.shl(col0, 2u32);
                    let at = b.add(base, n4);
                    let n = 16 * slot + 8 * (j % 2) + e;
                    let nl = b.ld::<F32, _>(&shared(at, (S_LSE + 4 * n) as i64));
                    let dl = b.ld::<F32, _>(&shared(at, (S_DELTA + 4 * n) as i64));
                    for rr in 0..2usize {
                        let i = (4 * j) as usize + 2 * rr + e as usize;
                        let kp = if rr == 0 { key_pos_s } else { key_pos8_s };
                        let v = b.fma(s_acc[i], scale_log2e, nl);
                        let seen = b.setp(Cmp::Ge, slot_qpos, kp);
                        let v = b.selp(v, neg_inf, seen);
                        let pv = b.ex2_approx(v);
                        let dd = b.sub(dp_acc[i], dl);
                        let ds = b.fmul(pv, dd);
                        let ds = b.fmul(ds, common::SCALE);
                        p_pair[rr][e as usize] = Some(pv);
                        ds_pair[rr][e as usize] = Some(ds);
                    }
                }
                for rr in 0..2 {
                    let [lo, hi] = p_pair[rr].map(|v| v.expect("filled above"));
                    p_frag.push(b.cvt_bf16x2(hi, lo));
                    let [lo, hi] = ds_pair[rr].map(|v| v.expect("filled above"));
                    ds_frag.push(b.cvt_bf16x2(hi, lo));
                }
            }

            if half == 1 {
                b.comment("this thread's last read of the row scalars is done: release them");
                let rst = rows_stage.as_ref().expect("waited in half 0");
                rows.consumer_release(b, &bars, rst);
            }

            b.comment("dS^T to shared memory: SW128 panels [folded/64][key][64 folded]");
            for j in 0..8u32 {
                for rr in 0..2u32 {
                    // Row = key (64c + row0 + 8rr); column = folded 64·half + 8j + col0.
                    let key = b.add(key_local, 8 * rr);
                    let row_off = b.shl(key, 7u32);
                    let chunk = b.and(key, 7u32);
                    let chunk = b.xor(chunk, j);
                    let chunk = b.shl(chunk, 4u32);
                    let within = b.shl(col0, 1u32);
                    let off = b.add(row_off, chunk);
                    let off = b.add(off, within);
                    let off = b.add(off, SDS + half * PANEL_BYTES);
                    let addr = b.add(base, off);
                    b.st(&shared(addr, 0), ds_frag[(2 * j + rr) as usize]);
                }
            }

            b.comment("dV += P^T*dO_h, dK += dS^T*Q_h (A from registers, B MN-major)");
            b.wgmma_fence();
            for (acc, frags, tile) in [(&dv_acc, &p_frag, do_base), (&dk_acc, &ds_frag, q_base)] {
                let b_addr = b.add(tile, half * 64 * 128);
                let b0 = mn_major().emit(b, b_addr);
                for k in 0..4u32 {
                    let b_desc = mn_major().emit_step(b, b0, k);
                    let a = [
                        frags[(4 * k) as usize],
                        frags[(4 * k + 1) as usize],
                        frags[(4 * k + 2) as usize],
                        frags[(4 * k + 3) as usize],
                    ];
                    let acc_p = if half == 0 && k == 0 { same } else { always };
                    b.wgmma_rs(acc, a, b_desc, acc_p, true);
                }
            }
            b.wgmma_commit();
            b.wgmma_wait(0);
        }

        b.comment("release the Q/dO stage once the whole warpgroup is done");
        b.bar_sync_reg(wg_bar, 128);
        b.predicated(elected, false, |b| qdo.consumer_release(b, &bars, &qst));

        b.comment("dQ^T_c = K^T_c*dS^T once both consumers stored dS^T");
        b.fence_proxy_async_shared();
        b.bar_sync(1, Some(256));
        // Two 64-column halves of dQ^T keep the accumulator at 32 registers next to dK/dV.
        let a_addr = b.add(base, SK);
        let a_addr = b.add(a_addr, c_panel);
        let a0 = mn_major().emit(b, a_addr);
        let d_row = b.mad_lo(c, 64u32, row0);
        let policy = b.policy_evict_last(1.0);
        for nh in 0..2u32 {
            let dq_acc: Vec<Reg<F32>> = (0..32).map(|_| b.reg()).collect();
            let b_addr = b.add(base, SDS + nh * PANEL_BYTES);
            let b0 = mn_major().emit(b, b_addr);
            b.wgmma_fence();
            for k in 0..8u32 {
                let a_desc = mn_major().emit_step(b, a0, k);
                let b_desc = mn_major().emit_step(b, b0, k);
                let acc_p = if k == 0 { never } else { always };
                b.wgmma_ss(&dq_acc, a_desc, b_desc, acc_p, true, true);
            }
            b.wgmma_commit();
            b.wgmma_wait(0);
            if nh == 1 {
                // Both consumers must finish reading sdS before the next task overwrites it.
                b.bar_sync(1, Some(256));
            }

            b.comment("dQ: head pairs to the bf16x2 pool");
            for j in 0..8u32 {
                // Folded column 64nh + 8j + col0 (+1): slot 4nh + j/2, heads 2hp, 2hp+1.
                let slot = (4 * nh + j / 2) as usize;
                let hp = b.shl(head, 3u32);
                let hp = b.add(hp, pair);
                let hp = b.add(hp, 4 * (j % 2));
                let slot_qrow = slot_word(b, &p.qrows, slot);
                let live = b.setp(Cmp::Ge, slot_qrow, 0i32);
                let r = b.bitcast::<U32, S32>(slot_qrow);
                for rr in 0..2u32 {
                    let i = (4 * j + 2 * rr) as usize;
                    let packed = b.cvt_bf16x2(dq_acc[i + 1], dq_acc[i]);
                    let d = b.add(d_row, 8 * rr);
                    let word = b.mad_lo(r, 32u32, hp);
                    let word = b.mad_lo(word, 128u32, d);
                    let dq = b.ld_param_ptr(&p.dq);
                    let a = common::elem::<U32>(b, dq, word);
                    b.predicated(live, false, |b| b.red_add_bf16x2(&a, packed, Some(policy)));
                }
            }
        }

        let is_end = b.setp(Cmp::Ne, seg_end, 0u32);
        b.if_then(is_end, "flush", |b| {
            b.comment("segment end: dK/dV to the fp32 pools, four head dims per lane");
            let odd = b.and(lane, 1u32);
            let is_odd = b.setp(Cmp::Ne, odd, 0u32);
            let kv_row = b.shl(kb, 7u32);
            let kv_row = b.add(kv_row, key_local);
            for (acc, pool_p) in [(&dv_acc, &p.dv), (&dk_acc, &p.dk)] {
                let pool = b.ld_param_ptr(pool_p);
                for j in 0..16u32 {
                    let i = (4 * j) as usize;
                    // Even lanes keep row r and take the partner's columns c+2, c+3; odd
                    // lanes keep row r+8 and take the partner's columns c-2, c-1.
                    let send0 = b.selp(acc[i], acc[i + 2], is_odd);
                    let send1 = b.selp(acc[i + 1], acc[i + 3], is_odd);
                    let got0 = b.shfl(Shfl::Bfly, send0, 1u32, 0x1f);
                    let got1 = b.shfl(Shfl::Bfly, send1, 1u32, 0x1f);
                    let v0 = b.selp(got0, acc[i], is_odd);
                    let v1 = b.selp(got1, acc[i + 1], is_odd);
                    let v2 = b.selp(acc[i + 2], got0, is_odd);
                    let v3 = b.selp(acc[i + 3], got1, is_odd);
                    let row_add = b.selp(8u32, 0u32, is_odd);
                    let key_row = b.add(kv_row, row_add);
                    let col_sub = b.shl(odd, 1u32);
                    let col = b.add(col0, 8 * j);
                    let col = b.sub(col, col_sub);
                    let idx = b.mad_lo(key_row, 4u32, head);
                    let idx = b.mad_lo(idx, 128u32, col);
                    let a = common::elem::<F32>(b, pool, idx);
                    b.red_add_v4_f32(&a, [v0, v1, v2, v3], None);
                }
            }
            b.bar_sync_reg(wg_bar, 128);
            let st = kv.locate(b, &bars, segments.into());
            b.predicated(elected, false, |b| kv.consumer_release(b, &bars, &st));
            let next = b.add(segments, 1u32);
            b.set(segments, next);
        });
        let next = b.add(tasks, 1u32);
        b.set(tasks, next);
    });
}
