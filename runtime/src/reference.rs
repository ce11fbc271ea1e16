//! f32 CPU reference of MSA forward and backward (seed-design §1.4).
