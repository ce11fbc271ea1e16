//! Outputs recorded on an H200, kept in `tests/data/h200_recorded.bin` so that CI compares the
//! simulator with the hardware without a GPU. `h200_compare.rs` appends a record per output
//! when `H200_DUMP` is set; the file is that dump's `h200_recorded.bin`.
//!
//! Format: records of `[name length: u16 LE][name: UTF-8][payload length: u32 LE][payload]`.

/// The record name of a wgmma probe set's first problem, first [`probe_rows`] rows.
pub fn probe_record(set: &str) -> String {
    format!("wgmma probe: {set}")
}

/// Rows of a probe set's first problem that are recorded (all 64 columns each): 16, or all
/// 64 for the underflow set, whose accumulators that pin the `2^-158` floor of the sum are
/// few (11 in its first problem, none in its first 16 rows).
pub fn probe_rows(set: &str) -> usize {
    if set.contains("underflow") {
        64
    } else {
        16
    }
}

/// Appends one record to `$H200_DUMP/h200_recorded.bin` when the variable is set.
pub fn record(name: &str, payload: &[u8]) {
    use std::io::Write;
    let Ok(dir) = std::env::var("H200_DUMP") else {
        return;
    };
    let path = std::path::Path::new(&dir).join("h200_recorded.bin");
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut rec = Vec::with_capacity(6 + name.len() + payload.len());
    rec.extend((name.len() as u16).to_le_bytes());
    rec.extend(name.as_bytes());
    rec.extend((payload.len() as u32).to_le_bytes());
    rec.extend(payload);
    f.write_all(&rec)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}

/// Every record of `bytes`, in order.
pub fn parse(bytes: &[u8]) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let n = u16::from_le_bytes([bytes[at], bytes[at + 1]]) as usize;
        let name = String::from_utf8(bytes[at + 2..at + 2 + n].to_vec()).expect("UTF-8 name");
        at += 2 + n;
        let len = u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes")) as usize;
        out.push((name, bytes[at + 4..at + 4 + len].to_vec()));
        at += 4 + len;
    }
    out
}
