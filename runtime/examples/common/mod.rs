//! What the examples share: reading the benchmark's input files.

use std::error::Error;

/// A little-endian int32 file (`DIR/<case>.q2k.i32`, `DIR/<case>.cu_seqlens.i32`), refusing one
/// whose length is not a whole number of int32.
pub fn read_i32s(path: &str) -> Result<Vec<i32>, Box<dyn Error>> {
    let bytes = std::fs::read(path).map_err(|e| format!("{path}: {e}"))?;
    if bytes.len() % 4 != 0 {
        return Err(format!(
            "{path}: {} bytes is not a whole number of int32",
            bytes.len()
        )
        .into());
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}
