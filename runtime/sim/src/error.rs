//! Errors of parsing, launching and running.

use std::fmt;

use crate::ir::Space;

/// Why PTX text was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// Malformed text.
    #[error("line {line}: {message}")]
    Syntax {
        /// 1-based line.
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// A well-formed instruction the simulator does not model.
    #[error("unsupported instruction `{opcode}` at line {line} ({reason}): `{text}`")]
    Unsupported {
        /// The opcode with all its modifiers, e.g. `wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16`.
        opcode: String,
        /// 1-based line.
        line: usize,
        /// The statement.
        text: String,
        /// Which part is not modelled.
        reason: String,
    },
    /// A directive or declaration the simulator does not model.
    #[error("unsupported directive `{directive}` at line {line}")]
    UnsupportedDirective {
        /// 1-based line.
        line: usize,
        /// The directive.
        directive: String,
    },
}

/// Where a fault happened: kernel, instruction, CTA and thread.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    /// Kernel name.
    pub kernel: String,
    /// Instruction index in the kernel (the simulator's PC).
    pub pc: usize,
    /// 1-based line of the instruction in the PTX text.
    pub line: usize,
    /// The instruction's text.
    pub instruction: String,
    /// `%ctaid`.
    pub cta: [u32; 3],
    /// `%tid`.
    pub thread: [u32; 3],
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [cx, cy, cz] = self.cta;
        let [tx, ty, tz] = self.thread;
        write!(
            f,
            "kernel `{}`, pc {} (line {}: `{}`), CTA ({cx},{cy},{cz}), thread ({tx},{ty},{tz})",
            self.kernel, self.pc, self.line, self.instruction
        )
    }
}

/// The kind of a bad memory access.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryFaultKind {
    /// The address is in no allocation (global) or past the end of the space (shared, param).
    OutOfBounds,
    /// The access is not aligned to its size.
    Misaligned,
}

/// A bad memory access.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryFault {
    /// What went wrong.
    pub kind: MemoryFaultKind,
    /// `load`, `store` or `atomic`.
    pub access: &'static str,
    /// The state space.
    pub space: Space,
    /// The address.
    pub address: u64,
    /// Bytes accessed.
    pub size: u32,
    /// The nearest allocation or the space's bounds, for the reader.
    pub detail: String,
}

impl fmt::Display for MemoryFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.kind {
            MemoryFaultKind::OutOfBounds => "out-of-bounds",
            MemoryFaultKind::Misaligned => "misaligned",
        };
        write!(
            f,
            "{what} {} {} of {} bytes at {:#x} ({})",
            self.space, self.access, self.size, self.address, self.detail
        )
    }
}

/// What a faulting thread did wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FaultKind {
    /// A bad memory access.
    Memory(MemoryFault),
    /// Integer `div`/`rem` by zero.
    DivisionByZero,
    /// A warp-synchronous instruction (`shfl.sync`, `bar.sync`, a warpgroup-collective
    /// `wgmma` or `setmaxnreg`) whose participants were not converged, or another violation
    /// of its contract.
    Sync(String),
    /// Misuse of an mbarrier: not initialised, more arrivals or more transaction bytes in a
    /// phase than it expects, a store over a live mbarrier.
    Mbarrier(String),
    /// A bad TMA copy: the tensor map, coordinates, destination, or a copy still in flight
    /// when the CTA exits.
    Tma(String),
    /// A bad `wgmma`: descriptor, layout, a register accessed while an MMA that uses it is in
    /// flight, a missing `wgmma.fence`, shared operands changing before `wgmma.wait_group`.
    Wgmma(String),
    /// A bad `tcgen05` operation: TMEM allocation or access outside the allocation or the
    /// warp's lane quadrant, descriptors, a `tcgen05.ld` of cells an MMA in flight writes, a
    /// register of a `tcgen05.ld` read before `tcgen05.wait::ld`.
    Tcgen05(String),
    /// A thread executed `trap`.
    Trap,
    /// Shared memory written through the generic proxy (`st.shared`) and read through the
    /// async proxy (wgmma, TMA) without a `fence.proxy.async` by the writer in between.
    Proxy(String),
}

impl fmt::Display for FaultKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FaultKind::Memory(m) => m.fmt(f),
            FaultKind::DivisionByZero => f.write_str("integer division by zero"),
            FaultKind::Sync(s) => f.write_str(s),
            FaultKind::Trap => f.write_str("trap executed"),
            FaultKind::Mbarrier(s) => write!(f, "mbarrier: {s}"),
            FaultKind::Tma(s) => write!(f, "TMA: {s}"),
            FaultKind::Wgmma(s) => write!(f, "wgmma: {s}"),
            FaultKind::Tcgen05(s) => write!(f, "tcgen05: {s}"),
            FaultKind::Proxy(s) => write!(f, "async proxy: {s}"),
        }
    }
}

/// One group of lanes of a warp that cannot proceed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StuckLanes {
    /// Lanes (bit `i` = lane `i`).
    pub lanes: u32,
    /// Instruction index they are at (the barrier they wait on for blocked lanes).
    pub pc: usize,
    /// Its line.
    pub line: usize,
    /// Its text.
    pub instruction: String,
    /// What they wait for, e.g. `barrier 0 (32 of 64 threads arrived)`, or `running`.
    pub waiting_for: String,
}

/// The state of one warp when the simulation had to stop.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WarpState {
    /// Warp index in the CTA.
    pub warp: u32,
    /// Groups of live lanes by PC; exited lanes are left out.
    pub groups: Vec<StuckLanes>,
}

/// All live threads of a CTA are blocked, or the step budget ran out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stall {
    /// Kernel name.
    pub kernel: String,
    /// `%ctaid`.
    pub cta: [u32; 3],
    /// The warps with live lanes.
    pub warps: Vec<WarpState>,
}

fn lane_ranges(mask: u32) -> String {
    let mut out = Vec::new();
    let mut i = 0;
    while i < 32 {
        if mask >> i & 1 == 1 {
            let s = i;
            while i < 32 && mask >> i & 1 == 1 {
                i += 1;
            }
            out.push(if i - 1 == s {
                format!("{s}")
            } else {
                format!("{s}-{}", i - 1)
            });
        } else {
            i += 1;
        }
    }
    out.join(",")
}

impl fmt::Display for Stall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [x, y, z] = self.cta;
        write!(f, "kernel `{}`, CTA ({x},{y},{z})", self.kernel)?;
        for w in &self.warps {
            for g in &w.groups {
                write!(
                    f,
                    "\n  warp {} lanes {}: pc {} (line {}: `{}`), {}",
                    w.warp,
                    lane_ranges(g.lanes),
                    g.pc,
                    g.line,
                    g.instruction,
                    g.waiting_for
                )?;
            }
        }
        Ok(())
    }
}

/// Any failure of the simulator.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SimError {
    /// The PTX text was rejected.
    #[error(transparent)]
    Parse(#[from] ParseError),
    /// The launch itself is invalid (arguments, block size, shared memory, unknown kernel).
    #[error("launch of `{kernel}`: {message}")]
    Launch {
        /// Kernel name.
        kernel: String,
        /// What is wrong.
        message: String,
    },
    /// A thread faulted.
    #[error("{kind} at {at}")]
    Fault {
        /// Where.
        at: Box<Location>,
        /// What.
        kind: FaultKind,
    },
    /// Every live thread of a CTA is blocked.
    #[error("deadlock: every live thread is blocked in {0}")]
    Deadlock(Box<Stall>),
    /// A CTA ran past the step budget (an infinite loop, or a budget too small).
    #[error("step limit of {limit} warp instructions exceeded in {stall}")]
    StepLimit {
        /// The budget per CTA.
        limit: u64,
        /// Where the warps were.
        stall: Box<Stall>,
    },
    /// A host-side copy touched memory outside an allocation.
    #[error("host access: {0}")]
    Host(String),
}
