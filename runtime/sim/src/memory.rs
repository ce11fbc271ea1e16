//! Global memory: a bump allocator of 256-byte-aligned device addresses with guard gaps, and
//! typed host copies.

use std::fmt;

/// A device address in the simulated 64-bit global space.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DevPtr(pub u64);

impl DevPtr {
    /// The address `bytes` further on.
    pub fn offset(self, bytes: u64) -> DevPtr {
        DevPtr(self.0 + bytes)
    }

    /// The raw address.
    pub fn addr(self) -> u64 {
        self.0
    }
}

impl fmt::Display for DevPtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// A plain value with a little-endian device representation.
pub trait Element: Copy {
    /// Bytes per element.
    const SIZE: usize;
    /// Writes `self` into `out[..SIZE]`.
    fn write_le(self, out: &mut [u8]);
    /// Reads from `b[..SIZE]`.
    fn read_le(b: &[u8]) -> Self;
}

macro_rules! element {
    ($($t:ty),*) => {$(
        impl Element for $t {
            const SIZE: usize = std::mem::size_of::<$t>();
            fn write_le(self, out: &mut [u8]) {
                out[..Self::SIZE].copy_from_slice(&self.to_le_bytes());
            }
            fn read_le(b: &[u8]) -> Self {
                let mut a = [0u8; std::mem::size_of::<$t>()];
                a.copy_from_slice(&b[..Self::SIZE]);
                <$t>::from_le_bytes(a)
            }
        }
    )*};
}

element!(u8, i8, u16, i16, u32, i32, u64, i64, f32, f64);

impl Element for half::bf16 {
    const SIZE: usize = 2;
    fn write_le(self, out: &mut [u8]) {
        self.to_bits().write_le(out)
    }
    fn read_le(b: &[u8]) -> Self {
        half::bf16::from_bits(u16::read_le(b))
    }
}

impl Element for half::f16 {
    const SIZE: usize = 2;
    fn write_le(self, out: &mut [u8]) {
        self.to_bits().write_le(out)
    }
    fn read_le(b: &[u8]) -> Self {
        half::f16::from_bits(u16::read_le(b))
    }
}

/// The first address the allocator hands out (above 4 GiB, so a pointer truncated to 32 bits
/// is never a valid address).
pub const HEAP_BASE: u64 = 0x0000_7f00_0000_0000;

/// Alignment of every allocation.
pub const ALLOC_ALIGN: u64 = 256;

/// Unallocated bytes left after every allocation, so small overruns hit no allocation.
pub const GUARD_BYTES: u64 = 4096;

#[derive(Debug, Clone)]
pub(crate) struct Allocation {
    pub start: u64,
    pub name: String,
    pub data: Vec<u8>,
}

/// The simulated global memory.
#[derive(Debug, Clone)]
pub struct GlobalMemory {
    allocs: Vec<Allocation>,
    next: u64,
}

impl Default for GlobalMemory {
    fn default() -> Self {
        GlobalMemory {
            allocs: Vec::new(),
            next: HEAP_BASE,
        }
    }
}

impl GlobalMemory {
    /// Allocates `bytes` zeroed bytes named `name` (for error messages).
    ///
    /// # Panics
    /// When the host cannot provide the memory; [`GlobalMemory::try_alloc`] returns an error
    /// instead.
    pub fn alloc(&mut self, name: &str, bytes: usize) -> DevPtr {
        self.try_alloc(name, bytes)
            .unwrap_or_else(|e| panic!("simulated allocation: {e}"))
    }

    /// [`GlobalMemory::alloc`], with an error instead of an abort when the host memory (or the
    /// simulated address space) cannot hold `bytes` more.
    pub fn try_alloc(&mut self, name: &str, bytes: usize) -> Result<DevPtr, String> {
        let start = self.next;
        let refused = || format!("cannot allocate {bytes} bytes for `{name}`");
        let next = start
            .checked_add(bytes as u64)
            .and_then(|end| end.checked_next_multiple_of(ALLOC_ALIGN))
            .and_then(|end| end.checked_add(GUARD_BYTES))
            .ok_or_else(refused)?;
        let mut data = Vec::new();
        data.try_reserve_exact(bytes).map_err(|_| refused())?;
        data.resize(bytes, 0);
        self.next = next;
        self.allocs.push(Allocation {
            start,
            name: name.to_string(),
            data,
        });
        Ok(DevPtr(start))
    }

    fn find(&self, addr: u64) -> Option<usize> {
        // Allocations are created in ascending address order.
        let i = self.allocs.partition_point(|a| a.start <= addr);
        i.checked_sub(1)
    }

    /// The bytes `[addr, addr+len)` if they lie inside one allocation.
    pub(crate) fn slice(&self, addr: u64, len: usize) -> Option<&[u8]> {
        let a = &self.allocs[self.find(addr)?];
        let off = (addr - a.start) as usize;
        a.data.get(off..off.checked_add(len)?)
    }

    /// Mutable [`GlobalMemory::slice`].
    pub(crate) fn slice_mut(&mut self, addr: u64, len: usize) -> Option<&mut [u8]> {
        let i = self.find(addr)?;
        let a = &mut self.allocs[i];
        let off = (addr - a.start) as usize;
        a.data.get_mut(off..off.checked_add(len)?)
    }

    /// Describes where `addr` lies relative to the allocations, for error messages.
    pub(crate) fn describe(&self, addr: u64) -> String {
        match self.find(addr) {
            Some(i) => {
                let a = &self.allocs[i];
                let end = a.start + a.data.len() as u64;
                if addr < end {
                    format!(
                        "crosses the end of allocation `{}` [{:#x}, +{}) at offset {}",
                        a.name,
                        a.start,
                        a.data.len(),
                        addr - a.start
                    )
                } else {
                    format!(
                        "{} bytes past the end of allocation `{}` [{:#x}, +{})",
                        addr - end,
                        a.name,
                        a.start,
                        a.data.len()
                    )
                }
            }
            None => match self.allocs.first() {
                Some(a) if addr < a.start => format!(
                    "below every allocation; the lowest is `{}` at {:#x}",
                    a.name, a.start
                ),
                _ => "no allocation exists".to_string(),
            },
        }
    }

    /// Copies `data` to `ptr`.
    pub fn write<T: Element>(&mut self, ptr: DevPtr, data: &[T]) -> Result<(), String> {
        let len = data.len() * T::SIZE;
        let desc = self.describe(ptr.0);
        let dst = self
            .slice_mut(ptr.0, len)
            .ok_or_else(|| format!("write of {len} bytes at {ptr}: {desc}"))?;
        for (chunk, v) in dst.chunks_exact_mut(T::SIZE).zip(data) {
            v.write_le(chunk);
        }
        Ok(())
    }

    /// Copies `len` elements from `ptr`.
    pub fn read<T: Element>(&self, ptr: DevPtr, len: usize) -> Result<Vec<T>, String> {
        let bytes = len * T::SIZE;
        let src = self
            .slice(ptr.0, bytes)
            .ok_or_else(|| format!("read of {bytes} bytes at {ptr}: {}", self.describe(ptr.0)))?;
        Ok(src.chunks_exact(T::SIZE).map(T::read_le).collect())
    }
}
