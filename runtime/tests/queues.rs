//! `MsaBackward`'s workspaces stay on the queue (stream) that allocated them: a call on
//! another queue frees them and allocates new ones there, and a call on the same queue reuses
//! them (issue 17). Checked on a recording backend that launches nothing, through
//! `MsaBackward::reserve`, which makes exactly the allocations a call makes.

use msa_runtime::backend::TileMapSpec;
use msa_runtime::tma::TensorMap;
use msa_runtime::{
    Backend, KernelArg, KernelSpec, MsaBackward, ResidentSchedule, RuntimeError, ScheduleBuildSizes,
};
use std::cell::RefCell;
use std::rc::Rc;

/// What the backend saw: `(queue, bytes)` of each allocation, and the queues buffers were
/// freed from.
#[derive(Default)]
struct Log {
    allocs: Vec<(u64, usize)>,
    frees: Vec<u64>,
}

/// A buffer that records, when dropped, the queue it was allocated on.
struct Buffer {
    addr: u64,
    queue: u64,
    log: Rc<RefCell<Log>>,
}

impl Drop for Buffer {
    fn drop(&mut self) {
        self.log.borrow_mut().frees.push(self.queue);
    }
}

struct Recorder {
    queue: u64,
    next: u64,
    log: Rc<RefCell<Log>>,
}

impl Backend for Recorder {
    type Buffer = Buffer;

    fn capability(&self) -> (i32, i32) {
        (9, 0)
    }

    fn sm_count(&self) -> usize {
        132
    }

    fn ordinal(&self) -> usize {
        0
    }

    fn memory_space(&self) -> u64 {
        7
    }

    fn queue(&self) -> u64 {
        self.queue
    }

    fn alloc(&mut self, _what: &'static str, bytes: usize) -> Result<Buffer, RuntimeError> {
        self.log.borrow_mut().allocs.push((self.queue, bytes));
        let addr = self.next;
        self.next += (bytes as u64).next_multiple_of(256).max(256);
        Ok(Buffer {
            addr,
            queue: self.queue,
            log: self.log.clone(),
        })
    }

    fn address(&self, buffer: &Buffer) -> u64 {
        buffer.addr
    }

    fn upload(&mut self, _: &'static str, _: u64, _: &[u8]) -> Result<(), RuntimeError> {
        Ok(())
    }

    fn zero(&mut self, _: &'static str, _: u64, _: usize) -> Result<(), RuntimeError> {
        Ok(())
    }

    fn copy(&mut self, _: &'static str, _: u64, _: u64, _: usize) -> Result<(), RuntimeError> {
        Ok(())
    }

    fn download(&mut self, _: &'static str, _: u64, bytes: usize) -> Result<Vec<u8>, RuntimeError> {
        Ok(vec![0; bytes])
    }

    fn load(&mut self, _: &KernelSpec) -> Result<(), RuntimeError> {
        Ok(())
    }

    fn tensor_map(&mut self, _: &TileMapSpec, _: u64) -> Result<TensorMap, RuntimeError> {
        Ok(TensorMap([0; 128]))
    }

    unsafe fn launch(
        &mut self,
        _: &KernelSpec,
        _: (u32, u32, u32),
        _: &[KernelArg],
    ) -> Result<(), RuntimeError> {
        Ok(())
    }
}

#[test]
fn workspaces_stay_on_the_queue_that_allocated_them() {
    let log = Rc::new(RefCell::new(Log::default()));
    let on = |queue| Recorder {
        queue,
        next: 0x10_0000 * (queue + 1),
        log: log.clone(),
    };
    let (mut a, mut b) = (on(1), on(2));
    let sizes = ScheduleBuildSizes::new(4096, 2, 4096, 64).unwrap();
    let schedule_a = ResidentSchedule::new(&mut a, sizes).unwrap();
    let schedule_b = ResidentSchedule::new(&mut b, sizes).unwrap();
    let mut backward = MsaBackward::<Recorder>::new();

    backward.reserve(&mut a, &schedule_a).unwrap();
    let first = backward.allocation_count();
    assert_eq!(first, 2, "the gradient and task workspaces");
    backward.reserve(&mut a, &schedule_a).unwrap();
    assert_eq!(backward.allocation_count(), first, "same queue: reused");
    assert!(log.borrow().frees.is_empty());

    // Another queue of the same memory space: queue 1's workspaces are freed (by their own
    // buffers, so on queue 1) and new ones allocated on queue 2.
    backward.reserve(&mut b, &schedule_b).unwrap();
    assert_eq!(backward.allocation_count(), first + 2);
    assert_eq!(log.borrow().frees, vec![1, 1]);
    let on_b: Vec<u64> = log.borrow().allocs.iter().map(|&(q, _)| q).collect();
    // Two resident schedules, then the workspaces on 1, then on 2.
    assert_eq!(on_b, vec![1, 2, 1, 1, 2, 2]);

    // And back: queue 2's are freed, new ones made on queue 1.
    backward.reserve(&mut a, &schedule_a).unwrap();
    assert_eq!(backward.allocation_count(), first + 4);
    assert_eq!(log.borrow().frees, vec![1, 1, 2, 2]);
    drop(backward);
    assert_eq!(log.borrow().frees, vec![1, 1, 2, 2, 1, 1]);
}
