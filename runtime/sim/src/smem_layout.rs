//! Shared-memory layouts as the async units see them: the swizzle a TMA box is written with,
//! the matrix descriptor an MMA reads its operands through, and the one reader of such an
//! operand.
//!
//! Below the TMA model ([`crate::tensor_map`]) and both MMA models (wgmma on sm_90a,
//! tcgen05.mma on sm_100a), which share these rules and must not disagree on them.

use crate::error::FaultKind;
use crate::ir::SourceLoc;

/// Shared-memory swizzle of a TMA box (`CUtensorMapSwizzle`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Swizzle {
    /// `CU_TENSOR_MAP_SWIZZLE_NONE`
    None,
    /// `CU_TENSOR_MAP_SWIZZLE_32B`
    B32,
    /// `CU_TENSOR_MAP_SWIZZLE_64B`
    B64,
    /// `CU_TENSOR_MAP_SWIZZLE_128B`
    B128,
}

impl Swizzle {
    /// The swizzle span in bytes (0 for none).
    pub fn span(self) -> usize {
        match self {
            Swizzle::None => 0,
            Swizzle::B32 => 32,
            Swizzle::B64 => 64,
            Swizzle::B128 => 128,
        }
    }

    /// The swizzled shared-memory address of byte address `addr`: the 16-byte chunk index
    /// (address bits 4..) is XORed with the 128-byte row index (bits 7..), over 1, 2 or 3
    /// bits for 32B, 64B and 128B (CUTLASS `Swizzle<B,4,3>` on byte addresses). It is a
    /// function of the absolute shared address, not of the offset inside the box.
    pub fn apply(self, addr: u32) -> u32 {
        let bits = match self {
            Swizzle::None => return addr,
            Swizzle::B32 => 1,
            Swizzle::B64 => 2,
            Swizzle::B128 => 3,
        };
        addr ^ (((addr >> 7) & ((1 << bits) - 1)) << 4)
    }

    /// The `CUtensorMapSwizzle` value.
    pub(crate) fn code(self) -> u8 {
        match self {
            Swizzle::None => 0,
            Swizzle::B32 => 1,
            Swizzle::B64 => 2,
            Swizzle::B128 => 3,
        }
    }

    /// The swizzle of a `CUtensorMapSwizzle` value, if it is one.
    pub(crate) fn from_code(c: u8) -> Option<Swizzle> {
        Some(match c {
            0 => Swizzle::None,
            1 => Swizzle::B32,
            2 => Swizzle::B64,
            3 => Swizzle::B128,
            _ => return None,
        })
    }
}

/// A decoded shared-memory matrix descriptor: the fields wgmma and tcgen05.mma share. Each
/// family validates its own remaining bits before building one.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MatrixDesc {
    pub(crate) start: u32,
    pub(crate) lbo: u32,
    pub(crate) sbo: u32,
}

impl MatrixDesc {
    /// Start address, leading and stride byte offsets: bits 0-13, 16-29 and 32-45 of `raw`, in
    /// units of 16 bytes (the same place in the sm_90a and sm_100a descriptors).
    pub(crate) fn from_raw(raw: u64) -> MatrixDesc {
        MatrixDesc {
            start: ((raw & 0x3fff) << 4) as u32,
            lbo: (((raw >> 16) & 0x3fff) << 4) as u32,
            sbo: (((raw >> 32) & 0x3fff) << 4) as u32,
        }
    }

    /// The shared address of 16-bit element `(mn, k)` (128B swizzle, the only layout
    /// modelled).
    pub(crate) fn addr(&self, mn: u32, k: u32, mn_major: bool) -> u32 {
        let off = if mn_major {
            2 * (mn % 64) + (mn / 64) * self.lbo + (k % 8) * 128 + (k / 8) * self.sbo
        } else {
            (mn % 8) * 128 + (mn / 8) * self.sbo + 2 * k
        };
        Swizzle::B128.apply(self.start.wrapping_add(off))
    }
}

/// Generic-proxy stores to shared memory not yet followed by their thread's
/// `fence.proxy.async`, as the executor tracks them; an MMA must not read them.
pub(crate) struct UnfencedStores<'a> {
    /// Per 4-byte word: 1 + the storing thread, or 0.
    pub(crate) thread: &'a [u32],
    /// Per 4-byte word: the PC of that store.
    pub(crate) pc: &'a [u32],
    /// The kernel's source locations, by PC.
    pub(crate) source: &'a [SourceLoc],
}

/// Why an operand could not be read.
#[derive(Debug)]
pub(crate) enum OperandFault {
    /// An element lies outside the CTA's shared memory.
    Outside(String),
    /// An element was stored through the generic proxy with no fence since.
    Unfenced(String),
}

impl OperandFault {
    /// The fault: an unfenced element is a proxy fault, an element outside is the MMA
    /// family's own kind, `outside`.
    pub(crate) fn kind(self, outside: fn(String) -> FaultKind) -> FaultKind {
        match self {
            OperandFault::Outside(m) => outside(m),
            OperandFault::Unfenced(m) => FaultKind::Proxy(m),
        }
    }
}

/// Reads a `rows × 16` operand of 16-bit elements (`[row·16 + k]`) through `d` from `shared`.
/// `which` names the operand (`A`/`B`) and `reader` the instruction in the messages; with
/// `unfenced`, an element covered by an unfenced generic store is a fault.
pub(crate) fn read_operand(
    shared: &[u8],
    d: &MatrixDesc,
    rows: u32,
    mn_major: bool,
    which: &str,
    reader: &str,
    unfenced: Option<UnfencedStores<'_>>,
) -> Result<Vec<u16>, OperandFault> {
    let mut out = Vec::with_capacity(rows as usize * 16);
    let len = shared.len();
    for mn in 0..rows {
        for k in 0..16 {
            let at = d.addr(mn, k, mn_major) as usize;
            if at + 2 > len {
                return Err(OperandFault::Outside(format!(
                    "{which} element ({mn}, k {k}) at shared {at:#x} is outside the CTA's {len} \
                     bytes of shared memory"
                )));
            }
            if let Some(u) = &unfenced {
                if u.thread[at / 4] != 0 {
                    let t = u.thread[at / 4] as usize - 1;
                    let line = u.source[u.pc[at / 4] as usize].line;
                    return Err(OperandFault::Unfenced(format!(
                        "the {reader} reads {which} at shared {at:#x}, stored by thread {t} at \
                         line {line} with no fence.proxy.async by that thread since"
                    )));
                }
            }
            out.push(u16::from_le_bytes([shared[at], shared[at + 1]]));
        }
    }
    Ok(out)
}
