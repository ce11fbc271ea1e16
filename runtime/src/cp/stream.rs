//! [`Collective`] on NCCL (feature `nccl`: cudarc's `nccl`, loaded at run time like the
//! driver), on a stream of its own: each collective first waits for the work issued so far on
//! the [`CudaBackend`]'s stream, and [`Collective::wait`] makes that stream wait for the
//! collectives, so the backend's work in between overlaps them.
//!
//! The communicator is a raw `ncclComm_t`, so that one made elsewhere serves as well: by
//! [`NcclCollective::init_rank`] (`ncclCommInitRank` with an id shared by the caller's own
//! means), by cudarc's `nccl::Comm`, or by PyTorch's NCCL process group. Rank and size are
//! read from it. One rank per GPU, as NCCL requires.
//!
//! Layer 5 of the crate (cudarc convenience API).

use super::Collective;
use crate::backend::Span;
use crate::cuda::CudaBackend;
use crate::error::RuntimeError;
use cudarc::driver::CudaStream;
use cudarc::nccl::{result, sys};
use half::bf16;
use std::sync::Arc;

/// One rank's NCCL communicator as a [`Collective`].
pub struct NcclCollective {
    comm: sys::ncclComm_t,
    rank: usize,
    ranks: usize,
    owned: bool,
    /// The collectives' stream (made on first use, on the backend's context), and whether
    /// collectives were issued on it since the last [`Collective::wait`].
    side: Option<Arc<CudaStream>>,
    pending: bool,
}

fn nccl_error(call: &'static str, e: result::NcclError) -> RuntimeError {
    RuntimeError::Collective {
        call,
        message: format!("{e:?}"),
    }
}

/// Whether the NCCL library can be loaded (cudarc panics on the first call otherwise).
pub fn nccl_present() -> bool {
    #[cfg(feature = "dynamic-loading")]
    {
        // SAFETY: only probes for the shared library.
        unsafe { sys::is_culib_present() }
    }
    #[cfg(not(feature = "dynamic-loading"))]
    {
        true
    }
}

fn require_nccl(call: &'static str) -> Result<(), RuntimeError> {
    if nccl_present() {
        Ok(())
    } else {
        Err(RuntimeError::Collective {
            call,
            message: "libnccl.so could not be loaded (set LD_LIBRARY_PATH to NCCL's lib \
                      folder, e.g. site-packages/nvidia/nccl/lib, with a libnccl.so link)"
                .into(),
        })
    }
}

impl NcclCollective {
    /// A new communicator for rank `rank` of `ranks`, joined with `id` (from
    /// `cudarc::nccl::result::get_uniqueid` on one rank, shared with the others), on the
    /// current device; destroyed on drop.
    ///
    /// # Errors
    /// [`RuntimeError::Collective`] naming the failed NCCL call (NCCL missing, a wrong id or
    /// rank); [`RuntimeError::Input`] for a rank or size past `i32`.
    pub fn init_rank(
        id: sys::ncclUniqueId,
        rank: usize,
        ranks: usize,
    ) -> Result<Self, RuntimeError> {
        let (r, n) = (
            i32::try_from(rank).map_err(|_| RuntimeError::input("rank", rank, "an int"))?,
            i32::try_from(ranks).map_err(|_| RuntimeError::input("ranks", ranks, "an int"))?,
        );
        require_nccl("ncclCommInitRank")?;
        let mut comm = std::ptr::null_mut();
        // SAFETY: `comm` is written by NCCL; the id is plain data.
        unsafe { result::comm_init_rank(&mut comm, n, id, r) }
            .map_err(|e| nccl_error("ncclCommInitRank", e))?;
        let mut c = unsafe { Self::from_raw(comm) }?;
        c.owned = true;
        Ok(c)
    }

    /// Wraps a communicator another library owns (not destroyed on drop).
    ///
    /// # Safety
    /// `comm` must be a valid, initialized NCCL communicator that outlives the wrapper.
    ///
    /// # Errors
    /// [`RuntimeError::Collective`] when NCCL is missing or cannot report the rank or size.
    pub unsafe fn from_raw(comm: sys::ncclComm_t) -> Result<Self, RuntimeError> {
        require_nccl("ncclCommUserRank")?;
        // SAFETY: the caller guarantees `comm` is valid.
        let rank = unsafe { result::comm_user_rank(comm) }
            .map_err(|e| nccl_error("ncclCommUserRank", e))?;
        let ranks =
            unsafe { result::comm_count(comm) }.map_err(|e| nccl_error("ncclCommCount", e))?;
        Ok(NcclCollective {
            comm,
            rank: rank as usize,
            ranks: ranks as usize,
            owned: false,
            side: None,
            pending: false,
        })
    }
}

impl NcclCollective {
    /// The collectives' stream, after it waits for the work issued so far on `backend`'s.
    fn side_after(&mut self, backend: &CudaBackend) -> Result<sys::cudaStream_t, RuntimeError> {
        let main = backend.stream();
        let fresh = match &self.side {
            Some(s) => !Arc::ptr_eq(s.context(), main.context()),
            None => true,
        };
        if fresh {
            // `fork` makes the new stream wait for `main`.
            self.side = Some(
                main.fork()
                    .map_err(RuntimeError::driver("cuStreamCreate"))?,
            );
        } else if let Some(s) = &self.side {
            s.join(main)
                .map_err(RuntimeError::driver("cuStreamWaitEvent"))?;
        }
        self.pending = true;
        let side = self.side.as_ref().expect("made above");
        Ok(side.cu_stream() as _)
    }
}

impl Drop for NcclCollective {
    fn drop(&mut self) {
        if self.owned {
            // SAFETY: created by `init_rank` and not used afterwards.
            let _ = unsafe { result::comm_destroy(self.comm) };
        }
    }
}

impl Collective<CudaBackend> for NcclCollective {
    fn ranks(&self) -> usize {
        self.ranks
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn all_gather_bf16(
        &mut self,
        backend: &mut CudaBackend,
        send: Span<bf16>,
        recv: Span<bf16>,
    ) -> Result<(), RuntimeError> {
        if recv.len != self.ranks * send.len {
            return Err(RuntimeError::input(
                "recv",
                recv.len,
                format!("ranks·send.len = {}", self.ranks * send.len),
            ));
        }
        let stream = self.side_after(backend)?;
        // SAFETY: both spans are device buffers of the lengths checked above, ordered after
        // the backend's work so far; NCCL's bf16 is a 16-bit float of the same layout.
        unsafe {
            result::all_gather(
                send.addr as *const _,
                recv.addr as *mut _,
                send.len,
                sys::ncclDataType_t::ncclBfloat16,
                self.comm,
                stream as _,
            )
        }
        .map(|_| ())
        .map_err(|e| nccl_error("ncclAllGather", e))
    }

    fn reduce_scatter_f32_in_place(
        &mut self,
        backend: &mut CudaBackend,
        buf: Span<f32>,
    ) -> Result<(), RuntimeError> {
        if !buf.len.is_multiple_of(self.ranks) {
            return Err(RuntimeError::input(
                "buf",
                buf.len,
                "a multiple of the ranks",
            ));
        }
        let n = buf.len / self.ranks;
        let stream = self.side_after(backend)?;
        let recv = buf.addr + (4 * self.rank * n) as u64;
        // SAFETY: in place as NCCL allows it (`recvbuff = sendbuff + rank·recvcount`), on a
        // device buffer of `ranks·n` f32, ordered after the backend's work so far.
        unsafe {
            result::reduce_scatter(
                buf.addr as *const _,
                recv as *mut _,
                n,
                sys::ncclDataType_t::ncclFloat32,
                sys::ncclRedOp_t::ncclSum,
                self.comm,
                stream as _,
            )
        }
        .map(|_| ())
        .map_err(|e| nccl_error("ncclReduceScatter", e))
    }

    fn wait(&mut self, backend: &mut CudaBackend) -> Result<(), RuntimeError> {
        if let (true, Some(side)) = (self.pending, &self.side) {
            backend
                .stream()
                .join(side)
                .map_err(RuntimeError::driver("cuStreamWaitEvent"))?;
            self.pending = false;
        }
        Ok(())
    }
}
