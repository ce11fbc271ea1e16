//! Warpgroup collectives: `wgmma.*` and `setmaxnreg`.
//!
//! The four warps of a warpgroup (warps `4g .. 4g+4`) meet at the instruction; each must be
//! fully converged with every lane active. Then it runs once for the warpgroup:
//!
//! - `wgmma.mma_async` checks that every warp executed `wgmma.fence` since it last touched
//!   the accumulator or A-fragment registers, decodes the (warpgroup-uniform) descriptors,
//!   snapshots its shared operands (checking the async-proxy ordering of generic stores) and
//!   the register A fragment, and marks its registers in flight. Nothing is computed yet.
//! - `wgmma.commit_group` closes the uncommitted MMAs into a group.
//! - `wgmma.wait_group N` retires the oldest groups until `N` remain: each MMA re-reads its
//!   shared operands (a change since issue is a race and a fault), then computes
//!   `D = A·B (+ D)` and writes the accumulator registers.
//! - `setmaxnreg` sets the warpgroup's per-thread register count; `.inc` waits until the
//!   CTA's pool (Σ over warpgroups of count·128 ≤ [`super::Limits::register_pool`]) has room.
//!
//! # Numerics
//!
//! Each output element of one instruction is [`crate::tensor_core::sm90_block`] of its
//! sixteen bf16/f16 products and the accumulator (none when scale-d is false), with
//! `imm-scale-a/b = −1` negating the A/B inputs: the products are exact, aligned to the
//! largest exponent of the block (accumulator included), cut 25 bits below it toward zero,
//! summed exactly and rounded toward zero to f32; NaN results are `0x7fffffff`. This is the
//! H200's behaviour bit for bit on the probes of `tests/h200_compare.rs` (the evidence is in
//! [`crate::tensor_core`]).
//!
//! # Layouts (128B swizzle only)
//!
//! Descriptor: start address `(d & 0x3fff) << 4`, LBO `((d >> 16) & 0x3fff) << 4`, SBO
//! `((d >> 32) & 0x3fff) << 4`, base offset bits 49–51 (must be 0), layout type bits 62–63
//! (must be 1 = 128B swizzle). Element `(mn, k)` of a 16-bit operand lies at
//! `swizzle128(start + off)` with
//!
//! - K-major (`imm-trans` = 0): `off = (mn % 8)·128 + (mn / 8)·SBO + 2k`;
//! - MN-major (`imm-trans` = 1): `off = 2(mn % 64) + (mn / 64)·LBO + (k % 8)·128 + (k / 8)·SBO`;
//!
//! and `swizzle128(a) = a ^ (((a >> 7) & 7) << 4)` on the absolute shared address. For A,
//! `mn` = m in 0..64; for B, `mn` = n in 0..N.
//!
//! Accumulator: thread `lane` of warp `q` of the warpgroup holds register `i` =
//! element (`16q + lane/4 + 8·((i%4)/2)`, `8·(i/4) + 2·(lane%4) + i%2`). Register A fragment:
//! `.b32` register `j` holds (`16q + lane/4 + 8·(j%2)`, `8·(j/2) + 2·(lane%4) + h`) in its
//! half `h` (low half = lower k).

use std::collections::VecDeque;

use super::{Cta, BLOCK_WARPGROUP, NOT_BLOCKED};
use crate::error::{FaultKind, SimError};
use crate::ir::{Op, PredSrc, Reg, Src, Wgmma, WgmmaA, WgmmaInput, WgmmaSync};
use crate::module::Kernel;
use crate::smem_layout::{read_operand, MatrixDesc};
use crate::tensor_core::{
    all_finite, sm90_block, sm90_block_prepared, MmaInput, Operand, Prepared,
};

/// The state of one warpgroup.
#[derive(Debug, Clone, Default)]
pub(super) struct Warpgroup {
    /// Warps (bit `q` = warp `4g + q`) waiting at the collective at `pc`.
    arrived: u8,
    pc: u32,
    /// Per-thread registers (`setmaxnreg`).
    regs: u32,
    /// A `setmaxnreg.inc` count waiting for the pool.
    pool_wait: Option<u32>,
    uncommitted: Vec<PendingMma>,
    groups: VecDeque<Vec<PendingMma>>,
}

impl Warpgroup {
    pub(super) fn new(regs: u32) -> Self {
        Warpgroup {
            regs,
            ..Warpgroup::default()
        }
    }
}

/// An issued, not yet retired MMA.
#[derive(Debug, Clone)]
struct PendingMma {
    pc: usize,
    /// `None`: A came from registers.
    a_desc: Option<MatrixDesc>,
    b_desc: MatrixDesc,
    /// A at issue, `[m·16 + k]`, raw 16-bit values.
    a: Vec<u16>,
    /// B at issue, `[n·16 + k]`.
    b: Vec<u16>,
    scale_d: bool,
    /// Registers in flight per thread (accumulator and A fragment).
    regs: Vec<Reg>,
}

/// Per-thread registers at launch: `.maxnreg` if declared, else the most the launch allows
/// (`pool / (threads · max(1, .minnctapersm))`, at most 255, rounded down to a multiple of 8).
/// ptxas may allocate fewer; only whether a `setmaxnreg.inc` has to wait depends on it.
pub(super) fn launch_registers(k: &Kernel, threads: u32, pool: u32) -> u32 {
    if let Some(n) = k.maxnreg {
        return n;
    }
    let ctas = k.minnctapersm.unwrap_or(1).max(1);
    let per = pool / (ctas * threads.div_ceil(32) * 32).max(1);
    per.min(255) / 8 * 8
}

/// Element (row, col) of accumulator register `i` of thread `lane` of warp `q`.
fn acc_pos(q: usize, lane: usize, i: usize) -> (usize, usize) {
    (
        16 * q + lane / 4 + 8 * ((i % 4) / 2),
        8 * (i / 4) + 2 * (lane % 4) + i % 2,
    )
}

fn opname(op: &Op) -> &'static str {
    match op {
        Op::Wgmma(_) => "wgmma.mma_async",
        Op::WgmmaSync(WgmmaSync::Fence) => "wgmma.fence",
        Op::WgmmaSync(WgmmaSync::Commit) => "wgmma.commit_group",
        Op::WgmmaSync(WgmmaSync::Wait(_)) => "wgmma.wait_group",
        _ => "setmaxnreg",
    }
}

impl Cta<'_> {
    /// Why lane `l` of warp `w` does not take part in an instruction executed by `group`.
    pub(super) fn absence(&self, w: usize, l: usize, group: u32) -> String {
        if self.present[w] >> l & 1 == 0 {
            "does not exist (partial warp)".to_string()
        } else if self.exited[w] >> l & 1 == 1 {
            "has exited".to_string()
        } else if self.blocked_on[w * 32 + l] != NOT_BLOCKED {
            format!("is {}", self.describe_block(w * 32 + l))
        } else if group >> l & 1 == 1 {
            "has a false guard".to_string()
        } else {
            let at = self.lane_pc(w, l) as usize;
            format!(
                "is not converged (at pc {at}, line {})",
                self.k.source[at].line
            )
        }
    }

    /// A warp arrives at a warpgroup collective; the last of the four runs it.
    pub(super) fn collective(
        &mut self,
        pc: usize,
        w: usize,
        group: u32,
        exec: u32,
    ) -> Result<(), SimError> {
        let k = self.k;
        let op = &k.code[pc].op;
        let name = opname(op);
        let sync = |m: String| FaultKind::Sync(m);
        if exec != u32::MAX {
            let l = (!exec).trailing_zeros() as usize;
            let why = self.absence(w, l, group);
            let msg =
                format!("`{name}` is .sync.aligned over the warpgroup: lane {l} of warp {w} {why}");
            let first = exec.trailing_zeros().min(31) as usize;
            return Err(self.fault(pc, w, first, sync(msg)));
        }
        let g = w / 4;
        if 4 * g + 4 > self.nwarps {
            let msg = format!(
                "`{name}`: warp {w} is in warpgroup {g}, which has only {} warps (a warpgroup \
                 is 4 warps: the block needs a multiple of 128 threads)",
                self.nwarps - 4 * g
            );
            return Err(self.fault(pc, w, 0, sync(msg)));
        }
        if let Some(q) = (4 * g..4 * g + 4).find(|&q| self.exited[q] != 0) {
            let msg = format!(
                "`{name}`: warp {q} of warpgroup {g} has exited lanes {:#010x}, so the \
                 warpgroup can never meet here",
                self.exited[q]
            );
            return Err(self.fault(pc, w, 0, sync(msg)));
        }
        let wg = &mut self.wgs[g];
        if wg.arrived != 0 && wg.pc != pc as u32 {
            let waiting: Vec<usize> = (0..4)
                .filter(|q| wg.arrived >> q & 1 == 1)
                .map(|q| 4 * g + q)
                .collect();
            let msg = format!(
                "warpgroup {g}: warp {w} reaches `{name}` at line {} while warps {waiting:?} wait \
                 at line {} (.aligned: all four warps must execute the same instruction)",
                k.source[pc].line, k.source[wg.pc as usize].line
            );
            return Err(self.fault(pc, w, 0, sync(msg)));
        }
        wg.arrived |= 1 << (w % 4);
        wg.pc = pc as u32;
        self.materialize(w);
        self.blocked_on[w * 32..w * 32 + 32].fill(BLOCK_WARPGROUP);
        self.ready[w] = 0;
        if self.wgs[g].arrived != 0xf {
            return Ok(());
        }
        self.wgs[g].arrived = 0;
        let release = match op {
            Op::Wgmma(m) => {
                self.issue_mma(pc, g, m)?;
                true
            }
            Op::WgmmaSync(s) => {
                self.wgmma_sync(pc, g, *s)?;
                true
            }
            Op::SetMaxNReg { inc, count } => self.setmaxnreg(pc, g, *inc, *count)?,
            _ => unreachable!("only collectives come here"),
        };
        if release {
            self.release_warpgroup(g);
        }
        Ok(())
    }

    /// Moves the four warps of warpgroup `g` past the collective they wait at.
    fn release_warpgroup(&mut self, g: usize) {
        let next = self.wgs[g].pc + 1;
        for w in 4 * g..4 * g + 4 {
            for l in 0..32 {
                self.pc[w * 32 + l] = next;
                self.blocked_on[w * 32 + l] = NOT_BLOCKED;
            }
            self.ready[w] = self.present[w];
            self.uniform[w] = false;
        }
    }

    fn pool_used(&self) -> u64 {
        self.wgs
            .iter()
            .enumerate()
            .filter(|(g, _)| (4 * g..(4 * g + 4).min(self.nwarps)).any(|w| self.present[w] != 0))
            .map(|(_, wg)| wg.regs as u64 * 128)
            .sum()
    }

    /// `setmaxnreg`; returns whether the warpgroup may go on (an `.inc` may have to wait).
    fn setmaxnreg(&mut self, pc: usize, g: usize, inc: bool, count: u32) -> Result<bool, SimError> {
        let cur = self.wgs[g].regs;
        let bad = if !count.is_multiple_of(8) || !(24..=256).contains(&count) {
            Some(format!(
                "register count {count} is not a multiple of 8 in 24..=256"
            ))
        } else if inc && count < cur {
            Some(format!(
                "setmaxnreg.inc to {count}, below the current {cur}"
            ))
        } else if !inc && count > cur {
            Some(format!(
                "setmaxnreg.dec to {count}, above the current {cur}"
            ))
        } else {
            None
        };
        if let Some(msg) = bad {
            return Err(self.fault(pc, 4 * g, 0, FaultKind::Sync(msg)));
        }
        if !inc {
            self.wgs[g].regs = count;
            // Registers went back to the pool: waiting increases may now fit.
            for h in 0..self.wgs.len() {
                if let Some(c) = self.wgs[h].pool_wait {
                    let after = self.pool_used() - self.wgs[h].regs as u64 * 128 + c as u64 * 128;
                    if after <= self.register_pool as u64 {
                        self.wgs[h].regs = c;
                        self.wgs[h].pool_wait = None;
                        self.release_warpgroup(h);
                    }
                }
            }
            return Ok(true);
        }
        let after = self.pool_used() - cur as u64 * 128 + count as u64 * 128;
        if after <= self.register_pool as u64 {
            self.wgs[g].regs = count;
            Ok(true)
        } else {
            self.wgs[g].pool_wait = Some(count);
            Ok(false)
        }
    }

    fn wgmma_sync(&mut self, pc: usize, g: usize, s: WgmmaSync) -> Result<(), SimError> {
        match s {
            WgmmaSync::Fence => {
                for w in 4 * g..4 * g + 4 {
                    self.fence_gen[w] += 1;
                }
            }
            WgmmaSync::Commit => {
                let ops = std::mem::take(&mut self.wgs[g].uncommitted);
                self.wgs[g].groups.push_back(ops);
            }
            WgmmaSync::Wait(n) => {
                while self.wgs[g].groups.len() > n as usize {
                    let group = self.wgs[g].groups.pop_front().expect("non-empty");
                    for m in group {
                        self.retire_mma(pc, g, m)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// The value of `s`, which must be the same in all 128 threads of warpgroup `g`.
    fn uniform_b64(&self, pc: usize, g: usize, s: Src, what: &str) -> Result<u64, SimError> {
        let first = self.gather(4 * g, s)[0];
        for w in 4 * g..4 * g + 4 {
            let v = self.gather(w, s);
            if let Some(l) = (0..32).find(|&l| v[l] != first) {
                let msg = format!(
                    "the {what} differs across the warpgroup: {:#x} in warp {w} lane {l}, {first:#x} \
                     in warp {} lane 0",
                    v[l],
                    4 * g
                );
                return Err(self.fault(pc, w, l, FaultKind::Wgmma(msg)));
            }
        }
        Ok(first)
    }

    fn uniform_pred(&self, pc: usize, g: usize, p: PredSrc) -> Result<bool, SimError> {
        let first = self.pred_mask(4 * g, p) & 1 == 1;
        for w in 4 * g..4 * g + 4 {
            let m = self.pred_mask(w, p);
            let want = if first { u32::MAX } else { 0 };
            if m != want {
                let l = (m ^ want).trailing_zeros() as usize;
                let msg = format!(
                    "scale-d differs across the warpgroup (warp {w} lane {l} has {})",
                    !first
                );
                return Err(self.fault(pc, w, l, FaultKind::Wgmma(msg)));
            }
        }
        Ok(first)
    }

    fn matrix_desc(
        &self,
        pc: usize,
        g: usize,
        raw: u64,
        which: &str,
    ) -> Result<MatrixDesc, SimError> {
        let layout = raw >> 62;
        let base_offset = (raw >> 49) & 7;
        let msg = if layout != 1 {
            Some(format!(
                "{which} descriptor {raw:#018x}: layout type {layout} is not modelled (only 1 = \
                 128B swizzle)"
            ))
        } else if base_offset != 0 {
            Some(format!(
                "{which} descriptor {raw:#018x}: base offset {base_offset} is not modelled \
                 (swizzle patterns must be 1024-byte aligned)"
            ))
        } else {
            None
        };
        if let Some(m) = msg {
            return Err(self.fault(pc, 4 * g, 0, FaultKind::Wgmma(m)));
        }
        Ok(MatrixDesc::from_raw(raw))
    }

    /// Reads a `rows × 16` operand (`[row·16 + k]`) through its descriptor; with
    /// `check_proxy`, unfenced generic stores under it are faults.
    #[allow(clippy::too_many_arguments)]
    fn read_operand(
        &self,
        pc: usize,
        g: usize,
        d: &MatrixDesc,
        rows: u32,
        mn_major: bool,
        which: &str,
        check_proxy: bool,
    ) -> Result<Vec<u16>, SimError> {
        let unfenced = self.unfenced_stores(check_proxy);
        read_operand(
            &self.shared,
            d,
            rows,
            mn_major,
            which,
            "wgmma.mma_async",
            unfenced,
        )
        .map_err(|e| self.fault(pc, 4 * g, 0, e.kind(FaultKind::Wgmma)))
    }

    fn issue_mma(&mut self, pc: usize, g: usize, op: &Wgmma) -> Result<(), SimError> {
        let nregs = self.nregs;
        let b_raw = self.uniform_b64(pc, g, op.b, "B descriptor")?;
        let a_raw = match &op.a {
            WgmmaA::Desc(s) => Some(self.uniform_b64(pc, g, *s, "A descriptor")?),
            WgmmaA::Regs(_) => None,
        };
        let scale_d = self.uniform_pred(pc, g, op.scale_d)?;
        let mut regs: Vec<Reg> = op.d.clone();
        if let WgmmaA::Regs(r) = &op.a {
            regs.extend(r.iter().filter_map(|s| match s {
                Src::Reg(r) => Some(*r),
                _ => None,
            }));
        }
        for w in 4 * g..4 * g + 4 {
            if self.fence_gen[w] == 1 {
                let msg =
                    format!("warp {w} issues wgmma.mma_async without a wgmma.fence before it");
                return Err(self.fault(pc, w, 0, FaultKind::Wgmma(msg)));
            }
            if let Some(&r) = regs
                .iter()
                .find(|&&r| self.touched[w * nregs + r as usize] == self.fence_gen[w])
            {
                let msg = format!(
                    "register `{}` of warp {w} was accessed after the warp's last wgmma.fence; a \
                     wgmma.fence must separate register accesses from a wgmma.mma_async that \
                     uses the registers",
                    self.k.reg_names[r as usize]
                );
                return Err(self.fault(pc, w, 0, FaultKind::Wgmma(msg)));
            }
        }
        let b_desc = self.matrix_desc(pc, g, b_raw, "B")?;
        let b = self.read_operand(pc, g, &b_desc, op.n, op.trans_b, "B", true)?;
        let (a_desc, a) = match (&op.a, a_raw) {
            (_, Some(raw)) => {
                let d = self.matrix_desc(pc, g, raw, "A")?;
                let a = self.read_operand(pc, g, &d, 64, op.trans_a, "A", true)?;
                (Some(d), a)
            }
            (WgmmaA::Regs(srcs), None) => {
                let mut a = vec![0u16; 64 * 16];
                for q in 0..4 {
                    let vals: Vec<[u64; 32]> =
                        srcs.iter().map(|s| self.gather(4 * g + q, *s)).collect();
                    for lane in 0..32 {
                        for (j, v) in vals.iter().enumerate() {
                            for h in 0..2 {
                                let m = 16 * q + lane / 4 + 8 * (j % 2);
                                let k = 8 * (j / 2) + 2 * (lane % 4) + h;
                                a[m * 16 + k] = (v[lane] >> (16 * h)) as u16;
                            }
                        }
                    }
                }
                (None, a)
            }
            (WgmmaA::Desc(_), None) => unreachable!("descriptor read above"),
        };
        for w in 4 * g..4 * g + 4 {
            for &r in &regs {
                self.inflight[w * nregs + r as usize] += 1;
            }
            self.inflight_ops[w] += 1;
        }
        self.wgs[g].uncommitted.push(PendingMma {
            pc,
            a_desc,
            b_desc,
            a,
            b,
            scale_d,
            regs,
        });
        Ok(())
    }

    /// Computes a retired MMA at `wgmma.wait_group` (`pc`) and writes its accumulator.
    fn retire_mma(&mut self, pc: usize, g: usize, m: PendingMma) -> Result<(), SimError> {
        let k = self.k;
        let Op::Wgmma(op) = &k.code[m.pc].op else {
            unreachable!("pending MMAs come from wgmma instructions")
        };
        let issued = k.source[m.pc].line;
        // The operands must not have changed since issue: the hardware reads them at some
        // point in between.
        let mut checks = vec![("B", m.b_desc, op.n, op.trans_b, &m.b)];
        if let Some(d) = m.a_desc {
            checks.push(("A", d, 64, op.trans_a, &m.a));
        }
        for (which, d, rows, mn_major, old) in checks {
            let now = self.read_operand(pc, g, &d, rows, mn_major, which, false)?;
            if let Some(i) = (0..now.len()).find(|&i| now[i] != old[i]) {
                let (mn, kk) = (i / 16, i % 16);
                let msg = format!(
                    "shared memory under {which} of the wgmma.mma_async at line {issued} changed \
                     before the wgmma.wait_group that retires it: element ({mn}, k {kk}) at shared \
                     {:#x} was {:#06x} at issue and is {:#06x} now (a store or TMA raced the MMA)",
                    d.addr(mn as u32, kk as u32, mn_major),
                    old[i],
                    now[i]
                );
                return Err(self.fault(pc, 4 * g, 0, FaultKind::Wgmma(msg)));
            }
        }
        let n = op.n as usize;
        let input = match op.input {
            WgmmaInput::Bf16 => MmaInput::Bf16,
            WgmmaInput::F16 => MmaInput::F16,
        };
        let a: Vec<Operand> = m.a.iter().map(|&x| input.decode(x, op.negate_a)).collect();
        let b: Vec<Operand> = m.b.iter().map(|&x| input.decode(x, op.negate_b)).collect();
        let mut d = vec![0u32; 64 * n];
        let nregs = self.nregs;
        if m.scale_d {
            for q in 0..4 {
                let w = 4 * g + q;
                for (i, &r) in op.d.iter().enumerate() {
                    let base = (w * nregs + r as usize) * 32;
                    for lane in 0..32 {
                        let (row, col) = acc_pos(q, lane, i);
                        d[row * n + col] = self.regs[base + lane] as u32;
                    }
                }
            }
        }
        // Special values are rare: take the general path only when an input has one.
        if all_finite(&a) && all_finite(&b) {
            let (pa, pb) = (Prepared::new(input, &a), Prepared::new(input, &b));
            for (row, out) in d.chunks_exact_mut(n).enumerate() {
                let (av, ae) = (&pa.value[row * 16..][..16], &pa.exp[row * 16..][..16]);
                for (col, x) in out.iter_mut().enumerate() {
                    let (bv, be) = (&pb.value[col * 16..][..16], &pb.exp[col * 16..][..16]);
                    *x = sm90_block_prepared(input, av, ae, bv, be, m.scale_d.then_some(*x));
                }
            }
        } else {
            for (row, out) in d.chunks_exact_mut(n).enumerate() {
                let a = &a[row * 16..row * 16 + 16];
                for (col, x) in out.iter_mut().enumerate() {
                    let c = m.scale_d.then_some(*x);
                    *x = sm90_block(input, a, &b[col * 16..col * 16 + 16], c);
                }
            }
        }
        for q in 0..4 {
            let w = 4 * g + q;
            for (i, &r) in op.d.iter().enumerate() {
                let base = (w * nregs + r as usize) * 32;
                for lane in 0..32 {
                    let (row, col) = acc_pos(q, lane, i);
                    self.regs[base + lane] = d[row * n + col] as u64;
                }
            }
            for &r in &m.regs {
                self.inflight[w * nregs + r as usize] -= 1;
            }
            self.inflight_ops[w] -= 1;
        }
        Ok(())
    }

    /// Register hazards of a non-wgmma instruction at `pc` executed by warp `w`: no register
    /// of an MMA in flight may be touched, and the access is remembered for the fence rule.
    pub(super) fn track_registers(
        &mut self,
        pc: usize,
        w: usize,
        exec: u32,
    ) -> Result<(), SimError> {
        let k = self.k;
        let regs = &k.inst_regs[pc];
        let base = w * self.nregs;
        if self.inflight_ops[w] > 0 {
            if let Some(&r) = regs.iter().find(|&&r| self.inflight[base + r as usize] > 0) {
                let wg = &self.wgs[w / 4];
                let issued = wg
                    .uncommitted
                    .iter()
                    .chain(wg.groups.iter().flatten())
                    .find(|m| m.regs.contains(&r))
                    .map_or(0, |m| k.source[m.pc].line);
                let msg = format!(
                    "register `{}` is an operand of the wgmma.mma_async at line {issued}, still in \
                     flight: retire it with wgmma.wait_group before touching the register",
                    k.reg_names[r as usize]
                );
                let l = exec.trailing_zeros() as usize;
                return Err(self.fault(pc, w, l, FaultKind::Wgmma(msg)));
            }
        }
        let gen = self.fence_gen[w];
        for &r in regs.iter() {
            self.touched[base + r as usize] = gen;
        }
        Ok(())
    }

    pub(super) fn describe_warpgroup_wait(&self, w: usize) -> String {
        let g = w / 4;
        let wg = &self.wgs[g];
        if let Some(c) = wg.pool_wait {
            return format!(
                "setmaxnreg.inc to {c} waits for registers (warpgroup {g} holds {}; the pool has \
                 {} of {} in use)",
                wg.regs,
                self.pool_used(),
                self.register_pool
            );
        }
        let arrived: Vec<usize> = (0..4)
            .filter(|q| wg.arrived >> q & 1 == 1)
            .map(|q| 4 * g + q)
            .collect();
        format!(
            "waiting for warpgroup {g} at line {} (warps {arrived:?} arrived)",
            self.k.source[wg.pc as usize].line
        )
    }

    pub(super) fn check_wgmma_exit(&self) -> Result<(), SimError> {
        for (g, wg) in self.wgs.iter().enumerate() {
            let pending: Vec<&PendingMma> = wg
                .uncommitted
                .iter()
                .chain(wg.groups.iter().flatten())
                .collect();
            if let Some(m) = pending.first() {
                let msg = format!(
                    "warpgroup {g} finished with {} wgmma.mma_async in flight (this one was \
                     never retired by a wgmma.wait_group)",
                    pending.len()
                );
                return Err(self.fault(m.pc, 4 * g, 0, FaultKind::Wgmma(msg)));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accumulator_positions_cover_the_tile_once() {
        for n in [8usize, 64, 128, 256] {
            let mut seen = vec![0u8; 64 * n];
            for q in 0..4 {
                for lane in 0..32 {
                    for i in 0..n / 2 {
                        let (r, c) = acc_pos(q, lane, i);
                        seen[r * n + c] += 1;
                    }
                }
            }
            assert!(seen.iter().all(|&x| x == 1), "n = {n}");
        }
    }
}
