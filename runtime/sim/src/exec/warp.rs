//! The warp collectives `shfl.sync`, `elect.sync`, `vote.sync.ballot`, `redux.sync.min`,
//! `bar.warp.sync`, `stmatrix` and `mma.sync`, and their membermask contract.

use super::{lanes, Cta, Flow, Place};
use crate::error::{FaultKind, MemoryFault, MemoryFaultKind, SimError};
use crate::ir::{Addr, Dst, Op, Reg, ShflMode, Space, Src};
use crate::numeric::{bf16_to_f32, shfl_source};

impl Cta<'_> {
    /// Executes the warp collectives `shfl.sync`, `elect.sync` and `vote.sync.ballot`.
    pub(super) fn step_warp(
        &mut self,
        pcu: usize,
        w: usize,
        group: u32,
        exec: u32,
        op: &Op,
    ) -> Result<Flow, SimError> {
        match op {
            Op::Shfl {
                mode,
                d,
                p,
                a,
                b,
                c,
                mask: mk,
            } => self.shfl(pcu, w, group, exec, *mode, *d, *p, [*a, *b, *c, *mk])?,
            Op::Elect { d, p, mask } => self.elect(pcu, w, group, exec, *d, *p, *mask)?,
            Op::Ballot { d, a, mask } => {
                if exec != 0 {
                    let mk = self.gather(w, *mask);
                    let member = self.check_membermask(pcu, w, group, exec, &mk, "vote.sync")?;
                    let votes = self.pred_mask(w, *a) & member;
                    if let Dst::Reg(r) = d {
                        self.put(w, *r, exec, &[votes as u64; 32], 32);
                    }
                }
            }
            Op::ReduxMin { d, a, mask } => {
                if exec != 0 {
                    let mk = self.gather(w, *mask);
                    let member = self.check_membermask(pcu, w, group, exec, &mk, "redux.sync")?;
                    let v = self.gather(w, *a);
                    let least = lanes(member).map(|l| v[l] as u32).min().unwrap_or(u32::MAX);
                    if let Dst::Reg(r) = d {
                        self.put(w, *r, exec, &[u64::from(least); 32], 32);
                    }
                }
            }
            Op::WarpSync { mask } => {
                if exec != 0 {
                    let mk = self.gather(w, *mask);
                    self.check_membermask(pcu, w, group, exec, &mk, "bar.warp.sync")?;
                }
            }
            Op::Stmatrix { addr, src } => self.stmatrix(pcu, w, group, exec, addr, src)?,
            Op::MmaBf16 { d, a, b, c } => self.mma_bf16(pcu, w, group, exec, d, [a, b, c])?,
            _ => unreachable!("step dispatches only warp instructions here"),
        }
        Ok(Flow::Advance)
    }

    /// The `.sync` contract of a warp instruction with a membermask: the same mask in every
    /// executing lane, every executing lane in it, every lane of it executing.
    fn check_membermask(
        &self,
        pc: usize,
        w: usize,
        group: u32,
        exec: u32,
        mk: &[u64; 32],
        what: &str,
    ) -> Result<u32, SimError> {
        let first = exec.trailing_zeros() as usize;
        let member = mk[first] as u32;
        for l in lanes(exec) {
            if mk[l] as u32 != member {
                return Err(self.fault(
                    pc,
                    w,
                    l,
                    FaultKind::Sync(format!(
                        "{what} membermask {:#010x} differs from lane {first}'s {member:#010x}",
                        mk[l] as u32
                    )),
                ));
            }
            if member >> l & 1 == 0 {
                return Err(self.fault(
                    pc,
                    w,
                    l,
                    FaultKind::Sync(format!(
                        "{what} executed by lane {l}, which is not in membermask {member:#010x}"
                    )),
                ));
            }
        }
        let missing = member & !exec;
        if missing != 0 {
            let l = missing.trailing_zeros() as usize;
            let why = self.absence(w, l, group);
            return Err(self.fault(
                pc,
                w,
                first,
                FaultKind::Sync(format!(
                    "{what} with membermask {member:#010x}: lane {l} {why}"
                )),
            ));
        }
        Ok(member)
    }

    /// `elect.sync d|p, membermask`: the lowest lane of the membermask is the leader.
    #[allow(clippy::too_many_arguments)]
    fn elect(
        &mut self,
        pc: usize,
        w: usize,
        group: u32,
        exec: u32,
        d: Dst,
        p: Option<Reg>,
        mask: Src,
    ) -> Result<(), SimError> {
        if exec == 0 {
            return Ok(());
        }
        let mk = self.gather(w, mask);
        let member = self.check_membermask(pc, w, group, exec, &mk, "elect.sync")?;
        let leader = member.trailing_zeros();
        if let Dst::Reg(r) = d {
            self.put(w, r, exec, &[leader as u64; 32], 32);
        }
        if let Some(r) = p {
            self.put_mask(w, r, exec, 1 << leader);
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn shfl(
        &mut self,
        pc: usize,
        w: usize,
        group: u32,
        exec: u32,
        mode: ShflMode,
        d: Dst,
        p: Option<Reg>,
        srcs: [Src; 4],
    ) -> Result<(), SimError> {
        if exec == 0 {
            return Ok(());
        }
        let [a, b, c, mk] = srcs.map(|s| self.gather(w, s));
        self.check_membermask(pc, w, group, exec, &mk, "shfl.sync")?;
        let mut val = [0u64; 32];
        let mut pv = [0u64; 32];
        for l in lanes(exec) {
            let (j, ok) = shfl_source(mode, l as u32, b[l] as u32, c[l] as u32);
            if exec >> j & 1 == 0 {
                return Err(self.fault(
                    pc,
                    w,
                    l,
                    FaultKind::Sync(format!(
                        "shfl.sync reads lane {j}, which does not take part"
                    )),
                ));
            }
            val[l] = a[j as usize];
            pv[l] = ok as u64;
        }
        if let Dst::Reg(r) = d {
            self.put(w, r, exec, &val, 32);
        }
        if let Some(r) = p {
            self.put(w, r, exec, &pv, 1);
        }
        Ok(())
    }

    /// The `.aligned` contract of a warp instruction without a membermask: `Ok(false)` when no
    /// lane executes it, `Ok(true)` when all 32 do, an error naming the first absent lane
    /// otherwise.
    fn whole_warp(
        &self,
        pc: usize,
        w: usize,
        group: u32,
        exec: u32,
        what: &str,
    ) -> Result<bool, SimError> {
        if exec == 0 {
            return Ok(false);
        }
        if exec != u32::MAX {
            let l = (!exec).trailing_zeros() as usize;
            let why = self.absence(w, l, group);
            return Err(self.fault(
                pc,
                w,
                exec.trailing_zeros() as usize,
                FaultKind::Sync(format!("{what} (.sync.aligned) without lane {l}: it {why}")),
            ));
        }
        Ok(true)
    }

    /// `stmatrix.m8n8.x{1,2,4}`: matrix `i`'s row `r` (16 bytes at the address of lane
    /// `8i + r`) is register `i` of lanes `4r .. 4r + 4`, in lane order. The whole warp
    /// executes it (`.aligned`).
    fn stmatrix(
        &mut self,
        pc: usize,
        w: usize,
        group: u32,
        exec: u32,
        addr: &Addr,
        src: &[Src],
    ) -> Result<(), SimError> {
        if !self.whole_warp(pc, w, group, exec, "stmatrix")? {
            return Ok(());
        }
        let vals: Vec<[u64; 32]> = src.iter().map(|s| self.gather(w, *s)).collect();
        for (i, v) in vals.iter().enumerate() {
            for r in 0..8usize {
                let l = 8 * i + r;
                let at = self.lane_addr(w, l, addr);
                let misaligned = !at.is_multiple_of(16);
                let place = self
                    .locate(Space::Shared, at, 16, "store")
                    .map_err(|f| self.fault(pc, w, l, FaultKind::Memory(f)))?;
                let Place::Shared(off) = place else {
                    unreachable!("a shared-space access locates in shared memory")
                };
                if misaligned {
                    return Err(self.fault(
                        pc,
                        w,
                        l,
                        FaultKind::Memory(MemoryFault {
                            kind: MemoryFaultKind::Misaligned,
                            access: "store",
                            space: Space::Shared,
                            address: at,
                            size: 16,
                            detail: "a stmatrix row address must be 16-byte aligned".to_string(),
                        }),
                    ));
                }
                // Word k of the row comes from lane 4r + k, which is charged with its store.
                for k in 0..4usize {
                    let from = 4 * r + k;
                    self.generic_shared_store(pc, w, from, off + 4 * k, 4)?;
                    let word = (v[from] as u32).to_le_bytes();
                    self.write_bytes(Place::Shared(off + 4 * k), &word);
                }
            }
        }
        Ok(())
    }

    /// `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`: with `g = lane / 4` and
    /// `t = lane % 4`, A's element (row, k) sits in lane `4·(row % 8) + (k % 8) / 2`,
    /// register `row / 8 + 2·(k / 8)`, half `k % 2`; B's (k, col) in lane `4·col + (k % 8) / 2`,
    /// register `k / 8`, half `k % 2`; D's (row, col) in lane `4·(row % 8) + col / 2`, register
    /// `2·(row / 8) + col % 2`. The products are exact in f64 and each sum is rounded to f32
    /// once (the hardware's order of additions is unspecified). The whole warp executes it.
    fn mma_bf16(
        &mut self,
        pc: usize,
        w: usize,
        group: u32,
        exec: u32,
        d: &[Dst],
        [a, b, c]: [&[Src]; 3],
    ) -> Result<(), SimError> {
        if !self.whole_warp(pc, w, group, exec, "mma.sync")? {
            return Ok(());
        }
        let [a, b, c] = [a, b, c].map(|v| v.iter().map(|s| self.gather(w, *s)).collect::<Vec<_>>());
        let half = |word: u64, k: usize| bf16_to_f32((word >> (16 * (k % 2))) as u16) as f64;
        let a_at =
            |row: usize, k: usize| half(a[row / 8 + 2 * (k / 8)][4 * (row % 8) + (k % 8) / 2], k);
        let b_at = |k: usize, col: usize| half(b[k / 8][4 * col + (k % 8) / 2], k);
        let mut out = vec![[0u64; 32]; 4];
        for row in 0..16 {
            for col in 0..8 {
                let (lane, reg) = (4 * (row % 8) + col / 2, 2 * (row / 8) + col % 2);
                let acc = f32::from_bits(c[reg][lane] as u32) as f64;
                let sum: f64 = (0..16).map(|k| a_at(row, k) * b_at(k, col)).sum::<f64>() + acc;
                out[reg][lane] = (sum as f32).to_bits() as u64;
            }
        }
        for (dst, vals) in d.iter().zip(&out) {
            if let Dst::Reg(r) = dst {
                self.put(w, *r, exec, vals, 32);
            }
        }
        Ok(())
    }
}
