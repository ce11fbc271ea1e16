//! The forward's per-item block list, built by one warp: the slots' compact rows and aligned
//! positions, and the union of the blocks the item's 8 queries select, each with the mask of
//! the slots that selected it. Both forward kernels' list warps call it, with the list and
//! scratch addresses as arguments so that each kernel places them where its layout says.
//!
//! An item is `4·chunk + g`: queries `8·chunk .. 8·chunk + 8` and KV group `g`. Lanes 0..8
//! find each slot's document by binary search over `cu_seqlens` (a row past `T` gets row −1,
//! a row of a flagged schedule row `t` with no position and no blocks); then every lane owns 4
//! of the 128 candidates (`entry = 16·slot + j`), compares them with all 128 and a warp scan
//! compacts the first occurrences in entry order, so the walk order is deterministic.

use super::common;
use super::forward_sm90::{ForwardParams, Items};
use crate::plan::pipeline::{Barriers, Pipe};
use crate::plan::smem::{Buf, BufferSpec, Placed};
use crate::ptx::*;

/// Byte offset of the entry count in a list.
pub const COUNT: u32 = 0;
/// Byte offset of the 8 slots' compact rows (`s32`, −1 past `T`).
pub const QROW: u32 = 16;
/// Byte offset of the 8 slots' aligned positions (`s32`, −1 for a row without keys).
pub const QPOS: u32 = QROW + 4 * 8;
/// Byte offset of the entries' global key blocks (`u32`, up to 128).
pub const GB: u32 = QPOS + 4 * 8;
/// Byte offset of the entries' slot masks (`u32`, bit `s` = slot `s` selected the block).
pub const MASK: u32 = GB + 4 * 128;
/// Bytes of one list (a multiple of 16).
pub const BYTES: u32 = (MASK + 4 * 128).next_multiple_of(16);

/// The buffers both forward kernels' shared layouts begin with: two stages each of K, V and Q
/// (SW128 tiles), the item lists (two stages of [`BYTES`]) and the builder's scratch.
pub fn buffers() -> Vec<BufferSpec> {
    vec![
        BufferSpec::tile(Buf::K, 2),
        BufferSpec::tile(Buf::V, 2),
        BufferSpec::tile(Buf::Q, 2),
        BufferSpec::scalar(Buf::List, BYTES / 4, 2),
        BufferSpec::scalar(Buf::ListScratch, SCRATCH_BYTES / 4, 1),
    ]
}
/// Scratch: the 128 candidates, then the 8 slots' first global block (or `u32::MAX`).
const RAW: u32 = 0;
const QBASE: u32 = 4 * 128;
/// Bytes of the scratch.
pub const SCRATCH_BYTES: u32 = QBASE + 4 * 8;

/// What [`build`] needs besides the parameters.
pub struct ListArgs {
    /// Shared-window address of the list to fill.
    pub list: Reg<U32>,
    /// Shared-window address of the scratch.
    pub scratch: Reg<U32>,
    /// Lane of the building warp.
    pub lane: Reg<U32>,
    /// The item.
    pub item: Reg<U32>,
    /// The schedule's status flags (non-zero: every selection is empty).
    pub flags: Reg<U32>,
    /// T (the local rows).
    pub num_tokens: Reg<U32>,
    /// The packed sequence's token of local row 0 (`ForwardParams::first_token`).
    pub first_token: Reg<U32>,
}

/// The list warp of both forward kernels: for each of the CTA's `items`, acquires a stage of
/// the `list` pipeline, fills that stage of the `lists` buffer ([`build`], with `scratch`)
/// and commits it. `warp_sync` is the building warp's own barrier (`tid` its threads' ids).
#[allow(clippy::too_many_arguments)] // the kernel's placement of the pipeline and buffers
pub fn warp(
    b: &mut KernelBuilder,
    p: &ForwardParams,
    items: &Items,
    list: &Pipe,
    bars: &Barriers,
    (lists, scratch): (&Placed, &Placed),
    (base, tid): (Reg<U32>, Reg<U32>),
    warp_sync: &dyn Fn(&mut KernelBuilder),
) {
    let lane = b.and(tid, 31u32);
    let num_tokens = b.ld_param(&p.num_tokens);
    let first_token = b.ld_param(&p.first_token);
    let status = b.ld_param_ptr(&p.status);
    let flags = b.ld::<U32, _>(&global(status, 0));
    let scratch = b.add(base, scratch.offset);
    b.for_range(0u32, items.count, 1, "list_item", |b, k| {
        let item = items.item(b, k);
        let st = list.producer_acquire(b, bars, k);
        let lb = lists.emit_stage_addr(b, base, st.index);
        let args = ListArgs {
            list: lb,
            scratch,
            lane,
            item,
            flags,
            num_tokens,
            first_token,
        };
        build(b, p, &args, warp_sync);
        list.producer_commit(b, bars, &st);
        // The next item rewrites the scratch: every lane has finished reading it.
        warp_sync(b);
    });
}

/// Fills the list of `a.item`; `warp_sync` orders the lanes' scratch stores and loads (a
/// barrier of the building warp alone). Every lane's stores precede its return, so a
/// per-thread `mbarrier.arrive` after it publishes the list.
pub fn build(
    b: &mut KernelBuilder,
    p: &ForwardParams,
    a: &ListArgs,
    warp_sync: &dyn Fn(&mut KernelBuilder),
) {
    let lane = a.lane;
    let lane4 = b.shl(lane, 2u32);
    let lane_at = b.add(a.scratch, lane4);
    let g = b.and(a.item, 3u32);
    let chunk = b.shr(a.item, 2u32);
    let row0 = b.shl(chunk, 3u32);
    let lb = a.list;

    b.comment("lanes 0..8: each slot's compact row, aligned position and first block");
    let is_slot = b.setp(Cmp::Lt, lane, 8u32);
    b.if_then(is_slot, "slot", |b| {
        let t = b.add(row0, lane);
        let qpos = b.mov::<S32>(-1i32);
        let qbase = b.mov::<U32>(u32::MAX);
        let inside = b.setp(Cmp::Lt, t, a.num_tokens);
        let clean = b.setp(Cmp::Eq, a.flags, 0u32);
        let valid = b.and_pred(inside, clean);
        // A row inside T is always written (an empty one as 0 / −inf, also when the schedule
        // is flagged); only a valid one gets a position and blocks.
        let row = b.bitcast::<S32, U32>(t);
        let qrow = b.selp(row, -1i32, inside);
        b.if_then(valid, "slot_doc", |b| {
            // The document: the largest d with cu[d] <= tg (cu[0] <= tg < cu[D]), tg the
            // row's token in the packed sequence.
            let tg = b.add(t, a.first_token);
            let cu = b.ld_param_ptr(&p.cu);
            let lo = common::doc_search(b, cu, &p.num_docs, tg);
            let start = common::load_u32(b, cu, lo);
            let ws = b.ld_param_ptr(&p.ws);
            let wstart = common::load_u32(b, ws, lo);
            let local = b.sub(tg, start);
            let pos = b.add(wstart, local);
            let pos = b.bitcast::<S32, U32>(pos);
            b.set(qpos, pos);
            let first = b.shr(wstart, 7u32);
            b.set(qbase, first);
        });
        let at = b.add(lb, lane4);
        b.st(&shared(at, QROW as i64), qrow);
        b.st(&shared(at, QPOS as i64), qpos);
        b.st(&shared(lane_at, QBASE as i64), qbase);
    });
    warp_sync(b);

    b.comment("the 128 candidates: entry e = 16*slot + j, lane owns e = lane + 32kk");
    let j = b.and(lane, 15u32);
    let half = b.shr(lane, 4u32);
    let q2k = b.ld_param_ptr(&p.q2k);
    let mut gbs = Vec::new();
    for kk in 0..4u32 {
        let slot = b.add(half, 2 * kk);
        let slot4 = b.shl(slot, 2u32);
        let sat = b.add(a.scratch, slot4);
        let qb = b.ld::<U32, _>(&shared(sat, QBASE as i64));
        let gb = b.mov::<U32>(u32::MAX);
        let live = b.setp(Cmp::Ne, qb, u32::MAX);
        b.if_then(live, "cand", |b| {
            let t = b.add(row0, slot);
            let gt = b.mad_lo(g, a.num_tokens, t);
            let idx = b.mad_lo(gt, 16u32, j);
            let at = common::elem::<S32>(b, q2k, idx);
            let id = b.ld::<S32, _>(&at);
            let sel = b.setp(Cmp::Ge, id, 0i32);
            let idu = b.bitcast::<U32, S32>(id);
            let v = b.add(qb, idu);
            let v = b.selp(v, u32::MAX, sel);
            b.set(gb, v);
        });
        let e4 = b.add(lane4, 128 * kk);
        let at = b.add(a.scratch, e4);
        b.st(&shared(at, RAW as i64), gb);
        gbs.push(gb);
    }
    warp_sync(b);

    b.comment("each candidate's first occurrence and the mask of the slots that chose it");
    let masks: Vec<Reg<U32>> = (0..4).map(|_| b.mov::<U32>(0u32)).collect();
    let dups: Vec<Reg<U32>> = (0..4).map(|_| b.mov::<U32>(0u32)).collect();
    let mine: Vec<Reg<U32>> = (0..4u32).map(|kk| b.add(lane, 32 * kk)).collect();
    b.for_range(0u32, 128u32, 4, "dedup", |b, e2| {
        let off = b.shl(e2, 2u32);
        let at = b.add(a.scratch, off);
        let v: [Reg<U32>; 4] = b.ld_v(&shared(at, RAW as i64));
        let slot = b.shr(e2, 4u32);
        let bit = b.mov::<U32>(1u32);
        let bit = b.shl(bit, slot);
        for (q, vq) in v.iter().enumerate() {
            let eq_idx = b.add(e2, q as u32);
            for kk in 0..4 {
                let eq = b.setp(Cmp::Eq, *vq, gbs[kk]);
                let add = b.selp(bit, 0u32, eq);
                let m = b.or(masks[kk], add);
                b.set(masks[kk], m);
                let before = b.setp(Cmp::Lt, eq_idx, mine[kk]);
                let both = b.and_pred(eq, before);
                let one = b.selp(1u32, 0u32, both);
                let d = b.add(dups[kk], one);
                b.set(dups[kk], d);
            }
        }
    });

    b.comment("compact the first occurrences in entry order (a warp scan per round)");
    let count = b.mov::<U32>(0u32);
    for kk in 0..4 {
        let none = b.setp(Cmp::Eq, dups[kk], 0u32);
        let real = b.setp(Cmp::Ne, gbs[kk], u32::MAX);
        let keep = b.and_pred(none, real);
        let f = b.selp(1u32, 0u32, keep);
        let incl = common::warp_inclusive_scan(b, f, lane);
        let excl = b.sub(incl, f);
        let pos = b.add(count, excl);
        b.if_then(keep, "keep", |b| {
            let pos4 = b.shl(pos, 2u32);
            let at = b.add(lb, pos4);
            b.st(&shared(at, GB as i64), gbs[kk]);
            b.st(&shared(at, MASK as i64), masks[kk]);
        });
        let total = b.shfl(Shfl::Idx, incl, 31u32, 0x1f);
        let next = b.add(count, total);
        b.set(count, next);
    }
    let first = b.setp(Cmp::Eq, lane, 0u32);
    b.predicated(first, false, |b| {
        b.st(&shared(lb, COUNT as i64), count);
    });
}
