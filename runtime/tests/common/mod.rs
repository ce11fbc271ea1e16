//! Helpers shared by the runtime's integration tests.

#![allow(dead_code)] // each test file uses part of it

use msa_runtime::backend::TileMapSpec;
use msa_runtime::tma::TensorMap;
use msa_runtime::{Backend, KernelArg, KernelSpec, RuntimeError, Schedule, ScheduleError};

/// The six raw fields of a schedule, to rebuild it with one field changed.
#[derive(Clone)]
pub struct Parts {
    pub row_ptr: Vec<i32>,
    pub q_indices: Vec<i32>,
    pub metadata: Vec<i32>,
    pub work_count: i32,
    pub cu_seqlens: Vec<i32>,
    pub ws_starts: Vec<i32>,
}

impl Parts {
    pub fn of(s: &Schedule) -> Parts {
        Parts {
            row_ptr: s.row_ptr().to_vec(),
            q_indices: s.q_indices().to_vec(),
            metadata: s.scheduler_metadata().to_vec(),
            work_count: s.work_count(),
            cu_seqlens: s.cu_seqlens().to_vec(),
            ws_starts: s.document_workspace_starts().to_vec(),
        }
    }

    /// `Schedule::new` on the fields, which validates them.
    pub fn build(self) -> Result<Schedule, ScheduleError> {
        Schedule::new(
            self.row_ptr,
            self.q_indices,
            self.metadata,
            self.work_count,
            self.cu_seqlens,
            self.ws_starts,
        )
    }

    /// Metadata rows, 6 columns each.
    pub fn items(&self) -> Vec<[i32; 6]> {
        self.metadata
            .chunks_exact(6)
            .map(|c| c.try_into().unwrap())
            .collect()
    }

    /// The same fields with `items` as the metadata rows.
    pub fn with_items(mut self, items: &[[i32; 6]]) -> Parts {
        self.metadata = items.concat();
        self
    }
}

/// A backend that records what the host flow issues and runs nothing: the host checks can
/// be fuzzed without simulating a kernel.
#[derive(Default)]
pub struct Recorder {
    /// Bytes handed out so far (the next buffer's offset).
    pub next: u64,
    /// Each upload's and zeroing's label and each launched kernel's name, in order.
    pub issued: Vec<&'static str>,
}

impl Backend for Recorder {
    type Buffer = u64;
    fn capability(&self) -> (i32, i32) {
        (9, 0)
    }
    fn sm_count(&self) -> usize {
        8
    }
    fn ordinal(&self) -> usize {
        0
    }
    fn memory_space(&self) -> u64 {
        7
    }
    fn alloc(&mut self, _: &'static str, bytes: usize) -> Result<u64, RuntimeError> {
        // Far above every address the test hands out.
        let at = (1 << 56) + self.next;
        self.next += (bytes as u64).next_multiple_of(256);
        Ok(at)
    }
    fn address(&self, buffer: &u64) -> u64 {
        *buffer
    }
    fn upload(&mut self, what: &'static str, _: u64, _: &[u8]) -> Result<(), RuntimeError> {
        self.issued.push(what);
        Ok(())
    }
    fn zero(&mut self, what: &'static str, _: u64, _: usize) -> Result<(), RuntimeError> {
        self.issued.push(what);
        Ok(())
    }
    fn copy(&mut self, what: &'static str, _: u64, _: u64, _: usize) -> Result<(), RuntimeError> {
        self.issued.push(what);
        Ok(())
    }
    fn download(&mut self, _: &'static str, _: u64, b: usize) -> Result<Vec<u8>, RuntimeError> {
        Ok(vec![0; b])
    }
    fn load(&mut self, _: &KernelSpec) -> Result<(), RuntimeError> {
        Ok(())
    }
    fn tensor_map(&mut self, spec: &TileMapSpec, base: u64) -> Result<TensorMap, RuntimeError> {
        spec.validate(base)?;
        Ok(TensorMap([0; 128]))
    }
    unsafe fn launch(
        &mut self,
        kernel: &KernelSpec,
        _: (u32, u32, u32),
        _: &[KernelArg],
    ) -> Result<(), RuntimeError> {
        self.issued.push(kernel.name);
        Ok(())
    }
}
