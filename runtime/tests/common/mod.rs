//! Helpers shared by the runtime's integration tests.

#![allow(dead_code)] // each test file uses part of it

use msa_runtime::{Schedule, ScheduleError};

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
