//! Memory: loads and stores in the param, global and shared spaces, address conversion,
//! L2 cache policies, and the TMA bulk-tensor copy (`cp.async.bulk.tensor`).

use crate::ptx::builder::KernelBuilder;
use crate::ptx::ir::{AddrBase, Operand};
use crate::ptx::operand::{
    Address, GlobalAddr, ParamRef, SharedAddr, SharedVar, Src, TensorMapRef,
};
use crate::ptx::types::*;
use crate::target::PtxVersion;

/// The primary L2 eviction priority of a `createpolicy` ([`KernelBuilder::policy_fractional`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum L2Evict {
    /// Evicted before normal lines: data read once (streamed).
    First,
    /// Evicted after normal lines: data read or added again soon.
    Last,
    /// The priority of an access without a hint: a policy that selects between a hint and
    /// none at run time.
    Normal,
}

impl KernelBuilder {
    /// Loads a scalar parameter.
    pub fn ld_param<T: Ty>(&mut self, p: &ParamRef<T>) -> Reg<T> {
        let d = self.fresh::<T>();
        self.inst(
            format!("ld.param.{}", T::NAME),
            vec![
                Operand::Reg(d.name()),
                Operand::Addr(AddrBase::Symbol(p.name.clone()), 0),
            ],
        );
        d
    }

    /// Loads a pointer parameter and converts it to a global address.
    pub fn ld_param_ptr(&mut self, p: &ParamRef<U64>) -> Reg<U64> {
        let generic = self.ld_param(p);
        let d = self.fresh::<U64>();
        self.inst(
            "cvta.to.global.u64".into(),
            vec![Operand::Reg(d.name()), Operand::Reg(generic.name())],
        );
        d
    }

    /// The generic address of a tensor-map parameter (the TMA descriptor operand): the
    /// parameter's address converted from the param window (`cvta.param`, PTX 7.7).
    pub fn tensor_map_addr(&mut self, p: &TensorMapRef) -> Reg<U64> {
        let param = self.fresh::<U64>();
        self.inst(
            "mov.u64".into(),
            vec![Operand::Reg(param.name()), Operand::Symbol(p.name.clone())],
        );
        let d = self.fresh::<U64>();
        self.push(
            "cvta.param.u64".into(),
            vec![Operand::Reg(d.name()), Operand::Reg(param.name())],
            PtxVersion(7, 7),
        );
        d
    }

    /// The 32-bit shared-window address of a shared array.
    pub fn shared_base(&mut self, v: &SharedVar) -> Reg<U32> {
        let d = self.fresh::<U32>();
        self.inst(
            "mov.u32".into(),
            vec![Operand::Reg(d.name()), Operand::Symbol(v.name.clone())],
        );
        d
    }

    fn check_vector<T: Ty>(&mut self, n: usize) {
        if !matches!(n, 2 | 4) || T::BYTES as usize * n > 16 {
            self.error(format!(
                "vector access of {n} x {} is not a legal PTX vector (2 or 4 lanes, <= 16 bytes)",
                T::NAME
            ));
        }
    }

    fn mem_name<T: Ty>() -> &'static str {
        // bf16 and f16x2 values move as untyped bits.
        if T::NAME.starts_with("bf16") || T::NAME == "f16x2" {
            T::DECL
        } else {
            T::NAME
        }
    }

    /// Scalar load.
    pub fn ld<T: Mem, A: Address>(&mut self, addr: &A) -> Reg<T> {
        let d = self.fresh::<T>();
        self.inst(
            format!("ld.{}.{}", A::SPACE, Self::mem_name::<T>()),
            vec![Operand::Reg(d.name()), addr.operand()],
        );
        d
    }

    /// Vector load of `N` (2 or 4) elements.
    pub fn ld_v<T: Mem, A: Address, const N: usize>(&mut self, addr: &A) -> [Reg<T>; N] {
        self.ld_vec::<T, A, N>(addr, "")
    }

    /// Vector load through the read-only (non-coherent) path, for data the kernel never writes.
    pub fn ld_global_nc_v<T: Mem, const N: usize>(&mut self, addr: &GlobalAddr) -> [Reg<T>; N] {
        self.ld_vec::<T, GlobalAddr, N>(addr, ".nc")
    }

    fn ld_vec<T: Mem, A: Address, const N: usize>(&mut self, addr: &A, cache: &str) -> [Reg<T>; N] {
        self.check_vector::<T>(N);
        let regs: [Reg<T>; N] = std::array::from_fn(|_| self.fresh::<T>());
        self.inst(
            format!("ld.{}{cache}.v{N}.{}", A::SPACE, Self::mem_name::<T>()),
            vec![
                Operand::Vector(regs.iter().map(|r| r.name()).collect()),
                addr.operand(),
            ],
        );
        regs
    }

    /// Scalar store.
    pub fn st<T: Mem, A: Address>(&mut self, addr: &A, v: impl Src<T>) {
        self.inst(
            format!("st.{}.{}", A::SPACE, Self::mem_name::<T>()),
            vec![addr.operand(), v.operand()],
        );
    }

    /// Scalar `st.volatile`: ptxas neither drops nor merges it, even when the address is
    /// stored to again before any read.
    pub fn st_volatile<T: Mem, A: Address>(&mut self, addr: &A, v: impl Src<T>) {
        self.inst(
            format!("st.volatile.{}.{}", A::SPACE, Self::mem_name::<T>()),
            vec![addr.operand(), v.operand()],
        );
    }

    /// Vector store of `N` (2 or 4) elements.
    pub fn st_v<T: Mem, A: Address, const N: usize>(&mut self, addr: &A, v: [Reg<T>; N]) {
        self.check_vector::<T>(N);
        self.inst(
            format!("st.{}.v{N}.{}", A::SPACE, Self::mem_name::<T>()),
            vec![
                addr.operand(),
                Operand::Vector(v.iter().map(|r| r.name()).collect()),
            ],
        );
    }

    /// `stmatrix.sync.aligned.m8n8.x4.shared.b16` (PTX 7.8, sm_90): the warp stores four 8×8
    /// b16 matrices held in the mma fragment layout (register `i` of lane `4·row + k` holds
    /// columns `2k, 2k + 1` of `row` of matrix `i`); lane `8·i + row` gives the 16-byte
    /// aligned address of `row` of matrix `i`. Every lane of the warp must execute it.
    pub fn stmatrix_x4<T: Packed16x2>(&mut self, addr: &SharedAddr, v: [Reg<T>; 4]) {
        self.push(
            "stmatrix.sync.aligned.m8n8.x4.shared.b16".into(),
            vec![
                addr.operand(),
                Operand::Vector(v.iter().map(|r| r.name()).collect()),
            ],
            PtxVersion(7, 8),
        );
    }

    /// A 3-D TMA tile load of the box at `coords` (innermost first) into `dst`, completing
    /// its bytes on `bar`.
    pub fn tma_load_3d(
        &mut self,
        dst: &SharedAddr,
        tensor_map: Reg<U64>,
        coords: [Reg<S32>; 3],
        bar: &SharedAddr,
    ) {
        self.tma_load_3d_hinted(dst, tensor_map, coords, bar, None);
    }

    /// [`tma_load_3d`](Self::tma_load_3d) with an L2 eviction `policy` (`.L2::cache_hint`)
    /// when one is given.
    pub fn tma_load_3d_hinted(
        &mut self,
        dst: &SharedAddr,
        tensor_map: Reg<U64>,
        coords: [Reg<S32>; 3],
        bar: &SharedAddr,
        policy: Option<Reg<B64>>,
    ) {
        let (hint, extra) = Self::policy(policy);
        let mut operands = vec![
            dst.operand(),
            Operand::TensorCoords(tensor_map.name(), coords.iter().map(|c| c.name()).collect()),
            bar.operand(),
        ];
        operands.extend(extra);
        self.inst(
            format!(
                "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes{hint}"
            ),
            operands,
        );
    }

    /// A bulk (non-tensor) copy of `bytes` contiguous bytes of global memory at `src` into
    /// shared memory at `dst`, completing them on `bar` (`cp.async.bulk…mbarrier::complete_tx`,
    /// PTX 8.0, sm_90), with an L2 eviction `policy` when one is given. Both addresses 16-byte
    /// aligned, `bytes` a multiple of 16; no swizzle: the bytes land as they are.
    pub fn bulk_load_hinted(
        &mut self,
        dst: &SharedAddr,
        src: &GlobalAddr,
        bytes: u32,
        bar: &SharedAddr,
        policy: Option<Reg<B64>>,
    ) {
        let (hint, extra) = Self::policy(policy);
        let mut operands = vec![
            dst.operand(),
            src.operand(),
            Operand::Int(i64::from(bytes)),
            bar.operand(),
        ];
        operands.extend(extra);
        self.push(
            format!("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes{hint}"),
            operands,
            PtxVersion(8, 0),
        );
    }

    /// A 3-D TMA reduce-add of the shared box at `src` into the tensor at `coords`
    /// (innermost first), elementwise in the tensor map's type, tracked by the thread's bulk
    /// groups (PTX 8.0, sm_90). `src` must stay unchanged until `cp.async.bulk.wait_group.read`.
    pub fn tma_reduce_add_3d(
        &mut self,
        src: &SharedAddr,
        tensor_map: Reg<U64>,
        coords: [Reg<S32>; 3],
    ) {
        self.tma_reduce_add_3d_hinted(src, tensor_map, coords, None);
    }

    /// [`tma_reduce_add_3d`](Self::tma_reduce_add_3d) with an L2 eviction `policy`
    /// (`.L2::cache_hint`) when one is given.
    pub fn tma_reduce_add_3d_hinted(
        &mut self,
        src: &SharedAddr,
        tensor_map: Reg<U64>,
        coords: [Reg<S32>; 3],
        policy: Option<Reg<B64>>,
    ) {
        let (hint, extra) = Self::policy(policy);
        let mut operands = vec![
            Operand::TensorCoords(tensor_map.name(), coords.iter().map(|c| c.name()).collect()),
            src.operand(),
        ];
        operands.extend(extra);
        self.push(
            format!("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group{hint}"),
            operands,
            PtxVersion(8, 0),
        );
    }

    /// A bulk (non-tensor) f16 reduce-add of `bytes` contiguous bytes at `src` into global
    /// memory at `dst` (`cp.reduce.async.bulk…add.noftz.f16`, PTX 8.0, sm_90), tracked by the
    /// thread's bulk groups; both addresses 16-byte aligned, `bytes` a multiple of 16. `src`
    /// must stay unchanged until `cp.async.bulk.wait_group.read`.
    pub fn bulk_reduce_add_f16_hinted(
        &mut self,
        dst: &GlobalAddr,
        src: &SharedAddr,
        bytes: u32,
        policy: Option<Reg<B64>>,
    ) {
        let (hint, extra) = Self::policy(policy);
        let mut operands = vec![dst.operand(), src.operand(), Operand::Int(i64::from(bytes))];
        operands.extend(extra);
        self.push(
            format!("cp.reduce.async.bulk.global.shared::cta.bulk_group{hint}.add.noftz.f16"),
            operands,
            PtxVersion(8, 0),
        );
    }

    /// `cp.async.bulk.commit_group`: closes the thread's bulk copies issued since the last
    /// commit into a group.
    pub fn bulk_commit_group(&mut self) {
        self.push(
            "cp.async.bulk.commit_group".into(),
            vec![],
            PtxVersion(8, 0),
        );
    }

    /// `cp.async.bulk.wait_group.read n`: waits until at most `n` of the thread's bulk groups
    /// still read their shared sources.
    pub fn bulk_wait_group_read(&mut self, n: u32) {
        self.push(
            "cp.async.bulk.wait_group.read".into(),
            vec![Operand::Int(n as i64)],
            PtxVersion(8, 0),
        );
    }

    /// The `.L2::cache_hint` qualifier and its operand, when a policy is given.
    pub(super) fn policy(policy: Option<Reg<B64>>) -> (&'static str, Vec<Operand>) {
        match policy {
            Some(p) => (".L2::cache_hint", vec![p.operand()]),
            None => ("", vec![]),
        }
    }

    /// An L2 policy that keeps the lines it touches (`evict_last`) for `fraction` of them.
    pub fn policy_evict_last(&mut self, fraction: f32) -> Reg<B64> {
        self.policy_fractional(L2Evict::Last, fraction)
    }

    /// An L2 policy of priority `evict` for `fraction` of the lines it touches (the others
    /// unchanged).
    pub fn policy_fractional(&mut self, evict: L2Evict, fraction: f32) -> Reg<B64> {
        let d = self.fresh::<B64>();
        let kind = match evict {
            L2Evict::First => "evict_first",
            L2Evict::Last => "evict_last",
            L2Evict::Normal => "evict_normal",
        };
        self.inst(
            format!("createpolicy.fractional.L2::{kind}.L2::evict_unchanged.b64"),
            vec![Operand::Reg(d.name()), Operand::F32(fraction)],
        );
        d
    }
}

#[cfg(test)]
mod tests {
    use crate::ptx::ir::HostElem;
    use crate::ptx::testing::{builder, errors};
    use crate::ptx::{global, print, shared, L2Evict, Reg, S32, U32, U64};

    /// A hint adds `.L2::cache_hint` and the policy as the last operand; none leaves the
    /// instruction as it was.
    #[test]
    fn tma_hints_name_their_policy() {
        let mut b = builder();
        let p = b.param_ptr("p", HostElem::F32, false);
        let map = b.ld_param_ptr(&p);
        let base = b.mov::<U32>(0u32);
        let c = b.mov::<S32>(0i32);
        let first = b.policy_fractional(L2Evict::First, 1.0);
        let last = b.policy_fractional(L2Evict::Last, 0.5);
        b.policy_fractional(L2Evict::Normal, 1.0);
        let (dst, bar) = (shared(base, 0), shared(base, 1024));
        b.tma_load_3d(&dst, map, [c, c, c], &bar);
        b.tma_load_3d_hinted(&dst, map, [c, c, c], &bar, Some(first));
        b.tma_reduce_add_3d(&dst, map, [c, c, c]);
        b.tma_reduce_add_3d_hinted(&dst, map, [c, c, c], Some(last));
        b.bulk_load_hinted(&dst, &global(map, 64), 4096, &bar, None);
        b.bulk_load_hinted(&dst, &global(map, 64), 4096, &bar, Some(first));
        let text = print::body(&b.finish().unwrap());
        let lines: Vec<&str> = text.lines().map(str::trim).collect();
        let has = |prefix: &str, suffix: &str| {
            lines
                .iter()
                .any(|l| l.starts_with(prefix) && l.ends_with(suffix))
        };
        let policy = |r: Reg<crate::ptx::B64>| format!(", {};", r.name());
        assert!(
            has(
                &format!(
                    "createpolicy.fractional.L2::evict_first.L2::evict_unchanged.b64 {}",
                    first.name()
                ),
                ", 0f3F800000;"
            ),
            "{text}"
        );
        assert!(
            has("createpolicy.fractional.L2::evict_last.", ", 0f3F000000;"),
            "{text}"
        );
        assert!(
            has("createpolicy.fractional.L2::evict_normal.", ", 0f3F800000;"),
            "{text}"
        );
        assert!(has("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [", "];"), "{text}");
        assert!(has("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint [", &policy(first)), "{text}");
        assert!(
            has(
                "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [",
                "];"
            ),
            "{text}"
        );
        assert!(has("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group.L2::cache_hint [", &policy(last)), "{text}");
        let bulk = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes";
        assert!(
            has(&format!("{bulk} [%r0], [%rd1+64]"), "4096, [%r0+1024];"),
            "{text}"
        );
        assert!(
            has(&format!("{bulk}.L2::cache_hint ["), &policy(first)),
            "{text}"
        );
    }

    #[test]
    fn rejects_illegal_vector_width() {
        let mut b = builder();
        let p = b.param_ptr("p", HostElem::F32, false);
        let a = b.ld_param_ptr(&p);
        let _: [Reg<U64>; 4] = b.ld_v(&global(a, 0));
        let e = errors(b);
        assert!(e[0].contains("4 x u64 is not a legal PTX vector"), "{e:?}");
    }
}
