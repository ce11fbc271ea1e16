//! `ld`, `st` and `atom` on the global, shared and parameter spaces (through
//! `Cta::locate`), and `createpolicy`.

use super::{lanes, Cta, Flow, Place};
use crate::error::{FaultKind, MemoryFault, MemoryFaultKind, SimError};
use crate::ir::{Dst, Op, Space};
use crate::numeric::{atom_apply, mask, sext};

impl Cta<'_> {
    /// Executes `ld`, `st` and `atom` on the global, shared and parameter spaces, and `createpolicy`.
    pub(super) fn step_memory(
        &mut self,
        pcu: usize,
        w: usize,
        exec: u32,
        op: &Op,
    ) -> Result<Flow, SimError> {
        match op {
            Op::Ld {
                space,
                ty,
                dst,
                dst_bits,
                addr,
            } => {
                let esize = ty.bytes() as usize;
                let n = dst.len();
                let mut buf = [0u8; 64];
                for l in lanes(exec) {
                    let at = self.lane_addr(w, l, addr);
                    let place = self
                        .locate(*space, at, esize * n, "load")
                        .map_err(|f| self.fault(pcu, w, l, FaultKind::Memory(f)))?;
                    self.read_bytes(place, &mut buf[..esize * n]);
                    for (i, dd) in dst.iter().enumerate() {
                        let Dst::Reg(r) = dd else { continue };
                        let mut raw = [0u8; 8];
                        raw[..esize].copy_from_slice(&buf[i * esize..(i + 1) * esize]);
                        let mut v = u64::from_le_bytes(raw);
                        if ty.is_signed() {
                            v = mask(*dst_bits as u32, sext(v, ty.bits()) as u64);
                        }
                        let ri = self.ri(w, *r);
                        self.regs[ri + l] = v;
                    }
                }
            }
            Op::St {
                space,
                ty,
                addr,
                src,
            } => {
                let esize = ty.bytes() as usize;
                let n = src.len();
                let vals: Vec<[u64; 32]> = src.iter().map(|s| self.gather(w, *s)).collect();
                let mut buf = [0u8; 64];
                for l in lanes(exec) {
                    let at = self.lane_addr(w, l, addr);
                    let place = self
                        .locate(*space, at, esize * n, "store")
                        .map_err(|f| self.fault(pcu, w, l, FaultKind::Memory(f)))?;
                    if let Place::Param(_) = place {
                        return Err(self.fault(
                            pcu,
                            w,
                            l,
                            FaultKind::Memory(MemoryFault {
                                kind: MemoryFaultKind::OutOfBounds,
                                access: "store",
                                space: Space::Param,
                                address: at,
                                size: (esize * n) as u32,
                                detail: "kernel parameters are read-only".to_string(),
                            }),
                        ));
                    }
                    for (i, v) in vals.iter().enumerate() {
                        buf[i * esize..(i + 1) * esize]
                            .copy_from_slice(&v[l].to_le_bytes()[..esize]);
                    }
                    if let Place::Shared(off) = place {
                        self.generic_shared_store(pcu, w, l, off, esize * n)?;
                    }
                    self.write_bytes(place, &buf[..esize * n]);
                }
            }
            Op::Atom {
                space,
                op,
                ty,
                d,
                addr,
                b,
                c,
                noftz: _,
            } => {
                let esize = ty.bytes() as usize;
                let n = b.len();
                let bv: Vec<[u64; 32]> = b.iter().map(|s| self.gather(w, *s)).collect();
                let cv = c.map(|c| self.gather(w, c));
                for l in lanes(exec) {
                    let at = self.lane_addr(w, l, addr);
                    let place = self
                        .locate(*space, at, esize * n, "atomic")
                        .map_err(|f| self.fault(pcu, w, l, FaultKind::Memory(f)))?;
                    if let Place::Param(_) = place {
                        return Err(self.fault(
                            pcu,
                            w,
                            l,
                            FaultKind::Sync("atomic on the parameter buffer".to_string()),
                        ));
                    }
                    let mut buf = [0u8; 32];
                    self.read_bytes(place, &mut buf[..esize * n]);
                    for (i, bvals) in bv.iter().enumerate() {
                        let mut raw = [0u8; 8];
                        raw[..esize].copy_from_slice(&buf[i * esize..(i + 1) * esize]);
                        let old = u64::from_le_bytes(raw);
                        let new = atom_apply(*op, *ty, old, bvals[l], cv.map_or(0, |c| c[l]));
                        buf[i * esize..(i + 1) * esize]
                            .copy_from_slice(&new.to_le_bytes()[..esize]);
                        if let Some(Dst::Reg(r)) = d.as_ref().and_then(|d| d.get(i)) {
                            let ri = self.ri(w, *r);
                            self.regs[ri + l] = old;
                            if let Place::Global(g) = place {
                                self.atomic_latency(w, l, g, ri);
                            }
                        }
                    }
                    if let Place::Shared(off) = place {
                        self.generic_shared_store(pcu, w, l, off, esize * n)?;
                    }
                    self.write_bytes(place, &buf[..esize * n]);
                }
            }
            Op::CreatePolicy { d } => {
                self.put(w, *d, exec, &[0x1000_0000_0000_0000; 32], 64);
            }
            _ => unreachable!("step dispatches only memory instructions here"),
        }
        Ok(Flow::Advance)
    }
}
