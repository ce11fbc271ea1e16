//! `Schedule`: the forward-derived metadata the backward reads (seed-design §2.1).
