//! Topology constants and the CTA-walk rule (`docs/design.md` §1.1, §2.4).
//!
//! This is the one home of the attention topology the kernels are compiled for and of the walk
//! rule the device task build mirrors (thread 0 of its scatter step writes the descriptor the main
//! kernel's prologue reads). The host never learns the exact task count: it launches
//! [`grid_launch_bound`] CTAs and every CTA at or past the descriptor's grid size walks nothing.

use std::ops::Range;

/// Keys per document-local block, and the alignment unit of the workspace.
pub const BLOCK_SIZE: usize = 128;

/// Head dimension of Q, K, V and dO.
pub const HEAD_DIM: usize = 128;

/// Dimension of the indexer's query and key projections (selection only).
pub const INDEX_DIM: usize = 128;

/// Number of query heads.
pub const NUM_Q_HEADS: usize = 64;

/// Number of key/value heads (GQA groups); kv head `g` serves q-heads `16g..16g+16`.
pub const NUM_KV_HEADS: usize = 4;
/// Elements of one token's query-side row `[64, 128]` (q, dO, O, dQ).
pub(crate) const Q_ROW: usize = NUM_Q_HEADS * HEAD_DIM;
/// Elements of one K/V row `[4, 128]` (compact, or aligned in the workspace layout).
pub(crate) const KV_ROW: usize = NUM_KV_HEADS * HEAD_DIM;

/// Number of index heads; index head `g` selects the blocks of GQA group `g`.
pub const NUM_INDEX_HEADS: usize = 4;

/// Query heads served by one index head (and one kv head): `NUM_Q_HEADS / NUM_INDEX_HEADS`.
pub const MAIN_HEADS_PER_INDEX: usize = NUM_Q_HEADS / NUM_INDEX_HEADS;

/// Key blocks each query selects (`q2k` entries per query and index head; `-1` pads).
pub const TOPK_BLOCKS: usize = 16;

/// Queries per backward task: 8 query slots × 16 heads fold into one 128-column tile.
pub const QUERY_CHUNK: usize = 8;

/// Task rows per CTA while the task count is at most [`ROWS_PER_CTA_SWITCH`].
pub const ROWS_PER_CTA_SMALL: usize = 4;

/// Task rows per CTA above [`ROWS_PER_CTA_SWITCH`] (halves the dK/dV flushes per bucket vs 32).
pub const ROWS_PER_CTA_LARGE: usize = 64;

/// Largest task count that still walks [`ROWS_PER_CTA_SMALL`] rows per CTA.
pub const ROWS_PER_CTA_SWITCH: usize = 2400;

/// The seed's locality window (`docs/design.md` §2.4): 512 queries, global over the packed stream.
/// This implementation replaced it by [`Locality`]'s per-document windows; the constant stays
/// as the seed's documented value only.
pub const LOCALITY_WINDOW: usize = 512;

/// The seed's bin limit `4 · ceil(T/512) · max(W/128, 1) <= 2^22` (about 250k tokens), which
/// grew as T². [`Locality`]'s bins grow linearly and have no such limit; the constant stays as
/// the seed's documented value only.
pub const MAX_BINS: usize = 1 << 22;

/// Most tokens one backward call takes: the main kernels index the dQ pool
/// `[T, 32, 128]` in 32-bit words, `(row·32 + head pair)·128 + d < 2^32`.
pub const MAX_TOKENS: usize = 1 << 20;

/// The locality rule of the task order: the tasks of one index head and one document are
/// grouped by window of document-local queries, then by key block, then by query.
///
/// A document of `B` key blocks gets windows of `2^s` queries,
/// `s = min(max(min_window_log2, ceil(log2 B) + blocks_log2), max_window_log2)`. Within one
/// window a key block's tasks are consecutive (one segment, one K/V load and one dK/dV
/// flush), and a window of `2^s >= 2^blocks_log2·B` queries gives each block about
/// `2^s·16/B/8 >= 2^(blocks_log2+1)` tasks (64 with the default), so the segments stay long
/// however long the document is; the seed's fixed 512-query window left one task per segment
/// past about 100K tokens (figures in `bench/README.md`). `blocks_log2 = 7` makes each
/// document one window (`2^s >= 128·B`). The bins number
/// `Σ_docs windows·B <= T/2^blocks_log2 + T/128 + docs` per head: linear in `T`, unless the cap
/// `max_window_log2` binds: windows under `B` queries number `T/2^max` and add up to
/// `T·ceil(T/128)/2^max` bins per head, quadratic in `T` (the KV forward's L2-sized windows).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Locality {
    /// Smallest window, as a power of two of queries.
    pub min_window_log2: u32,
    /// Windows hold at least `2^blocks_log2` queries per key block of the document.
    pub blocks_log2: u32,
    /// Largest window, as a power of two of queries; [`Locality::NO_CAP`] for none. It wins
    /// over the other two fields.
    pub max_window_log2: u32,
}

impl Default for Locality {
    /// Windows of at least 8192 queries and at least 32 queries per key block: measured on
    /// the H200 against `blocks_log2` 3, 4, 6 and 7 at every bench length (`bench/README.md`,
    /// "Long documents"). Documents of at most 256 blocks (32K tokens) get the same 8192-query
    /// windows as with 3; longer ones get windows 4× larger.
    fn default() -> Self {
        Locality::uncapped(13, 5)
    }
}

impl Locality {
    /// Largest `min_window_log2` accepted (windows of 2^30 queries cover any document).
    pub const MAX_MIN_WINDOW_LOG2: u32 = 30;
    /// Largest `blocks_log2` accepted (keeps `blocks · 2^blocks_log2` below 2^31).
    pub const MAX_BLOCKS_LOG2: u32 = 7;
    /// `max_window_log2` of no cap: no document's window reaches 2^30 queries.
    pub const NO_CAP: u32 = 30;

    /// The rule `min_window_log2, blocks_log2` without a cap.
    pub const fn uncapped(min_window_log2: u32, blocks_log2: u32) -> Locality {
        Locality::capped(min_window_log2, blocks_log2, Locality::NO_CAP)
    }

    /// The rule `min_window_log2, blocks_log2` with windows of at most `2^max_window_log2`.
    pub const fn capped(min_window_log2: u32, blocks_log2: u32, max_window_log2: u32) -> Locality {
        Locality {
            min_window_log2,
            blocks_log2,
            max_window_log2,
        }
    }

    /// Checks both fields against their bounds.
    pub fn validate(&self) -> Result<(), String> {
        if self.min_window_log2 > Self::MAX_MIN_WINDOW_LOG2 {
            return Err(format!(
                "min_window_log2 = {} is above {}",
                self.min_window_log2,
                Self::MAX_MIN_WINDOW_LOG2
            ));
        }
        if self.blocks_log2 > Self::MAX_BLOCKS_LOG2 {
            return Err(format!(
                "blocks_log2 = {} is above {}",
                self.blocks_log2,
                Self::MAX_BLOCKS_LOG2
            ));
        }
        if self.max_window_log2 > Self::NO_CAP || self.max_window_log2 < self.min_window_log2 {
            return Err(format!(
                "max_window_log2 = {} is outside min_window_log2 = {} ..= {}",
                self.max_window_log2,
                self.min_window_log2,
                Self::NO_CAP
            ));
        }
        Ok(())
    }

    /// `log2` of the window of a document of `num_blocks` key blocks.
    pub fn window_log2(&self, num_blocks: usize) -> u32 {
        let need = (num_blocks.max(1) as u64) << self.blocks_log2;
        let ceil_log2 = u64::BITS - (need - 1).leading_zeros();
        ceil_log2
            .max(self.min_window_log2)
            .min(self.max_window_log2)
    }

    /// Bins of one index head for a document of `len` tokens: its windows times its blocks.
    pub fn document_bins(&self, len: usize) -> usize {
        let blocks = len.div_ceil(BLOCK_SIZE);
        let window = 1usize << self.window_log2(blocks);
        len.div_ceil(window) * blocks
    }

    /// An upper bound on the bins of one index head from the token and document counts alone:
    /// `ceil(T/2^blocks_log2) + ceil(T/128) + docs`, at least 1, plus
    /// `ceil(T·ceil(T/128)/2^max_window_log2)` under a cap (saturating).
    pub fn bins_per_head_bound(&self, num_tokens: usize, num_docs: usize) -> usize {
        let blocks = num_tokens.div_ceil(BLOCK_SIZE);
        // A document whose window the cap shortens has `ceil(L/2^max)·B <= L·B/2^max + B`
        // bins; one it does not, `<= L/2^blocks_log2 + B`.
        let capped = if self.max_window_log2 < Self::NO_CAP {
            (num_tokens as u128 * blocks as u128).div_ceil(1u128 << self.max_window_log2)
        } else {
            0
        };
        let base = num_tokens.div_ceil(1 << self.blocks_log2) + blocks + num_docs;
        usize::try_from(capped)
            .ok()
            .and_then(|c| c.checked_add(base))
            .unwrap_or(usize::MAX)
            .max(1)
    }
}

/// Softmax scale `HEAD_DIM^-1/2 = 128^-1/2`.
///
/// `128^-1/2 = 2^-3.5 = (1/√2) / 8`; dividing the correctly rounded `1/√2` by a power of two is
/// exact, so this is the correctly rounded f32 of `128^-1/2`.
pub const SOFTMAX_SCALE: f32 = std::f32::consts::FRAC_1_SQRT_2 / 8.0;

/// Task rows one CTA walks for a table of `num_rows` rows.
///
/// `4` up to [`ROWS_PER_CTA_SWITCH`] rows, [`ROWS_PER_CTA_LARGE`] above; the device task build
/// mirrors this rule.
pub fn rows_per_cta(num_rows: usize) -> usize {
    if num_rows <= ROWS_PER_CTA_SWITCH {
        ROWS_PER_CTA_SMALL
    } else {
        ROWS_PER_CTA_LARGE
    }
}

/// The CTA walk over `num_rows` task rows: `(num_full_ctas, tail_rows, grid_ctas)`.
///
/// The first `num_full_ctas` CTAs walk `rows_per_cta` rows each; the following CTAs walk
/// `tail_rows` rows each until `num_rows` is covered; `grid_ctas` CTAs walk a non-empty interval
/// (see [`cta_interval`]). Full CTAs only come in whole waves of `num_sms`, and a leftover that
/// would give tails shorter than 3 rows is instead walked in plain `rows_per_cta` chunks (the
/// per-CTA prologue eats the gain of such short tails).
///
/// Preconditions `rows_per_cta >= 1` and `num_sms >= 1`: a `0` in either is treated as `1`, so
/// the function is total and never divides by zero.
pub fn chunk_map(num_rows: usize, rows_per_cta: usize, num_sms: usize) -> (usize, usize, usize) {
    let r = rows_per_cta.max(1);
    let s = num_sms.max(1);
    let n = num_rows;
    let chunks = n.div_ceil(r);
    // A partial chunk never joins a full wave.
    let num_full = ((chunks / s) * s).min(n / r);
    let left = n - num_full * r;
    if left == 0 {
        return (num_full, 1, num_full);
    }
    let tail = left.div_ceil(s);
    if tail < 3 {
        (0, r, chunks)
    } else {
        (num_full, tail, num_full + left.div_ceil(tail))
    }
}

/// Task-row interval CTA `cta` walks, given `walk = chunk_map(num_rows, rows_per_cta, _)`.
///
/// CTA `b < num_full` walks `[b·r, min(b·r + r, n))`; a later CTA walks
/// `[lo, min(lo + tail, n))` with `lo = num_full·r + (b − num_full)·tail`. CTAs at or past
/// `grid_ctas` get an empty interval (`n..n`), because the host launches an upper bound.
/// `rows_per_cta == 0` is treated as `1`, as in [`chunk_map`]. Intervals are clamped to
/// `[0, n]` and the arithmetic saturates, so an inconsistent `walk` gives wrong but in-range
/// intervals, never a panic.
pub fn cta_interval(
    cta: usize,
    num_rows: usize,
    rows_per_cta: usize,
    walk: (usize, usize, usize),
) -> Range<usize> {
    let (num_full, tail, grid_ctas) = walk;
    let n = num_rows;
    if cta >= grid_ctas {
        return n..n;
    }
    let (lo, len) = if cta < num_full {
        let r = rows_per_cta.max(1);
        (cta.saturating_mul(r), r)
    } else {
        let lo = num_full
            .saturating_mul(rows_per_cta.max(1))
            .saturating_add((cta - num_full).saturating_mul(tail));
        (lo, tail)
    };
    let lo = lo.min(n);
    lo..lo.saturating_add(len).min(n)
}

/// Grid size the main kernel is launched with for a task table of `capacity` rows.
///
/// `max(min(capacity, 2400)/4, capacity/64) + num_sms`: `chunk_map(n, r, s).2 <= n/r + s` for
/// every `n`, so this bounds the walk of every task count up to `capacity` in both the small and
/// the large regime. `num_sms == 0` is treated as `1`, as in [`chunk_map`]; the sum saturates.
pub fn grid_launch_bound(capacity: usize, num_sms: usize) -> usize {
    let small = capacity.min(ROWS_PER_CTA_SWITCH) / ROWS_PER_CTA_SMALL;
    let large = capacity / ROWS_PER_CTA_LARGE;
    small.max(large).saturating_add(num_sms.max(1))
}
