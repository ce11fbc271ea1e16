//! The simulator as a runtime backend: [`SimDevice`] implements `msa_runtime::Backend`, so the
//! runtime's own host flow (`MsaBackward::run_on`, the task build, `preprocess`,
//! `postprocess`) runs on it unchanged: the same workspace carving, tensor-map parameters,
//! launch geometry and kernel order as on a GPU.
//!
//! ```no_run
//! use msa_runtime::{Backend, MsaBackward};
//! use msa_sim::device::SimDevice;
//! use msa_sim::device::Arch;
//!
//! let mut dev = SimDevice::new(Arch::Sm100, 148);
//! assert_eq!(dev.capability(), (10, 0));
//! let mut backward = MsaBackward::<SimDevice>::new();
//! // upload inputs with `dev.upload_new`, then `backward.run_on(&mut dev, &buffers, &schedule)`.
//! # let _ = &mut backward;
//! ```
//!
//! Work runs synchronously at issue (a stream whose every operation has finished when the call
//! returns). Kernel faults come back as `RuntimeError::Simulator` whose source is the
//! [`SimError`]; [`sim_error`] recovers it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use msa_runtime::backward::TileMapSpec;
use msa_runtime::tma::TensorMap;
use msa_runtime::{Backend, KernelArg, KernelSpec, RuntimeError};

use crate::{
    Arg, DevPtr, Element, Gpu, L2Traffic, LaunchConfig, Limits, Module, SimError, SimTensorMap,
};

/// A GPU architecture the kernels ship PTX for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Hopper, compute capability 9.0 (`sm_90a` PTX).
    Sm90,
    /// Blackwell, compute capability 10.0 (`sm_100a` PTX).
    Sm100,
}

impl Arch {
    /// The compute capability the runtime selects variants by.
    pub fn compute_capability(self) -> (i32, i32) {
        match self {
            Arch::Sm90 => (9, 0),
            Arch::Sm100 => (10, 0),
        }
    }

    /// The PTX the runtime would JIT for this architecture out of `variants` (a kernel's
    /// `VARIANTS` table in `msa_runtime::kernels`).
    pub fn ptx(self, variants: &[((i32, i32), &'static str)]) -> Option<&'static str> {
        let cc = self.compute_capability();
        variants.iter().find(|(v, _)| *v == cc).map(|(_, p)| *p)
    }
}

/// A buffer of simulated global memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimBuffer {
    /// Its address.
    pub ptr: DevPtr,
    /// Its size in bytes.
    pub bytes: usize,
}

/// One launch the device ran.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchRecord {
    /// The kernel.
    pub kernel: &'static str,
    /// The grid.
    pub grid: (u32, u32, u32),
    /// Warp instructions executed.
    pub warp_instructions: u64,
    /// Wall time.
    pub elapsed: Duration,
    /// The bulk operations' bytes by L2 side, under [`crate::Limits::l2_sides`].
    pub l2: L2Traffic,
}

/// A simulated GPU of one architecture and SM count, as a `msa_runtime::Backend`.
///
/// Memory is never freed while the device lives (buffers are small in tests); dropping a
/// [`SimBuffer`] does nothing.
#[derive(Debug)]
pub struct SimDevice {
    gpu: Gpu,
    arch: Arch,
    sm_count: usize,
    space: u64,
    modules: HashMap<&'static str, Module>,
    overrides: HashMap<&'static str, String>,
    launches: Vec<LaunchRecord>,
}

impl SimDevice {
    /// A device of `arch` with `sm_count` SMs and default [`Limits`].
    pub fn new(arch: Arch, sm_count: usize) -> Self {
        Self::with_limits(arch, sm_count, Limits::default())
    }

    /// A device of `arch` with `sm_count` SMs and `limits`.
    pub fn with_limits(arch: Arch, sm_count: usize, limits: Limits) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        SimDevice {
            gpu: Gpu::with_limits(limits),
            arch,
            sm_count,
            // Memory spaces of simulated devices never equal a CUDA context's address.
            space: (1 << 63) | NEXT.fetch_add(1, Ordering::Relaxed),
            modules: HashMap::new(),
            overrides: HashMap::new(),
            launches: Vec::new(),
        }
    }

    /// Runs `ptx` instead of the shipped variant whenever `kernel` is loaded (to plant bugs).
    pub fn override_ptx(&mut self, kernel: &'static str, ptx: impl Into<String>) {
        self.modules.remove(kernel);
        self.overrides.insert(kernel, ptx.into());
    }

    /// The architecture.
    pub fn arch(&self) -> Arch {
        self.arch
    }

    /// The simulated GPU (memory and launches).
    pub fn gpu(&mut self) -> &mut Gpu {
        &mut self.gpu
    }

    /// Every launch so far, in order.
    pub fn launches(&self) -> &[LaunchRecord] {
        &self.launches
    }

    /// Allocates a buffer holding `data`.
    pub fn upload_new<T: Element>(&mut self, name: &str, data: &[T]) -> SimBuffer {
        SimBuffer {
            ptr: self.gpu.upload(name, data),
            bytes: std::mem::size_of_val(data),
        }
    }

    /// Reads `len` elements at `addr`.
    pub fn read<T: Element>(&self, addr: u64, len: usize) -> Result<Vec<T>, SimError> {
        self.gpu.read(DevPtr(addr), len)
    }

    fn module(&mut self, kernel: &KernelSpec) -> Result<&Module, RuntimeError> {
        if !self.modules.contains_key(kernel.name) {
            let text = match self.overrides.get(kernel.name) {
                Some(t) => t.clone(),
                None => kernel.ptx(self.arch.compute_capability(), 0)?.to_string(),
            };
            let m = Module::parse(&text).map_err(|e| simulated(kernel.name, SimError::from(e)))?;
            if m.kernel(kernel.name).is_none() {
                return Err(simulated(
                    kernel.name,
                    SimError::Launch {
                        kernel: kernel.name.into(),
                        message: "no such entry in the module".into(),
                    },
                ));
            }
            self.modules.insert(kernel.name, m);
        }
        Ok(&self.modules[kernel.name])
    }
}

/// A simulator error as the runtime's.
fn simulated(call: &str, e: SimError) -> RuntimeError {
    RuntimeError::Simulator {
        call: call.to_string(),
        source: Box::new(e),
    }
}

/// The [`SimError`] behind a `RuntimeError::Simulator`, if that is what `e` is.
pub fn sim_error(e: &RuntimeError) -> Option<&SimError> {
    match e {
        RuntimeError::Simulator { source, .. } => source.downcast_ref::<SimError>(),
        _ => None,
    }
}

impl Backend for SimDevice {
    type Buffer = SimBuffer;

    fn capability(&self) -> (i32, i32) {
        self.arch.compute_capability()
    }

    fn sm_count(&self) -> usize {
        self.sm_count
    }

    fn ordinal(&self) -> usize {
        0
    }

    fn memory_space(&self) -> u64 {
        self.space
    }

    fn alloc(&mut self, what: &'static str, bytes: usize) -> Result<SimBuffer, RuntimeError> {
        let ptr = self
            .gpu
            .try_alloc(what, bytes.max(1))
            .map_err(|e| simulated(what, e))?;
        Ok(SimBuffer { ptr, bytes })
    }

    fn address(&self, buffer: &SimBuffer) -> u64 {
        buffer.ptr.0
    }

    fn upload(&mut self, what: &'static str, dst: u64, bytes: &[u8]) -> Result<(), RuntimeError> {
        self.gpu
            .write(DevPtr(dst), bytes)
            .map_err(|e| simulated(what, e))
    }

    fn zero(&mut self, what: &'static str, dst: u64, bytes: usize) -> Result<(), RuntimeError> {
        self.gpu
            .write(DevPtr(dst), &vec![0u8; bytes])
            .map_err(|e| simulated(what, e))
    }

    fn copy(
        &mut self,
        what: &'static str,
        dst: u64,
        src: u64,
        bytes: usize,
    ) -> Result<(), RuntimeError> {
        let data = self
            .gpu
            .read::<u8>(DevPtr(src), bytes)
            .map_err(|e| simulated(what, e))?;
        self.gpu
            .write(DevPtr(dst), &data)
            .map_err(|e| simulated(what, e))
    }

    fn download(
        &mut self,
        what: &'static str,
        src: u64,
        bytes: usize,
    ) -> Result<Vec<u8>, RuntimeError> {
        self.gpu
            .read::<u8>(DevPtr(src), bytes)
            .map_err(|e| simulated(what, e))
    }

    fn load(&mut self, kernel: &KernelSpec) -> Result<(), RuntimeError> {
        self.module(kernel).map(|_| ())
    }

    fn tensor_map(&mut self, spec: &TileMapSpec, base: u64) -> Result<TensorMap, RuntimeError> {
        // The runtime's own validation first, as the CUDA backend's `encode` does.
        spec.validate(base)?;
        let map = SimTensorMap::from_spec(spec, DevPtr(base)).map_err(|message| {
            simulated(
                "tensor map",
                SimError::Launch {
                    kernel: spec.map.into(),
                    message,
                },
            )
        })?;
        Ok(TensorMap(map.to_bytes()))
    }

    unsafe fn launch(
        &mut self,
        kernel: &KernelSpec,
        grid: (u32, u32, u32),
        args: &[KernelArg],
    ) -> Result<(), RuntimeError> {
        let args: Vec<Arg> = args
            .iter()
            .map(|a| match *a {
                KernelArg::Ptr(p) => Arg::Ptr(DevPtr(p)),
                KernelArg::U32(v) => Arg::U32(v),
                KernelArg::I32(v) => Arg::I32(v),
                KernelArg::TensorMap(m) => Arg::Bytes(m.0.to_vec()),
            })
            .collect();
        let cfg = LaunchConfig::new(grid, kernel.threads)
            .with_dynamic_shared(kernel.dynamic_shared_bytes);
        self.module(kernel)?;
        let entry = self.modules[kernel.name]
            .kernel(kernel.name)
            .expect("checked when the module was loaded");
        let started = Instant::now();
        let stats = self
            .gpu
            .launch(entry, &cfg, &args)
            .map_err(|e| simulated(kernel.name, e))?;
        self.launches.push(LaunchRecord {
            kernel: kernel.name,
            grid,
            warp_instructions: stats.warp_instructions,
            elapsed: started.elapsed(),
            l2: stats.l2,
        });
        Ok(())
    }
}
