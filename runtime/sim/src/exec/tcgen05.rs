//! Blackwell tensor memory and `tcgen05` (`cta_group::1`).
//!
//! # Tensor memory
//!
//! Not modelled: `cta_group::2`, `tcgen05.cp`/`shift`, other `ld`/`st` shapes and
//! `.pack::16b`/`.unpack::16b`, M = 64 / 256, `disable_output_lane`, scale-input-d, block-scaled
//! and non-f16 kinds, swizzles other than 128B; the instruction decoder or executor rejects
//! them. Allocation never blocks (one CTA per simulated SM at a time).
//!
//! Per CTA, 128 lanes × 512 columns of 32-bit cells; address = `lane << 16 | column`.
//! `tcgen05.alloc` (warp-collective, a power of two in 32..=512 columns) takes the lowest free
//! aligned column range, fills it with NaN bits (`0x7fffffff`; the hardware leaves it
//! undefined) and writes the base address to the shared word. Allocating more than is free
//! (the CTA is alone on its simulated SM, so nothing would ever free it), allocating after
//! `relinquish_alloc_permit`, any access outside the allocated columns (after `dealloc`
//! included), a `dealloc` while MMAs are in flight and a CTA that exits with columns still
//! allocated are faults.
//!
//! # `tcgen05.ld` / `tcgen05.st` (`.32x32b.xN`)
//!
//! Warp-collective with a warp-uniform address; thread `t` accesses lane `lane + t`, columns
//! `col .. col + N`. A warp may touch only lanes `32·(warp % 4) .. +32`. A register written by
//! `tcgen05.ld` and touched by another instruction before `tcgen05.wait::ld` is a fault, as is
//! a warp that signals other threads (`mbarrier.arrive`, `bar`, `tcgen05.commit`) after a
//! `tcgen05.st` without `tcgen05.wait::st`. Reading a cell (by `tcgen05.ld`, as a TS A operand
//! or as an accumulated D) that nothing wrote since its allocation is a fault: its value is
//! undefined, and it is how a consumer that skipped its wait shows up when the MMA it should
//! have waited for has not even been issued.
//!
//! # `tcgen05.mma.cta_group::1.kind::f16`
//!
//! Issued per executing thread (the kernels elect one lane). The instruction descriptor gives
//! D format (bits 4–5, must be 1 = f32), A/B format (7–9 / 10–12: 0 = f16, 1 = bf16), negate
//! A/B (13/14), A/B major (15/16: 1 = MN-major), N >> 3 (17–22) and M >> 4 (24–28); only
//! M = 128 is modelled (D row m = TMEM lane m, column n = `d_col + n`). Shared-memory
//! descriptors are the SM100 ones: start >> 4 (0–13), LBO >> 4 (16–29), SBO >> 4 (32–45),
//! version bits 46–48 = 0b001, base offset 49–51 = 0, LBO mode 52 = 0, swizzle 61–63 = 2
//! (128B); element addresses as in [`super::wgmma`]. The TS form reads A from TMEM, K-major:
//! `A[m][k]` is the half `k % 2` (low = even k) of the cell (lane m, column `a_col + k/2`).
//!
//! MMAs are asynchronous and complete at the latest legal point: when a thread waits on the
//! mbarrier of a `tcgen05.commit` that follows them and the phase has not completed, or when
//! every live thread is blocked. Among the MMAs completing then, those on one accumulator
//! (same D columns and shape) complete in issue order, the only order the PTX ISA gives;
//! the others complete in issue order, in a seeded random order or latest-first
//! ([`crate::UmmaOrder`]). So that no order can change a result, an MMA whose TMEM footprint
//! (D, and A in TMEM) conflicts with an in-flight MMA on another accumulator is reported at
//! issue.
//!
//! Fences: a `tcgen05.mma`, `ld`, `st` or `dealloc` after a thread synchronization (a
//! `bar.sync` release or a successful mbarrier wait) with no
//! `tcgen05.fence::after_thread_sync` since, and a `bar`/`mbarrier.arrive` after a
//! `tcgen05.ld`/`st`/`alloc` with no `tcgen05.fence::before_thread_sync` (or
//! `tcgen05.commit`, which implies it) since, are reported. Their shared operands are snapshot at
//! issue (with the async-proxy check of generic stores) and re-read at completion: a change
//! is a race. `tcgen05.ld` of cells an in-flight MMA writes, and `tcgen05.st` to cells an
//! in-flight MMA reads or writes, are races. A commit arrives once on its mbarrier when every
//! MMA its thread issued before it has completed. Numerics ([`crate::Tcgen05Numerics`]): by
//! default products are exact and accumulate sequentially in k in f32, each addition rounded
//! to nearest even; `Truncating` uses the H200's fitted wgmma step of [`crate::tensor_core`]
//! instead. The B200's internal order and precision have not been measured, so the kernels
//! are tested under both.

use super::{lanes, mix64, Cta, Tcgen05Numerics, UmmaOrder, GOLDEN};
use crate::error::{FaultKind, SimError};
use crate::ir::{Addr, Dst, Op, PredSrc, Space, Src, Tc05A, Tcgen05};
use crate::numeric::canon;
use crate::smem_layout::{read_operand, MatrixDesc};
use crate::tensor_core::{
    all_finite, sm90_block, sm90_block_prepared, MmaInput, Operand, Prepared,
};

/// TMEM lanes.
pub(super) const TMEM_LANES: usize = 128;
/// TMEM columns.
pub(super) const TMEM_COLS: usize = 512;

/// Tensor-memory state of one CTA.
#[derive(Debug, Clone, Default)]
pub(super) struct Tmem {
    /// `[lane * 512 + column]`, allocated on first use.
    pub cells: Vec<u32>,
    /// Per cell: written (by `tcgen05.st` or an MMA) since its columns were allocated.
    pub written: Vec<bool>,
    /// Allocated column ranges `(start, count)`.
    pub allocs: Vec<(u32, u32)>,
    /// Whether a dealloc happened (for the message of a use after it).
    pub freed: bool,
    pub relinquished: bool,
    /// MMAs in flight, in issue order.
    pub mmas: Vec<PendingUmma>,
    /// Commits whose arrival has not happened yet, in issue order.
    pub commits: Vec<PendingCommit>,
    /// Sequence number of the last MMA issued (0: none yet).
    pub seq: u64,
    /// Per thread: sequence number of its last MMA.
    pub last_seq: Vec<u64>,
    /// Per warp and register: written by a `tcgen05.ld` not yet waited for.
    pub ld_pending: Vec<bool>,
    /// Per warp: how many such registers.
    pub ld_pending_n: Vec<u32>,
    /// Per warp: the line of a `tcgen05.st` not yet followed by `tcgen05.wait::st`.
    pub st_pending: Vec<Option<usize>>,
    /// Per thread: the pc of a thread synchronization it completed (a `bar.sync` release or a
    /// successful mbarrier wait) not yet followed by `tcgen05.fence::after_thread_sync`.
    pub synced: Vec<Option<usize>>,
    /// Per thread: the pc of its TMEM access (`tcgen05.ld`/`st`/`alloc`) not yet followed by
    /// `tcgen05.fence::before_thread_sync` (or a `tcgen05.commit`, which implies it).
    pub accessed: Vec<Option<usize>>,
}

impl Tmem {
    pub(super) fn reset(&mut self) {
        self.allocs.clear();
        self.freed = false;
        self.relinquished = false;
        self.mmas.clear();
        self.commits.clear();
        self.seq = 0;
        self.last_seq.fill(0);
        self.ld_pending.fill(false);
        self.ld_pending_n.fill(0);
        self.st_pending.fill(None);
        self.synced.fill(None);
        self.accessed.fill(None);
    }
}

/// An issued, not yet completed `tcgen05.mma`.
#[derive(Debug, Clone)]
pub(super) struct PendingUmma {
    pc: usize,
    seq: u64,
    m: u32,
    n: u32,
    d_col: u32,
    /// `Some(column)` for the TS form.
    a_tmem: Option<u32>,
    a_desc: Option<(MatrixDesc, bool)>,
    b_desc: (MatrixDesc, bool),
    /// Shared operands at issue: A `[m·16 + k]` (SS only), B `[n·16 + k]`.
    a: Vec<u16>,
    b: Vec<u16>,
    bf16: bool,
    negate_a: bool,
    negate_b: bool,
    enable_d: bool,
}

/// A `tcgen05.commit` waiting for its MMAs.
#[derive(Debug, Clone)]
pub(super) struct PendingCommit {
    pc: usize,
    warp: usize,
    lane: usize,
    mbar: u32,
    /// Every MMA with a sequence number up to this one must complete first.
    upto: u64,
}

fn err(m: String) -> FaultKind {
    FaultKind::Tcgen05(m)
}

impl Cta<'_> {
    /// Runs a `tcgen05` instruction for the lanes `exec` of warp `w`.
    pub(super) fn tcgen05(
        &mut self,
        pc: usize,
        w: usize,
        exec: u32,
        op: &Tcgen05,
    ) -> Result<(), SimError> {
        if exec == 0 {
            return Ok(());
        }
        let collective = !matches!(op, Tcgen05::Mma { .. } | Tcgen05::Commit { .. });
        if collective && exec != self.present[w] {
            let l = (self.present[w] & !exec).trailing_zeros() as usize;
            let why = self.absence(w, l, exec);
            let first = exec.trailing_zeros() as usize;
            return Err(self.fault(
                pc,
                w,
                first,
                err(format!(
                    "`{}` is .sync.aligned over the warp: lane {l} {why}",
                    self.k.source[pc].text
                )),
            ));
        }
        // The operations that touch TMEM state another thread may have produced or still
        // use: MMAs, loads, stores and the dealloc. (An alloc and a commit depend on no other
        // thread's tcgen05 work.)
        if matches!(
            op,
            Tcgen05::Mma { .. } | Tcgen05::Ld { .. } | Tcgen05::St { .. } | Tcgen05::Dealloc { .. }
        ) {
            self.check_fence_after(pc, w, exec)?;
        }
        let tmem_access = matches!(
            op,
            Tcgen05::Ld { .. } | Tcgen05::St { .. } | Tcgen05::Alloc { .. }
        );
        for l in lanes(exec) {
            let t = w * 32 + l;
            match op {
                Tcgen05::Fence { before: true } | Tcgen05::Commit { .. } => {
                    self.tmem.accessed[t] = None
                }
                Tcgen05::Fence { before: false } => self.tmem.synced[t] = None,
                _ if tmem_access => self.tmem.accessed[t] = Some(pc),
                _ => {}
            }
        }
        match op {
            Tcgen05::Alloc { dst, ncols } => self.tmem_alloc(pc, w, exec, dst, *ncols),
            Tcgen05::Dealloc { taddr, ncols } => self.tmem_dealloc(pc, w, exec, *taddr, *ncols),
            Tcgen05::Relinquish => {
                self.tmem.relinquished = true;
                Ok(())
            }
            Tcgen05::Mma {
                d,
                a,
                b,
                idesc,
                enable_d,
            } => {
                for l in lanes(exec) {
                    self.umma_issue(pc, w, l, d, a, *b, *idesc, *enable_d)?;
                }
                Ok(())
            }
            Tcgen05::Commit { mbar } => {
                for l in lanes(exec) {
                    let off = self.mbar_offset(pc, w, l, Space::Shared, mbar)?;
                    self.mbar_live(pc, w, l, off)?;
                    let upto = self.tmem.last_seq[w * 32 + l];
                    self.tmem.commits.push(PendingCommit {
                        pc,
                        warp: w,
                        lane: l,
                        mbar: off,
                        upto,
                    });
                }
                Ok(())
            }
            Tcgen05::Ld { dst, taddr } => self.tmem_ld(pc, w, exec, dst, taddr),
            Tcgen05::St { taddr, src } => self.tmem_st(pc, w, exec, taddr, src),
            Tcgen05::WaitLd => {
                if self.tmem.ld_pending_n[w] > 0 {
                    let base = w * self.nregs;
                    self.tmem.ld_pending[base..base + self.nregs].fill(false);
                    self.tmem.ld_pending_n[w] = 0;
                }
                Ok(())
            }
            Tcgen05::WaitSt => {
                self.tmem.st_pending[w] = None;
                Ok(())
            }
            Tcgen05::Fence { .. } => Ok(()),
        }
    }

    /// The warp-uniform value of `s` over `exec`.
    fn warp_uniform(
        &self,
        pc: usize,
        w: usize,
        exec: u32,
        v: &[u64; 32],
        what: &str,
    ) -> Result<u64, SimError> {
        let first = exec.trailing_zeros() as usize;
        for l in lanes(exec) {
            if v[l] != v[first] {
                return Err(self.fault(
                    pc,
                    w,
                    l,
                    err(format!(
                        "the {what} differs across the warp: {:#x} in lane {l}, {:#x} in lane {first}",
                        v[l], v[first]
                    )),
                ));
            }
        }
        Ok(v[first])
    }

    fn addr_values(&self, w: usize, a: &Addr) -> [u64; 32] {
        std::array::from_fn(|l| self.lane_addr(w, l, a))
    }

    /// Checks that columns `[col, col + n)` are allocated.
    fn tmem_cols(
        &self,
        pc: usize,
        w: usize,
        l: usize,
        col: u32,
        n: u32,
        what: &str,
    ) -> Result<(), SimError> {
        let ok = self
            .tmem
            .allocs
            .iter()
            .any(|&(s, c)| col >= s && col + n <= s + c);
        if ok {
            return Ok(());
        }
        let state = if self.tmem.allocs.is_empty() && self.tmem.freed {
            "nothing is allocated any more (use after tcgen05.dealloc)".to_string()
        } else {
            format!("allocated columns: {:?}", self.tmem.allocs)
        };
        Err(self.fault(
            pc,
            w,
            l,
            err(format!(
                "{what} touches TMEM columns [{col}, {}) outside the allocation; {state}",
                col + n
            )),
        ))
    }

    fn tmem_alloc(
        &mut self,
        pc: usize,
        w: usize,
        exec: u32,
        dst: &Addr,
        ncols: Src,
    ) -> Result<(), SimError> {
        let first = exec.trailing_zeros() as usize;
        let n = self.warp_uniform(pc, w, exec, &self.gather(w, ncols), "column count")? as u32;
        let at = self.warp_uniform(pc, w, exec, &self.addr_values(w, dst), "destination")?;
        if !n.is_power_of_two() || !(32..=TMEM_COLS as u32).contains(&n) {
            return Err(self.fault(
                pc,
                w,
                first,
                err(format!(
                    "tcgen05.alloc of {n} columns: must be a power of two in 32..=512"
                )),
            ));
        }
        if self.tmem.relinquished {
            return Err(self.fault(
                pc,
                w,
                first,
                err("tcgen05.alloc after tcgen05.relinquish_alloc_permit".to_string()),
            ));
        }
        let free = |s: u32| {
            self.tmem
                .allocs
                .iter()
                .all(|&(a, c)| s + n <= a || a + c <= s)
        };
        let Some(start) = (0..TMEM_COLS as u32).step_by(n as usize).find(|&s| free(s)) else {
            return Err(self.fault(
                pc,
                w,
                first,
                err(format!(
                    "tcgen05.alloc of {n} columns with {:?} already allocated: the allocation \
                     would block forever (nothing else frees TMEM on this SM)",
                    self.tmem.allocs
                )),
            ));
        };
        let place = self
            .locate(Space::Shared, at, 4, "tcgen05.alloc")
            .map_err(|f| self.fault(pc, w, first, FaultKind::Memory(f)))?;
        if self.tmem.cells.is_empty() {
            self.tmem.cells = vec![0; TMEM_LANES * TMEM_COLS];
            self.tmem.written = vec![false; TMEM_LANES * TMEM_COLS];
        }
        for lane in 0..TMEM_LANES {
            let cols = lane * TMEM_COLS + start as usize..lane * TMEM_COLS + (start + n) as usize;
            self.tmem.cells[cols.clone()].fill(0x7fff_ffff);
            self.tmem.written[cols].fill(false);
        }
        self.tmem.allocs.push((start, n));
        self.write_bytes(place, &start.to_le_bytes());
        Ok(())
    }

    fn tmem_dealloc(
        &mut self,
        pc: usize,
        w: usize,
        exec: u32,
        taddr: Src,
        ncols: Src,
    ) -> Result<(), SimError> {
        let first = exec.trailing_zeros() as usize;
        let n = self.warp_uniform(pc, w, exec, &self.gather(w, ncols), "column count")? as u32;
        let a = self.warp_uniform(pc, w, exec, &self.gather(w, taddr), "address")? as u32;
        if let Some(m) = self.tmem.mmas.first() {
            return Err(self.fault(
                pc,
                w,
                first,
                err(format!(
                    "tcgen05.dealloc while {} tcgen05.mma are in flight (the first issued at line \
                     {}; no wait on a commit that covers it)",
                    self.tmem.mmas.len(),
                    self.k.source[m.pc].line
                )),
            ));
        }
        let col = a & 0xffff;
        match self.tmem.allocs.iter().position(|&x| x == (col, n)) {
            Some(i) if a >> 16 == 0 => {
                self.tmem.allocs.remove(i);
                self.tmem.freed = true;
                Ok(())
            }
            _ => Err(self.fault(
                pc,
                w,
                first,
                err(format!(
                    "tcgen05.dealloc of address {a:#x}, {n} columns: not an allocation (allocated: \
                     {:?})",
                    self.tmem.allocs
                )),
            )),
        }
    }

    /// The lane and column of a warp-collective ld/st, checked against the warp's quadrant.
    fn tmem_access(
        &self,
        pc: usize,
        w: usize,
        exec: u32,
        taddr: &Addr,
        n: u32,
        what: &str,
    ) -> Result<(u32, u32), SimError> {
        let first = exec.trailing_zeros() as usize;
        let a = self.warp_uniform(pc, w, exec, &self.addr_values(w, taddr), "TMEM address")? as u32;
        let (lane, col) = (a >> 16, a & 0xffff);
        let q = (w % 4) as u32;
        if lane != 32 * q {
            return Err(self.fault(
                pc,
                w,
                first,
                err(format!(
                    "{what} at TMEM lane {lane}: warp {w} may access only lanes {}..{} (warp % 4 \
                     = {q}), and .32x32b needs the quadrant's first lane",
                    32 * q,
                    32 * q + 32
                )),
            ));
        }
        self.tmem_cols(pc, w, first, col, n, what)?;
        Ok((lane, col))
    }

    /// An in-flight MMA whose D (or, with `reads`, TS A) overlaps lanes `[lane, lane+32)` ×
    /// columns `[col, col+n)`.
    fn umma_conflict(
        &self,
        lane: u32,
        col: u32,
        n: u32,
        reads: bool,
    ) -> Option<(usize, &'static str)> {
        let hit = |s: u32, c: u32, rows: u32| lane < rows && col < s + c && s < col + n;
        for m in &self.tmem.mmas {
            if hit(m.d_col, m.n, m.m) {
                return Some((m.pc, "writes"));
            }
            if reads {
                if let Some(a) = m.a_tmem {
                    if hit(a, 8, m.m) {
                        return Some((m.pc, "reads"));
                    }
                }
            }
        }
        None
    }

    fn tmem_ld(
        &mut self,
        pc: usize,
        w: usize,
        exec: u32,
        dst: &[Dst],
        taddr: &Addr,
    ) -> Result<(), SimError> {
        let n = dst.len() as u32;
        let (lane, col) = self.tmem_access(pc, w, exec, taddr, n, "tcgen05.ld")?;
        if let Some((mpc, how)) = self.umma_conflict(lane, col, n, false) {
            let l = exec.trailing_zeros() as usize;
            return Err(self.fault(
                pc,
                w,
                l,
                err(format!(
                    "tcgen05.ld of TMEM lanes {lane}.., columns [{col}, {}) that the tcgen05.mma at \
                     line {} {how} while in flight (no wait on a commit covering it)",
                    col + n,
                    self.k.source[mpc].line
                )),
            ));
        }
        if let Some((t, j)) = self.unwritten(lane, col, n, 32) {
            let l = exec.trailing_zeros() as usize;
            return Err(self.fault(
                pc,
                w,
                l,
                err(format!(
                    "tcgen05.ld reads TMEM lane {}, column {}, never written since its \
                     allocation (its value is undefined; an MMA or tcgen05.st that should have \
                     written it was not waited for, or has not been issued)",
                    lane + t,
                    col + j
                )),
            ));
        }
        for (j, d) in dst.iter().enumerate() {
            let Dst::Reg(r) = d else { continue };
            let mut v = [0u64; 32];
            for l in lanes(exec) {
                v[l] = self.tmem.cells[(lane as usize + l) * TMEM_COLS + col as usize + j] as u64;
            }
            self.put(w, *r, exec, &v, 32);
            let i = w * self.nregs + *r as usize;
            if !self.tmem.ld_pending[i] {
                self.tmem.ld_pending[i] = true;
                self.tmem.ld_pending_n[w] += 1;
            }
        }
        Ok(())
    }

    fn tmem_st(
        &mut self,
        pc: usize,
        w: usize,
        exec: u32,
        taddr: &Addr,
        src: &[Src],
    ) -> Result<(), SimError> {
        let n = src.len() as u32;
        let (lane, col) = self.tmem_access(pc, w, exec, taddr, n, "tcgen05.st")?;
        if let Some((mpc, how)) = self.umma_conflict(lane, col, n, true) {
            let l = exec.trailing_zeros() as usize;
            return Err(self.fault(
                pc,
                w,
                l,
                err(format!(
                    "tcgen05.st to TMEM lanes {lane}.., columns [{col}, {}) that the tcgen05.mma at \
                     line {} {how} while in flight",
                    col + n,
                    self.k.source[mpc].line
                )),
            ));
        }
        self.tmem.st_pending[w] = Some(self.k.source[pc].line);
        for (j, s) in src.iter().enumerate() {
            let v = self.gather(w, *s);
            for l in lanes(exec) {
                let i = (lane as usize + l) * TMEM_COLS + col as usize + j;
                self.tmem.cells[i] = v[l] as u32;
                self.tmem.written[i] = true;
            }
        }
        Ok(())
    }

    /// The first cell (lane offset, column offset) of lanes `[lane, lane + rows)` × columns
    /// `[col, col + n)` not written since allocation.
    fn unwritten(&self, lane: u32, col: u32, n: u32, rows: u32) -> Option<(u32, u32)> {
        for t in 0..rows {
            let row = (lane + t) as usize * TMEM_COLS + col as usize;
            if let Some(j) = self.tmem.written[row..row + n as usize]
                .iter()
                .position(|&x| !x)
            {
                return Some((t, j as u32));
            }
        }
        None
    }

    /// A tcgen05 operation after a thread synchronization needs
    /// `tcgen05.fence::after_thread_sync` in between: without it the operation may be
    /// performed before the synchronization it depends on (PTX ISA, tcgen05 memory
    /// consistency).
    fn check_fence_after(&self, pc: usize, w: usize, exec: u32) -> Result<(), SimError> {
        for l in lanes(exec) {
            if let Some(sync) = self.tmem.synced[w * 32 + l] {
                return Err(self.fault(
                    pc,
                    w,
                    l,
                    err(format!(
                        "`{}` follows the thread synchronization at line {} with no \
                         tcgen05.fence::after_thread_sync in between",
                        self.k.source[pc].text, self.k.source[sync].line
                    )),
                ));
            }
        }
        Ok(())
    }

    /// A thread synchronization that follows a TMEM access (`tcgen05.ld`/`st`/`alloc`) needs
    /// `tcgen05.fence::before_thread_sync` in between (or a `tcgen05.commit`, which implies
    /// it): without it the access may be performed after the synchronization that publishes
    /// it.
    pub(super) fn check_fence_before(
        &self,
        pc: usize,
        w: usize,
        exec: u32,
    ) -> Result<(), SimError> {
        if !matches!(
            &self.k.code[pc].op,
            Op::MbarrierArrive { .. } | Op::Bar { .. }
        ) {
            return Ok(());
        }
        for l in lanes(exec) {
            if let Some(access) = self.tmem.accessed[w * 32 + l] {
                return Err(self.fault(
                    pc,
                    w,
                    l,
                    err(format!(
                        "`{}` synchronizes after the TMEM access at line {} with no \
                         tcgen05.fence::before_thread_sync in between",
                        self.k.source[pc].text, self.k.source[access].line
                    )),
                ));
            }
        }
        Ok(())
    }

    /// Threads `lanes` of warp `w` completed a thread synchronization at `pc`.
    pub(super) fn note_synced(&mut self, pc: usize, w: usize, lanes_done: u32) {
        if self.tmem.synced.is_empty() {
            return;
        }
        for l in lanes(lanes_done) {
            self.tmem.synced[w * 32 + l] = Some(pc);
        }
    }

    /// A warp that signals other threads (mbarrier arrive, named barrier, commit) must have
    /// waited for its `tcgen05.st` first.
    pub(super) fn check_st_pending(&self, pc: usize, w: usize, exec: u32) -> Result<(), SimError> {
        let Some(line) = self.tmem.st_pending[w] else {
            return Ok(());
        };
        let signals = match &self.k.code[pc].op {
            Op::MbarrierArrive { .. } | Op::Bar { .. } => true,
            Op::Tcgen05(t) => matches!(**t, Tcgen05::Commit { .. }),
            _ => false,
        };
        if !signals {
            return Ok(());
        }
        let l = exec.trailing_zeros() as usize;
        Err(self.fault(
            pc,
            w,
            l,
            err(format!(
                "warp {w} signals other threads while its tcgen05.st at line {line} may still be \
                 in progress (tcgen05.wait::st first)"
            )),
        ))
    }

    /// Registers written by a `tcgen05.ld` and not yet waited for must not be touched.
    pub(super) fn check_ld_pending(&self, pc: usize, w: usize, exec: u32) -> Result<(), SimError> {
        if matches!(&self.k.code[pc].op, Op::Tcgen05(t) if matches!(**t, Tcgen05::WaitLd)) {
            return Ok(());
        }
        let base = w * self.nregs;
        if let Some(&r) = self.k.inst_regs[pc]
            .iter()
            .find(|&&r| self.tmem.ld_pending[base + r as usize])
        {
            let l = exec.trailing_zeros() as usize;
            return Err(self.fault(
                pc,
                w,
                l,
                err(format!(
                    "register `{}` is a destination of a tcgen05.ld not yet waited for \
                     (tcgen05.wait::ld first)",
                    self.k.reg_names[r as usize]
                )),
            ));
        }
        Ok(())
    }

    fn smem_desc(
        &self,
        pc: usize,
        w: usize,
        l: usize,
        raw: u64,
        which: &str,
    ) -> Result<MatrixDesc, SimError> {
        let version = (raw >> 46) & 7;
        let base_offset = (raw >> 49) & 7;
        let lbo_mode = (raw >> 52) & 1;
        let swizzle = raw >> 61;
        let msg = if version != 1 {
            Some(format!(
                "version bits 46-48 are {version:#b}, not 0b001 (a Hopper descriptor?)"
            ))
        } else if base_offset != 0 {
            Some(format!(
                "base offset {base_offset} is not modelled (1024-byte aligned atoms only)"
            ))
        } else if lbo_mode != 0 {
            Some("LBO mode 1 is not modelled".to_string())
        } else if swizzle != 2 {
            Some(format!(
                "swizzle code {swizzle} is not modelled (only 2 = 128B)"
            ))
        } else if (raw >> 14) & 3 != 0 || (raw >> 30) & 3 != 0 || (raw >> 53) & 0xff != 0 {
            Some("reserved bits are set".to_string())
        } else {
            None
        };
        if let Some(m) = msg {
            return Err(self.fault(
                pc,
                w,
                l,
                err(format!("tcgen05.mma {which} descriptor {raw:#018x}: {m}")),
            ));
        }
        Ok(MatrixDesc::from_raw(raw))
    }

    /// Reads a `rows × 16` shared operand; `Err` when out of bounds or (with `check_proxy`)
    /// unfenced.
    fn umma_operand(
        &self,
        d: &MatrixDesc,
        rows: u32,
        mn_major: bool,
        which: &str,
        check_proxy: bool,
    ) -> Result<Vec<u16>, FaultKind> {
        let unfenced = self.unfenced_stores(check_proxy);
        read_operand(
            &self.shared,
            d,
            rows,
            mn_major,
            which,
            "tcgen05.mma",
            unfenced,
        )
        .map_err(|e| e.kind(err))
    }

    #[allow(clippy::too_many_arguments)]
    fn umma_issue(
        &mut self,
        pc: usize,
        w: usize,
        l: usize,
        d: &Addr,
        a: &Tc05A,
        b: Src,
        idesc: Src,
        enable_d: PredSrc,
    ) -> Result<(), SimError> {
        let fault = |s: &Self, m: String| s.fault(pc, w, l, err(m));
        let kfault = |s: &Self, k: FaultKind| s.fault(pc, w, l, k);
        let id = self.gather(w, idesc)[l] as u32;
        let field = |lo: u32, bits: u32| (id >> lo) & ((1 << bits) - 1);
        let (dfmt, afmt, bfmt) = (field(4, 2), field(7, 3), field(10, 3));
        let (n, m) = (field(17, 6) << 3, field(24, 5) << 4);
        let bad = if field(0, 4) != 0 || field(6, 1) != 0 || field(23, 1) != 0 || field(29, 3) != 0
        {
            Some("sparsity, saturate, reserved or max-shift bits are set".to_string())
        } else if dfmt != 1 {
            Some(format!("D format {dfmt} is not modelled (only 1 = f32)"))
        } else if afmt > 1 || afmt != bfmt {
            Some(format!(
                "A/B formats {afmt}/{bfmt} are not modelled (f16 or bf16, equal)"
            ))
        } else if m != 128 {
            Some(format!(
                "M = {m} is not modelled (only M = 128 with cta_group::1)"
            ))
        } else if !(16..=256).contains(&n) || !n.is_multiple_of(16) {
            Some(format!(
                "N = {n} is not valid for M = 128 (16..=256, step 16)"
            ))
        } else {
            None
        };
        if let Some(msg) = bad {
            return Err(fault(
                self,
                format!("instruction descriptor {id:#010x}: {msg}"),
            ));
        }
        let (a_mn, b_mn) = (field(15, 1) == 1, field(16, 1) == 1);
        let dt = self.lane_addr(w, l, d) as u32;
        if dt >> 16 != 0 {
            return Err(fault(
                self,
                format!("D address {dt:#x}: lane must be 0 for M = 128"),
            ));
        }
        let d_col = dt & 0xffff;
        self.tmem_cols(pc, w, l, d_col, n, "tcgen05.mma D")?;
        let b_raw = self.gather(w, b)[l];
        let b_desc = self.smem_desc(pc, w, l, b_raw, "B")?;
        let bv = self
            .umma_operand(&b_desc, n, b_mn, "B", true)
            .map_err(|e| kfault(self, e))?;
        let (a_tmem, a_desc, av) = match a {
            Tc05A::Desc(s) => {
                let raw = self.gather(w, *s)[l];
                let ad = self.smem_desc(pc, w, l, raw, "A")?;
                let av = self
                    .umma_operand(&ad, m, a_mn, "A", true)
                    .map_err(|e| kfault(self, e))?;
                (None, Some((ad, a_mn)), av)
            }
            Tc05A::Tmem(x) => {
                if a_mn {
                    return Err(fault(
                        self,
                        "an A operand in TMEM must be K-major (idesc bit 15 = 0)".to_string(),
                    ));
                }
                let at = self.lane_addr(w, l, x) as u32;
                if at >> 16 != 0 {
                    return Err(fault(
                        self,
                        format!("A address {at:#x}: lane must be 0 for M = 128"),
                    ));
                }
                self.tmem_cols(pc, w, l, at & 0xffff, 8, "tcgen05.mma A")?;
                (Some(at & 0xffff), None, Vec::new())
            }
        };
        // The ISA orders an MMA only after earlier MMAs on the same accumulator; any other
        // in-flight MMA may still run, so their TMEM footprints must not conflict.
        let a_cols = a_tmem.map(|c| (c, 8));
        for p in &self.tmem.mmas {
            if (p.d_col, p.n, p.m) == (d_col, n, m) {
                continue;
            }
            let overlap = |x: (u32, u32), y: (u32, u32)| x.0 < y.0 + y.1 && y.0 < x.0 + x.1;
            let p_a = p.a_tmem.map(|c| (c, 8));
            let what = if overlap((d_col, n), (p.d_col, p.n)) {
                Some("writes TMEM columns the in-flight MMA also writes")
            } else if p_a.is_some_and(|pa| overlap((d_col, n), pa)) {
                Some("writes TMEM columns the in-flight MMA reads as its A operand")
            } else if a_cols.is_some_and(|ac| overlap(ac, (p.d_col, p.n))) {
                Some("reads as its A operand TMEM columns the in-flight MMA writes")
            } else {
                None
            };
            if let Some(what) = what {
                return Err(fault(
                    self,
                    format!(
                        "this tcgen05.mma (D columns {d_col}..{}) {what} (the tcgen05.mma at line \
                         {}, D columns {}..{}): MMAs on different accumulators are not ordered \
                         (PTX ISA, tcgen05 completion order); wait for a tcgen05.commit of the \
                         earlier one first",
                        d_col + n,
                        self.k.source[p.pc].line,
                        p.d_col,
                        p.d_col + p.n
                    ),
                ));
            }
        }
        let enable = self.pred_mask(w, enable_d) >> l & 1 == 1;
        self.tmem.seq += 1;
        let seq = self.tmem.seq;
        self.tmem.last_seq[w * 32 + l] = seq;
        self.tmem.mmas.push(PendingUmma {
            pc,
            seq,
            m,
            n,
            d_col,
            a_tmem,
            a_desc,
            b_desc: (b_desc, b_mn),
            a: av,
            b: bv,
            bf16: afmt == 1,
            negate_a: field(13, 1) == 1,
            negate_b: field(14, 1) == 1,
            enable_d: enable,
        });
        Ok(())
    }

    /// Completes every in-flight MMA with a sequence number up to `upto`, in order; `at` is
    /// the instruction that forces completion (for fault locations).
    fn umma_complete_upto(&mut self, upto: u64, at: (usize, usize, usize)) -> Result<(), SimError> {
        let n = self.tmem.mmas.iter().take_while(|m| m.seq <= upto).count();
        let mut done: Vec<PendingUmma> = self.tmem.mmas.drain(..n).collect();
        if self.umma_order == UmmaOrder::Issue {
            for m in done {
                self.umma_compute(&m, at)?;
            }
            return Ok(());
        }
        while !done.is_empty() {
            // The MMAs that may complete next: none of an earlier MMA on their accumulator is
            // still pending.
            let ready: Vec<usize> = (0..done.len())
                .filter(|&i| {
                    let key = |m: &PendingUmma| (m.d_col, m.n, m.m);
                    !done[..i].iter().any(|e| key(e) == key(&done[i]))
                })
                .collect();
            let pick = match self.umma_order {
                UmmaOrder::Issue => ready[0],
                UmmaOrder::Reversed => ready[ready.len() - 1],
                UmmaOrder::Seeded(_) => {
                    self.umma_rng = self.umma_rng.wrapping_add(GOLDEN);
                    ready[(mix64(self.umma_rng) % ready.len() as u64) as usize]
                }
            };
            let m = done.remove(pick);
            self.umma_compute(&m, at)?;
        }
        Ok(())
    }

    fn umma_compute(&mut self, m: &PendingUmma, at: (usize, usize, usize)) -> Result<(), SimError> {
        let (pc, w, l) = at;
        let issued = self.k.source[m.pc].line;
        let mut checks = vec![("B", m.b_desc, m.n, &m.b)];
        if let Some(d) = m.a_desc {
            checks.push(("A", d, m.m, &m.a));
        }
        for (which, (d, mn_major), rows, old) in checks {
            let now = self
                .umma_operand(&d, rows, mn_major, which, false)
                .map_err(|e| self.fault(pc, w, l, e))?;
            if let Some(i) = (0..now.len()).find(|&i| now[i] != old[i]) {
                let (mn, kk) = (i / 16, i % 16);
                return Err(self.fault(
                    pc,
                    w,
                    l,
                    err(format!(
                        "shared memory under {which} of the tcgen05.mma at line {issued} changed \
                         before the MMA completed: element ({mn}, k {kk}) at shared {:#x} was \
                         {:#06x} at issue and is {:#06x} now (a store or TMA raced the MMA)",
                        d.addr(mn as u32, kk as u32, mn_major),
                        old[i],
                        now[i]
                    )),
                ));
            }
        }
        let mut reads = Vec::new();
        if let Some(col) = m.a_tmem {
            reads.push(("A", col, 8));
        }
        if m.enable_d {
            reads.push(("D (enable_input_d is true)", m.d_col, m.n));
        }
        for (which, col, n) in reads {
            if let Some((t, j)) = self.unwritten(0, col, n, m.m) {
                return Err(self.fault(
                    pc,
                    w,
                    l,
                    err(format!(
                        "the tcgen05.mma at line {issued} reads its {which} at TMEM lane {t}, \
                         column {}, never written since its allocation",
                        col + j
                    )),
                ));
            }
        }
        let (rows, n) = (m.m as usize, m.n as usize);
        if self.tcgen05_numerics == Tcgen05Numerics::Truncating {
            let cells = &mut self.tmem.cells;
            let input = if m.bf16 {
                MmaInput::Bf16
            } else {
                MmaInput::F16
            };
            // The raw halves of A (negated as the descriptor says) and of B, per k16 step.
            let raw_a: Vec<u16> = match m.a_tmem {
                None => m.a.clone(),
                Some(col) => (0..rows * 16)
                    .map(|i| {
                        let cell = cells[(i / 16) * TMEM_COLS + col as usize + (i % 16) / 2];
                        (cell >> (16 * (i % 2))) as u16
                    })
                    .collect(),
            };
            let a: Vec<Operand> = raw_a.iter().map(|&x| input.decode(x, m.negate_a)).collect();
            let b: Vec<Operand> = m.b.iter().map(|&x| input.decode(x, m.negate_b)).collect();
            let fast = all_finite(&a) && all_finite(&b);
            let (pa, pb) = (Prepared::new(input, &a), Prepared::new(input, &b));
            for r in 0..rows {
                let at = r * TMEM_COLS + m.d_col as usize;
                for j in 0..n {
                    let c = m.enable_d.then_some(cells[at + j]);
                    cells[at + j] = if fast {
                        let (av, ae) = (&pa.value[r * 16..][..16], &pa.exp[r * 16..][..16]);
                        let (bv, be) = (&pb.value[j * 16..][..16], &pb.exp[j * 16..][..16]);
                        sm90_block_prepared(input, av, ae, bv, be, c)
                    } else {
                        sm90_block(input, &a[r * 16..][..16], &b[j * 16..][..16], c)
                    };
                }
                self.tmem.written[at..at + n].fill(true);
            }
            return Ok(());
        }
        let conv = |x: u16| {
            if m.bf16 {
                f32::from_bits((x as u32) << 16)
            } else {
                half::f16::from_bits(x).to_f32()
            }
        };
        let sa = if m.negate_a { -1.0f32 } else { 1.0 };
        let sb = if m.negate_b { -1.0f32 } else { 1.0 };
        let cells = &mut self.tmem.cells;
        let af: Vec<f32> = match m.a_tmem {
            None => m.a.iter().map(|&x| conv(x) * sa).collect(),
            Some(col) => {
                let mut v = vec![0f32; rows * 16];
                for (r, row) in v.chunks_exact_mut(16).enumerate() {
                    for (k, x) in row.iter_mut().enumerate() {
                        let cell = cells[r * TMEM_COLS + col as usize + k / 2];
                        *x = conv((cell >> (16 * (k % 2))) as u16) * sa;
                    }
                }
                v
            }
        };
        let mut bt = vec![0f32; 16 * n];
        for j in 0..n {
            for kk in 0..16 {
                bt[kk * n + j] = conv(m.b[j * 16 + kk]) * sb;
            }
        }
        let mut out = vec![0f32; n];
        for r in 0..rows {
            let row = &mut cells[r * TMEM_COLS + m.d_col as usize..][..n];
            for (o, c) in out.iter_mut().zip(row.iter()) {
                *o = if m.enable_d { f32::from_bits(*c) } else { 0.0 };
            }
            for kk in 0..16 {
                let a = af[r * 16 + kk];
                for (x, &b) in out.iter_mut().zip(&bt[kk * n..(kk + 1) * n]) {
                    *x += a * b;
                }
            }
            for (c, o) in row.iter_mut().zip(&out) {
                *c = canon(*o) as u32;
            }
            let at = r * TMEM_COLS + m.d_col as usize;
            self.tmem.written[at..at + n].fill(true);
        }
        Ok(())
    }

    /// Lands the commits to the mbarrier at `off` (a thread waits on it and the phase is
    /// incomplete): their MMAs complete, then each arrives once.
    pub(super) fn complete_commits_for(&mut self, off: u32) -> Result<(), SimError> {
        if !self.tmem.commits.iter().any(|c| c.mbar == off) {
            return Ok(());
        }
        let (mine, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut self.tmem.commits)
            .into_iter()
            .partition(|c| c.mbar == off);
        self.tmem.commits = rest;
        for c in mine {
            self.land_commit(c)?;
        }
        Ok(())
    }

    /// Every live thread is blocked (or the CTA ends): everything in flight completes.
    pub(super) fn complete_all_umma(&mut self) -> Result<(), SimError> {
        for c in std::mem::take(&mut self.tmem.commits) {
            self.land_commit(c)?;
        }
        if let Some(m) = self.tmem.mmas.last() {
            let at = (m.pc, 0, 0);
            self.umma_complete_upto(u64::MAX, at)?;
        }
        Ok(())
    }

    pub(super) fn umma_pending(&self) -> bool {
        !self.tmem.mmas.is_empty() || !self.tmem.commits.is_empty()
    }

    fn land_commit(&mut self, c: PendingCommit) -> Result<(), SimError> {
        self.umma_complete_upto(c.upto, (c.pc, c.warp, c.lane))?;
        let i = self.mbar_live(c.pc, c.warp, c.lane, c.mbar)?;
        let mb = &mut self.mbars[i];
        mb.pending -= 1;
        if mb.pending < 0 {
            let msg = format!(
                "tcgen05.commit arrives on the mbarrier at shared {:#x} in phase {}, which expects \
                 only {} arrivals",
                c.mbar, mb.phase, mb.expected
            );
            return Err(self.fault(c.pc, c.warp, c.lane, FaultKind::Mbarrier(msg)));
        }
        self.settle(i)
            .map_err(|msg| self.fault(c.pc, c.warp, c.lane, FaultKind::Mbarrier(msg)))
    }

    /// At the end of a CTA: MMAs in flight or TMEM still allocated are faults; commits left
    /// (all their MMAs done) arrive.
    pub(super) fn check_tcgen05_exit(&mut self) -> Result<(), SimError> {
        if let Some(m) = self.tmem.mmas.first() {
            let msg = format!(
                "the CTA finished with {} tcgen05.mma in flight (this one was never covered by a \
                 commit that was waited on)",
                self.tmem.mmas.len()
            );
            return Err(self.fault(m.pc, 0, 0, err(msg)));
        }
        for c in std::mem::take(&mut self.tmem.commits) {
            self.land_commit(c)?;
        }
        if let Some(&(s, n)) = self.tmem.allocs.first() {
            let msg = format!(
                "the CTA finished with TMEM columns [{s}, {}) still allocated (tcgen05.dealloc \
                 before exit)",
                s + n
            );
            return Err(SimError::Fault {
                at: self.location(0, 0, 0),
                kind: err(msg),
            });
        }
        Ok(())
    }
}
