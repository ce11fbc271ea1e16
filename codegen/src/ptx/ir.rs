//! The instruction IR: what the builder records and the printer prints, one line per
//! statement. Nothing here is written by kernel descriptions directly.

use super::types::RegName;
use crate::target::{PtxVersion, Target};
use std::fmt;

/// An instruction operand.
#[derive(Debug, Clone, PartialEq)]
pub enum Operand {
    /// A virtual register.
    Reg(RegName),
    /// A special register such as `%tid.x`.
    Special(&'static str),
    /// A signed integer immediate.
    Int(i64),
    /// An unsigned integer immediate printed in hex (masks, policies).
    Hex(u64),
    /// An f32 immediate, printed bit-exactly as `0fXXXXXXXX`.
    F32(f32),
    /// A memory operand `[base+offset]`.
    Addr(AddrBase, i64),
    /// A brace-enclosed register vector `{%a, %b}`.
    Vector(Vec<RegName>),
    /// A branch target.
    Label(Label),
    /// A module symbol (parameter or shared variable) used as a value.
    Symbol(String),
    /// A tensor-map operand with its coordinates: `[%rd, {%s0, %s1, %s2}]`.
    TensorCoords(RegName, Vec<RegName>),
}

/// Base of a memory operand.
#[derive(Debug, Clone, PartialEq)]
pub enum AddrBase {
    /// A register holding the address.
    Reg(RegName),
    /// A symbol (a `.param` or `.shared` variable).
    Symbol(String),
}

/// A branch target; printed as `$L_<n>_<hint>`, numbered in creation order.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Label {
    pub(crate) idx: u32,
    pub(crate) hint: &'static str,
}

impl fmt::Display for Label {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "$L_{}_{}", self.idx, self.hint)
    }
}

/// One PTX instruction.
#[derive(Debug, Clone, PartialEq)]
pub struct Inst {
    /// `@p` / `@!p` guard.
    pub guard: Option<(RegName, bool)>,
    /// Full opcode with modifiers, e.g. `ld.global.nc.v4.b32`.
    pub opcode: String,
    /// Operands in PTX order.
    pub operands: Vec<Operand>,
    /// The PTX ISA version this instruction needs.
    pub min_version: PtxVersion,
}

impl Inst {
    /// The opcode root (`ld` for `ld.global.nc.v4.b32`), for histograms.
    pub fn root(&self) -> &str {
        self.opcode.split('.').next().unwrap_or(&self.opcode)
    }
}

/// A body statement.
#[derive(Debug, Clone, PartialEq)]
pub enum Stmt {
    /// An instruction.
    Inst(Inst),
    /// A label definition.
    Label(Label),
    /// A comment line (section markers that help a reviewer).
    Comment(String),
}

/// Host-side meaning of a kernel parameter; drives the PTX `.param` declaration and the
/// generated Rust launch binding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamKind {
    /// A device pointer to elements of `elem`; `mutable` if the kernel writes through it.
    Ptr {
        /// Element type on the host.
        elem: HostElem,
        /// Whether the kernel writes through the pointer.
        mutable: bool,
    },
    /// A 32-bit unsigned scalar.
    U32,
    /// A 32-bit signed scalar.
    I32,
    /// A CUtensorMap passed by value: `.param .align 64 .b8 name[128]`.
    TensorMap,
}

/// Element types of pointer parameters, as the host sees them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostElem {
    /// `half::bf16`.
    Bf16,
    /// `u16` (16-bit pools that are reinterpreted on the device).
    U16,
    /// `f32`.
    F32,
    /// `i32`.
    I32,
    /// `u32`.
    U32,
}

impl HostElem {
    /// Size of one element in bytes.
    pub fn bytes(self) -> u32 {
        match self {
            HostElem::Bf16 | HostElem::U16 => 2,
            HostElem::F32 | HostElem::I32 | HostElem::U32 => 4,
        }
    }

    /// Rust type name for generated bindings.
    pub fn rust_name(self) -> &'static str {
        match self {
            HostElem::Bf16 => "bf16",
            HostElem::U16 => "u16",
            HostElem::F32 => "f32",
            HostElem::I32 => "i32",
            HostElem::U32 => "u32",
        }
    }
}

/// A kernel parameter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Param {
    /// Name in PTX and in the binding.
    pub name: String,
    /// What it is.
    pub kind: ParamKind,
}

impl Param {
    /// The `.param` declaration.
    pub fn decl(&self) -> String {
        match self.kind {
            ParamKind::Ptr { .. } => format!(".param .u64 .ptr .align 16 {}", self.name),
            ParamKind::U32 => format!(".param .u32 {}", self.name),
            ParamKind::I32 => format!(".param .s32 {}", self.name),
            ParamKind::TensorMap => format!(".param .align 64 .b8 {}[128]", self.name),
        }
    }
}

/// A `.shared` declaration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedDecl {
    /// Symbol name.
    pub name: String,
    /// Size in bytes (0 for the dynamic `.extern` array).
    pub bytes: u32,
    /// Alignment in bytes.
    pub align: u32,
    /// Whether this is the dynamic (`.extern`, unsized) array.
    pub dynamic: bool,
}

impl SharedDecl {
    /// The declaration line, without the trailing semicolon.
    pub fn decl(&self) -> String {
        if self.dynamic {
            format!(".extern .shared .align {} .b8 {}[]", self.align, self.name)
        } else {
            format!(
                ".shared .align {} .b8 {}[{}]",
                self.align, self.name, self.bytes
            )
        }
    }
}

/// A finished kernel for one target: the unit the printer, the summary and the bindings read.
#[derive(Debug, Clone)]
pub struct Kernel {
    /// Entry name.
    pub name: String,
    /// Target architecture.
    pub target: Target,
    /// Threads per CTA (x, y, z).
    pub threads: (u32, u32, u32),
    /// `.minnctapersm` directive, if any.
    pub min_ctas_per_sm: Option<u32>,
    /// `.maxnreg` directive, if any.
    pub max_regs: Option<u32>,
    /// Parameters in order.
    pub params: Vec<Param>,
    /// Shared declarations in order.
    pub shared: Vec<SharedDecl>,
    /// Register counts per prefix, in type order: (decl type, prefix, count).
    pub regs: Vec<(&'static str, &'static str, u32)>,
    /// The body.
    pub body: Vec<Stmt>,
    /// How the grid is sized, in words (for the manifest).
    pub grid: String,
    /// Dynamic shared memory the launch must request, in bytes.
    pub dynamic_shared_bytes: u32,
}

impl Kernel {
    /// The lowest PTX ISA version that covers the target and every instruction.
    pub fn version(&self) -> PtxVersion {
        self.body
            .iter()
            .filter_map(|s| match s {
                Stmt::Inst(i) => Some(i.min_version),
                _ => None,
            })
            .fold(self.target.min_version(), PtxVersion::max)
    }

    /// Static shared bytes (sum over sized declarations, each rounded up to its alignment).
    pub fn static_shared_bytes(&self) -> u32 {
        self.shared
            .iter()
            .filter(|s| !s.dynamic)
            .fold(0, |acc, s| acc.next_multiple_of(s.align) + s.bytes)
    }

    /// Instructions in the body.
    pub fn insts(&self) -> impl Iterator<Item = &Inst> {
        self.body.iter().filter_map(|s| match s {
            Stmt::Inst(i) => Some(i),
            _ => None,
        })
    }
}

impl fmt::Display for Operand {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Operand::Reg(r) => write!(f, "{r}"),
            Operand::Special(s) => f.write_str(s),
            Operand::Int(v) => write!(f, "{v}"),
            Operand::Hex(v) => write!(f, "0x{v:x}"),
            Operand::F32(v) => write!(f, "0f{:08X}", v.to_bits()),
            Operand::Addr(base, off) => {
                let b = match base {
                    AddrBase::Reg(r) => r.to_string(),
                    AddrBase::Symbol(s) => s.clone(),
                };
                // PTX spells a negative displacement `[r+-4]`.
                match off {
                    0 => write!(f, "[{b}]"),
                    o => write!(f, "[{b}+{o}]"),
                }
            }
            Operand::Vector(rs) => {
                f.write_str("{")?;
                for (i, r) in rs.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{r}")?;
                }
                f.write_str("}")
            }
            Operand::Label(l) => write!(f, "{l}"),
            Operand::Symbol(s) => f.write_str(s),
            Operand::TensorCoords(map, coords) => {
                write!(f, "[{map}, {}]", Operand::Vector(coords.clone()))
            }
        }
    }
}

impl fmt::Display for Inst {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some((p, neg)) = self.guard {
            write!(f, "@{}{} ", if neg { "!" } else { "" }, p)?;
        }
        f.write_str(&self.opcode)?;
        for (i, o) in self.operands.iter().enumerate() {
            f.write_str(if i == 0 { " " } else { ", " })?;
            write!(f, "{o}")?;
        }
        f.write_str(";")
    }
}
