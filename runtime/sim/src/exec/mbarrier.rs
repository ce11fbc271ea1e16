//! mbarriers, TMA tile loads and the generic/async proxy bookkeeping of shared memory.
//!
//! An mbarrier is a side-table entry keyed by its shared address: expected arrivals, pending
//! arrivals, the transaction count and the phase. A phase completes when the pending
//! arrivals and the transaction count are both zero; then the phase number increments and
//! the pending count is re-armed. `try_wait.parity p` succeeds when the current phase's parity
//! differs from `p` (the phase of parity `p` has completed).
//!
//! A TMA copy is validated at issue (map, coordinates, destination, mbarrier) and recorded
//! with the mbarrier's phase at that moment; completing it copies the box into shared memory
//! (zeros, or the NaN fill, for out-of-bounds elements; the 128B/64B/32B swizzle XORs the 16-byte
//! chunk index with the absolute 128-byte row index) and subtracts the box bytes from the
//! transaction count. A copy that completes after its phase has already completed carried
//! bytes the phase did not expect: a fault.
//!
//! What an H200 does with tile loads (`tests/h200_compare.rs`, byte for byte): the destination
//! must be 128-byte aligned (16 gives a misaligned-address error) and need not be aligned to
//! the swizzle pattern: the swizzle is a function of the absolute shared address. A box row
//! narrower than the swizzle span occupies a whole span (the rest untouched) while the
//! transaction count is the dense box. An inner coordinate that is not a multiple of 16 bytes
//! raises an illegal instruction (in range or not); the simulator refuses it. The NaN fill of
//! a bf16 map writes `0x7ff7`.

use super::{lanes, Cta, Flow, Place, TmaCompletion, BLOCK_MBAR, BLOCK_WARPGROUP, NOT_BLOCKED};
use crate::error::{FaultKind, SimError};
use crate::ir::{
    Addr, BulkLoad, BulkReduce, Dst, Op, Reg, Space, Src, TensorRef, TmaLoad, TmaReduce,
    SHARED_WINDOW,
};
use crate::numeric::{bf16_rne, bf16_to_f32, f16_rne};
use crate::tensor_map::{OobFill, SimTensorMap, TENSOR_MAP_BYTES};

/// Largest arrival count and transaction count of one operation (2^20 − 1).
const MAX_COUNT: u64 = (1 << 20) - 1;

/// One initialised mbarrier.
#[derive(Debug, Clone)]
pub(super) struct Mbarrier {
    /// Shared address.
    pub addr: u32,
    /// Arrivals per phase.
    pub expected: u32,
    /// Arrivals still missing in the current phase.
    pub pending: i64,
    /// Transaction bytes expected and not yet completed in the current phase (negative when
    /// copies completed before their `expect_tx`).
    pub tx: i64,
    /// Phases completed so far.
    pub phase: u64,
}

/// The shared source of a TMA reduction, protected until its group is retired.
#[derive(Debug, Clone)]
pub(super) struct BulkRead {
    /// The issuing thread (`32·warp + lane`).
    pub thread: usize,
    /// Its bulk group, once committed.
    pub group: Option<u64>,
    /// `[lo, hi)` in shared memory.
    pub lo: u32,
    pub hi: u32,
    /// The issuing instruction.
    pub pc: usize,
}

/// What a copy in flight reads.
#[derive(Debug, Clone)]
pub(super) enum CopySource {
    /// A tensor map's box at these coordinates.
    Box { map: SimTensorMap, coords: [i64; 5] },
    /// `bytes` contiguous bytes of global memory at `src`.
    Bulk { src: u64, bytes: u32 },
}

/// A TMA copy (tensor or bulk) issued and not yet landed.
#[derive(Debug, Clone)]
pub(super) struct PendingTma {
    pub pc: usize,
    pub warp: usize,
    pub lane: usize,
    pub source: CopySource,
    pub dst: u32,
    pub mbar: u32,
    /// The mbarrier's phase when the copy was issued.
    pub phase: u64,
}

impl Cta<'_> {
    /// The shared address of an mbarrier operand (8-byte aligned, inside shared memory).
    pub(super) fn mbar_offset(
        &self,
        pc: usize,
        w: usize,
        l: usize,
        space: Space,
        addr: &Addr,
    ) -> Result<u32, SimError> {
        let at = self.lane_addr(w, l, addr);
        let off = match space {
            Space::Shared => at,
            _ if (SHARED_WINDOW..SHARED_WINDOW + (1 << 32)).contains(&at) => at - SHARED_WINDOW,
            _ => {
                return Err(self.fault(
                    pc,
                    w,
                    l,
                    FaultKind::Mbarrier(format!(
                        "generic address {at:#x} is not in the shared window"
                    )),
                ))
            }
        };
        match self.locate(Space::Shared, off, 8, "mbarrier") {
            Ok(_) => Ok(off as u32),
            Err(f) => Err(self.fault(pc, w, l, FaultKind::Memory(f))),
        }
    }

    fn mbar_index(&self, off: u32) -> Option<usize> {
        self.mbars.iter().position(|m| m.addr == off)
    }

    pub(super) fn mbar_live(
        &self,
        pc: usize,
        w: usize,
        l: usize,
        off: u32,
    ) -> Result<usize, SimError> {
        self.mbar_index(off).ok_or_else(|| {
            self.fault(
                pc,
                w,
                l,
                FaultKind::Mbarrier(format!(
                    "no mbarrier is initialised at shared {off:#x} (mbarrier.init first)"
                )),
            )
        })
    }

    pub(super) fn mbarrier_init(
        &mut self,
        pc: usize,
        w: usize,
        exec: u32,
        space: Space,
        addr: &Addr,
        count: Src,
    ) -> Result<(), SimError> {
        let counts = self.gather(w, count);
        for l in lanes(exec) {
            let off = self.mbar_offset(pc, w, l, space, addr)?;
            let n = counts[l] as u32 as u64;
            if n == 0 || n > MAX_COUNT {
                return Err(self.fault(
                    pc,
                    w,
                    l,
                    FaultKind::Mbarrier(format!("init count {n} is not in 1..2^20")),
                ));
            }
            if let Some(i) = self.mbar_index(off) {
                let waiting = (0..self.blocked_on.len())
                    .any(|t| self.blocked_on[t] == BLOCK_MBAR && self.mbar_wait[t].0 == off);
                let copies = self.tmas.iter().filter(|t| t.mbar == off).count();
                if waiting || copies > 0 {
                    return Err(self.fault(
                        pc,
                        w,
                        l,
                        FaultKind::Mbarrier(format!(
                            "re-initialising the mbarrier at shared {off:#x} while {} \
                             ({copies} TMA copies in flight)",
                            if waiting {
                                "threads wait on it"
                            } else {
                                "no thread waits on it"
                            }
                        )),
                    ));
                }
                self.mbars.remove(i);
            }
            self.mbars.push(Mbarrier {
                addr: off,
                expected: n as u32,
                pending: n as i64,
                tx: 0,
                phase: 0,
            });
        }
        Ok(())
    }

    /// `mbarrier.expect_tx` / `mbarrier.complete_tx`: transaction bytes without an arrival.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mbarrier_tx(
        &mut self,
        pc: usize,
        w: usize,
        exec: u32,
        space: Space,
        addr: &Addr,
        tx: Src,
        complete: bool,
    ) -> Result<(), SimError> {
        let txs = self.gather(w, tx);
        for l in lanes(exec) {
            let off = self.mbar_offset(pc, w, l, space, addr)?;
            let i = self.mbar_live(pc, w, l, off)?;
            let v = txs[l] as u32 as u64;
            if v > MAX_COUNT {
                let msg = format!("transaction count {v} is not in 0..2^20");
                return Err(self.fault(pc, w, l, FaultKind::Mbarrier(msg)));
            }
            self.mbars[i].tx += if complete { -(v as i64) } else { v as i64 };
            self.settle(i)
                .map_err(|msg| self.fault(pc, w, l, FaultKind::Mbarrier(msg)))?;
        }
        Ok(())
    }

    /// `mbarrier.arrive[.expect_tx]`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mbarrier_arrive(
        &mut self,
        pc: usize,
        w: usize,
        exec: u32,
        space: Space,
        state: Dst,
        addr: &Addr,
        count: Option<Src>,
        tx: Option<Src>,
    ) -> Result<(), SimError> {
        let counts = count.map(|c| self.gather(w, c));
        let txs = tx.map(|c| self.gather(w, c));
        let mut token = [0u64; 32];
        for l in lanes(exec) {
            let off = self.mbar_offset(pc, w, l, space, addr)?;
            let i = self.mbar_live(pc, w, l, off)?;
            let bad =
                |what: &str, v: u64| FaultKind::Mbarrier(format!("{what} {v} is not in 0..2^20"));
            if let Some(t) = &txs {
                let v = t[l] as u32 as u64;
                if v > MAX_COUNT {
                    return Err(self.fault(pc, w, l, bad("expect_tx byte count", v)));
                }
                self.mbars[i].tx += v as i64;
            }
            token[l] = self.mbars[i].phase;
            let c = counts.map_or(1, |c| c[l] as u32 as u64);
            if c == 0 || c > MAX_COUNT {
                return Err(self.fault(pc, w, l, bad("arrival count", c)));
            }
            let m = &mut self.mbars[i];
            m.pending -= c as i64;
            if m.pending < 0 {
                let msg = format!(
                    "at shared {off:#x}: {} arrivals in phase {} of an mbarrier that expects {} \
                     per phase (the phase waits for {} transaction bytes)",
                    m.expected as i64 - m.pending,
                    m.phase,
                    m.expected,
                    m.tx
                );
                return Err(self.fault(pc, w, l, FaultKind::Mbarrier(msg)));
            }
            self.settle(i)
                .map_err(|msg| self.fault(pc, w, l, FaultKind::Mbarrier(msg)))?;
        }
        if let Dst::Reg(r) = state {
            self.put(w, r, exec, &token, 64);
        }
        Ok(())
    }

    /// Completes the phase of mbarrier `i` if its arrivals and bytes are all in; an error
    /// when more bytes completed than the phase expected.
    pub(super) fn settle(&mut self, i: usize) -> Result<(), String> {
        let m = &mut self.mbars[i];
        if m.pending == 0 && m.tx < 0 {
            return Err(format!(
                "at shared {:#x}, phase {}: {} more transaction bytes completed than the phase \
                 expected (all {} arrivals are in)",
                m.addr, m.phase, -m.tx, m.expected
            ));
        }
        if m.pending == 0 && m.tx == 0 {
            m.phase += 1;
            m.pending = m.expected as i64;
            let (addr, parity) = (m.addr, (m.phase & 1) as u8);
            self.wake_mbar(addr, parity);
        }
        Ok(())
    }

    /// Makes the lanes waiting on `addr` for the phase that just completed (parity other than
    /// `parity`, the parity of the phase now in progress) runnable again.
    fn wake_mbar(&mut self, addr: u32, parity: u8) {
        for w in 0..self.nwarps {
            let mut wake = 0u32;
            for l in 0..32 {
                let t = w * 32 + l;
                if self.blocked_on[t] == BLOCK_MBAR
                    && self.mbar_wait[t].0 == addr
                    && self.mbar_wait[t].1 != parity
                {
                    wake |= 1 << l;
                }
            }
            if wake != 0 {
                self.materialize(w);
                for l in lanes(wake) {
                    self.blocked_on[w * 32 + l] = NOT_BLOCKED;
                }
                self.ready[w] |= wake;
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn mbarrier_try_wait(
        &mut self,
        pc: usize,
        w: usize,
        group: u32,
        exec: u32,
        test: bool,
        space: Space,
        p: Reg,
        addr: &Addr,
        parity: Src,
    ) -> Result<(), SimError> {
        let par = self.gather(w, parity);
        let mut blocked = 0u32;
        for l in lanes(exec) {
            let off = self.mbar_offset(pc, w, l, space, addr)?;
            let want = (par[l] & 1) as u8;
            let i = self.mbar_live(pc, w, l, off)?;
            if self.mbars[i].phase & 1 != want as u64 {
                continue;
            }
            // The phase is in progress: the copies it waits for land now, at the latest point.
            self.complete_tmas_for(off)?;
            self.complete_commits_for(off)?;
            let i = self.mbar_live(pc, w, l, off)?;
            if self.mbars[i].phase & 1 == want as u64 {
                blocked |= 1 << l;
                self.mbar_wait[w * 32 + l] = (off, want);
            }
        }
        self.note_synced(pc, w, exec & !blocked);
        if test {
            // test_wait never blocks: the lanes still waiting read false.
            self.put_mask(w, p, exec, exec & !blocked);
            self.advance(w, group);
            return Ok(());
        }
        let done = exec & !blocked;
        self.put_mask(w, p, done, done);
        if blocked == 0 {
            self.advance(w, group);
            return Ok(());
        }
        self.materialize(w);
        for l in lanes(group & !blocked) {
            self.pc[w * 32 + l] += 1;
        }
        for l in lanes(blocked) {
            self.blocked_on[w * 32 + l] = BLOCK_MBAR;
        }
        self.ready[w] &= !blocked;
        Ok(())
    }

    /// The 128 bytes of a tensor map at generic address `at` (param, global or shared).
    fn read_map(&self, at: u64) -> Result<[u8; TENSOR_MAP_BYTES], String> {
        if !at.is_multiple_of(64) {
            return Err(format!(
                "the tensor map address {at:#x} is not 64-byte aligned"
            ));
        }
        let place = self
            .locate(Space::Generic, at, 8, "tensor map load")
            .map_err(|f| f.to_string())?;
        let n = TENSOR_MAP_BYTES;
        let bytes = match place {
            Place::Param(o) => self.params.get(o..o + n),
            Place::Shared(o) => self.shared.get(o..o + n),
            Place::Global(a) => self.mem.slice(a, n),
        };
        let bytes = bytes.ok_or_else(|| {
            format!("the 128-byte tensor map at {at:#x} crosses the end of its memory")
        })?;
        Ok(bytes.try_into().expect("128 bytes"))
    }

    pub(super) fn tma_issue(
        &mut self,
        pc: usize,
        w: usize,
        exec: u32,
        t: &TmaLoad,
    ) -> Result<(), SimError> {
        let coords: Vec<[u64; 32]> = t.tensor.coords.iter().map(|c| self.gather(w, *c)).collect();
        for l in lanes(exec) {
            let lane_coords: Vec<u64> = coords.iter().map(|c| c[l]).collect();
            let (map, c, dst) = self.tma_box(pc, w, l, &t.tensor, &lane_coords, &t.dst, "copy")?;
            self.clear_of_mbarriers(pc, (w, l), "box", u64::from(dst), map.shared_bytes())?;
            let mbar = self.mbar_offset(pc, w, l, Space::Shared, &t.mbar)?;
            let i = self.mbar_live(pc, w, l, mbar)?;
            let pending = PendingTma {
                pc,
                warp: w,
                lane: l,
                source: CopySource::Box { map, coords: c },
                dst,
                mbar,
                phase: self.mbars[i].phase,
            };
            self.track_copy(pending)?;
        }
        Ok(())
    }

    /// `cp.async.bulk` global to shared: per lane, validated at issue (16-byte aligned
    /// addresses, the destination inside shared memory and clear of live mbarriers, the
    /// mbarrier live) and landed as a TMA copy.
    pub(super) fn bulk_issue(
        &mut self,
        pc: usize,
        w: usize,
        exec: u32,
        t: &BulkLoad,
    ) -> Result<(), SimError> {
        for l in lanes(exec) {
            let src = self.lane_addr(w, l, &t.src);
            let dst = self.lane_addr(w, l, &t.dst);
            let bytes = u64::from(t.bytes);
            self.bulk_operands(pc, (w, l), "bulk copy", (src, dst, bytes))?;
            self.clear_of_mbarriers(pc, (w, l), "bulk copy", dst, bytes)?;
            let mbar = self.mbar_offset(pc, w, l, Space::Shared, &t.mbar)?;
            let i = self.mbar_live(pc, w, l, mbar)?;
            let pending = PendingTma {
                pc,
                warp: w,
                lane: l,
                source: CopySource::Bulk {
                    src,
                    bytes: t.bytes,
                },
                dst: dst as u32,
                mbar,
                phase: self.mbars[i].phase,
            };
            self.track_copy(pending)?;
        }
        Ok(())
    }

    /// The operands of a bulk (non-tensor) copy or reduction (`what`) of lane `l` of warp
    /// `w`: its global address and its shared `[shared, +bytes)` both 16-byte aligned, the
    /// shared side inside the CTA's shared memory.
    fn bulk_operands(
        &self,
        pc: usize,
        (w, l): (usize, usize),
        what: &str,
        (global, shared, bytes): (u64, u64, u64),
    ) -> Result<(), SimError> {
        if global.is_multiple_of(16)
            && shared.is_multiple_of(16)
            && shared + bytes <= self.shared.len() as u64
        {
            return Ok(());
        }
        Err(self.fault(
            pc,
            w,
            l,
            FaultKind::Tma(format!(
                "a {what} between global {global:#x} and shared [{shared:#x}, +{bytes}): both \
                 must be 16-byte aligned and the shared side inside the CTA's {} bytes of shared \
                 memory",
                self.shared.len()
            )),
        ))
    }

    /// A copy's destination `[dst, +bytes)` in shared memory (`what`: "box", "bulk copy")
    /// must not cover a live mbarrier.
    fn clear_of_mbarriers(
        &self,
        pc: usize,
        (w, l): (usize, usize),
        what: &str,
        dst: u64,
        bytes: u64,
    ) -> Result<(), SimError> {
        match self
            .mbars
            .iter()
            .find(|m| u64::from(m.addr) + 8 > dst && u64::from(m.addr) < dst + bytes)
        {
            Some(m) => Err(self.fault(
                pc,
                w,
                l,
                FaultKind::Tma(format!(
                    "the {what} [{dst:#x}, +{bytes}) overwrites the live mbarrier at {:#x}",
                    m.addr
                )),
            )),
            None => Ok(()),
        }
    }

    /// Lands `pending` now or when its mbarrier is waited on, as the completion mode says.
    fn track_copy(&mut self, pending: PendingTma) -> Result<(), SimError> {
        match self.tma_completion {
            TmaCompletion::Deferred => self.tmas.push(pending),
            TmaCompletion::Immediate => self.complete_tma(pending)?,
        }
        Ok(())
    }

    /// The checks a TMA box operation (`op`: "copy", "reduction") of lane `l` shares: its map
    /// decodes and has one dimension per coordinate (`coords`: the lane's values, read as
    /// s32), the inner coordinate is 16-byte aligned, and the box's shared side at `smem` is
    /// 128-byte aligned and inside the CTA's shared memory. Returns the map, the coordinates
    /// and the shared offset.
    #[allow(clippy::too_many_arguments)]
    fn tma_box(
        &self,
        pc: usize,
        w: usize,
        l: usize,
        tensor: &TensorRef,
        coords: &[u64],
        smem: &Addr,
        op: &str,
    ) -> Result<(SimTensorMap, [i64; 5], u32), SimError> {
        let tma = |msg: String| FaultKind::Tma(msg);
        let map_at = self.lane_addr(w, l, &tensor.map);
        let map = self
            .read_map(map_at)
            .and_then(|b| SimTensorMap::from_bytes(&b))
            .map_err(|e| self.fault(pc, w, l, tma(e)))?;
        if map.rank as usize != coords.len() {
            return Err(self.fault(
                pc,
                w,
                l,
                tma(format!(
                    "a {}d {op} through a rank-{} tensor map",
                    coords.len(),
                    map.rank
                )),
            ));
        }
        let mut c = [0i64; 5];
        for (d, &v) in coords.iter().enumerate() {
            c[d] = v as u32 as i32 as i64;
        }
        let inner = c[0] * map.elem_bytes as i64;
        if inner % 16 != 0 {
            return Err(self.fault(
                pc,
                w,
                l,
                tma(format!(
                    "the inner coordinate {} is {inner} bytes into the row, not a multiple of \
                     16 (an H200 raises an illegal instruction)",
                    c[0]
                )),
            ));
        }
        let at = self.lane_addr(w, l, smem);
        let bytes = map.shared_bytes();
        if !at.is_multiple_of(128) || at + bytes > self.shared.len() as u64 {
            let side = if op == "copy" {
                "destination"
            } else {
                "source"
            };
            return Err(self.fault(
                pc,
                w,
                l,
                tma(format!(
                    "{side} shared [{at:#x}, +{bytes}) must be 128-byte aligned and inside the \
                     CTA's {} bytes of shared memory",
                    self.shared.len()
                )),
            ));
        }
        Ok((map, c, at as u32))
    }

    /// Lands every copy in flight to the mbarrier at `off`, in issue order.
    pub(super) fn complete_tmas_for(&mut self, off: u32) -> Result<(), SimError> {
        if !self.tmas.iter().any(|t| t.mbar == off) {
            return Ok(());
        }
        let (mine, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut self.tmas)
            .into_iter()
            .partition(|t| t.mbar == off);
        self.tmas = rest;
        for t in mine {
            self.complete_tma(t)?;
        }
        Ok(())
    }

    /// Lands every copy in flight, in issue order.
    pub(super) fn complete_all_tmas(&mut self) -> Result<(), SimError> {
        for t in std::mem::take(&mut self.tmas) {
            self.complete_tma(t)?;
        }
        Ok(())
    }

    fn complete_tma(&mut self, t: PendingTma) -> Result<(), SimError> {
        let bytes = match &t.source {
            CopySource::Box { map, coords } => self.land_box(&t, map, coords)?,
            CopySource::Bulk { src, bytes } => self.land_bulk(&t, *src, *bytes)?,
        };
        let fault =
            |cta: &Self, msg: String| cta.fault(t.pc, t.warp, t.lane, FaultKind::Mbarrier(msg));
        let Some(i) = self.mbar_index(t.mbar) else {
            let msg = format!(
                "the mbarrier at shared {:#x} of a TMA copy in flight was re-initialised",
                t.mbar
            );
            return Err(fault(self, msg));
        };
        if self.mbars[i].phase != t.phase {
            let msg = format!(
                "at shared {:#x}: a TMA copy of {bytes} bytes issued in phase {} lands in phase {}: \
                 its phase completed without these bytes (the copies carry more bytes than the \
                 phase's expect_tx)",
                t.mbar, t.phase, self.mbars[i].phase
            );
            return Err(fault(self, msg));
        }
        self.mbars[i].tx -= bytes;
        self.settle(i).map_err(|msg| fault(self, msg))
    }

    /// A bulk copy's bytes into shared memory (replacing any generic store pending there);
    /// returns its transaction bytes.
    fn land_bulk(&mut self, t: &PendingTma, src: u64, bytes: u32) -> Result<i64, SimError> {
        let Some(data) = self.mem.slice(src, bytes as usize).map(<[u8]>::to_vec) else {
            let msg = format!(
                "the bulk copy reads global [{src:#x}, +{bytes}): {}",
                self.mem.describe(src)
            );
            return Err(self.fault(t.pc, t.warp, t.lane, FaultKind::Tma(msg)));
        };
        self.count_bulk(true, src, u64::from(bytes));
        let lo = t.dst as usize;
        self.shared[lo..lo + data.len()].copy_from_slice(&data);
        if self.unfenced_total > 0 {
            for word in lo / 4..(lo + data.len()) / 4 {
                if self.unfenced[word] != 0 {
                    self.unfenced[word] = 0;
                    self.unfenced_total -= 1;
                }
            }
        }
        Ok(i64::from(bytes))
    }

    /// A tensor copy's box into shared memory (see the module docs); returns its transaction
    /// bytes.
    fn land_box(
        &mut self,
        t: &PendingTma,
        m: &SimTensorMap,
        coords: &[i64; 5],
    ) -> Result<i64, SimError> {
        let rank = m.rank as usize;
        let n = m.box_elements();
        let es = m.elem_bytes as usize;
        let fill = match m.oob_fill {
            OobFill::Zero => [0u8; 8],
            OobFill::Nan => OobFill::nan_bits(es),
        };
        let in_dim = |d: usize, g: i64| m.in_dim(d, g);
        let coord = |d: usize, i: u32| m.coord(coords, d, i);
        let pitch = m.row_pitch() as u32;
        let mut elem = [0u8; 8];
        for (row, (row_ok, row_base)) in (0u32..).zip(m.box_rows(coords)) {
            // The in-bounds run of the row, read as one slice.
            let run: Vec<u32> = if row_ok {
                (0..n[0]).filter(|&i| in_dim(0, coord(0, i))).collect()
            } else {
                Vec::new()
            };
            let src = match (run.first(), run.last()) {
                (Some(&a), Some(&b)) => {
                    let lo = coord(0, a);
                    let len = (coord(0, b) - lo + 1) as usize * es;
                    let at = (row_base + lo as i128 * es as i128) as u64;
                    match self.mem.slice(at, len) {
                        Some(s) => Some((lo, s.to_vec())),
                        None => {
                            let msg = format!(
                                "box row at coordinates {:?} reads global \
                                             [{at:#x}, +{len}): {}",
                                &coords[..rank],
                                self.mem.describe(at)
                            );
                            return Err(self.fault(t.pc, t.warp, t.lane, FaultKind::Tma(msg)));
                        }
                    }
                }
                _ => None,
            };
            for i0 in 0..n[0] {
                let g0 = coord(0, i0);
                match &src {
                    Some((lo, s)) if row_ok && in_dim(0, g0) => {
                        let o = (g0 - lo) as usize * es;
                        elem[..es].copy_from_slice(&s[o..o + es]);
                    }
                    _ => elem[..es].copy_from_slice(&fill[..es]),
                }
                let off = row * pitch + i0 * es as u32;
                let at = m.swizzle.apply(t.dst + off) as usize;
                self.shared[at..at + es].copy_from_slice(&elem[..es]);
                if self.unfenced_total > 0 && self.unfenced[at / 4] != 0 {
                    // The box replaces a generic store still pending there.
                    self.unfenced[at / 4] = 0;
                    self.unfenced_total -= 1;
                }
            }
        }
        Ok(m.box_bytes() as i64)
    }

    /// `cp.reduce.async.bulk.tensor ... .add` (executed at issue: the sum lands before any
    /// later wait could observe it), `cp.async.bulk.commit_group` and
    /// `cp.async.bulk.wait_group{.read}`. The source must hold no unfenced generic store, and
    /// stays protected against generic stores until its group is retired.
    pub(super) fn step_bulk(
        &mut self,
        pc: usize,
        w: usize,
        exec: u32,
        op: &Op,
    ) -> Result<Flow, SimError> {
        for l in lanes(exec) {
            let t = w * 32 + l;
            match op {
                Op::TmaReduceAdd(r) => self.tma_reduce(pc, w, l, r)?,
                Op::BulkReduceAdd(r) => self.bulk_reduce(pc, w, l, r)?,
                Op::BulkCommit => {
                    self.bulk_groups[t] += 1;
                    let g = self.bulk_groups[t];
                    for b in self.bulk_reads.iter_mut().filter(|b| b.thread == t) {
                        b.group.get_or_insert(g);
                    }
                }
                Op::BulkWait { n } => {
                    let newest = self.bulk_groups[t];
                    self.bulk_reads.retain(|b| {
                        b.thread != t || b.group.is_none_or(|g| g + u64::from(*n) > newest)
                    });
                }
                _ => unreachable!("step dispatches only bulk instructions here"),
            }
        }
        Ok(Flow::Advance)
    }

    /// An async-proxy read of shared `[src, src + bytes)` (a `kind` reduction) must find no
    /// generic store there that its thread has not fenced with `fence.proxy.async`.
    fn async_read_fenced(
        &self,
        pc: usize,
        w: usize,
        l: usize,
        src: u64,
        bytes: u64,
        kind: &str,
    ) -> Result<(), SimError> {
        if self.unfenced_total == 0 {
            return Ok(());
        }
        let (lo, hi) = (src as usize / 4, (src + bytes) as usize / 4);
        match (lo..hi).find(|&i| self.unfenced[i] != 0) {
            None => Ok(()),
            Some(word) => Err(self.fault(
                pc,
                w,
                l,
                FaultKind::Proxy(format!(
                    "the {kind} reduction reads shared {:#x}, stored by thread {} (pc {}) \
                     without a fence.proxy.async before it",
                    word * 4,
                    self.unfenced[word] - 1,
                    self.unfenced_pc[word]
                )),
            )),
        }
    }

    /// A bulk f16 reduce-add: `bytes` at shared `src` (16-byte aligned, unfenced stores
    /// refused as for the tensor form) added into global `dst`, rounded to f16 per element.
    fn bulk_reduce(
        &mut self,
        pc: usize,
        w: usize,
        l: usize,
        r: &BulkReduce,
    ) -> Result<(), SimError> {
        let src = self.lane_addr(w, l, &r.src);
        let dst = self.lane_addr(w, l, &r.dst);
        let bytes = u64::from(r.bytes);
        let tma = |msg: String| FaultKind::Tma(msg);
        self.bulk_operands(pc, (w, l), "bulk reduction", (dst, src, bytes))?;
        self.async_read_fenced(pc, w, l, src, bytes, "bulk")?;
        let add: Vec<u8> = self.shared[src as usize..(src + bytes) as usize].to_vec();
        let Some(out) = self.mem.slice_mut(dst, bytes as usize) else {
            let msg = format!(
                "the bulk reduction writes global [{dst:#x}, +{bytes}): {}",
                self.mem.describe(dst)
            );
            return Err(self.fault(pc, w, l, tma(msg)));
        };
        for (o, a) in out.chunks_exact_mut(2).zip(add.chunks_exact(2)) {
            AddElem::F16.add(o, a);
        }
        self.count_bulk(false, dst, bytes);
        self.bulk_reads.push(BulkRead {
            thread: w * 32 + l,
            group: None,
            lo: src as u32,
            hi: (src + bytes) as u32,
            pc,
        });
        Ok(())
    }

    fn tma_reduce(&mut self, pc: usize, w: usize, l: usize, r: &TmaReduce) -> Result<(), SimError> {
        let tma = |msg: String| FaultKind::Tma(msg);
        let coords: Vec<u64> = r
            .tensor
            .coords
            .iter()
            .map(|c| self.gather(w, *c)[l])
            .collect();
        let (m, c, src) = self.tma_box(pc, w, l, &r.tensor, &coords, &r.src, "reduction")?;
        let elem = match (m.elem_bytes, m.f16) {
            (2, true) => AddElem::F16,
            (2, false) => AddElem::Bf16,
            (4, _) => AddElem::F32,
            _ => return Err(self.fault(
                pc,
                w,
                l,
                tma(format!(
                    "a reduction through a map of {}-byte elements (the model adds bf16, f16 and f32)",
                    m.elem_bytes
                )),
            )),
        };
        let eb = elem.bytes();
        let rank = m.rank as usize;
        let bytes = m.shared_bytes();
        self.async_read_fenced(pc, w, l, u64::from(src), bytes, "TMA")?;
        let n = m.box_elements();
        let pitch = m.row_pitch() as u32;
        for (row, (row_ok, row_base)) in (0u32..).zip(m.box_rows(&c)) {
            for i0 in 0..n[0] {
                let g0 = m.coord(&c, 0, i0);
                if !(row_ok && m.in_dim(0, g0)) {
                    continue;
                }
                let at = (row_base + g0 as i128 * i128::from(eb)) as u64;
                let s_at = m.swizzle.apply(src + row * pitch + i0 * eb) as usize;
                let add = &self.shared[s_at..s_at + eb as usize];
                let Some(dst) = self.mem.slice_mut(at, eb as usize) else {
                    let msg = format!(
                        "the reduction at coordinates {:?} writes global [{at:#x}, +{eb}): {}",
                        &c[..rank],
                        self.mem.describe(at)
                    );
                    return Err(self.fault(pc, w, l, tma(msg)));
                };
                elem.add(dst, add);
            }
        }
        self.bulk_reads.push(BulkRead {
            thread: w * 32 + l,
            group: None,
            lo: src,
            hi: src + bytes as u32,
            pc,
        });
        Ok(())
    }

    /// A generic-proxy store of `len` bytes at shared `off` by lane `l` of warp `w`: no live
    /// mbarrier may be overwritten, and the bytes stay "unfenced" for the async proxy until the
    /// thread executes `fence.proxy.async`.
    pub(super) fn generic_shared_store(
        &mut self,
        pc: usize,
        w: usize,
        l: usize,
        off: usize,
        len: usize,
    ) -> Result<(), SimError> {
        if let Some(m) = self
            .mbars
            .iter()
            .find(|m| m.addr as usize + 8 > off && (m.addr as usize) < off + len)
        {
            return Err(self.fault(
                pc,
                w,
                l,
                FaultKind::Mbarrier(format!(
                    "a generic store to shared [{off:#x}, +{len}) overwrites the live mbarrier at \
                     {:#x}",
                    m.addr
                )),
            ));
        }
        if let Some(b) = self
            .bulk_reads
            .iter()
            .find(|b| (b.lo as usize) < off + len && off < b.hi as usize)
        {
            return Err(self.fault(
                pc,
                w,
                l,
                FaultKind::Proxy(format!(
                    "a generic store to shared [{off:#x}, +{len}) overwrites the source of a TMA \
                     reduction (pc {}, thread {}) not yet retired by cp.async.bulk.wait_group.read",
                    b.pc, b.thread
                )),
            ));
        }
        if self.k.uses_async_proxy {
            let t = w * 32 + l;
            for word in off / 4..(off + len).div_ceil(4) {
                if self.unfenced[word] == 0 {
                    self.unfenced_total += 1;
                }
                if self.unfenced[word] != t as u32 + 1 {
                    self.unfenced_list[t].push(word as u32);
                }
                self.unfenced[word] = t as u32 + 1;
                self.unfenced_pc[word] = pc as u32;
            }
        }
        Ok(())
    }

    /// `fence.proxy.async` by thread `t`: its generic stores become visible to the async proxy.
    pub(super) fn proxy_fence(&mut self, t: usize) {
        for word in std::mem::take(&mut self.unfenced_list[t]) {
            let word = word as usize;
            if self.unfenced[word] == t as u32 + 1 {
                self.unfenced[word] = 0;
                self.unfenced_total -= 1;
            }
        }
    }

    /// What a blocked thread waits for.
    pub(super) fn describe_block(&self, t: usize) -> String {
        match self.blocked_on[t] {
            NOT_BLOCKED => "runnable".to_string(),
            BLOCK_MBAR => self.describe_mbar_wait(t),
            BLOCK_WARPGROUP => self.describe_warpgroup_wait(t / 32),
            b => self.describe_barrier(b as usize),
        }
    }

    pub(super) fn describe_mbar_wait(&self, t: usize) -> String {
        let (off, parity) = self.mbar_wait[t];
        let state = match self.mbar_index(off) {
            Some(i) => {
                let m = &self.mbars[i];
                let copies = self.tmas.iter().filter(|x| x.mbar == off).count();
                format!(
                    "phase {} in progress: {} of {} arrivals pending, tx-count {}, {copies} TMA \
                     copies in flight",
                    m.phase, m.pending, m.expected, m.tx
                )
            }
            None => "no longer initialised".to_string(),
        };
        format!("waiting on mbarrier at shared {off:#x} for parity {parity} ({state})")
    }

    /// At the end of a CTA: nothing may still be in flight.
    pub(super) fn check_exit(&mut self) -> Result<(), SimError> {
        if let Some(t) = self.tmas.first() {
            let msg = format!(
                "the CTA finished with {} TMA copies in flight; this one (to shared {:#x}, \
                 mbarrier {:#x}) was never waited for",
                self.tmas.len(),
                t.dst,
                t.mbar
            );
            return Err(self.fault(t.pc, t.warp, t.lane, FaultKind::Tma(msg)));
        }
        if let Some(b) = self.bulk_reads.first() {
            // The CTA's shared memory goes to the next CTA while the TMA unit may still read it.
            let msg = format!(
                "the CTA finished while {} TMA reductions may still read shared memory; this one \
                 (source [{:#x}, {:#x})) was not retired by cp.async.bulk.wait_group.read",
                self.bulk_reads.len(),
                b.lo,
                b.hi
            );
            let (w, l) = (b.thread / 32, b.thread % 32);
            return Err(self.fault(b.pc, w, l, FaultKind::Proxy(msg)));
        }
        self.check_wgmma_exit()?;
        self.check_tcgen05_exit()
    }

    /// Executes the mbarrier operations and the TMA loads that complete on them.
    pub(super) fn step_mbarrier(
        &mut self,
        pcu: usize,
        w: usize,
        group: u32,
        exec: u32,
        op: &Op,
    ) -> Result<Flow, SimError> {
        match op {
            Op::MbarrierInit { space, addr, count } => {
                self.mbarrier_init(pcu, w, exec, *space, addr, *count)?;
            }
            Op::MbarrierArrive {
                space,
                state,
                addr,
                count,
                tx,
            } => self.mbarrier_arrive(pcu, w, exec, *space, *state, addr, *count, *tx)?,
            Op::MbarrierExpectTx {
                space,
                addr,
                tx,
                complete,
            } => self.mbarrier_tx(pcu, w, exec, *space, addr, *tx, *complete)?,
            Op::MbarrierTryWait {
                test,
                space,
                p,
                addr,
                parity,
            } => {
                self.mbarrier_try_wait(pcu, w, group, exec, *test, *space, *p, addr, *parity)?;
                return Ok(Flow::Moved);
            }
            Op::CpAsyncBulkTensor(t) => self.tma_issue(pcu, w, exec, t)?,
            Op::CpAsyncBulk(t) => self.bulk_issue(pcu, w, exec, t)?,
            _ => unreachable!("step dispatches only mbarrier instructions here"),
        }
        Ok(Flow::Advance)
    }
}

/// The element types the reductions add: f16 and bf16 rounded to nearest even, f32 by the
/// host's f32 addition.
#[derive(Clone, Copy)]
enum AddElem {
    F16,
    Bf16,
    F32,
}

impl AddElem {
    fn bytes(self) -> u32 {
        match self {
            AddElem::F16 | AddElem::Bf16 => 2,
            AddElem::F32 => 4,
        }
    }

    /// `dst += add`, both one little-endian element of this type.
    fn add(self, dst: &mut [u8], add: &[u8]) {
        let u16_of = |b: &[u8]| u16::from_le_bytes([b[0], b[1]]);
        let f32_of = |b: &[u8]| f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        match self {
            AddElem::F16 => {
                let sum = half::f16::from_bits(u16_of(dst)).to_f32()
                    + half::f16::from_bits(u16_of(add)).to_f32();
                dst.copy_from_slice(&f16_rne(sum).to_le_bytes());
            }
            AddElem::Bf16 => {
                let sum = bf16_to_f32(u16_of(dst)) + bf16_to_f32(u16_of(add));
                dst.copy_from_slice(&bf16_rne(sum).to_le_bytes());
            }
            AddElem::F32 => dst.copy_from_slice(&(f32_of(dst) + f32_of(add)).to_le_bytes()),
        }
    }
}
