//! The kernel builder's core: the [`KernelBuilder`] itself, register allocation, the
//! instruction stream, module-level declarations (parameters, shared arrays) and
//! [`KernelBuilder::finish`], which checks the whole kernel.
//!
//! The instructions are methods too, but live with their PTX ISA family: [`super::ops`]
//! (arithmetic, conversions, memory, atomics, synchronisation, control flow),
//! [`super::wgmma`] and [`super::tcgen05`]. Each extends `impl KernelBuilder` from its own
//! file and checks operand types through the trait bounds of [`super::types`].

use super::ir::{HostElem, Inst, Kernel, Operand, Param, ParamKind, SharedDecl, Stmt};
use super::operand::{ParamRef, SharedVar, TensorMapRef};
use super::types::*;
use crate::error::CodegenError;
use crate::target::{PtxVersion, Target};
use std::collections::BTreeMap;

/// Largest shared memory a CTA may use on sm_90/sm_100 (227 KiB), checked at codegen time.
pub const MAX_SHARED_BYTES: u32 = 232_448;

/// Records a kernel body for one target.
///
/// The `pub(super)` fields are the state the families in [`super::ops`] read or update:
/// the CTA shape (barrier checks), labels, the predicate guard and the body (control flow).
pub struct KernelBuilder {
    name: String,
    target: Target,
    pub(super) threads: (u32, u32, u32),
    min_ctas_per_sm: Option<u32>,
    max_regs: Option<u32>,
    params: Vec<Param>,
    shared: Vec<SharedDecl>,
    counters: BTreeMap<&'static str, u32>,
    pub(super) labels: u32,
    pub(super) placed: Vec<bool>,
    pub(super) used: Vec<bool>,
    pub(super) guard: Option<(RegName, bool)>,
    pub(super) body: Vec<Stmt>,
    errors: Vec<String>,
    grid: String,
    dynamic_shared_bytes: u32,
}

impl KernelBuilder {
    /// Starts a kernel `name` for `target` launched with `threads` per CTA.
    pub fn new(name: &str, target: Target, threads: (u32, u32, u32)) -> Self {
        KernelBuilder {
            name: name.to_string(),
            target,
            threads,
            min_ctas_per_sm: None,
            max_regs: None,
            params: Vec::new(),
            shared: Vec::new(),
            counters: BTreeMap::new(),
            labels: 0,
            placed: Vec::new(),
            used: Vec::new(),
            guard: None,
            body: Vec::new(),
            errors: Vec::new(),
            grid: String::new(),
            dynamic_shared_bytes: 0,
        }
    }

    /// The target being built.
    pub fn target(&self) -> Target {
        self.target
    }

    /// Describes how the host sizes the grid (goes into the manifest).
    pub fn grid(&mut self, text: &str) {
        self.grid = text.to_string();
    }

    /// Adds `.minnctapersm n`.
    pub fn min_ctas_per_sm(&mut self, n: u32) {
        self.min_ctas_per_sm = Some(n);
    }

    /// Adds `.maxnreg n`.
    pub fn max_regs(&mut self, n: u32) {
        self.max_regs = Some(n);
    }

    pub(crate) fn error(&mut self, msg: String) {
        self.errors.push(msg);
    }

    pub(crate) fn fresh<T: Ty>(&mut self) -> Reg<T> {
        let c = self.counters.entry(T::PREFIX).or_insert(0);
        let r = Reg::new(*c);
        *c += 1;
        r
    }

    /// A fresh register of type `T`, not yet written (loop variables, outputs of `set`).
    pub fn reg<T: Ty>(&mut self) -> Reg<T> {
        self.fresh()
    }

    pub(crate) fn push(&mut self, opcode: String, operands: Vec<Operand>, min_version: PtxVersion) {
        self.body.push(Stmt::Inst(Inst {
            guard: self.guard,
            opcode,
            operands,
            min_version,
        }));
    }

    pub(crate) fn inst(&mut self, opcode: String, operands: Vec<Operand>) {
        self.push(opcode, operands, PtxVersion(0, 0));
    }

    /// A comment line in the body, to mark sections for a reviewer.
    ///
    /// PTX must be ASCII (the driver's JIT rejects anything else), so other text is an error.
    pub fn comment(&mut self, text: &str) {
        if !text.is_ascii() {
            self.error(format!(
                "comment {text:?} is not ASCII; the driver's PTX JIT rejects it"
            ));
        }
        self.body.push(Stmt::Comment(text.to_string()));
    }

    /// Records an error unless building for `target` (architecture-specific families).
    pub(crate) fn require(&mut self, what: &str, target: Target) {
        if self.target != target {
            self.error(format!(
                "{what} is only available on {target}, not {}",
                self.target
            ));
        }
    }

    // ---- parameters and declarations -------------------------------------------------

    fn add_param(&mut self, name: &str, kind: ParamKind) {
        if self.params.iter().any(|p| p.name == name) {
            self.error(format!("parameter `{name}` declared twice"));
        }
        self.params.push(Param {
            name: name.to_string(),
            kind,
        });
    }

    /// Declares a device-pointer parameter.
    pub fn param_ptr(&mut self, name: &str, elem: HostElem, mutable: bool) -> ParamRef<U64> {
        self.add_param(name, ParamKind::Ptr { elem, mutable });
        ParamRef {
            name: name.to_string(),
            _t: Default::default(),
        }
    }

    /// Declares a `u32` parameter.
    pub fn param_u32(&mut self, name: &str) -> ParamRef<U32> {
        self.add_param(name, ParamKind::U32);
        ParamRef {
            name: name.to_string(),
            _t: Default::default(),
        }
    }

    /// Declares an `s32` parameter.
    pub fn param_s32(&mut self, name: &str) -> ParamRef<S32> {
        self.add_param(name, ParamKind::I32);
        ParamRef {
            name: name.to_string(),
            _t: Default::default(),
        }
    }

    /// Declares a 128-byte, 64-aligned CUtensorMap parameter.
    pub fn param_tensor_map(&mut self, name: &str) -> TensorMapRef {
        self.add_param(name, ParamKind::TensorMap);
        TensorMapRef {
            name: name.to_string(),
        }
    }

    /// Declares a static shared array of `bytes` bytes aligned to `align`.
    pub fn shared_array(&mut self, name: &str, bytes: u32, align: u32) -> SharedVar {
        if !align.is_power_of_two() {
            self.error(format!(
                "shared `{name}`: alignment {align} is not a power of two"
            ));
        }
        self.shared.push(SharedDecl {
            name: name.to_string(),
            bytes,
            align,
            dynamic: false,
        });
        SharedVar {
            name: name.to_string(),
            bytes,
        }
    }

    /// Declares the dynamic shared array; the launch must request `bytes`.
    pub fn dynamic_shared(&mut self, name: &str, bytes: u32, align: u32) -> SharedVar {
        self.dynamic_shared_bytes = bytes;
        self.shared.push(SharedDecl {
            name: name.to_string(),
            bytes: 0,
            align,
            dynamic: true,
        });
        SharedVar {
            name: name.to_string(),
            bytes,
        }
    }

    // ---- finishing -----------------------------------------------------------------

    /// Checks the recorded kernel and returns it.
    pub fn finish(mut self) -> Result<Kernel, CodegenError> {
        for (i, (placed, used)) in self.placed.iter().zip(&self.used).enumerate() {
            if *used && !placed {
                self.errors
                    .push(format!("label #{i} is a branch target but never placed"));
            }
        }
        let threads = self.threads.0 * self.threads.1 * self.threads.2;
        if threads == 0 || threads > 1024 {
            self.errors
                .push(format!("{threads} threads per CTA; expected 1..=1024"));
        }
        let kernel = Kernel {
            name: self.name,
            target: self.target,
            threads: self.threads,
            min_ctas_per_sm: self.min_ctas_per_sm,
            max_regs: self.max_regs,
            params: self.params,
            shared: self.shared,
            regs: ALL_PREFIXES
                .iter()
                .filter_map(|&(prefix, decl)| self.counters.get(prefix).map(|&n| (decl, prefix, n)))
                .collect(),
            body: self.body,
            grid: self.grid,
            dynamic_shared_bytes: self.dynamic_shared_bytes,
        };
        let smem = kernel.static_shared_bytes() + kernel.dynamic_shared_bytes;
        if smem > MAX_SHARED_BYTES {
            self.errors.push(format!(
                "shared memory {smem} B exceeds the per-CTA limit of {MAX_SHARED_BYTES} B"
            ));
        }
        let version = kernel.version();
        if version > crate::target::MAX_DRIVER_VERSION {
            self.errors.push(format!(
                "needs PTX ISA {version}, above the {} the target driver accepts",
                crate::target::MAX_DRIVER_VERSION
            ));
        }
        if self.errors.is_empty() {
            Ok(kernel)
        } else {
            Err(CodegenError::Kernel {
                kernel: kernel.name,
                target: kernel.target,
                errors: self.errors,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ptx::global;
    use crate::ptx::testing::{builder, errors};

    #[test]
    fn rejects_shared_memory_over_the_limit() {
        let mut b = builder();
        b.shared_array("a", 200_000, 1024);
        b.dynamic_shared("dyn", 40_000, 1024);
        let e = errors(b);
        assert!(
            e[0].contains("240000 B exceeds") && e[0].contains("232448"),
            "{e:?}"
        );

        let mut b = builder();
        b.shared_array("a", 232_448, 16);
        assert!(b.finish().is_ok());
    }

    #[test]
    fn rejects_bad_alignment_and_duplicate_params() {
        let mut b = builder();
        b.shared_array("a", 64, 24);
        b.param_u32("n");
        b.param_u32("n");
        let e = errors(b);
        assert!(e.iter().any(|m| m.contains("alignment 24")), "{e:?}");
        assert!(e.iter().any(|m| m.contains("`n` declared twice")), "{e:?}");
    }

    #[test]
    fn rejects_cta_shapes_out_of_range() {
        let b = KernelBuilder::new("t", Target::Sm100a, (2048, 1, 1));
        assert!(errors(b)[0].contains("2048 threads"));
    }

    #[test]
    fn registers_are_numbered_per_type_in_creation_order() {
        let mut b = builder();
        let a = b.mov::<U32>(1u32);
        let f = b.mov::<F32>(1.5f32);
        let c = b.add(a, 2u32);
        assert_eq!(
            (a.to_string(), c.to_string(), f.to_string()),
            ("%r0".into(), "%r1".into(), "%f0".into())
        );
        let k = b.finish().unwrap();
        let body = crate::ptx::print::body(&k);
        assert_eq!(
            body,
            "\tmov.u32 %r0, 1;\n\tmov.f32 %f0, 0f3FC00000;\n\tadd.u32 %r1, %r0, 2;\n"
        );
    }

    #[test]
    fn version_is_the_highest_any_instruction_needs() {
        let build = |vector_red: bool| {
            let mut b = builder();
            let p = b.param_ptr("p", HostElem::F32, true);
            let a = b.ld_param_ptr(&p);
            let v = [b.mov::<F32>(0.0f32); 4];
            if vector_red {
                b.red_add_v4_f32(&global(a, 0), v, None);
            } else {
                b.red_add_f32(&global(a, 0), v[0]);
            }
            b.finish().unwrap().version()
        };
        assert_eq!(build(false), PtxVersion(8, 0));
        assert_eq!(build(true), PtxVersion(8, 1));
    }
}
