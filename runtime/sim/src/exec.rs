//! The executor: a grid of CTAs run one at a time, warps of 32 lanes in lockstep.
//!
//! Every thread has its own PC. A warp step picks the smallest PC among the warp's runnable
//! lanes and executes that instruction for every runnable lane at that PC; lanes that took the
//! other side of a branch wait at higher PCs and rejoin when the others get there (min-PC
//! reconvergence, exact for the structured control flow the codegen emits). Warps are
//! scheduled round-robin, each until it blocks or a quantum runs out. A thread that reaches
//! `bar.sync` blocks until the barrier completes; when no warp has a runnable lane and some
//! thread is still alive, the CTA is deadlocked and the error names every warp's PCs and the
//! barriers they wait on.
//!
//! # Asynchronous machinery (sm_90a)
//!
//! - **mbarriers** live in a side table keyed by their shared address, with the phase, the
//!   pending arrivals and the transaction count. `mbarrier.try_wait.parity` blocks the lane
//!   until the phase of that parity completes (a deadlock names the mbarrier, the parity and
//!   its state). More arrivals or more transaction bytes than a phase expects are faults.
//! - **TMA** (`cp.async.bulk.tensor`) is validated when issued and completed late: by default
//!   when a thread waits on its mbarrier and the phase is not complete yet (or when every
//!   thread is blocked), so that a consumer that skips the wait reads stale shared memory.
//!   [`TmaCompletion::Immediate`] completes at issue instead, so that a producer that
//!   overwrites a stage still being read is caught. See [`crate::tensor_map`] for the map.
//! - **wgmma** and **setmaxnreg** are warpgroup collectives: the four warps meet at the same
//!   instruction (a different instruction is a fault), then it runs for the warpgroup. An MMA
//!   snapshots its shared operands at issue and computes at the `wgmma.wait_group` that
//!   retires it, after re-reading the operands: a change in between is a fault, as is any
//!   access to its accumulator or A registers while in flight and a register access since
//!   the last `wgmma.fence`.
//! - **Proxy ordering**: a generic `st.shared` read by a wgmma or tcgen05.mma before the
//!   *writing* thread executed `fence.proxy.async` is a fault.
//!
//! # Tensor memory and tcgen05 (sm_100a)
//!
//! Per CTA, 128 lanes × 512 columns of 32-bit cells. `tcgen05.mma` is issued per thread and
//! completes, in issue order, at the latest legal point: when a thread waits on the mbarrier of
//! a `tcgen05.commit` that covers it and the phase is incomplete, or when every live thread is
//! blocked. Races (a `tcgen05.ld` of cells an MMA in flight writes, a `tcgen05.st` to cells it
//! reads or writes, shared operands changing before completion, registers of a `tcgen05.ld`
//! read before `wait::ld`, a signal after `tcgen05.st` without `wait::st`), reads of TMEM never
//! written since allocation, lane-quadrant violations and allocation misuse are faults. The
//! details are in the `tcgen05` submodule.

use crate::error::{
    FaultKind, Location, MemoryFault, MemoryFaultKind, SimError, Stall, StuckLanes, WarpState,
};
use crate::ir::*;
use crate::launch::{param_buffer, Arg, LaunchConfig};
use crate::memory::{DevPtr, Element, GlobalMemory};
use crate::module::Kernel;
use crate::smem_layout::UnfencedStores;

mod alu;
mod control;
mod mbarrier;
mod memory;
mod sync;
mod tcgen05;
mod warp;
mod wgmma;

/// Limits of the simulated device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most threads in one CTA.
    pub max_threads_per_cta: u32,
    /// Most shared memory (static + dynamic) of one CTA: 227 KiB on sm_90 / sm_100.
    pub max_shared_bytes: u32,
    /// Warp instructions one CTA may execute before the launch fails with
    /// [`SimError::StepLimit`] (catches infinite loops).
    pub max_steps_per_cta: u64,
    /// Registers of one SM's pool that `setmaxnreg` redistributes: 65536 on sm_90 / sm_100.
    pub register_pool: u32,
    /// When a TMA copy lands in shared memory and completes its bytes on the mbarrier.
    pub tma_completion: TmaCompletion,
    /// Warps (bit `w` = warp `w` of each CTA) that run only when no other warp can: an
    /// adversarial schedule under which a warp that reads data a starved warp produces,
    /// without waiting for it, reads it before it is written.
    pub starved_warps: u64,
    /// The order in which in-flight `tcgen05.mma`s complete when a commit forces them.
    pub umma_order: UmmaOrder,
    /// The arithmetic of one `tcgen05.mma` k16 step.
    pub tcgen05_numerics: Tcgen05Numerics,
    /// The order in which the CTAs of a launch run (one after another).
    pub cta_order: CtaOrder,
    /// A model of Hopper's two L2 partitions for `%clock` and the bulk copies, or none
    /// (`%clock` then reads a hash).
    pub l2_sides: Option<L2Sides>,
}

/// The two L2 partitions as session 27's probe found them (`bench/probe/l2_sides.cu`): every
/// SM sits next to one, every 4 KiB of address space is homed in one, and a returning atomic
/// takes `near` cycles to an address homed on its SM's side and `far` otherwise. Under the
/// model a returning atomic's value is ready its latency after issue, and a thread's `%clock`
/// advances only when a memory operation, barrier or fence waits for a value not yet ready:
/// ptxas keeps those in order with `%clock` reads, but may schedule arithmetic after one, so
/// a latency probe reads an atomic's latency only when a memory operation consumes the
/// value before the second read (session 29's probes did not, and their labels came out
/// as random here as on the GPU). Each CTA runs on an SM of its own, whose side is a hash of
/// its index. [`L2Traffic`] counts the bulk copies' and bulk reductions' bytes by side. The
/// model is of the probe's premise, which no GPU run has tested yet; `tests/tests/codegen.rs`
/// checks the probes' order in the SASS ptxas makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct L2Sides {
    /// Cycles of a returning atomic homed on the SM's side.
    pub near: u32,
    /// Cycles of one homed on the other side.
    pub far: u32,
    /// The address bits whose parity is the home (an address's partition).
    pub home_bits: u64,
}

impl Default for L2Sides {
    /// The H200's and H100's latencies (about 280 and 480 cycles) and home hash (address bits
    /// 12, 13, 15, 17, 19, 21, 22 and 24, as far as the probe's 32 MiB reached).
    fn default() -> Self {
        let bits = [12, 13, 15, 17, 19, 21, 22, 24];
        L2Sides {
            near: 280,
            far: 480,
            home_bits: bits.iter().fold(0, |m, b| m | 1u64 << b),
        }
    }
}

impl L2Sides {
    /// The partition address `addr` is homed in.
    pub fn home(&self, addr: u64) -> u8 {
        ((addr & self.home_bits).count_ones() & 1) as u8
    }

    /// The side of the SM that runs CTA `ctaid` (a hash, so that no kernel can guess it).
    pub fn side(&self, ctaid: [u32; 3]) -> u8 {
        (mix64(cta_key(ctaid).wrapping_add(GOLDEN)) & 1) as u8
    }

    /// The bytes of one home: the interleave below the lowest address bit of the hash.
    fn grain(&self) -> u64 {
        1 << self.home_bits.trailing_zeros()
    }
}

/// splitmix64's increment.
pub(crate) const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// splitmix64's output mix: the simulator's deterministic hashes and random streams.
pub(crate) fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// One number per CTA index, the seed of its hashes.
fn cta_key(ctaid: [u32; 3]) -> u64 {
    (u64::from(ctaid[2]) << 42) ^ (u64::from(ctaid[1]) << 21) ^ u64::from(ctaid[0])
}

/// Bytes of bulk (non-tensor) copies from global memory and bulk reductions into it, by
/// whether their 4 KiB pieces are homed on the issuing SM's side; counted only under
/// [`Limits::l2_sides`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct L2Traffic {
    /// Bulk reductions into lines homed on the SM's side.
    pub reduce_near: u64,
    /// Bulk reductions into lines homed on the other side.
    pub reduce_far: u64,
    /// Bulk copies from lines homed on the SM's side.
    pub load_near: u64,
    /// Bulk copies from lines homed on the other side.
    pub load_far: u64,
}

impl L2Traffic {
    /// Adds `o`'s counts (another CTA's or launch's).
    pub fn add(&mut self, o: &L2Traffic) {
        self.reduce_near += o.reduce_near;
        self.reduce_far += o.reduce_far;
        self.load_near += o.load_near;
        self.load_far += o.load_far;
    }
}

/// The order in which the simulator runs the CTAs of a grid. The hardware promises no order
/// (CTA 0 is dispatched first in practice, which `schedule_count` relies on); another order
/// lands cross-CTA atomics in another order, and a kernel that waits for a later CTA never
/// finishes (a step-limit error).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CtaOrder {
    /// Linear CTA index order (x fastest).
    #[default]
    InOrder,
    /// Last CTA first.
    Reversed,
    /// A random permutation from this seed.
    Seeded(u64),
}

/// The order in which the simulator completes the in-flight `tcgen05.mma`s a commit covers.
/// MMAs on one accumulator always complete in issue order (the only order the PTX ISA
/// gives); MMAs whose TMEM columns conflict across accumulators are reported at issue, so
/// any order the ISA allows must give the same result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UmmaOrder {
    /// Issue order.
    #[default]
    Issue,
    /// A random order allowed by the ISA, from this seed (and the CTA index).
    Seeded(u64),
    /// Latest issued first wherever the ISA allows: each MMA completes as late as it can.
    Reversed,
}

/// How a `tcgen05.mma` k16 step rounds. The B200's tensor core has not been measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Tcgen05Numerics {
    /// Exact products accumulated sequentially in k in f32, each addition rounded to nearest.
    #[default]
    RoundToNearest,
    /// The H200's wgmma step ([`crate::tensor_core::sm90_block`]): the 16 exact products and
    /// the accumulator aligned to the largest exponent, cut 25 bits below it, summed and
    /// rounded toward zero.
    Truncating,
}

/// When the simulator completes a TMA copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TmaCompletion {
    /// As late as possible: when a thread waits on the copy's mbarrier and the phase has not
    /// completed, or when every live thread is blocked. A consumer that reads the stage
    /// without waiting sees stale data.
    #[default]
    Deferred,
    /// At issue. A producer that overwrites a stage before its consumers released it
    /// corrupts what they read (or trips the wgmma operand check).
    Immediate,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_threads_per_cta: 1024,
            max_shared_bytes: 227 * 1024,
            max_steps_per_cta: 50_000_000,
            register_pool: 65536,
            tma_completion: TmaCompletion::Deferred,
            starved_warps: 0,
            umma_order: UmmaOrder::Issue,
            tcgen05_numerics: Tcgen05Numerics::RoundToNearest,
            cta_order: CtaOrder::InOrder,
            l2_sides: None,
        }
    }
}

/// What a launch executed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LaunchStats {
    /// CTAs run.
    pub ctas: u64,
    /// Warp instructions issued.
    pub warp_instructions: u64,
    /// Thread instructions executed (lanes whose guard was true).
    pub thread_instructions: u64,
    /// The bulk operations' bytes by L2 side, under [`Limits::l2_sides`].
    pub l2: L2Traffic,
}

/// A simulated GPU: global memory plus the ability to launch kernels.
#[derive(Debug, Clone, Default)]
pub struct Gpu {
    mem: GlobalMemory,
    limits: Limits,
}

impl Gpu {
    /// A GPU with empty memory and default [`Limits`].
    pub fn new() -> Gpu {
        Gpu::default()
    }

    /// A GPU with the given limits.
    pub fn with_limits(limits: Limits) -> Gpu {
        Gpu {
            mem: GlobalMemory::default(),
            limits,
        }
    }

    /// The limits.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Allocates `bytes` zeroed bytes; `name` appears in fault messages.
    pub fn alloc(&mut self, name: &str, bytes: usize) -> DevPtr {
        self.mem.alloc(name, bytes)
    }

    /// [`Gpu::alloc`], with an error instead of an abort for a size the host cannot hold.
    pub fn try_alloc(&mut self, name: &str, bytes: usize) -> Result<DevPtr, SimError> {
        self.mem.try_alloc(name, bytes).map_err(SimError::Host)
    }

    /// Allocates and fills a buffer with `data`.
    pub fn upload<T: Element>(&mut self, name: &str, data: &[T]) -> DevPtr {
        let p = self.mem.alloc(name, data.len() * T::SIZE);
        self.mem
            .write(p, data)
            .expect("a fresh allocation holds its data");
        p
    }

    /// Copies `data` to `ptr`.
    pub fn write<T: Element>(&mut self, ptr: DevPtr, data: &[T]) -> Result<(), SimError> {
        self.mem.write(ptr, data).map_err(SimError::Host)
    }

    /// Copies `len` elements from `ptr`.
    pub fn read<T: Element>(&self, ptr: DevPtr, len: usize) -> Result<Vec<T>, SimError> {
        self.mem.read(ptr, len).map_err(SimError::Host)
    }

    /// The global memory.
    pub fn memory(&self) -> &GlobalMemory {
        &self.mem
    }

    /// Runs `kernel` on `cfg` with `args`; CTAs run one after another in `x, y, z` order.
    pub fn launch(
        &mut self,
        kernel: &Kernel,
        cfg: &LaunchConfig,
        args: &[Arg],
    ) -> Result<LaunchStats, SimError> {
        if let Some(e) = &kernel.unsupported {
            return Err(SimError::Parse(e.clone()));
        }
        let launch_err = |message: String| SimError::Launch {
            kernel: kernel.name.clone(),
            message,
        };
        let threads = cfg.block.iter().map(|&d| d as u64).product::<u64>();
        if threads == 0 || threads > self.limits.max_threads_per_cta as u64 {
            return Err(launch_err(format!(
                "block {:?} has {threads} threads; 1..={} allowed",
                cfg.block, self.limits.max_threads_per_cta
            )));
        }
        if let Some(m) = kernel.maxntid {
            let max = m.iter().map(|&d| d as u64).product::<u64>();
            if threads > max {
                return Err(launch_err(format!(
                    "block {:?} has {threads} threads, more than .maxntid {m:?}",
                    cfg.block
                )));
            }
        }
        if let Some(r) = kernel.reqntid {
            if r != cfg.block {
                return Err(launch_err(format!(
                    "block {:?} differs from .reqntid {r:?}",
                    cfg.block
                )));
            }
        }
        if cfg.grid.contains(&0) {
            return Err(launch_err(format!("empty grid {:?}", cfg.grid)));
        }
        let shared_bytes = match kernel.dynamic_base {
            Some(base) => base as u64 + cfg.dynamic_shared_bytes as u64,
            None => kernel.static_shared as u64 + cfg.dynamic_shared_bytes as u64,
        };
        if shared_bytes > self.limits.max_shared_bytes as u64 {
            return Err(launch_err(format!(
                "{shared_bytes} bytes of shared memory (static {} + dynamic {}), more than {}",
                kernel.static_shared, cfg.dynamic_shared_bytes, self.limits.max_shared_bytes
            )));
        }
        let params = param_buffer(kernel, args).map_err(launch_err)?;

        let mut cta = Cta::new(
            kernel,
            &mut self.mem,
            &params,
            cfg,
            shared_bytes as usize,
            &self.limits,
        );
        let mut stats = LaunchStats::default();
        let mut order: Vec<[u32; 3]> = (0..cfg.grid[2])
            .flat_map(|z| {
                (0..cfg.grid[1]).flat_map(move |y| (0..cfg.grid[0]).map(move |x| [x, y, z]))
            })
            .collect();
        match self.limits.cta_order {
            CtaOrder::InOrder => {}
            CtaOrder::Reversed => order.reverse(),
            CtaOrder::Seeded(seed) => {
                // Fisher-Yates with a splitmix64 stream.
                let mut state = seed;
                let mut next = || {
                    state = state.wrapping_add(GOLDEN);
                    mix64(state)
                };
                for i in (1..order.len()).rev() {
                    let j = (next() % (i as u64 + 1)) as usize;
                    order.swap(i, j);
                }
            }
        }
        for id in order {
            cta.reset(id);
            cta.run()?;
            stats.ctas += 1;
            stats.warp_instructions += cta.steps;
            stats.thread_instructions += cta.thread_steps;
            stats.l2.add(&cta.l2_traffic);
        }
        Ok(stats)
    }
}

const NOT_BLOCKED: u8 = u8::MAX;
/// `blocked_on` of a lane in `mbarrier.try_wait` (details in `mbar_wait`); the lane re-executes
/// the wait when woken.
const BLOCK_MBAR: u8 = 16;
/// `blocked_on` of a lane whose warp waits for its warpgroup at a collective instruction.
const BLOCK_WARPGROUP: u8 = 17;
/// Warp instructions a warp runs before the scheduler moves on.
const QUANTUM: u32 = 4096;

#[derive(Debug, Clone, Default)]
struct Barrier {
    /// Lanes that arrived in the current phase, per warp.
    arrived: Vec<u32>,
    /// PC each warp arrived from.
    pc: Vec<u32>,
    /// Expected threads of the current phase (`None`: all threads of the CTA).
    count: Option<u32>,
    /// Any arrival in the current phase.
    active: bool,
}

struct Cta<'a> {
    k: &'a Kernel,
    mem: &'a mut GlobalMemory,
    params: &'a [u8],
    block: [u32; 3],
    grid: [u32; 3],
    ctaid: [u32; 3],
    nwarps: usize,
    nregs: usize,
    regs: Vec<u64>,
    pc: Vec<u32>,
    blocked_on: Vec<u8>,
    ready: Vec<u32>,
    /// Whether every ready lane of the warp is at `wpc` (then `pc` is stale for them).
    uniform: Vec<bool>,
    wpc: Vec<u32>,
    exited: Vec<u32>,
    present: Vec<u32>,
    shared: Vec<u8>,
    bars: Vec<Barrier>,
    max_steps: u64,
    starved: u64,
    umma_order: UmmaOrder,
    tcgen05_numerics: Tcgen05Numerics,
    /// Random state of the seeded MMA completion order.
    umma_rng: u64,
    steps: u64,
    thread_steps: u64,
    /// (shared address, parity) of each lane blocked in `mbarrier.try_wait`.
    mbar_wait: Vec<(u32, u8)>,
    mbars: Vec<mbarrier::Mbarrier>,
    tmas: Vec<mbarrier::PendingTma>,
    /// Shared sources of TMA reductions that may still be read (until the issuing thread's
    /// `cp.async.bulk.wait_group.read` retires their group).
    bulk_reads: Vec<mbarrier::BulkRead>,
    /// Per thread: bulk groups committed so far.
    bulk_groups: Vec<u64>,
    tma_completion: TmaCompletion,
    wgs: Vec<wgmma::Warpgroup>,
    /// Per-thread registers at launch (what `setmaxnreg` starts from).
    launch_regs: u32,
    register_pool: u32,
    /// Per warp and register: how many in-flight MMAs use it (accumulator or A fragment).
    inflight: Vec<u16>,
    /// Per warp: in-flight MMAs.
    inflight_ops: Vec<u32>,
    /// Per warp and register: the warp's fence generation when last accessed.
    touched: Vec<u32>,
    /// Per warp: incremented by every `wgmma.fence` (starts at 1).
    fence_gen: Vec<u32>,
    /// Per shared 4-byte word: 1 + the thread whose generic store is not yet fenced, or 0.
    unfenced: Vec<u32>,
    /// PC of that store.
    unfenced_pc: Vec<u32>,
    /// Per thread: the words it stored since its last `fence.proxy.async`.
    unfenced_list: Vec<Vec<u32>>,
    unfenced_total: usize,
    /// Tensor memory and the `tcgen05` machinery.
    tmem: tcgen05::Tmem,
    /// The L2 model, each thread's `%clock` under it and the CTA's bulk traffic by side.
    l2: Option<L2Sides>,
    clock: Vec<u64>,
    /// Under the L2 model, per register and lane (as `regs`): the `%clock` time its value is
    /// ready at (a returning atomic's issue time plus its latency, and from there through
    /// every result computed from it).
    ready_at: Vec<u64>,
    /// Under the L2 model: when the executing instruction's results are ready, per lane.
    result_ready: [u64; 32],
    l2_traffic: L2Traffic,
}

#[inline]
fn lanes(mask: u32) -> impl Iterator<Item = usize> {
    let mut m = mask;
    std::iter::from_fn(move || {
        if m == 0 {
            None
        } else {
            let l = m.trailing_zeros() as usize;
            m &= m - 1;
            Some(l)
        }
    })
}

impl<'a> Cta<'a> {
    fn new(
        k: &'a Kernel,
        mem: &'a mut GlobalMemory,
        params: &'a [u8],
        cfg: &LaunchConfig,
        shared_bytes: usize,
        limits: &Limits,
    ) -> Self {
        let nthreads = cfg.block.iter().product::<u32>() as usize;
        let nwarps = nthreads.div_ceil(32);
        let nregs = k.reg_names.len();
        let present = (0..nwarps)
            .map(|w| {
                let n = (nthreads - w * 32).min(32);
                if n == 32 {
                    u32::MAX
                } else {
                    (1u32 << n) - 1
                }
            })
            .collect();
        Cta {
            k,
            mem,
            params,
            block: cfg.block,
            grid: cfg.grid,
            ctaid: [0; 3],
            nwarps,
            nregs,
            regs: vec![0; nwarps * nregs * 32],
            pc: vec![0; nwarps * 32],
            blocked_on: vec![NOT_BLOCKED; nwarps * 32],
            ready: vec![0; nwarps],
            uniform: vec![false; nwarps],
            wpc: vec![0; nwarps],
            exited: vec![0; nwarps],
            present,
            shared: vec![0; shared_bytes],
            bars: vec![
                Barrier {
                    arrived: vec![0; nwarps],
                    pc: vec![0; nwarps],
                    count: None,
                    active: false,
                };
                16
            ],
            max_steps: limits.max_steps_per_cta,
            starved: limits.starved_warps,
            umma_order: limits.umma_order,
            tcgen05_numerics: limits.tcgen05_numerics,
            umma_rng: 0,
            steps: 0,
            thread_steps: 0,
            mbar_wait: vec![(0, 0); nwarps * 32],
            mbars: Vec::new(),
            tmas: Vec::new(),
            bulk_reads: Vec::new(),
            bulk_groups: vec![0; nwarps * 32],
            tma_completion: limits.tma_completion,
            wgs: vec![wgmma::Warpgroup::default(); nwarps.div_ceil(4)],
            launch_regs: wgmma::launch_registers(k, nthreads as u32, limits.register_pool),
            register_pool: limits.register_pool,
            inflight: if k.uses_wgmma {
                vec![0; nwarps * nregs]
            } else {
                Vec::new()
            },
            inflight_ops: vec![0; nwarps],
            touched: if k.uses_wgmma {
                vec![0; nwarps * nregs]
            } else {
                Vec::new()
            },
            fence_gen: vec![1; nwarps],
            unfenced: if k.uses_async_proxy {
                vec![0; shared_bytes.div_ceil(4)]
            } else {
                Vec::new()
            },
            unfenced_pc: if k.uses_async_proxy {
                vec![0; shared_bytes.div_ceil(4)]
            } else {
                Vec::new()
            },
            unfenced_list: vec![Vec::new(); nwarps * 32],
            unfenced_total: 0,
            tmem: tcgen05::Tmem {
                last_seq: vec![0; nwarps * 32],
                ld_pending: if k.uses_tcgen05 {
                    vec![false; nwarps * nregs]
                } else {
                    Vec::new()
                },
                ld_pending_n: vec![0; nwarps],
                st_pending: vec![None; nwarps],
                synced: if k.uses_tcgen05 {
                    vec![None; nwarps * 32]
                } else {
                    Vec::new()
                },
                accessed: if k.uses_tcgen05 {
                    vec![None; nwarps * 32]
                } else {
                    Vec::new()
                },
                ..tcgen05::Tmem::default()
            },
            l2: limits.l2_sides,
            clock: if limits.l2_sides.is_some() {
                vec![0; nwarps * 32]
            } else {
                Vec::new()
            },
            ready_at: if limits.l2_sides.is_some() {
                vec![0; nwarps * nregs * 32]
            } else {
                Vec::new()
            },
            result_ready: [0; 32],
            l2_traffic: L2Traffic::default(),
        }
    }

    fn reset(&mut self, ctaid: [u32; 3]) {
        self.ctaid = ctaid;
        if let UmmaOrder::Seeded(seed) = self.umma_order {
            self.umma_rng = seed ^ cta_key(ctaid).wrapping_mul(GOLDEN);
        }
        self.regs.fill(0);
        self.pc.fill(0);
        self.blocked_on.fill(NOT_BLOCKED);
        self.ready.copy_from_slice(&self.present);
        self.uniform.fill(true);
        self.wpc.fill(0);
        self.exited.fill(0);
        self.shared.fill(0);
        for b in &mut self.bars {
            b.arrived.fill(0);
            b.count = None;
            b.active = false;
        }
        self.steps = 0;
        self.thread_steps = 0;
        self.mbars.clear();
        self.tmas.clear();
        self.bulk_reads.clear();
        self.bulk_groups.fill(0);
        let regs = self.launch_regs;
        for g in &mut self.wgs {
            *g = wgmma::Warpgroup::new(regs);
        }
        self.inflight.fill(0);
        self.inflight_ops.fill(0);
        self.touched.fill(0);
        self.fence_gen.fill(1);
        self.unfenced.fill(0);
        self.unfenced_list.iter_mut().for_each(Vec::clear);
        self.unfenced_total = 0;
        self.tmem.reset();
        self.clock.fill(0);
        self.ready_at.fill(0);
        self.l2_traffic = L2Traffic::default();
    }

    /// Under the L2 model: the returning atomic of warp `w`'s lane `l` at `addr` makes its
    /// value (register index `ri`) ready the latency of the partition `addr` is homed in
    /// after the lane's present `%clock`.
    fn atomic_latency(&mut self, w: usize, l: usize, addr: u64, ri: usize) {
        if let Some(l2) = self.l2 {
            let near = l2.home(addr) == l2.side(self.ctaid);
            let t = w * 32 + l;
            self.ready_at[ri + l] = self.clock[t] + u64::from(if near { l2.near } else { l2.far });
        }
    }

    /// Under the L2 model, before instruction `pc` runs on warp `w`'s lanes `exec`: when its
    /// results will be ready (when the last of its registers is), and, for an instruction that
    /// ptxas keeps in order with `%clock` reads (memory operations, barriers and fences), the
    /// lanes' `%clock` moved to that time, since in-order issue holds it until its operands
    /// are ready. Arithmetic does not move the clock: ptxas may schedule it after a later
    /// `%clock` read (as it did session 29's latency probes), so a probe times an atomic only
    /// when a memory operation waits for its value before the second read.
    fn order_clock(&mut self, pc: usize, w: usize, exec: u32, op: &Op) {
        // Stmatrix (a shared-memory store) is a warp op that ptxas keeps in order too.
        let ordered = match family(op) {
            Family::Alu | Family::Control => false,
            Family::Warp => matches!(op, Op::Stmatrix { .. }),
            _ => true,
        };
        let regs = &self.k.inst_regs[pc];
        for l in lanes(exec) {
            let ready = regs
                .iter()
                .map(|&r| self.ready_at[self.ri(w, r) + l])
                .max()
                .unwrap_or(0);
            let t = w * 32 + l;
            self.result_ready[l] = if ordered {
                self.clock[t] = self.clock[t].max(ready);
                self.clock[t]
            } else {
                ready
            };
        }
    }

    /// Under the L2 model: counts `bytes` of a bulk copy (`load`) or reduction at global
    /// `addr`, by the home of each piece within one home.
    fn count_bulk(&mut self, load: bool, addr: u64, bytes: u64) {
        let Some(l2) = self.l2 else { return };
        let side = l2.side(self.ctaid);
        let mut at = addr;
        let end = addr + bytes;
        while at < end {
            let piece = ((at | (l2.grain() - 1)) + 1).min(end) - at;
            let near = l2.home(at) == side;
            let c = &mut self.l2_traffic;
            *match (load, near) {
                (true, true) => &mut c.load_near,
                (true, false) => &mut c.load_far,
                (false, true) => &mut c.reduce_near,
                (false, false) => &mut c.reduce_far,
            } += piece;
            at += piece;
        }
    }

    /// Runs warp `w` until it blocks or its quantum ends; whether it ran at all.
    fn run_warp(&mut self, w: usize) -> Result<bool, SimError> {
        let mut n = 0;
        while self.ready[w] != 0 && n < QUANTUM {
            if self.steps >= self.max_steps {
                return Err(SimError::StepLimit {
                    limit: self.max_steps,
                    stall: Box::new(self.stall()),
                });
            }
            self.step(w)?;
            n += 1;
        }
        Ok(n > 0)
    }

    fn run(&mut self) -> Result<(), SimError> {
        let starved = |w: usize| w < 64 && self.starved >> w & 1 == 1;
        let (normal, last): (Vec<usize>, Vec<usize>) = (0..self.nwarps).partition(|&w| !starved(w));
        loop {
            let mut progressed = false;
            for &w in &normal {
                progressed |= self.run_warp(w)?;
            }
            if !progressed {
                // Starved warps only when nothing else can run.
                for &w in &last {
                    progressed |= self.run_warp(w)?;
                }
            }
            if !progressed {
                if self.exited == self.present {
                    return self.check_exit();
                }
                if !self.tmas.is_empty() {
                    // Every live thread is blocked: the copies in flight land now.
                    self.complete_all_tmas()?;
                    continue;
                }
                if self.umma_pending() {
                    // Likewise the tcgen05.mma in flight and their commits.
                    self.complete_all_umma()?;
                    continue;
                }
                return Err(SimError::Deadlock(Box::new(self.stall())));
            }
        }
    }

    fn stall(&self) -> Stall {
        let mut warps = Vec::new();
        for w in 0..self.nwarps {
            let live = self.present[w] & !self.exited[w];
            if live == 0 {
                continue;
            }
            let mut groups: Vec<StuckLanes> = Vec::new();
            for l in lanes(live) {
                let t = w * 32 + l;
                let b = self.blocked_on[t];
                let pc = match b {
                    NOT_BLOCKED => self.lane_pc(w, l) as usize,
                    // Named barriers advance before blocking; the others re-execute.
                    0..=15 => self.pc[t] as usize - 1,
                    _ => self.pc[t] as usize,
                };
                let waiting_for = match b {
                    NOT_BLOCKED => "runnable".to_string(),
                    0..=15 => self.describe_barrier(b as usize),
                    BLOCK_MBAR => self.describe_mbar_wait(t),
                    _ => self.describe_warpgroup_wait(w),
                };
                match groups
                    .iter_mut()
                    .find(|g| g.pc == pc && g.waiting_for == waiting_for)
                {
                    Some(g) => g.lanes |= 1 << l,
                    None => {
                        let src = &self.k.source[pc];
                        groups.push(StuckLanes {
                            lanes: 1 << l,
                            pc,
                            line: src.line,
                            instruction: src.text.clone(),
                            waiting_for,
                        })
                    }
                }
            }
            warps.push(WarpState {
                warp: w as u32,
                groups,
            });
        }
        Stall {
            kernel: self.k.name.clone(),
            cta: self.ctaid,
            warps,
        }
    }

    fn describe_barrier(&self, id: usize) -> String {
        let b = &self.bars[id];
        let arrived: u32 = b.arrived.iter().map(|m| m.count_ones()).sum();
        match b.count {
            Some(n) => format!("blocked on barrier {id} ({arrived} of {n} threads arrived)"),
            None => {
                let live: u32 = (0..self.nwarps)
                    .map(|w| (self.present[w] & !self.exited[w]).count_ones())
                    .sum();
                format!(
                    "blocked on barrier {id} (all threads of the CTA; {arrived} of {live} live threads arrived)"
                )
            }
        }
    }

    fn location(&self, pc: usize, w: usize, lane: usize) -> Box<Location> {
        let t = (w * 32 + lane) as u32;
        let [bx, by, _] = self.block;
        let src = &self.k.source[pc];
        Box::new(Location {
            kernel: self.k.name.clone(),
            pc,
            line: src.line,
            instruction: src.text.clone(),
            cta: self.ctaid,
            thread: [t % bx, (t / bx) % by, t / (bx * by)],
        })
    }

    /// The unfenced generic stores an MMA's shared-operand read checks against: `None`
    /// without `check` (a re-read at completion) or when there are none.
    fn unfenced_stores(&self, check: bool) -> Option<UnfencedStores<'_>> {
        (check && self.unfenced_total > 0).then(|| UnfencedStores {
            thread: &self.unfenced,
            pc: &self.unfenced_pc,
            source: &self.k.source,
        })
    }

    fn fault(&self, pc: usize, w: usize, lane: usize, kind: FaultKind) -> SimError {
        SimError::Fault {
            at: self.location(pc, w, lane),
            kind,
        }
    }

    #[inline]
    fn ri(&self, w: usize, r: Reg) -> usize {
        (w * self.nregs + r as usize) * 32
    }

    #[inline]
    fn special(&self, s: Special, w: usize, lane: usize) -> u64 {
        let t = (w * 32 + lane) as u32;
        let [bx, by, _] = self.block;
        let tid = [t % bx, (t / bx) % by, t / (bx * by)];
        let l = lane as u32;
        (match s {
            Special::Tid(a) => tid[a.index()],
            Special::Ntid(a) => self.block[a.index()],
            Special::Ctaid(a) => self.ctaid[a.index()],
            Special::Nctaid(a) => self.grid[a.index()],
            Special::LaneId => l,
            // A hash of the CTA's progress and the thread: deterministic, and differing
            // between two reads, so that latency probes see arbitrary (not equal) times.
            Special::Clock if self.l2.is_some() => self.clock[t as usize] as u32,
            Special::Clock => mix64(
                self.thread_steps
                    .wrapping_add(u64::from(self.ctaid[0]) << 32)
                    .wrapping_add(u64::from(t))
                    .wrapping_mul(GOLDEN),
            ) as u32,
            Special::WarpId => w as u32,
            Special::LaneMaskEq => 1 << l,
            Special::LaneMaskLt => (1u32 << l) - 1,
            Special::LaneMaskLe => ((1u64 << (l + 1)) - 1) as u32,
            Special::LaneMaskGt => !(((1u64 << (l + 1)) - 1) as u32),
            Special::LaneMaskGe => !((1u32 << l) - 1),
        }) as u64
    }

    #[inline(always)]
    fn gather(&self, w: usize, s: Src) -> [u64; 32] {
        match s {
            Src::Reg(r) => {
                let i = self.ri(w, r);
                let mut out = [0u64; 32];
                out.copy_from_slice(&self.regs[i..i + 32]);
                out
            }
            Src::Imm(v) => [v; 32],
            Src::Special(sp) => std::array::from_fn(|l| self.special(sp, w, l)),
        }
    }

    #[inline]
    fn pred_mask(&self, w: usize, p: PredSrc) -> u32 {
        let v = self.gather(w, p.src);
        let mut m = 0u32;
        for (l, x) in v.iter().enumerate() {
            m |= ((*x != 0) as u32) << l;
        }
        if p.negate {
            !m
        } else {
            m
        }
    }

    #[inline(always)]
    fn put(&mut self, w: usize, d: Reg, exec: u32, vals: &[u64; 32], bits: u32) {
        let m = if bits >= 64 {
            u64::MAX
        } else {
            (1u64 << bits) - 1
        };
        let i = self.ri(w, d);
        if !self.ready_at.is_empty() {
            for l in lanes(exec) {
                self.ready_at[i + l] = self.result_ready[l];
            }
        }
        let dst = &mut self.regs[i..i + 32];
        if exec == u32::MAX {
            for (d, v) in dst.iter_mut().zip(vals) {
                *d = v & m;
            }
        } else {
            for (l, (d, v)) in dst.iter_mut().zip(vals).enumerate() {
                let sel = 0u64.wrapping_sub(((exec >> l) & 1) as u64);
                *d = (v & m & sel) | (*d & !sel);
            }
        }
    }

    /// Writes the bits of `m` as predicates.
    #[inline(always)]
    fn put_mask(&mut self, w: usize, d: Reg, exec: u32, m: u32) {
        let mut out = [0u64; 32];
        for (l, o) in out.iter_mut().enumerate() {
            *o = (m >> l & 1) as u64;
        }
        self.put(w, d, exec, &out, 1);
    }

    /// `f` on every lane (inactive lanes compute garbage that [`Cta::put`] drops).
    #[inline(always)]
    fn map1(&mut self, w: usize, exec: u32, d: Reg, a: Src, bits: u32, f: impl Fn(u64) -> u64) {
        let av = self.gather(w, a);
        let mut out = [0u64; 32];
        for l in 0..32 {
            out[l] = f(av[l]);
        }
        self.put(w, d, exec, &out, bits);
    }

    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn map2(
        &mut self,
        w: usize,
        exec: u32,
        d: Reg,
        a: Src,
        b: Src,
        bits: u32,
        f: impl Fn(u64, u64) -> u64,
    ) {
        let av = self.gather(w, a);
        let bv = self.gather(w, b);
        let mut out = [0u64; 32];
        for l in 0..32 {
            out[l] = f(av[l], bv[l]);
        }
        self.put(w, d, exec, &out, bits);
    }

    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn map3(
        &mut self,
        w: usize,
        exec: u32,
        d: Reg,
        a: Src,
        b: Src,
        c: Src,
        bits: u32,
        f: impl Fn(u64, u64, u64) -> u64,
    ) {
        let av = self.gather(w, a);
        let bv = self.gather(w, b);
        let cv = self.gather(w, c);
        let mut out = [0u64; 32];
        for l in 0..32 {
            out[l] = f(av[l], bv[l], cv[l]);
        }
        self.put(w, d, exec, &out, bits);
    }

    /// Moves the lanes of `group` to the next instruction.
    #[inline(always)]
    fn advance(&mut self, w: usize, group: u32) {
        if self.uniform[w] {
            debug_assert_eq!(group, self.ready[w]);
            self.wpc[w] += 1;
            return;
        }
        let base = w * 32;
        for l in lanes(group) {
            self.pc[base + l] += 1;
        }
    }

    /// The PC of lane `l` of warp `w`.
    fn lane_pc(&self, w: usize, l: usize) -> u32 {
        if self.uniform[w] && self.ready[w] >> l & 1 == 1 {
            self.wpc[w]
        } else {
            self.pc[w * 32 + l]
        }
    }

    /// Leaves the uniform fast path: writes the warp PC back to every ready lane.
    #[inline]
    fn materialize(&mut self, w: usize) {
        if self.uniform[w] {
            let base = w * 32;
            let pc = self.wpc[w];
            for l in lanes(self.ready[w]) {
                self.pc[base + l] = pc;
            }
            self.uniform[w] = false;
        }
    }

    #[inline]
    fn lane_addr(&self, w: usize, lane: usize, a: &Addr) -> u64 {
        let base = match a.base {
            AddrBase::Reg(r) => self.regs[self.ri(w, r) + lane],
            AddrBase::Abs(v) => v,
        };
        base.wrapping_add(a.offset as u64)
    }

    /// Checks an access and returns where it lands.
    fn locate(
        &self,
        space: Space,
        addr: u64,
        size: usize,
        access: &'static str,
    ) -> Result<Place, MemoryFault> {
        let fault = |kind, space, detail: String| MemoryFault {
            kind,
            access,
            space,
            address: addr,
            size: size as u32,
            detail,
        };
        // Access sizes are powers of two.
        if addr & (size as u64 - 1) != 0 {
            return Err(fault(
                MemoryFaultKind::Misaligned,
                space,
                format!("needs {size}-byte alignment"),
            ));
        }
        let space = match space {
            Space::Generic => {
                if (SHARED_WINDOW..SHARED_WINDOW + (1 << 32)).contains(&addr) {
                    return self
                        .locate(Space::Shared, addr - SHARED_WINDOW, size, access)
                        .map_err(|mut f| {
                            f.space = Space::Generic;
                            f.address = addr;
                            f
                        });
                }
                if (PARAM_WINDOW..PARAM_WINDOW + (1 << 32)).contains(&addr) {
                    Space::Param
                } else {
                    Space::Global
                }
            }
            s => s,
        };
        match space {
            Space::Shared => {
                let end = addr.checked_add(size as u64);
                if end.is_some_and(|e| e <= self.shared.len() as u64) {
                    Ok(Place::Shared(addr as usize))
                } else {
                    Err(fault(
                        MemoryFaultKind::OutOfBounds,
                        space,
                        format!("the CTA has {} bytes of shared memory", self.shared.len()),
                    ))
                }
            }
            Space::Param => {
                let off = addr.wrapping_sub(PARAM_WINDOW);
                if addr >= PARAM_WINDOW && off + size as u64 <= self.params.len() as u64 {
                    Ok(Place::Param(off as usize))
                } else {
                    Err(fault(
                        MemoryFaultKind::OutOfBounds,
                        space,
                        format!(
                            "the parameter buffer is [{PARAM_WINDOW:#x}, +{})",
                            self.params.len()
                        ),
                    ))
                }
            }
            _ => {
                if self.mem.slice(addr, size).is_some() {
                    Ok(Place::Global(addr))
                } else {
                    Err(fault(
                        MemoryFaultKind::OutOfBounds,
                        Space::Global,
                        self.mem.describe(addr),
                    ))
                }
            }
        }
    }

    fn read_bytes(&self, p: Place, out: &mut [u8]) {
        let n = out.len();
        match p {
            Place::Shared(o) => out.copy_from_slice(&self.shared[o..o + n]),
            Place::Param(o) => out.copy_from_slice(&self.params[o..o + n]),
            Place::Global(a) => out.copy_from_slice(self.mem.slice(a, n).expect("located")),
        }
    }

    fn write_bytes(&mut self, p: Place, data: &[u8]) {
        let n = data.len();
        match p {
            Place::Shared(o) => self.shared[o..o + n].copy_from_slice(data),
            Place::Param(_) => unreachable!("param stores are rejected before"),
            Place::Global(a) => self
                .mem
                .slice_mut(a, n)
                .expect("located")
                .copy_from_slice(data),
        }
    }

    fn step(&mut self, w: usize) -> Result<(), SimError> {
        let k = self.k;
        let base = w * 32;
        let (pc, group) = if self.uniform[w] {
            (self.wpc[w], self.ready[w])
        } else {
            let mut pc = u32::MAX;
            let mut group = 0u32;
            for l in lanes(self.ready[w]) {
                let p = self.pc[base + l];
                if p < pc {
                    pc = p;
                    group = 1 << l;
                } else if p == pc {
                    group |= 1 << l;
                }
            }
            if group == self.ready[w] {
                self.uniform[w] = true;
                self.wpc[w] = pc;
            }
            (pc, group)
        };
        let pcu = pc as usize;
        let inst = &k.code[pcu];
        let exec = match inst.guard {
            None => group,
            Some(g) => {
                group
                    & self.pred_mask(
                        w,
                        PredSrc {
                            src: Src::Reg(g.reg),
                            negate: g.negate,
                        },
                    )
            }
        };
        self.steps += 1;
        self.thread_steps += exec.count_ones() as u64;
        if self.l2.is_some() && exec != 0 {
            self.order_clock(pcu, w, exec, &inst.op);
        }
        if k.uses_wgmma && exec != 0 && !matches!(inst.op, Op::Wgmma(_) | Op::WgmmaSync(_)) {
            self.track_registers(pcu, w, exec)?;
        }
        if k.uses_tcgen05 && exec != 0 {
            if self.tmem.ld_pending_n[w] > 0 {
                self.check_ld_pending(pcu, w, exec)?;
            }
            self.check_st_pending(pcu, w, exec)?;
            self.check_fence_before(pcu, w, exec)?;
        }
        // Only routing: each family's arms live in its own file.
        let op = &inst.op;
        let flow = match family(op) {
            Family::Alu => self.step_alu(pcu, w, exec, op)?,
            Family::Memory => self.step_memory(pcu, w, exec, op)?,
            Family::Warp => self.step_warp(pcu, w, group, exec, op)?,
            Family::Sync => self.step_sync(pcu, w, group, exec, op)?,
            Family::Mbarrier => self.step_mbarrier(pcu, w, group, exec, op)?,
            Family::Bulk => self.step_bulk(pcu, w, exec, op)?,
            Family::Collective => {
                self.collective(pcu, w, group, exec)?;
                Flow::Moved
            }
            Family::Tcgen05 => {
                let Op::Tcgen05(t) = op else {
                    unreachable!("the tcgen05 family")
                };
                self.tcgen05(pcu, w, exec, t)?;
                Flow::Advance
            }
            Family::Control => self.step_control(pcu, w, group, exec, op)?,
        };
        if let Flow::Advance = flow {
            self.advance(w, group);
        }
        Ok(())
    }
}

/// The family of files that executes an instruction ([`family`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Family {
    /// Lane-wise register operations (`exec/alu.rs`).
    Alu,
    /// Loads, stores and atomics (`exec/memory.rs`).
    Memory,
    /// Warp-wide operations (`exec/warp.rs`).
    Warp,
    /// Barriers and fences (`exec/sync.rs`).
    Sync,
    /// mbarriers and the async copies that complete on them (`exec/mbarrier.rs`).
    Mbarrier,
    /// Bulk reductions and their groups (`exec/mbarrier.rs`).
    Bulk,
    /// Warpgroup collectives (`exec/wgmma.rs`).
    Collective,
    /// `tcgen05` (`exec/tcgen05.rs`).
    Tcgen05,
    /// Branches and exits (`exec/control.rs`).
    Control,
}

/// The family of `op`. The match is exhaustive, so that a new opcode has to pick one.
fn family(op: &Op) -> Family {
    match op {
        Op::Mov { .. }
        | Op::Pack { .. }
        | Op::Unpack { .. }
        | Op::Cvta { .. }
        | Op::Int { .. }
        | Op::IntUn { .. }
        | Op::MulWide { .. }
        | Op::Mad { .. }
        | Op::Float { .. }
        | Op::Fma { .. }
        | Op::FloatUn { .. }
        | Op::Setp { .. }
        | Op::Selp { .. }
        | Op::Pred { .. }
        | Op::PredNot { .. }
        | Op::Cvt { .. }
        | Op::CvtBf16x2 { .. }
        | Op::Prmt { .. } => Family::Alu,
        Op::Ld { .. } | Op::St { .. } | Op::Atom { .. } | Op::CreatePolicy { .. } => Family::Memory,
        Op::Shfl { .. }
        | Op::Elect { .. }
        | Op::Ballot { .. }
        | Op::ReduxMin { .. }
        | Op::Stmatrix { .. }
        | Op::MmaBf16 { .. }
        | Op::WarpSync { .. } => Family::Warp,
        Op::Bar { .. } | Op::Fence(_) => Family::Sync,
        Op::MbarrierInit { .. }
        | Op::MbarrierArrive { .. }
        | Op::MbarrierExpectTx { .. }
        | Op::MbarrierTryWait { .. }
        | Op::CpAsyncBulkTensor(_)
        | Op::CpAsyncBulk(_) => Family::Mbarrier,
        Op::TmaReduceAdd(_) | Op::BulkReduceAdd(_) | Op::BulkCommit | Op::BulkWait { .. } => {
            Family::Bulk
        }
        Op::Wgmma(_) | Op::WgmmaSync(_) | Op::SetMaxNReg { .. } => Family::Collective,
        Op::Tcgen05(_) => Family::Tcgen05,
        Op::Bra { .. } | Op::Exit | Op::Trap => Family::Control,
    }
}

/// What `step` does with the issuing lanes after an instruction family ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flow {
    /// They move on to the next instruction.
    Advance,
    /// The family set their PCs or blocked them itself (branches, exits, barriers and
    /// collectives).
    Moved,
}

#[derive(Debug, Clone, Copy)]
enum Place {
    Shared(usize),
    Param(usize),
    Global(u64),
}
