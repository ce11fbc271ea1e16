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
//!   compact rows and query positions) into shared memory ahead of the softmax. Every consumer
//!   thread releases the row scalars itself, right after its last read of them: the
//!   write-after-read order of the next fill then rests on each reader's own `mbarrier.arrive`
//!   (release) and the gather lanes' `try_wait` (acquire), which compute-sanitizer's racecheck
//!   follows; a hand-off through `bar.sync` and one elected arrival is just as ordered by the
//!   PTX memory model, but racecheck reports it as a hazard. Warpgroups 1 and 2 are
//!   consumers (`setmaxnreg.inc`); consumer `c` owns keys `64c .. 64c+64`.
//! - **Plan.** Every resource comes from the typed [`Sm90Plan`] (`crate::plan::sm90`), checked
//!   at codegen time as the SM100 kernel's plan is: the `setmaxnreg` budgets, the
//!   shared-memory offsets ([`SmemPlan`](crate::plan::smem::SmemPlan)), the pipelines with
//!   their barrier slots ([`PipelinePlan`](crate::plan::pipeline::PipelinePlan)) and the
//!   named barriers. Pipelines: K/V one stage (full: 1 arrival + the tx bytes of its four TMA
//!   boxes; empty: one arrival per consumer warpgroup), Q/dO two stages (32 boxes), row
//!   scalars one stage (full: the gather warp's 32 lanes; empty: all 256 consumer threads).
//!   Stage indices and parities come from [`Pipe`] over running counters, never written by
//!   hand; the operand descriptors are the plan's [`SmemDesc`](crate::plan::gemm::SmemDesc) SW128 views (Hopper encoding).
//! - **GEMMs** (wgmma, bf16 in, f32 in registers), per task and consumer, over two 64-row
//!   halves of the folded rows:
//!   - `S^T = K_c·Q_hᵀ` and `dP^T = V_c·dO_hᵀ`: m64n64k16, both operands K-major SW128,
//!     committed as two groups: after `wgmma.wait_group 1` (S^T done, dP^T still running)
//!     the thread computes `P^T = exp2(S^T·scale·log2e − lse·log2e)` with the causal
//!     predicate `qpos ≥ key_pos` in workspace coordinates (invalid slots have
//!     −lse·log2e = −∞), so the exponentials overlap the dP^T GEMM.
//!   - After `wait_group 0`: `dS^T = bf16(P^T ∘ (dP^T − Delta) · scale)` (the softmax scale
//!     is folded into dS).
//!   - `dV_c += P^T·dO_h` and `dK_c += dS^T·Q_h`: m64n128k16 with A from registers (the
//!     accumulator layout of S^T is the wgmma A-fragment layout) and B an MN-major
//!     descriptor over the same Q/dO bytes. dK/dV stay in registers across a segment.
//!   - In half 1, half 0's dV/dK group is still in flight: S^T is queued behind it and dP^T
//!     issued once it has completed (`wait_group 1`), so the tensor cores do not drain
//!     between the halves while the registers of half 0's A fragments are freed before
//!     dP^T's accumulators need them (168 registers, no spills). Session 10's rounds on
//!     the H200 (`bench/results/h200-2026-12-02-s10-backward.md`): this with the dQ GEMM
//!     below and the preprocess of `bwd_preprocess` in memory order, +2.5-3.9 % on the
//!     device-schedule path.
//!   - dS^T is also stored to shared memory (SW128, MN-major panels); after both consumers
//!     have written it (`bar.sync` over both, the one consumer-wide wait of a task, reached
//!     while half 1's dV/dK still runs), `dQ_c = dS_c·K`: one m64n128k16 GEMM per consumer
//!     over its folded half `c` (slots `4c .. 4c+4`) and all 128 head dims, A the dS^T panel
//!     of that half, B the whole K tile, both MN-major; 64 accumulator registers. Warp `w`
//!     then holds the rows of one slot, `4c + w`. Against two m64n64 passes (consumer `c`
//!     owning head dims `64c..`) it reads 48 KB of shared memory per task and consumer
//!     instead of 64 KB. It is issued once half 1's dV/dK has drained. (The deterministic
//!     kernel computes `dQ^T_c = K^T_c·dS^T` instead,
//!     two m64n64 passes over the folded halves with the first half's reductions under the
//!     second's GEMM, whose fragment its head-quad pool words follow.)
//!   - dS^T goes to its panel with `stmatrix.x4` (four per half and thread: the accumulator
//!     fragment is the 8×8 `stmatrix` layout, rows = keys), not 16 scalar stores with their
//!     address arithmetic each.
//!   - The write-after-read order on the shared dS^T (the next task's stores after the other
//!     consumer's last reads of it) is a split barrier, `ds_free`: a consumer `bar.arrive`s on
//!     the other's instance once it is done with the panel (not after the walk's last task),
//!     and `bar.sync`s on its own instance just before its next dS^T stores (not before the
//!     walk's first task), instead of a second consumer-wide `bar.sync` after dQ.
//! - **Writes.** dQ goes straight into `dq [T, 64, 128]` (no de-interleave in the
//!   postprocess; `docs/design.md` §3.6). Once its dQ GEMM has completed and the warpgroup has
//!   met (so no warp's part of the GEMM still reads panel `c`), each warp stages its 16 rows
//!   (its slot's 16 heads × 128 head dims, bf16) in its own 4 KB of that panel with eight
//!   `stmatrix.x4`, as the two SW128 boxes (16 heads × 64 head dims) of the `tmap_dq` tensor
//!   map, which has Q's geometry. Each lane fences its stores for the async proxy, the warp
//!   meets, and lane 0 issues two `cp.reduce.async.bulk.tensor.3d ... .add` (bf16 adds in
//!   L2). Lane 0 waits for them to have read the boxes (`cp.async.bulk.wait_group.read`)
//!   only in the next task, once its half-0 S^T/dP^T are issued; the warp then meets and the
//!   consumer's `ds_free` arrival lets the panel be overwritten. After the walk's last task
//!   the wait comes before the CTA exits. The TMA unit serves these reads behind the
//!   producer's Q/dO loads, so a wait right after the issue kept both consumers (in step
//!   since the barrier before dQ) off the tensor cores.
//!
//!   Session 11's H200 rounds (`bench/results/h200-2026-12-02-s11-backward.md`):
//!   - The staging replaced a 4×4 transpose in each quad and a swap between quads: 48
//!     shuffles and about 250 more instructions per thread and task.
//!   - Staged rows read back with `ld.shared.v4` and reduced with eight
//!     `red.global.add.noftz.v4.bf16x2` per thread, with the task metadata loaded one task
//!     ahead (its load had been on the path to each task's first GEMM), were 3-8 % faster than
//!     session 10's kernel. The TMA reduction is 1-2 % faster again: it takes the reductions
//!     off the registers and the LSU.
//!   - Session 12 (`bench/results/h200-2026-12-02-s12-backward.md`): the read wait moved
//!     into the next task, as above, was 3-7 % faster, and with the K/V stage released
//!     before the segment's dK/dV flush (below) 4.6-12 %; ncu puts the tensor pipe at 70 % of
//!     the cycles (63 % before). Walking 128, 256 or 512 task rows per CTA instead of 64 was
//!     0-5 % slower.
//!   - Deferring the reductions into the next task (after its S^T/dP^T issue, or after its
//!     half-0 exponentials) was 2-7 % slower: they then delay the dS that feeds its first
//!     dV/dK.
//!   - Letting the consumers drift apart (each one's dQ over the panel the other completes in
//!     its first pass, a split readiness barrier per direction instead of the consumer-wide
//!     one) was 1-4 % slower: the single-buffered panels bound the offset.
//!
//!   The slots' compact rows, which address the reductions, come from the gather warp's row
//!   stage, read before its release. At a segment's end the warpgroup meets and releases the
//!   K/V stage (every GEMM of the segment has completed), so that the next segment's K/V load
//!   runs under the flush; dK/dV are then flushed with `red.global.add.v4.f32` after a
//!   lane-pair exchange that gives each lane four consecutive head dims.
//! - **Deterministic mode** (`msa_backward_sm90_det`, `fixed_point`): the gather warp also
//!   computes each slot's inverse dQ unit from `a[t, g]` into the row stage, so that the
//!   consumers only read eight words before they release it; dQ goes as integer-valued f32
//!   head quads (`red.add.v4.f32`), dK/dV as i64 (`red.add.u64`) at a segment's end.

use super::common::{self, k_major, mn_major, MainParams, Walk};
use super::fixed_point;
use super::KernelDesc;
use crate::plan::pipeline::{Barriers, NamedBarrier, Pipe};
use crate::plan::sm90::{Sm90Plan, Sm90Warps, WarpgroupBarrier};
use crate::plan::smem::{Buf, Major, Placed, PANEL_BYTES};
use crate::ptx::*;
use crate::target::Target;

/// Threads per CTA: one producer warpgroup and two consumer warpgroups.
pub const THREADS: u32 = crate::plan::sm90::THREADS;
/// Dynamic shared memory requested: the per-CTA maximum, which leaves the slack above the
/// plan's layout for aligning the base to the 1024-B swizzle atom at run time (a base that
/// needs more traps instead of corrupting memory).
pub const SMEM_BYTES: u32 = MAX_SHARED_BYTES;

/// The Hopper main kernel.
pub const DESC: KernelDesc = KernelDesc {
    name: "msa_backward_sm90",
    about:
        "MSA backward main kernel for Hopper: TMA + mbarrier pipelines, wgmma, dK/dV in registers",
    targets: &[Target::Sm90a],
    threads: (THREADS, 1, 1),
    describe,
};

/// The Hopper main kernel of the deterministic mode: fixed-point integer reductions
/// (`fixed_point`, `docs/design.md` §3.8), otherwise the same kernel.
pub const DETERMINISTIC: KernelDesc = KernelDesc {
    name: "msa_backward_sm90_det",
    about: "msa_backward_sm90 with fixed-point integer reductions of dQ, dK and dV (bitwise reproducible)",
    targets: &[Target::Sm90a],
    threads: (THREADS, 1, 1),
    describe: describe_deterministic,
};

/// The plan resolved for the roles: every buffer, pipeline and barrier the code names,
/// looked up and checked once by [`resolve`].
struct Resolved<'a> {
    warps: &'a Sm90Warps,
    k: Placed,
    v: Placed,
    q: Placed,
    d_o: Placed,
    ds: Placed,
    lse: Placed,
    delta: Placed,
    qrows: Placed,
    qpos: Placed,
    dq_inv: Placed,
    barriers: u32,
    kv: Pipe<'a>,
    q_do: Pipe<'a>,
    rows: Pipe<'a>,
    consumers: &'a NamedBarrier,
    consumer_wg: &'a WarpgroupBarrier,
    ds_free: &'a WarpgroupBarrier,
}

/// Looks up everything [`Resolved`] holds; the error names what is missing or the rule the
/// code relies on that the plan breaks.
fn resolve(plan: &Sm90Plan) -> Result<Resolved<'_>, String> {
    let smem = plan.smem();
    let buf = |id| smem.buffer(id).copied().map_err(|e| e.to_string());
    let pipe = |name| plan.pipelines().get(name).map_err(|e| e.to_string());
    let r = Resolved {
        warps: plan.warps(),
        k: buf(Buf::K)?,
        v: buf(Buf::V)?,
        q: buf(Buf::Q)?,
        d_o: buf(Buf::DO)?,
        ds: buf(Buf::PdS)?,
        lse: buf(Buf::Lse)?,
        delta: buf(Buf::Delta)?,
        qrows: buf(Buf::QRows)?,
        qpos: buf(Buf::QPos)?,
        dq_inv: buf(Buf::DqInv)?,
        barriers: buf(Buf::Barriers)?.offset,
        kv: pipe("kv")?,
        q_do: pipe("q_do")?,
        rows: pipe("rows")?,
        consumers: plan
            .barrier("consumers")
            .ok_or("the plan has no named barrier `consumers`")?,
        consumer_wg: plan
            .warpgroup_barrier("consumer_wg")
            .ok_or("the plan has no warpgroup barrier `consumer_wg`")?,
        ds_free: plan
            .warpgroup_barrier("ds_free")
            .ok_or("the plan has no warpgroup barrier `ds_free`")?,
    };
    // The code addresses K/V and the row scalars at stage 0 and releases K/V and Q/dO with
    // one elected arrival per consumer warpgroup.
    for pipe in [r.kv, r.rows] {
        if pipe.pipeline.stages != 1 {
            return Err(format!(
                "pipeline `{}` has {} stages; the kernel addresses its buffers as one stage",
                pipe.pipeline.name, pipe.pipeline.stages
            ));
        }
    }
    for pipe in [r.kv, r.q_do] {
        if pipe.pipeline.consumer_arrivals != crate::plan::sm90::CONSUMERS {
            return Err(format!(
                "pipeline `{}` expects {} consumer arrivals; the kernel releases it once per \
                 consumer warpgroup",
                pipe.pipeline.name, pipe.pipeline.consumer_arrivals
            ));
        }
    }
    Ok(r)
}

/// What every role reads.
struct Ctx<'a> {
    r: &'a Resolved<'a>,
    p: &'a MainParams,
    base: Reg<U32>,
    bars: Barriers,
    walk: Walk,
}

fn describe(b: &mut KernelBuilder) {
    describe_mode(b, false);
}

fn describe_deterministic(b: &mut KernelBuilder) {
    describe_mode(b, true);
}

fn describe_mode(b: &mut KernelBuilder, deterministic: bool) {
    b.grid("[grid_launch_bound(capacity, num_sms), 1, 1]");
    b.min_ctas_per_sm(1);
    let p = common::main_params(b, deterministic);
    let plan = match Sm90Plan::design() {
        Ok(plan) => plan,
        Err(e) => return b.error(format!("SM90 plan: {e}")),
    };
    let r = match resolve(&plan) {
        Ok(r) => r,
        Err(e) => return b.error(format!("SM90 plan: {e}")),
    };
    let Some(base) = common::guarded_smem_base(b, plan.smem().total(), SMEM_BYTES) else {
        return;
    };
    let tid = b.sreg(SReg::TidX);
    let bars = common::sm90_barriers(b, base, r.barriers);
    let (leader, walk) = common::init_and_walk(b, tid, plan.pipelines(), &bars, &p.desc);
    let ctx = Ctx {
        r: &r,
        p: &p,
        base,
        bars,
        walk,
    };

    common::sm90_roles(
        b,
        r.warps,
        (tid, leader),
        |b| producer(b, &ctx),
        |b| gather(b, &ctx, tid),
        |b| consumer(b, &ctx, tid),
    );
}

fn producer(b: &mut KernelBuilder, ctx: &Ctx) {
    let (p, r, base, bars) = (ctx.p, ctx.r, ctx.base, &ctx.bars);
    let qrows = b.ld_param_ptr(&p.qrows);
    let tq = b.tensor_map_addr(&p.tmap_q);
    let tdo = b.tensor_map_addr(&p.tmap_do);
    let tk = b.tensor_map_addr(&p.tmap_k);
    let tv = b.tensor_map_addr(&p.tmap_v);
    let prev = b.mov::<U32>(u32::MAX);
    let segments = b.mov::<U32>(0u32);
    let tasks = b.mov::<U32>(0u32);
    b.for_range(ctx.walk.lo, ctx.walk.hi, 1, "producer_row", |b, row| {
        let m = common::task_meta(b, p, row);
        // A new segment waits until both consumers released the previous K/V.
        let tiles = [(&r.k, base), (&r.v, base)];
        common::load_kv_if_new_segment(b, &r.kv, bars, (prev, segments), [tk, tv], tiles, &m, None);
        let st = r.q_do.producer_acquire(b, bars, tasks);
        let q_tile = r.q.emit_stage_addr(b, base, st.index);
        let do_tile = r.d_o.emit_stage_addr(b, base, st.index);
        let tiles = [shared(q_tile, 0), shared(do_tile, 0)];
        common::load_qdo_tiles(b, [tq, tdo], tiles, qrows, row, &m, &st.full);
        let next = b.add(tasks, 1u32);
        b.set(tasks, next);
    });
}

/// The gather warp (warp 1 of the producer warpgroup): per task, the row scalars of its 128
/// folded rows into shared memory, ahead of the consumers' softmax. Lane `4·slot + part`
/// fills folded rows `4·lane .. 4·lane+4` (slot `lane/4`, heads `4·part ..`).
fn gather(b: &mut KernelBuilder, ctx: &Ctx, tid: Reg<U32>) {
    let (p, r, base, bars) = (ctx.p, ctx.r, ctx.base, &ctx.bars);
    let g = common::gather_lane(b, tid);
    let tasks = b.mov::<U32>(0u32);
    b.for_range(ctx.walk.lo, ctx.walk.hi, 1, "gather_row", |b, row| {
        let st = r.rows.producer_acquire(b, bars, tasks);
        let m = common::task_meta(b, p, row);
        let (l4, d4) = common::gather_row_scalars(b, p, row, m[1], &g);
        let row8 = b.shl(row, 3u32);
        let at = b.add(base, g.lane16);
        b.st_v(&r.lse.at(at, 0), l4);
        b.st_v(&r.delta.at(at, 0), d4);
        b.if_then(g.word_lane, "gather_qpos", |b| {
            let idx = b.add(row8, g.lane);
            let qpos = b.ld_param_ptr(&p.qpos);
            let a = common::elem::<S32>(b, qpos, idx);
            let v = b.ld::<S32, _>(&a);
            let qrows = b.ld_param_ptr(&p.qrows);
            let a = common::elem::<S32>(b, qrows, idx);
            let q = b.ld::<S32, _>(&a);
            let lane4 = b.shl(g.lane, 2u32);
            let at = b.add(base, lane4);
            b.st(&r.qpos.at(at, 0), v);
            b.st(&r.qrows.at(at, 0), q);
            // Deterministic: slot `lane`'s inverse dQ unit from a[t, g], off the consumers'
            // path (an empty slot reads row 0; its reductions are skipped).
            if let Some(f) = &p.fixed {
                let bounds = b.ld_param_ptr(&f.bounds);
                let factor = fixed_point::dq_factor(b, bounds, m[1]);
                let rc = b.max(q, 0i32);
                let rc = b.bitcast::<U32, S32>(rc);
                let inv = fixed_point::dq_row_inv_unit(b, f, rc, m[1], factor);
                b.st(&r.dq_inv.at(at, 0), inv);
            }
        });
        r.rows.producer_commit(b, bars, &st);
        let next = b.add(tasks, 1u32);
        b.set(tasks, next);
    });
}

#[allow(clippy::too_many_lines)]
fn consumer(b: &mut KernelBuilder, ctx: &Ctx, tid: Reg<U32>) {
    let (p, r, base, walk) = (ctx.p, ctx.r, ctx.base, &ctx.walk);
    let bars = ctx.bars;
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
    let c_rows_keys = b.sub(key_local, quad); // this warp's first key, 64c + 16·warp
    let elected = b.setp(Cmp::Eq, tw, 0u32);
    let wg_bar = b.add(c, r.consumer_wg.first); // one consumer warpgroup
                                                // ds_free: this consumer's instance (it waits there) and the other's (it arrives there).
    let ds_mine = b.add(c, r.ds_free.first);
    let other = b.xor(c, 1u32);
    let ds_other = b.add(other, r.ds_free.first);
    let zero = b.mov::<U32>(0u32);
    let always = b.setp(Cmp::Eq, zero, 0u32);
    let never = b.setp(Cmp::Ne, zero, 0u32);
    let neg_inf = f32::NEG_INFINITY;
    let scale_log2e = common::SCALE_LOG2E;

    // Pointers are re-read from the parameter bank where used: holding all eight across the
    // loop costs 16 registers the accumulators need.

    let (kv, qdo, rows) = (r.kv, r.q_do, r.rows);
    let c_panel = b.mul_lo(c, PANEL_BYTES);
    let c_rows = b.mul_lo(c, 64 * 128);
    let dv_acc: Vec<Reg<F32>> = (0..64).map(|_| b.reg()).collect();
    let dk_acc: Vec<Reg<F32>> = (0..64).map(|_| b.reg()).collect();
    let prev = b.mov::<U32>(u32::MAX);
    let segments = b.mov::<U32>(0u32);
    let tasks = b.mov::<U32>(0u32);

    // The task's (index head, kblock), loaded one task ahead: the load's latency was on the
    // path to each task's first GEMM.
    let next_head = b.mov::<U32>(0u32);
    let next_kb = b.mov::<U32>(0u32);
    let any = b.setp(Cmp::Lt, walk.lo, walk.hi);
    b.if_then(any, "first_meta", |b| {
        let m = common::task_meta(b, p, walk.lo);
        b.set(next_head, m[1]);
        b.set(next_kb, m[2]);
    });

    b.for_range(walk.lo, walk.hi, 1, "task", |b, row| {
        let head = b.mov::<U32>(next_head);
        let kb = b.mov::<U32>(next_kb);
        let cur = common::bucket(b, &[zero, head, kb, zero]);
        // `same` also marks the segment's first task, whose first dV/dK MMA overwrites.
        let same = b.setp(Cmp::Eq, cur, prev);
        b.unless(same, "kv_wait", |b| {
            kv.consumer_wait(b, &bars, segments);
            b.set(prev, cur);
        });
        let first_task = b.setp(Cmp::Eq, row, walk.lo);
        let next_row = b.add(row, 1u32);
        let last_task = b.setp(Cmp::Ge, next_row, walk.hi);
        b.unless(last_task, "next_meta", |b| {
            let m = common::task_meta(b, p, next_row);
            b.set(next_head, m[1]);
            b.set(next_kb, m[2]);
        });

        let qst = qdo.consumer_wait(b, &bars, tasks);
        let q_base = r.q.emit_stage_addr(b, base, qst.index);
        let do_base = r.d_o.emit_stage_addr(b, base, qst.index);

        let key_pos = b.shl(kb, 7u32);
        let key_pos = b.add(key_pos, key_local);
        let key_pos8 = b.add(key_pos, 8u32);
        let key_pos_s = b.bitcast::<S32, U32>(key_pos);
        let key_pos8_s = b.bitcast::<S32, U32>(key_pos8);
        let mut rows_stage = None;
        // Deterministic: the slots' inverse dQ units (the gather warp's), held to the dQ loop.
        let mut dq_invs: Option<Vec<Reg<F32>>> = None;
        // The slots' compact query rows (the gather warp's), held to the dQ loop: a global
        // load per slot there put an L2 round trip in front of each slot's reductions.
        let mut slot_rows: Vec<Reg<S32>> = Vec::new();

        for half in 0..2u32 {
            b.comment(&format!(
                "half {half}: S^T and dP^T for folded rows {}..{}",
                64 * half,
                64 * half + 64
            ));
            let s_acc: Vec<Reg<F32>> = (0..32).map(|_| b.reg()).collect();
            let dp_acc: Vec<Reg<F32>> = (0..32).map(|_| b.reg()).collect();
            b.wgmma_fence();
            // S^T and dP^T in two commit groups: the exponentials of P^T run while the
            // tensor cores still compute dP^T. In half 1, half 0's dV/dK group is still in
            // flight: S^T queues behind it, and dP^T is issued once it has completed (its A
            // fragments then free their registers for dP^T's accumulators).
            for (gi, (acc, a_tile, b_tile)) in
                [(&s_acc, r.k.offset, q_base), (&dp_acc, r.v.offset, do_base)]
                    .into_iter()
                    .enumerate()
            {
                if half == 1 && gi == 1 {
                    b.wgmma_wait(1);
                    b.wgmma_fence();
                }
                let a_addr = b.add(base, a_tile);
                let a_addr = b.add(a_addr, c_rows);
                let a0 = k_major().emit(b, a_addr);
                let b_addr = b.add(b_tile, half * 64 * 128);
                let b0 = k_major().emit(b, b_addr);
                common::wgmma_ss_k128(b, acc, Major::K, (a0, b0), (never, always));
                b.wgmma_commit();
            }
            if half == 0 && p.fixed.is_none() {
                // The previous task's dQ boxes: panel `c` may be overwritten (by the other
                // consumer after the arrival; by this one after its `ds_free` meeting) once
                // the TMA has read them. Waited here, with this task's first GEMMs in flight,
                // not on the path from the dQ GEMM to them.
                b.unless(first_task, "ds_free_arrive", |b| {
                    let lane0 = b.setp(Cmp::Eq, lane, 0u32);
                    b.predicated(lane0, false, |b| b.bulk_wait_group_read(0));
                    b.bar_warp_sync();
                    b.bar_arrive_reg(ds_other, 2 * WarpgroupBarrier::THREADS);
                });
            }
            b.wgmma_wait(1);
            if half == 0 {
                b.comment("the gather warp's row scalars for this task");
                rows_stage = Some(rows.consumer_wait(b, &bars, tasks));
            }

            // Columns 64·half + 8j + col0 + e: slot 4·half + j/2, head 8(j%2) + col0 + e;
            // accumulator element 4j + 2rr + e, folded row 16·slot + 8(j%2) + col0 + e.
            let n4 = b.shl(col0, 2u32);
            let at = b.add(base, n4);
            let folded = |j: u32, e: u32| 16 * (4 * half + j / 2) + 8 * (j % 2) + e;
            b.comment("P^T = exp2(S^T*scale*log2e - lse*log2e) under the causal predicate");
            let mut p_val = Vec::new();
            // The query positions of this half's four slots, one vector load.
            let qpos: [Reg<S32>; 4] = b.ld_v(&r.qpos.at(base, 0).offset(16 * half as i64));
            for j in 0..8u32 {
                let slot_qpos = qpos[(j / 2) as usize];
                // −lse·log2e (−∞ for an empty slot), gathered into shared memory.
                let nl: [Reg<F32>; 2] = b.ld_v(&r.lse.at(at, 0).offset(4 * folded(j, 0) as i64));
                for rr in 0..2usize {
                    let kp = if rr == 0 { key_pos_s } else { key_pos8_s };
                    let seen = b.setp(Cmp::Ge, slot_qpos, kp);
                    for (e, &nl) in nl.iter().enumerate() {
                        let i = (4 * j) as usize + 2 * rr + e;
                        let v = b.fma(s_acc[i], scale_log2e, nl);
                        let v = b.selp(v, neg_inf, seen);
                        p_val.push(b.ex2_approx(v));
                    }
                }
            }
            b.wgmma_wait(0);
            b.comment("dS^T = P^T*(dP^T - Delta)*scale; both packed to bf16 A fragments");
            let mut p_frag = Vec::new();
            let mut ds_frag = Vec::new();
            for j in 0..8u32 {
                let dl: [Reg<F32>; 2] = b.ld_v(&r.delta.at(at, 0).offset(4 * folded(j, 0) as i64));
                for rr in 0..2usize {
                    let mut ds_pair = Vec::new();
                    for (e, &dl) in dl.iter().enumerate() {
                        let i = (4 * j) as usize + 2 * rr + e;
                        let dd = b.sub(dp_acc[i], dl);
                        let ds = b.fmul(p_val[i], dd);
                        ds_pair.push(b.fmul(ds, common::SCALE));
                    }
                    let i = (4 * j) as usize + 2 * rr;
                    p_frag.push(b.cvt_bf16x2(p_val[i + 1], p_val[i]));
                    ds_frag.push(b.cvt_bf16x2(ds_pair[1], ds_pair[0]));
                }
            }

            if half == 1 {
                if p.fixed.is_some() {
                    b.comment(
                        "the slots' query rows for the dQ reductions, read before the release",
                    );
                    let at = r.qrows.at(base, 0);
                    let lo: [Reg<S32>; 4] = b.ld_v(&at);
                    let hi: [Reg<S32>; 4] = b.ld_v(&at.offset(16));
                    slot_rows = lo.into_iter().chain(hi).collect();
                    b.comment("the slots' inverse dQ units, read before the release");
                    let at = r.dq_inv.at(base, 0);
                    let lo: [Reg<F32>; 4] = b.ld_v(&at);
                    let hi: [Reg<F32>; 4] = b.ld_v(&at.offset(16));
                    dq_invs = Some(lo.into_iter().chain(hi).collect());
                } else {
                    b.comment(
                        "this warp's slot's query row (slot 4c + warp), read before the release",
                    );
                    let slot = b.mad_lo(c, 4u32, warp);
                    let off = b.shl(slot, 2u32);
                    let at = b.add(base, off);
                    slot_rows = vec![b.ld::<S32, _>(&r.qrows.at(at, 0))];
                }
                b.comment("this thread's last read of the row scalars is done: release them");
                let rst = rows_stage.as_ref().expect("waited in half 0");
                rows.consumer_release(b, &bars, rst);
            }

            if half == 0 {
                b.comment("wait until the other consumer's last dQ^T has read these dS^T rows");
                b.unless(first_task, "ds_free_wait", |b| {
                    b.bar_sync_reg(ds_mine, 2 * WarpgroupBarrier::THREADS);
                });
            }
            b.comment("dS^T to shared memory: SW128 panels [folded/64][key][64 folded], stmatrix");
            // Instruction `s` stores the 8×8 matrices (j, rr) = (2s, 0), (2s, 1), (2s + 1, 0),
            // (2s + 1, 1) of the fragment: row `key_local + 8rr + r` (r = lane & 7, given by lane
            // 8·mi + r), 16-byte chunk `j ^ r` of the SW128 row (128 B per key).
            let sm = common::StmatrixLane::new(b, lane);
            let key = b.add(c_rows_keys, sm.row);
            let panel = r.ds.offset + half * PANEL_BYTES;
            sm.store_sw128(b, key, base, panel, 4, |_, s| {
                let f = (4 * s) as usize;
                [ds_frag[f], ds_frag[f + 1], ds_frag[f + 2], ds_frag[f + 3]]
            });

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
            // No wait: half 0's group drains under half 1's S^T, half 1's under dQ's first
            // GEMM.
            b.wgmma_commit();
        }

        let fixed = p.fixed.is_some();
        b.comment(if fixed {
            "dQ^T_c = K^T_c*dS^T once both consumers stored dS^T"
        } else {
            "dQ_c = dS*K_c once both consumers stored dS^T"
        });
        b.fence_proxy_async_shared();
        r.consumers.sync(b);
        if !fixed {
            // One m64n128 GEMM per consumer: its folded half (slots 4c..4c+4) × all 128 head
            // dims, dQ = dS_c·K (A: the dS^T panel of that half, written by both consumers;
            // B: the whole K tile; both MN-major). Against two m64n64 passes over both halves it reads 48 KB of shared
            // memory instead of 64 KB, and each warp's rows are one slot: one query row.
            b.wgmma_wait(0);
            let ds_addr = b.add(base, r.ds.offset);
            let ds_addr = b.add(ds_addr, c_panel);
            let ds0 = mn_major().emit(b, ds_addr);
            let k_addr = b.add(base, r.k.offset);
            let k0 = mn_major().emit(b, k_addr);
            let dq_acc: Vec<Reg<F32>> = (0..64).map(|_| b.reg()).collect();
            b.wgmma_fence();
            common::wgmma_ss_k128(b, &dq_acc, Major::MN, (ds0, k0), (never, always));
            b.wgmma_commit();
            b.wgmma_wait(0);
            // Every warp has waited for its dV/dK group before issuing dQ, and for its dQ: once
            // all four meet, the warpgroup's reads of this Q/dO stage and of dS^T panel `c`
            // are over (the GEMM reads every key row of the panel for each warp's rows).
            b.comment("release the Q/dO stage once the whole warpgroup is done");
            b.bar_sync_reg(wg_bar, 128);
            b.predicated(elected, false, |b| qdo.consumer_release(b, &bars, &qst));
            b.comment("dQ: staged in dS^T panel c as two SW128 boxes, TMA reduce-add into dq");
            let qrow = slot_rows[0];
            let live = b.setp(Cmp::Ge, qrow, 0i32);
            let stage = b.mad_lo(warp, 16 * 256u32, ds_addr);
            common::stage_rows_bf16(b, &dq_acc, stage, lane);
            // The async proxy reads the staged rows: each lane's stores are fenced, then the
            // warp meets before its lane 0 issues.
            b.fence_proxy_async_shared();
            b.bar_warp_sync();
            let lane0 = b.setp(Cmp::Eq, lane, 0u32);
            let issue = b.and_pred(lane0, live);
            let tmap_dq = p
                .tmap_dq
                .as_ref()
                .expect("the default kernel declares tmap_dq");
            b.if_then(issue, "dq_tma", |b| {
                let map = b.tensor_map_addr(tmap_dq);
                let h16 = b.shl(head, 4u32);
                let h16 = b.bitcast::<S32, U32>(h16);
                for (box_, d0) in [(0u32, 0i32), (1, 64)] {
                    let d0 = b.mov::<S32>(d0);
                    let src = shared(stage, i64::from(2048 * box_));
                    b.tma_reduce_add_3d(&src, map, [d0, h16, qrow]);
                }
                b.bulk_commit_group();
            });
        } else {
            // K_c, head dims 64c..64c+64, A of dQ^T_c = K^T_c·dS^T (MN-major: d contiguous),
            // whose fragment the head-quad pool words follow. Both 64-row halves of the
            // folded rows in flight (64 accumulator registers next to dK/dV): the reductions
            // of the first half run while the tensor cores compute the second.
            let k_addr = b.add(base, r.k.offset);
            let k_addr = b.add(k_addr, c_panel);
            let k0 = mn_major().emit(b, k_addr);
            let policy = b.policy_evict_last(1.0);
            let invs = dq_invs.as_deref().expect("read in half 1");
            let dq_accs: Vec<Vec<Reg<F32>>> =
                (0..2).map(|_| (0..32).map(|_| b.reg()).collect()).collect();
            b.wgmma_fence();
            for (nh, dq_acc) in dq_accs.iter().enumerate() {
                if nh == 1 {
                    // Half 1's dV/dK group (queued before dQ^T's first) is done: its A
                    // fragments are free, and the warpgroup's reads of this Q/dO stage are over.
                    b.wgmma_wait(1);
                    b.comment("release the Q/dO stage once the whole warpgroup is done");
                    b.bar_sync_reg(wg_bar, 128);
                    b.predicated(elected, false, |b| qdo.consumer_release(b, &bars, &qst));
                    b.wgmma_fence();
                }
                let ds_addr = b.add(base, r.ds.offset + nh as u32 * PANEL_BYTES);
                let ds0 = mn_major().emit(b, ds_addr);
                common::wgmma_ss_k128(b, dq_acc, Major::MN, (k0, ds0), (never, always));
                b.wgmma_commit();
            }
            for nh in 0..2u32 {
                let dq_acc = &dq_accs[nh as usize];
                b.wgmma_wait(1 - nh);
                if nh == 1 {
                    b.comment(
                        "this consumer's reads of sdS are done: the other may overwrite its rows",
                    );
                    b.unless(last_task, "ds_free_arrive", |b| {
                        b.bar_arrive_reg(ds_other, 2 * WarpgroupBarrier::THREADS);
                    });
                }
                b.comment("dQ: fixed-point head quads to the f32 pool [T][4][4][128][4]");
                let d_row = b.mad_lo(c, 64u32, row0);
                for jj in 0..4u32 {
                    // Columns of j = 2jj and 2jj+1: slot 4nh + jj, heads 2·pair, 2·pair+1 of
                    // the group, then the same + 8: one pool word (quad `pair`) per d.
                    let slot = (4 * nh + jj) as usize;
                    let slot_qrow = slot_rows[slot];
                    let live = b.setp(Cmp::Ge, slot_qrow, 0i32);
                    let r = b.bitcast::<U32, S32>(slot_qrow);
                    let word = fixed_point::dq_word(b, r, head, pair, d_row);
                    let dq = b.ld_param_ptr(&p.dq);
                    let a = common::elem::<F32>(b, dq, word);
                    for rr in 0..2u32 {
                        let (i0, i1) = ((8 * jj + 2 * rr) as usize, (8 * jj + 4 + 2 * rr) as usize);
                        let vals = [dq_acc[i0], dq_acc[i0 + 1], dq_acc[i1], dq_acc[i1 + 1]]
                            .map(|x| fixed_point::to_fixed_f32(b, x, invs[slot]));
                        // d + 8: 8 words of 16 bytes further.
                        let at = a.offset(128 * rr as i64);
                        b.predicated(live, false, |b| b.red_add_v4_f32(&at, vals, Some(policy)));
                    }
                }
            }
        }
        // The segment ends with the walk or where the next task is another bucket.
        let next = common::bucket(b, &[zero, next_head, next_kb, zero]);
        let other_bucket = b.setp(Cmp::Ne, next, cur);
        let is_end = b.or_pred(other_bucket, last_task);
        b.if_then(is_end, "flush", |b| {
            // Every GEMM of the segment has been waited for: once the warpgroup meets, its
            // reads of K/V are over, and the next segment's loads run under the flush.
            b.bar_sync_reg(wg_bar, 128);
            let st = kv.locate(b, &bars, segments.into());
            b.predicated(elected, false, |b| kv.consumer_release(b, &bars, &st));
            b.comment("segment end: dK/dV to the fp32 pools, four head dims per lane");
            let odd = b.and(lane, 1u32);
            let is_odd = b.setp(Cmp::Ne, odd, 0u32);
            let kv_row = b.shl(kb, 7u32);
            let kv_row = b.add(kv_row, key_local);
            // Deterministic: the inverse units of this group's dV and dK.
            let invs = p
                .fixed
                .as_ref()
                .map(|f| fixed_point::flush_inv_units(b, f, head));
            for (which, (acc, pool_p)) in
                [(&dv_acc, &p.dv), (&dk_acc, &p.dk)].into_iter().enumerate()
            {
                let pool = b.ld_param_ptr(pool_p);
                if let Some(inv) = invs {
                    // 64-bit reductions straight from the accumulator layout (no exchange):
                    // a quad's lanes then cover 8 consecutive words of a row per instruction,
                    // half the sectors of four words per lane. Element (r + dr, c + 8j + dc)
                    // lies 8·(dr·512 + 8j + dc) bytes after (r, c): one address per flush.
                    let idx = b.mad_lo(kv_row, 4u32, head);
                    let idx = b.mad_lo(idx, 128u32, col0);
                    let base = common::elem_bytes(b, pool, idx, 8);
                    for j in 0..16u32 {
                        for (e, (dr, dc)) in [(0u32, 0u32), (0, 1), (8, 0), (8, 1)]
                            .into_iter()
                            .enumerate()
                        {
                            let off = 8 * (dr * 4 * 128 + 8 * j + dc);
                            let x =
                                fixed_point::to_fixed64(b, acc[(4 * j) as usize + e], inv[which]);
                            b.red::<U64, _>(AtomOp::Add, &base.offset(i64::from(off)), x);
                        }
                    }
                    continue;
                }
                for j in 0..16u32 {
                    let v = common::pair_exchange_v4(b, acc, j, is_odd);
                    let row_add = b.selp(8u32, 0u32, is_odd);
                    let key_row = b.add(kv_row, row_add);
                    let col_sub = b.shl(odd, 1u32);
                    let col = b.add(col0, 8 * j);
                    let col = b.sub(col, col_sub);
                    let idx = b.mad_lo(key_row, 4u32, head);
                    let idx = b.mad_lo(idx, 128u32, col);
                    let a = common::elem::<F32>(b, pool, idx);
                    b.red_add_v4_f32(&a, v, None);
                }
            }
            let next = b.add(segments, 1u32);
            b.set(segments, next);
        });
        let next = b.add(tasks, 1u32);
        b.set(tasks, next);
    });
    if p.fixed.is_none() {
        b.comment("the walk's last dQ boxes are read before the CTA's shared memory goes");
        let lane0 = b.setp(Cmp::Eq, lane, 0u32);
        b.predicated(lane0, false, |b| b.bulk_wait_group_read(0));
    }
}
